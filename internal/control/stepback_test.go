package control

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// listening is the seed's evaluator with the API's default step-back rule.
func listening(mode ramp.When, capacity int64, steps ...int64) *evaluator {
	e := newEvaluator()
	e.params = seedParams(capacity, steps...)
	e.params.Ramp.StepBack = ramp.StepBack{When: mode, FailureRatio: 0.01, MinFailures: 3}
	e.pub = Restore(e.params, "", 0, time.Time{}, t0)
	return e
}

// toHalfOpen opens a closed breaker at its first evaluation and half-opens
// it a minute later (epoch 3).
func toHalfOpen(t *testing.T, e *evaluator) {
	t.Helper()
	runSteps(t, e, []step{
		{name: "closed", state: wire.Closed, limit: e.params.Capacity, epoch: 1},
		{name: "open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}},
		{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: min(3, e.params.Capacity), epoch: 3, events: []string{EventHalfOpened}},
	})
}

// toRamping opens the breaker, half-opens it and closes it with three
// probes: the ramp starts at its first step.
func toRamping(t *testing.T, e *evaluator, firstLimit int64) {
	t.Helper()
	toHalfOpen(t, e)
	runSteps(t, e, []step{
		{name: "close", advance: time.Second, probes: probes3, state: wire.Ramping, limit: firstLimit, epoch: 4, events: []string{EventClosed}},
	})
}

var (
	// sixth is a cold capacity of 1 under a limit of 2, for 3 seconds: 1
	// call in 6 fails.
	sixth = protocol.Window{Calls: 18, Successes: 15, Failures: 3}
	// oneFailure is a single failure at tiny volume.
	oneFailure = protocol.Window{Calls: 2, Successes: 1, Timeouts: 1}
)

// TestPlanStepBackTransitions is the control law's table of the rule: a
// step that fails partially steps back before the breaker's threshold, the
// settling ignores what the higher step left in flight, a step that holds
// does not climb, the limit that failed is tried again after twice the step
// duration, and the step up to full capacity is judged too.
func TestPlanStepBackTransitions(t *testing.T) {
	e := listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "a single failure at tiny volume holds", advance: time.Second, window: oneFailure, state: wire.Ramping, limit: 5, epoch: 4},
		{name: "clean minute", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		{name: "1 in 6 fails at 10: step back to 5", advance: 3 * time.Second, window: sixth, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventRampStepBack}},
		{name: "settling: what 10 left in flight is ignored", advance: time.Second, window: protocol.Window{Calls: 10, Failures: 10}, state: wire.Ramping, limit: 5, epoch: 4},
		{name: "settling: the breaker ignores it too", advance: 8 * time.Second, window: protocol.Window{Calls: 40, Failures: 40}, state: wire.Ramping, limit: 5, epoch: 4},
		{name: "holding: 1% or more failed", advance: 2 * time.Minute, window: protocol.Window{Calls: 100, Successes: 99, Failures: 1}, state: wire.Ramping, limit: 5, epoch: 4},
		{name: "clean again, 2 minutes after the step back: try 10 again", advance: time.Second, window: healthy, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		{name: "10 clean for a minute: the ceiling is cleared", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 4, events: []string{EventRampStep}},
		{name: "full capacity", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5, events: []string{EventRampStep}},
		{name: "the step to full capacity is judged", advance: 5 * time.Second, window: sixth, state: wire.Ramping, limit: 20, epoch: 6, events: []string{EventRampStepBack}},
		{name: "settled, clean", advance: 2 * time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 7, events: []string{EventRampStep}},
		{name: "a minute at full capacity is no longer judged (Ramping)", advance: time.Minute, window: sixth, state: wire.Closed, limit: 40, epoch: 7},
		{name: "the breaker still opens", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 8, events: []string{EventOpened}},
	})
	if e.pub.RampCeiling != 0 || e.pub.RampBackoffs != 0 {
		t.Fatalf("an open breaker keeps ceiling %d backoffs %d, want none", e.pub.RampCeiling, e.pub.RampBackoffs)
	}
}

