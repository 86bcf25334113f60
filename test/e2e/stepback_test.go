package e2e

import (
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/replay"
)

// TestColdCapacityBelowTheFirstStep replays an outage after which the
// dependency serves 1 call at once for 8 s, below the ramp's first step (2):
// with the default step-back rule the controller steps back below the first
// step, fleet-wide, holds there while the dependency is cold instead of
// cycling through the breaker, and climbs once it is warm, with no second
// outage. (The replay's dependency rejects calls beyond its capacity at
// once, so most calls of the first step fail and, without the rule, the
// breaker opens instead: the limit then alternates between 0 and 2 until the
// dependency is warm. The limits the test sees tell the two apart.)
func TestColdCapacityBelowTheFirstStep(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	start := time.Now()

	cfg := replay.DefaultConfig()
	cfg.Dependency.ColdFactor = 0.1 // 1 of 10
	cfg.Dependency.WarmUp = 8 * time.Second
	// Two seconds of calls beyond the cold capacity take it down: time for
	// the evaluator to see the failures, less than a step.
	cfg.Dependency.CollapseAfter = 2 * time.Second
	cfg.ArrivalRate = 40
	cfg.MaxRecovery = 45 * time.Second

	w := replay.Workload{Namespace: "cold", Policy: "template-api", ScaledObject: "render-workers", Deployment: "render-workers"}
	spec := replay.DefaultPolicy() // ramp 2, 5, 10, one step per 1.5 s; stepBack: the API's default
	// Probes run at once: two against a cold capacity of 1 would fail one
	// and keep the breaker open until the dependency is warm.
	spec.Breaker.HalfOpenProbes = 1
	cp, res := replayPolicy(t, w, spec, cfg)
	t.Logf("step-back rule: backlog %d, drained in %.1fs, second outages %d, peak %d in flight, %d over the limit, lost %d",
		res.Backlog, res.DrainSeconds, res.SecondOutages, res.PeakInFlight, res.OverLimit, res.Lost)
	g.Expect(res.Backlog).To(BeNumerically(">", 20), "the outage left a backlog")
	g.Expect(res.SecondOutages).To(BeZero(), "no second outage")
	g.Expect(res.OverLimit).To(BeZero(), "the dependency never saw more calls than the limit in force")
	g.Expect(res.DrainSeconds).To(BeNumerically(">", 0), "the backlog drained")
	g.Expect(res.Lost).To(BeZero(), "every job is accounted for")
	var limits []int64
	for _, s := range res.Samples {
		if s.State == string(spillwayv1alpha1.StateRamping) && (len(limits) == 0 || limits[len(limits)-1] != s.Limit) {
			limits = append(limits, s.Limit)
		}
	}
	t.Logf("Ramping limits: %v", limits)
	g.Expect(limits).To(ContainElement(int64(1)), "stepped back below the first step")
	opened := 0
	for _, s := range res.Samples {
		if s.Phase == "recovery" && s.State == string(spillwayv1alpha1.StateOpen) {
			opened++
		}
	}
	t.Logf("Samples Open after the recovery: %d of %d", opened, len(res.Samples))
	g.Expect(slices.Max(limits)).To(BeNumerically(">", spec.Ramp.Steps[0]), "the ramp climbed past its first step once warm")
	var events eventsv1.EventList
	g.Expect(cp.Env.Client.List(ctx, &events, client.InNamespace(w.Namespace))).To(Succeed())
	var reasons []string
	for _, e := range events.Items {
		reasons = append(reasons, e.Reason)
	}
	g.Expect(reasons).To(ContainElement(control.EventRampStepBack))

	t.Logf("replay took %v", time.Since(start).Round(time.Second))
}

// replayPolicy starts a control plane (evaluating every 200 ms), installs
// the policy spec for the workload w, waits until its ScaledObject is bounded
// and replays cfg's outage against it, logging every sample. The control
// plane stops with the test.
func replayPolicy(t *testing.T, w replay.Workload, spec spillwayv1alpha1.DependencyPolicySpec, cfg replay.Config) (*replay.ControlPlane, replay.Result) {
	t.Helper()
	g := NewWithT(t)
	ctx := t.Context()
	cp, err := replay.StartControlPlane(ctx, 200*time.Millisecond)
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(cp.Stop)
	fleet, err := cp.Install(ctx, w, spec, replay.DefaultMinReplicas, replay.DefaultMaxReplicas)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(cp.WaitBounded(ctx, w, fleet, int(spec.Capacity.Concurrency/spec.Consumers[0].SlotsPerReplica))).To(Succeed())
	res, err := replay.Run(ctx, cfg, fleet, func(s replay.Sample) { t.Log(s) })
	g.Expect(err).NotTo(HaveOccurred())
	return cp, res
}
