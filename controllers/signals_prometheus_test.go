package controllers

import (
	"context"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/promtest"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// signalWindow is the breaker window of the Prometheus tests, and the range
// of their queries: five scrapes.
const signalWindow = 5 * time.Second

// prometheusSpec is testSpec with the breaker opened by a real Prometheus's
// error ratio of the dependency's own counters: a 5s window, open for 3s,
// queried every second.
func prometheusSpec(address string, consumers ...string) spillwayv1alpha1.DependencyPolicySpec {
	spec := testSpec(consumers...)
	spec.Breaker.MinCalls = 20
	spec.Breaker.Window = metav1.Duration{Duration: signalWindow}
	spec.Breaker.OpenDuration = metav1.Duration{Duration: 3 * time.Second}
	spec.Signals = &spillwayv1alpha1.Signals{Prometheus: &spillwayv1alpha1.PrometheusSignal{
		Address:         address,
		ErrorRatioQuery: promtest.ErrorRatioQuery(signalWindow),
		RateQuery:       promtest.RateQuery(signalWindow),
		Interval:        metav1.Duration{Duration: time.Second},
		Timeout:         metav1.Duration{Duration: time.Second},
	}}
	return spec
}

// eventMessages lists the messages of the Events about a policy with reason.
func eventMessages(ns, name, reason string) func(Gomega) []string {
	return func(g Gomega) []string {
		var list eventsv1.EventList
		g.Expect(env.Client.List(context.Background(), &list, client.InNamespace(ns))).To(Succeed())
		var msgs []string
		for _, e := range list.Items {
			if e.Regarding.Kind == spillwayv1alpha1.DependencyPolicyKind && e.Regarding.Name == name && e.Reason == reason {
				msgs = append(msgs, e.Note)
			}
		}
		return msgs
	}
}

// TestPrometheusSignalOpensPinsAndRamps: a dependency's own counters,
// scraped by a real Prometheus, open the breaker with no worker reporting
// anything; the ScaledObject's minimum is pinned; once the errors fall the
// ratio passes the half-open probes and the ramp climbs back to Closed.
func TestPrometheusSignalOpensPinsAndRamps(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	dep := promtest.NewDependency(t)
	dep.Load(50, 0)
	prom := promtest.Start(t, dep.Target())
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "template-api")

	createDeployment(t, ns, "render", 6)
	createScaledObject(t, ns, "render", deployment("render"), ptr.To[int32](2), ptr.To[int32](80))
	createPolicy(t, ns, "template-api", prometheusSpec(prom.URL(), "render"))

	g.Eventually(conditionOf(ns, "template-api", ConditionSignalsHealthy)).WithTimeout(20 * time.Second).Should(Equal("True/Healthy"))
	g.Eventually(conditionOf(ns, "template-api", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Expect(conditionNamed(getPolicy(g, ns, "template-api"), ConditionReady).Message).To(ContainSubstring("signals: the workers' outcomes and Prometheus are healthy"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"))
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"))

	// 90% of the dependency's requests fail: Prometheus's ratio opens the
	// breaker, and the minimum is pinned at the replicas of the outage.
	dep.Load(50, 0.9)
	rise := time.Now()
	g.Eventually(w.stateLimit()).WithTimeout(20 * time.Second).WithPolling(50 * time.Millisecond).Should(Equal("Open/0"))
	t.Logf("Open %v after the errors rose (scrape 1s, query interval 1s, window 5s)", time.Since(rise).Round(100*time.Millisecond))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=6 max=40"), "pinned to the replicas at the outage")
	g.Eventually(eventMessages(ns, "template-api", EventOpened)).Should(ContainElement(HavePrefix("Prometheus error ratio")))

	// The errors fall: half-open after 3s, and a window of clean Prometheus
	// samples passes the probes; the ramp climbs 5, 10, 20, 40.
	dep.Load(50, 0)
	fall := time.Now()
	var seen []string
	g.Eventually(func(g Gomega) string {
		s := w.stateLimit()(g)
		if len(seen) == 0 || seen[len(seen)-1] != s {
			seen = append(seen, s)
		}
		return s
	}).WithTimeout(40 * time.Second).WithPolling(20 * time.Millisecond).Should(Equal("Closed/40"))
	t.Logf("Recovery: %v, Closed %v after the errors fell (openDuration 3s, 3 ramp steps of 1s)", seen, time.Since(fall).Round(100*time.Millisecond))
	g.Expect(seen).To(ContainElements("HalfOpen/3", "Ramping/5", "Ramping/10", "Ramping/20", "Closed/40"))
	// The first half-open sample may still hold the end of the outage and
	// reopen it once; once the ramp started, it never reopens.
	g.Expect(seen[slices.Index(seen, "Ramping/5"):]).NotTo(ContainElement("Open/0"), "no reopen during the ramp: %v", seen)
	g.Eventually(eventMessages(ns, "template-api", EventClosed)).Should(ContainElement(HavePrefix("Prometheus error ratio")))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"), "the user's minimum is back")
}

// TestPrometheusFailureNeverOpens: a Prometheus that stops answering, or a
// query it refuses, is a condition and an Event, Ready False, and never an
// open breaker; the workers' outcomes still open it.
func TestPrometheusFailureNeverOpens(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	dep := promtest.NewDependency(t)
	dep.Load(50, 0)
	prom := promtest.Start(t, dep.Target())
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "template-api")
	spec := prometheusSpec(prom.URL())
	spec.Breaker.MinCalls = minCalls
	createPolicy(t, ns, "template-api", spec)
	g.Eventually(conditionOf(ns, "template-api", ConditionSignalsHealthy)).WithTimeout(20 * time.Second).Should(Equal("True/Healthy"))

	prom.Stop()
	g.Eventually(conditionOf(ns, "template-api", ConditionSignalsHealthy)).WithTimeout(10 * time.Second).Should(Equal("False/PrometheusUnreachable"))
	g.Eventually(conditionOf(ns, "template-api", ConditionReady)).Should(Equal("False/PrometheusUnreachable"))
	pol := getPolicy(g, ns, "template-api")
	g.Expect(conditionNamed(pol, ConditionReady).Message).To(ContainSubstring("the workers' outcomes are healthy, Prometheus is failing"))
	g.Expect(conditionNamed(pol, ConditionSignalsHealthy).Message).To(ContainSubstring("never opens it"))
	g.Eventually(eventReasons(ns, "template-api")).Should(ContainElement(EventSignalUnavailable))
	g.Consistently(w.stateLimit()).WithTimeout(2*time.Second).Should(Equal("Closed/40"), "a failing signal never opens the breaker")

	// The workers' outcomes still count.
	g.Expect(w.report(g, minCalls, protocol.Failure)).To(Equal(minCalls))
	g.Eventually(w.stateLimit()).Should(Equal("Open/0"))
	g.Eventually(eventMessages(ns, "template-api", EventOpened)).Should(ContainElement(ContainSubstring("calls failed or timed out")))

	// A query Prometheus refuses: QueryFailed, against a live server.
	prom2 := promtest.Start(t, dep.Target())
	g.Eventually(func() error {
		pol := getPolicy(g, ns, "template-api")
		pol.Spec.Signals.Prometheus.Address = prom2.URL()
		pol.Spec.Signals.Prometheus.ErrorRatioQuery = "sum(rate(" + promtest.ErrorsMetric
		return env.Client.Update(context.Background(), pol)
	}).Should(Succeed())
	g.Eventually(conditionOf(ns, "template-api", ConditionSignalsHealthy)).WithTimeout(10 * time.Second).Should(Equal("False/QueryFailed"))

	// Fixed: the signal recovers, with an Event.
	g.Eventually(func() error {
		pol := getPolicy(g, ns, "template-api")
		pol.Spec.Signals.Prometheus.ErrorRatioQuery = promtest.ErrorRatioQuery(signalWindow)
		return env.Client.Update(context.Background(), pol)
	}).Should(Succeed())
	g.Eventually(conditionOf(ns, "template-api", ConditionSignalsHealthy)).WithTimeout(20 * time.Second).Should(Equal("True/Healthy"))
	g.Eventually(eventReasons(ns, "template-api")).Should(ContainElement(EventSignalRecovered))
}

// conditionNamed is pol's condition of type t, or an empty one.
func conditionNamed(pol *spillwayv1alpha1.DependencyPolicy, t string) metav1.Condition {
	for _, c := range pol.Status.Conditions {
		if c.Type == t {
			return c
		}
	}
	return metav1.Condition{}
}