// TestPlanStepBackBelowTheFirstStep: a cold capacity below the first step
// steps back through the powers of two below it until the calls stop
// failing, and the ramp climbs back by doubling through the same limits.
func TestPlanStepBackBelowTheFirstStep(t *testing.T) {
	e := listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "5 fails: 4", advance: 3 * time.Second, window: sixth, state: wire.Ramping, limit: 4, epoch: 4, events: []string{EventRampStepBack}},
		{name: "4 fails: 2", advance: 13 * time.Second, window: sixth, state: wire.Ramping, limit: 2, epoch: 4, events: []string{EventRampStepBack}},
		{name: "2 fails: 1", advance: 13 * time.Second, window: sixth, state: wire.Ramping, limit: 1, epoch: 4, events: []string{EventRampStepBack}},
		{name: "nothing below 1", advance: 13 * time.Second, window: sixth, state: wire.Ramping, limit: 1, epoch: 4},
		{name: "2 again after 8 clean minutes", advance: 8 * time.Minute, window: healthy, state: wire.Ramping, limit: 2, epoch: 4, events: []string{EventRampStep}},
		{name: "4", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 4, epoch: 4, events: []string{EventRampStep}},
		{name: "5", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventRampStep}},
	})
}

// TestPlanStepBackAlwaysDiscoversCapacity: with Always a Closed policy
// that fails partially at full capacity steps back into Ramping, below the
// capacity, and tries it again after twice the step duration.
func TestPlanStepBackAlwaysDiscoversCapacity(t *testing.T) {
	e := listening(ramp.Always, 40)
	runSteps(t, e, []step{
		{name: "closed", state: wire.Closed, limit: 40, epoch: 1},
		{name: "an hour later, 1 in 6 fails", advance: time.Hour, window: sixth, state: wire.Ramping, limit: 20, epoch: 2, events: []string{EventRampStepBack}},
		{name: "one clean minute is not enough", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 2},
		{name: "two are", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 3, events: []string{EventRampStep}},
	})
	// Ramping and Never leave a long-closed policy alone.
	for _, mode := range []ramp.When{ramp.Ramping, ramp.Never} {
		e := listening(mode, 40)
		runSteps(t, e, []step{
			{name: "closed", state: wire.Closed, limit: 40, epoch: 1},
			{name: string(mode) + ": 1 in 6 fails", advance: time.Second, window: sixth, state: wire.Closed, limit: 40, epoch: 1},
		})
	}
}

// TestPlanStepBackNeverIsTheFixedSchedule: Never climbs through failures,
// as before the rule existed.
func TestPlanStepBackNeverIsTheFixedSchedule(t *testing.T) {
	e := listening(ramp.Never, 40)
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "a minute of 1 in 6", advance: time.Minute, window: sixth, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
	})
}

