package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// This file is the policy reconciler's I/O on its consumers: it reads
// autoscalers (ScaledObjects and HPAs) and their scale targets and applies
// what binding.go plans.

// Event reasons for autoscalers, besides the transitions in plan.go
// (internal/control).
const (
	// EventBounded: Spillway changed an autoscaler's min or max replicas.
	EventBounded = "Bounded"
	// EventRestored: Spillway put back an autoscaler's replicas and let go
	// of it.
	EventRestored = "Restored"
)

// reconcileConsumers bounds each consumer of pol for state and the limit
// published with it, and lets go of the autoscalers pol bounded but no longer
// names. It returns one result per consumer, in spec order, then one per
// autoscaler it failed to let go.
//
// It also returns the workloads (scaleTargetRef consumers) to record in
// status: those the spec names and those it failed to let go, so that a
// workload that leaves the spec is found and given its replicas back.
func (r *PolicyReconciler) reconcileConsumers(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, params policy.Params, state wire.State, limit int64) ([]consumerResult, []workloadRef) {
	bounds := ConsumerBounds(params, state, limit, pol.Spec.Consumers)
	pinning := control.PinsMinReplicas(params, state)
	results := make([]consumerResult, 0, len(pol.Spec.Consumers))
	named := make(map[consumerRef]bool, len(pol.Spec.Consumers))
	workloads := map[workloadRef]bool{}
	var autoscalers []autoscalerOf
	var listErr error
	listed := false
	for i, c := range pol.Spec.Consumers {
		if c.ScaleTargetRef != nil {
			w := workloadOf(c.ScaleTargetRef)
			workloads[w] = true
			if !listed {
				autoscalers, listErr = r.autoscalersIn(ctx, pol.Namespace)
				listed = true
			}
			res := consumerResult{Reason: ReasonAPIError, Message: fmt.Sprint(listErr)}
			if listErr == nil {
				res = r.bindWorkload(ctx, pol, w, bounds[i], autoscalers)
			}
			res.Name = w.String()
			results = append(results, res)
			continue
		}
		ref := refOf(c)
		named[ref] = true
		res := r.bindConsumer(ctx, pol, ref, bounds[i], pinning)
		res.Name = ref.String()
		results = append(results, res)
	}
	if err := r.releaseAll(ctx, pol, named); err != nil {
		results = append(results, consumerResult{Name: "(released consumers)", Reason: ReasonAPIError, Message: err.Error()})
	}
	failed, err := r.releaseWorkloads(ctx, pol, workloads)
	if err != nil {
		results = append(results, consumerResult{Name: "(released workloads)", Reason: ReasonAPIError, Message: err.Error()})
	}
	for _, w := range failed {
		workloads[w] = true
	}
	return results, slices.SortedFunc(maps.Keys(workloads), compareWorkloads)
}

// bindConsumer bounds one autoscaler: it records the user's replicas and
// the owner, pins the minimum during an outage and bounds the maximum, in one
// server-side apply under FieldManager. It plans from the cache; when the
// autoscaler changed since (the cache lags, or the user just wrote), the
// apply is refused and bindConsumer plans once more from the API server.
func (r *PolicyReconciler) bindConsumer(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, ref consumerRef, bound int32, pinning bool) consumerResult {
	res, conflict := r.bindFrom(ctx, r.Client, pol, ref, bound, pinning)
	if conflict {
		ctrl.LoggerFrom(ctx).V(1).Info("An autoscaler changed since the cache read it: reading it again", ref.Kind.LogKey, klog.KRef(pol.Namespace, ref.Name))
		res, _ = r.bindFrom(ctx, r.APIReader, pol, ref, bound, pinning)
	}
	return res
}

