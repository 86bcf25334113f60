// Package skew tests version skew between the manager and the workers: a
// rolling upgrade from the last commit of the previous protocol version
// (named by its pin, pkg/protocol/pins/v<N-1>.sum), built from the repository's own history, to this
// tree, under load, with an outage in the middle. internal/skewtest builds
// and runs the programs of both versions.
//
// `make test` runs the short form; `make skew-long` the long one
// (SPILLWAY_SKEW_LONG=1: more workers and more rounds of outages, manager
// switches and worker rollbacks).
package skew

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/skewtest"
	"github.com/spillway-dev/spillway/internal/testenv"
)

const (
	namespace = "fleet"
	name      = "reports-api"
	dep       = namespace + "/" + name
	// capacity is the policy's concurrency: the fleet's workers run more
	// threads than that, so they contend for it.
	capacity = 8
	// probes is the policy's halfOpenProbes: an admission at this limit is
	// a HalfOpen probe, as the ramp starts above it.
	probes = 1
	// hold is how long the dependency takes to answer.
	hold = 15 * time.Millisecond
)

// steps are the ramp's steps: above probes, below capacity, so that every
// admission's limit says which state admitted it.
var steps = []int32{2, 3, 4, 5, 6, 7}

// rollout is the rolling upgrade's world: the API server, Redis, the
// dependency, the programs of both versions, the manager replicas and the
// workers, and what was seen.
type rollout struct {
	t        *testing.T
	g        *WithT
	kube     *testenv.Env
	redis    *redistest.Server
	rdb      *redis.Client
	dep      *skewtest.Dependency
	old, cur skewtest.Binaries
	managers skewtest.Managers
	fleet    skewtest.Fleet
	replicas []*skewtest.Manager
	// workers are the running workers, by name; retired those stopped.
	workers map[string]*skewtest.Worker
	retired []*skewtest.Worker
	final   map[*skewtest.Worker]skewtest.Stats
	states  func() []skewtest.State
	// switches are when the leader changed, and from which version to which.
	switches []leaderSwitch
	outages  []time.Time // when each outage began
	recovery []time.Time // and when it ended
	start    time.Time
	replica  int // names the next replica
}

type leaderSwitch struct {
	at       time.Time // when the old leader was told to stop
	from, to string
	before   skewtest.State // the last state the old leader published
	after    skewtest.State // the new leader's first publication
}

