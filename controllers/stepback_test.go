package controllers

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// TestRampStepsBack: calls that fail partially at the first ramp step, far
// below the breaker's threshold, make the controller step back: the limit
// halves, a RampStepBack Event says why, status shows the ceiling and the
// reason, and a Redis that restarts empty does not lose the step back: the
// controller continues from status below the limit that failed.
func TestRampStepsBack(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "search")
	spec := testSpec()
	// Long steps, so nothing climbs while the test looks.
	spec.Ramp.StepDuration = metav1.Duration{Duration: time.Hour}
	createPolicy(t, ns, "search", spec)
	g.Expect(getPolicy(g, ns, "search").Spec.Ramp.StepBack.FailureRatio).To(Equal(0.01), "the API's default rule")

	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	w.report(g, minCalls, protocol.Failure)
	g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"))
	w.report(g, 3, protocol.Success)
	g.Eventually(w.stateLimit()).Should(Equal("Ramping/5"))

	// 1 call in 5 fails or times out at the first step: far below the
	// breaker's 50%; the ramp steps back to the highest power of two below
	// the step.
	w.report(g, 12, protocol.Success)
	w.report(g, 2, protocol.Failure)
	w.report(g, 1, protocol.Timeout)
	g.Eventually(w.stateLimit()).Should(Equal("Ramping/4"))
	p := w.published(g)
	g.Expect(p.RampCeiling).To(Equal(int64(5)))
	g.Expect(p.RampLimit).To(Equal(int64(4)))

	g.Eventually(eventReasons(ns, "search")).Should(ContainElement(EventRampStepBack))
	g.Eventually(conditionOf(ns, "search", ConditionRamping)).Should(Equal("True/SteppedBack"))
	pol := getPolicy(g, ns, "search")
	g.Expect(pol.Status.RampCeiling).To(Equal(int32(5)))
	g.Expect(pol.Status.CurrentLimit).To(Equal(int32(4)))
	g.Expect(conditionIn(pol, ConditionRamping).Message).To(ContainSubstring("limit 4, below limit 5"))

	// Redis restarts empty: continued from status, at 4 below the ceiling 5,
	// not at the first step and not at full capacity.
	srv.Stop()
	g.Eventually(conditionOf(ns, "search", ConditionReady)).Should(Equal("False/RedisUnavailable"))
	g.Expect(srv.Restart()).To(Succeed())
	g.Eventually(conditionOf(ns, "search", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Consistently(w.stateLimit()).Should(Equal("Ramping/4"), "restored from status")
	g.Expect(w.published(g).RampCeiling).To(Equal(int64(5)))
}
