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
	} else if err := r.releaseFleet(ctx, pol); err != nil {
		reconcileErrors.WithLabelValues(ReasonRedisUnavailable).Inc()
		after := jitter(r.backoff.When(key))
		log.Info("Failed to release the fleet in Redis; keeping the finalizer and retrying", "retryAfter", after, "error", err.Error())
		r.Recorder.Eventf(pol, nil, corev1.EventTypeWarning, EventReleaseFailed, "Delete",
			"Could not publish full capacity for the deleted policy, retrying; the finalizer stays until it is published (or %s=true): %s", AnnotationSkipRedisRelease, err.Error())
		obs.ReleaseErr = err
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
	r.Evaluations.forget(key)
	log.Info("Released the policy's consumers and removed the finalizer")
	return ctrl.Result{}, nil
}

// releaseFleet publishes releasedState for a deleted policy.
func (r *PolicyReconciler) releaseFleet(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy) error {
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
func (r *PolicyReconciler) publishRelease(ctx context.Context, pc *protocol.Client, params policy.Params, paramsErr error) error {
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
