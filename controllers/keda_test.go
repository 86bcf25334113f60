package controllers

import (
	"context"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
)

// TestStartsWithoutKEDA runs the controllers against an API server of its
// own that does not serve KEDA's CRDs, as in a cluster that uses plain HPAs:
// the manager starts, bounds the HPA consumer and reports the ScaledObject
// consumer KEDANotInstalled. Once KEDA's CRD is installed, the same manager
// bounds the ScaledObject, without a restart.
func TestStartsWithoutKEDA(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	noKEDA, err := testenv.Start(testenv.WithoutKEDA())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = noKEDA.Stop() })
	c := noKEDA.Client
	nsObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "spillway-"}}
	g.Expect(c.Create(ctx, nsObj)).To(Succeed())
	ns := nsObj.Name

	srv := redistest.Start(t)
	opts := testOptions
	opts.KEDADiscoveryInterval = interval
	rdb := managerRedis(srv)
	startReconciler(t, noKEDA.Config, ns, &Evaluator{Redis: rdb, Options: opts}, &PolicyReconciler{Redis: rdb, Options: opts})

	g.Expect(c.Create(ctx, deploymentObj(ns, "render", 3))).To(Succeed())
	g.Expect(c.Create(ctx, deploymentObj(ns, "reports", 6))).To(Succeed())
	g.Expect(c.Create(ctx, &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "reports"},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: "reports"},
			MinReplicas:    ptr.To[int32](2),
			MaxReplicas:    50,
		},
	})).To(Succeed())
	spec := testSpec("render")
	spec.Consumers = append(spec.Consumers, hpaConsumer("reports"))
	g.Expect(c.Create(ctx, &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "reports-api"}, Spec: spec})).To(Succeed())

	hpaReplicas := func(g Gomega) string {
		hpa := &autoscalingv2.HorizontalPodAutoscaler{}
		g.Expect(c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "reports"}, hpa)).To(Succeed())
		return hpaAutoscaler{hpa}.replicas().String()
	}
	consumersBounded := func(g Gomega) metav1.Condition {
		pol := &spillwayv1alpha1.DependencyPolicy{}
		g.Expect(c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "reports-api"}, pol)).To(Succeed())
		cond := meta.FindStatusCondition(pol.Status.Conditions, ConditionConsumersBounded)
		g.Expect(cond).NotTo(BeNil())
		return *cond
	}

	// Without KEDA: the HPA gets its share of the 40 slots, the
	// ScaledObject consumer is reported, not bounded.
	g.Eventually(hpaReplicas).Should(Equal("min=2 max=20"))
	g.Eventually(consumersBounded).Should(And(
		HaveField("Status", metav1.ConditionFalse),
		HaveField("Reason", ReasonKEDANotInstalled),
		HaveField("Message", And(ContainSubstring("render"), ContainSubstring("KEDA's ScaledObject CRD (keda.sh/v1alpha1) is not installed")))))

	// A policy with only a ScaledObject consumer is deleted while KEDA is
	// not installed: there is nothing to let go of, and the finalizer goes.
	orphan := &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "orphan"}, Spec: testSpec("ghost")}
	g.Expect(c.Create(ctx, orphan)).To(Succeed())
	g.Eventually(func(g Gomega) []string {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(orphan), orphan)).To(Succeed())
		return orphan.Finalizers
	}).Should(ContainElement(Finalizer))
	g.Expect(c.Delete(ctx, orphan)).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(c.Get(ctx, client.ObjectKeyFromObject(orphan), &spillwayv1alpha1.DependencyPolicy{}))
	}).Should(BeTrue(), "the deleted policy's finalizer is removed")

	// KEDA is installed, then the ScaledObject created: the running manager
	// watches it and bounds it.
	g.Expect(noKEDA.InstallKEDA()).To(Succeed())
	g.Expect(c.Create(ctx, scaledObjectObj(ns, "render", deployment("render"), nil, ptr.To[int32](80)), client.FieldOwner("kubectl-client-side-apply"))).To(Succeed())
	g.Eventually(func(g Gomega) string {
		so := &kedav1alpha1.ScaledObject{}
		g.Expect(c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "render"}, so)).To(Succeed())
		return Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}.String()
	}).WithTimeout(30 * time.Second).Should(Equal("min=unset max=20"))
	g.Eventually(consumersBounded).Should(And(HaveField("Status", metav1.ConditionTrue), HaveField("Reason", ReasonBounded)))
	g.Expect(hpaReplicas(g)).To(Equal("min=2 max=20"))
}