// bindFrom is bindConsumer with the autoscaler read from reader. It reports
// whether the apply was refused because the autoscaler changed since it was
// read.
func (r *PolicyReconciler) bindFrom(ctx context.Context, reader client.Reader, pol *spillwayv1alpha1.DependencyPolicy, ref consumerRef, bound int32, pinning bool) (consumerResult, bool) {
	log := ctrl.LoggerFrom(ctx)
	kind := ref.Kind.Kind
	if ref.Kind == scaledObjectKind && r.keda.missing.Load() {
		return consumerResult{Reason: ReasonKEDANotInstalled, Message: fmt.Sprintf(
			"KEDA's ScaledObject CRD (%s) is not installed: the ScaledObject is bounded once it is, without a restart", kedav1alpha1.GroupVersion)}, false
	}
	so := ref.newObject()
	if err := reader.Get(ctx, types.NamespacedName{Namespace: pol.Namespace, Name: ref.Name}, so.object()); err != nil {
		if apierrors.IsNotFound(err) {
			return consumerResult{Reason: ref.Kind.NotFound, Message: fmt.Sprintf("%s not found in namespace %s", kind, pol.Namespace)}, false
		}
		return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to read the %s: %v", kind, err)}, false
	}
	if !so.GetDeletionTimestamp().IsZero() {
		return consumerResult{Reason: ref.Kind.NotFound, Message: fmt.Sprintf("the %s is being deleted", kind)}, false
	}
	if res := refusal(so); res != nil {
		// Bounded before it was refused (KEDA adopted it since): the user's
		// replicas go back, and it is left alone from then on.
		if so.GetAnnotations()[AnnotationOwner] == pol.Name {
			if err := r.release(ctx, pol, so); err != nil {
				return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to restore the %s: %v", kind, err)}, false
			}
		}
		return *res, false
	}
	if owner := so.GetAnnotations()[AnnotationOwner]; owner != "" && owner != pol.Name {
		claimed, err := r.claimedBy(ctx, pol.Namespace, owner, ref)
		if err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: err.Error()}, false
		}
		if claimed {
			return consumerResult{Reason: ReasonConflict, Message: fmt.Sprintf("already bounded by DependencyPolicy %s", owner)}, false
		}
		log.Info("Taking over an autoscaler whose owner no longer names it", ref.Kind.LogKey, klog.KObj(so), "previousOwner", owner)
	}

	// The scale target is read when the outage begins (to pin its replicas)
	// and once per autoscaler generation (to report a bad target early).
	var scaled *int32
	var failed *consumerResult
	if needPin := pinning && so.GetAnnotations()[AnnotationPinnedMinReplicas] == ""; needPin || !r.scaleChecked(so) {
		replicas, res := r.readScale(ctx, so)
		if res != nil {
			failed = res
		} else if needPin {
			scaled = &replicas
		}
	}

	b := planBinding(pol.Name, so, bound, pinning, scaled)
	if b.Adopted != "" {
		log.Info("The user changed a bounded autoscaler: recorded as the user's replicas", ref.Kind.LogKey, klog.KObj(so), "fields", b.Adopted, "user", b.User.String())
	}
	if b.Apply {
		if err := r.applyBinding(ctx, so, b); err != nil {
			if apierrors.IsConflict(err) {
				return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("the %s changed since it was read; it is read again", kind)}, true
			}
			return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to apply replicas: %v", err)}, false
		}
		if !b.Live.Equal(b.Desired) {
			msg := fmt.Sprintf("%s %s: replicas %s -> %s (bound %d)", kind, so.GetName(), b.Live, b.Desired, bound)
			if b.Pinned != nil {
				msg += fmt.Sprintf(", minimum pinned at %d replicas through the outage", *b.Pinned)
			}
			r.Recorder.Eventf(pol, so.object(), corev1.EventTypeNormal, EventBounded, "Bound", "%s", msg)
			log.Info("Bounded an autoscaler", ref.Kind.LogKey, klog.KObj(so), "from", b.Live.String(), "to", b.Desired.String(), "bound", bound)
		}
	}
	if failed != nil {
		return *failed, false
	}
	return consumerResult{Message: b.Desired.String(), Replicas: &b.Desired}, false
}

