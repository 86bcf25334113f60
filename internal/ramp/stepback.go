package ramp

import (
	"fmt"
	"math"
	"time"
)

// When says when the step-back rule applies.
type When string

const (
	// Never is a fixed schedule: one step up per StepDuration, whatever the
	// outcomes; only the breaker stops it. The zero When is Never.
	Never When = "Never"
	// Ramping holds and steps back while the ramp climbs, up to and
	// including its first StepDuration at full capacity (the caller judges
	// that one).
	Ramping When = "Ramping"
	// Always also steps back from full capacity (capacity discovery): a
	// dependency that starts failing below the breaker's threshold at full
	// capacity gets the ramp back, capped below the limit that failed.
	Always When = "Always"
)

// Z is the one-sided 95% normal quantile the step-back rule's Wilson bound
// uses.
const Z = 1.645

// MaxBackoffs caps the doubling of the hold before a limit that failed is
// tried again: at most 2^MaxBackoffs = 8 step durations.
const MaxBackoffs = 3

// MaxSettle caps Settle.
const MaxSettle = 10 * time.Second

// StepBack is the rule that makes the ramp listen to the outcomes of each
// step. With a step's calls and failures (failures and timeouts), counted
// since the step started and over at most the breaker window:
//
//   - step back when Failures >= MinFailures and the Wilson lower bound
//     (one-sided 95%, Z) of the failure ratio is at least FailureRatio: the
//     step is too high with 95% confidence;
//   - hold (do not step up) while the observed ratio Failures/Calls is at
//     least FailureRatio;
//   - step up when the step has lasted its hold time and the observed ratio
//     is below FailureRatio.
//
// MinFailures keeps a single failure at tiny volume from stepping back; the
// Wilson bound keeps the ordinary noise of a healthy dependency at high
// volume from doing it. FailureRatio must lie well below the breaker's
// failure ratio: the rule acts on a partial failure, before the breaker's
// minCalls and ratio are reached and before the dependency falls over.
type StepBack struct {
	// When is Never (the zero value), Ramping or Always.
	When When
	// FailureRatio is the failure ratio a step must stay below; in (0, 1).
	FailureRatio float64
	// MinFailures is the fewest failures that can step back; >= 1.
	MinFailures int64
}

// Validate returns an error naming the first invalid field, or nil. A rule
// that is Never on is valid whatever its other fields.
func (sb StepBack) Validate() error {
	switch sb.When {
	case "", Never:
		return nil
	case Ramping, Always:
	default:
		return fmt.Errorf("when must be Never, Ramping or Always, got %q", sb.When)
	}
	if !(sb.FailureRatio > 0 && sb.FailureRatio < 1) {
		return fmt.Errorf("failureRatio must be in (0, 1), got %v", sb.FailureRatio)
	}
	if sb.MinFailures < 1 {
		return fmt.Errorf("minFailures must be >= 1, got %d", sb.MinFailures)
	}
	return nil
}

// On reports whether the rule applies at all.
func (sb StepBack) On() bool { return sb.When == Ramping || sb.When == Always }

// Verdict is what the step-back rule makes of a step's outcomes.
type Verdict int

const (
	// Clean: the step may move up once it has lasted its hold time.
	Clean Verdict = iota
	// Hold: the failure ratio is at FailureRatio or above but not yet
	// conclusive: the step neither moves up nor back.
	Hold
	// Back: the step is too high; step back.
	Back
)

func (v Verdict) String() string {
	switch v {
	case Clean:
		return "Clean"
	case Hold:
		return "Hold"
	case Back:
		return "Back"
	}
	return fmt.Sprintf("Verdict(%d)", int(v))
}

// Judge applies the rule to a step's calls and failures (failures include
// timeouts and are part of calls). A rule that is Never on judges every step
// Clean.
func (sb StepBack) Judge(calls, failures int64) Verdict {
	if !sb.On() || calls <= 0 || failures <= 0 {
		return Clean
	}
	failures = min(failures, calls)
	if failures >= sb.MinFailures && WilsonLower(failures, calls, Z) >= sb.FailureRatio {
		return Back
	}
	if float64(failures) >= sb.FailureRatio*float64(calls) {
		return Hold
	}
	return Clean
}

// WilsonLower is the lower bound of the Wilson score interval for a
// proportion of k successes in n trials at normal quantile z; 0 when n <= 0.
func WilsonLower(k, n int64, z float64) float64 {
	if n <= 0 {
		return 0
	}
	nf := float64(n)
	p := float64(k) / nf
	z2 := z * z
	center, margin := p+z2/(2*nf), z*math.Sqrt(p*(1-p)/nf+z2/(4*nf*nf))
	return max(0, (center-margin)/(1+z2/nf))
}

