package controllers

import (
	"context"
	"encoding/json"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/config/crd"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestObservedGenerationFollowsTheEvaluator: a spec change made while Redis
// is hung is not observed until the evaluator has published it.
func TestObservedGenerationFollowsTheEvaluator(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "orders")
	createPolicy(t, ns, "orders", testSpec())
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	observed := func(g Gomega) int64 { return getPolicy(g, ns, "orders").Status.ObservedGeneration }
	g.Eventually(observed).Should(Equal(int64(1)))

	g.Expect(srv.Pause()).To(Succeed())
	g.Eventually(conditionOf(ns, "orders", ConditionReady)).Should(Equal("False/RedisUnavailable"))
	pol := getPolicy(g, ns, "orders")
	patch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Capacity.Concurrency = 80
	g.Expect(env.Client.Patch(ctx, pol, patch)).To(Succeed())
	g.Expect(pol.Generation).To(Equal(int64(2)))
	g.Consistently(observed).WithTimeout(2*time.Second).Should(Equal(int64(1)),
		"generation 2 is not observed while it cannot be published")

	g.Expect(srv.Resume()).To(Succeed())
	g.Eventually(observed).Should(Equal(int64(2)))
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/80"), "published before it was observed")
	g.Eventually(conditionOf(ns, "orders", ConditionReady)).Should(Equal("True/Evaluated"))
}

// legacyMinCalls marks, in TestInvalidEditDuringOutageKeepsOpen, a spec as one
// the API server stored under an older, looser schema: legacyClient reads a
// policy whose breaker.minCalls is legacyMinCalls as minCalls 0, which the
// current schema refuses and the controller cannot use.
const legacyMinCalls = 999_999

// legacyClient is the manager's client, reading policies marked with
// legacyMinCalls with minCalls 0.
type legacyClient struct{ client.Client }

func (c legacyClient) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	if err := c.Client.Get(ctx, key, obj, opts...); err != nil {
		return err
	}
	if pol, ok := obj.(*spillwayv1alpha1.DependencyPolicy); ok && pol.Spec.Breaker.MinCalls == legacyMinCalls {
		pol.Spec.Breaker.MinCalls = 0
	}
	return nil
}

