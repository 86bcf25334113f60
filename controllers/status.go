package controllers

import (
	"context"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// updateStatus writes to pol's status what the policy reconciler observed,
// through the pure condition functions of conditions.go:
//
//   - a policy being deleted: ReleasePending while its fleet cannot be
//     released in Redis;
//   - an invalid spec: Ready False and Stalled, the generation observed (it
//     will not get further until the spec changes), and the state the fleet
//     keeps, which the evaluator read;
//   - otherwise the last evaluation (the generation is observed once the
//     evaluator published it), ConsumersBounded, Ready as their summary,
//     BreakerOpen and Ramping.
func updateStatus(pol *spillwayv1alpha1.DependencyPolicy, obs *observed) {
	ev, current := obs.Evaluation, obs.current(pol)
	switch {
	case obs.Deleting:
		if obs.ReleaseErr != nil {
			setCondition(pol, releasePendingCondition(obs.ReleaseErr))
		}
		return
	case obs.SpecErr != nil:
		setCondition(pol, readyCondition(invalidSpecError(obs.SpecErr), protocol.Published{}))
		var held protocol.Published
		if current {
			held = ev.Published
		}
		setCondition(pol, stalledCondition(obs.SpecErr, held))
		pol.Status.ObservedGeneration = pol.Generation
		if held.State != "" {
			setPublishedStatus(&pol.Status, ev.Published, ev.Window, ev.At)
			setCondition(pol, breakerOpenCondition(ev.Published.State, ev.Published.OpenUntil, 0))
			setCondition(pol, rampingCondition(ev.Published.State, ev.Published.RampStep, ev.Published.Limit, ev.Published.RampCeiling, nil))
		}
		return
	}
	meta.RemoveStatusCondition(&pol.Status.Conditions, ConditionStalled)

	var ready metav1.Condition
	switch {
	case obs.Evaluated:
		ready = readyCondition(ev.Err, ev.Published)
		if ev.Err == nil {
			setPublishedStatus(&pol.Status, ev.Published, ev.Window, ev.At)
		}
	case meta.FindStatusCondition(pol.Status.Conditions, ConditionReady) != nil:
		ready = *meta.FindStatusCondition(pol.Status.Conditions, ConditionReady)
	default:
		ready = metav1.Condition{Type: ConditionReady, Status: metav1.ConditionUnknown, Reason: ReasonNotEvaluated, Message: "The policy has not been evaluated yet"}
	}
	if current && ev.Err == nil {
		pol.Status.ObservedGeneration = pol.Generation
	}

	if obs.WorkloadsKnown {
		pol.Status.Workloads = nil
		for _, w := range obs.Workloads {
			pol.Status.Workloads = append(pol.Status.Workloads, w.spec())
		}
	}
	state := wireState(pol.Status.State)
	consumers := consumersBoundedCondition(obs.Consumers)
	setCondition(pol, consumers)
	ready = readySummary(ready, consumers)
	if obs.Evaluated {
		ready = readyWithSignals(ready, ev.Signal)
		setSignalsCondition(pol, ev.Signal)
		if ev.FleetRead {
			setCondition(pol, workersServedCondition(ev.Fleet))
		}
	}
	setCondition(pol, ready)
	openUntil := time.Time{}
	if obs.Evaluated && ev.Published.State == wire.Open {
		openUntil = ev.Published.OpenUntil
	}
	setCondition(pol, breakerOpenCondition(state, openUntil, obs.Params.Breaker.HalfOpenProbes))
	setCondition(pol, rampingCondition(state, int(pol.Status.RampStep), int64(pol.Status.CurrentLimit), int64(pol.Status.RampCeiling), obs.Params.Ramp.Steps))
}

// setCondition sets c on pol's status at pol's generation.
func setCondition(pol *spillwayv1alpha1.DependencyPolicy, c metav1.Condition) {
	c.ObservedGeneration = pol.Generation
	meta.SetStatusCondition(&pol.Status.Conditions, c)
}

// patchStatus writes pol's status when it differs from base in a way worth a
// write (see statusDue).
func (r *PolicyReconciler) patchStatus(ctx context.Context, base, pol *spillwayv1alpha1.DependencyPolicy) error {
	if !statusDue(base.Status, pol.Status, r.Clock.Now(), statusInterval(pol, r.Options.StatusInterval)) {
		return nil
	}
	if err := r.Client.Status().Patch(ctx, pol, client.MergeFrom(base)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("failed to patch the status of %s: %w", klog.KObj(pol), err)
	}
	return nil
}

// statusDue reports whether a status is worth writing. The evaluator
// evaluates every policy every second; writing status each time would cost
// the API server a write per policy per second for counts nobody reads at
// that rate. So status is written when the state, the limit, the ramp step,
// the last transition, the observed generation or a condition changed, which
// are what people and tools act on, and otherwise only when the window counts
// changed and the window in status was observed at least interval ago, so the
// counts in status are never more than interval behind.
func statusDue(old, cur spillwayv1alpha1.DependencyPolicyStatus, now time.Time, interval time.Duration) bool {
	switch {
	case old.State != cur.State,
		old.CurrentLimit != cur.CurrentLimit,
		old.RampStep != cur.RampStep,
		old.RampCeiling != cur.RampCeiling,
		old.ObservedGeneration != cur.ObservedGeneration,
		!timesEqual(old.LastTransitionTime, cur.LastTransitionTime),
		!slices.Equal(old.Workloads, cur.Workloads),
		!conditionsEqual(old.Conditions, cur.Conditions):
		return true
	}
	if old.Window.Calls == cur.Window.Calls && old.Window.Failures == cur.Window.Failures && old.Window.Retries == cur.Window.Retries {
		return old.Window.ObservedAt == nil && cur.Window.ObservedAt != nil
	}
	return old.Window.ObservedAt == nil || now.Sub(old.Window.ObservedAt.Time) >= interval
}

// statusInterval spreads the status interval over [interval/2, interval) by
// the policy's UID, so that policies created together do not all refresh
// their status in the same second.
func statusInterval(pol *spillwayv1alpha1.DependencyPolicy, interval time.Duration) time.Duration {
	h := fnv.New32a()
	_, _ = h.Write([]byte(pol.UID))
	return interval/2 + time.Duration(float64(interval/2)*float64(h.Sum32())/float64(math.MaxUint32+1))
}

// apiState and wireState are the one place the controller converts between
// the fleet's state (wire.State, as Redis and the control law hold it) and the
// status field's CRD type; their strings are the same, which
// TestAPIStatesAreWireStates pins.
func apiState(s wire.State) spillwayv1alpha1.DependencyState {
	return spillwayv1alpha1.DependencyState(s)
}

func wireState(s spillwayv1alpha1.DependencyState) wire.State { return wire.State(s) }

// setPublishedStatus records a publication and its window in st, at the
// seconds' precision status is stored with.
func setPublishedStatus(st *spillwayv1alpha1.DependencyPolicyStatus, p protocol.Published, w protocol.Window, at time.Time) {
	st.State = apiState(p.State)
	st.CurrentLimit = int32(min(p.Limit, math.MaxInt32))
	st.RampStep = int32(p.RampStep)
	st.RampCeiling = int32(min(p.RampCeiling, math.MaxInt32))
	st.LastTransitionTime = &metav1.Time{Time: transitionTime(p).Truncate(time.Second)}
	st.Window = spillwayv1alpha1.ObservedWindow{
		Calls:      w.Calls,
		Failures:   w.Failures + w.Timeouts,
		Retries:    w.Retries(),
		ObservedAt: &metav1.Time{Time: at.Truncate(time.Second)},
	}
}

// transitionTime is when the published state last changed: when the breaker
// last changed state, or, for a ramp that completed, when it reached its last
// step. It comes from Redis, so it is exact after a restart too.
func transitionTime(p protocol.Published) time.Time {
	if p.State == wire.Closed && p.RampStepStarted.After(p.BreakerSince) {
		return p.RampStepStarted
	}
	return p.BreakerSince
}

func timesEqual(a, b *metav1.Time) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

// conditionsEqual compares conditions by what they say, ignoring their
// transition times, which change only with their status anyway.
func conditionsEqual(a, b []metav1.Condition) bool {
	if len(a) != len(b) {
		return false
	}
	for _, c := range a {
		o := meta.FindStatusCondition(b, c.Type)
		if o == nil || o.Status != c.Status || o.Reason != c.Reason || o.Message != c.Message || o.ObservedGeneration != c.ObservedGeneration {
			return false
		}
	}
	return true
}
