// Package mixedfleet runs Go, Python and Node workers against one dependency
// at once, each through its own language's guard (pkg/guard, clients/python,
// clients/node) and
// the same Redis keys and Lua scripts, and checks that they form one fleet:
// one concurrency limit, one breaker, one retry budget, one set of counters.
//
// It lives under test/ beside test/e2e because it is a cross-language
// contract test, not a test of one package: it needs the Python client and
// Debian's python3 (hack/setup-python.sh) and the Node client built with its
// npm modules (make node-test), none of which a Go package's tests should
// depend on. The Go workers are this test binary re-executed (TestMain plays
// the worker when mixedRoleEnv is set), so there is no build step; the
// Python workers are worker.py, the Node workers worker.mjs.
package mixedfleet

import (
	"bufio"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

const (
	mixedRoleEnv    = "SPILLWAY_MIXED_ROLE"
	mixedRedisEnv   = "SPILLWAY_MIXED_REDIS"
	mixedDepEnv     = "SPILLWAY_MIXED_DEP"
	mixedURLEnv     = "SPILLWAY_MIXED_URL"
	mixedThreadsEnv = "SPILLWAY_MIXED_THREADS"
	// mixedBatchEnv "true" makes a Go worker batch its slots
	// (guard.Options.Batch) and call the dependency as "go-batch".
	mixedBatchEnv = "SPILLWAY_MIXED_BATCH"
	statsPrefix   = "mixed-stats: "

	// requirePythonEnv, when set (make test sets it), turns a missing
	// python3 or module into a failure instead of a skip.
	requirePythonEnv = "SPILLWAY_REQUIRE_PYTHON"
	python           = "/usr/bin/python3"

	dependency = "fleet/vehicle-api"
	limit      = 4
	minRetries = 6
	workers    = 2 // processes per language
	threads    = 8 // goroutines or threads per process

	// openSettle is how long after the Open publish a call admitted just
	// before it may still reach the dependency: a worker starved by a busy
	// machine between its admission and its request.
	openSettle = 2 * time.Second
)

func TestMain(m *testing.M) {
	if os.Getenv(mixedRoleEnv) == "go-worker" {
		os.Exit(goWorker())
	}
	os.Exit(m.Run())
}

// workerStats is what a worker prints, in either language.
type workerStats struct {
	Lang    string         `json:"lang"`
	PID     int            `json:"pid"`
	OK      int64          `json:"ok"`
	Failed  int64          `json:"failed"`
	Retry   int64          `json:"retry"`
	Park    int64          `json:"park"`
	Drop    int64          `json:"drop"`
	Refused map[string]int `json:"refused"`
}

// dependencyServer is the shared dependency: it counts calls in flight and by
// language, and answers 503 while down.
// dependencyCall is how long the dependency takes to answer a call.
const dependencyCall = 10 * time.Millisecond

type dependencyServer struct {
	inFlight, peak atomic.Int64
	// stepPeak is the most calls in flight at once since the test last
	// reset it (a ramp step's peak).
	stepPeak atomic.Int64
	down     atomic.Bool
	// failLang, when set, fails the calls of that language (X-Lang) alone.
	failLang    atomic.Pointer[string]
	byLang      sync.Map // lang -> *atomic.Int64
	byPID       sync.Map // the worker's process id (X-PID) -> *atomic.Int64
	lastArrival atomic.Int64
}

func (d *dependencyServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d.lastArrival.Store(time.Now().UnixNano())
	n := d.inFlight.Add(1)
	for _, peak := range []*atomic.Int64{&d.peak, &d.stepPeak} {
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
	}
	c, _ := d.byLang.LoadOrStore(r.Header.Get("X-Lang"), new(atomic.Int64))
	c.(*atomic.Int64).Add(1)
	if pid := r.Header.Get("X-PID"); pid != "" {
		c, _ := d.byPID.LoadOrStore(pid, new(atomic.Int64))
		c.(*atomic.Int64).Add(1)
	}
	time.Sleep(dependencyCall)
	d.inFlight.Add(-1)
	if fail := d.failLang.Load(); d.down.Load() || (fail != nil && *fail == r.Header.Get("X-Lang")) {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	_, _ = io.WriteString(w, "ok")
}

// callsOf is the number of calls that the worker process pid made.
func (d *dependencyServer) callsOf(pid int) int64 {
	c, ok := d.byPID.Load(strconv.Itoa(pid))
	if !ok {
		return 0
	}
	return c.(*atomic.Int64).Load()
}

func (d *dependencyServer) calls(lang string) int64 {
	c, ok := d.byLang.Load(lang)
	if !ok {
		return 0
	}
	return c.(*atomic.Int64).Load()
}

// requirePython skips the test when Debian's python3 or the client's modules
// are missing, unless SPILLWAY_REQUIRE_PYTHON is set: then it fails.
func requirePython(t *testing.T) {
	t.Helper()
	missing := func(why string) {
		msg := why + ": run hack/setup-python.sh (make test does)"
		if os.Getenv(requirePythonEnv) != "" {
			t.Fatalf("%s (%s is set, so this is not skipped)", msg, requirePythonEnv)
		}
		t.Skipf("%s; set %s=1 to make this a failure", msg, requirePythonEnv)
	}
	if _, err := os.Stat(python); err != nil {
		missing(python + " not found")
	}
	if out, err := exec.Command(python, "-c", "import redis").CombinedOutput(); err != nil {
		missing(fmt.Sprintf("%s cannot import redis (%s)", python, strings.TrimSpace(string(out))))
	}
}

// fleetProc is one worker process and its latest stats.
type fleetProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	mu    sync.Mutex
	last  workerStats
	done  chan struct{}
}

func (p *fleetProc) stats() workerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last
}

