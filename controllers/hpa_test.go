package controllers

import (
	"context"
	"slices"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// These tests bound autoscaling/v2 HorizontalPodAutoscalers, which the
// kube-apiserver serves itself. No HPA controller runs in envtest, so the
// Deployments keep the replicas the tests give them.

// createHPA creates an HPA scaling the apps/v1 Deployment target with the
// user's min (nil: the API server's default of 1) and max.
func createHPA(t testing.TB, ns, name, target string, min *int32, max int32, owners ...metav1.OwnerReference) {
	t.Helper()
	hpa := &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, OwnerReferences: owners},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: target},
			MinReplicas:    min,
			MaxReplicas:    max,
		},
	}
	if err := env.Client.Create(context.Background(), hpa, client.FieldOwner("kubectl-client-side-apply")); err != nil {
		t.Fatalf("failed to create HorizontalPodAutoscaler %s: %v", name, err)
	}
}

func getHPA(g Gomega, ns, name string) *autoscalingv2.HorizontalPodAutoscaler {
	hpa := &autoscalingv2.HorizontalPodAutoscaler{}
	g.Expect(env.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, hpa)).To(Succeed())
	return hpa
}

// hpaReplicasOf polls an HPA's min and max as "min=2 max=20".
func hpaReplicasOf(ns, name string) func(Gomega) string {
	return func(g Gomega) string {
		return hpaAutoscaler{getHPA(g, ns, name)}.replicas().String()
	}
}

// applyFieldsOf is the fieldsV1 of manager's apply entry in obj's
// managedFields, "{}" when it has none.
func applyFieldsOf(obj client.Object, manager string) string {
	for _, e := range obj.GetManagedFields() {
		if e.Manager == manager && e.Operation == metav1.ManagedFieldsOperationApply && e.FieldsV1 != nil {
			return string(e.FieldsV1.Raw)
		}
	}
	return "{}"
}

func managersOf(obj client.Object) []string {
	var m []string
	for _, e := range obj.GetManagedFields() {
		m = append(m, e.Manager)
	}
	return m
}

// hpaConsumer is a consumer naming an HPA.
func hpaConsumer(name string) spillwayv1alpha1.Consumer {
	return spillwayv1alpha1.Consumer{HorizontalPodAutoscalerName: name}
}

