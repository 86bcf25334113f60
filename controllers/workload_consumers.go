package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// This file is the policy reconciler's I/O on workloads without an
// autoscaler (scaleTargetRef consumers): it reads their metadata and scale
// subresource from the API server, applies what workload.go plans, and lets
// go of them. Workloads are not cached: a manager does not watch every
// Deployment in the cluster for the few a policy names.

// bindWorkload bounds one workload: it records the user's replicas and the
// owner with a server-side apply under FieldManager, then scales the
// workload down to the bound through its scale subresource, from the
// resourceVersion the apply left, so that a change made meanwhile is never
// overwritten unrecorded.
func (r *PolicyReconciler) bindWorkload(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, w workloadRef, bound int32, autoscalers []autoscalerOf) consumerResult {
	log := ctrl.LoggerFrom(ctx)
	obj, res := r.getWorkload(ctx, pol.Namespace, w)
	if res != nil {
		return *res
	}
	if res := workloadRefusal(w, autoscalers); res != nil {
		// Bounded before an autoscaler took it: the user's replicas go back,
		// and it is left to the autoscaler from then on.
		if obj.GetAnnotations()[AnnotationOwner] == pol.Name {
			if err := r.releaseWorkload(ctx, pol, w, obj); err != nil {
				return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to restore the %s: %v", w.Kind, err)}
			}
		}
		return *res
	}
	if owner := obj.GetAnnotations()[AnnotationOwner]; owner != "" && owner != pol.Name {
		claimed, err := r.workloadClaimedBy(ctx, pol.Namespace, owner, w)
		if err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: err.Error()}
		}
		if claimed {
			return consumerResult{Reason: ReasonConflict, Message: fmt.Sprintf("already bounded by DependencyPolicy %s", owner)}
		}
		log.Info("Taking over a workload whose owner no longer names it", "workload", w.String(), "previousOwner", owner)
	}
	scale, res := r.readScaleOf(ctx, pol.Namespace, w)
	if res != nil {
		return *res
	}
	live := scaleReplicas(scale)
	b := planWorkload(pol.Name, obj.GetAnnotations(), obj.GetLabels(), obj.GetManagedFields(), live, bound)
	if b.Adopted {
		log.Info("The user changed a bounded workload's replicas: recorded as the user's", "workload", w.String(), "user", b.User)
	}
	rv := obj.GetResourceVersion()
	if b.Apply {
		applied, err := r.applyWorkloadMetadata(ctx, w, obj, b.Annotations, b.Labels)
		if err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to record the %s's replicas: %v", w.Kind, err)}
		}
		rv = applied
	}
	if b.Scale {
		if err := r.scaleWorkload(ctx, pol.Namespace, w, scale, rv, b.Desired); err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to scale the %s: %v", w.Kind, err)}
		}
		r.Recorder.Eventf(pol, obj, corev1.EventTypeNormal, EventBounded, "Scale",
			"%s %s: replicas %d -> %d: at most %d replicas call the dependency within its capacity of %d (the user's replicas, %d, come back when the policy lets go)",
			w.Kind, w.Name, live, b.Desired, bound, pol.Spec.Capacity.Concurrency, b.User)
		log.Info("Scaled a workload down to its bound", "workload", w.String(), "from", live, "to", b.Desired, "bound", bound)
	}
	return consumerResult{Message: fmt.Sprintf("replicas=%d", b.Desired), Replicas: &Replicas{Max: &b.Desired}}
}

// getWorkload reads w's metadata from the API server.
func (r *PolicyReconciler) getWorkload(ctx context.Context, namespace string, w workloadRef) (*metav1.PartialObjectMetadata, *consumerResult) {
	gv, err := schema.ParseGroupVersion(w.APIVersion)
	if err != nil {
		return nil, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("invalid apiVersion %q: %v", w.APIVersion, err)}
	}
	obj := &metav1.PartialObjectMetadata{}
	obj.SetGroupVersionKind(gv.WithKind(w.Kind))
	err = r.APIReader.Get(ctx, types.NamespacedName{Namespace: namespace, Name: w.Name}, obj)
	switch {
	case err == nil:
		if !obj.GetDeletionTimestamp().IsZero() {
			return nil, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("the %s is being deleted", w.describe())}
		}
		return obj, nil
	case apierrors.IsNotFound(err):
		return nil, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("%s not found in namespace %s", w.describe(), namespace)}
	case apierrors.IsForbidden(err):
		return nil, &consumerResult{Reason: ReasonScaleTargetForbidden, Message: fmt.Sprintf("%s: the controller may not read it: %v", w.describe(), err)}
	}
	if _, res := r.readScaleOf(ctx, namespace, w); res != nil && res.Reason != ReasonAPIError {
		return nil, res
	}
	return nil, &consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to read %s: %v", w.describe(), err)}
}

