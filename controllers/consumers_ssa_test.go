package controllers

import (
	"context"
	"sync"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/clock"
)

// These tests play a GitOps tool against Spillway through the real API
// server: a second field manager ("argocd") server-side applies the whole
// ScaledObject, as `kubectl apply --server-side --field-manager=argocd` or an
// Argo CD server-side sync does.

// gitopsManager is the second field manager of these tests.
const gitopsManager = "argocd"

// gitopsApply server-side applies a ScaledObject manifest, as Git holds it,
// under gitopsManager: the scale target, one trigger and min and max (nil
// leaves a field out of the manifest). force is --force-conflicts.
func gitopsApply(ns, name string, min, max *int32, force bool) error {
	spec := map[string]any{
		"scaleTargetRef": map[string]any{"name": name},
		"triggers":       []any{map[string]any{"type": "cpu", "metadata": map[string]any{"value": "50"}}},
	}
	if min != nil {
		spec["minReplicaCount"] = int64(*min)
	}
	if max != nil {
		spec["maxReplicaCount"] = int64(*max)
	}
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": kedav1alpha1.GroupVersion.String(),
		"kind":       "ScaledObject",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       spec,
	}}
	opts := []client.ApplyOption{client.FieldOwner(gitopsManager)}
	if force {
		opts = append(opts, client.ForceOwnership)
	}
	return env.Client.Apply(context.Background(), client.ApplyConfigurationFromUnstructured(u), opts...)
}

// specFieldOwners lists the managers that own spec.<field> of so.
func specFieldOwners(so *kedav1alpha1.ScaledObject, field string) []string {
	var owners []string
	for _, e := range so.ManagedFields {
		if e.Subresource == "" && fieldPathOwned(e, "f:spec", "f:"+field) {
			owners = append(owners, e.Manager)
		}
	}
	return owners
}

// fieldPathOwned reports whether entry e owns the field at path.
func fieldPathOwned(e metav1.ManagedFieldsEntry, path ...string) bool {
	if e.FieldsV1 == nil {
		return false
	}
	set, err := parseFieldsV1(e.FieldsV1.Raw)
	if err != nil {
		return false
	}
	return set.has(path...)
}

// staleClient is a manager's client whose List of ScaledObjects (or HPAs), or Get of
// one, answers from a snapshot taken earlier: the informer cache lagging
// behind the API server. Everything else goes to the real client.
type staleClient struct {
	client.Client

	mu sync.Mutex
	// lists, when set, is what a List of ScaledObjects returns.
	lists *kedav1alpha1.ScaledObjectList
	// hpaLists, when set, is what a List of HPAs returns.
	hpaLists *autoscalingv2.HorizontalPodAutoscalerList
	// gets holds, by name, what a Get of a ScaledObject returns.
	gets map[string]*kedav1alpha1.ScaledObject
}

func (c *staleClient) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	c.mu.Lock()
	stale, staleHPAs := c.lists, c.hpaLists
	c.mu.Unlock()
	if l, ok := list.(*kedav1alpha1.ScaledObjectList); ok && stale != nil {
		stale.DeepCopyInto(l)
		return nil
	}
	if l, ok := list.(*autoscalingv2.HorizontalPodAutoscalerList); ok && staleHPAs != nil {
		staleHPAs.DeepCopyInto(l)
		return nil
	}
	return c.Client.List(ctx, list, opts...)
}

func (c *staleClient) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	c.mu.Lock()
	stale := c.gets[key.Name]
	c.mu.Unlock()
	if so, ok := obj.(*kedav1alpha1.ScaledObject); ok && stale != nil {
		stale.DeepCopyInto(so)
		return nil
	}
	return c.Client.Get(ctx, key, obj, opts...)
}

// startManagerWithClient starts a manager for namespace ns whose reconciler
// uses wrap(the manager's client) as its Client. The APIReader stays the
// manager's uncached reader.
func startManagerWithClient(t testing.TB, ns string, rdb redis.UniversalClient, wrap func(client.Client) client.Client) {
	t.Helper()
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatalf("failed to create the manager: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := wrap(mgr.GetClient())
	e := &Evaluator{Redis: rdb, Options: testOptions, Client: c}
	p := &PolicyReconciler{Redis: rdb, Options: testOptions, Client: c}
	if err := setupControllers(ctx, mgr, e, p); err != nil {
		cancel()
		t.Fatalf("failed to set up the controller: %v", err)
	}
	m := &testManager{cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- mgr.Start(ctx) }()
	t.Cleanup(func() { m.stop(t) })
}

// deletePolicy deletes a policy and waits until its finalizer let it go.
func deletePolicy(g Gomega, ns, name string) {
	ctx := context.Background()
	g.Expect(env.Client.Delete(ctx, &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed")
	}).Should(Succeed())
}

// expectLetGo checks that so carries the user's replicas and nothing of
// Spillway's: no annotation, no managedFields entry.
func expectLetGo(g Gomega, ns, name, replicas string) {
	so := getScaledObject(g, ns, name)
	g.Expect(Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}.String()).To(Equal(replicas))
	g.Expect(so.Annotations).NotTo(HaveKey(AnnotationOwner))
	g.Expect(so.Annotations).NotTo(HaveKey(AnnotationOriginalReplicas))
	g.Expect(so.Annotations).NotTo(HaveKey(AnnotationPinnedMinReplicas))
	g.Expect(managers(so)).NotTo(ContainElement(FieldManager))
	g.Expect(managers(so)).NotTo(ContainElement(MetadataFieldOwner))
}