// TestRollingUpgradeUnderLoad runs a fleet of Go (per call and batching)
// and Python workers on one dependency under contention through a rolling
// upgrade from the pinned commit to this tree: all old; the manager
// upgraded as a 2-replica Deployment rolls; the workers rolled one by one,
// with an outage in the middle (the dependency fails, the fleet opens, then
// ramps) during whose ramp the manager is rolled back; then a second outage,
// of new workers under the old manager, during whose ramp the manager is
// rolled forward again.
// Throughout: never more calls in flight at the dependency than the limit,
// no job deferred for a version reason; every state change seen by
// workers of both versions; the ramp never restarts, and the breaker never
// opens, because the manager changed; and no lease left behind once the
// workers stop.
func TestRollingUpgradeUnderLoad(t *testing.T) {
	skewtest.RequirePython(t)
	long := os.Getenv("SPILLWAY_SKEW_LONG") != ""
	r := setup(t)

	// 1. All old.
	r.phase("all old: old manager replicas, old workers")
	r.replicas = []*skewtest.Manager{r.startManager(r.old), r.startManager(r.old)}
	r.g.Eventually(func() bool { return r.leader() != nil }).WithTimeout(60*time.Second).Should(BeTrue(), "an old replica leads")
	r.createPolicy()
	r.g.Eventually(func() string { return r.state().State + fmt.Sprint("/", r.state().Limit) }).
		WithTimeout(30*time.Second).Should(Equal(fmt.Sprintf("Closed/%d", capacity)), "the old manager publishes the policy")
	specs := []skewtest.WorkerSpec{
		{Name: "go-call-1", Threads: 4},
		{Name: "go-batch-1", Batch: true, Threads: 4},
		{Name: "py-1", Python: true, Threads: 4},
		{Name: "py-2", Python: true, Threads: 4},
	}
	if long {
		specs = append(specs,
			skewtest.WorkerSpec{Name: "go-call-2", Threads: 4},
			skewtest.WorkerSpec{Name: "go-batch-2", Batch: true, Threads: 4})
	}
	for _, s := range specs {
		r.startWorker(r.old, s)
	}
	r.progress("the old fleet under the old manager")

	// 2. Upgrade the manager: old workers under a new manager.
	r.phase("manager upgrade: old workers under the new manager")
	r.rollManagers(r.cur)
	r.progress("old workers under the new manager")

	// 3. Roll the workers one by one, half of them before the outage.
	half := len(specs) / 2
	order := rollOrder(specs)
	for _, s := range order[:half] {
		r.rollWorker(s.Name, r.cur)
	}

	// 5. An outage, with old and new workers in the fleet; 4. during its
	// ramp the manager is rolled back.
	r.outage(r.old)
	// The rest of the workers roll once they saw the ramp, under the old
	// manager; the last old one stays until it saw the ramp end, so that
	// the old version sees every change.
	rest := order[half:]
	for i, s := range rest {
		r.waitSaw(s.Name, "the ramp", func(x skewtest.Seen) bool { return kind(x) == "ramping" }, r.lastOutage())
		if i == len(rest)-1 {
			r.waitState("Closed", 60*time.Second)
			w := r.workers[s.Name]
			r.g.Eventually(func() string {
				seen := w.Seen()
				return seen[len(seen)-1].What
			}).WithTimeout(30*time.Second).Should(Equal(fmt.Sprintf("limit=%d", capacity)), "the worker %s sees the full capacity again", w.ID())
		}
		r.rollWorker(s.Name, r.cur)
	}
	r.waitState("Closed", 60*time.Second)
	// Another outage, now of new workers under the old manager (the
	// in-path trip is theirs); during its ramp the manager is rolled
	// forward again.
	r.outage(r.cur)
	r.progress("the new fleet under the new manager, ramping")

	if long {
		// Roll the workers back and forward, outages in between, the
		// manager switched during each ramp.
		r.waitState("Closed", 60*time.Second)
		for round := range 2 {
			r.phase(fmt.Sprintf("long round %d: workers rolled back to the old version", round))
			for _, s := range order {
				r.rollWorker(s.Name, r.old)
			}
			r.outage(r.old) // new manager: roll it back during the ramp
			r.waitState("Closed", 60*time.Second)
			r.phase(fmt.Sprintf("long round %d: workers rolled forward under the old manager", round))
			for _, s := range order {
				r.rollWorker(s.Name, r.cur)
			}
			r.outage(r.cur) // old manager: roll it forward during the ramp
			r.waitState("Closed", 60*time.Second)
		}
	}
	r.check()
}

