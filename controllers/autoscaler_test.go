package controllers

import (
	"testing"

	. "github.com/onsi/gomega"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

func TestDesiredReplicasOfAnHPA(t *testing.T) {
	r := func(min, max *int32) Replicas { return Replicas{Min: min, Max: max} }
	i := ptr.To[int32]
	tests := []struct {
		name  string
		user  Replicas
		bound int32
		pin   *int32
		want  Replicas
	}{
		{name: "max lowered to the bound", user: r(i(2), i(80)), bound: 20, want: r(i(2), i(20))},
		{name: "a lower user max is kept", user: r(i(2), i(10)), bound: 20, want: r(i(2), i(10))},
		{name: "max stays set above 100: it is required", user: r(i(1), i(500)), bound: 200, want: r(i(1), i(200))},
		{name: "min above the bound is capped", user: r(i(30), i(80)), bound: 20, want: r(i(20), i(20))},
		{name: "pinned", user: r(i(2), i(80)), bound: 20, pin: i(7), want: r(i(7), i(20))},
		{name: "pin capped at the max", user: r(i(2), i(80)), bound: 20, pin: i(50), want: r(i(20), i(20))},
		{name: "pin of zero replicas keeps the HPA's minimum of 1", user: r(nil, i(10)), bound: 20, pin: i(0), want: r(i(1), i(10))},
		{name: "pin never lowers the user's min", user: r(i(5), i(80)), bound: 20, pin: i(3), want: r(i(5), i(20))},
		{name: "an unset max (never served) gets the bound", user: r(i(2), nil), bound: 20, want: r(i(2), i(20))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := desiredReplicas(hpaKind, tt.user, tt.bound, tt.pin)
			if !got.Equal(tt.want) {
				t.Errorf("desiredReplicas(HPA, %s, %d, %v) = %s, want %s", tt.user, tt.bound, tt.pin, got, tt.want)
			}
		})
	}
}

func hpa(min *int32, max int32, ann map[string]string, managed ...metav1.ManagedFieldsEntry) hpaAutoscaler {
	return hpaAutoscaler{&autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Name: "reports", Namespace: "ns", Annotations: ann, ManagedFields: managed, ResourceVersion: "7"},
		Spec:       autoscalingv2.HorizontalPodAutoscalerSpec{MinReplicas: min, MaxReplicas: max},
	}}
}

