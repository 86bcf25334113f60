package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// EventSafeState (Warning): the spec of a policy cannot be used and its
// fleet was published in the safe state (see safeState).
const EventSafeState = "SafeState"

// releasedState is what a deleted policy leaves in Redis: Closed at full
// capacity, so no fleet stays held at the limit of an outage by a policy that
// no longer exists. Workers refuse to call a dependency with no state in
// Redis, so the state is written rather than deleted, also when Redis holds
// none (it lost its data). prev and found are what Redis holds; params are
// the policy's, when its spec is valid (paramsErr nil).
//
// The parameters are the spec's; with an unusable spec, the ones last
// published. The epoch is two past the stored one: an evaluation still in
// flight, which publishes at most one past it, is refused.
func releasedState(params policy.Params, paramsErr error, prev protocol.Published, found bool, now time.Time) (protocol.Published, error) {
	next := prev
	switch {
	case paramsErr == nil:
		next.Capacity = params.Capacity
		next.RatePerSecond = params.RatePerSecond
		next.Backoff = params.Backoff
		next.Budget = params.Budget
		next.BreakerWindow = params.Breaker.Window
		next.RampStep = len(params.Ramp.Steps) - 1
	case !found:
		return protocol.Published{}, errors.New("the spec is invalid and Redis holds no state to release the fleet from")
	}
	return closedAtCapacity(next, now, prev.Epoch+2), nil
}

// closedAtCapacity is p published Closed at its full capacity from now, at
// epoch: what a deleted policy and an unusable spec both leave the fleet in.
func closedAtCapacity(p protocol.Published, now time.Time, epoch int64) protocol.Published {
	p.State, p.Limit = protocol.Closed, p.Capacity
	p.OpenUntil, p.BreakerSince, p.RampStepStarted = time.Time{}, now, now
	p.Epoch = epoch
	return p
}

// safeState is what the evaluator publishes for a policy whose spec cannot
// be turned into parameters (Stalled): Closed at the capacity last
// published, with the parameters last published. The breaker and the ramp
// cannot run without a valid spec; holding the fleet Open or HalfOpen until
// someone fixes the spec would strand it, so the fleet is bounded by the
// capacity alone, as after a deletion. It reports false when prev already is
// that state. A state change takes the next epoch, as a transition does.
func safeState(prev protocol.Published, now time.Time) (protocol.Published, bool) {
	if prev.State == protocol.Closed && prev.Limit == prev.Capacity {
		return prev, false
	}
	return closedAtCapacity(prev, now, prev.Epoch+1), true
}

// evaluateInvalid is the evaluator's run for a policy whose spec cannot be
// turned into parameters: it publishes safeState every interval (so the
// state stays fresh in Redis), records an InvalidSpec evaluation carrying
// what it published for the policy reconciler, which marks the policy
// Stalled, and reports the change as an Event. With no state in Redis there
// is no capacity to publish: nothing is written and workers defer their
// calls until the spec is fixed.
func (r *DependencyPolicyReconciler) evaluateInvalid(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, specErr error) (ctrl.Result, error) {
	key := client.ObjectKeyFromObject(pol)
	now := r.Clock.Now()
	ev := evaluation{At: now, Generation: pol.Generation, Err: &evalError{reason: ReasonInvalidSpec, err: fmt.Errorf("invalid spec: %w", specErr)}}
	err := func() error {
		pc, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: pol.Namespace, Name: pol.Name})
		if err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, r.Options.RedisTimeout)
		defer cancel()
		// Stamped with Redis's time, as every evaluation is: the manager's
		// clock may be off.
		prev, found, redisNow, err := pc.ReadPublishedAt(rctx)
		if err != nil || !found {
			return err
		}
		next, changed := safeState(prev, redisNow)
		if _, err := pc.Publish(rctx, next); err != nil {
			return err
		}
		if changed {
			ctrl.LoggerFrom(ctx).Info("Published the safe state of a policy whose spec cannot be used", "from", prev.State, "limit", next.Limit, "epoch", next.Epoch)
			r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, EventSafeState, "Evaluate",
				"The spec cannot be used: published Closed at the capacity last published (%d) instead of %s until the spec is fixed", next.Limit, prev.State)
			recordState(key, next)
		}
		ev.Published = next
		return nil
	}()
	if r.remember(key, ev) {
		r.trigger(pol)
	}
	if err != nil {
		reconcileErrors.WithLabelValues(ReasonRedisUnavailable).Inc()
		ctrl.LoggerFrom(ctx).V(1).Info("Failed to publish the safe state of an invalid policy", "error", err.Error())
		return ctrl.Result{RequeueAfter: jitter(r.evalBackoff.When(key)), Priority: ptr.To(evaluationPriority)}, nil
	}
	r.evalBackoff.Forget(key)
	return ctrl.Result{RequeueAfter: r.Options.EvaluationInterval, Priority: ptr.To(evaluationPriority)}, nil
}