// TestHPAConsumerLifecycle follows an HPA consumer, beside a ScaledObject
// consumer, through a policy's life: both bounded to their share of the
// capacity, the HPA's minReplicas pinned at the Deployment's replicas through
// an outage and given back when the ramp completes, a change the user makes
// recorded, and the user's replicas restored when the policy is deleted.
func TestHPAConsumerLifecycle(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "reports-api")

	createDeployment(t, ns, "render", 3)
	createDeployment(t, ns, "reports", 6)
	createScaledObject(t, ns, "render", deployment("render"), nil, ptr.To[int32](80))
	createHPA(t, ns, "reports", "reports", ptr.To[int32](2), 50)
	spec := testSpec("render")
	spec.Consumers = append(spec.Consumers, hpaConsumer("reports"))
	createPolicy(t, ns, "reports-api", spec)

	// 40 slots shared 1:1 between the two kinds: 20 replicas each.
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=20"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=unset max=20"))
	g.Eventually(conditionOf(ns, "reports-api", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	hpa := getHPA(g, ns, "reports")
	g.Expect(hpa.Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":2,"max":50}`))
	g.Expect(hpa.Annotations).To(HaveKeyWithValue(AnnotationOwner, "reports-api"))
	g.Expect(applyFieldsOf(hpa, FieldManager)).To(MatchJSON(`{"f:metadata":{"f:annotations":{"f:spillway.dev/original-replicas":{},"f:spillway.dev/owner":{}}},"f:spec":{"f:maxReplicas":{},"f:minReplicas":{}}}`),
		"the field manager owns minReplicas, maxReplicas and its annotations, and nothing else")
	g.Eventually(eventReasons(ns, "reports-api")).Should(ContainElement(EventBounded))

	// An outage pins minReplicas at the Deployment's replicas.
	w.report(g, minCalls, protocol.Failure)
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=6 max=20"), "pinned to the replicas at the outage")
	g.Expect(getHPA(g, ns, "reports").Annotations).To(HaveKeyWithValue(AnnotationPinnedMinReplicas, "6"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=3 max=20"))

	// Probes close the breaker; once the ramp completes the user's min is back.
	g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"))
	g.Expect(w.report(g, 3, protocol.Success)).To(Equal(3))
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=20"))
	g.Expect(getHPA(g, ns, "reports").Annotations).NotTo(HaveKey(AnnotationPinnedMinReplicas))

	// The user raises maxReplicas with an update (kubectl edit): recorded as
	// theirs, and bounded again.
	hpa = getHPA(g, ns, "reports")
	patch := client.MergeFrom(hpa.DeepCopy())
	hpa.Spec.MaxReplicas = 70
	g.Expect(env.Client.Patch(ctx, hpa, patch, client.FieldOwner("kubectl-edit"))).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getHPA(g, ns, "reports").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"min":2,"max":70}`))
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=20"))

	// Deleting the policy gives the HPA the user's replicas back, and
	// Spillway owns nothing in it any more.
	g.Expect(env.Client.Delete(ctx, getPolicy(g, ns, "reports-api"))).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "reports-api"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed")
	}).Should(Succeed())
	hpa = getHPA(g, ns, "reports")
	g.Expect(hpaAutoscaler{hpa}.replicas().String()).To(Equal("min=2 max=70"))
	g.Expect(hpa.Annotations).NotTo(HaveKey(AnnotationOwner))
	g.Expect(hpa.Annotations).NotTo(HaveKey(AnnotationOriginalReplicas))
	g.Expect(managersOf(hpa)).NotTo(ContainElements(FieldManager, MetadataFieldOwner))
	g.Expect(replicasOf(ns, "render")(g)).To(Equal("min=unset max=80"))
	g.Eventually(eventReasons(ns, "reports-api")).Should(ContainElement(EventRestored))
}

// TestHPAConsumerDroppedAndDefaultMin: an HPA created without minReplicas
// (the API server defaults it to 1) is bounded, and given back when the
// policy stops naming it, while the policy lives on.
func TestHPAConsumerDroppedAndDefaultMin(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "digest", 2)
	createHPA(t, ns, "digest", "digest", nil, 200)
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{hpaConsumer("digest")}
	createPolicy(t, ns, "mailer", spec)

	g.Eventually(hpaReplicasOf(ns, "digest")).Should(Equal("min=1 max=40"), "the whole capacity, one slot per replica")
	g.Expect(getHPA(g, ns, "digest").Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":1,"max":200}`))

	pol := getPolicy(g, ns, "mailer")
	polPatch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Consumers = nil
	g.Expect(env.Client.Patch(ctx, pol, polPatch)).To(Succeed())
	g.Eventually(func(g Gomega) {
		hpa := getHPA(g, ns, "digest")
		g.Expect(hpaAutoscaler{hpa}.replicas().String()).To(Equal("min=1 max=200"))
		g.Expect(hpa.Annotations).NotTo(HaveKey(AnnotationOwner))
		g.Expect(managersOf(hpa)).NotTo(ContainElement(FieldManager))
	}).Should(Succeed())
	g.Eventually(conditionOf(ns, "mailer", ConditionConsumersBounded)).Should(Equal("True/NoConsumers"))
}

// TestKEDAOwnedHPAIsRefused: the HPA KEDA makes for a ScaledObject
// (keda-hpa-<name>, owned by the ScaledObject) is refused as a consumer with
// a condition that says to name the ScaledObject, and left untouched; named
// by its ScaledObject, the same workload is bounded.
func TestKEDAOwnedHPAIsRefused(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "render", 4)
	createScaledObject(t, ns, "render", deployment("render"), ptr.To[int32](1), ptr.To[int32](80))
	so := getScaledObject(g, ns, "render")
	createHPA(t, ns, "keda-hpa-render", "render", ptr.To[int32](1), 80, metav1.OwnerReference{
		APIVersion: kedav1alpha1.GroupVersion.String(), Kind: "ScaledObject", Name: "render", UID: so.UID,
		Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
	})
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{hpaConsumer("keda-hpa-render")}
	createPolicy(t, ns, "template-api", spec)

	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("False/" + ReasonOwnedByScaledObject))
	msg := conditionIn(getPolicy(g, ns, "template-api"), ConditionConsumersBounded).Message
	g.Expect(msg).To(ContainSubstring("HorizontalPodAutoscaler/keda-hpa-render"))
	g.Expect(msg).To(ContainSubstring("name the ScaledObject instead (scaledObjectName: render)"))
	// Ready is set once the evaluator has published too, which may come a
	// moment after the reconciler set ConsumersBounded.
	g.Eventually(conditionOf(ns, "template-api", ConditionReady)).Should(Equal("False/" + ReasonOwnedByScaledObject))
	hpa := getHPA(g, ns, "keda-hpa-render")
	g.Expect(hpaAutoscaler{hpa}.replicas().String()).To(Equal("min=1 max=80"))
	g.Expect(hpa.Annotations).To(BeEmpty())
	g.Expect(managersOf(hpa)).NotTo(ContainElement(FieldManager))

	// The user names the ScaledObject instead.
	pol := getPolicy(g, ns, "template-api")
	patch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Consumers = []spillwayv1alpha1.Consumer{{ScaledObjectName: "render"}}
	g.Expect(env.Client.Patch(ctx, pol, patch)).To(Succeed())
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=1 max=40"))
	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	g.Expect(getHPA(g, ns, "keda-hpa-render").Annotations).To(BeEmpty())
}