func start(t *testing.T, cmd *exec.Cmd) *fleetProc {
	t.Helper()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &prefixWriter{t: t, prefix: filepath.Base(cmd.Path)}
	if err := cmd.Start(); err != nil {
		t.Fatalf("failed to start %s: %v", cmd.Path, err)
	}
	p := &fleetProc{cmd: cmd, stdin: stdin, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), statsPrefix)
			if !ok {
				continue
			}
			var s workerStats
			if err := json.Unmarshal([]byte(line), &s); err == nil {
				p.mu.Lock()
				p.last = s
				p.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() {
		_ = stdin.Close()
		select {
		case <-p.done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
		}
		_ = cmd.Wait()
	})
	return p
}

// stop closes the worker's stdin and waits for its final stats.
func (p *fleetProc) stop(t *testing.T) workerStats {
	_ = p.stdin.Close()
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		t.Errorf("worker %d did not stop within 20s", p.cmd.Process.Pid)
	}
	return p.stats()
}

type prefixWriter struct {
	t      *testing.T
	prefix string
}

func (w *prefixWriter) Write(b []byte) (int, error) {
	w.t.Logf("%s: %s", w.prefix, strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

func sum(procs []*fleetProc, f func(workerStats) int64) int64 {
	var n int64
	for _, p := range procs {
		n += f(p.stats())
	}
	return n
}

func TestGoAndPythonWorkersShareOneLimitBreakerAndBudget(t *testing.T) {
	requirePython(t)
	g := NewWithT(t)
	ctx := t.Context()

	fl := startMixedFleet(t, limit, threads)
	rdb, proto, policy, dep, env, self, repo := fl.rdb, fl.proto, fl.policy, fl.dep, fl.env, fl.self, fl.repo
	var goProcs, pyProcs []*fleetProc
	for i := range workers {
		cmd := exec.Command(self, "-test.run=^$")
		// One Go worker of each mode: batching and per-call workers of
		// both languages share the limit, the breaker and the budget.
		cmd.Env = append(env, mixedRoleEnv+"=go-worker", mixedBatchEnv+"="+strconv.FormatBool(i%2 == 1))
		goProcs = append(goProcs, start(t, cmd))
		cmd = exec.Command(python, "worker.py")
		cmd.Env = env
		pyProcs = append(pyProcs, start(t, cmd))
	}
	all := append(append([]*fleetProc(nil), goProcs...), pyProcs...)
	// The batching Go worker calls the dependency as "go-batch".
	goCalls := func() int64 { return dep.calls("go") + dep.calls("go-batch") }

	// Phase 1, healthy: both languages are admitted, never more than the
	// limit at once.
	g.Eventually(func() bool { return goCalls() >= 50 && dep.calls("python") >= 50 }).
		WithTimeout(90*time.Second).WithPolling(50*time.Millisecond).
		Should(BeTrue(), "both languages must get calls through")

	// Phase 2, the dependency fails: the fleet's one budget grants
	// minRetries retries in all, then every worker of either language parks.
	dep.down.Store(true)
	g.Eventually(func() bool {
		return sum(goProcs, func(s workerStats) int64 { return s.Park }) > 0 &&
			sum(pyProcs, func(s workerStats) int64 { return s.Park }) > 0
	}).WithTimeout(60*time.Second).WithPolling(50*time.Millisecond).
		Should(BeTrue(), "workers of both languages must park once the budget is spent")

	// Phase 3, the breaker opens (the test publishes what the controller
	// would): both languages are refused, nothing reaches the dependency.
	policy.State, policy.Limit, policy.Epoch = wire.Open, 0, 2
	policy.OpenUntil = time.Now().Add(time.Minute)
	_, err := proto.Publish(ctx, policy)
	g.Expect(err).NotTo(HaveOccurred())
	openAt := time.Now()
	g.Eventually(func() bool {
		return sum(goProcs, func(s workerStats) int64 { return int64(s.Refused["open"]) }) > 0 &&
			sum(pyProcs, func(s workerStats) int64 { return int64(s.Refused["open"]) }) > 0
	}).WithTimeout(30*time.Second).WithPolling(50*time.Millisecond).
		Should(BeTrue(), "workers of both languages must see the breaker open")
	time.Sleep(time.Until(openAt.Add(openSettle + time.Second)))

	final := map[string]workerStats{}
	for _, p := range all {
		s := p.stop(t)
		final[fmt.Sprintf("%s/%d", s.Lang, s.PID)] = s
	}
	t.Logf("Dependency saw %d calls from Go (%d batching) and %d from Python, at most %d at once",
		goCalls(), dep.calls("go-batch"), dep.calls("python"), dep.peak.Load())
	for k, s := range final {
		t.Logf("Worker %s: ok %d failed %d retry %d park %d refused %v", k, s.OK, s.Failed, s.Retry, s.Park, s.Refused)
	}

	// One limit.
	g.Expect(dep.peak.Load()).To(BeNumerically("<=", limit), "calls in flight above the fleet's limit")
	// One breaker: no call arrived once the Open state was in force (a call
	// admitted just before the publish may arrive a little later).
	g.Expect(time.Unix(0, dep.lastArrival.Load())).To(BeTemporally("<", openAt.Add(openSettle)),
		"a call reached the dependency while the breaker was open")
	// One budget: the grants of both languages together are the budget's.
	var retries, calls int64
	for _, s := range final {
		retries += s.Retry
		calls += s.OK + s.Failed
	}
	w, _, _, err := proto.ReadWindow(ctx, 10*time.Minute, time.Time{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(retries).To(BeNumerically(">", 0))
	g.Expect(retries).To(BeNumerically("<=", minRetries), "the fleet retried more than one budget allows")
	// A batching worker takes grants in batches: one it took and never
	// handed out is counted granted too (the budget only gets stricter).
	g.Expect(w.RetriesGranted).To(BeNumerically(">=", retries), "every grant is in the one budget's counters")
	g.Expect(w.RetriesGranted).To(BeNumerically("<=", minRetries), "the budget granted more than it has")
	// One set of counters: every call either language made is in the stats.
	g.Expect(w.Calls).To(Equal(calls), "the stats must count the calls of both languages")
	g.Expect(w.Calls).To(Equal(goCalls() + dep.calls("python")))
	// One set of scripts: Python ran the Go tree's scripts, byte for byte,
	// so Redis holds no script but those.
	g.Expect(onlyGoScriptsCached(ctx, rdb, filepath.Join(repo, "pkg", "protocol", "lua"))).To(Succeed())
}

// onlyGoScriptsCached checks that every script in Redis's cache has the SHA1
// of one of pkg/protocol/lua's scripts as the Go client composes them.
func onlyGoScriptsCached(ctx context.Context, rdb *redis.Client, dir string) error {
	lib, err := os.ReadFile(filepath.Join(dir, "lib.lua"))
	if err != nil {
		return err
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.lua"))
	if err != nil {
		return err
	}
	var shas []string
	for _, f := range files {
		body, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		text := append(append([]byte(nil), lib...), body...)
		if filepath.Base(f) == "noop.lua" {
			text = body
		}
		sum := sha1.Sum(text)
		shas = append(shas, hex.EncodeToString(sum[:]))
	}
	exists, err := rdb.ScriptExists(ctx, shas...).Result()
	if err != nil {
		return err
	}
	var known int64
	for _, e := range exists {
		if e {
			known++
		}
	}
	info, err := rdb.Info(ctx, "memory").Result()
	if err != nil {
		return err
	}
	var cached int64 = -1
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "number_of_cached_scripts:"); ok {
			cached, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	if known < 3 || cached != known {
		return fmt.Errorf("redis caches %d scripts, %d of them the Go tree's: a worker ran other script text", cached, known)
	}
	return nil
}

// goWorker is the Go side of the fleet: threads goroutines call the
// dependency through one guard and act on its decisions, with the delays
// capped so the test stays short, printing their counts every 200 ms and
// once more when stdin closes.
func goWorker() int {
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv(mixedRedisEnv), ContextTimeoutEnabled: true})
	defer rdb.Close()
	lang, opts := "go", guard.Options{}
	if os.Getenv(mixedBatchEnv) == "true" {
		lang, opts.Batch = "go-batch", guard.BatchOptions{Enabled: true}
	}
	gd, err := guard.New(rdb, os.Getenv(mixedDepEnv), opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer gd.Close()
	n, _ := strconv.Atoi(os.Getenv(mixedThreadsEnv))
	url := os.Getenv(mixedURLEnv)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()

	var mu sync.Mutex
	st := workerStats{Lang: lang, PID: os.Getpid(), Refused: map[string]int{}}
	count := func(f func()) { mu.Lock(); f(); mu.Unlock() }
	report := func() {
		mu.Lock()
		b, _ := json.Marshal(st)
		mu.Unlock()
		fmt.Println(statsPrefix + string(b))
	}
	reasons := map[error]string{guard.ErrThrottled: "slots", guard.ErrRateLimited: "rate", guard.ErrOpen: "open",
		guard.ErrRedisUnavailable: "redis_unavailable", guard.ErrNoPolicy: "no_policy"}
	call := func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		req.Header.Set("X-Lang", lang)
		req.Header.Set("X-PID", strconv.Itoa(os.Getpid()))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			count(func() { st.Failed++ }) // the guard reports it as a failure too
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			count(func() { st.Failed++ })
			return fmt.Errorf("dependency answered %d", resp.StatusCode)
		}
		count(func() { st.OK++ })
		return nil
	}
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			attempt := 1
			for ctx.Err() == nil {
				err := gd.Do(context.WithoutCancel(ctx), guard.Job{Attempt: attempt}, call)
				if err == nil {
					attempt = 1
					continue
				}
				var ge *guard.Error
				if !errors.As(err, &ge) {
					continue
				}
				pause := min(ge.After, 50*time.Millisecond)
				switch ge.Action {
				case guard.ActionDefer:
					count(func() { st.Refused[reasons[ge.Reason]]++ })
				case guard.ActionRetry:
					count(func() { st.Retry++ })
					attempt++
				case guard.ActionPark:
					count(func() { st.Park++ })
					attempt = 1
					pause = min(ge.After, 100*time.Millisecond)
				case guard.ActionDrop:
					count(func() { st.Drop++ })
				}
				select {
				case <-ctx.Done():
				case <-time.After(pause):
				}
			}
		}()
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-tick.C:
			report()
		}
	}
	wg.Wait()
	report()
	return 0
}

