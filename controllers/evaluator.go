package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// Evaluator is the controller that evaluates each DependencyPolicy every
// evaluation interval: it reads the policy's state and window from Redis,
// plans and publishes (evaluate), and remembers the outcome in Evaluations
// for the PolicyReconciler. Build it with its exported fields and call
// SetupWithManager, which fills what is left unset.
type Evaluator struct {
	// Client reads policies, from the manager's cache.
	Client client.Client
	// Redis is where limits are published and outcomes read.
	Redis redis.UniversalClient
	// Recorder emits Events. Default: the manager's, as ControllerName.
	Recorder events.EventRecorder
	// Clock records when an evaluation ran, for status; the evaluation
	// decides by Redis time. Default: clock.System, the wall clock.
	Clock clock.Clock
	// Evaluations is where the evaluator remembers each evaluation; the
	// PolicyReconciler must be given the same. Required.
	Evaluations *Evaluations
	// Signals runs the policies' Prometheus queries in the background.
	// Default: PrometheusHTTP, reading credentials Secrets with the manager's
	// API reader (uncached).
	Signals *Signals
	// Options tune the evaluator.
	Options Options

	// backoff spaces the retries of failed evaluations, per policy.
	backoff workqueue.TypedRateLimiter[types.NamespacedName]
}

// SetupWithManager fills the evaluator's defaults and starts it.
func (r *Evaluator) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if r.Redis == nil {
		return errors.New("the evaluator needs a Redis client")
	}
	if r.Evaluations == nil {
		return errors.New("the evaluator needs an Evaluations store")
	}
	if r.Client == nil {
		r.Client = mgr.GetClient()
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder(ControllerName)
	}
	if r.Signals == nil {
		r.Signals = NewSignals(PrometheusHTTP{}, mgr.GetAPIReader())
	}
	r.setDefaults()
	err := ctrl.NewControllerManagedBy(mgr).
		For(&spillwayv1alpha1.DependencyPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: r.Options.MaxConcurrentReconciles}).
		Named("dependencypolicy-evaluator").
		Complete(r)
	if err != nil {
		return fmt.Errorf("failed to set up the evaluator: %w", err)
	}
	return nil
}

// setDefaults fills the options, the clock and the backoff; the Client and
// the Recorder come from SetupWithManager.
func (r *Evaluator) setDefaults() {
	r.Options = r.Options.withDefaults()
	if r.Clock == nil {
		r.Clock = clock.System{}
	}
	if r.Signals == nil {
		r.Signals = NewSignals(PrometheusHTTP{}, nil)
	}
	r.backoff = workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](r.Options.EvaluationInterval, r.Options.MaxRetryDelay)
}

// Reconcile runs every interval for each policy: it evaluates it (or, when
// its spec cannot be used, reads the state the fleet keeps), and reports the
// transitions as Events and metrics. It writes nothing to the API server but
// Events, which are sent in the background, so a slow or throttled API
// server never delays a limit. When the outcome changes it triggers the
// policy reconciler, which writes status and bounds the consumers.
func (r *Evaluator) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	key := req.NamespacedName
	pol := &spillwayv1alpha1.DependencyPolicy{}
	if err := r.Client.Get(ctx, key, pol); err != nil {
		if apierrors.IsNotFound(err) {
			r.Evaluations.forget(key)
			r.Evaluations.forgetGate(key)
			r.Signals.Forget(key)
			r.backoff.Forget(key)
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
		return r.evaluateInvalid(ctx, pol, err)
	}

	done, ok := r.Evaluations.evaluating(pol)
	if !ok {
		// Its fleet was released: the policy is being deleted, which this
		// cache has not seen yet. A publish now would hold the released fleet.
		return ctrl.Result{}, nil
	}
	ev := r.evaluate(ctx, pol, params, r.Clock.Now())
	done()
	ev.Generation = pol.Generation
	changed := r.Evaluations.remember(key, ev)
	if changed {
		r.Evaluations.trigger(pol)
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
		return ctrl.Result{RequeueAfter: jitter(r.backoff.When(key)), Priority: ptr.To(evaluationPriority)}, nil
	}
	if changed {
		ctrl.LoggerFrom(ctx).V(1).Info("Evaluated", "state", ev.Published.State, "limit", ev.Published.Limit, "epoch", ev.Published.Epoch)
	}
	r.backoff.Forget(key)
	return ctrl.Result{RequeueAfter: r.Options.EvaluationInterval, Priority: ptr.To(evaluationPriority)}, nil
}