// TestHPAAdoptedByKEDAIsLetGo: an HPA that a ScaledObject comes to own
// while Spillway bounds it gets the user's replicas back and is refused from
// then on.
func TestHPAAdoptedByKEDAIsLetGo(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "orders", 2)
	createHPA(t, ns, "orders", "orders", ptr.To[int32](1), 80)
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{hpaConsumer("orders")}
	createPolicy(t, ns, "orders-db", spec)
	g.Eventually(hpaReplicasOf(ns, "orders")).Should(Equal("min=1 max=40"))

	createScaledObject(t, ns, "orders", deployment("orders"), ptr.To[int32](1), ptr.To[int32](80))
	so := getScaledObject(g, ns, "orders")
	hpa := getHPA(g, ns, "orders")
	patch := client.MergeFrom(hpa.DeepCopy())
	hpa.OwnerReferences = []metav1.OwnerReference{{APIVersion: kedav1alpha1.GroupVersion.String(), Kind: "ScaledObject", Name: "orders", UID: so.UID}}
	g.Expect(env.Client.Patch(ctx, hpa, patch, client.FieldOwner("keda"))).To(Succeed())

	g.Eventually(conditionOf(ns, "orders-db", ConditionConsumersBounded)).Should(Equal("False/" + ReasonOwnedByScaledObject))
	g.Eventually(func(g Gomega) {
		hpa := getHPA(g, ns, "orders")
		g.Expect(hpaAutoscaler{hpa}.replicas().String()).To(Equal("min=1 max=80"))
		g.Expect(hpa.Annotations).NotTo(HaveKey(AnnotationOwner))
		g.Expect(managersOf(hpa)).NotTo(ContainElement(FieldManager))
	}).Should(Succeed())
}

