package controllers

import (
	"context"
	"testing"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
)

// These tests bound workloads that no autoscaler scales (scaleTargetRef
// consumers). No Deployment controller runs in envtest: spec.replicas is
// what a person, a GitOps tool or Spillway last wrote.

// deploymentConsumer is a consumer naming an apps/v1 Deployment.
func deploymentConsumer(name string) spillwayv1alpha1.Consumer {
	return spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "Deployment", Name: name}}
}

func getDeployment(g Gomega, ns, name string) *appsv1.Deployment {
	d := &appsv1.Deployment{}
	g.Expect(env.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, d)).To(Succeed())
	return d
}

// deploymentReplicas polls a Deployment's spec.replicas.
func deploymentReplicas(ns, name string) func(Gomega) int32 {
	return func(g Gomega) int32 { return ptr.Deref(getDeployment(g, ns, name).Spec.Replicas, -1) }
}

// kubectlScale sets a Deployment's replicas through its scale subresource,
// as kubectl scale does.
func kubectlScale(ns, name string, replicas int32) error {
	d := &appsv1.Deployment{}
	d.Namespace, d.Name = ns, name
	return kubectlScaleObject(d, replicas)
}

// kubectlScaleObject sets the replicas of workload obj (its namespace and
// name set) through its scale subresource, as kubectl scale does.
func kubectlScaleObject(obj client.Object, replicas int32) error {
	scale := &autoscalingv1.Scale{}
	if err := env.Client.SubResource("scale").Get(context.Background(), obj, scale); err != nil {
		return err
	}
	scale.Spec.Replicas = replicas
	return env.Client.SubResource("scale").Update(context.Background(), obj, client.WithSubResourceBody(scale), client.FieldOwner("kubectl"))
}

// setConsumers sets a policy's consumers with a merge patch (the controller
// writes its status meanwhile).
func setConsumers(g Gomega, ns, name string, consumers ...spillwayv1alpha1.Consumer) {
	pol := getPolicy(g, ns, name)
	patch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Consumers = consumers
	g.Expect(env.Client.Patch(context.Background(), pol, patch)).To(Succeed())
}

