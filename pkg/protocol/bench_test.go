package protocol_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// The benchmarks run 64 goroutines over one client (b.SetParallelism makes
// parallelism × GOMAXPROCS goroutines: 32 × 2 on a 2-core machine) against
// one dependency, so every script runs on the one Redis core that owns the
// dependency's hash slot.
//
// Compare per round trip: one op of BenchmarkAcquireRelease is an Acquire and
// a Release (two EVALSHAs that do the work), one op of BenchmarkNoopEvalSha is
// two EVALSHAs of a script that returns at once, over a client built the same
// way. Both report pairs/s (ops/s); their ratio is the share of the plain
// round-trip rate that the protocol's work leaves. BenchmarkAcquireReleaseVsNoop
// measures that ratio round by round in one run.
//
//	go test -run '^$' -bench . -benchmem -count=1 ./pkg/protocol/
const benchGoroutines = 64

const benchPoolSize = 2 * benchGoroutines

func benchParallelism() int { return max(1, benchGoroutines/runtime.GOMAXPROCS(0)) }

// benchStandalone returns a client of the shared standalone server, and an
// admin client of the server that owns dep (the same server).
func benchStandalone(b *testing.B) (rdb redis.UniversalClient, owner func(protocol.Dependency) *redis.Client) {
	srv, _ := sharedStandalone(b)
	admin := srv.Client()
	return srv.Client(func(o *redis.Options) { o.PoolSize = benchPoolSize }),
		func(protocol.Dependency) *redis.Client { return admin }
}

// benchCluster returns a client of the shared cluster, and an admin client of
// the master that owns dep's slot.
func benchCluster(b *testing.B) (rdb redis.UniversalClient, owner func(protocol.Dependency) *redis.Client) {
	cl, _ := sharedCluster(b)
	return cl.Client(func(o *redis.ClusterOptions) { o.PoolSize = benchPoolSize }),
		func(d protocol.Dependency) *redis.Client {
			nodes := cl.Nodes()
			return nodes[keySlot(protocol.KeysFor(d).State)*len(nodes)/16384].Client()
		}
}

// redisCPU is the CPU time the server has used, user plus system.
func redisCPU(b *testing.B, admin *redis.Client) time.Duration {
	info, err := admin.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// reportThroughput reports ops/s (an op being a unit, e.g. "pair"), the
// server's CPU per op and the share of one core it used, and the ops/s one
// fully busy core would serve at that cost: the ceiling of one dependency
// (one slot, one core).
func reportThroughput(b *testing.B, unit string, cpu time.Duration) {
	secs := b.Elapsed().Seconds()
	b.ReportMetric(float64(b.N)/secs, unit+"s/s")
	perOp := cpu.Seconds() / float64(b.N)
	b.ReportMetric(perOp*1e6, "redis-µs/"+unit)
	b.ReportMetric(100*cpu.Seconds()/secs, "redis-cpu%")
	if perOp > 0 {
		b.ReportMetric(1/perOp, "ceiling-"+unit+"s/s")
	}
}

// benchDep publishes a policy whose limit no run reaches, and loads the
// scripts.
func benchDep(b *testing.B, rdb redis.UniversalClient) *protocol.Client {
	c := newClient(b, rdb)
	ctx := context.Background()
	if _, err := c.Publish(ctx, policy(1_000_000_000)); err != nil {
		b.Fatal(err)
	}
	a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: "warm-up", TTL: time.Minute})
	if err != nil || a.Code != protocol.Admitted {
		b.Fatalf("warm-up acquire: %+v, %v", a, err)
	}
	if _, err := c.Release(ctx, a.Member, a.Epoch, protocol.Success, 1); err != nil {
		b.Fatal(err)
	}
	if err := c.Noop(ctx); err != nil {
		b.Fatal(err)
	}
	return c
}

// acquireRelease is one op of the acquire benchmarks: an Acquire with a lease
// id made the way the guard makes them, and its Release.
func acquireRelease(ctx context.Context, c *protocol.Client) error {
	a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: protocol.NewLeaseID(), TTL: time.Minute})
	if err != nil || a.Code != protocol.Admitted {
		return fmt.Errorf("acquire = %+v, %w", a, err)
	}
	if _, err := c.Release(ctx, a.Member, 0, protocol.Success, 1); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

// noopPair is one op of the baseline: two EVALSHAs of the no-op script.
func noopPair(ctx context.Context, c *protocol.Client) error {
	if err := c.Noop(ctx); err != nil {
		return err
	}
	return c.Noop(ctx)
}

