package controllers

import (
	"context"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// openThenStopRedis creates a policy that stays Open for a minute, opens its
// breaker through the worker protocol and stops Redis, losing its data.
func openThenStopRedis(t *testing.T, g Gomega, srv *redistest.Server, w *worker, ns, name string) *spillwayv1alpha1.DependencyPolicy {
	t.Helper()
	spec := testSpec()
	spec.Breaker.OpenDuration = metav1.Duration{Duration: time.Minute}
	createPolicy(t, ns, name, spec)
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	g.Eventually(func(g Gomega) []string { return getPolicy(g, ns, name).Finalizers }).Should(ContainElement(Finalizer))
	w.report(g, minCalls, protocol.Failure)
	g.Eventually(w.stateLimit()).Should(Equal("Open/0"))
	srv.Stop()
	return getPolicy(g, ns, name)
}

// admitted reports whether a worker is admitted a call now.
func (w *worker) admitted(g Gomega) bool {
	adm, err := w.c.Acquire(context.Background(), protocol.AcquireArgs{LeaseID: leaseID(), TTL: 10 * time.Second})
	if err != nil {
		return false
	}
	if adm.Code != protocol.Admitted {
		return false
	}
	_, err = w.c.Release(context.Background(), adm.Member, 0, protocol.Success, 1)
	g.Expect(err).NotTo(HaveOccurred())
	return true
}

// TestDeleteWaitsForRedis deletes a policy whose breaker is Open while Redis
// is down: the finalizer stays, with a condition and a Warning Event saying
// why, until Redis is back and the fleet is published Closed at full
// capacity; only then does the policy go. Redis comes back empty, as after a
// crash, so the release publishes a state of its own.
func TestDeleteWaitsForRedis(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "billing")
	pol := openThenStopRedis(t, g, srv, w, ns, "billing")

	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(conditionOf(ns, "billing", ConditionReady)).Should(Equal("False/" + ReasonReleasePending))
	g.Expect(conditionIn(getPolicy(g, ns, "billing"), ConditionReady).Message).To(ContainSubstring(AnnotationSkipRedisRelease))
	g.Eventually(eventReasons(ns, "billing")).Should(ContainElement(EventReleaseFailed))
	g.Consistently(func(g Gomega) []string {
		return getPolicy(g, ns, "billing").Finalizers
	}).WithTimeout(3*time.Second).Should(ContainElement(Finalizer), "the finalizer stays while the fleet cannot be released")

	g.Expect(srv.Restart()).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "billing"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed once Redis is back")
	}).WithTimeout(30 * time.Second).Should(Succeed())
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"), "published before the finalizer went")
	g.Expect(w.admitted(g)).To(BeTrue(), "workers are admitted again")
	g.Eventually(eventReasons(ns, "billing")).Should(ContainElement(EventReleased))
}

// TestDeleteSkipRedisRelease: for a Redis that is gone for good, the
// annotation lets the finalizer go without publishing, with a Warning Event.
func TestDeleteSkipRedisRelease(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "archive")
	pol := openThenStopRedis(t, g, srv, w, ns, "archive")

	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(conditionOf(ns, "archive", ConditionReady)).Should(Equal("False/" + ReasonReleasePending))
	g.Consistently(func(g Gomega) []string {
		return getPolicy(g, ns, "archive").Finalizers
	}).Should(ContainElement(Finalizer))

	pol = getPolicy(g, ns, "archive")
	patch := client.MergeFrom(pol.DeepCopy())
	metav1.SetMetaDataAnnotation(&pol.ObjectMeta, AnnotationSkipRedisRelease, "true")
	g.Expect(env.Client.Patch(ctx, pol, patch)).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "archive"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the annotation lets the finalizer go")
	}).WithTimeout(5 * time.Second).Should(Succeed())
	g.Eventually(eventReasons(ns, "archive")).Should(ContainElement(EventReleaseSkipped))
}

