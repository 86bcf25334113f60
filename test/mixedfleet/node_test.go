package mixedfleet

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/pkg/wire"
)

// requireNodeEnv, when set (make test sets it), turns a missing node or an
// unbuilt Node client into a failure instead of a skip.
const requireNodeEnv = "SPILLWAY_REQUIRE_NODE"

// The kinds of worker in the three-language fleet, as the dependency counts
// them (the X-Lang header) and as their stats name them.
var langs = []string{"go", "python", "node"}

const (
	threeLimit   = 6
	threeThreads = 4 // per process: 2 processes of each language want 24 slots
	// threeWait bounds each phase's wait, so that a fleet that does not
	// behave fails in seconds, not at the test binary's timeout.
	threeWait = 15 * time.Second
	// fairWindow is the window over which each process must get its share.
	fairWindow = time.Second
)

// requireNode skips the test when node or the built Node client is
// missing, unless SPILLWAY_REQUIRE_NODE is set: then it fails.
func requireNode(t *testing.T, repo string) {
	t.Helper()
	missing := func(why string) {
		msg := why + ": run make node-test (make test does)"
		if os.Getenv(requireNodeEnv) != "" {
			t.Fatalf("%s (%s is set, so this is not skipped)", msg, requireNodeEnv)
		}
		t.Skipf("%s; set %s=1 to make this a failure", msg, requireNodeEnv)
	}
	if _, err := exec.LookPath("node"); err != nil {
		missing("node not found")
	}
	for _, f := range []string{"dist/index.js", "node_modules/ioredis/package.json"} {
		if _, err := os.Stat(filepath.Join(repo, "clients", "node", f)); err != nil {
			missing("clients/node/" + f + " not found")
		}
	}
}

