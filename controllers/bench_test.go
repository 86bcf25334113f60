package controllers

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The benchmarks run a whole scenario once, whatever b.N is (run them with
// -benchtime=1x), and report their figures with ReportMetric. Tune them with
// the environment:
//
//	SPILLWAY_BENCH_POLICIES  policies of BenchmarkScale (default 1000)
//	SPILLWAY_BENCH_DURATION  how long BenchmarkScale measures (default 60s)
//	SPILLWAY_BENCH_INTERVAL  the evaluation interval (default 1s)
//	SPILLWAY_BENCH_TRIALS    trials of BenchmarkFailureToOpen (default 100)

func benchEnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func benchEnvDuration(name string, def time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// startBenchManager starts a manager as cmd/manager does by default: the
// flags' API rate limits (100 QPS, burst 200) and the given options.
func startBenchManager(b *testing.B, ns string, rdb redis.UniversalClient, opts Options) {
	b.Helper()
	cfg := rest.CopyConfig(env.Config)
	cfg.QPS, cfg.Burst = 100, 200
	startManagerWithConfig(b, cfg, ns, rdb, opts)
}

// createPolicies creates n policies named p0000.. with testSpec, each with
// one consumer ScaledObject (min 1, max 50) over a Deployment of 2 replicas
// when consumers is set, 16 at a time.
func createPolicies(b *testing.B, ns string, n int, consumers bool) []string {
	b.Helper()
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("p%04d", i)
	}
	ctx := context.Background()
	sem := make(chan struct{}, 16)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, name := range names {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			spec := testSpec()
			var objs []client.Object
			if consumers {
				spec = testSpec(name)
				objs = append(objs, deploymentObj(ns, name, 2), scaledObjectObj(ns, name, deployment(name), ptr.To[int32](1), ptr.To[int32](50)))
			}
			objs = append(objs, &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec})
			for _, o := range objs {
				if err := env.Client.Create(ctx, o); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatalf("failed to create the policies: %v", err)
	}
	return names
}

// stateKeys are the Redis state hashes of the named policies.
func stateKeys(ns string, names []string) []string {
	keys := make([]string, len(names))
	for i, n := range names {
		keys[i] = protocol.KeysFor(protocol.Dependency{Namespace: ns, Name: n}).State
	}
	return keys
}

// updatedAt reads every policy's last publication time (0 when none yet)
// and Redis's time, in one pipeline.
func updatedAt(ctx context.Context, rdb *redis.Client, keys []string) ([]int64, int64, error) {
	pipe := rdb.Pipeline()
	cmds := make([]*redis.StringCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.HGet(ctx, k, "updated_at_ms")
	}
	tm := pipe.Time(ctx)
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return nil, 0, err
	}
	out := make([]int64, len(keys))
	for i, c := range cmds {
		out[i], _ = strconv.ParseInt(c.Val(), 10, 64)
	}
	return out, tm.Val().UnixMilli(), nil
}

// processCPU is this process's user and system CPU time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// childCPU is the CPU time of this process's running children by command
// name (kube-apiserver, etcd, redis-server), read from /proc on Linux.
func childCPU() map[string]time.Duration {
	out := map[string]time.Duration{}
	self := strconv.Itoa(os.Getpid())
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range stats {
		data, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		s := string(data)
		open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || closing < open {
			continue
		}
		fields := strings.Fields(s[closing+1:])
		// After the command: state, ppid, ... utime is field 14 and stime 15
		// of stat, i.e. indexes 11 and 12 here, in clock ticks of 10ms.
		if len(fields) < 13 || fields[1] != self {
			continue
		}
		utime, _ := strconv.ParseInt(fields[11], 10, 64)
		stime, _ := strconv.ParseInt(fields[12], 10, 64)
		out[s[open+1:closing]] += time.Duration(utime+stime) * 10 * time.Millisecond
	}
	return out
}

