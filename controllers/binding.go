package controllers

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// This file plans, without I/O, what Spillway writes to an autoscaler (a
// ScaledObject or an HPA, read through the autoscaler interface of
// autoscaler.go): the bound of each consumer (Bounds, DesiredReplicas), the
// bound and the pin
// while a policy holds it (planBinding, cleanupPatch), and the user's
// replicas when it lets go (planRelease, letGoPatch). consumers.go does the
// reads and writes these plans call for.
//
// It reads the server-side apply bookkeeping, metadata.managedFields, by the
// rules of structured-merge-diff, the library behind server-side apply:
//
//   - A write that changes a field's value takes the field from every other
//     manager: an update always, an apply only when forced (otherwise it is a
//     conflict).
//   - An apply that sets a field to the value it already has takes nothing
//     from anyone: the appliers share the field.
//   - An applier owns exactly the fields of its last apply. A field it leaves
//     out is released, and deleted if no other manager owns it.
//   - A manager's entry can be edited like any other metadata (by an update
//     that sends managedFields); a field nobody owns stays as it is.
//
// So a field of the user's that FieldManager (spillway-controller) owns alone
// still has the value Spillway applied, while one that another manager owns
// too, or instead, has the value that manager wrote last: the user's.

// FieldManager is the server-side apply field manager that owns a bounded
// autoscaler's min and max (a ScaledObject's spec.minReplicaCount and
// spec.maxReplicaCount, an HPA's spec.minReplicas and spec.maxReplicas) and
// Spillway's annotations, and nothing else. GitOps tools can be told to
// ignore exactly its fields.
const FieldManager = "spillway-controller"

// MetadataFieldOwner is the field owner of the merge patch that lets go of an
// autoscaler: it removes the annotations and Spillway's managedFields
// entries, and so owns nothing afterwards.
const MetadataFieldOwner = "spillway-controller-metadata"

// Spillway's annotations on a ScaledObject or an HPA.
const (
	// AnnotationOwner, on an autoscaler, names the DependencyPolicy (in the
	// same namespace) that bounds it. A second policy naming the same
	// autoscaler reports a Conflict instead of fighting over it.
	AnnotationOwner = "spillway.dev/owner"
	// AnnotationOriginalReplicas, on an autoscaler, records the user's own
	// min and max replicas, as JSON with null for unset
	// ({"min":2,"max":null}), before Spillway first changes them; they are put
	// back when the policy lets go. A change the user makes meanwhile (the
	// field manager loses the field) is recorded here too. On a workload
	// without an autoscaler it holds the workload's replicas and those
	// Spillway last set, {"replicas":80,"applied":20} (see workloadRecord).
	AnnotationOriginalReplicas = "spillway.dev/original-replicas"
	// AnnotationPinnedMinReplicas, on an autoscaler, is the replicas its
	// workload had when the outage began: the minimum pinned while the
	// breaker is Open or HalfOpen and the ramp climbs.
	AnnotationPinnedMinReplicas = "spillway.dev/pinned-min-replicas"
)

// spillwayAnnotations are the annotations FieldManager applies.
var spillwayAnnotations = []string{AnnotationOwner, AnnotationOriginalReplicas, AnnotationPinnedMinReplicas}

// binding is what planBinding decided for one autoscaler.
type binding struct {
	// Live is the autoscaler's replicas now; Desired what they should be.
	Live, Desired Replicas
	// User is the user's replicas, as recorded (and updated with changes the
	// user made since).
	User Replicas
	// Adopted names the fields the user changed since they were recorded.
	Adopted string
	// Pinned is the pinned minimum, nil when not pinning.
	Pinned *int32
	// Annotations are the annotations FieldManager applies: the owner, the
	// user's replicas and, while pinning, the pinned minimum.
	Annotations map[string]string
	// Apply is whether FieldManager must apply Desired and Annotations.
	Apply bool
	// DropLegacy is whether MetadataFieldOwner's entry, left in
	// managedFields by a controller version that wrote the annotations with
	// a merge patch, must go first, so that FieldManager's apply takes the
	// annotations.
	DropLegacy bool
	// Remove are Spillway's annotations that must go but that FieldManager's
	// apply cannot remove, because it does not own them (a field an applier
	// leaves out is removed only if it applied it before). They are removed
	// by a merge patch before the apply, with DropLegacy.
	Remove []string
}

