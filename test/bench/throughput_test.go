package bench

// The fleet throughput harness: tpProcs real worker processes (this test
// binary re-executed, TestThroughputWorker playing the worker) call one
// dependency through pkg/guard against one real redis-server, in one of three
// modes, side by side in one run:
//
//   - bare: the dependency's function called directly, no guard: the floor
//     that the harness itself costs;
//   - percall: guard.Do in per-call mode, an acquire and a release round trip
//     per call;
//   - batch: guard.Do in batch mode, a call taking a slot from the process's
//     local pool of fleet slots.
//
// The dependency is a function that counts the calls in flight across every
// process in shared memory (throughput_shared_test.go) and records the peak,
// so the cap is checked where it matters, at the dependency, whatever the
// mode. The fleet makes a fixed number of calls (the benchmark's b.N) or
// runs for a fixed time (the test), taking each call from a quota in the
// same shared memory, so every process works until the fleet is done.

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

const (
	tpRoleEnv       = "SPILLWAY_TP_ROLE"
	tpRedisEnv      = "SPILLWAY_TP_REDIS"
	tpSharedEnv     = "SPILLWAY_TP_SHARED"
	tpModeEnv       = "SPILLWAY_TP_MODE"
	tpGoroutinesEnv = "SPILLWAY_TP_GOROUTINES"
	tpHoldEnv       = "SPILLWAY_TP_HOLD"
	tpLimitEnv      = "SPILLWAY_TP_LIMIT"
	tpYieldEnv      = "SPILLWAY_TP_YIELD"
	// tpProfileEnv, when set to a directory, makes every worker write a
	// CPU profile of its timed run there (worker-<mode>-<pid>.pprof), to
	// see where a mode's time goes in the worker.
	tpProfileEnv  = "SPILLWAY_BENCH_CPUPROFILE"
	tpReadyLine   = "tp-ready"
	tpGoLine      = "go"
	tpStatsPrefix = "tp-stats: "

	// tpModesEnv selects the modes BenchmarkFleetThroughput measures, comma
	// separated, in that order.
	tpModesEnv = "SPILLWAY_BENCH_MODES"

	tpDependency = "bench/fleet-api"
)

// The modes a fleet can run in.
const (
	tpBare    = "bare"
	tpPerCall = "percall"
	tpBatch   = "batch"
)

// tpDefaultModes are the modes measured when SPILLWAY_BENCH_MODES is unset.
var tpDefaultModes = []string{tpBare, tpPerCall, tpBatch}

// tpConfig is one fleet.
type tpConfig struct {
	procs, goroutines int
	// limit is the published concurrency limit.
	limit int64
	// hold is how long the dependency takes per call; 0 returns at once.
	hold time.Duration
	// yield, for a call that returns at once, yields the processor once
	// inside the call (runtime.Gosched, as a call that waits on nothing but
	// a non-blocking I/O would): without a guard, the calls of every
	// goroutine then overlap at the dependency, far above a limit below the
	// fleet's demand. Without it, an instant call is in flight for so short
	// a time that two cores hold at most a few at once, and a cap check on
	// such a fleet cannot fail.
	yield bool
}

// tpWorkerStats is what one worker process counted over the timed run.
type tpWorkerStats struct {
	// Calls are the calls this process made (guard.Do returned nil, or a
	// bare call).
	Calls int64 `json:"calls"`
	// Refused counts refusals and failures by their reason.
	Refused map[string]int64 `json:"refused"`
	// CPU is the process's user plus system CPU time over the run, in ns.
	CPU int64 `json:"cpuNs"`
}

// tpResult is one run of a fleet.
type tpResult struct {
	mode    string
	elapsed time.Duration
	// calls are the calls the dependency saw; workerCalls the calls the
	// workers counted as made. They must agree.
	calls, workerCalls int64
	// peak is the most calls in flight at the dependency at once;
	// overLimit the calls that found more than the limit in flight.
	peak, overLimit int64
	// busy is the time calls spent in the dependency, summed (measured
	// only for calls that take time).
	busy       time.Duration
	refused    map[string]int64
	workerCPU  time.Duration
	tpRedisCPU time.Duration
	// commands are the commands the server ran over the run, by name
	// (INFO commandstats), so a figure per call says how many round trips
	// a call cost and which ones take the server's time.
	commands map[string]tpCommandStat
}