// TestPlanStepBackSmallCapacity is the incident: capacity 2, default
// ramp [1, 2], cold capacity 1. The step to 2 steps back within the seconds
// the failures take to be conclusive, long before the breaker could open.
func TestPlanStepBackSmallCapacity(t *testing.T) {
	g := NewWithT(t)
	e := listening(ramp.Ramping, 2)
	e.params.Breaker.HalfOpenProbes = 1
	runSteps(t, e, []step{
		{name: "closed", state: wire.Closed, limit: 2, epoch: 1},
		{name: "open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}},
		{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 1, epoch: 3, events: []string{EventHalfOpened}},
		{name: "close", advance: time.Second, probes: protocol.Probes{Successes: 1}, state: wire.Ramping, limit: 1, epoch: 4, events: []string{EventClosed}},
		{name: "2 after a clean minute", advance: time.Minute, window: healthy, state: wire.Closed, limit: 2, epoch: 5, events: []string{EventRampStep}},
		{name: "1 s: 1 of 6 failed, not conclusive", advance: time.Second, window: protocol.Window{Calls: 6, Successes: 5, Failures: 1}, state: wire.Closed, limit: 2, epoch: 5},
		{name: "2 s: 2 of 12", advance: time.Second, window: protocol.Window{Calls: 12, Successes: 10, Failures: 2}, state: wire.Closed, limit: 2, epoch: 5},
	})
	out := e.eval(sixth, protocol.Probes{})
	g.Expect(reasons(out)).To(Equal([]string{EventRampStepBack}))
	g.Expect(out.Next.State).To(Equal(wire.Ramping))
	g.Expect(out.Next.Limit).To(Equal(int64(1)))
	g.Expect(out.Next.RampCeiling).To(Equal(int64(2)))
	g.Expect(out.Next.RampSettling).To(BeTrue())
	g.Expect(out.Transitions[0].From).To(Equal(wire.Closed))
	g.Expect(out.Transitions[0].Message).To(Equal("3 of 18 calls failed or timed out at limit 2 (ratio above 0.01 with 95% confidence): stepped back to limit 1; limit 2 is tried again after 2m0s clean"))
}

// TestWindowStartFollowsTheStep: the window the evaluator reads starts at the
// current step while the rule judges it, after the settling for a step
// entered by a step back, and is the breaker's otherwise.
func TestWindowStartFollowsTheStep(t *testing.T) {
	g := NewWithT(t)
	e := listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	closedAt := e.now
	e.now = e.now.Add(time.Minute)
	e.eval(healthy, protocol.Probes{}) // 10
	stepAt := e.now
	e.now = e.now.Add(20 * time.Second)
	g.Expect(WindowStart(e.params, e.pub, e.now)).To(Equal(stepAt), "the step's start, later than now - 30s")
	e.now = e.now.Add(time.Second)
	e.eval(sixth, protocol.Probes{}) // back to 5
	backAt := e.now
	g.Expect(WindowStart(e.params, e.pub, e.now)).To(Equal(backAt.Add(10*time.Second)), "after the settling")

	off := e.params
	off.Ramp.StepBack.When = ramp.Never
	g.Expect(WindowStart(off, e.pub, e.now)).To(Equal(e.now.Add(-30*time.Second)), "Never: the breaker's window")
	g.Expect(closedAt.Before(e.now.Add(-30 * time.Second))).To(BeTrue())
}

// TestPlanStepBackSurvivesRestarts: the step-back memory rides in the
// published state (Redis) and in status (RestoreSaved): a restarted manager
// neither loses a step back nor jumps to full capacity.
func TestPlanStepBackSurvivesRestarts(t *testing.T) {
	g := NewWithT(t)
	e := listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	e.now = e.now.Add(3 * time.Second)
	e.eval(sixth, protocol.Probes{}) // 5 -> 4, ceiling 5
	g.Expect(e.pub.Limit).To(Equal(int64(4)))

	// From Redis: the next plans keep it all: one clean minute is not
	// enough to try the ceiling again.
	e.now = e.now.Add(time.Minute)
	e.eval(healthy, protocol.Probes{})
	g.Expect(e.pub.Limit).To(Equal(int64(4)), "one clean minute is not enough to try 5 again")
	g.Expect(e.pub.RampCeiling).To(Equal(int64(5)))

	// From status, Redis lost: state, step, limit and ceiling.
	saved := Saved{State: wire.Ramping, RampStep: e.pub.RampStep, Limit: e.pub.Limit, RampCeiling: e.pub.RampCeiling, LastTransition: e.now}
	restored := RestoreSaved(e.params, saved, e.now)
	out := Plan(Input{Params: e.params, Previous: restored, Window: healthy, Now: e.now.Add(time.Minute)})
	g.Expect(out.Next.State).To(Equal(wire.Ramping))
	g.Expect(out.Next.Limit).To(Equal(int64(4)), "not the first step, not full capacity")
	g.Expect(out.Next.RampCeiling).To(Equal(int64(5)))
	g.Expect(strings.Join(reasons(out), ",")).To(BeEmpty())
	out = Plan(Input{Params: e.params, Previous: out.Next, Window: healthy, Now: e.now.Add(2 * time.Minute)})
	g.Expect(out.Next.Limit).To(Equal(int64(5)), "two clean minutes after the restore")
}

// TestPlanPartialFailureStepsBackBeforeTheBreaker: fast rejections can fail
// most calls of a step above the cold capacity while the dependency serves
// the rest. Such a step steps back instead of opening the breaker; a step
// whose calls all fail (the dependency is down), or one at a limit of 1,
// opens the breaker as before.
func TestPlanPartialFailureStepsBackBeforeTheBreaker(t *testing.T) {
	rejecting := protocol.Window{Calls: 100, Successes: 20, Failures: 80}
	down := protocol.Window{Calls: 100, Failures: 100}

	e := listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "80% fast rejections, 20 served: step back", advance: time.Second, window: rejecting, state: wire.Ramping, limit: 4, epoch: 4, events: []string{EventRampStepBack}},
		{name: "settled, 80% again: step back", advance: 11 * time.Second, window: rejecting, state: wire.Ramping, limit: 2, epoch: 4, events: []string{EventRampStepBack}},
		{name: "and again", advance: 11 * time.Second, window: rejecting, state: wire.Ramping, limit: 1, epoch: 4, events: []string{EventRampStepBack}},
		{name: "at 1 nothing is below: the breaker opens", advance: 11 * time.Second, window: rejecting, state: wire.Open, limit: 0, epoch: 5, events: []string{EventOpened}},
	})

	e = listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "all calls fail: the breaker opens", advance: time.Second, window: down, state: wire.Open, limit: 0, epoch: 5, events: []string{EventOpened}},
	})

	e = listening(ramp.Never, 40)
	toRamping(t, e, 5)
	runSteps(t, e, []step{
		{name: "Never: the breaker opens", advance: time.Second, window: rejecting, state: wire.Open, limit: 0, epoch: 5, events: []string{EventOpened}},
	})
}