// planBinding decides how policyName bounds the autoscaler a to bound. While pinning, the
// minimum is the pinned-replicas annotation, or scaled (the replicas just read
// from the scale target) when there is none yet.
//
// The user's replicas are the recorded annotation, or the live values before
// the first change, updated with the changes the user made since (see
// userReplicas). Desired and the annotations are applied together, from a's
// resourceVersion, so the record always matches what was live.
func planBinding(policyName string, a autoscaler, bound int32, pinning bool, scaled *int32) binding {
	ann := a.GetAnnotations()
	k := a.kind()
	own := ownershipOf(a.GetManagedFields(), k)
	b := binding{Live: a.replicas(), DropLegacy: own.Legacy}
	held := heldPin(ann)
	b.User = b.Live
	if s, ok := ann[AnnotationOriginalReplicas]; ok {
		if recorded, err := parseReplicas(s); err == nil {
			b.User, b.Adopted = userReplicas(k, recorded, b.Live, own, held)
		}
	}
	if pinning {
		if held != nil {
			b.Pinned = held
		} else if scaled != nil {
			b.Pinned = ptrTo(*scaled)
		}
	}
	b.Desired = desiredReplicas(k, b.User, bound, b.Pinned)

	b.Annotations = map[string]string{
		AnnotationOwner:            policyName,
		AnnotationOriginalReplicas: b.User.marshal(),
	}
	if b.Pinned != nil {
		b.Annotations[AnnotationPinnedMinReplicas] = strconv.Itoa(int(*b.Pinned))
	}
	for _, k := range spillwayAnnotations {
		if _, present := ann[k]; present && b.Annotations[k] == "" && !own.Annotations[k] {
			b.Remove = append(b.Remove, k)
		}
	}
	b.Apply = !b.Live.Equal(b.Desired) ||
		own.Min != (b.Desired.Min != nil) || own.Max != (b.Desired.Max != nil) ||
		!maps.Equal(own.Annotations, keysOf(b.Annotations)) ||
		!annotationsMatch(ann, b.Annotations) ||
		b.DropLegacy || len(b.Remove) > 0
	return b
}

// planRelease is the user's replicas an autoscaler gets back when Spillway
// lets go of it: the record, updated with the changes the user made since;
// nil when nothing was recorded (or the record cannot be read), and then the
// live values stay.
func planRelease(a autoscaler) *Replicas {
	ann := a.GetAnnotations()
	recorded, err := parseReplicas(ann[AnnotationOriginalReplicas])
	if err != nil {
		return nil
	}
	k := a.kind()
	u, _ := userReplicas(k, recorded, a.replicas(), ownershipOf(a.GetManagedFields(), k), heldPin(ann))
	return &u
}

// heldPin is the pinned-replicas annotation, nil when there is none (or it
// cannot be read).
func heldPin(ann map[string]string) *int32 {
	v, err := strconv.ParseInt(ann[AnnotationPinnedMinReplicas], 10, 32)
	if err != nil || v < 0 {
		return nil
	}
	return ptrTo(int32(v))
}

// userReplicas updates the recorded user replicas with the fields of kind k
// the user changed since, and names them. A field's live value is the user's when it
// differs from the record and
//
//   - FieldManager does not own it: another writer changed it (or Spillway
//     never set it), or
//   - another manager owns it too: that manager applied exactly the value
//     Spillway holds (Git says 20 while the bound is 20), which moves no
//     ownership and changes nothing but managedFields. Except a min at the
//     pinned value held: a tool that copies live values into what it applies
//     (Argo CD's RespectIgnoreDifferences) looks just the same, and taking
//     its copy for the user's would make the pin permanent.
func userReplicas(k *autoscalerKind, recorded, live Replicas, own ownership, held *int32) (Replicas, string) {
	var adopted string
	otherMin := own.OtherMin && !(held != nil && equalInt32(live.Min, held))
	if !equalInt32(recorded.Min, live.Min) && (!own.Min || otherMin) {
		recorded.Min, adopted = live.Min, k.MinField
	}
	if !equalInt32(recorded.Max, live.Max) && (!own.Max || own.OtherMax) {
		recorded.Max = live.Max
		if adopted != "" {
			adopted += ","
		}
		adopted += k.MaxField
	}
	return recorded, adopted
}

// letGoPatch is the merge patch with which Spillway lets go of an autoscaler
// at resourceVersion rv whose managedFields are entries, once the user's
// replicas are back: it removes the annotations and the entries of
// FieldManager and MetadataFieldOwner, and changes no other field, so it
// makes MetadataFieldOwner the owner of nothing. Fields only Spillway owned
// are then owned by nobody, and anyone's next apply takes them without a
// conflict.
func letGoPatch(rv string, entries []metav1.ManagedFieldsEntry) ([]byte, error) {
	annotations := map[string]any{}
	for _, k := range spillwayAnnotations {
		annotations[k] = nil
	}
	metadata := map[string]any{"resourceVersion": rv, "annotations": annotations, "labels": map[string]any{LabelBoundedBy: nil}}
	if kept, dropped := withoutSpillway(entries); dropped {
		metadata["managedFields"] = kept
	}
	data, err := json.Marshal(map[string]any{"metadata": metadata})
	if err != nil {
		return nil, fmt.Errorf("failed to build the let-go patch: %w", err)
	}
	return data, nil
}

