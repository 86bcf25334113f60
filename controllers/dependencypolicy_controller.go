// Package controllers holds Spillway's DependencyPolicy controllers.
//
// Two controllers share the policies. The evaluator (Evaluate) runs every
// evaluation interval and talks only to Redis: it reads what workers reported,
// steps the breaker and the ramp in a pure planner (Plan) and publishes the
// fleet's limit, so a slow or throttled API server never delays a limit. The
// policy reconciler (Reconcile) holds the finalizer, writes status once per
// reconcile and bounds the consumers' KEDA ScaledObjects (Bounds,
// DesiredReplicas); the evaluator triggers it whenever the outcome changes.
//
// Neither keeps essential state in memory: the breaker and the ramp live in
// Redis (and, as a fallback, in the policy's status), the user's replicas and
// the pinned minimum in annotations on the ScaledObjects.
package controllers

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/redis/go-redis/v9"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

const (
	// ControllerName names the controller, its logger and its Events.
	ControllerName = "spillway-controller"
	// Finalizer holds a DependencyPolicy until its ScaledObjects got the
	// user's replicas back.
	Finalizer = "spillway.dev/finalizer"
	// FieldManager is the server-side apply field manager that owns a bounded
	// ScaledObject's spec.minReplicaCount and spec.maxReplicaCount and
	// Spillway's annotations, and nothing else. GitOps tools can be told to
	// ignore exactly its fields.
	FieldManager = "spillway-controller"
	// MetadataFieldOwner is the field owner of the merge patch that lets go
	// of a ScaledObject: it removes the annotations and Spillway's
	// managedFields entries, and so owns nothing afterwards.
	MetadataFieldOwner = "spillway-controller-metadata"

	// AnnotationOwner, on a ScaledObject, names the DependencyPolicy (in the
	// same namespace) that bounds it. A second policy naming the same
	// ScaledObject reports a Conflict instead of fighting over it.
	AnnotationOwner = "spillway.dev/owner"
	// AnnotationOriginalReplicas, on a ScaledObject, records the user's own
	// minReplicaCount and maxReplicaCount, as JSON with null for unset
	// ({"min":2,"max":null}), before Spillway first changes them; they are put
	// back when the policy lets go. A change the user makes meanwhile (the
	// field manager loses the field) is recorded here too.
	AnnotationOriginalReplicas = "spillway.dev/original-replicas"
	// AnnotationSkipRedisRelease, on a DependencyPolicy being deleted, set to
	// "true", lets the finalizer go without publishing the fleet's release
	// to Redis: the escape hatch for a Redis that is gone for good (see
	// docs/runbook.md). Without it the finalizer stays until the release is
	// published.
	AnnotationSkipRedisRelease = "spillway.dev/skip-redis-release"
	// AnnotationPinnedMinReplicas, on a ScaledObject, is the replicas its
	// workload had when the outage began: the minReplicaCount pinned while the
	// breaker is Open or HalfOpen and the ramp climbs.
	AnnotationPinnedMinReplicas = "spillway.dev/pinned-min-replicas"

	// IndexConsumer indexes DependencyPolicies by the names of the
	// ScaledObjects they list as consumers.
	IndexConsumer = "spec.consumers.scaledObjectName"
	// IndexHPAConsumer indexes DependencyPolicies by the names of the
	// HorizontalPodAutoscalers they list as consumers.
	IndexHPAConsumer = "spec.consumers.horizontalPodAutoscalerName"
	// IndexOwner indexes ScaledObjects and HorizontalPodAutoscalers by their
	// AnnotationOwner.
	IndexOwner = "metadata.annotations.spillway.dev/owner"
)

// Event reasons for ScaledObjects, besides the transitions in plan.go
// (internal/control).
const (
	// EventBounded: Spillway changed a ScaledObject's min or max replicas.
	EventBounded = "Bounded"
	// EventRestored: Spillway put back a ScaledObject's replicas and let go
	// of it.
	EventRestored = "Restored"
	// EventReleased: the fleet of a deleted policy was published Closed at
	// full capacity.
	EventReleased = "FleetReleased"
	// EventReleaseFailed (Warning): the fleet of a deleted policy could not
	// be released in Redis; the finalizer stays and the controller retries.
	EventReleaseFailed = "FleetReleaseFailed"
	// EventReleaseSkipped (Warning): the finalizer of a deleted policy went
	// without releasing the fleet in Redis, as AnnotationSkipRedisRelease
	// asked.
	EventReleaseSkipped = "FleetReleaseSkipped"
)

