package controllers

import (
	"testing"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestPlanWorkload(t *testing.T) {
	// The creator's manager owns spec.replicas until Spillway first scales;
	// Spillway's scale-subresource update then owns it alone, until a person
	// or a GitOps tool writes it again.
	creator := managedBy("kubectl-client-side-apply", metav1.ManagedFieldsOperationUpdate, "replicas")
	ours := managedBy(FieldManager, metav1.ManagedFieldsOperationUpdate, "replicas")
	ours.Subresource = "scale"
	kubectlScale := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "replicas")
	kubectlScale.Subresource = "scale"
	recorded := func(n, applied int32) map[string]string {
		return map[string]string{AnnotationOwner: "template-api", AnnotationOriginalReplicas: workloadRecord{Replicas: n, Applied: &applied}.marshal()}
	}
	label := map[string]string{LabelBoundedBy: "template-api"}
	tests := []struct {
		name        string
		ann, labels map[string]string
		entries     []metav1.ManagedFieldsEntry
		live, bound int32
		wantUser    int32
		wantDesired int32
		wantAdopted bool
		wantApply   bool
		wantScale   bool
	}{{
		name: "first bind above the bound: recorded, then scaled down",
		ann:  nil, entries: []metav1.ManagedFieldsEntry{creator}, live: 80, bound: 20,
		wantUser: 80, wantDesired: 20, wantApply: true, wantScale: true,
	}, {
		name: "first bind below the bound: recorded and labelled, not scaled",
		ann:  nil, entries: []metav1.ManagedFieldsEntry{creator}, live: 5, bound: 20,
		wantUser: 5, wantDesired: 5, wantApply: true,
	}, {
		name: "bounded and steady: nothing to do",
		ann:  recorded(80, 20), labels: label, entries: []metav1.ManagedFieldsEntry{ours}, live: 20, bound: 20,
		wantUser: 80, wantDesired: 20,
	}, {
		name: "the bound rises (the ramp climbs): scaled up, never past the user's",
		ann:  recorded(80, 5), labels: label, entries: []metav1.ManagedFieldsEntry{ours}, live: 5, bound: 40,
		wantUser: 80, wantDesired: 40, wantApply: true, wantScale: true,
	}, {
		name: "the bound rises past the user's replicas: the user's",
		ann:  recorded(30, 20), labels: label, entries: []metav1.ManagedFieldsEntry{ours}, live: 20, bound: 40,
		wantUser: 30, wantDesired: 30, wantApply: true, wantScale: true,
	}, {
		name: "kubectl scale below the bound: the user's now",
		ann:  recorded(80, 20), labels: label, entries: []metav1.ManagedFieldsEntry{kubectlScale}, live: 6, bound: 20,
		wantUser: 6, wantDesired: 6, wantAdopted: true, wantApply: true,
	}, {
		name: "kubectl scale above the bound (no webhook): the user's, scaled down again",
		ann:  recorded(80, 20), labels: label, entries: []metav1.ManagedFieldsEntry{kubectlScale}, live: 50, bound: 20,
		wantUser: 50, wantDesired: 20, wantAdopted: true, wantApply: true, wantScale: true,
	}, {
		name: "GitOps applies the bound itself: shared, so it is the user's",
		ann:  recorded(80, 20), labels: label, entries: []metav1.ManagedFieldsEntry{ours, creator}, live: 20, bound: 20,
		wantUser: 20, wantDesired: 20, wantAdopted: true, wantApply: true,
	}, {
		name: "Spillway's own value while nobody owns spec.replicas (the API server left its scale unrecorded): still the record",
		ann:  recorded(80, 20), labels: label, entries: nil, live: 20, bound: 20,
		wantUser: 80, wantDesired: 20,
	}, {
		name: "the label was removed: applied again",
		ann:  recorded(80, 20), labels: nil, entries: []metav1.ManagedFieldsEntry{ours}, live: 20, bound: 20,
		wantUser: 80, wantDesired: 20, wantApply: true,
	}, {
		name: "an unreadable record: the live replicas are the user's",
		ann:  map[string]string{AnnotationOwner: "template-api", AnnotationOriginalReplicas: "eighty"}, labels: label, entries: []metav1.ManagedFieldsEntry{ours}, live: 20, bound: 20,
		wantUser: 20, wantDesired: 20, wantApply: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			b := planWorkload("template-api", tt.ann, tt.labels, tt.entries, tt.live, tt.bound)
			g.Expect(b.User).To(Equal(tt.wantUser), "user")
			g.Expect(b.Desired).To(Equal(tt.wantDesired), "desired")
			g.Expect(b.Adopted).To(Equal(tt.wantAdopted), "adopted")
			g.Expect(b.Apply).To(Equal(tt.wantApply), "apply")
			g.Expect(b.Scale).To(Equal(tt.wantScale), "scale")
			g.Expect(b.Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, workloadRecord{Replicas: tt.wantUser, Applied: &tt.wantDesired}.marshal()))
			g.Expect(b.Labels).To(Equal(label))
		})
	}
}

