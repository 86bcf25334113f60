package control

import (
	"fmt"
	"math"
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Signal is an error ratio measured outside the fleet (the policy's
// Prometheus query), as Plan takes it. The controller measures it; Plan only
// reads the value, so the rule that combines it with the workers' outcomes
// is pure and shared with the simulator.
type Signal struct {
	// Valid is true when the controller holds a sample from its last query.
	// It is false when the policy names no external signal, and when the
	// last query failed or returned no data: an invalid signal is ignored,
	// so a failing query never opens the breaker by itself.
	Valid bool
	// Ratio is the dependency's error ratio, in [0, 1] (values outside are
	// clamped).
	Ratio float64
	// Calls is the number of requests the ratio covers (request rate ×
	// breaker window), or -1 when unknown (no rate query), in which case the
	// ratio counts whatever the traffic.
	Calls int64
	// Age is how long before Plan's Now the sample was measured. Plan adds
	// it to its own Now (Redis's time), so the controller's clock and
	// Prometheus's never need to agree.
	Age time.Duration
}

// CallsOver is the number of calls a request rate (per second) stands for
// over window, rounded to the nearest call; a negative or NaN rate is
// unknown (-1).
func CallsOver(ratePerSecond float64, window time.Duration) int64 {
	if math.IsNaN(ratePerSecond) || ratePerSecond < 0 {
		return -1
	}
	return int64(math.Round(math.Min(ratePerSecond*window.Seconds(), math.MaxInt32)))
}

// verdict is what an external signal says about the dependency.
type verdict int

const (
	// verdictNone: the signal says nothing: invalid, too old, too little
	// traffic, or a state that does not read it.
	verdictNone verdict = iota
	// verdictFailing: the ratio is at or above breaker.failureRatio.
	verdictFailing
	// verdictHealthy: the ratio is below breaker.failureRatio (read only
	// while HalfOpen, where it counts as successful probes).
	verdictHealthy
)

// withSignal folds an external signal into the counts the breaker
// evaluates, so that the breaker's own arithmetic decides and the breaker
// opens on either signal:
//
//   - Closed: the signal counts only when its sample was measured one
//     breaker window or more after the breaker's last transition: the query
//     is written over the breaker window, and errors from before the breaker
//     closed must not reopen it, as for the workers' window.
//   - HalfOpen: the signal counts once its sample was measured after the
//     breaker half-opened. Its window may still hold the end of the outage:
//     that can only reopen the breaker once more, never close it early, and
//     waiting for a whole clean window would let openDuration (which reopens
//     a half-open breaker that got no probes) expire first when it is the
//     shorter.
//   - Closed: a ratio at or above breaker.failureRatio, over at least
//     breaker.minCalls calls (or an unknown count), opens the breaker:
//     window becomes at least minCalls calls, all failed.
//   - HalfOpen: a ratio at or above failureRatio over at least one call (or
//     an unknown count) is a failed probe, and reopens it; a ratio below it
//     over at least breaker.halfOpenProbes calls (or an unknown count), with
//     no failed worker probe, counts as halfOpenProbes successful probes and
//     closes it. A fleet without the library reports no probes, so this is
//     how its breaker closes: the fleet, held at the size of the ramp's first
//     step, is its own probe.
//   - Open: the signal is ignored; the breaker half-opens after
//     openDuration as always.
//
// An invalid signal leaves the counts alone.
func withSignal(p policy.Params, snap breaker.Snapshot, now time.Time, window, probes breaker.Counts, s Signal) (breaker.Counts, breaker.Counts, verdict) {
	if !s.Valid {
		return window, probes, verdictNone
	}
	measured := now.Add(-max(s.Age, 0))
	fresh := measured.Sub(snap.Since) >= p.Breaker.Window
	if snap.State == wire.HalfOpen {
		fresh = measured.After(snap.Since)
	}
	if !fresh {
		return window, probes, verdictNone
	}
	ratio := min(max(s.Ratio, 0), 1)
	failing := ratio >= p.Breaker.FailureRatio
	enough := func(n int64) bool { return s.Calls < 0 || s.Calls >= max(n, 1) }
	switch snap.State {
	case wire.Closed:
		if failing && enough(p.Breaker.MinCalls) {
			n := max(window.Calls, p.Breaker.MinCalls, 1)
			return breaker.Counts{Calls: n, Failures: n}, probes, verdictFailing
		}
	case wire.HalfOpen:
		switch {
		case failing && enough(1):
			return window, breaker.Counts{Calls: probes.Calls + 1, Failures: probes.Failures + 1}, verdictFailing
		case !failing && probes.Failures == 0 && enough(p.Breaker.HalfOpenProbes):
			return window, breaker.Counts{Calls: max(probes.Calls, p.Breaker.HalfOpenProbes, 1)}, verdictHealthy
		}
	}
	return window, probes, verdictNone
}

// decidedBySignal reports whether the external signal made transition t:
// the workers' counts alone, evaluated by the same breaker from the same
// snapshot, would not have made it.
func decidedBySignal(p policy.Params, snap breaker.Snapshot, clk fixedClock, window, probes breaker.Counts, t breaker.Transition) bool {
	alone, ok := breaker.Restore(p.Breaker, clk, snap).Evaluate(window, probes)
	return !ok || alone.To != t.To
}

// signalMessage is the Event message of a transition the external signal
// made.
func signalMessage(p policy.Params, t breaker.Transition, s Signal, r *ramp.Ramp) string {
	over := "an unknown number of calls"
	if s.Calls >= 0 {
		over = fmt.Sprintf("about %d calls", s.Calls)
	}
	measured := fmt.Sprintf("Prometheus error ratio %.2f over %s (failure ratio %.2f)", s.Ratio, over, p.Breaker.FailureRatio)
	switch {
	case t.To == wire.Open && t.From == wire.HalfOpen:
		return fmt.Sprintf("%s while half-open: breaker reopened, limit 0 for %v", measured, p.Breaker.OpenDuration)
	case t.To == wire.Open:
		return fmt.Sprintf("%s: breaker opened, limit 0 for %v", measured, p.Breaker.OpenDuration)
	case r.Done():
		return fmt.Sprintf("%s while half-open: breaker closed, limit %d (full capacity)", measured, r.Limit())
	}
	return fmt.Sprintf("%s while half-open: breaker closed, ramping from limit %d (step 1 of %d)",
		measured, r.Limit(), len(p.Ramp.Steps))
}