// Options tune the reconciler. Zero values take the defaults.
type Options struct {
	// EvaluationInterval is how often each policy is evaluated. Default 1s.
	EvaluationInterval time.Duration
	// StatusInterval is how often the policy reconciler runs without being
	// triggered, and how far behind the window counts in status may fall
	// (see statusDue). Each policy uses a fixed point of its second half, so
	// policies created together do not write together. Default 10s.
	StatusInterval time.Duration
	// RedisTimeout bounds each Redis operation. Default 500ms.
	RedisTimeout time.Duration
	// MaxConcurrentReconciles is how many policies the evaluator, and
	// separately the policy reconciler, work on at once. Default 8; at
	// least 4.
	MaxConcurrentReconciles int
	// MaxRetryDelay caps the backoff after a failed evaluation. Default 10s.
	MaxRetryDelay time.Duration
	// StaleAfter is the dead-man bound published with every state: workers
	// treat an Open state published longer ago as HalfOpen. Default
	// StaleAfter(EvaluationInterval); negative turns the rule off.
	StaleAfter time.Duration
}

func (o Options) withDefaults() Options {
	if o.EvaluationInterval <= 0 {
		o.EvaluationInterval = time.Second
	}
	if o.StatusInterval <= 0 {
		o.StatusInterval = 10 * time.Second
	}
	if o.RedisTimeout <= 0 {
		o.RedisTimeout = 500 * time.Millisecond
	}
	if o.MaxConcurrentReconciles <= 0 {
		o.MaxConcurrentReconciles = 8
	}
	o.MaxConcurrentReconciles = max(o.MaxConcurrentReconciles, 4)
	if o.MaxRetryDelay <= 0 {
		o.MaxRetryDelay = 10 * time.Second
	}
	o.MaxRetryDelay = max(o.MaxRetryDelay, o.EvaluationInterval)
	return o
}

// DependencyPolicyReconciler runs both DependencyPolicy controllers: the
// evaluator (Evaluate) and the policy reconciler (Reconcile). Build it with
// its exported fields and call SetupWithManager, which fills what is left
// unset.
type DependencyPolicyReconciler struct {
	// Client reads from the manager's cache and writes to the API server.
	Client client.Client
	// APIReader reads from the API server, bypassing the cache: what a
	// deleted policy lets go of must not depend on the cache having caught
	// up. Default: the manager's.
	APIReader client.Reader
	// Redis is where limits are published and outcomes read.
	Redis redis.UniversalClient
	// Recorder emits Events. Default: the manager's, as ControllerName.
	Recorder events.EventRecorder
	// Clock is the time the breaker and ramp decide by. Default: the wall
	// clock.
	Clock clock.PassiveClock
	// Discovery tells a scale target without a scale subresource from a
	// missing one. Default: from the manager's config.
	Discovery discovery.DiscoveryInterface
	// Options tune the reconciler.
	Options Options

	// evalBackoff spaces the retries of failed evaluations, per policy.
	evalBackoff workqueue.TypedRateLimiter[types.NamespacedName]
	// backoff spaces the retries of policies whose consumers could not all
	// be bounded.
	backoff workqueue.TypedRateLimiter[types.NamespacedName]
	// evaluations holds each policy's last evaluation (an evaluation) for
	// the policy reconciler.
	evaluations sync.Map
	// triggers carries the policies whose evaluation changed to the policy
	// reconciler.
	triggers chan event.GenericEvent
	// scaleChecks caches, per ScaledObject, whether its scale target was
	// readable: an optimisation only, rebuilt after a restart.
	scaleChecks sync.Map
}

