package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// evaluation is the outcome of a policy's last evaluation. The evaluator
// keeps it in memory for the policy reconciler, which writes it to status. It
// is a cache, not state: after a restart the evaluator fills it again from
// Redis within one interval.
type evaluation struct {
	// Published is what the evaluation published; after a failed one, what
	// the last successful one published.
	Published protocol.Published
	// Window is what workers reported over the breaker window.
	Window protocol.Window
	// At is when the evaluation ran, by the controller's clock. Only status
	// uses it; the evaluation decides by Redis time.
	At time.Time
	// Err is why the evaluation failed, nil when it published.
	Err error
}

// Evaluate is the evaluator's reconcile: every interval it reads the
// policy's state and window from Redis, plans and publishes, and reports the
// transitions as Events and metrics. It writes nothing to the API server but
// Events, which are sent in the background, so a slow or throttled API
// server never delays a limit. When the outcome changes it triggers the
// policy reconciler, which writes status and bounds the consumers.
func (r *DependencyPolicyReconciler) Evaluate(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	key := req.NamespacedName
	pol := &spillwayv1alpha1.DependencyPolicy{}
	if err := r.Client.Get(ctx, key, pol); err != nil {
		if apierrors.IsNotFound(err) {
			r.evaluations.Delete(key)
			r.evalBackoff.Forget(key)
			forgetPolicy(key)
			return ctrl.Result{}, nil
		}
		reconcileErrors.WithLabelValues(ReasonKubernetesAPI).Inc()
		return ctrl.Result{}, fmt.Errorf("failed to get DependencyPolicy %s: %w", key, err)
	}
	if !pol.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	params, err := policy.FromSpec(pol.Spec)
	if err != nil {
		// The policy reconciler reports it; a new spec brings the policy back.
		return ctrl.Result{}, nil
	}

	ev := r.evaluate(ctx, pol, params, r.Clock.Now())
	changed := r.remember(key, ev)
	if changed {
		r.trigger(pol)
	}
	if ev.Err != nil {
		reason := evalReason(ev.Err)
		reconcileErrors.WithLabelValues(reason).Inc()
		// The failure is logged when it starts or changes, and quietly while
		// it lasts: in a Redis outage every policy fails.
		log := ctrl.LoggerFrom(ctx)
		if changed {
			log.Error(ev.Err, "Failed to evaluate the policy; workers keep the last published limit", "reason", reason)
		} else {
			log.V(1).Info("Evaluation still failing", "reason", reason, "error", ev.Err.Error())
		}
		return ctrl.Result{RequeueAfter: jitter(r.evalBackoff.When(key)), Priority: ptr.To(evaluationPriority)}, nil
	}
	if changed {
		ctrl.LoggerFrom(ctx).V(1).Info("Evaluated", "state", ev.Published.State, "limit", ev.Published.Limit, "epoch", ev.Published.Epoch)
	}
	r.evalBackoff.Forget(key)
	return ctrl.Result{RequeueAfter: r.Options.EvaluationInterval, Priority: ptr.To(evaluationPriority)}, nil
}

// evaluationPriority is the one priority of every evaluation. Without it,
// policies that existed when the manager started would keep the low priority
// of the initial list, and be evaluated after newer ones under load.
const evaluationPriority = 0

// DeadManIntervals is N of the dead-man rule: a state published more than N
// evaluation intervals ago (and at least MinStaleAfter) is stale, and workers
// treat a stale Open as HalfOpen (docs/protocol.md §3, the dead-man rule).
const DeadManIntervals = 30

// MinStaleAfter is the dead-man rule's floor. A manager that crashes hands
// over to another replica within the leader-election lease (15 s by default)
// plus its start: the rule must not fire during an ordinary handover.
const MinStaleAfter = 30 * time.Second

// StaleAfter is the dead-man bound for an evaluation interval:
// DeadManIntervals intervals, at least MinStaleAfter.
func StaleAfter(interval time.Duration) time.Duration {
	return max(DeadManIntervals*interval, MinStaleAfter)
}

// staleAfter is the dead-man bound the evaluator publishes: Options.StaleAfter,
// or StaleAfter(EvaluationInterval) when unset, or 0 (the rule off) when
// negative.
func (o Options) staleAfter() time.Duration {
	switch {
	case o.StaleAfter < 0:
		return 0
	case o.StaleAfter > 0:
		return o.StaleAfter
	}
	return StaleAfter(o.EvaluationInterval)
}

