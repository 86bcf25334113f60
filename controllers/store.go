package controllers

import (
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/source"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// evaluation is the outcome of a policy's last evaluation. The evaluator
// keeps it in Evaluations for the policy reconciler, which writes it to
// status. It is a cache, not state: after a restart the evaluator fills it
// again from Redis within one interval.
type evaluation struct {
	// Published is what the evaluation published; after a failed one, what
	// the last successful one published.
	Published protocol.Published
	// Window is what workers reported over the breaker window.
	Window protocol.Window
	// At is when the evaluation ran, by the controller's clock. Only status
	// uses it; the evaluation decides by Redis time.
	At time.Time
	// Generation is the policy's generation the evaluation ran for.
	Generation int64
	// Err is why the evaluation failed, nil when it published.
	Err error
	// Signal is the status of the policy's external signal (Signals).
	Signal signalStatus
	// Fleet is which protocol versions the dependency's workers speak, and
	// FleetRead whether the evaluation could read it.
	Fleet     protocol.Fleet
	FleetRead bool
}

// Evaluations is what the Evaluator hands the PolicyReconciler: each policy's
// last evaluation, and a trigger when it changes what status shows. Build it
// with NewEvaluations and give the same one to both controllers.
type Evaluations struct {
	// last holds each policy's last evaluation, by its key.
	last sync.Map
	// triggers carries the policies whose evaluation changed to the policy
	// reconciler.
	triggers chan event.GenericEvent
	// gates holds each policy's *gate, by its key.
	gates sync.Map
	// hook, when set (by tests, before the controllers run), is called at
	// each step of a gate: "evaluate" before an evaluation takes it,
	// "evaluating" once it holds it, "release" before a release takes it and
	// "releasing" once it holds it.
	hook func(key types.NamespacedName, step string)
}

// gate serialises a policy's evaluations with the release of its fleet, so
// that no publish can land after the release: an evaluation either ends
// before the release reads the state, or finds the policy released and
// publishes nothing. It holds the UID of the policy whose fleet was
// released: a policy of the same name created afterwards evaluates again.
type gate struct {
	mu       sync.Mutex
	released types.UID
}

// NewEvaluations returns an empty store.
func NewEvaluations() *Evaluations {
	return &Evaluations{triggers: make(chan event.GenericEvent, 1024)}
}

// remember stores ev as the policy's last evaluation and reports whether it
// changes what status shows: the first evaluation, a new generation, a new
// state, limit, step or epoch, or a failure starting, ending or changing its
// reason. A failed evaluation that published nothing keeps the last
// published state.
func (s *Evaluations) remember(key types.NamespacedName, ev evaluation) bool {
	v, ok := s.last.Load(key)
	if !ok {
		s.last.Store(key, ev)
		return true
	}
	prev := v.(evaluation)
	published := ev.Published.State != ""
	if !published {
		ev.Published, ev.Window = prev.Published, prev.Window
	}
	s.last.Store(key, ev)
	if evalReason(prev.Err) != evalReason(ev.Err) || prev.Generation != ev.Generation || prev.Signal.Reason != ev.Signal.Reason ||
		ev.FleetRead && (!prev.FleetRead || prev.Fleet.Summary() != ev.Fleet.Summary()) {
		return true
	}
	p, n := prev.Published, ev.Published
	return published && (p.State != n.State || p.Limit != n.Limit || p.RampStep != n.RampStep || p.RampCeiling != n.RampCeiling || p.Epoch != n.Epoch)
}

// evaluating takes the policy's gate for one evaluation (read, plan,
// publish). ok is false when the policy's fleet was released (it is being
// deleted, whatever the evaluator's cache says): nothing may be published
// then. Otherwise call done once the publish is over.
func (s *Evaluations) evaluating(pol *spillwayv1alpha1.DependencyPolicy) (done func(), ok bool) {
	key := client.ObjectKeyFromObject(pol)
	s.step(key, "evaluate")
	g := s.gate(key)
	g.mu.Lock()
	if g.released == pol.UID {
		g.mu.Unlock()
		return nil, false
	}
	s.step(key, "evaluating")
	return g.mu.Unlock, true
}

// releasing takes the gate of a policy being deleted and marks it released:
// no evaluation of it publishes from then on. It waits for an evaluation in
// progress to end. Call done once the release is over.
func (s *Evaluations) releasing(pol *spillwayv1alpha1.DependencyPolicy) (done func()) {
	key := client.ObjectKeyFromObject(pol)
	s.step(key, "release")
	g := s.gate(key)
	g.mu.Lock()
	g.released = pol.UID
	s.step(key, "releasing")
	return g.mu.Unlock
}

// forgetGate drops the gate of a policy that is gone from the evaluator's
// cache: no evaluation of it can start any more.
func (s *Evaluations) forgetGate(key types.NamespacedName) {
	s.gates.Delete(key)
}

func (s *Evaluations) gate(key types.NamespacedName) *gate {
	g, _ := s.gates.LoadOrStore(key, &gate{})
	return g.(*gate)
}

func (s *Evaluations) step(key types.NamespacedName, step string) {
	if s.hook != nil {
		s.hook(key, step)
	}
}

// lastEvaluation is the policy's last evaluation, if any since the manager
// started.
func (s *Evaluations) lastEvaluation(key types.NamespacedName) (evaluation, bool) {
	v, ok := s.last.Load(key)
	if !ok {
		return evaluation{}, false
	}
	return v.(evaluation), true
}

// forget drops the policy's last evaluation.
func (s *Evaluations) forget(key types.NamespacedName) {
	s.last.Delete(key)
}

// trigger asks the policy reconciler to reconcile pol now. It never blocks:
// when the channel is full the periodic reconcile catches up.
func (s *Evaluations) trigger(pol *spillwayv1alpha1.DependencyPolicy) {
	select {
	case s.triggers <- event.GenericEvent{Object: pol}:
	default:
	}
}

// source is the policy reconciler's source of the triggered policies.
func (s *Evaluations) source() source.Source {
	return source.Channel(s.triggers, &handler.EnqueueRequestForObject{})
}