// The controller patches policies (their finalizer) and their status, and
// never updates either. The finalizers grant is kubebuilder's usual one, for
// API servers that check it when an object names a policy as its owner.
//
// +kubebuilder:rbac:groups=spillway.dev,resources=dependencypolicies,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=spillway.dev,resources=dependencypolicies/status,verbs=patch
// +kubebuilder:rbac:groups=spillway.dev,resources=dependencypolicies/finalizers,verbs=update
// +kubebuilder:rbac:groups=keda.sh,resources=scaledobjects,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=autoscaling,resources=horizontalpodautoscalers,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=apps,resources=deployments/scale;statefulsets/scale,verbs=get
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// SetupWithManager fills the reconciler's defaults, registers the field
// indexes and starts the evaluator and the policy reconciler.
func (r *DependencyPolicyReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if r.Redis == nil {
		return errors.New("the reconciler needs a Redis client")
	}
	if r.Client == nil {
		r.Client = mgr.GetClient()
	}
	if r.APIReader == nil {
		r.APIReader = mgr.GetAPIReader()
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder(ControllerName)
	}
	if r.Discovery == nil {
		dc, err := discovery.NewDiscoveryClientForConfig(mgr.GetConfig())
		if err != nil {
			return fmt.Errorf("failed to create a discovery client: %w", err)
		}
		r.Discovery = dc
	}
	r.setDefaults()

	if err := mgr.GetFieldIndexer().IndexField(ctx, &spillwayv1alpha1.DependencyPolicy{}, IndexConsumer, consumerNames); err != nil {
		return fmt.Errorf("failed to index DependencyPolicies by consumer: %w", err)
	}
	if err := mgr.GetFieldIndexer().IndexField(ctx, &kedav1alpha1.ScaledObject{}, IndexOwner, ownerName); err != nil {
		return fmt.Errorf("failed to index ScaledObjects by owner: %w", err)
	}
	if err := indexHPAs(ctx, mgr); err != nil {
		return err
	}
	err := ctrl.NewControllerManagedBy(mgr).
		For(&spillwayv1alpha1.DependencyPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: r.Options.MaxConcurrentReconciles}).
		Named("dependencypolicy-evaluator").
		Complete(reconcile.Func(r.Evaluate))
	if err != nil {
		return fmt.Errorf("failed to set up the evaluator: %w", err)
	}
	// The policy reconciler also sees annotation changes, so that
	// AnnotationSkipRedisRelease takes effect at once.
	return ctrl.NewControllerManagedBy(mgr).
		For(&spillwayv1alpha1.DependencyPolicy{}, builder.WithPredicates(predicate.Or[client.Object](
			predicate.GenerationChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		Watches(&kedav1alpha1.ScaledObject{}, scaledObjectHandler{
			EventHandler: handler.EnqueueRequestsFromMapFunc(r.policiesFor),
			forget:       func(uid types.UID) { r.scaleChecks.Delete(uid) },
		}).
		Watches(&autoscalingv2.HorizontalPodAutoscaler{}, scaledObjectHandler{
			EventHandler: handler.EnqueueRequestsFromMapFunc(r.policiesFor),
			forget:       func(uid types.UID) { r.scaleChecks.Delete(uid) },
		}).
		WatchesRawSource(source.Channel(r.triggers, &handler.EnqueueRequestForObject{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: r.Options.MaxConcurrentReconciles}).
		Named("dependencypolicy").
		Complete(r)
}

// setDefaults fills the options, the clock and the internal queues; the
// Client, Recorder and Discovery come from SetupWithManager.
func (r *DependencyPolicyReconciler) setDefaults() {
	r.Options = r.Options.withDefaults()
	if r.Clock == nil {
		r.Clock = clock.RealClock{}
	}
	r.evalBackoff = workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](r.Options.EvaluationInterval, r.Options.MaxRetryDelay)
	r.backoff = workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](time.Second, max(r.Options.MaxRetryDelay, r.Options.StatusInterval))
	r.triggers = make(chan event.GenericEvent, 1024)
}

// Reconcile is the policy reconciler: Get, ensure the finalizer, then
// reconcile or reconcileDelete, with the status patched once on the way out.
func (r *DependencyPolicyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, retErr error) {
	pol := &spillwayv1alpha1.DependencyPolicy{}
	if err := r.Client.Get(ctx, req.NamespacedName, pol); err != nil {
		if apierrors.IsNotFound(err) {
			r.backoff.Forget(req.NamespacedName)
			return ctrl.Result{}, nil
		}
		reconcileErrors.WithLabelValues(ReasonKubernetesAPI).Inc()
		return ctrl.Result{}, fmt.Errorf("failed to get DependencyPolicy %s: %w", req, err)
	}
	deleting := !pol.DeletionTimestamp.IsZero()
	if deleting && !controllerutil.ContainsFinalizer(pol, Finalizer) {
		return ctrl.Result{}, nil
	}
	if !deleting && !controllerutil.ContainsFinalizer(pol, Finalizer) {
		patch := client.MergeFromWithOptions(pol.DeepCopy(), client.MergeFromWithOptimisticLock{})
		controllerutil.AddFinalizer(pol, Finalizer)
		if err := r.Client.Patch(ctx, pol, patch); err != nil {
			reconcileErrors.WithLabelValues(ReasonKubernetesAPI).Inc()
			return ctrl.Result{}, fmt.Errorf("failed to add the finalizer to %s: %w", req, err)
		}
	}

	base := pol.DeepCopy()
	defer func() {
		if err := r.patchStatus(ctx, base, pol); err != nil {
			reconcileErrors.WithLabelValues(ReasonKubernetesAPI).Inc()
			retErr = errors.Join(retErr, err)
		}
	}()
	if deleting {
		return r.reconcileDelete(ctx, pol)
	}
	return r.reconcile(ctx, pol)
}

// reconcile writes the last evaluation to pol's status and bounds the
// consumers for the state it decided.
func (r *DependencyPolicyReconciler) reconcile(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy) (ctrl.Result, error) {
	key := client.ObjectKeyFromObject(pol)
	// The last evaluation, or, until the evaluator's first one since the
	// manager started, what status already says. An evaluation of an older
	// generation says nothing about this one.
	ev, evaluated := r.lastEvaluation(key)
	current := evaluated && ev.Generation == pol.Generation

	params, err := policy.FromSpec(pol.Spec)
	if err != nil {
		return r.reconcileInvalid(pol, ev, current, err)
	}
	meta.RemoveStatusCondition(&pol.Status.Conditions, ConditionStalled)

	var ready metav1.Condition
	switch {
	case evaluated:
		ready = readyCondition(ev.Err, ev.Published)
		if ev.Err == nil {
			setPublishedStatus(&pol.Status, ev.Published, ev.Window, ev.At)
		}
	case meta.FindStatusCondition(pol.Status.Conditions, ConditionReady) != nil:
		ready = *meta.FindStatusCondition(pol.Status.Conditions, ConditionReady)
	default:
		ready = metav1.Condition{Type: ConditionReady, Status: metav1.ConditionUnknown, Reason: ReasonNotEvaluated, Message: "The policy has not been evaluated yet"}
	}
	// The generation is observed once the evaluator published it.
	if current && ev.Err == nil {
		pol.Status.ObservedGeneration = pol.Generation
	}

	state := protocol.State(pol.Status.State)
	results := r.reconcileConsumers(ctx, pol, params, state)
	consumers := consumersBoundedCondition(results)
	r.setCondition(pol, consumers)
	r.setCondition(pol, readySummary(ready, consumers))
	openUntil := time.Time{}
	if evaluated && ev.Published.State == protocol.Open {
		openUntil = ev.Published.OpenUntil
	}
	r.setCondition(pol, breakerOpenCondition(state, openUntil, params.Breaker.HalfOpenProbes))
	r.setCondition(pol, rampingCondition(state, int(pol.Status.RampStep), params.Ramp.Steps))

	// Periodic runs and retries go after the work the evaluator triggers and
	// ScaledObject changes: a transition's pins and status come first.
	if consumers.Status == metav1.ConditionFalse {
		reconcileErrors.WithLabelValues(consumers.Reason).Inc()
		return ctrl.Result{RequeueAfter: jitter(r.backoff.When(key)), Priority: ptr.To(handler.LowPriority)}, nil
	}
	r.backoff.Forget(key)
	return ctrl.Result{RequeueAfter: statusInterval(pol, r.Options.StatusInterval), Priority: ptr.To(handler.LowPriority)}, nil
}

// reconcileInvalid reports a spec that cannot be turned into a policy: Ready
// False and Stalled, the generation observed (it will not get further until
// the spec changes), and the safe state the evaluator publishes for it. The
// consumers keep their bounds. The error is terminal: a new spec brings the
// policy back.
func (r *DependencyPolicyReconciler) reconcileInvalid(pol *spillwayv1alpha1.DependencyPolicy, ev evaluation, current bool, specErr error) (ctrl.Result, error) {
	err := &evalError{reason: ReasonInvalidSpec, err: fmt.Errorf("invalid spec: %w", specErr)}
	if c := meta.FindStatusCondition(pol.Status.Conditions, ConditionStalled); c == nil || c.ObservedGeneration != pol.Generation {
		r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, ReasonInvalidSpec, "Evaluate", "%s", err.Error())
	}
	r.setCondition(pol, readyCondition(err, protocol.Published{}))
	r.setCondition(pol, stalledCondition(specErr))
	pol.Status.ObservedGeneration = pol.Generation
	if current && ev.Published.State != "" {
		setPublishedStatus(&pol.Status, ev.Published, ev.Window, ev.At)
		r.setCondition(pol, breakerOpenCondition(ev.Published.State, ev.Published.OpenUntil, 0))
		r.setCondition(pol, rampingCondition(ev.Published.State, ev.Published.RampStep, nil))
	}
	reconcileErrors.WithLabelValues(ReasonInvalidSpec).Inc()
	return ctrl.Result{}, reconcile.TerminalError(err)
}

