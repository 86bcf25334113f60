package controllers

import (
	"context"
	"fmt"
	"math"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// This file reads a consumer's scale target through its scale subresource:
// the replicas pinned when an outage begins, and a check, once per
// autoscaler generation, that reports a bad target early.

// scaleCheckMaxDelay caps how long an autoscaler whose scale target could
// not be read waits before the controller reads it again.
const scaleCheckMaxDelay = 5 * time.Minute

// scaleCheck remembers reading one autoscaler's scale target.
type scaleCheck struct {
	generation int64
	failed     *consumerResult
	failures   int
	next       time.Time
}

// scaleChecked reports whether so's scale target need not be read now: it
// was read successfully at this generation, or it failed and its backoff has
// not expired (then the cached failure is reported by readScale).
func (r *PolicyReconciler) scaleChecked(so autoscaler) bool {
	v, ok := r.scaleChecks.Load(so.GetUID())
	if !ok {
		return false
	}
	c := v.(scaleCheck)
	return c.generation == so.GetGeneration() && c.failed == nil
}

// readScale reads the replicas of so's scale target from its scale
// subresource (spec.replicas: what the autoscaler last asked for). A target
// that failed is read again only after a backoff, doubling from 1s up to
// scaleCheckMaxDelay; meanwhile the last failure is returned.
func (r *PolicyReconciler) readScale(ctx context.Context, so autoscaler) (int32, *consumerResult) {
	now := r.Clock.Now()
	prev := scaleCheck{}
	if v, ok := r.scaleChecks.Load(so.GetUID()); ok {
		prev = v.(scaleCheck)
		if prev.failed != nil && prev.generation == so.GetGeneration() && now.Before(prev.next) {
			return 0, prev.failed
		}
	}
	replicas, failed := r.getScale(ctx, so)
	check := scaleCheck{generation: so.GetGeneration(), failed: failed}
	if failed != nil {
		check.failures = prev.failures + 1
		delay := min(time.Duration(1<<min(check.failures-1, 20))*time.Second, scaleCheckMaxDelay)
		check.next = now.Add(jitter(delay))
	}
	r.scaleChecks.Store(so.GetUID(), check)
	return replicas, failed
}

// getScale reads the scale subresource of so's scaleTargetRef (an apps/v1
// Deployment when the apiVersion and kind are unset, as KEDA defaults them)
// and says what went wrong when it cannot.
func (r *PolicyReconciler) getScale(ctx context.Context, so autoscaler) (int32, *consumerResult) {
	apiVersion, kind, name := so.scaleTarget()
	if name == "" {
		return 0, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("the %s has no scaleTargetRef", so.kind().Kind)}
	}
	scale, res := r.readScaleOf(ctx, so.GetNamespace(), targetRef(apiVersion, kind, name))
	if res != nil {
		return 0, res
	}
	return scaleReplicas(scale), nil
}

// scaleReplicas is a Scale's spec.replicas.
func scaleReplicas(scale *unstructured.Unstructured) int32 {
	replicas, _, _ := unstructured.NestedInt64(scale.Object, "spec", "replicas")
	return int32(min(max(replicas, 0), math.MaxInt32))
}

// readScaleOf reads the scale subresource (an autoscaling/v1 Scale) of the
// workload ref in namespace and says what went wrong when it cannot.
func (r *PolicyReconciler) readScaleOf(ctx context.Context, namespace string, ref workloadRef) (*unstructured.Unstructured, *consumerResult) {
	gv, err := schema.ParseGroupVersion(ref.APIVersion)
	if err != nil {
		return nil, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("invalid apiVersion %q: %v", ref.APIVersion, err)}
	}
	gvk := gv.WithKind(ref.Kind)
	target := &unstructured.Unstructured{}
	target.SetGroupVersionKind(gvk)
	target.SetNamespace(namespace)
	target.SetName(ref.Name)
	scale := &unstructured.Unstructured{}
	scale.SetGroupVersionKind(schema.GroupVersionKind{Group: "autoscaling", Version: "v1", Kind: "Scale"})
	err = r.Client.SubResource("scale").Get(ctx, target, scale)
	what := ref.describe()
	switch {
	case err == nil:
		return scale, nil
	case meta.IsNoMatchError(err):
		return nil, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("scale target %s: the kind is not served by the API server", what)}
	case apierrors.IsNotFound(err), apierrors.IsForbidden(err), apierrors.IsMethodNotSupported(err):
		if has, derr := r.hasScaleSubresource(gvk); derr == nil && !has {
			return nil, &consumerResult{Reason: ReasonNoScaleSubresource, Message: fmt.Sprintf("scale target %s has no scale subresource", what)}
		}
		if apierrors.IsForbidden(err) {
			return nil, &consumerResult{Reason: ReasonScaleTargetForbidden, Message: fmt.Sprintf("scale target %s: the controller may not read its scale subresource: %v", what, err)}
		}
		return nil, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("scale target %s not found", what)}
	}
	return nil, &consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to read the scale of %s: %v", what, err)}
}

// hasScaleSubresource asks discovery whether gvk's resource has a scale
// subresource.
func (r *PolicyReconciler) hasScaleSubresource(gvk schema.GroupVersionKind) (bool, error) {
	mapping, err := r.Client.RESTMapper().RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return false, err
	}
	list, err := r.Discovery.ServerResourcesForGroupVersion(gvk.GroupVersion().String())
	if err != nil {
		return false, err
	}
	for _, res := range list.APIResources {
		if res.Name == mapping.Resource.Resource+"/scale" {
			return true, nil
		}
	}
	return false, nil
}