func (r tpResult) callsPerSecond() float64 { return float64(r.calls) / r.elapsed.Seconds() }

// meanInFlight is the calls in flight at the dependency on average over the
// run: against the limit, how much of the fleet's slots did work.
func (r tpResult) meanInFlight() float64 { return r.busy.Seconds() / r.elapsed.Seconds() }

// perCall divides d over the calls, in µs.
func (r tpResult) perCall(d time.Duration) float64 {
	if r.calls == 0 {
		return 0
	}
	return float64(d.Nanoseconds()) / 1e3 / float64(r.calls)
}

func (r tpResult) String() string {
	names := slices.SortedFunc(maps.Keys(r.commands), func(a, b string) int {
		return cmp.Compare(r.commands[b].usec, r.commands[a].usec)
	})
	var commands strings.Builder
	for _, name := range names[:min(len(names), 5)] { // the five the server spent most on
		c := r.commands[name]
		fmt.Fprintf(&commands, " %s %d (%.3f/call, %.2f µs/call)", name, c.calls,
			float64(c.calls)/float64(max(r.calls, 1)), r.perCall(time.Duration(c.usec)*time.Microsecond))
	}
	return fmt.Sprintf("%s: %d calls in %v (%.0f calls/s), worker CPU %.2f µs/call, Redis CPU %.2f µs/call, peak in flight %d (mean %.1f), over the limit %d, refused %v; Redis commands (a script's own counted too):%s",
		r.mode, r.calls, r.elapsed.Round(time.Millisecond), r.callsPerSecond(), r.perCall(r.workerCPU), r.perCall(r.tpRedisCPU),
		r.peak, r.meanInFlight(), r.overLimit, r.refused, commands.String())
}

// tpOptions are the guard's options in mode. Calls wait for a slot, as a
// worker with more goroutines than its share does, rather than being refused.
func tpOptions(mode string) (guard.Options, error) {
	switch mode {
	case tpPerCall:
		return guard.Options{WaitForSlot: true}, nil
	case tpBatch:
		return guard.Options{WaitForSlot: true, Batch: guard.BatchOptions{Enabled: true}}, nil
	}
	return guard.Options{}, fmt.Errorf("no guard in mode %q", mode)
}

// tpPolicy is what the controller would publish: cfg's limit, Closed, no rate
// limit.
func tpPolicy(limit int64) protocol.Published {
	return protocol.Published{
		State: wire.Closed, Limit: limit, Capacity: limit, Epoch: 1,
		Backoff:        retry.Backoff{Base: 100 * time.Millisecond, Max: time.Second, Jitter: retry.JitterFull},
		Budget:         retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute},
		BreakerWindow:  30 * time.Second,
		HalfOpenProbes: 1,
	}
}