// TestStepBackConverges runs the control law for an hour against a fluid
// dependency that stays cold at capacity c: each second the calls within c
// succeed (10 per slot, 100 ms calls) and those beyond it fail after a 1 s
// timeout (1 per slot). For every c the limit settles on the highest limit
// of the ramp at or below c (powers of two below the first step): the limit above
// it is probed again after 2, 4, then every 8 minutes, never sooner, each
// probe lasting seconds; the limit is above c for under 2% of the hour, and
// the breaker never opens.
func TestStepBackConverges(t *testing.T) {
	for _, c := range []int64{1, 3, 4, 6, 12, 30} {
		t.Run(fmt.Sprintf("cold capacity %d", c), func(t *testing.T) {
			e := listening(ramp.Ramping, 40) // steps 5, 10, 20, 40
			e.now = t0.Truncate(time.Second)
			e.pub = Restore(e.params, wire.Ramping, 0, e.now, e.now)
			var okAt, failedAt []int64 // per second since t0
			window := func() protocol.Window {
				from := WindowStart(e.params, e.pub, e.now).Add(-time.Second)
				var w protocol.Window
				for s := max(int64(from.Sub(t0)/time.Second)+1, 0); s < int64(len(okAt)); s++ {
					w.Successes += okAt[s]
					w.Failures += failedAt[s]
				}
				w.Calls = w.Successes + w.Failures
				return w
			}
			var above, probes int
			lastBack := map[int64]time.Time{} // by the limit stepped back from
			var gaps []time.Duration
			limits := map[int64]bool{}
			for range 3600 {
				limit := e.pub.Limit
				okAt = append(okAt, 10*min(limit, c))
				failedAt = append(failedAt, max(limit-c, 0))
				if limit > c {
					above++
				}
				e.now = e.now.Add(time.Second)
				out := e.eval(window(), protocol.Probes{})
				for _, tr := range out.Transitions {
					switch tr.Reason {
					case EventRampStepBack:
						probes++
						if at, ok := lastBack[limit]; ok {
							gaps = append(gaps, e.now.Sub(at))
						}
						lastBack[limit] = e.now
					case EventOpened:
						t.Fatalf("the breaker opened at %v: %s", e.now.Sub(t0), tr.Message)
					}
				}
				if e.now.Sub(t0) > 30*time.Minute {
					limits[e.pub.Limit] = true
				}
			}
			settled := int64(1)
			for _, s := range []int64{2, 4, 5, 10, 20, 40} { // powers of two below the first step
				if s <= c {
					settled = s
				}
			}
			t.Logf("c=%d: %d step backs, gaps %v, above c %d s of 3600, limits in the last half hour %v", c, probes, gaps, above, keys(limits))
			if float64(above) > 0.02*3600 {
				t.Errorf("above the cold capacity %d s of 3600, want under 2%%", above)
			}
			for i, g := range gaps {
				want := time.Minute << min(i+1, ramp.MaxBackoffs)
				if g < want {
					t.Errorf("probe %d came %v after the previous one, want at least %v", i+2, g, want)
				}
			}
			for l := range limits {
				if l <= c && l != settled {
					t.Errorf("limits in the last half hour %v, want %d and probes above %d", keys(limits), settled, c)
				}
			}
			if !limits[settled] {
				t.Errorf("limits in the last half hour %v, want %d", keys(limits), settled)
			}
		})
	}
}

