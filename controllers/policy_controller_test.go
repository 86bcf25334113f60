package controllers

import (
	"context"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func init() {
	SetDefaultEventuallyTimeout(20 * time.Second)
	SetDefaultEventuallyPollingInterval(20 * time.Millisecond)
	SetDefaultConsistentlyDuration(time.Second)
	SetDefaultConsistentlyPollingInterval(20 * time.Millisecond)
}

func deployment(name string) kedav1alpha1.ScaleTarget { return kedav1alpha1.ScaleTarget{Name: name} }

// TestOutageRecoveryAndRelease follows a dependency through an outage: two
// consumers bounded, failures reported through the worker protocol open the
// breaker within two intervals and pin the minimums, probes close it, the
// ramp climbs 5/10/20/40 back to Closed and the minimums come back; a consumer
// dropped from the policy and then the deleted policy give the user's
// replicas back.
func TestOutageRecoveryAndRelease(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "template-api")

	createDeployment(t, ns, "render", 6)
	createDeployment(t, ns, "thumbs", 3)
	createScaledObject(t, ns, "render", deployment("render"), ptr.To[int32](2), ptr.To[int32](80))
	createScaledObject(t, ns, "thumbs", deployment("thumbs"), nil, ptr.To[int32](10))
	createPolicy(t, ns, "template-api", testSpec("render", "thumbs"))

	// Both bounded: 40 slots shared 1:1 is 20 replicas each; thumbs's own
	// max of 10 is lower and stays.
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=20"))
	g.Eventually(replicasOf(ns, "thumbs")).Should(Equal("min=unset max=10"))
	g.Eventually(conditionOf(ns, "template-api", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	g.Eventually(conditionOf(ns, "template-api", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	render := getScaledObject(g, ns, "render")
	g.Expect(render.Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":2,"max":80}`))
	g.Expect(render.Annotations).To(HaveKeyWithValue(AnnotationOwner, "template-api"))
	g.Expect(getScaledObject(g, ns, "thumbs").Annotations).To(HaveKeyWithValue(AnnotationOriginalReplicas, `{"min":null,"max":10}`))
	g.Expect(fieldsOf(render, FieldManager)).To(MatchJSON(`{"f:metadata":{"f:annotations":{"f:spillway.dev/original-replicas":{},"f:spillway.dev/owner":{}}},"f:spec":{"f:maxReplicaCount":{},"f:minReplicaCount":{}}}`),
		"the field manager owns min, max and its annotations, and nothing else")

	// Failures through Acquire and Release open the breaker within two
	// evaluation intervals.
	g.Expect(w.report(g, minCalls, protocol.Failure)).To(Equal(minCalls))
	written := time.Now()
	g.Eventually(w.stateLimit()).WithTimeout(2*interval).WithPolling(5*time.Millisecond).Should(Equal("Open/0"),
		"the limit reaches 0 within two evaluation intervals")
	t.Logf("Limit 0 in Redis %v after the failure burst", time.Since(written))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=6 max=20"), "pinned to the replicas at the outage")
	g.Eventually(replicasOf(ns, "thumbs")).Should(Equal("min=3 max=10"))
	g.Expect(getScaledObject(g, ns, "render").Annotations).To(HaveKeyWithValue(AnnotationPinnedMinReplicas, "6"))
	g.Eventually(conditionOf(ns, "template-api", ConditionBreakerOpen)).Should(Equal("True/FailureRatioExceeded"))

	// HalfOpen after a second; three probes close the breaker and the ramp
	// climbs one step per clean second.
	g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"))
	g.Expect(w.report(g, 3, protocol.Success)).To(Equal(3))
	var seen []string
	g.Eventually(func(g Gomega) string {
		s := w.stateLimit()(g)
		if len(seen) == 0 || seen[len(seen)-1] != s {
			seen = append(seen, s)
		}
		return s
	}).WithPolling(10 * time.Millisecond).Should(Equal("Closed/40"))
	g.Expect(seen).To(ContainElements("Ramping/5", "Ramping/10", "Ramping/20", "Closed/40"))
	g.Expect(seen).NotTo(ContainElement("Open/0"), "no reopen during a clean ramp: %v", seen)
	t.Logf("Recovery: %v", seen)

	// The ramp is complete: the users' minimums are back, the bounds stay.
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=20"))
	g.Eventually(replicasOf(ns, "thumbs")).Should(Equal("min=unset max=10"))
	g.Expect(getScaledObject(g, ns, "render").Annotations).NotTo(HaveKey(AnnotationPinnedMinReplicas))
	g.Eventually(conditionOf(ns, "template-api", ConditionRamping)).Should(Equal("False/RampComplete"))

	// The user lowers render's max while it is bounded: recorded as theirs.
	so := getScaledObject(g, ns, "render")
	patch := client.MergeFrom(so.DeepCopy())
	so.Spec.MaxReplicaCount = ptr.To[int32](60)
	g.Expect(env.Client.Patch(ctx, so, patch, client.FieldOwner("kubectl-edit"))).To(Succeed())
	g.Eventually(func(g Gomega) string {
		return getScaledObject(g, ns, "render").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"min":2,"max":60}`))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=20"))

	// thumbs leaves the policy: its replicas and nothing else come back.
	pol := getPolicy(g, ns, "template-api")
	polPatch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Consumers = pol.Spec.Consumers[:1]
	g.Expect(env.Client.Patch(ctx, pol, polPatch)).To(Succeed())
	g.Eventually(func(g Gomega) {
		thumbs := getScaledObject(g, ns, "thumbs")
		g.Expect(thumbs.Spec.MinReplicaCount).To(BeNil())
		g.Expect(thumbs.Spec.MaxReplicaCount).To(Equal(ptr.To[int32](10)))
		g.Expect(thumbs.Annotations).NotTo(HaveKey(AnnotationOwner))
		g.Expect(thumbs.Annotations).NotTo(HaveKey(AnnotationOriginalReplicas))
		g.Expect(managers(thumbs)).NotTo(ContainElement(FieldManager))
	}).Should(Succeed())

	// Deleting the policy gives render back too, with the user's new max.
	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "template-api"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed")
	}).Should(Succeed())
	render = getScaledObject(g, ns, "render")
	g.Expect(Replicas{Min: render.Spec.MinReplicaCount, Max: render.Spec.MaxReplicaCount}.String()).To(Equal("min=2 max=60"))
	g.Expect(render.Annotations).NotTo(HaveKey(AnnotationOwner))
	g.Expect(render.Annotations).NotTo(HaveKey(AnnotationOriginalReplicas))
	g.Expect(managers(render)).NotTo(ContainElement(FieldManager))
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"), "a deleted policy leaves the fleet at full capacity")

	g.Eventually(eventReasons(ns, "template-api")).Should(ContainElements(
		EventOpened, EventHalfOpened, EventClosed, EventRampStep, EventBounded, EventRestored))
}

// TestRestartMidRampContinues stops the manager in the middle of the ramp and
// starts another: the ramp continues where it was, neither from the bottom
// nor at full capacity.
func TestRestartMidRampContinues(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	rdb := managerRedis(srv)
	first := startManager(t, ns, rdb, testOptions)
	w := newWorker(t, srv, ns, "ledger")
	spec := testSpec()
	spec.Ramp.StepDuration = metav1.Duration{Duration: 3 * time.Second}
	createPolicy(t, ns, "ledger", spec)

	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	w.report(g, minCalls, protocol.Timeout)
	g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"))
	w.report(g, 3, protocol.Success)
	g.Eventually(w.stateLimit()).WithTimeout(10 * time.Second).Should(Equal("Ramping/10"))

	first.stop(t)
	before := w.published(g)
	g.Expect(before.State).To(Equal(wire.Ramping))
	g.Expect(before.Limit).To(Equal(int64(10)))
	time.Sleep(time.Second)

	startManager(t, ns, rdb, testOptions)
	var firstAfter protocol.Published
	g.Eventually(func(g Gomega) bool {
		firstAfter = w.published(g)
		return firstAfter.UpdatedAt.After(before.UpdatedAt)
	}).WithPolling(5 * time.Millisecond).Should(BeTrue())
	g.Expect(firstAfter.State).To(Equal(wire.Ramping))
	g.Expect(firstAfter.Limit).To(BeElementOf(int64(10), int64(20)), "the ramp continues, not from 5 and not at 40")
	g.Expect(firstAfter.Epoch).To(Equal(before.Epoch))

	var seen []int64
	g.Eventually(func(g Gomega) wire.State {
		p := w.published(g)
		if len(seen) == 0 || seen[len(seen)-1] != p.Limit {
			seen = append(seen, p.Limit)
		}
		return p.State
	}).WithTimeout(15 * time.Second).Should(Equal(wire.Closed))
	g.Expect(seen).NotTo(ContainElement(int64(5)), "limits after the restart: %v", seen)
	t.Logf("Limits after the restart: %v", seen)
}

// TestRedisDown: a hung Redis and then a lost one make the policy not Ready
// with the reason, leave the last decision in place, and the controller
// continues from Redis (after a hang) or from status (after data loss), never
// from Closed at full capacity; after data loss its publication starts the
// learning second (docs/protocol.md §4 "Learning").
func TestRedisDown(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "payments")
	spec := testSpec()
	spec.Breaker.OpenDuration = metav1.Duration{Duration: time.Minute}
	createPolicy(t, ns, "payments", spec)

	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	g.Expect(w.published(g).LearningUntil).To(BeZero(), "a first publication lost nothing: no learning")
	w.report(g, minCalls, protocol.Failure)
	g.Eventually(w.stateLimit()).Should(Equal("Open/0"))
	g.Eventually(func(g Gomega) spillwayv1alpha1.DependencyState {
		return getPolicy(g, ns, "payments").Status.State
	}).Should(Equal(spillwayv1alpha1.StateOpen))
	epoch := w.published(g).Epoch

	// Hung: every operation times out.
	g.Expect(srv.Pause()).To(Succeed())
	g.Eventually(conditionOf(ns, "payments", ConditionReady)).Should(Equal("False/RedisUnavailable"))
	pol := getPolicy(g, ns, "payments")
	g.Expect(pol.Status.State).To(Equal(spillwayv1alpha1.StateOpen))
	g.Expect(conditionIn(pol, ConditionReady).Message).To(ContainSubstring("workers keep the limit last published"))
	g.Expect(srv.Resume()).To(Succeed())
	g.Eventually(conditionOf(ns, "payments", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Expect(w.stateLimit()(g)).To(Equal("Open/0"))
	g.Expect(w.published(g).Epoch).To(Equal(epoch), "continues from what Redis holds")

	// Lost: Redis restarts empty.
	srv.Stop()
	g.Eventually(conditionOf(ns, "payments", ConditionReady)).Should(Equal("False/RedisUnavailable"))
	g.Expect(srv.Restart()).To(Succeed())
	g.Eventually(conditionOf(ns, "payments", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Consistently(w.stateLimit()).Should(Equal("Open/0"), "restored from status, not Closed")
	g.Expect(w.published(g).Epoch).To(Equal(int64(1)))
	g.Expect(w.published(g).LearningUntil).NotTo(BeZero(), "republished over a lost state: the dependency learned before admitting")
}

// TestBadConsumersDoNotBlockOthers: a missing ScaledObject, a target kind
// without a scale subresource, a missing target and a conflict each show in
// ConsumersBounded with its reason, while every policy keeps being evaluated
// and a healthy one is bounded.
func TestBadConsumersDoNotBlockOthers(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "ok", 2)
	createScaledObject(t, ns, "ok", deployment("ok"), nil, nil)
	g.Expect(env.Client.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "settings"}})).To(Succeed())
	createScaledObject(t, ns, "cm", kedav1alpha1.ScaleTarget{APIVersion: "v1", Kind: "ConfigMap", Name: "settings"}, nil, nil)
	createScaledObject(t, ns, "ghost", deployment("nope"), nil, nil)

	createPolicy(t, ns, "missing", testSpec("absent"))
	createPolicy(t, ns, "noscale", testSpec("cm"))
	createPolicy(t, ns, "notarget", testSpec("ghost"))
	createPolicy(t, ns, "healthy", testSpec("ok"))

	g.Eventually(conditionOf(ns, "missing", ConditionConsumersBounded)).Should(Equal("False/ScaledObjectNotFound"))
	g.Eventually(conditionOf(ns, "noscale", ConditionConsumersBounded)).Should(Equal("False/NoScaleSubresource"))
	g.Eventually(conditionOf(ns, "notarget", ConditionConsumersBounded)).Should(Equal("False/ScaleTargetNotFound"))
	g.Eventually(conditionOf(ns, "healthy", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	g.Eventually(replicasOf(ns, "ok")).Should(Equal("min=unset max=40"))
	// Each policy is evaluated and published; READY is True only for the one
	// whose consumers are bounded, and says why for the others.
	for _, name := range []string{"missing", "noscale", "notarget", "healthy"} {
		g.Eventually(newWorker(t, srv, ns, name).stateLimit()).Should(Equal("Closed/40"), name)
	}
	g.Eventually(conditionOf(ns, "healthy", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Eventually(conditionOf(ns, "missing", ConditionReady)).Should(Equal("False/ScaledObjectNotFound"))
	g.Eventually(conditionOf(ns, "noscale", ConditionReady)).Should(Equal("False/NoScaleSubresource"))
	g.Eventually(conditionOf(ns, "notarget", ConditionReady)).Should(Equal("False/ScaleTargetNotFound"))
	g.Expect(conditionIn(getPolicy(g, ns, "missing"), ConditionReady).Message).To(
		And(ContainSubstring("Published state Closed with limit 40"), ContainSubstring("absent:")))
	g.Expect(conditionIn(getPolicy(g, ns, "noscale"), ConditionConsumersBounded).Message).To(ContainSubstring("cm: scale target ConfigMap settings (v1) has no scale subresource"))

	// A second policy naming a bounded ScaledObject is a conflict, not a fight.
	createPolicy(t, ns, "greedy", testSpec("ok"))
	g.Eventually(conditionOf(ns, "greedy", ConditionConsumersBounded)).Should(Equal("False/Conflict"))
	g.Eventually(conditionOf(ns, "greedy", ConditionReady)).Should(Equal("False/Conflict"))
	g.Consistently(func(g Gomega) string {
		return getScaledObject(g, ns, "ok").Annotations[AnnotationOwner]
	}).Should(Equal("healthy"))

	// Each policy is still evaluated: the healthy one opens on failures.
	w := newWorker(t, srv, ns, "healthy")
	w.report(g, minCalls, protocol.Failure)
	g.Eventually(w.stateLimit()).Should(Equal("Open/0"))
	g.Eventually(replicasOf(ns, "ok")).Should(Equal("min=2 max=40"))

	// The missing ScaledObject appears: the watch maps it to its policy.
	createDeployment(t, ns, "late", 1)
	createScaledObject(t, ns, "absent", deployment("late"), nil, ptr.To[int32](5))
	g.Eventually(conditionOf(ns, "missing", ConditionConsumersBounded)).Should(Equal("True/Bounded"))
	g.Eventually(conditionOf(ns, "missing", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Eventually(replicasOf(ns, "absent")).Should(Equal("min=unset max=5"))
}

// fieldsOf is the fields manager owns by apply, as JSON.
func fieldsOf(so *kedav1alpha1.ScaledObject, manager string) string {
	for _, e := range so.ManagedFields {
		if e.Manager == manager && e.Operation == metav1.ManagedFieldsOperationApply && e.FieldsV1 != nil {
			return string(e.FieldsV1.Raw)
		}
	}
	return "{}"
}

func managers(so *kedav1alpha1.ScaledObject) []string {
	var m []string
	for _, e := range so.ManagedFields {
		m = append(m, e.Manager)
	}
	return m
}

func conditionIn(pol *spillwayv1alpha1.DependencyPolicy, condType string) metav1.Condition {
	for _, c := range pol.Status.Conditions {
		if c.Type == condType {
			return c
		}
	}
	return metav1.Condition{}
}