func runParallel(b *testing.B, unit string, rdb redis.UniversalClient, owner func(protocol.Dependency) *redis.Client,
	op func(context.Context, *protocol.Client) error, setup ...func(*protocol.Client)) {
	c := benchDep(b, rdb)
	for _, f := range setup {
		f(c)
	}
	admin := owner(c.Dependency())
	b.SetParallelism(benchParallelism())
	cpu0 := redisCPU(b, admin)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			if err := op(ctx, c); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	reportThroughput(b, unit, redisCPU(b, admin)-cpu0)
}

// BenchmarkAcquireRelease: one op = Acquire + Release on one standalone Redis.
func BenchmarkAcquireRelease(b *testing.B) {
	rdb, owner := benchStandalone(b)
	runParallel(b, "pair", rdb, owner, acquireRelease)
}

// BenchmarkNoopEvalSha: one op = two EVALSHAs of the no-op script, the
// round-trip baseline of BenchmarkAcquireRelease.
func BenchmarkNoopEvalSha(b *testing.B) {
	rdb, owner := benchStandalone(b)
	runParallel(b, "pair", rdb, owner, noopPair)
}

// BenchmarkAcquireReleaseVsNoop is the comparison itself, made in one run:
// it alternates one second of acquire+release pairs with one second of no-op
// pairs, benchRounds times, over the same client, and reports the median of
// the per-round ratios (pairs/s over no-op pairs/s) with the lowest and the
// highest. Alternating puts both sides of each ratio in the same few seconds
// of a noisy machine; the median keeps one disturbed second from deciding.
//
// Each round also runs a second of "floor" pairs: two scripts that take
// acquire's and release's keys and arguments and return replies of the same
// shape, but make no redis.call. floor-ratio-median is what any protocol with
// these round trips could reach at best on this machine.
func BenchmarkAcquireReleaseVsNoop(b *testing.B) {
	rdb, owner := benchStandalone(b)
	c := benchDep(b, rdb)
	admin := owner(c.Dependency())
	floor := floorPair(rdb, c.Keys())
	if err := floor(context.Background(), c); err != nil {
		b.Fatal(err)
	}
	var ratios, floors, pairs, noops, cpuPerPair []float64
	for range b.N {
		for range benchRounds {
			p, cpu := timedOps(b, c, admin, acquireRelease)
			f, _ := timedOps(b, c, admin, floor)
			n, _ := timedOps(b, c, admin, noopPair)
			ratios = append(ratios, p/n)
			floors = append(floors, f/n)
			pairs = append(pairs, p)
			noops = append(noops, n)
			cpuPerPair = append(cpuPerPair, cpu.Seconds()/p*1e6)
		}
	}
	b.ReportMetric(median(ratios), "ratio-median")
	b.ReportMetric(slices.Min(ratios), "ratio-min")
	b.ReportMetric(slices.Max(ratios), "ratio-max")
	b.ReportMetric(median(floors), "floor-ratio-median")
	b.ReportMetric(median(pairs), "pairs/s")
	b.ReportMetric(median(noops), "noop-pairs/s")
	b.ReportMetric(median(cpuPerPair), "redis-µs/pair")
}

var (
	floorAcquire = redis.NewScript("return {0, 1, 1000000000, 'Closed', 1764547200000}")
	floorRelease = redis.NewScript("return 1")
)

// floorPair is acquire+release without the work: same keys, arguments and
// reply shapes, and the client does what Acquire and Release do with them.
func floorPair(rdb redis.UniversalClient, k protocol.Keys) func(context.Context, *protocol.Client) error {
	acquireKeys := []string{k.State, k.Leases, k.GCRA, k.Probes, k.Wants, k.Callers}
	releaseKeys := []string{k.Leases, k.Stats}
	caller := protocol.NewLeaseID()
	return func(ctx context.Context, _ *protocol.Client) error {
		id := protocol.NewLeaseID()
		if err := floorAcquire.Run(ctx, rdb, acquireKeys, id, int64(60000), int64(0), "", "", caller).Err(); err != nil {
			return err
		}
		return floorRelease.Run(ctx, rdb, releaseKeys, id, "s", 1).Err()
	}
}

const benchRounds = 7

