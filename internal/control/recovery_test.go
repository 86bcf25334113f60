package control

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// climbToFull closes the breaker after an outage and climbs 5, 10, 20, 40
// one clean minute a step: Closed at full capacity, epoch 5.
func climbToFull(t *testing.T, e *evaluator) {
	t.Helper()
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "10", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		{name: "20", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 4, events: []string{EventRampStep}},
		{name: "40", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5, events: []string{EventRampStep}},
	})
}

func TestPlanRemembersACollapse(t *testing.T) {
	t.Run("right after the last step: capacity is a ceiling, its hold doubles", func(t *testing.T) {
		e := newEvaluator()
		climbToFull(t, e)
		runSteps(t, e, []step{
			{name: "falls over at 40", advance: 5 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 6, events: []string{EventOpened}},
			{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 7, events: []string{EventHalfOpened}},
			{name: "closed, ramp at 5", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 8, events: []string{EventClosed}},
			{name: "10", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 8, events: []string{EventRampStep}},
			{name: "20", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 8, events: []string{EventRampStep}},
			{name: "a minute at 20: 40 is the ceiling", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 8},
			{name: "two minutes at 20: 40", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 9, events: []string{EventRampStep}},
			{name: "falls over at 40 again", advance: 5 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 10, events: []string{EventOpened}},
			{name: "half-open again", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 11, events: []string{EventHalfOpened}},
			{name: "closed again", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 12, events: []string{EventClosed}},
			{name: "10 again", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 12, events: []string{EventRampStep}},
			{name: "20 again", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 12, events: []string{EventRampStep}},
			{name: "three minutes at 20: held", advance: 3 * time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 12},
			{name: "four minutes at 20: 40", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 13, events: []string{EventRampStep}},
		})
		if e.pub.RampCeiling != 40 {
			t.Errorf("ceiling %d just after capacity was reached again, want 40 until it is held clean for its hold", e.pub.RampCeiling)
		}
	})
	t.Run("the ceiling lasts through a failed probe", func(t *testing.T) {
		e := newEvaluator()
		climbToFull(t, e)
		runSteps(t, e, []step{
			{name: "falls over at 40", advance: 5 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 6, events: []string{EventOpened}},
			{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 7, events: []string{EventHalfOpened}},
			{name: "a probe fails", advance: time.Second, probes: protocol.Probes{Failures: 1}, state: wire.Open, limit: 0, epoch: 8, events: []string{EventOpened}},
			{name: "half-open again", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 9, events: []string{EventHalfOpened}},
			{name: "closed", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 10, events: []string{EventClosed}},
		})
		NewWithT(t).Expect(e.pub.RampCeiling).To(BeEquivalentTo(40))
	})
	t.Run("an outage long after the ramp remembers nothing", func(t *testing.T) {
		e := newEvaluator()
		climbToFull(t, e)
		runSteps(t, e, []step{
			{name: "a clean minute at 40", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5},
			{name: "open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 6, events: []string{EventOpened}},
			{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 7, events: []string{EventHalfOpened}},
			{name: "closed", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 8, events: []string{EventClosed}},
			{name: "10 after a minute", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 8, events: []string{EventRampStep}},
		})
		NewWithT(t).Expect(e.pub.RampCeiling).To(BeZero())
	})
	t.Run("a collapse at the first step restarts below it", func(t *testing.T) {
		e := newEvaluator()
		toRamping(t, e, 5)
		runSteps(t, e, []step{
			{name: "falls over at 5", advance: 5 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 5, events: []string{EventOpened}},
			{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 6, events: []string{EventHalfOpened}},
			{name: "closed at 4", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 4, epoch: 7, events: []string{EventClosed}},
			{name: "a minute at 4: 5 is the ceiling", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 4, epoch: 7},
			{name: "two minutes: 5", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 5, epoch: 7, events: []string{EventRampStep}},
		})
	})
}

func TestPlanWarmFor(t *testing.T) {
	warm := func() *evaluator {
		e := newEvaluator()
		e.params.Ramp.WarmFor = 90 * time.Second
		return e
	}
	t.Run("an outage shorter than warmFor skips the ramp", func(t *testing.T) {
		e := warm()
		toHalfOpen(t, e)
		runSteps(t, e, []step{
			{name: "closed at full capacity", advance: time.Second, probes: probes3, state: wire.Closed, limit: 40, epoch: 4, events: []string{EventClosed}},
		})
	})
	t.Run("a longer one ramps", func(t *testing.T) {
		e := warm()
		toHalfOpen(t, e)
		runSteps(t, e, []step{
			{name: "a probe fails", advance: time.Second, probes: protocol.Probes{Timeouts: 1}, state: wire.Open, limit: 0, epoch: 4, events: []string{EventOpened}},
			{name: "half-open again", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 5, events: []string{EventHalfOpened}},
			{name: "closed after 2 min: ramps", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 6, events: []string{EventClosed}},
		})
	})
	t.Run("a collapse right after the skip ramps", func(t *testing.T) {
		e := warm()
		toHalfOpen(t, e)
		runSteps(t, e, []step{
			{name: "closed at full capacity", advance: time.Second, probes: probes3, state: wire.Closed, limit: 40, epoch: 4, events: []string{EventClosed}},
			{name: "falls over at once", advance: 5 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 5, events: []string{EventOpened}},
			{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 6, events: []string{EventHalfOpened}},
			{name: "closed within warmFor, but ramps below the collapse", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 7, events: []string{EventClosed}},
		})
	})
}

func TestRateBound(t *testing.T) {
	p := seedParams(40)
	withRate := p
	withRate.RatePerSecond = 100
	for _, tc := range []struct {
		name    string
		p       policy.Params
		bounded bool
		limit   int64
		latency time.Duration
		want    int64
	}{
		{"unbounded publishes the policy's rate", withRate, false, 40, 100 * time.Millisecond, 100},
		{"unbounded without a rate: none", p, false, 40, 100 * time.Millisecond, 0},
		{"ramping: limit over the success latency", p, true, 5, 100 * time.Millisecond, 50},
		{"ramping: rounded up", p, true, 5, 300 * time.Millisecond, 17},
		{"ramping: never above the policy's rate", withRate, true, 20, 100 * time.Millisecond, 100},
		{"ramping, latency unknown: the step's share of the rate", withRate, true, 5, 0, 13},
		{"ramping, latency unknown, no rate: unbounded", p, true, 5, 0, 0},
		{"half-open: the probes over the latency", p, true, 3, time.Second, 3},
		{"at least 1", p, true, 1, time.Hour, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := RateBound(tc.p, tc.bounded, tc.limit, tc.latency); got != tc.want {
				t.Errorf("RateBound(bounded %v, limit %d, latency %v) = %d, want %d", tc.bounded, tc.limit, tc.latency, got, tc.want)
			}
		})
	}
}