// rssBytes is this process's resident set size, from /proc on Linux.
func rssBytes() uint64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// BenchmarkScale runs 1,000 policies, each with a consumer ScaledObject, in
// one envtest with one Redis, and measures how stale each policy's last
// evaluation gets (Redis time minus its last publication, sampled every
// 100ms), and the manager's CPU and memory. A tenth of the policies go through
// an outage meanwhile, so transitions, Events, status writes and pinning are
// part of the load. It fails if any policy waits more than two intervals.
func BenchmarkScale(b *testing.B) {
	n := benchEnvInt("SPILLWAY_BENCH_POLICIES", 1000)
	duration := benchEnvDuration("SPILLWAY_BENCH_DURATION", time.Minute)
	iv := benchEnvDuration("SPILLWAY_BENCH_INTERVAL", time.Second)
	g := NewWithT(b)
	ctx := context.Background()
	ns := newNamespace(b)
	srv := redistest.Start(b)
	rdb := srv.Client()
	startBenchManager(b, ns, managerRedis(srv), Options{EvaluationInterval: iv})

	start := time.Now()
	names := createPolicies(b, ns, n, true)
	b.Logf("Created %d policies, ScaledObjects and Deployments in %v", n, time.Since(start))
	keys := stateKeys(ns, names)
	g.Eventually(func(g Gomega) int {
		at, _, err := updatedAt(ctx, rdb, keys)
		g.Expect(err).NotTo(HaveOccurred())
		return slices.Index(at, 0)
	}).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Equal(-1))
	b.Logf("Every policy published %v after the first was created", time.Since(start))
	time.Sleep(2 * iv) // let the first bounding writes settle

	var (
		mu        sync.Mutex
		staleness []time.Duration
		worst     time.Duration
		peakHeap  uint64
		peakRSS   uint64
	)
	cpu0, children0 := processCPU(), childCPU()
	measureStart := time.Now()
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
			}
			at, now, err := updatedAt(sampleCtx, rdb, keys)
			if err != nil {
				continue
			}
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			mu.Lock()
			for _, u := range at {
				d := time.Duration(now-u) * time.Millisecond
				staleness = append(staleness, d)
				worst = max(worst, d)
			}
			peakHeap = max(peakHeap, ms.HeapInuse)
			peakRSS = max(peakRSS, rssBytes())
			mu.Unlock()
		}
	}()

	// A tenth of the dependencies fail: their breakers open, half-open and
	// stay there (no probes), their consumers' minimums are pinned.
	time.Sleep(duration / 6)
	failing := 0
	for i := 0; i < n; i += 10 {
		w := newWorker(b, srv, ns, names[i])
		w.report(g, minCalls, protocol.Failure)
		failing++
	}
	burst := time.Now()
	var pinnedAfter time.Duration
	for pinnedAfter == 0 && time.Since(measureStart) < duration {
		var list kedav1alpha1.ScaledObjectList
		if err := env.Client.List(ctx, &list, client.InNamespace(ns)); err == nil {
			pinned := 0
			for _, so := range list.Items {
				if _, ok := so.Annotations[AnnotationPinnedMinReplicas]; ok {
					pinned++
				}
			}
			if pinned == failing {
				pinnedAfter = time.Since(burst)
			}
		}
		time.Sleep(500 * time.Millisecond)
	}
	time.Sleep(duration - time.Since(measureStart))
	stopSampling()
	<-sampled
	elapsed := time.Since(measureStart)
	cpu := processCPU() - cpu0
	children := childCPU()

	states := map[string]int{}
	for _, k := range keys {
		states[rdb.HGet(ctx, k, "state").Val()]++
	}
	b.Logf("States at the end: %v; the %d failing policies' consumers were all pinned %v after the failures were written", states, failing, pinnedAfter)
	if states[string(wire.Open)]+states[string(wire.HalfOpen)] != failing || pinnedAfter == 0 {
		b.Errorf("want %d policies Open or HalfOpen with their consumers pinned, got %v (pinned after %v)", failing, states, pinnedAfter)
	}

	slices.Sort(staleness)
	p50, p99 := percentile(staleness, 0.5), percentile(staleness, 0.99)
	b.ReportMetric(float64(n), "policies")
	b.ReportMetric(p50.Seconds(), "staleness-p50-s")
	b.ReportMetric(p99.Seconds(), "staleness-p99-s")
	b.ReportMetric(worst.Seconds(), "staleness-max-s")
	b.ReportMetric(cpu.Seconds()/elapsed.Seconds(), "cpu-cores")
	b.ReportMetric(float64(peakHeap)/(1<<20), "heap-MiB")
	b.ReportMetric(float64(peakRSS)/(1<<20), "rss-MiB")
	for name, t := range children {
		b.Logf("Child %s: %.3f CPU cores", name, (t-children0[name]).Seconds()/elapsed.Seconds())
	}
	b.Logf("%d policies over %v at a %v interval: staleness p50 %v, p99 %v, max %v; manager process %.3f CPU cores, peak heap in use %.1f MiB, peak RSS %.1f MiB",
		n, elapsed.Round(time.Second), iv, p50, p99, worst, cpu.Seconds()/elapsed.Seconds(), float64(peakHeap)/(1<<20), float64(peakRSS)/(1<<20))
	if worst > 2*iv {
		b.Errorf("a policy waited %v for its evaluation, more than two intervals (%v)", worst, 2*iv)
	}
}