// reconcileDelete gives every ScaledObject the policy bounds its user's
// replicas back, releases the fleet in Redis (see releasedState) and removes
// the finalizer. While Redis cannot be written the finalizer stays: the
// reconciler retries with backoff, with a Warning Event and the Ready
// condition saying why, unless AnnotationSkipRedisRelease lets it go.
func (r *DependencyPolicyReconciler) reconcileDelete(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	key := client.ObjectKeyFromObject(pol)
	if err := r.releaseAll(ctx, pol, nil); err != nil {
		reconcileErrors.WithLabelValues(ReasonAPIError).Inc()
		return ctrl.Result{}, err
	}
	if pol.Annotations[AnnotationSkipRedisRelease] == "true" {
		log.Info("Removing the finalizer without releasing the fleet in Redis, as the policy's annotation asks", "annotation", AnnotationSkipRedisRelease)
		r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, EventReleaseSkipped, "Delete",
			"Removed the finalizer without publishing full capacity to Redis (%s); workers keep whatever Redis holds for the policy", AnnotationSkipRedisRelease)
	} else if err := r.releaseFleet(ctx, pol); err != nil {
		reconcileErrors.WithLabelValues(ReasonRedisUnavailable).Inc()
		after := jitter(r.backoff.When(key))
		log.Info("Failed to release the fleet in Redis; keeping the finalizer and retrying", "retryAfter", after, "error", err.Error())
		r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, EventReleaseFailed, "Delete",
			"Could not publish full capacity for the deleted policy, retrying; the finalizer stays until it is published (or %s=true): %s", AnnotationSkipRedisRelease, err.Error())
		r.setCondition(pol, releasePendingCondition(err))
		return ctrl.Result{RequeueAfter: after}, nil
	} else {
		r.Recorder.Eventf(pol, nil, corev1.EventTypeNormal, EventReleased, "Delete", "Published the deleted policy's fleet Closed at full capacity")
	}

	patch := client.MergeFromWithOptions(pol.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(pol, Finalizer)
	if err := r.Client.Patch(ctx, pol, patch); err != nil && !apierrors.IsNotFound(err) {
		// Not found: a reconcile before this one, seen through a stale cache,
		// already removed the finalizer and the policy is gone.
		reconcileErrors.WithLabelValues(ReasonKubernetesAPI).Inc()
		return ctrl.Result{}, fmt.Errorf("failed to remove the finalizer from %s: %w", key, err)
	}
	forgetPolicy(key)
	r.backoff.Forget(key)
	r.evaluations.Delete(key)
	log.Info("Released the policy's consumers and removed the finalizer")
	return ctrl.Result{}, nil
}

