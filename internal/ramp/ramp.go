// Package ramp is Spillway's slow-start schedule: after a dependency's
// breaker closes (or a service restarts), the allowed concurrency climbs
// through a list of limits, one step per clean StepDuration, up to the full
// capacity; if the breaker reopens the ramp restarts from the bottom.
//
// With the default steps for a capacity of 40 and one-minute steps the limit
// is 5, then 10 after one clean minute, 20 after two and the full 40 after
// three.
//
// The package is pure: it performs no I/O and reads time only from an
// injected Clock (clock.Clock), so the controller, the service middleware
// and the simulator (virtual clock) share the same arithmetic.
package ramp

import (
	"fmt"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/clock"
)

// Clock is clock.Clock, Spillway's one clock interface, under the name this
// package's signatures use.
type Clock = clock.Clock

// Schedule is a slow-start ramp: the limits to step through and how long each
// step lasts.
type Schedule struct {
	// Steps are the limits, strictly increasing; the last one is normally
	// the full capacity.
	Steps []int64
	// StepDuration is the clean time spent at each step before advancing.
	StepDuration time.Duration
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
func (s Schedule) Withheld(capacity int64) float64 {
	var total float64
	for i := 0; i+1 < len(s.Steps); i++ {
		total += float64(capacity-s.Steps[i]) * s.StepDuration.Seconds()
	}
	return total
}

// Snapshot is the persistent form of a Ramp, used after a manager restart to
// continue where the ramp was.
type Snapshot struct {
	// Step is the index into Schedule.Steps.
	Step int
	// StepStarted is when the current step began.
	StepStarted time.Time
}

// Ramp walks a Schedule. It is safe for concurrent use.
//
// The Schedule should pass Validate; a Ramp over an empty Schedule reports a
// Limit of 0 and is always Done.
type Ramp struct {
	mu      sync.Mutex
	steps   []int64
	stepDur time.Duration
	clk     Clock
	step    int
	started time.Time
}

// New returns a Ramp at step 0 starting at clk.Now(). The Steps slice is
// copied.
func New(s Schedule, clk Clock) *Ramp {
	return Restore(s, clk, Snapshot{Step: 0, StepStarted: clk.Now()})
}

// Restore returns a Ramp that continues from a persisted Snapshot. Step is
// clamped into [0, len(Steps)-1]; a StepStarted later than clk.Now() (clock
// skew between replicas) is clamped to clk.Now().
func Restore(s Schedule, clk Clock, snap Snapshot) *Ramp {
	r := &Ramp{
		steps:   append([]int64(nil), s.Steps...),
		stepDur: s.StepDuration,
		clk:     clk,
		step:    min(max(snap.Step, 0), max(len(s.Steps)-1, 0)),
		started: snap.StepStarted,
	}
	if now := clk.Now(); r.started.After(now) {
		r.started = now
	}
	return r
}

// Advance moves up one step if the current step has lasted at least
// StepDuration and the ramp is not at its last step; the new step starts at
// clk.Now(), not at the scheduled boundary. It reports whether it advanced.
//
// Advance moves at most one step per call, even after a long gap: a restarted
// controller continues conservatively rather than jumping to full capacity.
// Callers that want the seed's one-step-per-minute cadence call it at least
// once per StepDuration.
func (r *Ramp) Advance() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done() {
		return false
	}
	now := r.clk.Now()
	if now.Sub(r.started) < r.stepDur {
		return false
	}
	r.step++
	r.started = now
	return true
}

// Limit returns the current limit, Steps[Step].
func (r *Ramp) Limit() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.steps) == 0 {
		return 0
	}
	return r.steps[r.step]
}

// Step returns the index of the current step.
func (r *Ramp) Step() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.step
}

// Done reports whether the ramp is at its last step (full capacity).
func (r *Ramp) Done() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done()
}

func (r *Ramp) done() bool {
	return r.step >= len(r.steps)-1
}

// Snapshot returns the state to persist.
func (r *Ramp) Snapshot() Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Snapshot{Step: r.step, StepStarted: r.started}
}

// Restart goes back to step 0 starting at clk.Now(). Because the first step
// must then last a full StepDuration of clean operation, call Restart when the
// breaker closes again after a reopen (calling it at the reopen as well is
// harmless) rather than only when it opens.
func (r *Ramp) Restart() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.step = 0
	r.started = r.clk.Now()
}
