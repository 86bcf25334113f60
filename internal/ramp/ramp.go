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
// injected clock.Clock, so the controller, the service middleware and the
// simulator (virtual clock) share the same arithmetic.
package ramp

import (
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/clock"
)

// Snapshot is the persistent form of a Ramp, used after a manager restart to
// continue where the ramp was.
type Snapshot struct {
	// Step is the index into Schedule.Steps.
	Step int
	// StepStarted is when the current step began.
	StepStarted time.Time
	// Limit, when between 1 and Steps[0] - 1, is the limit in force below
	// the first step, which the ramp reached by stepping back from it; it
	// counts only at Step 0. 0 means Steps[Step].
	Limit int64
	// Ceiling is the lowest limit that failed since the ramp last
	// restarted and has not been held clean since: the ramp moves up to it
	// only after a longer hold (see Ramp.Hold). 0 means none.
	Ceiling int64
	// Backoffs is the number of step backs since the ceiling was last
	// cleared; each doubles the hold before the ceiling is tried again, up
	// to MaxBackoffs.
	Backoffs int
	// Settling is whether the current step was entered by a step back, so
	// that its first Settle of outcomes is not its own.
	Settling bool
}

// Ramp walks a Schedule. It is safe for concurrent use.
//
// The Schedule should pass Validate; a Ramp over an empty Schedule reports a
// Limit of 0 and is always Done.
type Ramp struct {
	mu       sync.Mutex
	steps    []int64
	stepDur  time.Duration
	clk      clock.Clock
	step     int
	started  time.Time
	below    int64
	ceiling  int64
	backoffs int
	settling bool
}

// New returns a Ramp at step 0 starting at clk.Now(). The Steps slice is
// copied.
func New(s Schedule, clk clock.Clock) *Ramp {
	return Restore(s, clk, Snapshot{Step: 0, StepStarted: clk.Now()})
}

// Restore returns a Ramp that continues from a persisted Snapshot. Step is
// clamped into [0, len(Steps)-1]; a StepStarted later than clk.Now() (clock
// skew between replicas) is clamped to clk.Now(). A Limit outside
// [1, Steps[0]) or at a Step above 0 is ignored, Backoffs is clamped into
// [0, MaxBackoffs] and a Ceiling below the limit is dropped (it was written
// for other steps).
func Restore(s Schedule, clk clock.Clock, snap Snapshot) *Ramp {
	r := &Ramp{
		steps:    append([]int64(nil), s.Steps...),
		stepDur:  s.StepDuration,
		clk:      clk,
		step:     min(max(snap.Step, 0), max(len(s.Steps)-1, 0)),
		started:  snap.StepStarted,
		backoffs: min(max(snap.Backoffs, 0), MaxBackoffs),
		settling: snap.Settling,
	}
	if now := clk.Now(); r.started.After(now) {
		r.started = now
	}
	if len(r.steps) > 0 && r.step == 0 && snap.Limit >= 1 && snap.Limit < r.steps[0] {
		r.below = snap.Limit
	}
	if snap.Ceiling >= r.limit() {
		r.ceiling = snap.Ceiling
	} else {
		r.backoffs = 0
	}
	return r
}

// Advance moves up one step if the current step has lasted at least its
// hold time (Hold) and the ramp is not at its last step; the new step starts
// at clk.Now(), not at the scheduled boundary. It reports whether it
// advanced. Below the first step (after stepping back from it) the limits are
// the powers of two below it, and a step up doubles the limit, up to the
// first step. A limit at or above the ceiling that has lasted
// its hold time has been held clean: Advance clears the ceiling, at full
// capacity too (where it does not move).
//
// Advance moves at most one step per call, even after a long gap: a restarted
// controller continues conservatively rather than jumping to full capacity.
// Callers that want the seed's one-step-per-minute cadence call it at least
// once per StepDuration. Callers that judge the outcomes (StepBack) call it
// only for a Clean step.
func (r *Ramp) Advance() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.clk.Now()
	if len(r.steps) == 0 || now.Sub(r.started) < r.hold() {
		return false
	}
	if r.ceiling > 0 && r.limit() >= r.ceiling {
		r.ceiling, r.backoffs = 0, 0
	}
	if r.done() {
		return false
	}
	r.up(now)
	return true
}