// TestGoPythonAndNodeWorkersAreOneFleet runs per-call Go, Python and Node
// workers, two processes of each, on one dependency with fewer slots than
// they want, and checks that they are one fleet: the cap holds at the
// dependency; every process gets calls through in every second of
// contention, and its fair share over three; a failure burst from the Node workers alone trips the breaker
// in the fleet's path (release.lua) for all three languages; and each step
// of the ramp after it reaches all three, none over the step's limit.
func TestGoPythonAndNodeWorkersAreOneFleet(t *testing.T) {
	requirePython(t)
	g := NewWithT(t)
	ctx := t.Context()

	fl := startMixedFleet(t, threeLimit, threeThreads)
	rdb, proto, policy, dep, env, self, repo := fl.rdb, fl.proto, fl.policy, fl.dep, fl.env, fl.self, fl.repo
	requireNode(t, repo)
	byLang := map[string][]*fleetProc{}
	var all []*fleetProc
	for range workers {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(env, mixedRoleEnv+"=go-worker")
		byLang["go"] = append(byLang["go"], start(t, cmd))
		cmd = exec.Command(python, "worker.py")
		cmd.Env = env
		byLang["python"] = append(byLang["python"], start(t, cmd))
		cmd = exec.Command("node", "worker.mjs")
		cmd.Env = env
		byLang["node"] = append(byLang["node"], start(t, cmd))
	}
	for _, l := range langs {
		all = append(all, byLang[l]...)
	}
	running := func() error {
		for _, p := range all {
			select {
			case <-p.done:
				return StopTrying(fmt.Sprintf("worker %s exited early (its stderr is above)", p.cmd.Path))
			default:
			}
		}
		return nil
	}
	each := func(what string, f func(lang string) bool) func() error {
		return func() error {
			if err := running(); err != nil {
				return err
			}
			for _, l := range langs {
				if !f(l) {
					return fmt.Errorf("%s: not yet for %s", what, l)
				}
			}
			return nil
		}
	}
	langSum := func(lang string, f func(workerStats) int64) int64 { return sum(byLang[lang], f) }
	refusedOpen := func(lang string) int64 {
		return langSum(lang, func(s workerStats) int64 { return int64(s.Refused["open"]) })
	}

	// Phase 1, contention: 24 loops want 6 slots. Every language gets
	// calls through, and over one second each process gets its share.
	g.Eventually(each("calls through", func(l string) bool { return dep.calls(l) >= 20 })).
		WithTimeout(threeWait).WithPolling(50 * time.Millisecond).Should(Succeed())
	// Warmed up (a Node process compiles its call path in its first calls):
	// every process has made 30 calls.
	g.Eventually(func() error {
		for _, p := range all {
			if n := dep.callsOf(p.cmd.Process.Pid); n < 30 {
				return fmt.Errorf("process %d (%s) made %d calls", p.cmd.Process.Pid, p.cmd.Path, n)
			}
		}
		return running()
	}).WithTimeout(threeWait).WithPolling(50 * time.Millisecond).Should(Succeed())
	// Three windows of fairWindow each: in every window every process gets
	// calls through (none waits a second for a slot), and over the three
	// each gets its fair share of the calls the fleet made. Each of the six
	// processes is owed floor(limit / processes) = 1 slot, a sixth of the
	// calls; a refused per-call worker polls again only after a pause and
	// races the others for the freed slots, and a process of this busy
	// machine may not run for a few hundred milliseconds, so the bound asks
	// for 30% of it, as TestBatchingWorkersJoinTheMixedFleet does for
	// per-call processes. The share is of the calls made, not of the
	// dependency's 100 calls a second per slot: on this machine, shared by
	// other sessions' builds, the whole fleet made 450-900 calls a second of
	// the 600 its six slots allow.
	start := map[*fleetProc]int64{}
	for _, p := range all {
		start[p] = dep.callsOf(p.cmd.Process.Pid)
	}
	const windows = 3
	for w := range windows {
		before := map[*fleetProc]int64{}
		for _, p := range all {
			before[p] = dep.callsOf(p.cmd.Process.Pid)
		}
		time.Sleep(fairWindow)
		g.Expect(running()).To(Succeed())
		var shares []string
		for _, p := range all {
			shares = append(shares, fmt.Sprintf("%s %d", filepath.Base(p.cmd.Path), dep.callsOf(p.cmd.Process.Pid)-before[p]))
		}
		t.Logf("Contention window %d (%s): the processes made %s calls", w+1, fairWindow, strings.Join(shares, ", "))
		for _, p := range all {
			n := dep.callsOf(p.cmd.Process.Pid) - before[p]
			g.Expect(n).To(BeNumerically(">=", 1), "process %d (%s) got no slot in %s of contention", p.cmd.Process.Pid, p.cmd.Path, fairWindow)
		}
	}
	var contended int64
	for _, p := range all {
		contended += dep.callsOf(p.cmd.Process.Pid) - start[p]
	}
	share := float64(contended) * float64(threeLimit/len(all)) / float64(threeLimit)
	for _, p := range all {
		n := dep.callsOf(p.cmd.Process.Pid) - start[p]
		g.Expect(float64(n)).To(BeNumerically(">=", 0.3*share),
			"process %d (%s) made %d of the fleet's %d calls in %d× %s of contention: short of its share (%.0f)", p.cmd.Process.Pid, p.cmd.Path, n, contended, windows, fairWindow, share)
	}

	// Phase 2, the Node workers' calls fail, and only theirs: the in-path
	// trip (the breaker's rule, published as the controller publishes it)
	// opens the breaker from their releases, and all three languages are
	// refused. The Node processes make a sixth of the calls or fewer (they
	// made 13-20% in phase 1), and fewer once their failures spend the retry
	// budget and they park (6% of the window's calls in one run), so the
	// rule's ratio is 3%: their failures alone cross it, the others'
	// successes count against it, and no other worker fails.
	tripFrom := time.Now()
	policy.Epoch = 2
	policy.Trip.On, policy.Trip.FailureRatio, policy.Trip.MinCalls = true, 0.03, 20
	policy.Trip.Since, policy.Trip.OpenDuration = tripFrom, time.Minute
	_, err := proto.Publish(ctx, policy)
	g.Expect(err).NotTo(HaveOccurred())
	openBefore := map[string]int64{}
	for _, l := range langs {
		openBefore[l] = refusedOpen(l)
	}
	failNode := "node"
	dep.failLang.Store(&failNode)
	g.Eventually(func() error {
		p, _, err := proto.ReadPublished(ctx)
		if err != nil || p.State == wire.Open {
			return err
		}
		w, _, _, err := proto.ReadWindow(ctx, policy.BreakerWindow, tripFrom)
		if err != nil {
			return err
		}
		return fmt.Errorf("%s: the breaker's window since the failures began holds %d calls, %d failures, node %d calls",
			p.State, w.Calls, w.Failures+w.Timeouts, dep.calls("node"))
	}).WithTimeout(threeWait).WithPolling(20*time.Millisecond).Should(Succeed(), "the Node workers' failures never tripped the breaker")
	openAt := time.Now()
	tripped, _, err := proto.ReadPublished(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("The Node workers' failures tripped the breaker %s after they began (tripped from %s)", tripped.TrippedAt.Sub(tripFrom).Round(time.Millisecond), tripped.TrippedFrom)
	g.Eventually(each("refused open", func(l string) bool { return refusedOpen(l) > openBefore[l] })).
		WithTimeout(threeWait).WithPolling(50 * time.Millisecond).Should(Succeed())
	dep.failLang.Store(nil)
	time.Sleep(time.Until(openAt.Add(openSettle)))
	openEnd := time.Now()
	g.Expect(time.Unix(0, dep.lastArrival.Load())).To(BeTemporally("<", openEnd),
		"a call reached the dependency while the breaker was open")
	arrivedOpen := dep.lastArrival.Load()
	time.Sleep(200 * time.Millisecond)
	g.Expect(dep.lastArrival.Load()).To(Equal(arrivedOpen), "a call reached the dependency while the breaker was open")

	// Phase 3, the ramp (published as the controller publishes it after a
	// clean HalfOpen, the trip acknowledged): each step reaches all three
	// languages, and none goes over the step's limit.
	policy.Trip.On, policy.Trip.Acknowledged, policy.Trip.AcknowledgedCount = false, tripped.TripSeen(), tripped.TripsSeen()
	for i, step := range []int64{2, 4, threeLimit} {
		policy.Epoch = int64(3 + i)
		policy.State, policy.Limit = wire.Ramping, step
		if step == threeLimit {
			policy.State = wire.Closed
		}
		dep.stepPeak.Store(0)
		at := map[string]int64{}
		for _, l := range langs {
			at[l] = dep.calls(l)
		}
		_, err := proto.Publish(ctx, policy)
		g.Expect(err).NotTo(HaveOccurred())
		g.Eventually(each(fmt.Sprintf("calls at step %d", step), func(l string) bool { return dep.calls(l)-at[l] >= 10 })).
			WithTimeout(threeWait).WithPolling(50 * time.Millisecond).Should(Succeed())
		var got []string
		for _, l := range langs {
			got = append(got, fmt.Sprintf("%s %d", l, dep.calls(l)-at[l]))
		}
		t.Logf("Ramp step %d (%s): %s calls, at most %d at once", step, policy.State, strings.Join(got, ", "), dep.stepPeak.Load())
		g.Expect(dep.stepPeak.Load()).To(BeNumerically("<=", step), "calls in flight above the ramp step's limit")
	}

	final := map[string]workerStats{}
	for _, p := range all {
		s := p.stop(t)
		final[fmt.Sprintf("%s/%d", s.Lang, s.PID)] = s
	}
	var calls, retries int64
	for k, s := range final {
		t.Logf("Worker %s: ok %d failed %d retry %d park %d refused %v", k, s.OK, s.Failed, s.Retry, s.Park, s.Refused)
		calls += s.OK + s.Failed
		retries += s.Retry
	}
	var arrived int64
	for _, l := range langs {
		arrived += dep.calls(l)
	}
	t.Logf("Dependency saw %d calls (go %d, python %d, node %d), at most %d at once",
		arrived, dep.calls("go"), dep.calls("python"), dep.calls("node"), dep.peak.Load())

	// One limit, exact at the dependency.
	g.Expect(dep.peak.Load()).To(BeNumerically("<=", threeLimit), "calls in flight above the fleet's limit")
	// One budget, one set of counters, one set of scripts.
	w, _, _, err := proto.ReadWindow(ctx, 10*time.Minute, time.Time{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(retries).To(BeNumerically("<=", w.RetriesGranted), "a retry the budget did not grant")
	g.Expect(w.RetriesGranted).To(BeNumerically("<=", minRetries), "the fleet was granted more than one budget")
	g.Expect(w.Calls).To(Equal(calls), "the stats must count the calls of every language")
	g.Expect(w.Calls).To(Equal(arrived))
	g.Expect(onlyGoScriptsCached(ctx, rdb, filepath.Join(repo, "pkg", "protocol", "lua"))).To(Succeed())
}