// mixedFleet is what a mixed-fleet test starts its workers from: a
// redis-server with a Closed policy published, the dependency they call, and
// the environment and binary to start them with.
type mixedFleet struct {
	rdb    *redis.Client
	proto  *protocol.Client
	policy protocol.Published
	dep    *dependencyServer
	env    []string // for every worker: Redis, the dependency, threads
	self   string   // this test binary, for Go workers
	repo   string   // the repository's root
}

// startMixedFleet publishes a Closed policy at limit (its retry budget
// exactly minRetries over a window longer than the test, so the fleet's
// grants can be counted) and starts the dependency; workers run threads
// goroutines or threads each.
func startMixedFleet(t *testing.T, limit int64, threads int) mixedFleet {
	t.Helper()
	g := NewWithT(t)
	srv := redistest.Start(t)
	f := mixedFleet{rdb: srv.Client(func(o *redis.Options) { o.ContextTimeoutEnabled = true }), dep: &dependencyServer{}}
	var err error
	f.proto, err = protocol.NewClient(f.rdb, protocol.Dependency{Namespace: "fleet", Name: "vehicle-api"})
	g.Expect(err).NotTo(HaveOccurred())
	f.policy = protocol.Published{
		State: wire.Closed, Limit: limit, Capacity: limit, Epoch: 1,
		Backoff:        retry.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond, Jitter: retry.JitterFull},
		Budget:         retry.Budget{Ratio: 0, MinRetries: minRetries, Window: 10 * time.Minute},
		BreakerWindow:  30 * time.Second,
		HalfOpenProbes: 1,
	}
	_, err = f.proto.Publish(t.Context(), f.policy)
	g.Expect(err).NotTo(HaveOccurred())

	api := httptest.NewServer(f.dep)
	t.Cleanup(api.Close)
	f.self, err = os.Executable()
	g.Expect(err).NotTo(HaveOccurred())
	f.repo, err = filepath.Abs(filepath.Join("..", ".."))
	g.Expect(err).NotTo(HaveOccurred())
	f.env = append(os.Environ(),
		mixedRedisEnv+"="+srv.Addr(), mixedDepEnv+"="+dependency, mixedURLEnv+"="+api.URL,
		mixedThreadsEnv+"="+strconv.Itoa(threads), "PYTHONPATH="+filepath.Join(f.repo, "clients", "python"))
	return f
}
