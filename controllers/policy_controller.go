package controllers

import (
	"context"
	"errors"
	"fmt"
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
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Finalizer holds a DependencyPolicy until its autoscalers got the user's
// replicas back.
const Finalizer = "spillway.dev/finalizer"

// PolicyReconciler is the controller that holds a DependencyPolicy's
// finalizer, writes its status from the evaluator's last evaluation and
// bounds its consumers' autoscalers. Build it with its exported fields and
// call SetupWithManager, which fills what is left unset.
type PolicyReconciler struct {
	// Client reads from the manager's cache and writes to the API server.
	Client client.Client
	// APIReader reads from the API server, bypassing the cache: what a
	// deleted policy lets go of must not depend on the cache having caught
	// up. Default: the manager's.
	APIReader client.Reader
	// Redis is where a deleted policy's fleet is released.
	Redis redis.UniversalClient
	// Recorder emits Events. Default: the manager's, as ControllerName.
	Recorder events.EventRecorder
	// Clock is the time status and the scale checks go by. Default:
	// clock.System, the wall clock.
	Clock clock.Clock
	// Discovery tells a scale target without a scale subresource from a
	// missing one. Default: from the manager's config.
	Discovery discovery.DiscoveryInterface
	// Evaluations is where the Evaluator remembers each evaluation, and
	// triggers this reconciler from. Required: the Evaluator's.
	Evaluations *Evaluations
	// Options tune the reconciler.
	Options Options

	// backoff spaces the retries of policies whose consumers could not all
	// be bounded.
	backoff workqueue.TypedRateLimiter[types.NamespacedName]
	// keda says whether ScaledObjects are watched: not when the manager
	// started without KEDA's CRD, until it is served.
	keda kedaState
	// scaleChecks caches, per autoscaler, whether its scale target was
	// readable: an optimisation only, rebuilt after a restart.
	scaleChecks sync.Map
}

// The controllers patch policies (their finalizer) and their status, and
// never update either. The finalizers grant is kubebuilder's usual one, for
// API servers that check it when an object names a policy as its owner.
//
// +kubebuilder:rbac:groups=spillway.dev,resources=dependencypolicies,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=spillway.dev,resources=dependencypolicies/status,verbs=patch
// +kubebuilder:rbac:groups=spillway.dev,resources=dependencypolicies/finalizers,verbs=update
// +kubebuilder:rbac:groups=keda.sh,resources=scaledobjects,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=autoscaling,resources=horizontalpodautoscalers,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=apps,resources=deployments/scale;statefulsets/scale;replicasets/scale,verbs=get;update
// +kubebuilder:rbac:groups=apps,resources=deployments;statefulsets;replicasets,verbs=get;patch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// SetupWithManager fills the reconciler's defaults, registers the field
// indexes and starts the policy reconciler.
func (r *PolicyReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if r.Redis == nil {
		return errors.New("the policy reconciler needs a Redis client")
	}
	if r.Evaluations == nil {
		return errors.New("the policy reconciler needs the evaluator's Evaluations store")
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

	// Without KEDA's CRD the manager starts all the same: HPAs are bounded,
	// ScaledObject consumers wait (ReasonKEDANotInstalled) until the CRD is
	// served, and then are watched without a restart.
	scaledObjects, err := scaledObjectsServed(mgr.GetRESTMapper())
	if err != nil {
		return err
	}
	if err := setupIndexes(ctx, mgr, scaledObjects); err != nil {
		return err
	}
	// The policy reconciler also sees annotation changes, so that
	// AnnotationSkipRedisRelease takes effect at once.
	b := ctrl.NewControllerManagedBy(mgr).
		For(&spillwayv1alpha1.DependencyPolicy{}, builder.WithPredicates(predicate.Or[client.Object](
			predicate.GenerationChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		Watches(&autoscalingv2.HorizontalPodAutoscaler{}, autoscalerHandler{
			EventHandler: handler.EnqueueRequestsFromMapFunc(r.policiesFor),
			forget:       func(uid types.UID) { r.scaleChecks.Delete(uid) },
		}).
		WatchesRawSource(r.Evaluations.source()).
		WithOptions(controller.Options{MaxConcurrentReconciles: r.Options.MaxConcurrentReconciles}).
		Named("dependencypolicy")
	if scaledObjects {
		b = b.Watches(&kedav1alpha1.ScaledObject{}, r.scaledObjectHandler())
	}
	workloads, err := r.boundWorkloadSources(mgr)
	if err != nil {
		return err
	}
	for _, src := range workloads {
		b = b.WatchesRawSource(src)
	}
	c, err := b.Build(r)
	if err != nil {
		return err
	}
	if scaledObjects {
		return nil
	}
	r.keda.missing.Store(true)
	ctrl.Log.WithName(ControllerName).Info("KEDA's ScaledObject CRD is not installed: bounding HorizontalPodAutoscalers only, and watching ScaledObjects once it is",
		"discoveryInterval", r.Options.KEDADiscoveryInterval)
	return mgr.Add(r.watchScaledObjectsOnceServed(mgr, c, r.Options.KEDADiscoveryInterval))
}

// setDefaults fills the options, the clock and the backoff; the Client,
// Recorder and Discovery come from SetupWithManager.
func (r *PolicyReconciler) setDefaults() {
	r.Options = r.Options.withDefaults()
	if r.Clock == nil {
		r.Clock = clock.System{}
	}
	r.backoff = workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](time.Second, max(r.Options.MaxRetryDelay, r.Options.StatusInterval))
}

// Reconcile gets the policy, ensures the finalizer, then reconciles or
// reconcileDeletes it; on the way out updateStatus turns what they observed
// into status, patched once.
func (r *PolicyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, retErr error) {
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
	obs := &observed{Deleting: deleting}
	defer func() {
		updateStatus(pol, obs)
		if err := r.patchStatus(ctx, base, pol); err != nil {
			reconcileErrors.WithLabelValues(ReasonKubernetesAPI).Inc()
			retErr = errors.Join(retErr, err)
		}
	}()
	if deleting {
		return r.reconcileDelete(ctx, pol, obs)
	}
	return r.reconcile(ctx, pol, obs)
}

// reconcile bounds the consumers for the state of the last evaluation, and
// records in obs what updateStatus writes.
func (r *PolicyReconciler) reconcile(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, obs *observed) (ctrl.Result, error) {
	key := client.ObjectKeyFromObject(pol)
	// The last evaluation, or, until the evaluator's first one since the
	// manager started, what status already says.
	obs.Evaluation, obs.Evaluated = r.Evaluations.lastEvaluation(key)

	params, err := policy.FromSpec(pol.Spec)
	if err != nil {
		return r.reconcileInvalid(pol, obs, err)
	}
	obs.Params = params
	obs.Consumers, obs.Workloads = r.reconcileConsumers(ctx, pol, params, obs.state(pol), obs.limit(pol))
	obs.WorkloadsKnown = true

	// Periodic runs and retries go after the work the evaluator triggers and
	// ScaledObject changes: a transition's pins and status come first.
	consumers := consumersBoundedCondition(obs.Consumers)
	recordConsumers(key, obs.Consumers, consumers.Status != metav1.ConditionFalse)
	if consumers.Status == metav1.ConditionFalse {
		reconcileErrors.WithLabelValues(consumers.Reason).Inc()
		return ctrl.Result{RequeueAfter: jitter(r.backoff.When(key)), Priority: ptr.To(handler.LowPriority)}, nil
	}
	r.backoff.Forget(key)
	return ctrl.Result{RequeueAfter: statusInterval(pol, r.Options.StatusInterval), Priority: ptr.To(handler.LowPriority)}, nil
}

// reconcileInvalid handles a spec that cannot be turned into a policy: the
// consumers keep their bounds, status says Stalled (see updateStatus), and
// the first time at this generation a Warning Event says why. The error is
// terminal: a new spec brings the policy back.
func (r *PolicyReconciler) reconcileInvalid(pol *spillwayv1alpha1.DependencyPolicy, obs *observed, specErr error) (ctrl.Result, error) {
	obs.SpecErr = specErr
	err := invalidSpecError(specErr)
	if c := meta.FindStatusCondition(pol.Status.Conditions, ConditionStalled); c == nil || c.ObservedGeneration != pol.Generation {
		r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, ReasonInvalidSpec, "Evaluate", "%s", err.Error())
	}
	reconcileErrors.WithLabelValues(ReasonInvalidSpec).Inc()
	return ctrl.Result{}, reconcile.TerminalError(err)
}

// invalidSpecError is the evaluation error of a spec that cannot be turned
// into a policy.
func invalidSpecError(specErr error) error {
	return &evalError{reason: ReasonInvalidSpec, err: fmt.Errorf("invalid spec: %w", specErr)}
}

// observed is what the policy reconciler saw and did, for updateStatus.
type observed struct {
	// Evaluation is the evaluator's last evaluation of the policy, when
	// Evaluated (there was one since the manager started).
	Evaluation evaluation
	Evaluated  bool
	// SpecErr is why the spec cannot be turned into a policy, nil when it
	// can; then Params are the policy's parameters.
	SpecErr error
	Params  policy.Params
	// Consumers has one result per consumer, as reconcileConsumers returns.
	Consumers []consumerResult
	// Workloads are the workloads without an autoscaler to record in
	// status, when WorkloadsKnown (the consumers were reconciled).
	Workloads      []workloadRef
	WorkloadsKnown bool
	// Deleting: the policy is being deleted. ReleaseErr is why its fleet
	// could not be released in Redis, nil when it was (or was not tried).
	Deleting   bool
	ReleaseErr error
}

// current reports whether the evaluation is of the policy's generation: one
// of an older generation says nothing about this one.
func (o *observed) current(pol *spillwayv1alpha1.DependencyPolicy) bool {
	return o.Evaluated && o.Evaluation.Generation == pol.Generation
}

// state is the state status shows once updateStatus ran: the last
// evaluation's, when it published, or what status already says.
func (o *observed) state(pol *spillwayv1alpha1.DependencyPolicy) wire.State {
	if o.Evaluated && o.Evaluation.Err == nil {
		return o.Evaluation.Published.State
	}
	return wireState(pol.Status.State)
}
