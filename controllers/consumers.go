package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// scaleCheckMaxDelay caps how long a ScaledObject whose scale target could
// not be read waits before the controller reads it again.
const scaleCheckMaxDelay = 5 * time.Minute

// reconcileConsumers bounds each consumer of pol for state, and lets go of
// the ScaledObjects pol bounded but no longer names. It returns one result
// per consumer, in spec order, then one per ScaledObject it failed to let go.
func (r *DependencyPolicyReconciler) reconcileConsumers(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, params policy.Params, state protocol.State) []consumerResult {
	bounds := Bounds(params.Capacity, pol.Spec.Consumers)
	pinning := params.PinMinReplicas && (state == protocol.Open || state == protocol.HalfOpen || state == protocol.Ramping)
	results := make([]consumerResult, 0, len(pol.Spec.Consumers))
	named := make(map[string]bool, len(pol.Spec.Consumers))
	for i, c := range pol.Spec.Consumers {
		named[c.ScaledObjectName] = true
		res := r.bindConsumer(ctx, pol, c.ScaledObjectName, bounds[i], pinning)
		res.Name = c.ScaledObjectName
		results = append(results, res)
	}
	if err := r.releaseAll(ctx, pol, named); err != nil {
		results = append(results, consumerResult{Name: "(released consumers)", Reason: ReasonAPIError, Message: err.Error()})
	}
	return results
}

// bindConsumer bounds one ScaledObject: it records the user's replicas and
// the owner first, pins the minimum during an outage, and server-side applies
// min and max under FieldManager.
func (r *DependencyPolicyReconciler) bindConsumer(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, name string, bound int32, pinning bool) consumerResult {
	log := ctrl.LoggerFrom(ctx)
	so := &kedav1alpha1.ScaledObject{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: pol.Namespace, Name: name}, so); err != nil {
		if apierrors.IsNotFound(err) {
			return consumerResult{Reason: ReasonScaledObjectNotFound, Message: fmt.Sprintf("ScaledObject not found in namespace %s", pol.Namespace)}
		}
		return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to read the ScaledObject: %v", err)}
	}
	if !so.DeletionTimestamp.IsZero() {
		return consumerResult{Reason: ReasonScaledObjectNotFound, Message: "the ScaledObject is being deleted"}
	}
	if owner := so.Annotations[AnnotationOwner]; owner != "" && owner != pol.Name {
		claimed, err := r.claimedBy(ctx, pol.Namespace, owner, name)
		if err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: err.Error()}
		}
		if claimed {
			return consumerResult{Reason: ReasonConflict, Message: fmt.Sprintf("already bounded by DependencyPolicy %s", owner)}
		}
		log.Info("Taking over a ScaledObject whose owner no longer names it", "scaledObject", klog.KObj(so), "previousOwner", owner)
	}

	// The scale target is read when the outage begins (to pin its replicas)
	// and once per ScaledObject generation (to report a bad target early).
	var scaled *int32
	var failed *consumerResult
	if needPin := pinning && so.Annotations[AnnotationPinnedMinReplicas] == ""; needPin || !r.scaleChecked(so) {
		replicas, res := r.readScale(ctx, so)
		if res != nil {
			failed = res
		} else if needPin {
			scaled = &replicas
		}
	}

	b := planBinding(pol.Name, so, bound, pinning, scaled)
	if len(b.Annotations) > 0 {
		if err := r.patchAnnotations(ctx, so, b.Annotations); err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to annotate the ScaledObject: %v", err)}
		}
	}
	if b.Adopted != "" {
		log.Info("The user changed a bounded ScaledObject: recorded as the user's replicas", "scaledObject", klog.KObj(so), "fields", b.Adopted, "user", b.User.String())
	}
	if b.Apply {
		if err := r.applyReplicas(ctx, so, b.Desired); err != nil {
			return consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to apply replicas: %v", err)}
		}
		if !b.Live.Equal(b.Desired) {
			msg := fmt.Sprintf("ScaledObject %s: replicas %s -> %s (bound %d)", so.Name, b.Live, b.Desired, bound)
			if b.Pinned != nil {
				msg += fmt.Sprintf(", minimum pinned at %d replicas through the outage", *b.Pinned)
			}
			r.Recorder.Eventf(pol, so, corev1.EventTypeNormal, EventBounded, "Bound", "%s", msg)
			log.Info("Bounded a ScaledObject", "scaledObject", klog.KObj(so), "from", b.Live.String(), "to", b.Desired.String(), "bound", bound)
		}
	}
	if failed != nil {
		return *failed
	}
	return consumerResult{Message: b.Desired.String()}
}

