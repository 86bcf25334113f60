package control

import (
	"fmt"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The Event messages of Plan's transitions.

func breakerReason(to wire.State) string {
	switch to {
	case wire.Open:
		return EventOpened
	case wire.HalfOpen:
		return EventHalfOpened
	}
	return EventClosed
}

func breakerMessage(p policy.Params, t breaker.Transition, window, probes breaker.Counts, r *ramp.Ramp) string {
	switch {
	case t.To == wire.Open && t.From == wire.HalfOpen:
		return fmt.Sprintf("A probe call failed (%d of %d failed): breaker reopened, limit 0 for %v",
			probes.Failures, probes.Calls, p.Breaker.OpenDuration)
	case t.To == wire.Open:
		return fmt.Sprintf("%d of %d calls failed or timed out (failure ratio %.2f): breaker opened, limit 0 for %v",
			window.Failures, window.Calls, p.Breaker.FailureRatio, p.Breaker.OpenDuration)
	case t.To == wire.HalfOpen:
		return fmt.Sprintf("Breaker half-open after %v: admitting %d probe calls", p.Breaker.OpenDuration, p.Breaker.HalfOpenProbes)
	case r.Done():
		return fmt.Sprintf("%d probe calls succeeded: breaker closed, limit %d (full capacity)", probes.Calls, r.Limit())
	}
	return fmt.Sprintf("%d probe calls succeeded: breaker closed, ramping from limit %d (step 1 of %d)",
		probes.Calls, r.Limit(), len(p.Ramp.Steps))
}

func stepBackMessage(p policy.Params, window breaker.Counts, from int64, r *ramp.Ramp) string {
	return fmt.Sprintf("%d of %d calls failed or timed out at limit %d (ratio above %.2f with 95%% confidence): stepped back to limit %d; limit %d is tried again after %v clean",
		window.Failures, window.Calls, from, p.Ramp.StepBack.FailureRatio, r.Limit(), r.Ceiling(), r.Hold())
}

func rampMessage(p policy.Params, r *ramp.Ramp) string {
	if r.Done() {
		return fmt.Sprintf("Ramp complete: limit %d (full capacity)", r.Limit())
	}
	if r.Limit() < p.Ramp.Steps[r.Step()] {
		return fmt.Sprintf("Ramp climbing back to its first step (%d): limit %d", p.Ramp.Steps[0], r.Limit())
	}
	return fmt.Sprintf("Ramp step %d of %d: limit %d", r.Step()+1, len(p.Ramp.Steps), r.Limit())
}
