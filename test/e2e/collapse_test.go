package e2e

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/replay"
)

// TestFragileDependencyFallsOverAtMostOnce replays issue 20's failure class
// on loopback: a dependency that falls over after 300 ms above its
// effective capacity, stays down 1 s and comes back cold (6 of 10) for 7 s
// after every recovery, under a fixed ramp 2, 5, 10 of 2 s a step whose last
// step exceeds the cold capacity. A ramp that forgot where it fell over
// would reach 10 about 4 s after each close, about 5 s after the
// dependency came back, inside its cold start, and knock it over again and
// again. The ramp remembers the limit it fell over at as a ceiling and
// holds the step below it for twice the stepDuration, past the cold start:
// at most one second outage, and the backlog drains.
func TestFragileDependencyFallsOverAtMostOnce(t *testing.T) {
	g := NewWithT(t)
	start := time.Now()

	cfg := replay.DefaultConfig()
	cfg.Dependency.ColdFactor = 0.6 // 6 of 10
	cfg.Dependency.WarmUp = 7 * time.Second
	cfg.Dependency.CollapseAfter = 300 * time.Millisecond
	cfg.Dependency.DownFor = time.Second
	cfg.ArrivalRate = 150
	cfg.MaxRecovery = 60 * time.Second

	w := replay.Workload{Namespace: "fragile", Policy: "template-api", ScaledObject: "render-workers", Deployment: "render-workers"}
	spec := replay.DefaultPolicy()
	spec.Ramp.StepDuration = metav1.Duration{Duration: 2 * time.Second}
	spec.Breaker.HalfOpenProbes = 1
	// The fixed schedule: only the breaker and the memory of a collapse act
	// (the step-back rule would catch some of these overloads earlier).
	spec.Ramp.StepBack.When = spillwayv1alpha1.StepBackNever
	_, res := replayPolicy(t, w, spec, cfg)
	t.Logf("fragile dependency: backlog %d, drained in %.1fs, second outages %d, peak %d in flight, %d over the limit, lost %d",
		res.Backlog, res.DrainSeconds, res.SecondOutages, res.PeakInFlight, res.OverLimit, res.Lost)
	var limits []int64
	for _, s := range res.Samples {
		if s.Phase == "recovery" && (len(limits) == 0 || limits[len(limits)-1] != s.Limit) {
			limits = append(limits, s.Limit)
		}
	}
	t.Logf("limits after the recovery: %v", limits)
	g.Expect(res.Backlog).To(BeNumerically(">", 20), "the outage left a backlog")
	g.Expect(res.SecondOutages).To(BeNumerically("<=", 1), "the dependency fell over at most once after the recovery")
	g.Expect(res.OverLimit).To(BeZero(), "the dependency never saw more calls than the limit in force")
	g.Expect(res.DrainSeconds).To(BeNumerically(">", 0), "the backlog drained")
	g.Expect(res.Lost).To(BeZero(), "every job is accounted for")
	g.Expect(limits).To(ContainElement(int64(spec.Capacity.Concurrency)), "the ramp reached full capacity once warm")
	t.Logf("replay took %v", time.Since(start).Round(time.Second))
}