// binding is what planBinding decided for one ScaledObject.
type binding struct {
	// Live is the ScaledObject's replicas now; Desired what they should be.
	Live, Desired Replicas
	// User is the user's replicas, as recorded (and updated with changes the
	// user made since).
	User Replicas
	// Adopted names the fields the user changed since they were recorded.
	Adopted string
	// Pinned is the pinned minimum, nil when not pinning.
	Pinned *int32
	// Annotations to set (a value) or remove (nil); empty when unchanged.
	Annotations map[string]*string
	// Apply is whether min and max must be server-side applied.
	Apply bool
}

// planBinding decides, without I/O, how policyName bounds so to bound. While
// pinning, the minimum is the pinned-replicas annotation, or scaled (the
// replicas just read from the scale target) when there is none yet.
//
// The user's replicas are the recorded annotation, or the live values before
// the first change. A field that FieldManager no longer owns but whose live
// value differs from the recorded one was changed by the user (any other
// writer takes the field's ownership from FieldManager when it changes the
// value): the live value becomes the user's.
func planBinding(policyName string, so *kedav1alpha1.ScaledObject, bound int32, pinning bool, scaled *int32) binding {
	ann := so.GetAnnotations()
	b := binding{Live: Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}}
	owned := ownedReplicaFields(so.ManagedFields)
	b.User = b.Live
	if s, ok := ann[AnnotationOriginalReplicas]; ok {
		if recorded, err := parseReplicas(s); err == nil {
			b.User, b.Adopted = adoptUserChanges(recorded, b.Live, owned)
		}
	}
	if pinning {
		if v, err := strconv.ParseInt(ann[AnnotationPinnedMinReplicas], 10, 32); err == nil && v >= 0 {
			b.Pinned = ptrTo(int32(v))
		} else if scaled != nil {
			b.Pinned = ptrTo(*scaled)
		}
	}
	b.Desired = DesiredReplicas(b.User, bound, b.Pinned)

	want := map[string]*string{
		AnnotationOwner:             ptrTo(policyName),
		AnnotationOriginalReplicas:  ptrTo(b.User.marshal()),
		AnnotationPinnedMinReplicas: nil,
	}
	if b.Pinned != nil {
		want[AnnotationPinnedMinReplicas] = ptrTo(strconv.Itoa(int(*b.Pinned)))
	}
	b.Annotations = map[string]*string{}
	for k, v := range want {
		cur, ok := ann[k]
		if (v == nil && ok) || (v != nil && (!ok || cur != *v)) {
			b.Annotations[k] = v
		}
	}
	b.Apply = !b.Live.Equal(b.Desired) || owned.Min != (b.Desired.Min != nil) || owned.Max != (b.Desired.Max != nil)
	return b
}

// adoptUserChanges updates the recorded user replicas with the fields the
// user changed since: those FieldManager does not own whose live value
// differs. It also names them.
func adoptUserChanges(recorded, live Replicas, owned ownedFields) (Replicas, string) {
	var adopted string
	if !owned.Min && !equalInt32(recorded.Min, live.Min) {
		recorded.Min, adopted = live.Min, "minReplicaCount"
	}
	if !owned.Max && !equalInt32(recorded.Max, live.Max) {
		recorded.Max = live.Max
		if adopted != "" {
			adopted += ","
		}
		adopted += "maxReplicaCount"
	}
	return recorded, adopted
}