// TestInvalidEditDuringOutageKeepsOpen: a policy whose spec became unusable
// while its breaker was Open is Stalled and its new generation is observed,
// but the fleet is not sent at the failing dependency: nothing is published,
// Redis keeps Open, status says so (Stalled, LastStateKept), and once the
// dead-man bound has passed workers admit halfOpenProbes calls at a time. A
// fixed spec runs the breaker again.
func TestInvalidEditDuringOutageKeepsOpen(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	opts := testOptions
	opts.StaleAfter = 2 * time.Second
	startManagerWrapped(t, ns, managerRedis(srv), opts, func(c client.Client) client.Client { return legacyClient{c} })
	w := newWorker(t, srv, ns, "legacy")
	spec := testSpec()
	spec.Breaker.OpenDuration.Duration = 3 * time.Second
	createPolicy(t, ns, "legacy", spec)
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	w.report(g, minCalls, protocol.Failure)
	g.Eventually(w.stateLimit()).WithPolling(5 * time.Millisecond).Should(Equal("Open/0"))
	// The Open under test is the manager's: wait for it to take over a trip
	// the workers may have made (one it never takes over ends by the
	// workers' probes, pkg/protocol TestOrphanTripEndsByItself).
	g.Eventually(func(g Gomega) bool { return w.published(g).TripPending() }).Should(BeFalse())

	pol := getPolicy(g, ns, "legacy")
	patch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Breaker.MinCalls = legacyMinCalls
	g.Expect(env.Client.Patch(ctx, pol, patch)).To(Succeed())
	g.Eventually(conditionOf(ns, "legacy", ConditionStalled)).Should(Equal("True/" + ReasonLastStateKept))
	g.Expect(conditionIn(getPolicy(g, ns, "legacy"), ConditionStalled).Message).To(ContainSubstring("Open with limit 0"))
	g.Eventually(conditionOf(ns, "legacy", ConditionReady)).Should(Equal("False/InvalidSpec"))
	g.Eventually(func(g Gomega) int64 { return getPolicy(g, ns, "legacy").Status.ObservedGeneration }).Should(Equal(pol.Generation))
	g.Expect(getPolicy(g, ns, "legacy").Status.State).To(Equal(spillwayv1alpha1.StateOpen))

	held := w.published(g)
	g.Expect(held.State).To(Equal(wire.Open), "an invalid edit published over the outage: %+v", held)
	g.Consistently(func(g Gomega) protocol.Published { return w.published(g) }).WithTimeout(time.Second).
		Should(Equal(held), "nothing is published while the spec cannot be used")

	// The dead-man trickle: refused until the bound, then halfOpenProbes at
	// a time.
	stale := held.UpdatedAt.Add(held.StaleAfter)
	acquire := func() protocol.Admission {
		adm, err := w.c.Acquire(ctx, protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Minute})
		g.Expect(err).NotTo(HaveOccurred())
		return adm
	}
	var first protocol.Admission
	g.Eventually(func() protocol.Code {
		first = acquire()
		return first.Code
	}).WithTimeout(15 * time.Second).WithPolling(20 * time.Millisecond).Should(Equal(protocol.Admitted))
	g.Expect(time.Now()).To(BeTemporally(">=", stale.Add(-50*time.Millisecond)), "admitted before the dead-man bound")
	g.Expect(acquire().Code).To(Equal(protocol.Admitted))
	g.Expect(acquire().Code).To(Equal(protocol.Admitted))
	g.Expect(acquire().Code).NotTo(Equal(protocol.Admitted), "a fourth call while three are in flight")
	g.Expect(w.published(g)).To(Equal(held), "still nothing published")

	pol = getPolicy(g, ns, "legacy")
	patch = client.MergeFrom(pol.DeepCopy())
	pol.Spec.Breaker.MinCalls = minCalls
	g.Expect(env.Client.Patch(ctx, pol, patch)).To(Succeed())
	g.Eventually(conditionOf(ns, "legacy", ConditionStalled)).Should(Equal("absent"))
	g.Eventually(conditionOf(ns, "legacy", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"), "the breaker runs again")
}

// crdMaximum is the maximum the served schema sets on a property path
// (dot-separated, "items" for a list's elements), or false.
func crdMaximum(t *testing.T, path ...string) (float64, bool) {
	t.Helper()
	var def apiextensionsv1.CustomResourceDefinition
	if err := yaml.Unmarshal(crd.DependencyPolicyCRD, &def); err != nil {
		t.Fatalf("failed to parse the CRD: %v", err)
	}
	s := def.Spec.Versions[0].Schema.OpenAPIV3Schema
	for _, p := range path {
		if p == "items" {
			s = s.Items.Schema
			continue
		}
		prop, ok := s.Properties[p]
		if !ok {
			t.Fatalf("the CRD has no property %q in %v", p, path)
		}
		s = &prop
	}
	if s.Maximum == nil {
		return 0, false
	}
	return *s.Maximum, true
}

// TestBoundsAtTheMaxima: with three consumers at every maximum the API
// server accepts, and with random consumers anywhere within those maxima (up
// to the 32 the list holds), Bounds is the exact floor(capacity × weight /
// Σweights / slotsPerReplica), at least 1: nothing overflows.
func TestBoundsAtTheMaxima(t *testing.T) {
	g := NewWithT(t)
	maximum := func(path ...string) int64 {
		if m, ok := crdMaximum(t, path...); ok {
			return int64(m)
		}
		return math.MaxInt32 // what the int32 field holds without one
	}
	capacity := maximum("spec", "capacity", "concurrency")
	weight := maximum("spec", "consumers", "items", "weight")
	slots := maximum("spec", "consumers", "items", "slotsPerReplica")
	t.Logf("Maxima: concurrency %d, weight %d, slotsPerReplica %d", capacity, weight, slots)

	check := func(c int64, consumers []spillwayv1alpha1.Consumer) {
		total := big.NewInt(0)
		for _, k := range consumers {
			total.Add(total, big.NewInt(int64(k.Weight)))
		}
		got := Bounds(c, consumers)
		for i, k := range consumers {
			num := new(big.Int).Mul(big.NewInt(c), big.NewInt(int64(k.Weight)))
			den := new(big.Int).Mul(total, big.NewInt(int64(k.SlotsPerReplica)))
			want := min(max(new(big.Int).Quo(num, den).Int64(), 1), math.MaxInt32)
			g.Expect(got[i]).To(Equal(int32(want)), "capacity %d, consumer %d of %+v", c, i, consumers)
		}
	}
	at := func(w, s int64) spillwayv1alpha1.Consumer {
		return spillwayv1alpha1.Consumer{Weight: int32(w), SlotsPerReplica: int32(s)}
	}
	for _, consumers := range [][]spillwayv1alpha1.Consumer{
		{at(weight, slots), at(weight, slots), at(weight, slots)},
		{at(weight, 1), at(1, slots), at(weight, slots)},
		{at(weight, 1), at(1, 1), at(1, 1)},
	} {
		for _, c := range []int64{capacity, 1, 40} {
			check(c, consumers)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		consumers := make([]spillwayv1alpha1.Consumer, 1+rng.IntN(32))
		for i := range consumers {
			consumers[i] = at(1+rng.Int64N(weight), 1+rng.Int64N(slots))
		}
		check(1+rng.Int64N(capacity), consumers)
	}
}

// startManagerWrapped is startManager with the reconciler's client, the
// manager's, wrapped by wrap.
func startManagerWrapped(t testing.TB, ns string, rdb redis.UniversalClient, opts Options, wrap func(client.Client) client.Client) {
	t.Helper()
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatalf("failed to create the manager: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := wrap(mgr.GetClient())
	e := &Evaluator{Client: c, Redis: rdb, Options: opts}
	p := &PolicyReconciler{Client: c, Redis: rdb, Options: opts}
	if err := setupControllers(ctx, mgr, e, p); err != nil {
		cancel()
		t.Fatalf("failed to set up the controller: %v", err)
	}
	m := &testManager{cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- mgr.Start(ctx) }()
	t.Cleanup(func() { m.stop(t) })
}

func TestStatusDue(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	at := func(d time.Duration) *metav1.Time { return &metav1.Time{Time: now.Add(d)} }
	base := spillwayv1alpha1.DependencyPolicyStatus{
		State: spillwayv1alpha1.StateClosed, CurrentLimit: 40, RampStep: 3, ObservedGeneration: 1,
		LastTransitionTime: at(-time.Hour),
		Window:             spillwayv1alpha1.ObservedWindow{Calls: 10, ObservedAt: at(-5 * time.Second)},
		Conditions:         []metav1.Condition{{Type: ConditionReady, Status: metav1.ConditionTrue, Reason: ReasonEvaluated, Message: "m"}},
	}
	tests := []struct {
		name   string
		change func(*spillwayv1alpha1.DependencyPolicyStatus)
		want   bool
	}{
		{name: "nothing changed", change: func(*spillwayv1alpha1.DependencyPolicyStatus) {}, want: false},
		{name: "fresh window counts wait", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) {
			s.Window = spillwayv1alpha1.ObservedWindow{Calls: 99, Failures: 3, ObservedAt: at(0)}
		}, want: false},
		{name: "a window reported 5s ago is not refreshed", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) {
			s.Window.ObservedAt = at(0)
			s.Window.Calls = 10
		}, want: false},
		{name: "state", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) { s.State = spillwayv1alpha1.StateOpen }, want: true},
		{name: "limit", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) { s.CurrentLimit = 20 }, want: true},
		{name: "step", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) { s.RampStep = 1 }, want: true},
		{name: "generation", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) { s.ObservedGeneration = 2 }, want: true},
		{name: "condition message", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) {
			s.Conditions = []metav1.Condition{{Type: ConditionReady, Status: metav1.ConditionTrue, Reason: ReasonEvaluated, Message: "other"}}
		}, want: true},
		{name: "new condition", change: func(s *spillwayv1alpha1.DependencyPolicyStatus) {
			s.Conditions = append(s.Conditions, metav1.Condition{Type: ConditionRamping})
		}, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cur := *base.DeepCopy()
			tt.change(&cur)
			if got := statusDue(base, cur, now, 10*time.Second); got != tt.want {
				t.Errorf("statusDue = %v, want %v", got, tt.want)
			}
		})
	}

	t.Run("new counts reported more than the interval ago are refreshed", func(t *testing.T) {
		old := *base.DeepCopy()
		old.Window.ObservedAt = at(-11 * time.Second)
		cur := *old.DeepCopy()
		cur.Window.ObservedAt = at(0)
		cur.Window.Failures = 4
		if !statusDue(old, cur, now, 10*time.Second) {
			t.Error("statusDue = false, want true")
		}
	})
	t.Run("unchanged counts are not rewritten however old", func(t *testing.T) {
		old := *base.DeepCopy()
		old.Window.ObservedAt = at(-time.Hour)
		cur := *old.DeepCopy()
		cur.Window.ObservedAt = at(0)
		if statusDue(old, cur, now, 10*time.Second) {
			t.Error("statusDue = true, want false")
		}
	})
	t.Run("the status interval is spread by policy", func(t *testing.T) {
		seen := map[time.Duration]bool{}
		for _, uid := range []types.UID{"a", "b", "c", "d"} {
			d := statusInterval(&spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{UID: uid}}, 10*time.Second)
			if d < 5*time.Second || d >= 10*time.Second {
				t.Errorf("statusInterval(%s) = %v, want in [5s, 10s)", uid, d)
			}
			seen[d] = true
		}
		if len(seen) < 3 {
			t.Errorf("statusInterval gives %d distinct values for 4 policies, want them spread", len(seen))
		}
	})
	t.Run("the first window is written", func(t *testing.T) {
		old := *base.DeepCopy()
		old.Window.ObservedAt = nil
		cur := *base.DeepCopy()
		if !statusDue(old, cur, now, 10*time.Second) {
			t.Error("statusDue = false, want true")
		}
	})
}