// setup starts the API server, Redis and the dependency and builds the
// programs of both versions meanwhile.
func setup(t *testing.T) *rollout {
	g := NewWithT(t)
	r := &rollout{t: t, g: g, workers: map[string]*skewtest.Worker{}, final: map[*skewtest.Worker]skewtest.Stats{}, start: time.Now()}
	dir := t.TempDir()
	type built struct {
		old, cur skewtest.Binaries
		err      error
	}
	builds := make(chan built, 1)
	go func() {
		var b built
		commit, err := skewtest.Pinned()
		if err != nil {
			builds <- built{err: err}
			return
		}
		if b.old, err = skewtest.Old(commit); err != nil {
			builds <- built{err: err}
			return
		}
		b.cur, b.err = skewtest.New(dir)
		builds <- b
	}()
	kube, err := testenv.Start()
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = kube.Stop() })
	r.kube = kube
	user, err := kube.Environment.ControlPlane.AddUser(envtest.User{Name: "spillway-manager", Groups: []string{"system:masters"}}, nil)
	g.Expect(err).NotTo(HaveOccurred())
	kc, err := user.KubeConfig()
	g.Expect(err).NotTo(HaveOccurred())
	kubeconfig := filepath.Join(dir, "kubeconfig")
	g.Expect(os.WriteFile(kubeconfig, kc, 0o600)).To(Succeed())
	g.Expect(kube.Client.Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}})).To(Succeed())
	r.redis = redistest.Start(t)
	r.rdb = r.redis.Client()
	r.dep = skewtest.StartDependency(t, capacity, hold)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r.states = skewtest.WatchStates(ctx, r.rdb, dep)

	b := <-builds
	g.Expect(b.err).NotTo(HaveOccurred())
	r.old, r.cur = b.old, b.cur
	t.Logf("Built the old version (%s) and the new one in %s", filepath.Dir(r.old.Manager), time.Since(r.start).Round(time.Second))
	r.managers = skewtest.Managers{
		Kubeconfig: kubeconfig, Redis: r.redis.Addr(), Dir: dir,
		// Lease timings that a loaded machine's pauses do not break; a
		// replica that stops releases the Lease, so they do not slow the
		// handovers.
		Flags: []string{"--evaluation-interval=500ms", "--leader-election-lease-duration=10s",
			"--leader-election-renew-deadline=8s", "--leader-election-retry-period=500ms"},
	}
	r.fleet = skewtest.Fleet{Redis: r.redis.Addr(), Dependency: dep, URL: r.dep.URL(), Dir: dir}
	t.Cleanup(func() {
		if t.Failed() {
			for _, s := range r.states() {
				t.Logf("Published: %s", s)
			}
		}
	})
	return r
}

func (r *rollout) phase(what string) {
	r.t.Logf("%6.1fs: %s", time.Since(r.start).Seconds(), what)
}

func (r *rollout) startManager(b skewtest.Binaries) *skewtest.Manager {
	r.replica++
	return r.managers.Start(r.t, b, fmt.Sprintf("manager-%d-%s", r.replica, b.Version))
}

// leader is the replica that leads, nil if none does.
func (r *rollout) leader() *skewtest.Manager {
	for _, m := range r.replicas {
		if m.Leads() {
			return m
		}
	}
	return nil
}

// state is what the state hash says now.
func (r *rollout) state() skewtest.State {
	s, _, err := skewtest.ReadState(context.Background(), r.rdb, dep)
	r.g.Expect(err).NotTo(HaveOccurred())
	return s
}

func (r *rollout) waitState(state string, timeout time.Duration) {
	r.t.Helper()
	r.g.Eventually(func() string { return r.state().State }).WithTimeout(timeout).WithPolling(10*time.Millisecond).
		Should(Equal(state), "the fleet reaches %s", state)
}

// createPolicy creates the policy: capacity 8, ramped over steps 2..7 then
// 8 on a fixed schedule, opened by 10 calls at half failures over 3s, one probe.
func (r *rollout) createPolicy() {
	pol := &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: spillwayv1alpha1.DependencyPolicySpec{
			Capacity: spillwayv1alpha1.Capacity{Concurrency: capacity},
			Ramp: spillwayv1alpha1.Ramp{
				Steps:        steps,
				StepDuration: metav1.Duration{Duration: 4 * time.Second},
				StepBack:     spillwayv1alpha1.RampStepBack{When: spillwayv1alpha1.StepBackNever},
			},
			Breaker: spillwayv1alpha1.Breaker{
				FailureRatio: 0.5, MinCalls: 10, HalfOpenProbes: probes,
				Window:       metav1.Duration{Duration: 3 * time.Second},
				OpenDuration: metav1.Duration{Duration: time.Second},
			},
		},
	}
	r.g.Expect(r.kube.Client.Create(context.Background(), pol)).To(Succeed())
}