// TestDeleteRestoresAConsumerTheCacheMissed: the policy is deleted while the
// cache has not yet seen its claim on a ScaledObject (its List of
// ScaledObjects is stale: empty). The ScaledObject the spec names is read
// from the API server and restored all the same.
func TestDeleteRestoresAConsumerTheCacheMissed(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	stale := &staleClient{lists: &kedav1alpha1.ScaledObjectList{}}
	startManagerWithClient(t, ns, managerRedis(srv), func(c client.Client) client.Client {
		stale.Client = c
		return stale
	})

	createDeployment(t, ns, "render", 4)
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](80), false)).To(Succeed())
	createPolicy(t, ns, "template-api", testSpec("render"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"))
	g.Expect(getScaledObject(g, ns, "render").Annotations).To(HaveKeyWithValue(AnnotationOwner, "template-api"))

	deletePolicy(g, ns, "template-api")
	expectLetGo(g, ns, "render", "min=2 max=80")
}

// TestLetGoLeavesTheFieldsToGitOps: while Spillway bounds a ScaledObject a
// non-forced apply of another max conflicts with spillway-controller; once
// the policy is deleted, the same apply succeeds and the GitOps manager owns
// max alone.
func TestLetGoLeavesTheFieldsToGitOps(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "render", 4)
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](80), false)).To(Succeed())
	createPolicy(t, ns, "template-api", testSpec("render"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"))

	err := gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](60), false)
	g.Expect(apierrors.IsConflict(err)).To(BeTrue(), "a non-forced apply of another max conflicts while bounded: %v", err)
	g.Expect(err.Error()).To(ContainSubstring(FieldManager))

	deletePolicy(g, ns, "template-api")
	g.Expect(replicasOf(ns, "render")(g)).To(Equal("min=2 max=80"))
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](60), false)).To(Succeed(),
		"once Spillway let go, a non-forced apply conflicts with nobody")
	expectLetGo(g, ns, "render", "min=2 max=60")
	so := getScaledObject(g, ns, "render")
	g.Expect(specFieldOwners(so, "maxReplicaCount")).To(ConsistOf(gitopsManager))
	g.Expect(specFieldOwners(so, "minReplicaCount")).To(ConsistOf(gitopsManager))

	// A ScaledObject whose max was unset gets it unset back.
	createDeployment(t, ns, "thumbs", 2)
	g.Expect(gitopsApply(ns, "thumbs", nil, nil, false)).To(Succeed())
	createPolicy(t, ns, "thumbs-api", testSpec("thumbs"))
	g.Eventually(replicasOf(ns, "thumbs")).Should(Equal("min=unset max=40"))
	deletePolicy(g, ns, "thumbs-api")
	expectLetGo(g, ns, "thumbs", "min=unset max=unset")
	g.Expect(gitopsApply(ns, "thumbs", nil, ptr.To[int32](30), false)).To(Succeed())
	g.Expect(specFieldOwners(getScaledObject(g, ns, "thumbs"), "maxReplicaCount")).To(ConsistOf(gitopsManager))
}

// TestGitOpsApplyOfTheBoundIsTheUsers: the user applies exactly the max
// Spillway holds (the bound is 40, the whole capacity of the one consumer;
// Git now says 40). SSA moves no field: both managers own max. Spillway
// records 40 as the user's max, and 40 is what stays when it lets go.
func TestGitOpsApplyOfTheBoundIsTheUsers(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "render", 4)
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](80), false)).To(Succeed())
	createPolicy(t, ns, "template-api", testSpec("render"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"))
	g.Expect(getScaledObject(g, ns, "render").Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":2,"max":80}`))

	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](40), false)).To(Succeed(),
		"applying the value Spillway holds conflicts with nobody")
	g.Expect(specFieldOwners(getScaledObject(g, ns, "render"), "maxReplicaCount")).To(ContainElements(gitopsManager, FieldManager))
	g.Eventually(func(g Gomega) string {
		return getScaledObject(g, ns, "render").Annotations[AnnotationOriginalReplicas]
	}).WithTimeout(5*time.Second).Should(Equal(`{"min":2,"max":40}`), "the user's 40 is recorded")

	deletePolicy(g, ns, "template-api")
	expectLetGo(g, ns, "render", "min=2 max=40")
	g.Expect(specFieldOwners(getScaledObject(g, ns, "render"), "maxReplicaCount")).To(ConsistOf(gitopsManager))
}