// ownedFields says which replica fields FieldManager owns.
type ownedFields struct{ Min, Max bool }

// ownedReplicaFields reads FieldManager's apply entry in managedFields.
func ownedReplicaFields(entries []metav1.ManagedFieldsEntry) ownedFields {
	var owned ownedFields
	for _, e := range entries {
		if e.Manager != FieldManager || e.Operation != metav1.ManagedFieldsOperationApply || e.Subresource != "" || e.FieldsV1 == nil {
			continue
		}
		var fields struct {
			Spec map[string]json.RawMessage `json:"f:spec"`
		}
		if err := json.Unmarshal(e.FieldsV1.Raw, &fields); err != nil {
			continue
		}
		_, owned.Min = fields.Spec["f:minReplicaCount"]
		_, owned.Max = fields.Spec["f:maxReplicaCount"]
	}
	return owned
}

// patchAnnotations sets and removes annotations on so with a merge patch
// that fails if so changed since it was read, so the recorded user replicas
// are always the ones that were live.
func (r *DependencyPolicyReconciler) patchAnnotations(ctx context.Context, so *kedav1alpha1.ScaledObject, changes map[string]*string) error {
	patch := client.MergeFromWithOptions(so.DeepCopy(), client.MergeFromWithOptimisticLock{})
	for k, v := range changes {
		if v == nil {
			delete(so.Annotations, k)
			continue
		}
		metav1.SetMetaDataAnnotation(&so.ObjectMeta, k, *v)
	}
	return r.Client.Patch(ctx, so, patch, client.FieldOwner(MetadataFieldOwner))
}

// applyReplicas server-side applies min and max under FieldManager: the
// fields desired sets, and no others, so a field that goes back to unset is
// removed.
func (r *DependencyPolicyReconciler) applyReplicas(ctx context.Context, so *kedav1alpha1.ScaledObject, desired Replicas) error {
	obj := map[string]any{
		"apiVersion": kedav1alpha1.GroupVersion.String(),
		"kind":       "ScaledObject",
		"metadata":   map[string]any{"name": so.Name, "namespace": so.Namespace},
	}
	spec := map[string]any{}
	if desired.Min != nil {
		spec["minReplicaCount"] = int64(*desired.Min)
	}
	if desired.Max != nil {
		spec["maxReplicaCount"] = int64(*desired.Max)
	}
	if len(spec) > 0 {
		obj["spec"] = spec
	}
	u := &unstructured.Unstructured{Object: obj}
	return r.Client.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(FieldManager), client.ForceOwnership)
}

// releaseAll lets go of every ScaledObject pol bounds whose name is not in
// keep (all of them when keep is nil).
func (r *DependencyPolicyReconciler) releaseAll(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, keep map[string]bool) error {
	var owned kedav1alpha1.ScaledObjectList
	if err := r.Client.List(ctx, &owned, client.InNamespace(pol.Namespace), client.MatchingFields{IndexOwner: pol.Name}); err != nil {
		return fmt.Errorf("failed to list the ScaledObjects of %s: %w", klog.KObj(pol), err)
	}
	var errs []error
	for i := range owned.Items {
		so := &owned.Items[i]
		if keep[so.Name] {
			continue
		}
		if err := r.release(ctx, pol, so); err != nil {
			errs = append(errs, fmt.Errorf("failed to restore ScaledObject %s: %w", so.Name, err))
		}
	}
	return errors.Join(errs...)
}