// TestThroughputWorker is not a test: it is the body of the worker processes
// the throughput harness starts. It skips unless tpRoleEnv is set.
func TestThroughputWorker(t *testing.T) {
	if os.Getenv(tpRoleEnv) == "" {
		t.Skip("run by the throughput harness as a worker process")
	}
	if err := tpWorker(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "Throughput worker failed:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// tpWorker builds its guard, says it is ready, waits for the parent's go,
// then calls until the fleet's quota is spent or stdin closes, and prints
// what it counted.
func tpWorker(stdin io.Reader, stdout io.Writer) error {
	mode := os.Getenv(tpModeEnv)
	n, err := strconv.Atoi(os.Getenv(tpGoroutinesEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", tpGoroutinesEnv, err)
	}
	hold, err := time.ParseDuration(os.Getenv(tpHoldEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", tpHoldEnv, err)
	}
	limit, err := strconv.ParseInt(os.Getenv(tpLimitEnv), 10, 64)
	if err != nil {
		return fmt.Errorf("%s: %w", tpLimitEnv, err)
	}
	yield := os.Getenv(tpYieldEnv) == "1"
	shared, err := tpOpenShared(os.Getenv(tpSharedEnv))
	if err != nil {
		return err
	}
	defer shared.close()

	// The dependency: every call counted in flight across the fleet, and
	// against the limit only when a guard keeps one.
	if mode == tpBare {
		limit = 0
	}
	call := func(context.Context) error {
		shared.enter(limit)
		if yield {
			runtime.Gosched()
		}
		if hold > 0 {
			start := time.Now()
			time.Sleep(hold)
			shared.busy(time.Since(start))
		}
		shared.leave()
		return nil
	}
	var g *guard.Guard
	if mode != tpBare {
		opts, err := tpOptions(mode)
		if err != nil {
			return err
		}
		rdb := redis.NewClient(&redis.Options{Addr: os.Getenv(tpRedisEnv), ContextTimeoutEnabled: true})
		defer func() { _ = rdb.Close() }()
		if g, err = guard.New(rdb, tpDependency, opts); err != nil {
			return err
		}
	}

	in := bufio.NewReader(stdin)
	fmt.Fprintln(stdout, tpReadyLine)
	if line, err := in.ReadString('\n'); strings.TrimSpace(line) != tpGoLine {
		return fmt.Errorf("waiting for %q: got %q, %w", tpGoLine, line, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, in)
		cancel()
	}()

	if dir := os.Getenv(tpProfileEnv); dir != "" {
		stop, err := tpProfile(dir, mode)
		if err != nil {
			return err
		}
		defer stop()
	}
	cpu0 := tpProcessCPU()
	var mu sync.Mutex
	total := tpWorkerStats{Refused: map[string]int64{}}
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			var calls int64
			refused := map[string]int64{}
			for ctx.Err() == nil && shared.take() {
				var err error
				if g == nil {
					err = call(ctx)
				} else {
					err = g.Do(ctx, guard.Job{}, call)
				}
				if err == nil {
					calls++
					continue
				}
				shared.giveBack()
				refused[tpReason(err)]++
				tpSleep(ctx, time.Millisecond) // never spin on a refusal
			}
			mu.Lock()
			defer mu.Unlock()
			total.Calls += calls
			for k, v := range refused {
				total.Refused[k] += v
			}
		})
	}
	wg.Wait()
	total.CPU = int64(tpProcessCPU() - cpu0)
	if g != nil {
		g.Close()
	}
	b, err := json.Marshal(total)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s%s\n", tpStatsPrefix, b)
	return err
}

// tpProfile starts a CPU profile of this worker in dir; stop ends it.
func tpProfile(dir, mode string) (stop func(), err error) {
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("worker-%s-%d.pprof", mode, os.Getpid())))
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); _ = f.Close() }, nil
}

// tpReason names why a call was not made.
func tpReason(err error) string {
	var ge *guard.Error
	if !errors.As(err, &ge) {
		return "error: " + err.Error()
	}
	return ge.Action.String() + ": " + ge.Reason.Error()
}

// tpProcessCPU is the user plus system CPU time this process has used.
func tpProcessCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func tpSleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// tpWorkerProc is a running worker process.
type tpWorkerProc struct {
	stdin  io.WriteCloser
	stdout *bufio.Reader
}

// tpStart starts one worker process; closing its stdin stops it.
func tpStart(tb testing.TB, env []string) tpWorkerProc {
	tb.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestThroughputWorker$")
	cmd.Env = append(os.Environ(), append(env, tpRoleEnv+"=worker")...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatalf("start worker: %v", err)
	}
	tb.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return tpWorkerProc{stdin: stdin, stdout: bufio.NewReader(stdout)}
}

// tpReadLine reads one line of a worker within timeout, so a worker that hangs
// fails the run instead of holding it to the test binary's timeout.
func tpReadLine(r *bufio.Reader, timeout time.Duration) (string, error) {
	type line struct {
		s   string
		err error
	}
	ch := make(chan line, 1)
	go func() {
		s, err := r.ReadString('\n')
		ch <- line{s, err}
	}()
	select {
	case l := <-ch:
		return l.s, l.err
	case <-time.After(timeout):
		return "", fmt.Errorf("no line within %v", timeout)
	}
}

