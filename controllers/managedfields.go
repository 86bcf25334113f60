package controllers

import (
	"encoding/json"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// This file reads the server-side apply bookkeeping, metadata.managedFields,
// for planBinding and planRelease (see binding.go for the rules it relies on).

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