// The status field's CRD type and enum hold exactly the fleet's states, with
// the same strings, so apiState and wireState convert without a table.
func TestAPIStatesAreWireStates(t *testing.T) {
	g := NewWithT(t)
	pairs := []struct {
		api  spillwayv1alpha1.DependencyState
		wire wire.State
	}{
		{spillwayv1alpha1.StateClosed, wire.Closed},
		{spillwayv1alpha1.StateOpen, wire.Open},
		{spillwayv1alpha1.StateHalfOpen, wire.HalfOpen},
		{spillwayv1alpha1.StateRamping, wire.Ramping},
	}
	var wantEnum []string
	for _, p := range pairs {
		g.Expect(apiState(p.wire)).To(Equal(p.api))
		g.Expect(wireState(p.api)).To(Equal(p.wire))
		g.Expect(p.wire.Valid()).To(BeTrue())
		wantEnum = append(wantEnum, string(p.wire))
	}

	var def apiextensionsv1.CustomResourceDefinition
	g.Expect(yaml.Unmarshal(crd.DependencyPolicyCRD, &def)).To(Succeed())
	state := def.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"].Properties["state"]
	var enum []string
	for _, v := range state.Enum {
		var s string
		g.Expect(json.Unmarshal(v.Raw, &s)).To(Succeed())
		enum = append(enum, s)
	}
	g.Expect(enum).To(ConsistOf(wantEnum), "the CRD's status.state enum")
}