// BenchmarkFailureToOpen measures the time from a failure burst written to
// Redis through the worker protocol (the last Release returned) to the limit
// 0 published in Redis, over 100 trials, each on its own policy among 100.
func BenchmarkFailureToOpen(b *testing.B) {
	trials := benchEnvInt("SPILLWAY_BENCH_TRIALS", 100)
	iv := benchEnvDuration("SPILLWAY_BENCH_INTERVAL", time.Second)
	g := NewWithT(b)
	ctx := context.Background()
	ns := newNamespace(b)
	srv := redistest.Start(b)
	rdb := srv.Client()
	startBenchManager(b, ns, managerRedis(srv), Options{EvaluationInterval: iv})
	names := createPolicies(b, ns, trials, false)
	keys := stateKeys(ns, names)
	g.Eventually(func(g Gomega) int {
		at, _, err := updatedAt(ctx, rdb, keys)
		g.Expect(err).NotTo(HaveOccurred())
		return slices.Index(at, 0)
	}).WithTimeout(2 * time.Minute).WithPolling(100 * time.Millisecond).Should(Equal(-1))

	latencies := make([]time.Duration, 0, trials)
	for i, name := range names {
		// Start each burst at a random phase of the evaluation cycle.
		time.Sleep(time.Duration(rand.Int64N(int64(iv))))
		// Exactly minCalls failures: the breaker cannot open before the
		// last one is written.
		w := newWorker(b, srv, ns, name)
		g.Expect(w.report(g, minCalls, protocol.Failure)).To(Equal(minCalls))
		written := time.Now()
		for {
			limit, err := rdb.HGet(ctx, keys[i], "limit").Result()
			g.Expect(err).NotTo(HaveOccurred())
			if limit == "0" {
				break
			}
			if time.Since(written) > time.Minute {
				b.Fatalf("policy %s did not open within a minute", name)
			}
			time.Sleep(time.Millisecond)
		}
		latencies = append(latencies, time.Since(written))
	}
	slices.Sort(latencies)
	p50, p99 := percentile(latencies, 0.5), percentile(latencies, 0.99)
	b.ReportMetric(p50.Seconds(), "p50-s")
	b.ReportMetric(p99.Seconds(), "p99-s")
	b.ReportMetric(latencies[len(latencies)-1].Seconds(), "max-s")
	b.Logf("Failure burst to limit 0 over %d trials at a %v interval: median %v, p99 %v, max %v",
		trials, iv, p50, p99, latencies[len(latencies)-1])
}