// tpRun runs cfg's fleet in mode against a fresh redis-server: calls calls in
// all, or, when calls is 0, for run. started runs just before the workers
// are told to go (a benchmark resets its timer there). The run fails the
// test if a worker does not finish within wait.
func tpRun(tb testing.TB, cfg tpConfig, mode string, calls int64, run, wait time.Duration, started func()) tpResult {
	tb.Helper()
	srv := redistest.Start(tb)
	admin := srv.Client()
	if mode != tpBare {
		d, err := protocol.ParseDependency(tpDependency)
		if err != nil {
			tb.Fatal(err)
		}
		proto, err := protocol.NewClient(admin, d)
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := proto.Publish(context.Background(), tpPolicy(cfg.limit)); err != nil {
			tb.Fatalf("publish: %v", err)
		}
	}
	path := filepath.Join(tb.TempDir(), "dependency")
	shared, err := tpCreateShared(path)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(shared.close)
	if calls == 0 {
		calls = 1 << 62 // until stopped
	}
	shared.counter(tpRemaining).Store(calls)

	env := []string{
		tpRedisEnv + "=" + srv.Addr(),
		tpSharedEnv + "=" + path,
		tpModeEnv + "=" + mode,
		tpGoroutinesEnv + "=" + strconv.Itoa(cfg.goroutines),
		tpHoldEnv + "=" + cfg.hold.String(),
		tpLimitEnv + "=" + strconv.FormatInt(cfg.limit, 10),
	}
	if cfg.yield {
		env = append(env, tpYieldEnv+"=1")
	}
	workers := make([]tpWorkerProc, cfg.procs)
	for i := range workers {
		workers[i] = tpStart(tb, env)
	}
	for i, w := range workers {
		if line, err := tpReadLine(w.stdout, 30*time.Second); strings.TrimSpace(line) != tpReadyLine {
			tb.Fatalf("worker %d did not start: %q, %v", i, line, err)
		}
	}

	redis0, commands0 := tpRedisCPU(tb, admin), tpCommandStats(tb, admin)
	if started != nil {
		started()
	}
	start := time.Now()
	for _, w := range workers {
		if _, err := io.WriteString(w.stdin, tpGoLine+"\n"); err != nil {
			tb.Fatalf("start worker: %v", err)
		}
	}
	if run > 0 {
		time.Sleep(run)
		shared.counter(tpRemaining).Store(-1 << 40) // every take fails from now on
	}
	res := tpResult{mode: mode, refused: map[string]int64{}}
	deadline := time.Now().Add(wait)
	for i, w := range workers {
		line, err := tpReadLine(w.stdout, time.Until(deadline))
		s, ok := strings.CutPrefix(line, tpStatsPrefix)
		if !ok {
			tb.Fatalf("worker %d did not finish within %v: %q, %v", i, wait, line, err)
		}
		var ws tpWorkerStats
		if err := json.Unmarshal([]byte(s), &ws); err != nil {
			tb.Fatalf("worker %d stats: %v", i, err)
		}
		res.workerCalls += ws.Calls
		res.workerCPU += time.Duration(ws.CPU)
		for k, v := range ws.Refused {
			res.refused[k] += v
		}
	}
	res.elapsed = time.Since(start)
	res.tpRedisCPU = tpRedisCPU(tb, admin) - redis0
	res.commands = tpCommandDelta(commands0, tpCommandStats(tb, admin))
	res.calls = shared.counter(tpCalls).Load()
	res.peak = shared.counter(tpPeak).Load()
	res.overLimit = shared.counter(tpOverLimit).Load()
	res.busy = time.Duration(shared.counter(tpBusy).Load())
	for _, w := range workers {
		_ = w.stdin.Close()
	}
	return res
}

