package controllers

import (
	"testing"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestOwnershipOf(t *testing.T) {
	g := NewWithT(t)
	g.Expect(ownershipOf(nil, scaledObjectKind)).To(Equal(ownership{Annotations: map[string]bool{}}))
	g.Expect(ownershipOf([]metav1.ManagedFieldsEntry{
		managedBy("kubectl", metav1.ManagedFieldsOperationApply, "minReplicaCount", "maxReplicaCount"),
		managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "maxReplicaCount", "ann:"+AnnotationOwner),
	}, scaledObjectKind)).To(Equal(ownership{Max: true, OtherMin: true, OtherMax: true, Annotations: map[string]bool{AnnotationOwner: true}}))
	g.Expect(ownershipOf([]metav1.ManagedFieldsEntry{
		managedBy(FieldManager, metav1.ManagedFieldsOperationUpdate, "maxReplicaCount"),
		managedBy(MetadataFieldOwner, metav1.ManagedFieldsOperationUpdate, "maxReplicaCount"),
	}, scaledObjectKind)).To(Equal(ownership{Legacy: true, Annotations: map[string]bool{}}), "only the apply entry is ours; Spillway's other entries are nobody else's")
	status := managedBy("keda", metav1.ManagedFieldsOperationUpdate, "maxReplicaCount")
	status.Subresource = "status"
	g.Expect(ownershipOf([]metav1.ManagedFieldsEntry{status}, scaledObjectKind)).To(Equal(ownership{Annotations: map[string]bool{}}), "subresource entries do not count")
}