// evaluate reads the policy's state and window from Redis, plans, publishes
// the plan and reports its transitions. On an error nothing is published.
//
// It plans by Redis time, never by the manager's clock (at is only recorded
// for status): workers count outcomes in Redis seconds and the scripts
// compare the times it publishes with Redis's, so a manager whose node is
// ahead of Redis would read an empty window and never open the breaker, and
// one behind would count the failures that opened it again once it closed.
//
// The plan carries the sequence number of the state it was made from, so that
// Redis refuses it if another manager published meanwhile
// (protocol.ErrStaleSequence); the evaluation then fails with
// ReasonStaleEpoch and the next one, an interval or more later, re-reads.
func (r *DependencyPolicyReconciler) evaluate(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, params policy.Params, at time.Time) evaluation {
	log := ctrl.LoggerFrom(ctx)
	failed := func(reason string, err error) evaluation {
		return evaluation{At: at, Err: &evalError{reason: reason, err: err}}
	}
	pc, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: pol.Namespace, Name: pol.Name})
	if err != nil {
		return failed(ReasonInvalidSpec, err)
	}

	rctx, cancel := context.WithTimeout(ctx, r.Options.RedisTimeout)
	prev, found, now, err := pc.ReadPublishedAt(rctx)
	cancel()
	if err != nil {
		return failed(ReasonRedisUnavailable, err)
	}
	if !found {
		prev = RestoreFromStatus(pol.Status, params, now)
		log.Info("Redis holds no state for the policy: continuing from status", "state", prev.State, "rampStep", prev.RampStep)
	}

	// Workers count outcomes in whole seconds and ReadWindow sums the seconds
	// after from: starting one second early counts the second of the last
	// transition whole. Otherwise failures reported in the second a breaker
	// closed, or a policy was created, would never be counted; the calls of
	// that second from before the transition are the probes that closed it.
	from := WindowStart(params, prev, now).Add(-time.Second)
	rctx, cancel = context.WithTimeout(ctx, r.Options.RedisTimeout)
	window, probes, redisNow, err := pc.ReadWindow(rctx, params.Breaker.Window, from)
	cancel()
	if err != nil {
		return failed(ReasonRedisUnavailable, err)
	}

	out := Plan(PlanInput{Params: params, Previous: prev, Window: window, Probes: probes, Now: redisNow, StaleAfter: r.Options.staleAfter()})

	rctx, cancel = context.WithTimeout(ctx, r.Options.RedisTimeout)
	_, err = pc.Publish(rctx, out.Next)
	cancel()
	switch {
	case errors.Is(err, protocol.ErrStaleEpoch), errors.Is(err, protocol.ErrStaleSequence):
		return failed(ReasonStaleEpoch, err)
	case err != nil:
		return failed(ReasonRedisUnavailable, err)
	}

	if found {
		observeLag(prev.UpdatedAt, redisNow, r.Options.EvaluationInterval)
	}
	recordState(client.ObjectKeyFromObject(pol), out.Next)
	for _, t := range out.Transitions {
		eventType := corev1.EventTypeNormal
		if t.Reason == EventOpened {
			eventType = corev1.EventTypeWarning
		}
		r.Recorder.Eventf(pol, nil, eventType, t.Reason, "Evaluate", "%s", t.Message)
		if t.From != t.To {
			transitionsTotal.WithLabelValues(string(t.From), string(t.To)).Inc()
		}
		log.Info("Policy "+t.Reason, "from", t.From, "to", t.To, "limit", out.Next.Limit, "epoch", out.Next.Epoch, "message", t.Message)
	}
	return evaluation{Published: out.Next, Window: window, At: at}
}

// remember stores ev as the policy's last evaluation and reports whether it
// changes what status shows: the first evaluation, a new state, limit, step
// or epoch, or a failure starting, ending or changing its reason. A failed
// evaluation keeps the last published state.
func (r *DependencyPolicyReconciler) remember(key types.NamespacedName, ev evaluation) bool {
	v, ok := r.evaluations.Load(key)
	if !ok {
		r.evaluations.Store(key, ev)
		return true
	}
	prev := v.(evaluation)
	if ev.Err != nil {
		ev.Published, ev.Window = prev.Published, prev.Window
	}
	r.evaluations.Store(key, ev)
	if evalReason(prev.Err) != evalReason(ev.Err) {
		return true
	}
	p, n := prev.Published, ev.Published
	return ev.Err == nil && (p.State != n.State || p.Limit != n.Limit || p.RampStep != n.RampStep || p.Epoch != n.Epoch)
}

// lastEvaluation is the policy's last evaluation, if any since the manager
// started.
func (r *DependencyPolicyReconciler) lastEvaluation(key types.NamespacedName) (evaluation, bool) {
	v, ok := r.evaluations.Load(key)
	if !ok {
		return evaluation{}, false
	}
	return v.(evaluation), true
}

// trigger asks the policy reconciler to reconcile pol now. It never blocks:
// when the channel is full the periodic reconcile catches up.
func (r *DependencyPolicyReconciler) trigger(pol *spillwayv1alpha1.DependencyPolicy) {
	select {
	case r.triggers <- event.GenericEvent{Object: pol}:
	default:
	}
}

// evalReason is the Ready reason of an evaluation error, "" for nil.
func evalReason(err error) string {
	if err == nil {
		return ""
	}
	var ee *evalError
	if errors.As(err, &ee) {
		return ee.reason
	}
	return ReasonRedisUnavailable
}