// applyBinding server-side applies b under FieldManager: min and max as
// b.Desired sets them (a field that goes back to unset is removed) and the
// annotations, in one request that fails if so changed since it was read. A
// user's change made meanwhile is therefore never overwritten unrecorded: it
// is read, and recorded, on the next try. What the apply cannot remove (see
// cleanupPatch) goes first, from the same resourceVersion.
func (r *PolicyReconciler) applyBinding(ctx context.Context, so autoscaler, b binding) error {
	data, err := cleanupPatch(b, so.GetResourceVersion(), so.GetManagedFields())
	if err != nil {
		return err
	}
	if data != nil {
		if err := r.Client.Patch(ctx, so.object(), client.RawPatch(types.MergePatchType, data), client.FieldOwner(MetadataFieldOwner)); err != nil {
			return fmt.Errorf("failed to remove annotations the apply cannot: %w", err)
		}
	}
	_, err = r.apply(ctx, so, b.Desired, b.Annotations)
	return err
}

// apply server-side applies min and max (the fields desired sets, and no
// others) and annotations to so under FieldManager, with so's resourceVersion
// as a precondition, and returns the object the API server answered.
func (r *PolicyReconciler) apply(ctx context.Context, so autoscaler, desired Replicas, annotations map[string]string) (*unstructured.Unstructured, error) {
	k := so.kind()
	ann := make(map[string]any, len(annotations))
	for k, v := range annotations {
		ann[k] = v
	}
	metadata := map[string]any{"name": so.GetName(), "namespace": so.GetNamespace(), "resourceVersion": so.GetResourceVersion()}
	if len(ann) > 0 {
		metadata["annotations"] = ann
	}
	obj := map[string]any{
		"apiVersion": k.GroupVersion.String(),
		"kind":       k.Kind,
		"metadata":   metadata,
	}
	spec := map[string]any{}
	if desired.Min != nil {
		spec[k.MinField] = int64(*desired.Min)
	}
	if desired.Max != nil {
		spec[k.MaxField] = int64(*desired.Max)
	}
	if len(spec) > 0 {
		obj["spec"] = spec
	}
	u := &unstructured.Unstructured{Object: obj}
	if err := r.Client.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(FieldManager), client.ForceOwnership); err != nil {
		return nil, err
	}
	return u, nil
}

// releaseAll lets go of every autoscaler pol bounds that keep does not
// name. A nil keep means pol is being deleted: then the autoscalers its spec
// names are let go of too, so that one pol claimed moments ago, which the
// cache may not show yet, is not left bounded once the finalizer is gone.
// Each is read from the API server (APIReader) before it is let go.
func (r *PolicyReconciler) releaseAll(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, keep map[consumerRef]bool) error {
	refs := map[consumerRef]bool{}
	// Without KEDA's CRD there is no ScaledObject to let go of.
	kedaMissing := r.keda.missing.Load()
	if !kedaMissing {
		var sos kedav1alpha1.ScaledObjectList
		if err := r.Client.List(ctx, &sos, client.InNamespace(pol.Namespace), client.MatchingFields{IndexOwner: pol.Name}); err != nil {
			return fmt.Errorf("failed to list the ScaledObjects of %s: %w", klog.KObj(pol), err)
		}
		for _, so := range sos.Items {
			refs[consumerRef{Kind: scaledObjectKind, Name: so.Name}] = true
		}
	}
	var hpas autoscalingv2.HorizontalPodAutoscalerList
	if err := r.Client.List(ctx, &hpas, client.InNamespace(pol.Namespace), client.MatchingFields{IndexOwner: pol.Name}); err != nil {
		return fmt.Errorf("failed to list the HorizontalPodAutoscalers of %s: %w", klog.KObj(pol), err)
	}
	for _, h := range hpas.Items {
		refs[consumerRef{Kind: hpaKind, Name: h.Name}] = true
	}
	maps.DeleteFunc(refs, func(ref consumerRef, _ bool) bool { return keep[ref] })
	if keep == nil {
		for _, c := range pol.Spec.Consumers {
			if c.ScaleTargetRef != nil {
				continue // releaseWorkloads lets go of the workloads
			}
			if ref := refOf(c); ref.Kind != scaledObjectKind || !kedaMissing {
				refs[ref] = true
			}
		}
	}
	var errs []error
	if keep == nil {
		if _, err := r.releaseWorkloads(ctx, pol, nil); err != nil {
			errs = append(errs, err)
		}
	}
	for _, ref := range slices.SortedFunc(maps.Keys(refs), compareRefs) {
		so := ref.newObject()
		if err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: pol.Namespace, Name: ref.Name}, so.object()); err != nil {
			if !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("failed to read %s %s: %w", ref.Kind.Kind, ref.Name, err))
			}
			continue
		}
		if so.GetAnnotations()[AnnotationOwner] != pol.Name {
			continue
		}
		if err := r.release(ctx, pol, so); err != nil {
			errs = append(errs, fmt.Errorf("failed to restore %s %s: %w", ref.Kind.Kind, ref.Name, err))
		}
	}
	return errors.Join(errs...)
}