func TestPlanWorkloadRelease(t *testing.T) {
	g := NewWithT(t)
	ours := managedBy(FieldManager, metav1.ManagedFieldsOperationUpdate, "replicas")
	ours.Subresource = "scale"
	argo := managedBy("argocd-controller", metav1.ManagedFieldsOperationUpdate, "replicas")
	ann := map[string]string{AnnotationOriginalReplicas: `{"replicas":80,"applied":20}`}

	g.Expect(planWorkloadRelease(ann, []metav1.ManagedFieldsEntry{ours}, 20)).To(HaveValue(Equal(int32(80))), "Spillway's value: the record goes back")
	g.Expect(planWorkloadRelease(ann, nil, 20)).To(HaveValue(Equal(int32(80))), "Spillway's value, owned by nobody: the record goes back")
	g.Expect(planWorkloadRelease(ann, []metav1.ManagedFieldsEntry{argo}, 12)).To(HaveValue(Equal(int32(12))), "a sync wrote 12 since: it stays")
	g.Expect(planWorkloadRelease(nil, []metav1.ManagedFieldsEntry{ours}, 20)).To(BeNil(), "nothing recorded: the live replicas stay")
}

func TestWorkloadRefusal(t *testing.T) {
	render := workloadRef{APIVersion: "apps/v1", Kind: "Deployment", Name: "render"}
	tests := []struct {
		name        string
		autoscalers []autoscalerOf
		want        string
		wantMessage string
	}{{
		name: "no autoscaler",
	}, {
		name:        "an HPA scales it",
		autoscalers: []autoscalerOf{{Kind: hpaKind, Name: "render-hpa", Target: render}},
		want:        ReasonOwnedByHorizontalPodAutoscaler,
		wantMessage: "the Deployment is scaled by HorizontalPodAutoscaler render-hpa, which would undo any replicas Spillway sets: name the HorizontalPodAutoscaler instead (horizontalPodAutoscalerName: render-hpa)",
	}, {
		name:        "a ScaledObject scales it, under another version of the group",
		autoscalers: []autoscalerOf{{Kind: scaledObjectKind, Name: "render", Target: workloadRef{APIVersion: "apps/v1beta2", Kind: "Deployment", Name: "render"}}},
		want:        ReasonOwnedByScaledObject,
		wantMessage: "name the ScaledObject instead (scaledObjectName: render)",
	}, {
		name: "autoscalers of other workloads",
		autoscalers: []autoscalerOf{
			{Kind: hpaKind, Name: "a", Target: workloadRef{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "render"}},
			{Kind: hpaKind, Name: "b", Target: workloadRef{APIVersion: "argoproj.io/v1alpha1", Kind: "Deployment", Name: "render"}},
			{Kind: hpaKind, Name: "c", Target: workloadRef{APIVersion: "apps/v1", Kind: "Deployment", Name: "thumbs"}},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			res := workloadRefusal(render, tt.autoscalers)
			if tt.want == "" {
				g.Expect(res).To(BeNil())
				return
			}
			g.Expect(res).NotTo(BeNil())
			g.Expect(res.Reason).To(Equal(tt.want))
			g.Expect(res.Message).To(ContainSubstring(tt.wantMessage))
		})
	}
}