// TestWorkloadConsumerLifecycle follows a Deployment without an autoscaler,
// beside an HPA consumer, through a policy's life: scaled down to its share
// of the capacity with its own replicas recorded and an Event, a person's
// kubectl scale below the bound kept as theirs, the user's replicas back
// when the consumer leaves the spec, and again when the policy is deleted.
func TestWorkloadConsumerLifecycle(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "render", 80)
	createDeployment(t, ns, "reports", 6)
	createHPA(t, ns, "reports", "reports", ptr.To[int32](2), 50)
	spec := testSpec()
	render := deploymentConsumer("render")
	render.SlotsPerReplica = 2
	spec.Consumers = []spillwayv1alpha1.Consumer{render, hpaConsumer("reports")}
	createPolicy(t, ns, "template-api", spec)

	// 40 slots, 1:1: 20 for each consumer; render makes 2 calls per replica.
	g.Eventually(deploymentReplicas(ns, "render")).Should(Equal(int32(10)))
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=20"))
	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	d := getDeployment(g, ns, "render")
	g.Expect(d.Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"replicas":80,"applied":10}`))
	g.Expect(d.Annotations).To(HaveKeyWithValue(AnnotationOwner, "template-api"))
	g.Expect(d.Labels).To(HaveKeyWithValue(LabelBoundedBy, "template-api"))
	g.Eventually(func(g Gomega) []spillwayv1alpha1.ScaleTargetRef {
		return getPolicy(g, ns, "template-api").Status.Workloads
	}).Should(Equal([]spillwayv1alpha1.ScaleTargetRef{{APIVersion: "apps/v1", Kind: "Deployment", Name: "render"}}))
	g.Eventually(eventReasons(ns, "template-api")).Should(ContainElement(EventBounded))
	g.Eventually(eventMessages(ns, "template-api", EventBounded)).Should(ContainElement(
		"Deployment render: replicas 80 -> 10: at most 10 replicas call the dependency within its capacity of 40 (the user's replicas, 80, come back when the policy lets go)"))

	// A person scales below the bound: theirs, recorded, and not raised.
	g.Expect(kubectlScale(ns, "render", 4)).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getDeployment(g, ns, "render").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"replicas":4,"applied":4}`))
	g.Consistently(deploymentReplicas(ns, "render"), "300ms").Should(Equal(int32(4)))

	// Then back up to 30: above the bound, so scaled down to 10 again, and
	// 30 is what comes back.
	g.Expect(kubectlScale(ns, "render", 30)).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getDeployment(g, ns, "render").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"replicas":30,"applied":10}`))
	g.Eventually(deploymentReplicas(ns, "render")).Should(Equal(int32(10)))
	g.Eventually(eventMessages(ns, "template-api", EventBounded)).Should(ContainElement(
		"Deployment render: replicas 30 -> 10: at most 10 replicas call the dependency within its capacity of 40 (the user's replicas, 30, come back when the policy lets go)"))

	// The consumer leaves the spec: its replicas are back, Spillway owns
	// nothing in it, and status forgets it.
	setConsumers(g, ns, "template-api", hpaConsumer("reports"))
	g.Eventually(deploymentReplicas(ns, "render")).Should(Equal(int32(30)))
	g.Eventually(func(g Gomega) {
		d := getDeployment(g, ns, "render")
		g.Expect(d.Annotations).NotTo(HaveKey(AnnotationOwner))
		g.Expect(d.Annotations).NotTo(HaveKey(AnnotationOriginalReplicas))
		g.Expect(d.Labels).NotTo(HaveKey(LabelBoundedBy))
		g.Expect(managersOf(d)).NotTo(ContainElements(FieldManager, MetadataFieldOwner))
	}).Should(Succeed())
	g.Eventually(func(g Gomega) []spillwayv1alpha1.ScaleTargetRef {
		return getPolicy(g, ns, "template-api").Status.Workloads
	}).Should(BeEmpty())

	// Named again, then the policy is deleted: the user's replicas are back.
	setConsumers(g, ns, "template-api", hpaConsumer("reports"), render)
	g.Eventually(deploymentReplicas(ns, "render")).Should(Equal(int32(10)))
	g.Consistently(func(g Gomega) string {
		return getDeployment(g, ns, "render").Annotations[AnnotationOriginalReplicas]
	}, "500ms").Should(Equal(`{"replicas":30,"applied":10}`), "Spillway's own scale is not taken for the user's")
	g.Expect(env.Client.Delete(ctx, getPolicy(g, ns, "template-api"))).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "template-api"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed")
	}).Should(Succeed())
	d = getDeployment(g, ns, "render")
	g.Expect(*d.Spec.Replicas).To(Equal(int32(30)))
	g.Expect(d.Labels).NotTo(HaveKey(LabelBoundedBy))
	g.Expect(d.Annotations).NotTo(HaveKey(AnnotationOwner))
	g.Eventually(eventMessages(ns, "template-api", EventRestored)).Should(ContainElement("Deployment render: the user's replicas are back: 10 -> 30"))
}

// TestAutoscaledWorkloadIsRefused: a Deployment that an HPA scales cannot be
// a scaleTargetRef consumer; the condition names the HPA, and the
// Deployment's replicas are left alone.
func TestAutoscaledWorkloadIsRefused(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "render", 80)
	createHPA(t, ns, "render-hpa", "render", nil, 100)
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{deploymentConsumer("render")}
	createPolicy(t, ns, "template-api", spec)

	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("False/" + ReasonOwnedByHorizontalPodAutoscaler))
	c := getPolicy(g, ns, "template-api").Status.Conditions
	g.Expect(c).To(ContainElement(HaveField("Message", ContainSubstring("name the HorizontalPodAutoscaler instead (horizontalPodAutoscalerName: render-hpa)"))))
	d := getDeployment(g, ns, "render")
	g.Expect(*d.Spec.Replicas).To(Equal(int32(80)))
	g.Expect(d.Annotations).NotTo(HaveKey(AnnotationOwner))

	// A consumer naming a missing workload says so.
	setConsumers(g, ns, "template-api", spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "StatefulSet", Name: "nope"}})
	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("False/" + ReasonScaleTargetNotFound))
}

// TestManagerRoleBoundsWorkloads runs the manager as a user holding only
// the generated manager-role: it reads, labels and scales a Deployment
// without an autoscaler, and gives its replicas back.
func TestManagerRoleBoundsWorkloads(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	var role rbacv1.ClusterRole
	readRBAC(t, "role.yaml", &role)
	ns := newNamespace(t)
	name := "spillway-manager-" + ns
	bindClusterRole(t, g, &role, name)
	user, err := env.Environment.AddUser(envtest.User{Name: name, Groups: []string{"system:authenticated"}}, nil)
	g.Expect(err).NotTo(HaveOccurred())
	srv := redistest.Start(t)
	startManagerWithConfig(t, user.Config(), ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "mailer", 60)
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{deploymentConsumer("mailer")}
	pol := createPolicy(t, ns, "smtp", spec)
	g.Eventually(deploymentReplicas(ns, "mailer")).Should(Equal(int32(40)))
	g.Eventually(conditionOf(ns, "smtp", ConditionConsumersBounded)).Should(Equal("True/Bounded"))

	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(deploymentReplicas(ns, "mailer")).Should(Equal(int32(60)))
}

// statefulSetObj is a StatefulSet with replicas; no controller runs in
// envtest to start its pods.
func statefulSetObj(ns, name string, replicas int32) *appsv1.StatefulSet {
	d := deploymentObj(ns, name, replicas)
	return &appsv1.StatefulSet{
		ObjectMeta: d.ObjectMeta,
		Spec:       appsv1.StatefulSetSpec{Replicas: d.Spec.Replicas, Selector: d.Spec.Selector, Template: d.Spec.Template, ServiceName: name},
	}
}

// replicaSetObj is a ReplicaSet with replicas.
func replicaSetObj(ns, name string, replicas int32) *appsv1.ReplicaSet {
	d := deploymentObj(ns, name, replicas)
	return &appsv1.ReplicaSet{
		ObjectMeta: d.ObjectMeta,
		Spec:       appsv1.ReplicaSetSpec{Replicas: d.Spec.Replicas, Selector: d.Spec.Selector, Template: d.Spec.Template},
	}
}

// scaleOf polls the spec.replicas of workload obj's scale subresource.
func scaleOf(obj client.Object) func(Gomega) int32 {
	return func(g Gomega) int32 {
		scale := &autoscalingv1.Scale{}
		g.Expect(env.Client.SubResource("scale").Get(context.Background(), obj, scale)).To(Succeed())
		return scale.Spec.Replicas
	}
}

// metadataOf reads workload obj afresh (into a copy) for its metadata.
func metadataOf(g Gomega, obj client.Object) client.Object {
	fresh := obj.DeepCopyObject().(client.Object)
	g.Expect(env.Client.Get(context.Background(), client.ObjectKeyFromObject(obj), fresh)).To(Succeed())
	return fresh
}

// TestStatefulSetAndReplicaSetConsumers bounds the other workload kinds a
// scaleTargetRef names through their scale subresource, as Deployments
// are: a StatefulSet and a ReplicaSet above their share scaled down with
// their users' replicas recorded and an Event each, a kubectl scale of the
// StatefulSet above the bound recorded as the user's and lowered again, its
// replicas back when it leaves the spec, and the ReplicaSet's when the
// policy is deleted.
func TestStatefulSetAndReplicaSetConsumers(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	sts := statefulSetObj(ns, "render", 80)
	rs := replicaSetObj(ns, "mailer", 50)
	g.Expect(env.Client.Create(ctx, sts)).To(Succeed())
	g.Expect(env.Client.Create(ctx, rs)).To(Succeed())
	spec := testSpec()
	render := spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "StatefulSet", Name: "render"}, SlotsPerReplica: 2}
	mailer := spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "mailer"}}
	spec.Consumers = []spillwayv1alpha1.Consumer{render, mailer}
	createPolicy(t, ns, "template-api", spec)

	// 40 slots, 1:1: 20 for each; render makes 2 calls per replica.
	g.Eventually(scaleOf(sts)).Should(Equal(int32(10)))
	g.Eventually(scaleOf(rs)).Should(Equal(int32(20)))
	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	for _, w := range []struct {
		obj    client.Object
		record string
	}{{sts, `{"replicas":80,"applied":10}`}, {rs, `{"replicas":50,"applied":20}`}} {
		got := metadataOf(g, w.obj)
		g.Expect(got.GetAnnotations()).To(HaveKeyWithValue(AnnotationOriginalReplicas, w.record), w.obj.GetName())
		g.Expect(got.GetAnnotations()).To(HaveKeyWithValue(AnnotationOwner, "template-api"), w.obj.GetName())
		g.Expect(got.GetLabels()).To(HaveKeyWithValue(LabelBoundedBy, "template-api"), w.obj.GetName())
	}
	g.Eventually(func(g Gomega) []spillwayv1alpha1.ScaleTargetRef {
		return getPolicy(g, ns, "template-api").Status.Workloads
	}).Should(Equal([]spillwayv1alpha1.ScaleTargetRef{
		{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "mailer"},
		{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "render"},
	}))
	g.Eventually(eventMessages(ns, "template-api", EventBounded)).Should(ContainElements(
		"StatefulSet render: replicas 80 -> 10: at most 10 replicas call the dependency within its capacity of 40 (the user's replicas, 80, come back when the policy lets go)",
		"ReplicaSet mailer: replicas 50 -> 20: at most 20 replicas call the dependency within its capacity of 40 (the user's replicas, 50, come back when the policy lets go)",
	))

	// kubectl scale of the StatefulSet above the bound (no webhook here):
	// the user's new replicas, recorded, and lowered to the bound again.
	g.Expect(kubectlScaleObject(sts, 30)).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return metadataOf(g, sts).GetAnnotations()[AnnotationOriginalReplicas]
	}).Should(Equal(`{"replicas":30,"applied":10}`))
	g.Eventually(scaleOf(sts)).Should(Equal(int32(10)))

	// The StatefulSet leaves the spec: its replicas are back, and Spillway
	// owns nothing in it; the ReplicaSet stays bounded.
	setConsumers(g, ns, "template-api", mailer)
	g.Eventually(scaleOf(sts)).Should(Equal(int32(30)))
	g.Eventually(func(g Gomega) {
		got := metadataOf(g, sts)
		g.Expect(got.GetAnnotations()).NotTo(HaveKey(AnnotationOwner))
		g.Expect(got.GetAnnotations()).NotTo(HaveKey(AnnotationOriginalReplicas))
		g.Expect(got.GetLabels()).NotTo(HaveKey(LabelBoundedBy))
		g.Expect(managersOf(got)).NotTo(ContainElements(FieldManager, MetadataFieldOwner))
	}).Should(Succeed())
	// mailer alone has all 40 slots now: 40 is below its user's 50.
	g.Eventually(scaleOf(rs)).Should(Equal(int32(40)))
	g.Eventually(eventMessages(ns, "template-api", EventRestored)).Should(ContainElement("StatefulSet render: the user's replicas are back: 10 -> 30"))

	// The policy is deleted: the ReplicaSet's replicas are back.
	g.Expect(env.Client.Delete(ctx, getPolicy(g, ns, "template-api"))).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "template-api"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed")
	}).Should(Succeed())
	g.Expect(scaleOf(rs)(g)).To(Equal(int32(50)))
	got := metadataOf(g, rs)
	g.Expect(got.GetLabels()).NotTo(HaveKey(LabelBoundedBy))
	g.Expect(got.GetAnnotations()).NotTo(HaveKey(AnnotationOwner))
	g.Eventually(eventMessages(ns, "template-api", EventRestored)).Should(ContainElement("ReplicaSet mailer: the user's replicas are back: 40 -> 50"))
}