// release puts back the user's replicas (unset stays unset), removes
// Spillway's annotations and drops FieldManager's entry from managedFields, in
// one merge patch that fails if so changed since it was read. Dropping the
// entry hands the fields back without deleting them: a server-side apply
// without them would delete any field FieldManager alone owns.
func (r *DependencyPolicyReconciler) release(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy, so *kedav1alpha1.ScaledObject) error {
	data, user, err := releasePatch(so)
	if err != nil {
		return err
	}
	if err := r.Client.Patch(ctx, so, client.RawPatch(types.MergePatchType, data), client.FieldOwner(MetadataFieldOwner)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	r.scaleChecks.Delete(so.UID)
	msg := fmt.Sprintf("ScaledObject %s: the user's replicas are back", so.Name)
	if user != nil {
		msg = fmt.Sprintf("ScaledObject %s: the user's replicas %s are back", so.Name, user)
	}
	r.Recorder.Eventf(pol, so, corev1.EventTypeNormal, EventRestored, "Restore", "%s", msg)
	ctrl.LoggerFrom(ctx).Info("Restored a ScaledObject", "scaledObject", klog.KObj(so), "user", msg)
	return nil
}

// releasePatch is release's merge patch, and the user's replicas it puts
// back (nil when none were recorded, or the record cannot be read: then the
// live values stay).
func releasePatch(so *kedav1alpha1.ScaledObject) ([]byte, *Replicas, error) {
	metadata := map[string]any{
		"resourceVersion": so.ResourceVersion,
		"annotations": map[string]any{
			AnnotationOwner:             nil,
			AnnotationOriginalReplicas:  nil,
			AnnotationPinnedMinReplicas: nil,
		},
	}
	kept := make([]metav1.ManagedFieldsEntry, 0, len(so.ManagedFields))
	for _, e := range so.ManagedFields {
		if e.Manager == FieldManager && e.Operation == metav1.ManagedFieldsOperationApply {
			continue
		}
		kept = append(kept, e)
	}
	if len(kept) < len(so.ManagedFields) {
		if len(kept) == 0 {
			// An empty list would read as "not sent"; one empty entry is the
			// API server's way to clear managedFields.
			kept = []metav1.ManagedFieldsEntry{{}}
		}
		metadata["managedFields"] = kept
	}
	patch := map[string]any{"metadata": metadata}
	var user *Replicas
	live := Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}
	if recorded, err := parseReplicas(so.Annotations[AnnotationOriginalReplicas]); err == nil {
		u, _ := adoptUserChanges(recorded, live, ownedReplicaFields(so.ManagedFields))
		user = &u
		patch["spec"] = map[string]any{"minReplicaCount": u.Min, "maxReplicaCount": u.Max}
	}
	data, err := json.Marshal(patch)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to build the restore patch: %w", err)
	}
	return data, user, nil
}

// claimedBy reports whether the policy owner, in namespace, exists and names
// the ScaledObject as a consumer.
func (r *DependencyPolicyReconciler) claimedBy(ctx context.Context, namespace, owner, scaledObject string) (bool, error) {
	other := &spillwayv1alpha1.DependencyPolicy{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: namespace, Name: owner}, other); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("failed to read DependencyPolicy %s: %w", owner, err)
	}
	for _, c := range other.Spec.Consumers {
		if c.ScaledObjectName == scaledObject {
			return true, nil
		}
	}
	return false, nil
}

// scaleCheck remembers reading one ScaledObject's scale target.
type scaleCheck struct {
	generation int64
	failed     *consumerResult
	failures   int
	next       time.Time
}

// scaleChecked reports whether so's scale target need not be read now: it
// was read successfully at this generation, or it failed and its backoff has
// not expired (then the cached failure is reported by readScale).
func (r *DependencyPolicyReconciler) scaleChecked(so *kedav1alpha1.ScaledObject) bool {
	v, ok := r.scaleChecks.Load(so.UID)
	if !ok {
		return false
	}
	c := v.(scaleCheck)
	return c.generation == so.Generation && c.failed == nil
}