// tpRedisCPU is the CPU time the server has used, user plus system (INFO cpu).
func tpRedisCPU(tb testing.TB, admin *redis.Client) time.Duration {
	tb.Helper()
	info, err := admin.Info(context.Background(), "cpu").Result()
	if err != nil {
		tb.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				tb.Fatalf("INFO cpu %s: %v", k, err)
			}
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// tpCommandStat is one command's count and time in the server (INFO
// commandstats).
type tpCommandStat struct{ calls, usec int64 }

// tpCommandStats are the server's counts and times by command (INFO
// commandstats): the round trips a mode costs, and which of them the server
// spends its time on.
func tpCommandStats(tb testing.TB, admin *redis.Client) map[string]tpCommandStat {
	tb.Helper()
	info, err := admin.Info(context.Background(), "commandstats").Result()
	if err != nil {
		tb.Fatal(err)
	}
	stats := map[string]tpCommandStat{}
	for line := range strings.Lines(info) {
		name, fields, ok := strings.Cut(strings.TrimSpace(line), ":")
		if name, ok = strings.CutPrefix(name, "cmdstat_"); !ok {
			continue
		}
		var st tpCommandStat
		for f := range strings.SplitSeq(fields, ",") {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "calls":
				st.calls, err = strconv.ParseInt(v, 10, 64)
			case "usec":
				st.usec, err = strconv.ParseInt(v, 10, 64)
			}
			if err != nil {
				tb.Fatalf("INFO commandstats %s: %v", line, err)
			}
		}
		stats[name] = st
	}
	return stats
}

// tpCommandDelta is after less before, by command, leaving out the
// harness's own INFO and the commands that did not run in between.
func tpCommandDelta(before, after map[string]tpCommandStat) map[string]tpCommandStat {
	delta := map[string]tpCommandStat{}
	for name, a := range after {
		b := before[name]
		if d := (tpCommandStat{a.calls - b.calls, a.usec - b.usec}); name != "info" && d.calls > 0 {
			delta[name] = d
		}
	}
	return delta
}

// tpModes are the modes to measure: SPILLWAY_BENCH_MODES, or the defaults.
func tpModes(tb testing.TB) []string {
	tb.Helper()
	v := os.Getenv(tpModesEnv)
	if v == "" {
		return tpDefaultModes
	}
	var modes []string
	for m := range strings.SplitSeq(v, ",") {
		switch m = strings.TrimSpace(m); m {
		case tpBare, tpPerCall, tpBatch:
			modes = append(modes, m)
		case "":
		default:
			tb.Fatalf("%s: unknown mode %q (bare, percall, batch)", tpModesEnv, m)
		}
	}
	return modes
}

const tpProcs = 8

// tpVariants are the fleets BenchmarkFleetThroughput measures: short calls
// with a limit the fleet's demand just reaches, so the figure is the guard's
// own cost (its cap check cannot fail: the limit is the whole demand);
// instant calls that yield once, with a quarter of the slots the fleet
// wants, so the cap check has a cap to hold (a bare fleet fails it:
// TestCapCheckFailsWithoutAGuard); and 1 ms calls with half the slots the
// fleet wants, so every process contends and waits for slots.
var tpVariants = []struct {
	name string
	cfg  tpConfig
}{
	{"calls=instant", tpConfig{procs: tpProcs, goroutines: 8, limit: tpProcs * 8}},
	{"calls=instant/limit<demand", tpInstantCapped},
	{"calls=1ms/limit<demand", tpConfig{procs: tpProcs, goroutines: 16, limit: tpProcs * 16 / 2, hold: time.Millisecond}},
}