// cleanupPatch is the merge patch that, before FieldManager's apply, removes
// the annotations b.Remove names and, with b.DropLegacy, MetadataFieldOwner's
// entry from an autoscaler at resourceVersion rv whose managedFields are
// entries. It changes nothing else, so MetadataFieldOwner owns nothing after
// it; nil when there is nothing to do.
func cleanupPatch(b binding, rv string, entries []metav1.ManagedFieldsEntry) ([]byte, error) {
	if !b.DropLegacy && len(b.Remove) == 0 {
		return nil, nil
	}
	metadata := map[string]any{"resourceVersion": rv}
	if len(b.Remove) > 0 {
		annotations := map[string]any{}
		for _, k := range b.Remove {
			annotations[k] = nil
		}
		metadata["annotations"] = annotations
	}
	if b.DropLegacy {
		kept := make([]metav1.ManagedFieldsEntry, 0, len(entries))
		for _, e := range entries {
			if e.Manager != MetadataFieldOwner {
				kept = append(kept, e)
			}
		}
		metadata["managedFields"] = nonEmpty(kept)
	}
	data, err := json.Marshal(map[string]any{"metadata": metadata})
	if err != nil {
		return nil, fmt.Errorf("failed to build the managedFields patch: %w", err)
	}
	return data, nil
}

// withoutSpillway is entries without those of FieldManager and
// MetadataFieldOwner, and whether there were any.
func withoutSpillway(entries []metav1.ManagedFieldsEntry) ([]metav1.ManagedFieldsEntry, bool) {
	kept := make([]metav1.ManagedFieldsEntry, 0, len(entries))
	for _, e := range entries {
		if e.Manager != FieldManager && e.Manager != MetadataFieldOwner {
			kept = append(kept, e)
		}
	}
	return nonEmpty(kept), len(kept) < len(entries)
}

// nonEmpty keeps a managedFields list from reading as "not sent": one empty
// entry is the API server's way to clear managedFields.
func nonEmpty(entries []metav1.ManagedFieldsEntry) []metav1.ManagedFieldsEntry {
	if len(entries) == 0 {
		return []metav1.ManagedFieldsEntry{{}}
	}
	return entries
}

// annotationsMatch reports whether live holds want and none of the other
// spillwayAnnotations.
func annotationsMatch(live, want map[string]string) bool {
	for _, k := range spillwayAnnotations {
		v, ok := live[k]
		w, wanted := want[k]
		if ok != wanted || v != w {
			return false
		}
	}
	return true
}

func keysOf(m map[string]string) map[string]bool {
	keys := make(map[string]bool, len(m))
	for k := range m {
		keys[k] = true
	}
	return keys
}

// Bounds returns, for each consumer in order, the most replicas its workload
// may run so that all consumers together never ask for more than the
// dependency's capacity: floor(capacity × weight / Σweights / slotsPerReplica),
// and at least 1, so a consumer is never scaled to nothing by a bound. A weight
// or slotsPerReplica of 0 (a spec built in Go, not defaulted by the API server)
// counts as 1.
func Bounds(capacity int64, consumers []spillwayv1alpha1.Consumer) []int32 {
	var total int64
	for _, c := range consumers {
		total += max(int64(c.Weight), 1)
	}
	bounds := make([]int32, len(consumers))
	for i, c := range consumers {
		weight := max(int64(c.Weight), 1)
		slots := max(int64(c.SlotsPerReplica), 1)
		// capacity ≤ 2^31 and weight × len ≤ 2^31 × 32: the product fits an int64.
		b := capacity * weight / (total * slots)
		bounds[i] = int32(min(max(b, 1), math.MaxInt32))
	}
	return bounds
}

// DesiredReplicas is what Spillway sets on a ScaledObject whose user declared
// user, for a bound from Bounds and, during an outage, the replicas to pin
// (nil when not pinning):
//
//   - max is min(user's max, bound), where an unset max is KEDA's default of
//     100; it stays unset when the user's is unset and the bound is not lower
//     than 100. Spillway only ever lowers a maximum.
//   - min is the pinned replicas, raised to the user's min and capped at the
//     max, while pinning; otherwise the user's min, capped at the max so that
//     min ≤ max holds as KEDA requires, and unset when the user's is unset.
func DesiredReplicas(user Replicas, bound int32, pin *int32) Replicas {
	return desiredReplicas(scaledObjectKind, user, bound, pin)
}

// desiredReplicas is DesiredReplicas for an autoscaler of kind k, whose unset
// min and max mean k.DefaultMin and k.DefaultMax. A kind whose max is
// required (an HPA) always gets one.
func desiredReplicas(k *autoscalerKind, user Replicas, bound int32, pin *int32) Replicas {
	var out Replicas
	userMax := bound
	switch {
	case user.Max != nil:
		userMax = *user.Max
	case k.DefaultMax > 0:
		userMax = k.DefaultMax
	}
	effectiveMax := min(userMax, bound)
	if user.Max != nil || k.DefaultMax == 0 || bound < k.DefaultMax {
		out.Max = &effectiveMax
	}
	userMin := k.DefaultMin
	if user.Min != nil {
		userMin = *user.Min
	}
	switch {
	case pin != nil:
		v := min(max(*pin, userMin), effectiveMax)
		out.Min = &v
	case user.Min != nil:
		v := min(userMin, effectiveMax)
		out.Min = &v
	}
	return out
}