// applyWorkloadMetadata server-side applies annotations and labels (and no
// spec field) to obj under FieldManager, with obj's resourceVersion as a
// precondition, and returns the new resourceVersion.
func (r *PolicyReconciler) applyWorkloadMetadata(ctx context.Context, w workloadRef, obj *metav1.PartialObjectMetadata, annotations, labels map[string]string) (string, error) {
	metadata := map[string]any{"name": obj.GetName(), "namespace": obj.GetNamespace(), "resourceVersion": obj.GetResourceVersion()}
	if len(annotations) > 0 {
		metadata["annotations"] = toAny(annotations)
	}
	if len(labels) > 0 {
		metadata["labels"] = toAny(labels)
	}
	u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": w.APIVersion, "kind": w.Kind, "metadata": metadata}}
	if err := r.Client.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(FieldManager), client.ForceOwnership); err != nil {
		return "", err
	}
	return u.GetResourceVersion(), nil
}

// scaleWorkload sets w's replicas through its scale subresource, under
// FieldManager and from resourceVersion rv.
func (r *PolicyReconciler) scaleWorkload(ctx context.Context, namespace string, w workloadRef, scale *unstructured.Unstructured, rv string, replicas int32) error {
	gv, err := schema.ParseGroupVersion(w.APIVersion)
	if err != nil {
		return err
	}
	target := &unstructured.Unstructured{}
	target.SetGroupVersionKind(gv.WithKind(w.Kind))
	target.SetNamespace(namespace)
	target.SetName(w.Name)
	body := scale.DeepCopy()
	body.SetResourceVersion(rv)
	// The Scale read carries its workload's managedFields; sent back, they
	// would replace the API server's bookkeeping, and the update would not
	// be recorded as FieldManager's.
	body.SetManagedFields(nil)
	if err := unstructured.SetNestedField(body.Object, int64(replicas), "spec", "replicas"); err != nil {
		return err
	}
	return r.Client.SubResource("scale").Update(ctx, target, client.WithSubResourceBody(body), client.FieldOwner(FieldManager))
}