// rollManagers replaces both replicas by replicas of b, as a rolling
// update does, and waits for a replica of b to lead and publish.
func (r *rollout) rollManagers(b skewtest.Binaries) {
	r.t.Helper()
	before := r.leader()
	r.g.Expect(before).NotTo(BeNil(), "a replica leads before the rollout")
	last := r.state()
	at := time.Now()
	names := make([]string, len(r.replicas))
	for i := range names {
		r.replica++
		names[i] = fmt.Sprintf("manager-%d-%s", r.replica, b.Version)
	}
	r.replicas = r.managers.Roll(r.t, r.replicas, b, names...)
	// The old leader has exited: what the state says now is its last
	// publication (unless the new leader published already, which the
	// check of the whole ramp covers).
	last = r.state()
	var first skewtest.State
	r.g.Eventually(func() bool {
		if r.leader() == nil {
			return false
		}
		for _, s := range r.states() {
			if s.Seq > last.Seq {
				first = s
				return true
			}
		}
		return false
	}).WithTimeout(60*time.Second).WithPolling(20*time.Millisecond).Should(BeTrue(), "a %s replica leads and publishes", b.Version)
	sw := leaderSwitch{at: at, from: before.Version, to: b.Version, before: last, after: first}
	r.switches = append(r.switches, sw)
	r.phase(fmt.Sprintf("the leader changed from %s to %s: last publication %s, first %s", before, r.leader(), last, first))
}

// startWorker starts a worker of version b.
func (r *rollout) startWorker(b skewtest.Binaries, s skewtest.WorkerSpec) {
	r.workers[s.Name] = r.fleet.StartWorker(r.t, b, s)
}

// rollWorker replaces the worker by one of version b, as a rolling update
// with a surge does: the new one calls before the old one stops.
func (r *rollout) rollWorker(name string, b skewtest.Binaries) {
	r.t.Helper()
	old := r.workers[name]
	r.startWorker(b, old.Spec)
	w := r.workers[name]
	r.g.Eventually(func() bool { return len(w.Seen()) > 0 }).WithTimeout(30*time.Second).
		Should(BeTrue(), "the new worker %s hears from its guard", w.ID())
	r.final[old] = old.Stop(r.t)
	r.retired = append(r.retired, old)
	r.phase(fmt.Sprintf("rolled the worker %s to %s", old.ID(), w.ID()))
}

// progress waits until every worker has made calls since now.
func (r *rollout) progress(what string) {
	r.t.Helper()
	from := map[string]int64{}
	for _, w := range r.workers {
		from[w.ID()] = r.dep.Calls(w.ID())
	}
	r.g.Eventually(func() []string {
		var slow []string
		for _, w := range r.workers {
			if r.dep.Calls(w.ID())-from[w.ID()] < 10 {
				slow = append(slow, w.ID())
			}
		}
		slices.Sort(slow)
		return slow
	}).WithTimeout(30*time.Second).Should(BeEmpty(), "every worker makes calls: %s", what)
	r.phase("every worker makes calls: " + what)
}

func (r *rollout) lastOutage() time.Time { return r.outages[len(r.outages)-1] }

// outage fails the dependency until the fleet is Open and every worker saw
// it, then lets it recover; the fleet probes and ramps, and during the ramp
// the manager is rolled to b.
func (r *rollout) outage(b skewtest.Binaries) {
	r.t.Helper()
	at := time.Now()
	r.outages = append(r.outages, at)
	r.phase(fmt.Sprintf("outage: the dependency fails, under a %s leader", r.leader().Version))
	r.dep.SetDown(true)
	r.waitState("Open", 60*time.Second)
	for name := range r.workers {
		r.waitSaw(name, "the breaker open", func(s skewtest.Seen) bool { return s.What == "open" }, at)
	}
	r.dep.SetDown(false)
	r.recovery = append(r.recovery, time.Now())
	r.phase("every worker saw the breaker open; the dependency recovers")
	r.g.Eventually(func() bool {
		s := r.state()
		return s.State == "Ramping" && s.RampStep >= 1
	}).WithTimeout(60*time.Second).WithPolling(10*time.Millisecond).Should(BeTrue(), "the fleet ramps to its second step")
	r.phase(fmt.Sprintf("ramping: %s; rolling the manager to %s", r.state(), b.Version))
	r.rollManagers(b)
}