// AdvanceEarly moves up one step before the step's hold time, for a step
// whose own calls have proved it clean (StepBack.ProvenClean; the caller
// judges that): only once the step has lasted at least dwell, never onto a
// limit at or above the ceiling (whose doubled hold applies in full, see
// Hold), and never at the last step. Like Advance the new step starts at
// clk.Now(); it reports whether it advanced. It never clears the ceiling:
// only a limit held clean for its whole hold time does that (Advance).
//
// A step entered by a step back is never advanced early: its next limit is
// the one that failed, the ceiling.
func (r *Ramp) AdvanceEarly(dwell time.Duration) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.clk.Now()
	if len(r.steps) == 0 || r.done() || now.Sub(r.started) < dwell {
		return false
	}
	if r.ceiling > 0 && r.next() >= r.ceiling {
		return false
	}
	r.up(now)
	return true
}

// up moves to the next limit, starting at now.
func (r *Ramp) up(now time.Time) {
	if r.below > 0 {
		r.below = r.next()
		if r.below >= r.steps[0] {
			r.below = 0
		}
	} else {
		r.step++
	}
	r.started = now
	r.settling = false
}

// Rewind starts the current step again at clk.Now(), not Settling: for a
// breaker that closes after a Collapse, whose position and ceiling the
// ramp kept through the outage.
func (r *Ramp) Rewind() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.started = r.clk.Now()
	r.settling = false
}

// Skip moves to full capacity (the last step) at clk.Now() and forgets the
// ceiling: for a breaker that closes after an outage shorter than
// Schedule.WarmFor.
func (r *Ramp) Skip() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.restart()
	r.step = max(len(r.steps)-1, 0)
}

// Hold is how long the current step must last, clean, before Advance moves
// up: StepDuration, or, below the ceiling when the next limit is at or above
// it (a limit that failed), StepDuration × 2^Backoffs.
func (r *Ramp) Hold() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hold()
}

func (r *Ramp) hold() time.Duration {
	if r.ceiling > 0 && r.limit() < r.ceiling && r.next() >= r.ceiling {
		return r.stepDur << r.backoffs
	}
	return r.stepDur
}

// next is the limit Advance would move to: below the first step, twice the
// limit, at most the first step.
func (r *Ramp) next() int64 {
	if r.below > 0 {
		return min(2*r.below, r.steps[0])
	}
	return r.steps[min(r.step+1, len(r.steps)-1)]
}

// Limit returns the current limit: Steps[Step], or the limit below the first
// step that a step back from it reached.
func (r *Ramp) Limit() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.limit()
}

func (r *Ramp) limit() int64 {
	switch {
	case len(r.steps) == 0:
		return 0
	case r.below > 0:
		return r.below
	}
	return r.steps[r.step]
}

// Ceiling returns the lowest limit that failed and has not been held clean
// since, 0 if none.
func (r *Ramp) Ceiling() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ceiling
}

// Settling reports whether the current step was entered by a step back.
func (r *Ramp) Settling() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.settling
}

// Started returns when the current step began.
func (r *Ramp) Started() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.started
}

// Step returns the index of the current step; 0 below the first step.
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
	return r.step >= len(r.steps)-1 && r.below == 0
}

// Snapshot returns the state to persist.
func (r *Ramp) Snapshot() Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Snapshot{
		Step:        r.step,
		StepStarted: r.started,
		Limit:       r.below,
		Ceiling:     r.ceiling,
		Backoffs:    r.backoffs,
		Settling:    r.settling,
	}
}

// Restart goes back to step 0 starting at clk.Now(), and forgets the ceiling.
// Because the first step must then last a full StepDuration of clean
// operation, call Restart when the breaker closes again after a reopen
// (calling it at the reopen as well is harmless) rather than only when it
// opens.
func (r *Ramp) Restart() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.restart()
}

func (r *Ramp) restart() {
	r.step = 0
	r.started = r.clk.Now()
	r.below, r.ceiling, r.backoffs, r.settling = 0, 0, 0, false
}