// BenchmarkFleetThroughput measures 8 worker processes on one dependency, one
// redis-server, in every mode side by side (docs/benchmarks.md "Batch leases:
// fleet throughput"). One op is one call the dependency saw. It reports
// calls/s; the workers' CPU per call and, beside a bare run of the same fleet
// in the same run, the guard's overhead per call (the difference); Redis's
// CPU per call (INFO cpu, over the run); and the peak of calls in flight at
// the dependency with the limit. A guarded mode whose peak passes the limit
// fails.
//
//	go test -run '^$' -bench BenchmarkFleetThroughput -benchtime 400000x ./test/bench
func BenchmarkFleetThroughput(b *testing.B) {
	modes := tpModes(b)
	for _, v := range tpVariants {
		var bare float64 // worker CPU µs per bare call, once measured
		for _, mode := range modes {
			b.Run(v.name+"/mode="+mode, func(b *testing.B) {
				res := tpRun(b, v.cfg, mode, int64(b.N), 0, 10*time.Minute, b.ResetTimer)
				b.StopTimer()
				b.Log(res)
				if mode != tpBare && (res.peak > v.cfg.limit || res.overLimit > 0) {
					b.Errorf("the cap did not hold: %d calls in flight at the dependency, limit %d (%d calls over it)",
						res.peak, v.cfg.limit, res.overLimit)
				}
				if res.calls != res.workerCalls {
					b.Errorf("the dependency saw %d calls, the workers made %d", res.calls, res.workerCalls)
				}
				worker := res.perCall(res.workerCPU)
				b.ReportMetric(res.callsPerSecond(), "calls/s")
				b.ReportMetric(worker, "worker-µs/call")
				b.ReportMetric(res.perCall(res.tpRedisCPU), "redis-µs/call")
				b.ReportMetric(float64(res.peak), "peak-inflight")
				if v.cfg.hold > 0 {
					b.ReportMetric(res.meanInFlight(), "mean-inflight")
				}
				b.ReportMetric(float64(v.cfg.limit), "limit")
				if mode == tpBare {
					bare = worker
				} else if bare > 0 {
					b.ReportMetric(worker-bare, "overhead-µs/call")
				}
			})
		}
	}
}

// tpInstantCapped is a fleet of instant calls (each yields once) whose limit
// is a quarter of its demand: 8 processes of 8 goroutines on 16 slots.
var tpInstantCapped = tpConfig{procs: tpProcs, goroutines: 8, limit: tpProcs * 8 / 4, yield: true}

// TestCapCheckFailsWithoutAGuard shows that the cap check of
// BenchmarkFleetThroughput's instant fleet can fail: run bare (no guard),
// the fleet of tpInstantCapped has more calls in flight at the dependency
// than its limit, which the check refuses; guarded (batch mode, the
// cheapest), it holds the cap.
func TestCapCheckFailsWithoutAGuard(t *testing.T) {
	for _, mode := range []string{tpBare, tpBatch} {
		t.Run(mode, func(t *testing.T) {
			res := tpRun(t, tpInstantCapped, mode, 0, time.Second, 20*time.Second, nil)
			t.Log(res)
			if res.calls == 0 {
				t.Fatalf("no call reached the dependency")
			}
			over := res.peak > tpInstantCapped.limit || res.overLimit > 0
			switch {
			case mode == tpBare && !over:
				t.Errorf("bare: peak %d in flight at limit %d: the cap check could not fail", res.peak, tpInstantCapped.limit)
			case mode != tpBare && over:
				t.Errorf("%s: %d calls in flight at the dependency, limit %d (%d calls over it)", mode, res.peak, tpInstantCapped.limit, res.overLimit)
			}
		})
	}
}

// TestFleetHoldsTheCapInEveryMode runs the benchmark's harness briefly in
// every guarded mode, 4 processes of 8 goroutines on 8 slots with 2 ms calls,
// and requires calls to have been made and never more calls in flight at the
// dependency than the limit.
func TestFleetHoldsTheCapInEveryMode(t *testing.T) {
	cfg := tpConfig{procs: 4, goroutines: 8, limit: 8, hold: 2 * time.Millisecond}
	for _, mode := range []string{tpPerCall, tpBatch} {
		t.Run(mode, func(t *testing.T) {
			res := tpRun(t, cfg, mode, 0, time.Second, 20*time.Second, nil)
			t.Log(res)
			if res.calls == 0 {
				t.Fatalf("no call reached the dependency")
			}
			if res.calls != res.workerCalls {
				t.Errorf("the dependency saw %d calls, the workers made %d", res.calls, res.workerCalls)
			}
			if res.peak > cfg.limit || res.overLimit > 0 {
				t.Errorf("%d calls in flight at the dependency, limit %d (%d calls found more than the limit)",
					res.peak, cfg.limit, res.overLimit)
			}
		})
	}
}