// readScale reads the replicas of so's scale target from its scale
// subresource (spec.replicas: what the autoscaler last asked for). A target
// that failed is read again only after a backoff, doubling from 1s up to
// scaleCheckMaxDelay; meanwhile the last failure is returned.
func (r *DependencyPolicyReconciler) readScale(ctx context.Context, so *kedav1alpha1.ScaledObject) (int32, *consumerResult) {
	now := r.Clock.Now()
	prev := scaleCheck{}
	if v, ok := r.scaleChecks.Load(so.UID); ok {
		prev = v.(scaleCheck)
		if prev.failed != nil && prev.generation == so.Generation && now.Before(prev.next) {
			return 0, prev.failed
		}
	}
	replicas, failed := r.getScale(ctx, so)
	check := scaleCheck{generation: so.Generation, failed: failed}
	if failed != nil {
		check.failures = prev.failures + 1
		delay := min(time.Duration(1<<min(check.failures-1, 20))*time.Second, scaleCheckMaxDelay)
		check.next = now.Add(jitter(delay))
	}
	r.scaleChecks.Store(so.UID, check)
	return replicas, failed
}

// getScale reads the scale subresource of so's scaleTargetRef (KEDA's
// default is an apps/v1 Deployment) and says what went wrong when it cannot.
func (r *DependencyPolicyReconciler) getScale(ctx context.Context, so *kedav1alpha1.ScaledObject) (int32, *consumerResult) {
	ref := so.Spec.ScaleTargetRef
	if ref == nil || ref.Name == "" {
		return 0, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: "the ScaledObject has no scaleTargetRef"}
	}
	apiVersion, kind := ref.APIVersion, ref.Kind
	if apiVersion == "" {
		apiVersion = "apps/v1"
	}
	if kind == "" {
		kind = "Deployment"
	}
	gv, err := schema.ParseGroupVersion(apiVersion)
	if err != nil {
		return 0, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("invalid scaleTargetRef.apiVersion %q: %v", apiVersion, err)}
	}
	gvk := gv.WithKind(kind)
	target := &unstructured.Unstructured{}
	target.SetGroupVersionKind(gvk)
	target.SetNamespace(so.Namespace)
	target.SetName(ref.Name)
	scale := &unstructured.Unstructured{}
	scale.SetGroupVersionKind(schema.GroupVersionKind{Group: "autoscaling", Version: "v1", Kind: "Scale"})
	err = r.Client.SubResource("scale").Get(ctx, target, scale)
	what := fmt.Sprintf("%s %s (%s)", kind, ref.Name, apiVersion)
	switch {
	case err == nil:
		replicas, _, _ := unstructured.NestedInt64(scale.Object, "spec", "replicas")
		return int32(min(max(replicas, 0), math.MaxInt32)), nil
	case meta.IsNoMatchError(err):
		return 0, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("scale target %s: the kind is not served by the API server", what)}
	case apierrors.IsNotFound(err), apierrors.IsForbidden(err), apierrors.IsMethodNotSupported(err):
		if has, derr := r.hasScaleSubresource(gvk); derr == nil && !has {
			return 0, &consumerResult{Reason: ReasonNoScaleSubresource, Message: fmt.Sprintf("scale target %s has no scale subresource", what)}
		}
		if apierrors.IsForbidden(err) {
			return 0, &consumerResult{Reason: ReasonScaleTargetForbidden, Message: fmt.Sprintf("scale target %s: the controller may not read its scale subresource: %v", what, err)}
		}
		return 0, &consumerResult{Reason: ReasonScaleTargetNotFound, Message: fmt.Sprintf("scale target %s not found", what)}
	}
	return 0, &consumerResult{Reason: ReasonAPIError, Message: fmt.Sprintf("failed to read the scale of %s: %v", what, err)}
}

// hasScaleSubresource asks discovery whether gvk's resource has a scale
// subresource.
func (r *DependencyPolicyReconciler) hasScaleSubresource(gvk schema.GroupVersionKind) (bool, error) {
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

func ptrTo[T any](v T) *T { return &v }