// TestHPAWatch: a consumer naming an HPA that does not exist is reported,
// and bounded once the HPA is created; then a change to the bounded HPA
// re-enqueues its policy through the HPA watch. The status interval is an
// hour, so nothing but the watch brings a bounded policy back within the
// test's wait.
func TestHPAWatch(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	opts := testOptions
	opts.StatusInterval = time.Hour
	startManager(t, ns, managerRedis(srv), opts)

	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{hpaConsumer("reports")}
	createPolicy(t, ns, "reports-api", spec)
	g.Eventually(conditionOf(ns, "reports-api", ConditionConsumersBounded)).Should(Equal("False/" + ReasonHorizontalPodAutoscalerNotFound))
	g.Expect(conditionIn(getPolicy(g, ns, "reports-api"), ConditionConsumersBounded).Message).To(ContainSubstring("HorizontalPodAutoscaler/reports: HorizontalPodAutoscaler not found"))

	createDeployment(t, ns, "reports", 3)
	createHPA(t, ns, "reports", "reports", ptr.To[int32](2), 90)
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=40"))
	g.Eventually(conditionOf(ns, "reports-api", ConditionConsumersBounded)).Should(Equal("True/Bounded"))

	hpa := getHPA(g, ns, "reports")
	patch := client.MergeFrom(hpa.DeepCopy())
	hpa.Spec.MaxReplicas = 70
	hpa.Spec.MinReplicas = ptr.To[int32](3)
	g.Expect(env.Client.Patch(ctx, hpa, patch, client.FieldOwner("kubectl-edit"))).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getHPA(g, ns, "reports").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"min":3,"max":70}`))
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=3 max=40"))
}

// TestHPAGitOpsApply plays a GitOps tool that server-side applies the HPA
// from Git, as for ScaledObjects: a non-forced apply of another max
// conflicts with Spillway's field manager; a forced one is recorded as the
// user's value and bounded again; an apply of exactly the bound co-owns the
// field and is recorded.
func TestHPAGitOpsApply(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	gitops := func(min, max int32, force bool) error {
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "autoscaling/v2",
			"kind":       "HorizontalPodAutoscaler",
			"metadata":   map[string]any{"name": "reports", "namespace": ns},
			"spec": map[string]any{
				"scaleTargetRef": map[string]any{"apiVersion": "apps/v1", "kind": "Deployment", "name": "reports"},
				"minReplicas":    int64(min),
				"maxReplicas":    int64(max),
			},
		}}
		opts := []client.ApplyOption{client.FieldOwner(gitopsManager)}
		if force {
			opts = append(opts, client.ForceOwnership)
		}
		return env.Client.Apply(context.Background(), client.ApplyConfigurationFromUnstructured(u), opts...)
	}
	createDeployment(t, ns, "reports", 3)
	g.Expect(gitops(2, 80, false)).To(Succeed())
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{hpaConsumer("reports")}
	createPolicy(t, ns, "reports-api", spec)
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=40"))

	err := gitops(2, 60, false)
	g.Expect(apierrors.IsConflict(err)).To(BeTrue(), "want a conflict with %s, got %v", FieldManager, err)
	g.Expect(err.Error()).To(ContainSubstring(FieldManager))

	g.Expect(gitops(2, 60, true)).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getHPA(g, ns, "reports").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"min":2,"max":60}`))
	g.Eventually(hpaReplicasOf(ns, "reports")).Should(Equal("min=2 max=40"))

	// Git says exactly the bound: no conflict, and it is the user's now.
	g.Expect(gitops(2, 40, false)).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getHPA(g, ns, "reports").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"min":2,"max":40}`))
}

// TestManagerRoleBoundsHPAs runs the manager as a user holding only the
// generated manager-role through an HPA consumer's life: bounded, pinned,
// and restored when the policy is deleted.
func TestManagerRoleBoundsHPAs(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	var role rbacv1.ClusterRole
	readRBAC(t, "role.yaml", &role)
	found := false
	for _, rule := range role.Rules {
		if slices.Contains(rule.APIGroups, "autoscaling") {
			found = true
			g.Expect(rule.APIGroups).To(ConsistOf("autoscaling"))
			g.Expect(rule.Resources).To(ConsistOf("horizontalpodautoscalers"))
			g.Expect(rule.Verbs).To(ConsistOf("get", "list", "watch", "patch"), "the controller patches HPAs, it never updates, creates or deletes them")
		}
	}
	g.Expect(found).To(BeTrue(), "manager-role grants nothing on horizontalpodautoscalers")

	ns := newNamespace(t)
	name := "spillway-manager-" + ns
	bindClusterRole(t, g, &role, name)
	user, err := env.Environment.AddUser(envtest.User{Name: name, Groups: []string{"system:authenticated"}}, nil)
	g.Expect(err).NotTo(HaveOccurred())

	srv := redistest.Start(t)
	startManagerWithConfig(t, user.Config(), ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "search")
	createDeployment(t, ns, "indexer", 4)
	createHPA(t, ns, "indexer", "indexer", ptr.To[int32](1), 50)
	spec := testSpec()
	spec.Consumers = []spillwayv1alpha1.Consumer{hpaConsumer("indexer")}
	pol := createPolicy(t, ns, "search", spec)
	g.Eventually(hpaReplicasOf(ns, "indexer")).Should(Equal("min=1 max=40"))
	g.Eventually(conditionOf(ns, "search", ConditionReady)).Should(Equal("True/Evaluated"))

	w.report(g, minCalls, protocol.Failure)
	g.Eventually(hpaReplicasOf(ns, "indexer")).Should(Equal("min=4 max=40"), "pinned")

	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "search"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue())
	}).Should(Succeed())
	g.Expect(hpaReplicasOf(ns, "indexer")(g)).To(Equal("min=1 max=50"))
}