// ProvenClean reports whether a step's calls and failures prove it clean
// enough to climb before its StepDuration (Ramp.AdvanceEarly): at least
// ProofCalls of them, and not one failure. ProofCalls is 1/FailureRatio (100
// at 0.01), the fewest calls at which a single failure would not already hold
// the step (Judge), so the step has been seen clean at the rule's own
// resolution; with none failing, its failure ratio is below 3/ProofCalls with
// 95% confidence. A step with any failure climbs by time only (Ramp.Advance),
// if the rule judges it Clean. A rule that is Never on proves nothing (the
// fixed schedule climbs by time only).
//
// The proof does not need to be strong: a step that climbs early onto a limit
// above what the dependency can serve fails there, and the rule steps back to
// this step, which then becomes safe ground (the failed limit is the ceiling).
// What bounds the risk is the dwell before an early climb (Schedule.Settle):
// the calls the step admitted first must have ended, so that failures as slow
// as a timeout have been counted.
func (sb StepBack) ProvenClean(calls, failures int64) bool {
	if !sb.On() || failures > 0 {
		return false
	}
	return calls >= sb.ProofCalls()
}

// ProofCalls is how many calls, none failing, prove a step clean:
// ceil(1/FailureRatio), at least 1; 0 for a rule that is not on.
func (sb StepBack) ProofCalls() int64 {
	if !sb.On() || !(sb.FailureRatio > 0) {
		return 0
	}
	return max(1, int64(math.Ceil(1/sb.FailureRatio-1e-9)))
}

// Settle is how long the outcomes of a step entered by a step back are
// ignored: calls admitted under the higher limit, still in flight when it
// stepped back, end during it, and must not count against the lower step. It
// is a quarter of StepDuration, at most MaxSettle.
func (s Schedule) Settle() time.Duration {
	return min(s.StepDuration/4, MaxSettle)
}

// StepBack moves down from a limit that fails: to the step below it; from the
// first step, to the highest power of two below it; below the first step, to
// half the limit. The limits below the first step are the powers of two the
// climb back doubles through, so a step back returns to the limit the ramp
// came from. The limit that failed
// becomes the ceiling, and the hold before it is tried again doubles (Hold).
// The new step starts at clk.Now() and is Settling. It reports false, and
// changes nothing, at a limit of 1 or less: there is nothing below to step
// back to, and the breaker decides.
func (r *Ramp) StepBack() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	failed := r.limit()
	if failed <= 1 {
		return false
	}
	switch {
	case r.below > 0:
		r.below = max(1, r.below/2)
	case r.step > 0:
		r.step--
	default:
		r.below = powerOfTwoBelow(failed)
	}
	r.ceiling = failed
	r.backoffs = min(r.backoffs+1, MaxBackoffs)
	r.started = r.clk.Now()
	r.settling = true
	return true
}

// Collapse remembers the limit at which the dependency fell over, when the
// breaker opens during a step or right after the last one: that limit
// becomes the ceiling, exactly as a step back's (the hold before it doubles,
// up to MaxBackoffs), and the ramp goes back to where it will start again
// once the breaker closes: its first step, or, when the ceiling is at or
// below the first step, the highest power of two below the ceiling. A ramp
// that had stepped back and was still settling fell over because of the
// ceiling it stepped back from: that ceiling stays. A collapse at a limit
// of 1 remembers nothing (there is nothing below it) and is Restart.
// The new step starts at clk.Now(); Rewind restarts it when the breaker
// closes.
func (r *Ramp) Collapse() {
	r.mu.Lock()
	defer r.mu.Unlock()
	failed := r.limit()
	if r.settling && r.ceiling > failed {
		failed = r.ceiling
	}
	if len(r.steps) == 0 || failed <= 1 {
		r.restart()
		return
	}
	backoffs := min(r.backoffs+1, MaxBackoffs)
	r.restart()
	r.ceiling, r.backoffs = failed, backoffs
	if failed <= r.steps[0] {
		r.below = powerOfTwoBelow(failed)
	}
}

// powerOfTwoBelow is the highest power of two below n (n >= 2): the limit
// below the first step that a step back or a collapse at n goes to.
func powerOfTwoBelow(n int64) int64 {
	p := int64(1)
	for p*2 < n {
		p *= 2
	}
	return p
}
