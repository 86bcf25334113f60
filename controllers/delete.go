package controllers

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// AnnotationSkipRedisRelease, on a DependencyPolicy being deleted, set to
// "true", lets the finalizer go without publishing the fleet's release to
// Redis: the escape hatch for a Redis that is gone for good (see
// docs/runbook.md). Without it the finalizer stays until the release is
// published.
const AnnotationSkipRedisRelease = "spillway.dev/skip-redis-release"

// Event reasons of a deleted policy's fleet.
const (
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
	// EventNothingToRelease: the deleted policy's spec cannot be used and
	// Redis holds no state for it (it never published one, or Redis lost
	// it), so there is no capacity to release the fleet at; the finalizer
	// went without writing to Redis.
	EventNothingToRelease = "NothingToRelease"
)

// reconcileDelete gives every autoscaler the policy bounds its user's
// replicas back, releases the fleet in Redis (see releasedState) and removes
// the finalizer. While Redis cannot be written the finalizer stays: the
// reconciler retries with backoff, with a Warning Event and the Ready
// condition saying why (obs.ReleaseErr, see updateStatus), unless
// AnnotationSkipRedisRelease lets it go.
func (r *PolicyReconciler) reconcileDelete(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, obs *observed) (ctrl.Result, error) {
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
	} else if released, err := r.releaseFleet(ctx, pol); err != nil {
		reconcileErrors.WithLabelValues(ReasonRedisUnavailable).Inc()
		after := jitter(r.backoff.When(key))
		log.Info("Failed to release the fleet in Redis; keeping the finalizer and retrying", "retryAfter", after, "error", err.Error())
		r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, EventReleaseFailed, "Delete",
			"Could not publish full capacity for the deleted policy, retrying; the finalizer stays until it is published (or %s=true): %s", AnnotationSkipRedisRelease, err.Error())
		obs.ReleaseErr = err
		return ctrl.Result{RequeueAfter: after}, nil
	} else if released {
		r.Recorder.Eventf(pol, nil, corev1.EventTypeNormal, EventReleased, "Delete", "Published the deleted policy's fleet Closed at full capacity")
	} else {
		r.Recorder.Eventf(pol, nil, corev1.EventTypeNormal, EventNothingToRelease, "Delete",
			"Redis holds no state for the policy and its spec cannot be used: nothing to release, workers find no policy and defer as before")
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
	r.Evaluations.forget(key)
	log.Info("Released the policy's consumers and removed the finalizer")
	return ctrl.Result{}, nil
}

// releaseFleet publishes releasedState for a deleted policy, and reports
// whether there was a state to publish. It holds the policy's gate in
// Evaluations while it does: an evaluation in progress ends first, and none
// publishes after it (see Evaluations.releasing).
func (r *PolicyReconciler) releaseFleet(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy) (bool, error) {
	defer r.Evaluations.releasing(pol)()
	params, paramsErr := policy.FromSpec(pol.Spec)
	pc, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: pol.Namespace, Name: pol.Name})
	if err != nil {
		return false, err
	}
	// An evaluation still in flight (of another manager: this one's waits
	// for the gate) may publish between the read and the write, and the
	// sequence fence then refuses the release: read again and retry, a few
	// times, before reporting it (the caller retries with backoff).
	for attempt := 1; ; attempt++ {
		released, err := r.publishRelease(ctx, pc, params, paramsErr)
		if err == nil || attempt == 3 || !(errors.Is(err, protocol.ErrStaleSequence) || errors.Is(err, protocol.ErrStaleEpoch)) {
			return released, err
		}
	}
}

// publishRelease reads the state with Redis's time and publishes it Closed at
// full capacity, fenced by the sequence it read; it reports false, writing
// nothing, when there is nothing to release (see releasedState).
func (r *PolicyReconciler) publishRelease(ctx context.Context, pc *protocol.Client, params policy.Params, paramsErr error) (bool, error) {
	rctx, cancel := context.WithTimeout(ctx, r.Options.RedisTimeout)
	defer cancel()
	prev, found, now, err := pc.ReadPublishedAt(rctx)
	if err != nil {
		return false, err
	}
	next, ok := releasedState(params, paramsErr, prev, found, now)
	if !ok {
		return false, nil
	}
	if _, err := pc.Publish(rctx, next); err != nil {
		return false, err
	}
	return true, nil
}