// timedOps runs op on benchGoroutines goroutines for one second and returns
// ops per second and the server CPU they used per second.
func timedOps(b *testing.B, c *protocol.Client, admin *redis.Client, op func(context.Context, *protocol.Client) error) (float64, time.Duration) {
	const d = time.Second
	var n atomic.Int64
	var wg sync.WaitGroup
	cpu0 := redisCPU(b, admin)
	start := time.Now()
	stop := start.Add(d)
	for range benchGoroutines {
		wg.Go(func() {
			ctx := context.Background()
			for time.Now().Before(stop) {
				if err := op(ctx, c); err != nil {
					b.Error(err)
					return
				}
				n.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	return float64(n.Load()) / elapsed.Seconds(), time.Duration(float64(redisCPU(b, admin)-cpu0) / elapsed.Seconds())
}

func median(x []float64) float64 {
	s := slices.Sorted(slices.Values(x))
	return s[len(s)/2]
}

// BenchmarkRetryBudget: one op = one RetryBudget decision under the default
// budget window (1 minute) with counters in every second of the retention:
// the cost a failing call adds to its acquire and release.
func BenchmarkRetryBudget(b *testing.B) {
	rdb, owner := benchStandalone(b)
	runParallel(b, "decision", rdb, owner, func(ctx context.Context, c *protocol.Client) error {
		_, err := c.RetryBudget(ctx)
		return err
	}, busyStats(b, rdb))
}

// BenchmarkReadWindow: one op = the controller's read of a 30 s breaker
// window (the default) with counters in every second of the retention: its
// cost per policy and evaluation.
func BenchmarkReadWindow(b *testing.B) {
	rdb, owner := benchStandalone(b)
	runParallel(b, "read", rdb, owner, func(ctx context.Context, c *protocol.Client) error {
		_, _, _, err := c.ReadWindow(ctx, 30*time.Second, time.Time{})
		return err
	}, busyStats(b, rdb))
}

// busyStats fills the stats hash the way a busy dependency does: successes,
// failures, first attempts and retries, and granted retries in each of the
// last 70 seconds.
func busyStats(b *testing.B, rdb redis.UniversalClient) func(*protocol.Client) {
	return func(c *protocol.Client) {
		now := redisNow(b, rdb).Unix()
		counts := map[int64]map[string]int64{}
		for s := int64(-70); s <= 0; s++ {
			counts[s] = map[string]int64{"s": 900, "f": 100, "a1": 950, "a2": 50, "g": 50}
		}
		hsetSeconds(b, rdb, c, now, counts)
		// The warm-up release made the hash, so it says there were no
		// counters before (born): these were written by hand.
		if err := rdb.HDel(context.Background(), c.Keys().Stats, "born").Err(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAcquireReleaseCluster: one op = Acquire + Release for one
// dependency on a 3-master cluster. One dependency is one hash slot, so only
// one master works: the single-slot ceiling.
func BenchmarkAcquireReleaseCluster(b *testing.B) {
	rdb, owner := benchCluster(b)
	runParallel(b, "pair", rdb, owner, acquireRelease)
}

// BenchmarkPairVsPreviousVersion: what this protocol version's
// acquire+release pair costs against the previous version's (its real
// scripts, read from the commit its pin names), in interleaved rounds of one
// second each on one server, as BenchmarkAcquireReleaseVsNoop: the ratio of
// pairs per second (this version over the previous one) and each one's Redis
// CPU per pair. Version 6 adds the replication-id check (INFO replication)
// to every admission.
//
//	go test -run '^$' -bench PairVsPreviousVersion ./pkg/protocol/
func BenchmarkPairVsPreviousVersion(b *testing.B) {
	old := previousScripts(b)
	rdb, owner := benchStandalone(b)
	c := benchDep(b, rdb)
	admin := owner(c.Dependency())
	k := c.Keys()
	acquireKeys := []string{k.State, k.Leases, k.GCRA, k.Probes, k.Wants, k.Callers}
	releaseKeys := []string{k.Leases, k.Stats, k.State, k.Probes, k.Calls}
	previous := func(ctx context.Context, _ *protocol.Client) error {
		id := protocol.NewLeaseID()
		res, err := old["acquire"].Run(ctx, rdb, acquireKeys, id, int64(60000), int64(0)).Slice()
		if err != nil {
			return err
		}
		if code, _ := res[0].(int64); code != 0 {
			return fmt.Errorf("previous version's acquire = %v", res)
		}
		return old["release"].Run(ctx, rdb, releaseKeys, id, "s", 1).Err()
	}
	if err := acquireRelease(context.Background(), c); err != nil {
		b.Fatal(err)
	}
	var ratios, cur, prev, curCPU, prevCPU []float64
	for range b.N {
		for range benchRounds {
			p, cpuP := timedOps(b, c, admin, acquireRelease)
			q, cpuQ := timedOps(b, c, admin, previous)
			ratios = append(ratios, p/q)
			cur, prev = append(cur, p), append(prev, q)
			curCPU = append(curCPU, cpuP.Seconds()/p*1e6)
			prevCPU = append(prevCPU, cpuQ.Seconds()/q*1e6)
		}
	}
	b.ReportMetric(median(ratios), "ratio-median")
	b.ReportMetric(slices.Min(ratios), "ratio-min")
	b.ReportMetric(slices.Max(ratios), "ratio-max")
	b.ReportMetric(median(cur), "pairs/s")
	b.ReportMetric(median(prev), "previous-pairs/s")
	b.ReportMetric(median(curCPU), "redis-µs/pair")
	b.ReportMetric(median(prevCPU), "previous-redis-µs/pair")
}