// waitSaw waits until the current worker name saw what matches since.
func (r *rollout) waitSaw(name, what string, match func(skewtest.Seen) bool, since time.Time) {
	r.t.Helper()
	w := r.workers[name]
	r.g.Eventually(func() bool { return w.Saw(since, match) }).WithTimeout(30*time.Second).
		Should(BeTrue(), "the worker %s sees %s", w.ID(), what)
}

// check stops the workers and checks the invariants.
func (r *rollout) check() {
	r.t.Helper()
	t, g := r.t, r.g
	for _, w := range r.workers {
		r.final[w] = w.Stop(t)
		r.retired = append(r.retired, w)
	}
	r.phase("stopped the workers")

	// No lease left behind.
	leases, err := skewtest.LiveLeases(context.Background(), r.rdb, dep)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(leases).To(BeZero(), "live leases left behind once every worker stopped")

	// Never more in flight than the limit.
	t.Logf("The dependency saw %d calls, at most %d at once (capacity %d)", r.dep.Total(), r.dep.Peak(), capacity)
	g.Expect(r.dep.Violations()).To(BeEmpty(), "calls in flight above the limit at the dependency")

	// No job deferred for a version reason; every worker made calls.
	var versionRefusals []string
	for _, w := range r.retired {
		s := r.final[w]
		t.Logf("Worker %s: %d calls at the dependency; ok %d failed %d retry %d park %d drop %d refused %v",
			w.ID(), r.dep.Calls(w.ID()), s.OK, s.Failed, s.Retry, s.Park, s.Drop, s.Refused)
		g.Expect(s.OK).To(BeNumerically(">", 0), "%s made no successful call", w.ID())
		for _, reason := range []string{"version", "no_policy"} {
			if n := s.Refused[reason]; n > 0 {
				versionRefusals = append(versionRefusals, fmt.Sprintf("%s deferred %d jobs (%s)", w.ID(), n, reason))
			}
		}
		for reason, n := range s.Refused {
			// Redis unavailable: a reply later than the guard's 250ms
			// RedisTimeout, which a loaded machine makes (logged above).
			if !slices.Contains([]string{"version", "no_policy", "slots", "open", "rate", "redis_unavailable"}, reason) {
				t.Errorf("%s deferred %d jobs for an unexpected reason: %s", w.ID(), n, reason)
			}
		}
	}
	g.Expect(versionRefusals).To(BeEmpty(), "jobs deferred for a version reason")

	// Every state change, seen by workers of both versions.
	for _, version := range []string{r.old.Version, r.cur.Version} {
		g.Expect(r.sawEveryChange(version)).To(Succeed())
	}
	sawProbe := false
	for _, w := range r.retired {
		sawProbe = sawProbe || w.Saw(time.Time{}, func(s skewtest.Seen) bool { l, ok := s.Limit(); return ok && l == probes })
	}
	g.Expect(sawProbe).To(BeTrue(), "no worker was admitted as a HalfOpen probe")

	// The ramp continues across every manager switch, and the breaker
	// opens only in an outage.
	g.Expect(r.rampContinues()).To(Succeed())
	g.Expect(r.opensOnlyInOutages()).To(Succeed())
}

// sawEveryChange checks that the workers of version, together, saw every
// change of an outage they were in: full capacity before it, the breaker
// open, the ramp, and full capacity after it.
func (r *rollout) sawEveryChange(version string) error {
	var seen []skewtest.Seen
	for _, w := range r.retired {
		if w.Version == version {
			seen = append(seen, w.Seen()...)
		}
	}
	slices.SortStableFunc(seen, func(a, b skewtest.Seen) int { return a.At.Compare(b.At) })
	want := []string{"full capacity", "open", "ramping", "full capacity"}
	i := 0
	for _, s := range seen {
		if i < len(want) && kind(s) == want[i] {
			i++
		}
	}
	if i < len(want) {
		var got []string
		for _, s := range seen {
			got = append(got, s.At.Format("15:04:05.000")+" "+s.What)
		}
		return fmt.Errorf("the %s workers saw %s but not then %s: they saw\n%s", version, strings.Join(want[:i], ", "), want[i], strings.Join(got, "\n"))
	}
	return nil
}