func keys(m map[int64]bool) []int64 {
	var ks []int64
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// TestPlanPartialFailureYieldsToAFailingSignal: an external signal that says
// the dependency is failing opens the breaker even when the workers' outcomes
// alone would be a partial failure the ramp steps back from.
func TestPlanPartialFailureYieldsToAFailingSignal(t *testing.T) {
	g := NewWithT(t)
	e := listening(ramp.Ramping, 40)
	toRamping(t, e, 5)
	e.now = e.now.Add(31 * time.Second)
	rejecting := protocol.Window{Calls: 100, Successes: 20, Failures: 80}
	out := Plan(Input{Params: e.params, Previous: e.pub, Window: rejecting, Now: e.now,
		External: Signal{Valid: true, Ratio: 0.9, Calls: -1}})
	g.Expect(reasons(out)).To(Equal([]string{EventOpened}))
	out = Plan(Input{Params: e.params, Previous: e.pub, Window: rejecting, Now: e.now})
	g.Expect(reasons(out)).To(Equal([]string{EventRampStepBack}), "without the signal: a partial failure")
}

// TestPlanAdvanceEarly: with the step-back rule on, a clean step whose own
// calls prove it clean (ramp.StepBack.ProvenClean: 100 calls at 1%, none
// failing) climbs once it has lasted Schedule.Settle (10 s for one-minute
// steps), before its stepDuration; a step with too few calls, or any
// failure, waits its full stepDuration; a step whose next limit is the
// ceiling waits its doubled hold; the fixed schedule (Never) never climbs
// early.
func TestPlanAdvanceEarly(t *testing.T) {
	proven := protocol.Window{Calls: 100, Successes: 100}
	t.Run("without earlyClimb stepDuration is a floor", func(t *testing.T) {
		e := listening(ramp.Ramping, 40)
		toRamping(t, e, 5)
		runSteps(t, e, []step{
			{name: "proven clean at the dwell: stays", advance: 10 * time.Second, window: proven, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "3000 clean calls at 59 s: stays", advance: 49 * time.Second, window: protocol.Window{Calls: 3000, Successes: 3000}, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "a minute: climbs", advance: time.Second, window: protocol.Window{Calls: 3000, Successes: 3000}, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		})
	})
	t.Run("high traffic climbs after the dwell", func(t *testing.T) {
		e := listening(ramp.Ramping, 40)
		e.params.Ramp.EarlyClimb = true
		toRamping(t, e, 5)
		runSteps(t, e, []step{
			{name: "proven clean before the dwell", advance: 9 * time.Second, window: proven, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "proven clean at the dwell: climbs", advance: time.Second, window: proven, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
			{name: "the next step too", advance: 10 * time.Second, window: proven, state: wire.Ramping, limit: 20, epoch: 4, events: []string{EventRampStep}},
			{name: "0.1% failed: clean but not proven", advance: 10 * time.Second, window: protocol.Window{Calls: 1000, Successes: 999, Failures: 1}, state: wire.Ramping, limit: 20, epoch: 4},
			{name: "its full stepDuration: climbs by time", advance: 50 * time.Second, window: protocol.Window{Calls: 6000, Successes: 5952, Failures: 48}, state: wire.Closed, limit: 40, epoch: 5, events: []string{EventRampStep}},
		})
	})
	t.Run("low traffic waits the full stepDuration", func(t *testing.T) {
		e := listening(ramp.Ramping, 40)
		e.params.Ramp.EarlyClimb = true
		toRamping(t, e, 5)
		runSteps(t, e, []step{
			{name: "30 s, 60 clean calls", advance: 30 * time.Second, window: protocol.Window{Calls: 60, Successes: 60}, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "59 s, 99 clean calls", advance: 29 * time.Second, window: protocol.Window{Calls: 99, Successes: 99}, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "a minute", advance: time.Second, window: protocol.Window{Calls: 99, Successes: 99}, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		})
	})
	t.Run("the ceiling's hold applies in full", func(t *testing.T) {
		e := listening(ramp.Ramping, 40)
		e.params.Ramp.EarlyClimb = true
		toRamping(t, e, 5)
		runSteps(t, e, []step{
			{name: "climbs early", advance: 10 * time.Second, window: proven, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
			{name: "1 in 6 fails at 10: step back to 5", advance: 3 * time.Second, window: sixth, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventRampStepBack}},
			{name: "proven clean after settling: 10 is the ceiling", advance: time.Minute, window: protocol.Window{Calls: 3000, Successes: 3000}, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "twice the stepDuration: tries 10 again", advance: time.Minute, window: protocol.Window{Calls: 3000, Successes: 3000}, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		})
	})
	t.Run("Never keeps the fixed schedule", func(t *testing.T) {
		e := listening(ramp.Never, 40)
		toRamping(t, e, 5)
		runSteps(t, e, []step{
			{name: "proven clean calls do not count", advance: 30 * time.Second, window: protocol.Window{Calls: 3000, Successes: 3000}, state: wire.Ramping, limit: 5, epoch: 4},
			{name: "a minute", advance: 30 * time.Second, window: protocol.Window{Calls: 3000, Successes: 3000}, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		})
	})
}
