package control

import (
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Restore is what the controller continues from when Redis holds no state
// for the policy (Redis was flushed, or lost its data in a restart): the
// state, ramp step and last transition time it last wrote to the policy's
// status. state "" (a policy never evaluated) restores as Closed at full
// capacity, with the ramp complete for a StepDuration already, so that the
// step-back rule does not judge a new policy's first minute as a ramp step; a
// zero or future lastTransition counts as now. An Open breaker
// keeps its transition time, so it half-opens when it would have; a ramp step
// starts again at now, since its start is not in status. The epoch is 0, so
// Plan publishes epoch 1 and any stale probe counts are cleared.
func Restore(p policy.Params, state wire.State, rampStep int, lastTransition, now time.Time) protocol.Published {
	return RestoreSaved(p, Saved{State: state, RampStep: rampStep, LastTransition: lastTransition}, now)
}

// Saved is what the policy's status keeps of the published state, for
// RestoreSaved.
type Saved struct {
	// State is status.state.
	State wire.State
	// RampStep is status.rampStep.
	RampStep int
	// Limit is status.currentLimit: below the first ramp step, the limit a
	// step back reached.
	Limit int64
	// RampCeiling is status.rampCeiling.
	RampCeiling int64
	// LastTransition is status.lastTransitionTime.
	LastTransition time.Time
}

// RestoreSaved is Restore from everything status keeps: a Ramping state also
// keeps the limit below the first step and the ceiling that step backs
// reached, with one backoff (the hold before the ceiling is twice the step
// duration), so a manager that lost Redis's state neither forgets a step back
// nor jumps to a higher limit.
func RestoreSaved(p policy.Params, s Saved, now time.Time) protocol.Published {
	state, rampStep, lastTransition := s.State, s.RampStep, s.LastTransition
	since := now
	if !lastTransition.IsZero() && !lastTransition.After(now) {
		since = lastTransition
	}
	out := protocol.Published{
		State:           wire.Closed,
		BreakerSince:    since,
		RampStep:        len(p.Ramp.Steps) - 1,
		RampStepStarted: since,
	}
	switch state {
	case "":
		out.RampStepStarted = since.Add(-p.Ramp.StepDuration)
	case wire.Open, wire.HalfOpen:
		out.State = state
	case wire.Ramping:
		out.State = wire.Ramping
		out.RampStep = min(max(rampStep, 0), len(p.Ramp.Steps)-1)
		out.RampStepStarted = now
		if out.RampStep == 0 && len(p.Ramp.Steps) > 0 && s.Limit >= 1 && s.Limit < p.Ramp.Steps[0] {
			out.RampLimit = s.Limit
		}
		if s.RampCeiling > 0 {
			out.RampCeiling, out.RampBackoffs = s.RampCeiling, 1
		}
	}
	return out
}

// restore builds the breaker and ramp a published state describes. A Closed
// state means the ramp is done, whatever step was stored: a capacity change
// must not turn a closed breaker into a ramp.
func restore(p policy.Params, prev protocol.Published, clk fixedClock) (*breaker.Breaker, *ramp.Ramp) {
	state := prev.State.BreakerState()
	// A time after now was written by a clock ahead of Redis's (a manager
	// before the evaluator planned by Redis time, or a Redis failover to a
	// node behind): it counts as now, or the window would stay empty and the
	// breaker could not open until Redis's clock caught up.
	since := prev.BreakerSince
	if since.IsZero() || since.After(clk.Now()) {
		since = clk.Now()
	}
	b := breaker.Restore(p.Breaker, clk, breaker.Snapshot{State: state, Since: since})
	step := prev.RampStep
	if prev.State != wire.Ramping && b.State() == wire.Closed {
		step = len(p.Ramp.Steps) - 1
	}
	started := prev.RampStepStarted
	if started.IsZero() || started.After(clk.Now()) {
		started = clk.Now()
	}
	snap := ramp.Snapshot{
		Step: step, StepStarted: started,
		Limit: prev.RampLimit, Ceiling: prev.RampCeiling, Backoffs: prev.RampBackoffs, Settling: prev.RampSettling,
	}
	r := ramp.Restore(p.Ramp, clk, snap)
	return b, r
}