// evaluationPriority is the one priority of every evaluation. Without it,
// policies that existed when the manager started would keep the low priority
// of the initial list, and be evaluated after newer ones under load.
const evaluationPriority = 0

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
// ReasonStaleEpoch and the next one, an interval or more later, re-reads. A
// plan that did not see a trip the workers made meanwhile
// (protocol.ErrTripped) is made again at once from the tripped state.
func (r *Evaluator) evaluate(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, params policy.Params, at time.Time) evaluation {
	log := ctrl.LoggerFrom(ctx)
	// The external signal's last answer, without waiting for a query.
	external, signal := r.observeSignals(pol, params)
	failed := func(reason string, err error) evaluation {
		return evaluation{At: at, Err: &evalError{reason: reason, err: err}, Signal: signal}
	}
	pc, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: pol.Namespace, Name: pol.Name})
	if err != nil {
		return failed(ReasonInvalidSpec, err)
	}

	// The workers may trip the breaker in the fleet's path between the read
	// and the publish: publish then refuses the plan (protocol.ErrTripped),
	// which did not see the trip and would undo it, and the evaluator reads
	// again and plans from the tripped state. Once tripped the state is Open
	// and no second trip can come before the next publish, so one more
	// attempt is enough; a third is allowed for safety.
	var (
		prev, found           = protocol.Published{}, false
		window, probes        = protocol.Window{}, protocol.Probes{}
		redisNow, publishedAt time.Time
		out                   PlanOutput
	)
	for attempt := 1; ; attempt++ {
		rctx, cancel := context.WithTimeout(ctx, r.Options.RedisTimeout)
		var now time.Time
		prev, found, now, err = pc.ReadPublishedAt(rctx)
		cancel()
		if err != nil {
			return failed(ReasonRedisUnavailable, err)
		}
		if !found {
			prev = RestoreFromStatus(pol.Status, params, now)
			log.Info("Redis holds no state for the policy: continuing from status", "state", prev.State, "rampStep", prev.RampStep)
		}

		// Workers count outcomes in whole seconds and ReadWindow sums the
		// seconds after from: starting one second early counts the second
		// of the last transition whole. Otherwise failures reported in the
		// second a breaker closed, or a policy was created, would never be
		// counted; the calls of that second from before the transition are
		// the probes that closed it.
		from := WindowStart(params, prev, now).Add(-time.Second)
		rctx, cancel = context.WithTimeout(ctx, r.Options.RedisTimeout)
		window, probes, redisNow, err = pc.ReadWindow(rctx, params.Breaker.Window, from)
		cancel()
		if err != nil {
			return failed(ReasonRedisUnavailable, err)
		}

		out = Plan(PlanInput{Params: params, Previous: prev, Window: window, Probes: probes, External: external, Now: redisNow, StaleAfter: r.Options.staleAfter()})
		// Redis lost a state this manager published (status says it did):
		// it lost the leases too, and the dependency learns before it
		// admits anything new (docs/protocol.md §4 "Learning").
		out.Next.Restored = !found && pol.Status.State != ""

		rctx, cancel = context.WithTimeout(ctx, r.Options.RedisTimeout)
		publishedAt, err = pc.Publish(rctx, out.Next)
		cancel()
		if errors.Is(err, protocol.ErrTripped) && attempt < 3 {
			log.V(1).Info("The workers tripped the breaker during the evaluation: planning again from the trip", "error", err.Error())
			continue
		}
		break
	}
	switch {
	case errors.Is(err, protocol.ErrStaleEpoch), errors.Is(err, protocol.ErrStaleSequence):
		return failed(ReasonStaleEpoch, err)
	case err != nil:
		return failed(ReasonRedisUnavailable, err)
	}

	if found {
		observeLag(prev.UpdatedAt, redisNow, r.Options.EvaluationInterval)
	}
	key := client.ObjectKeyFromObject(pol)
	recordState(key, out.Next, publishedAt)
	for _, t := range out.Transitions {
		eventType := corev1.EventTypeNormal
		if t.Reason == EventOpened {
			eventType = corev1.EventTypeWarning
		}
		r.Recorder.Eventf(pol, nil, eventType, t.Reason, "Evaluate", "%s", t.Message)
		if t.Reason == EventRampStepBack {
			recordStepBack(key)
		}
		if t.From != t.To {
			transitionsTotal.WithLabelValues(string(t.From), string(t.To)).Inc()
		}
		log.Info("Policy "+t.Reason, "from", t.From, "to", t.To, "limit", out.Next.Limit, "epoch", out.Next.Epoch, "message", t.Message)
	}
	ev := evaluation{Published: out.Next, Window: window, At: at, Signal: signal}
	rctx, cancel := context.WithTimeout(ctx, r.Options.RedisTimeout)
	fleet, err := pc.ReadFleet(rctx)
	cancel()
	if err != nil {
		log.V(1).Info("Could not read the workers' protocol versions", "error", err.Error())
	} else {
		ev.Fleet, ev.FleetRead = fleet, true
		recordFleet(key, fleet)
	}
	return ev
}

// evaluateInvalid is the evaluator's run for a policy whose spec cannot be
// turned into parameters: it publishes nothing, and records an InvalidSpec
// evaluation carrying the state Redis holds, for the policy reconciler, which
// marks the policy Stalled. The breaker and the ramp cannot run without a
// valid spec, and the fleet keeps the state last published: Closed and
// Ramping their limit; an Open or HalfOpen, no longer refreshed, turns stale
// after its dead-man bound, and workers then admit halfOpenProbes calls at a
// time (docs/protocol.md §7) until the spec is fixed. Publishing Closed at
// the last capacity instead would send the whole fleet at a dependency that
// was failing. With no state in Redis nothing is held: workers defer their
// calls until the spec is fixed.
func (r *Evaluator) evaluateInvalid(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, specErr error) (ctrl.Result, error) {
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
		held, found, err := pc.ReadPublished(rctx)
		if err == nil && found {
			ev.Published = held
		}
		return err
	}()
	if r.Evaluations.remember(key, ev) {
		r.Evaluations.trigger(pol)
	}
	if err != nil {
		reconcileErrors.WithLabelValues(ReasonRedisUnavailable).Inc()
		ctrl.LoggerFrom(ctx).V(1).Info("Failed to read the state an invalid policy holds", "error", err.Error())
		return ctrl.Result{RequeueAfter: jitter(r.backoff.When(key)), Priority: ptr.To(evaluationPriority)}, nil
	}
	r.backoff.Forget(key)
	return ctrl.Result{RequeueAfter: r.Options.EvaluationInterval, Priority: ptr.To(evaluationPriority)}, nil
}
