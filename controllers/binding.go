package controllers

import (
	"encoding/json"
	"fmt"
	"maps"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// This file plans, without I/O, what Spillway writes to an autoscaler (a
// ScaledObject or an HPA, see autoscaler.go): the bound and the pin while a
// policy holds it (planBinding), and the user's replicas when it lets go
// (planRelease).
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

// ownership is what managedFields says about the fields Spillway writes.
type ownership struct {
	// Min and Max: FieldManager's apply owns the min and max fields
	// (spec.minReplicaCount and spec.maxReplicaCount of a ScaledObject,
	// spec.minReplicas and spec.maxReplicas of an HPA).
	Min, Max bool
	// OtherMin and OtherMax: a manager other than Spillway's owns them.
	OtherMin, OtherMax bool
	// Annotations FieldManager's apply owns, of spillwayAnnotations.
	Annotations map[string]bool
	// Legacy: MetadataFieldOwner has an entry.
	Legacy bool
}

// ownershipOf reads the managedFields of an autoscaler of kind k. Entries of
// subresources (status) and entries that cannot be read are skipped.
func ownershipOf(entries []metav1.ManagedFieldsEntry, k *autoscalerKind) ownership {
	own := ownership{Annotations: map[string]bool{}}
	for _, e := range entries {
		if e.Subresource != "" || e.FieldsV1 == nil {
			continue
		}
		set, err := parseFieldsV1(e.FieldsV1.Raw)
		if err != nil {
			continue
		}
		minOwned := set.has("f:spec", "f:"+k.MinField)
		maxOwned := set.has("f:spec", "f:"+k.MaxField)
		switch {
		case e.Manager == FieldManager && e.Operation == metav1.ManagedFieldsOperationApply:
			own.Min, own.Max = minOwned, maxOwned
			for _, k := range spillwayAnnotations {
				if set.has("f:metadata", "f:annotations", "f:"+k) {
					own.Annotations[k] = true
				}
			}
		case e.Manager == MetadataFieldOwner:
			own.Legacy = true
		case e.Manager != FieldManager:
			own.OtherMin = own.OtherMin || minOwned
			own.OtherMax = own.OtherMax || maxOwned
		}
	}
	return own
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
	metadata := map[string]any{"resourceVersion": rv, "annotations": annotations}
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

// fieldSet is a managedFields entry's fieldsV1, as nested maps keyed by
// "f:<name>" (and "k:", "v:", "i:" for list items).
type fieldSet map[string]fieldSet

// parseFieldsV1 reads a managedFields entry's fieldsV1.
func parseFieldsV1(raw []byte) (fieldSet, error) {
	var s fieldSet
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, fmt.Errorf("failed to parse fieldsV1: %w", err)
	}
	return s, nil
}

// has reports whether the set holds the field at path, e.g. "f:spec",
// "f:maxReplicaCount".
func (s fieldSet) has(path ...string) bool {
	cur := s
	for _, p := range path {
		next, ok := cur[p]
		if !ok {
			return false
		}
		cur = next
	}
	return true
}