// releaseFleet publishes releasedState for a deleted policy.
func (r *DependencyPolicyReconciler) releaseFleet(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy) error {
	params, paramsErr := policy.FromSpec(pol.Spec)
	pc, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: pol.Namespace, Name: pol.Name})
	if err != nil {
		return err
	}
	// An evaluation still in flight may publish between the read and the
	// write, and the sequence fence then refuses the release: read again and
	// retry, a few times, before reporting it (the caller retries with
	// backoff).
	for attempt := 1; ; attempt++ {
		err := r.publishRelease(ctx, pc, params, paramsErr)
		if err == nil || attempt == 3 || !(errors.Is(err, protocol.ErrStaleSequence) || errors.Is(err, protocol.ErrStaleEpoch)) {
			return err
		}
	}
}

// publishRelease reads the state with Redis's time and publishes it Closed at
// full capacity, fenced by the sequence it read.
func (r *DependencyPolicyReconciler) publishRelease(ctx context.Context, pc *protocol.Client, params policy.Params, paramsErr error) error {
	rctx, cancel := context.WithTimeout(ctx, r.Options.RedisTimeout)
	defer cancel()
	prev, found, now, err := pc.ReadPublishedAt(rctx)
	if err != nil {
		return err
	}
	next, err := releasedState(params, paramsErr, prev, found, now)
	if err != nil {
		return err
	}
	if _, err := pc.Publish(rctx, next); err != nil {
		return err
	}
	return nil
}