func TestPlanPublishesTheRateBound(t *testing.T) {
	e := newEvaluator()
	timed := protocol.Window{Calls: 100, Successes: 100, TimedSuccesses: 100, SuccessMicros: 100 * 200_000}
	runSteps(t, e, []step{
		{name: "closed, 200 ms successes", window: timed, state: wire.Closed, limit: 40, epoch: 1},
		{name: "open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}},
	})
	g := NewWithT(t)
	g.Expect(e.pub.SuccessLatency).To(Equal(200*time.Millisecond), "kept through a window with no timed success")
	runSteps(t, e, []step{
		{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 3, events: []string{EventHalfOpened}},
	})
	g.Expect(e.pub.RatePerSecond).To(BeEquivalentTo(15), "3 probes / 200 ms")
	runSteps(t, e, []step{
		{name: "closed, ramp at 5", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventClosed}},
	})
	g.Expect(e.pub.RatePerSecond).To(BeEquivalentTo(25), "5 / 200 ms")
	runSteps(t, e, []step{
		{name: "10 clean successes of 50 ms", advance: time.Second, window: protocol.Window{Calls: 10, Successes: 10, TimedSuccesses: 10, SuccessMicros: 500_000}, state: wire.Ramping, limit: 5, epoch: 4},
	})
	g.Expect(e.pub.RatePerSecond).To(BeEquivalentTo(100), "5 / 50 ms")
}

func TestPlanBoundsTheRateRightAfterTheRamp(t *testing.T) {
	e := newEvaluator()
	climbToFull(t, e)
	timed := protocol.Window{Calls: 100, Successes: 100, TimedSuccesses: 100, SuccessMicros: 100 * 100_000}
	runSteps(t, e, []step{{name: "timed at full capacity", advance: time.Second, window: timed, state: wire.Closed, limit: 40, epoch: 5}})
	g := NewWithT(t)
	g.Expect(e.pub.RatePerSecond).To(BeEquivalentTo(400), "40 / 100 ms during the first stepDuration at full capacity")
	runSteps(t, e, []step{{name: "a minute at full capacity", advance: time.Minute, window: timed, state: wire.Closed, limit: 40, epoch: 5}})
	g.Expect(e.pub.RatePerSecond).To(BeZero(), "no bound once the last step has lasted its stepDuration")
}