// releaseWorkload lets go of w, whose metadata obj the API server just
// returned: the user's replicas go back through the scale subresource
// (under FieldManager), then a merge patch removes the annotations, the label
// and the managedFields entries of FieldManager and MetadataFieldOwner, each
// step from the resourceVersion the one before left. Spillway then owns
// nothing in the workload.
func (r *PolicyReconciler) releaseWorkload(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, w workloadRef, obj *metav1.PartialObjectMetadata) error {
	scale, res := r.readScaleOf(ctx, pol.Namespace, w)
	if res != nil {
		if res.Reason == ReasonScaleTargetNotFound {
			return nil
		}
		return errors.New(res.Message)
	}
	live := scaleReplicas(scale)
	user := planWorkloadRelease(obj.GetAnnotations(), obj.GetManagedFields(), live)
	rv, entries := obj.GetResourceVersion(), obj.GetManagedFields()
	if user != nil && *user != live {
		if err := r.scaleWorkload(ctx, pol.Namespace, w, scale, rv, *user); err != nil {
			if apierrors.IsNotFound(err) {
				return nil
			}
			return fmt.Errorf("failed to scale back to the user's replicas: %w", err)
		}
		fresh, res := r.getWorkload(ctx, pol.Namespace, w)
		if res != nil {
			if res.Reason == ReasonScaleTargetNotFound {
				return nil
			}
			return errors.New(res.Message)
		}
		rv, entries = fresh.GetResourceVersion(), fresh.GetManagedFields()
	}
	data, err := letGoPatch(rv, entries)
	if err != nil {
		return err
	}
	if err := r.Client.Patch(ctx, obj, client.RawPatch(types.MergePatchType, data), client.FieldOwner(MetadataFieldOwner)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	msg := fmt.Sprintf("%s %s: let go at %d replicas", w.Kind, w.Name, live)
	if user != nil {
		msg = fmt.Sprintf("%s %s: the user's replicas are back: %d -> %d", w.Kind, w.Name, live, *user)
	}
	r.Recorder.Eventf(pol, obj, corev1.EventTypeNormal, EventRestored, "Restore", "%s", msg)
	ctrl.LoggerFrom(ctx).Info("Restored a workload", "workload", w.String(), "user", msg)
	return nil
}

// releaseWorkloads lets go of the workloads pol bounded (its status says
// which) or names that keep does not name; a nil keep means pol is being
// deleted. It returns the workloads it could not let go of, to keep in
// status and try again.
func (r *PolicyReconciler) releaseWorkloads(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, keep map[workloadRef]bool) ([]workloadRef, error) {
	refs := map[workloadRef]bool{}
	for _, s := range pol.Status.Workloads {
		refs[workloadOf(&s)] = true
	}
	if keep == nil {
		for _, w := range workloadsOf(pol) {
			refs[w] = true
		}
	}
	maps.DeleteFunc(refs, func(w workloadRef, _ bool) bool { return keep[w] })
	var failed []workloadRef
	var errs []error
	for _, w := range slices.SortedFunc(maps.Keys(refs), compareWorkloads) {
		obj, res := r.getWorkload(ctx, pol.Namespace, w)
		if res != nil {
			if res.Reason == ReasonAPIError {
				failed = append(failed, w)
				errs = append(errs, errors.New(res.Message))
			}
			continue
		}
		if obj.GetAnnotations()[AnnotationOwner] != pol.Name {
			continue
		}
		if err := r.releaseWorkload(ctx, pol, w, obj); err != nil {
			failed = append(failed, w)
			errs = append(errs, fmt.Errorf("failed to restore %s: %w", w, err))
		}
	}
	return failed, errors.Join(errs...)
}

// workloadClaimedBy reports whether the policy owner, in namespace, exists
// and names w as a consumer.
func (r *PolicyReconciler) workloadClaimedBy(ctx context.Context, namespace, owner string, w workloadRef) (bool, error) {
	other := &spillwayv1alpha1.DependencyPolicy{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: namespace, Name: owner}, other); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("failed to read DependencyPolicy %s: %w", owner, err)
	}
	return slices.ContainsFunc(workloadsOf(other), func(o workloadRef) bool { return sameWorkload(o, w) }), nil
}

// autoscalersIn lists the HPAs and (with KEDA) ScaledObjects in namespace
// and the workloads they scale, from the cache. KEDA's own HPAs are left
// out: their ScaledObject is listed.
func (r *PolicyReconciler) autoscalersIn(ctx context.Context, namespace string) ([]autoscalerOf, error) {
	var out []autoscalerOf
	var hpas autoscalingv2.HorizontalPodAutoscalerList
	if err := r.Client.List(ctx, &hpas, client.InNamespace(namespace)); err != nil {
		return nil, fmt.Errorf("failed to list the HorizontalPodAutoscalers in %s: %w", namespace, err)
	}
	for i := range hpas.Items {
		h := hpaAutoscaler{&hpas.Items[i]}
		if scaledObjectOwner(h.HorizontalPodAutoscaler) != "" {
			continue
		}
		out = append(out, autoscalerOf{Kind: hpaKind, Name: h.Name, Target: targetRef(h.scaleTarget())})
	}
	if !r.keda.missing.Load() {
		var sos kedav1alpha1.ScaledObjectList
		if err := r.Client.List(ctx, &sos, client.InNamespace(namespace)); err != nil {
			return nil, fmt.Errorf("failed to list the ScaledObjects in %s: %w", namespace, err)
		}
		for i := range sos.Items {
			s := soAutoscaler{&sos.Items[i]}
			if _, _, name := s.scaleTarget(); name != "" {
				out = append(out, autoscalerOf{Kind: scaledObjectKind, Name: s.Name, Target: targetRef(s.scaleTarget())})
			}
		}
	}
	return out, nil
}

func toAny(m map[string]string) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