// patchStatus writes pol's status when it differs from base in a way worth a
// write (see statusDue).
func (r *DependencyPolicyReconciler) patchStatus(ctx context.Context, base, pol *spillwayv1alpha1.DependencyPolicy) error {
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
		old.ObservedGeneration != cur.ObservedGeneration,
		!timesEqual(old.LastTransitionTime, cur.LastTransitionTime),
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

// setPublishedStatus records a publication and its window in st, at the
// seconds' precision status is stored with.
func setPublishedStatus(st *spillwayv1alpha1.DependencyPolicyStatus, p protocol.Published, w protocol.Window, at time.Time) {
	st.State = spillwayv1alpha1.BreakerState(p.State)
	st.CurrentLimit = int32(min(p.Limit, math.MaxInt32))
	st.RampStep = int32(p.RampStep)
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
	if p.State == protocol.Closed && p.RampStepStarted.After(p.BreakerSince) {
		return p.RampStepStarted
	}
	return p.BreakerSince
}

// setCondition sets c on pol's status at pol's generation.
func (r *DependencyPolicyReconciler) setCondition(pol *spillwayv1alpha1.DependencyPolicy, c metav1.Condition) {
	c.ObservedGeneration = pol.Generation
	meta.SetStatusCondition(&pol.Status.Conditions, c)
}

// policiesFor maps a ScaledObject or an HPA to the policies that name it as
// a consumer, and to the one its owner annotation names.
func (r *DependencyPolicyReconciler) policiesFor(ctx context.Context, obj client.Object) []reconcile.Request {
	index := IndexConsumer
	if _, ok := obj.(*autoscalingv2.HorizontalPodAutoscaler); ok {
		index = IndexHPAConsumer
	}
	var list spillwayv1alpha1.DependencyPolicyList
	if err := r.Client.List(ctx, &list, client.InNamespace(obj.GetNamespace()), client.MatchingFields{index: obj.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Failed to list the policies of an autoscaler", "autoscaler", klog.KObj(obj))
	}
	seen := map[string]bool{}
	var reqs []reconcile.Request
	add := func(name string) {
		if name != "" && !seen[name] {
			seen[name] = true
			reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: obj.GetNamespace(), Name: name}})
		}
	}
	for _, p := range list.Items {
		add(p.Name)
	}
	add(obj.GetAnnotations()[AnnotationOwner])
	return reqs
}

// scaledObjectHandler enqueues the policies of an autoscaler (a ScaledObject
// or an HPA) that changed, and forgets a deleted one's cached scale check.
type scaledObjectHandler struct {
	handler.EventHandler
	forget func(types.UID)
}

// Delete forgets the ScaledObject and enqueues its policies.
func (h scaledObjectHandler) Delete(ctx context.Context, e event.DeleteEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
	if e.Object != nil {
		h.forget(e.Object.GetUID())
	}
	h.EventHandler.Delete(ctx, e, q)
}

// consumerNames is the IndexConsumer index function.
func consumerNames(obj client.Object) []string {
	pol, ok := obj.(*spillwayv1alpha1.DependencyPolicy)
	if !ok {
		return nil
	}
	names := make([]string, 0, len(pol.Spec.Consumers))
	for _, c := range pol.Spec.Consumers {
		if c.ScaledObjectName != "" {
			names = append(names, c.ScaledObjectName)
		}
	}
	return names
}

// ownerName is the IndexOwner index function.
func ownerName(obj client.Object) []string {
	if owner := obj.GetAnnotations()[AnnotationOwner]; owner != "" {
		return []string{owner}
	}
	return nil
}

// jitter spreads a retry delay over ±20%, so policies that failed together
// do not retry together.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
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