// TestBindFromAStaleReadOverwritesNoEdit: the reconciler plans from a cached
// ScaledObject that predates the user's forced apply of max 60. Its apply is
// refused (the object changed since the read) instead of overwriting 60
// unrecorded, and the bind is planned again from the API server: 60 is
// recorded as the user's and bounded.
func TestBindFromAStaleReadOverwritesNoEdit(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	createDeployment(t, ns, "render", 4)
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](80), false)).To(Succeed())

	pol := &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "template-api"}}
	stale := &staleClient{Client: env.Client, gets: map[string]*kedav1alpha1.ScaledObject{}}
	r := &PolicyReconciler{Client: stale, APIReader: env.Client, Recorder: events.NewFakeRecorder(100), Clock: clock.System{}}

	res := r.bindConsumer(ctx, pol, consumerRef{Kind: scaledObjectKind, Name: "render"}, 20, false)
	g.Expect(res.Reason).To(BeEmpty(), res.Message)
	g.Expect(replicasOf(ns, "render")(g)).To(Equal("min=2 max=20"))

	// The cache holds this read while the user applies 60 with force.
	stale.gets["render"] = getScaledObject(g, ns, "render")
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](60), true)).To(Succeed())

	// The capacity halves: the bound is 10 now, planned first from the stale
	// read.
	res = r.bindConsumer(ctx, pol, consumerRef{Kind: scaledObjectKind, Name: "render"}, 10, false)
	g.Expect(res.Reason).To(BeEmpty(), res.Message)
	so := getScaledObject(g, ns, "render")
	g.Expect(so.Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":2,"max":60}`), "the user's edit is recorded, not overwritten")
	g.Expect(Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}.String()).To(Equal("min=2 max=10"))

	// A reader that stays stale: the bind is refused, nothing is written.
	stale.gets["render"] = so.DeepCopy()
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](50), true)).To(Succeed())
	r.APIReader = stale
	res = r.bindConsumer(ctx, pol, consumerRef{Kind: scaledObjectKind, Name: "render"}, 5, false)
	g.Expect(res.Reason).To(Equal(ReasonAPIError), "a bind from a stale read is refused")
	g.Expect(replicasOf(ns, "render")(g)).To(Equal("min=2 max=50"), "the user's edit is not overwritten")
}

// TestLegacyMetadataOwnerIsDropped: a ScaledObject bound by an earlier
// version, whose annotations spillway-controller-metadata wrote with a merge
// patch, is taken over: that entry is dropped, so the pin annotation, which
// spillway-controller's apply leaves out when the outage is over, is removed
// rather than kept by the old owner.
func TestLegacyMetadataOwnerIsDropped(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	createDeployment(t, ns, "render", 4)
	g.Expect(gitopsApply(ns, "render", ptr.To[int32](2), ptr.To[int32](80), false)).To(Succeed())

	// What the earlier version left during an outage.
	so := getScaledObject(g, ns, "render")
	patch := client.MergeFrom(so.DeepCopy())
	so.Annotations = map[string]string{AnnotationOwner: "template-api", AnnotationOriginalReplicas: `{"min":2,"max":80}`, AnnotationPinnedMinReplicas: "3"}
	g.Expect(env.Client.Patch(ctx, so, patch, client.FieldOwner(MetadataFieldOwner))).To(Succeed())
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": kedav1alpha1.GroupVersion.String(), "kind": "ScaledObject",
		"metadata": map[string]any{"name": "render", "namespace": ns},
		"spec":     map[string]any{"minReplicaCount": int64(3), "maxReplicaCount": int64(40)},
	}}
	g.Expect(env.Client.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(FieldManager), client.ForceOwnership)).To(Succeed())
	g.Expect(managers(getScaledObject(g, ns, "render"))).To(ContainElement(MetadataFieldOwner))

	// The outage is over.
	pol := &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "template-api"}}
	r := &PolicyReconciler{Client: env.Client, APIReader: env.Client, Recorder: events.NewFakeRecorder(100), Clock: clock.System{}}
	res := r.bindConsumer(ctx, pol, consumerRef{Kind: scaledObjectKind, Name: "render"}, 40, false)
	g.Expect(res.Reason).To(BeEmpty(), res.Message)
	so = getScaledObject(g, ns, "render")
	g.Expect(Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}.String()).To(Equal("min=2 max=40"))
	g.Expect(so.Annotations).NotTo(HaveKey(AnnotationPinnedMinReplicas))
	g.Expect(so.Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":2,"max":80}`))
	g.Expect(managers(so)).NotTo(ContainElement(MetadataFieldOwner))

	// And letting go, on delete, leaves nothing of Spillway's. (The field
	// index of the owner annotation needs a cache: the List is empty here.)
	r.Client = &staleClient{Client: env.Client, lists: &kedav1alpha1.ScaledObjectList{}, hpaLists: &autoscalingv2.HorizontalPodAutoscalerList{}}
	pol.Spec.Consumers = []spillwayv1alpha1.Consumer{{ScaledObjectName: "render"}}
	g.Expect(r.releaseAll(ctx, pol, nil)).To(Succeed())
	expectLetGo(g, ns, "render", "min=2 max=80")
}