// TestDeleteOnStaleCacheIsDone: a second reconcile of a deleted policy,
// from a cache that still holds it with its finalizer, finds the object
// gone and is done, not an error.
func TestDeleteOnStaleCacheIsDone(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	r := newCachedReconciler(t, ns, managerRedis(srv))
	pol := createPolicy(t, ns, "stale", testSpec())
	controllerutil.AddFinalizer(pol, Finalizer)
	g.Expect(env.Client.Update(ctx, pol)).To(Succeed())
	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Expect(env.Client.Get(ctx, client.ObjectKeyFromObject(pol), pol)).To(Succeed())
	stale := pol.DeepCopy()

	_, err := r.reconcileDelete(ctx, pol, &observed{Deleting: true})
	g.Expect(err).NotTo(HaveOccurred())
	err = env.Client.Get(ctx, client.ObjectKeyFromObject(pol), &spillwayv1alpha1.DependencyPolicy{})
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the first reconcile removed the finalizer")

	_, err = r.reconcileDelete(ctx, stale, &observed{Deleting: true})
	g.Expect(err).NotTo(HaveOccurred(), "an object already gone is done")
}

// newCachedReconciler is a reconciler outside any manager, reading ns through
// a cache of its own with the owner index, and Redis through rdb.
func newCachedReconciler(t *testing.T, ns string, rdb *redis.Client) *PolicyReconciler {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c, err := cache.New(env.Config, cache.Options{Scheme: env.Scheme, DefaultNamespaces: map[string]cache.Config{ns: {}}})
	if err != nil {
		t.Fatalf("failed to create a cache: %v", err)
	}
	if err := c.IndexField(ctx, &kedav1alpha1.ScaledObject{}, IndexOwner, ownerName); err != nil {
		t.Fatalf("failed to index ScaledObjects: %v", err)
	}
	if err := c.IndexField(ctx, &autoscalingv2.HorizontalPodAutoscaler{}, IndexOwner, ownerName); err != nil {
		t.Fatalf("failed to index HorizontalPodAutoscalers: %v", err)
	}
	go func() { _ = c.Start(ctx) }()
	if !c.WaitForCacheSync(ctx) {
		t.Fatal("the cache did not sync")
	}
	cl, err := client.New(env.Config, client.Options{Scheme: env.Scheme, Cache: &client.CacheOptions{Reader: c}})
	if err != nil {
		t.Fatalf("failed to create a client: %v", err)
	}
	r := &PolicyReconciler{
		Client:      cl,
		Redis:       rdb,
		Recorder:    events.NewFakeRecorder(1000),
		Evaluations: NewEvaluations(),
		Options:     testOptions,
	}
	r.setDefaults()
	return r
}

// TestDeleteInvalidNeverPublished: a policy whose spec the controller cannot
// use, and that never had state in Redis, has no fleet to release. Deleting
// it takes under 2 s without the escape annotation, so that deleting its
// namespace does not hang, and writes nothing to Redis.
func TestDeleteInvalidNeverPublished(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManagerWrapped(t, ns, managerRedis(srv), testOptions, func(c client.Client) client.Client { return legacyClient{c} })
	w := newWorker(t, srv, ns, "unused")
	spec := testSpec()
	spec.Breaker.MinCalls = legacyMinCalls
	pol := createPolicy(t, ns, "unused", spec)
	g.Eventually(conditionOf(ns, "unused", ConditionStalled)).Should(Equal("True/" + ReasonInvalidSpec))
	g.Eventually(func(g Gomega) []string { return getPolicy(g, ns, "unused").Finalizers }).Should(ContainElement(Finalizer))
	_, found, err := w.c.ReadPublished(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(found).To(BeFalse(), "the policy never had state in Redis")

	start := time.Now()
	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "unused"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer stays")
	}).WithTimeout(2 * time.Second).WithPolling(20 * time.Millisecond).Should(Succeed())
	t.Logf("deleted %v after the delete request", time.Since(start).Round(time.Millisecond))
	_, found, err = w.c.ReadPublished(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(found).To(BeFalse(), "nothing to release, nothing written")
	g.Eventually(eventReasons(ns, "unused")).Should(ContainElement(EventNothingToRelease))
}
