package ramp

// A Schedule and the arithmetic over it alone: validation, the default
// steps, and the forecasts (capacity withheld, backlog drain) that need no
// Ramp. ramp.go walks a Schedule.

import (
	"fmt"
	"time"
)

// Schedule is a slow-start ramp: the limits to step through and how long each
// step lasts.
type Schedule struct {
	// Steps are the limits, strictly increasing; the last one is normally
	// the full capacity.
	Steps []int64
	// StepDuration is the clean time spent at each step before advancing
	// (at most: with StepBack on, a step proven clean by its calls may
	// advance after Settle, see Ramp.AdvanceEarly).
	StepDuration time.Duration
	// StepBack is the rule that holds a step that fails and steps back from
	// it (see StepBack); the zero value is Never: a fixed schedule.
	StepBack StepBack
	// EarlyClimb lets a step that its own calls prove clean
	// (StepBack.ProvenClean) climb after Settle instead of StepDuration
	// (Ramp.AdvanceEarly). Off, StepDuration is a floor: no step is left
	// before it has lasted StepDuration.
	EarlyClimb bool
	// WarmFor is the longest outage after which the dependency is still
	// warm: a breaker that closes less than WarmFor after it opened goes
	// straight to full capacity instead of climbing the steps (Ramp.Skip).
	// 0 ramps after every outage.
	WarmFor time.Duration
}

// Validate checks s against the dependency's capacity: capacity >= 1, Steps
// non-empty, each step >= 1 and <= capacity, strictly increasing, and
// StepDuration > 0. It does not require the last step to equal capacity.
func (s Schedule) Validate(capacity int64) error {
	if capacity < 1 {
		return fmt.Errorf("capacity must be >= 1, got %d", capacity)
	}
	if len(s.Steps) == 0 {
		return fmt.Errorf("steps must not be empty")
	}
	for i, v := range s.Steps {
		if err := validateStep(i, v, capacity); err != nil {
			return err
		}
		if i > 0 && v <= s.Steps[i-1] {
			return fmt.Errorf("steps must be strictly increasing, got steps[%d]=%d after steps[%d]=%d", i, v, i-1, s.Steps[i-1])
		}
	}
	if s.StepDuration <= 0 {
		return fmt.Errorf("stepDuration must be > 0, got %v", s.StepDuration)
	}
	if err := s.StepBack.Validate(); err != nil {
		return fmt.Errorf("stepBack: %w", err)
	}
	if s.EarlyClimb && !s.StepBack.On() {
		return fmt.Errorf("earlyClimb needs stepBack.when Ramping or Always")
	}
	if s.WarmFor < 0 {
		return fmt.Errorf("warmFor must be >= 0, got %v", s.WarmFor)
	}
	return nil
}

// validateStep checks one step against the bounds [1, capacity].
func validateStep(i int, v, capacity int64) error {
	if v < 1 {
		return fmt.Errorf("steps[%d] must be >= 1, got %d", i, v)
	}
	if v > capacity {
		return fmt.Errorf("steps[%d] must be <= capacity %d, got %d", i, capacity, v)
	}
	return nil
}

// DefaultSteps returns capacity/8, capacity/4, capacity/2 and capacity
// (integer division) with values below 1 and duplicates removed, so the result
// is strictly increasing and ends at capacity. For example 40 gives
// [5 10 20 40], 10 gives [1 2 5 10], 3 gives [1 3] and 1 gives [1]. A capacity
// below 1 gives nil.
func DefaultSteps(capacity int64) []int64 {
	var steps []int64
	for _, v := range []int64{capacity / 8, capacity / 4, capacity / 2, capacity} {
		if v >= 1 && (len(steps) == 0 || v > steps[len(steps)-1]) {
			steps = append(steps, v)
		}
	}
	return steps
}

// Withheld returns the capacity-seconds the ramp withholds while it climbs:
// the sum over every step except the last of
// (capacity - step) * StepDuration.Seconds(). A drain-time prediction of
// backlog/(capacity - arrival rate) grows by Withheld/(capacity - arrival
// rate) when the drain starts with this ramp. It assumes a clean climb of one
// step per StepDuration with no restart; capacity is normally the last step.
// With the step-back rule on, a step its calls prove clean climbs early
// (Ramp.AdvanceEarly), so for a clean climb Withheld is an upper bound.
func (s Schedule) Withheld(capacity int64) float64 {
	var total float64
	for i := 0; i+1 < len(s.Steps); i++ {
		total += float64(capacity-s.Steps[i]) * s.StepDuration.Seconds()
	}
	return total
}

// Drain forecasts how long a backlog takes to drain from the moment the ramp
// starts at its first step (skip: at full capacity), climbing one step per
// StepDuration with no step back: a fluid model in which each step serves
// rate(step) calls a second, new work arrives at arrivals a second, and the
// last step serves rate(capacity) until the backlog is gone. The backlog
// may drain during the climb; a step serving less than arrivals makes it
// grow. It reports false when the last step cannot outpace arrivals.
//
// It assumes the dependency serves every step in full. A dependency that is
// still cold when the ramp reaches a limit it cannot serve makes the ramp
// step back or the breaker reopen, and the drain takes longer: the forecast
// is then a lower bound.
func (s Schedule) Drain(backlog, arrivals float64, skip bool, capacity int64, rate func(limit int64) float64) (float64, bool) {
	elapsed := 0.0
	if !skip {
		for i := 0; i+1 < len(s.Steps); i++ {
			spare := rate(s.Steps[i]) - arrivals
			d := s.StepDuration.Seconds()
			if spare > 0 && backlog <= spare*d {
				return elapsed + backlog/spare, true
			}
			backlog -= spare * d
			elapsed += d
		}
	}
	spare := rate(capacity) - arrivals
	if spare <= 0 {
		return 0, false
	}
	return elapsed + max(backlog, 0)/spare, true
}