// kind names what an observation shows: "open", "probe", "ramping" or
// "full capacity".
func kind(s skewtest.Seen) string {
	l, ok := s.Limit()
	switch {
	case !ok:
		return s.What
	case l == capacity:
		return "full capacity"
	case l == probes:
		return "probe"
	default:
		return "ramping"
	}
}

// rampContinues checks every ramp the states went through: from its first
// Ramping publication to the next Closed one, the step never goes down and
// the state never leaves Ramping; and at every manager switch during a
// ramp, the new leader's first publication is at the old leader's last
// step or above.
func (r *rollout) rampContinues() error {
	states := r.states()
	ramping := false
	var last skewtest.State
	for _, s := range states {
		switch {
		case s.State == "Ramping" && !ramping:
			ramping, last = true, s
		case ramping && s.State == "Ramping":
			if s.RampStep < last.RampStep {
				return fmt.Errorf("the ramp went back from step %d to %d: %s, then %s", last.RampStep, s.RampStep, last, s)
			}
			last = s
		case ramping && s.State == "Closed":
			ramping = false
		case ramping:
			return fmt.Errorf("the ramp was interrupted: %s, then %s", last, s)
		}
	}
	during := 0
	for _, sw := range r.switches {
		if sw.before.State != "Ramping" {
			continue
		}
		during++
		if sw.after.State == "Ramping" && sw.after.RampStep < sw.before.RampStep {
			return fmt.Errorf("the %s leader after the %s one went back from ramp step %d to %d", sw.to, sw.from, sw.before.RampStep, sw.after.RampStep)
		}
		if sw.after.State != "Ramping" && sw.after.State != "Closed" {
			return fmt.Errorf("the %s leader after the %s one published %s", sw.to, sw.from, sw.after)
		}
		r.t.Logf("Manager switch %s -> %s during the ramp: step %d (%s) then %d (%s)", sw.from, sw.to,
			sw.before.RampStep, sw.before.Seen.Format("15:04:05.000"), sw.after.RampStep, sw.after.Seen.Format("15:04:05.000"))
	}
	if during == 0 {
		return fmt.Errorf("no manager switch happened during a ramp")
	}
	return nil
}

// openSettle is how long after the dependency recovers the breaker may
// still open: a failure reported late, by a loaded machine.
const openSettle = 3 * time.Second

// opensOnlyInOutages checks that every opening of the breaker from Closed
// or Ramping was published while the dependency failed (or within
// openSettle of its recovery): a manager switch, or anything but the
// dependency's failures, must not open it.
func (r *rollout) opensOnlyInOutages() error {
	states := r.states()
	for i := 1; i < len(states); i++ {
		prev, s := states[i-1], states[i]
		if s.State != "Open" || (prev.State != "Closed" && prev.State != "Ramping") {
			continue
		}
		inOutage := false
		for j, at := range r.outages {
			inOutage = inOutage || (!s.Seen.Before(at) && j < len(r.recovery) && s.Seen.Before(r.recovery[j].Add(openSettle)))
		}
		if !inOutage {
			var sw string
			for _, x := range r.switches {
				if !x.at.After(s.Seen) {
					sw = fmt.Sprintf(" (the last manager switch before it: %s -> %s at %s)", x.from, x.to, x.at.Format("15:04:05.000"))
				}
			}
			return fmt.Errorf("the breaker opened with the dependency up: %s, then %s%s", prev, s, sw)
		}
	}
	return nil
}

// rollOrder is the order the workers roll in: alternating the kinds, so
// that each half holds Go and Python workers.
func rollOrder(specs []skewtest.WorkerSpec) []skewtest.WorkerSpec {
	var goW, pyW []skewtest.WorkerSpec
	for _, s := range specs {
		if s.Python {
			pyW = append(pyW, s)
		} else {
			goW = append(goW, s)
		}
	}
	var order []skewtest.WorkerSpec
	for i := range max(len(goW), len(pyW)) {
		if i < len(goW) {
			order = append(order, goW[i])
		}
		if i < len(pyW) {
			order = append(order, pyW[i])
		}
	}
	return order
}