// The planner reads an HPA's minReplicas and maxReplicas, and their owners in
// managedFields, as it reads a ScaledObject's minReplicaCount and
// maxReplicaCount.
func TestPlanBindingOfAnHPA(t *testing.T) {
	g := NewWithT(t)
	i := ptr.To[int32]
	user := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "minReplicas", "maxReplicas", "scaleTargetRef")
	b := planBinding("dep", hpa(i(2), 80, nil, user), 20, false, nil)
	g.Expect(b.Desired.String()).To(Equal("min=2 max=20"))
	g.Expect(b.Annotations).To(Equal(map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":2,"max":80}`}))
	g.Expect(b.Apply).To(BeTrue())

	// Bound: Spillway's apply owns both fields; the user's manager still
	// owns min (unchanged, shared).
	ours := managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "minReplicas", "maxReplicas", "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas)
	userBound := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "scaleTargetRef")
	b = planBinding("dep", hpa(i(2), 20, b.Annotations, userBound, ours), 20, false, nil)
	g.Expect(b.Apply).To(BeFalse(), "nothing to do")
	g.Expect(b.Adopted).To(BeEmpty())

	// The user took maxReplicas with an update: adopted under its HPA name.
	oursMin := managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "minReplicas", "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas)
	edited := managedBy("kubectl-edit", metav1.ManagedFieldsOperationUpdate, "maxReplicas")
	b = planBinding("dep", hpa(i(2), 60, b.Annotations, userBound, oursMin, edited), 20, false, nil)
	g.Expect(b.Adopted).To(Equal("maxReplicas"))
	g.Expect(b.User.String()).To(Equal("min=2 max=60"))
	g.Expect(b.Desired.String()).To(Equal("min=2 max=20"))

	// A ScaledObject's field names mean nothing on an HPA: a manager owning
	// spec.maxReplicaCount does not own maxReplicas.
	own := ownershipOf([]metav1.ManagedFieldsEntry{managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "minReplicaCount", "maxReplicaCount")}, hpaKind)
	g.Expect(own.Min || own.Max).To(BeFalse())

	// Pinning at the replicas read from the scale target, then release.
	b = planBinding("dep", hpa(i(2), 20, map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":2,"max":80}`}, userBound, ours), 20, true, i(6))
	g.Expect(b.Desired.String()).To(Equal("min=6 max=20"))
	g.Expect(b.Annotations).To(HaveKeyWithValue(AnnotationPinnedMinReplicas, "6"))
	got := planRelease(hpa(i(6), 20, b.Annotations, userBound, ours))
	g.Expect(got).NotTo(BeNil())
	g.Expect(got.String()).To(Equal("min=2 max=80"))
}

func TestScaledObjectOwner(t *testing.T) {
	g := NewWithT(t)
	owned := func(refs ...metav1.OwnerReference) *autoscalingv2.HorizontalPodAutoscaler {
		return &autoscalingv2.HorizontalPodAutoscaler{ObjectMeta: metav1.ObjectMeta{Name: "keda-hpa-render", OwnerReferences: refs}}
	}
	g.Expect(scaledObjectOwner(owned())).To(BeEmpty())
	g.Expect(scaledObjectOwner(owned(metav1.OwnerReference{APIVersion: "keda.sh/v1alpha1", Kind: "ScaledObject", Name: "render"}))).To(Equal("render"))
	g.Expect(scaledObjectOwner(owned(
		metav1.OwnerReference{APIVersion: "apps/v1", Kind: "Deployment", Name: "x"},
		metav1.OwnerReference{APIVersion: "keda.sh/v1", Kind: "ScaledObject", Name: "render"},
	))).To(Equal("render"), "any version of keda.sh")
	g.Expect(scaledObjectOwner(owned(metav1.OwnerReference{APIVersion: "example.com/v1", Kind: "ScaledObject", Name: "render"}))).To(BeEmpty(), "another group's ScaledObject is not KEDA's")

	g.Expect(refusal(hpaAutoscaler{owned()})).To(BeNil())
	r := refusal(hpaAutoscaler{owned(metav1.OwnerReference{APIVersion: "keda.sh/v1alpha1", Kind: "ScaledObject", Name: "render"})})
	g.Expect(r).NotTo(BeNil())
	g.Expect(r.Reason).To(Equal(ReasonOwnedByScaledObject))
	g.Expect(r.Message).To(ContainSubstring("scaledObjectName: render"))
}

func TestRefOf(t *testing.T) {
	g := NewWithT(t)
	so := refOf(spillwayv1alpha1.Consumer{ScaledObjectName: "render"})
	g.Expect(so).To(Equal(consumerRef{Kind: scaledObjectKind, Name: "render"}))
	g.Expect(so.String()).To(Equal("render"))
	h := refOf(spillwayv1alpha1.Consumer{HorizontalPodAutoscalerName: "render"})
	g.Expect(h).To(Equal(consumerRef{Kind: hpaKind, Name: "render"}))
	g.Expect(h.String()).To(Equal("HorizontalPodAutoscaler/render"))
	g.Expect(h).NotTo(Equal(so), "a ScaledObject and an HPA of one name are two consumers")

	pol := &spillwayv1alpha1.DependencyPolicy{Spec: spillwayv1alpha1.DependencyPolicySpec{Consumers: []spillwayv1alpha1.Consumer{
		{ScaledObjectName: "a"}, {HorizontalPodAutoscalerName: "b"}, {ScaledObjectName: "c"},
	}}}
	g.Expect(consumerNames(pol)).To(Equal([]string{"a", "c"}))
	g.Expect(hpaConsumerNames(pol)).To(Equal([]string{"b"}))
}