// compareRefs orders consumers by kind, then name.
func compareRefs(a, b consumerRef) int {
	if c := strings.Compare(a.Kind.Kind, b.Kind.Kind); c != 0 {
		return c
	}
	return strings.Compare(a.Name, b.Name)
}

// release lets go of so, in two requests, each failing if so changed since
// the one before:
//
//  1. FieldManager applies the user's replicas (an unset one left out, so it
//     is removed unless another manager owns it), with the annotations
//     unchanged, so that a failure before step 2 leaves so still claimed and
//     the release is tried again.
//  2. A merge patch removes the annotations and the managedFields entries of
//     FieldManager and MetadataFieldOwner, changing no other field.
//
// Spillway then owns nothing: a field only it owned is owned by nobody and
// the user's next apply, forced or not, takes it; a field the user's manager
// owned too stays theirs.
func (r *PolicyReconciler) release(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, so autoscaler) error {
	user := planRelease(so)
	rv, entries := so.GetResourceVersion(), so.GetManagedFields()
	if user != nil {
		ann := map[string]string{}
		for _, k := range spillwayAnnotations {
			if v, ok := so.GetAnnotations()[k]; ok {
				ann[k] = v
			}
		}
		u, err := r.apply(ctx, so, *user, ann)
		if err != nil {
			if apierrors.IsNotFound(err) {
				return nil
			}
			return fmt.Errorf("failed to apply the user's replicas: %w", err)
		}
		rv, entries = u.GetResourceVersion(), u.GetManagedFields()
	}
	data, err := letGoPatch(rv, entries)
	if err != nil {
		return err
	}
	if err := r.Client.Patch(ctx, so.object(), client.RawPatch(types.MergePatchType, data), client.FieldOwner(MetadataFieldOwner)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	r.scaleChecks.Delete(so.GetUID())
	k := so.kind()
	msg := fmt.Sprintf("%s %s: the user's replicas are back", k.Kind, so.GetName())
	if user != nil {
		msg = fmt.Sprintf("%s %s: the user's replicas %s are back", k.Kind, so.GetName(), user)
	}
	r.Recorder.Eventf(pol, so.object(), corev1.EventTypeNormal, EventRestored, "Restore", "%s", msg)
	ctrl.LoggerFrom(ctx).Info("Restored an autoscaler", k.LogKey, klog.KObj(so), "user", msg)
	return nil
}

// claimedBy reports whether the policy owner, in namespace, exists and names
// the autoscaler ref as a consumer.
func (r *PolicyReconciler) claimedBy(ctx context.Context, namespace, owner string, ref consumerRef) (bool, error) {
	other := &spillwayv1alpha1.DependencyPolicy{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: namespace, Name: owner}, other); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("failed to read DependencyPolicy %s: %w", owner, err)
	}
	for _, c := range other.Spec.Consumers {
		if refOf(c) == ref {
			return true, nil
		}
	}
	return false, nil
}

func ptrTo[T any](v T) *T { return &v }
