package control

import (
	"fmt"
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The in-path trip: the workers' release opens a Closed or Ramping breaker as
// soon as the failures they report cross breaker.Config.Trips
// (docs/protocol.md, lib.lua trip), between two evaluations. Plan publishes
// the rule with every state (tripFor), and takes a trip over at the next
// evaluation (pendingTrip): from there on the breaker, the ramp, the Events
// and the epochs are the controller's, as for an opening it decided itself.

// pendingTrip reports a trip the controller has not taken over yet
// (protocol.Published.TripPending: a TrippedAt after the last one a plan
// acknowledged, or a trip count above the one it acknowledged), from a state
// a trip can replace (the trip wrote Open over it).
func pendingTrip(prev protocol.Published) (time.Time, bool) {
	if prev.TrippedAt.IsZero() || !prev.TripPending() {
		return time.Time{}, false
	}
	if prev.TrippedFrom != wire.Closed && prev.TrippedFrom != wire.Ramping {
		return time.Time{}, false
	}
	return prev.TrippedAt, true
}

// beforeTrip is prev as the controller last published it, when a trip is
// pending: the state the trip replaced. The trip writes only the state, the
// limit, open_until_ms, the dead-man bound and its own fields; the
// controller's memory (ctrl_*) is the plan's from before the trip.
func beforeTrip(prev protocol.Published) protocol.Published {
	if _, ok := pendingTrip(prev); ok {
		prev.State = prev.TrippedFrom
		prev.OpenUntil = time.Time{}
	}
	return prev
}

// tripFor is the trip's part of the publication next, planned at now with
// the ramp r: the breaker's rule, where the window the evaluator will read
// starts (WindowStart, one second early as the evaluator reads it, so that
// the script counts the very seconds ReadWindow does), and whether the
// workers may trip at all. They may while the published state is Closed or
// Ramping and the breaker's rule alone decides whether it opens: not while
// the ramp's step-back rule judges the step (it steps back a partial failure
// instead of opening the breaker, and a settling step's window counts for
// nothing). The acknowledgement is filled by Plan.
func tripFor(p policy.Params, next protocol.Published, r *ramp.Ramp, now time.Time) protocol.Trip {
	t := protocol.Trip{
		FailureRatio: p.Breaker.FailureRatio,
		MinCalls:     p.Breaker.MinCalls,
		OpenDuration: p.Breaker.OpenDuration,
	}
	if (next.State == wire.Closed || next.State == wire.Ramping) && !judged(p, r, now) {
		t.On = true
		t.Since = WindowStart(p, next, now).Add(-time.Second)
	}
	return t
}

// tripMessage is the Event message of a trip the plan took over.
func tripMessage(p policy.Params, at, now time.Time, window breaker.Counts) string {
	return fmt.Sprintf("The workers' failures reached failure ratio %.2f over at least %d calls and tripped the breaker in the fleet's path %v before this evaluation (%d of %d calls failed or timed out in the window): breaker opened, limit 0 for %v",
		p.Breaker.FailureRatio, p.Breaker.MinCalls, now.Sub(at).Round(time.Millisecond), window.Failures, window.Calls, p.Breaker.OpenDuration)
}

// Trip is the in-path trip as the workers' scripts make it (lib.lua trip),
// stated in Go for the simulator: when pub lets the workers trip (Trip.On,
// Closed or Ramping) and window, the outcomes counted from Trip.Since as
// window.lua counts them, crosses the breaker's rule (breaker.Config.Trips,
// failures and timeouts over calls), the published state becomes Open at
// now: limit 0, OpenUntil now + Trip.OpenDuration, the trip and the state it
// replaced recorded, the dead-man bound extended as for an Open the
// controller publishes; the epoch and the sequence are kept. It reports
// whether it tripped; pub is returned unchanged when not.
func Trip(pub protocol.Published, window protocol.Window, now time.Time) (protocol.Published, bool) {
	if !pub.Trip.On || (pub.State != wire.Closed && pub.State != wire.Ramping) {
		return pub, false
	}
	rule := breaker.Config{FailureRatio: pub.Trip.FailureRatio, MinCalls: pub.Trip.MinCalls}
	if !rule.Trips(breaker.Counts{Calls: window.Calls, Failures: window.Failures + window.Timeouts}) {
		return pub, false
	}
	// Redis keeps milliseconds.
	now = now.Truncate(time.Millisecond)
	tripped := pub
	tripped.State, tripped.Limit = wire.Open, 0
	tripped.OpenUntil = now.Add(pub.Trip.OpenDuration)
	tripped.TrippedAt, tripped.TrippedFrom = now, pub.State
	tripped.TripCount++
	tripped.TrippedLimit, tripped.TrippedEpoch = pub.Limit, pub.Epoch
	if pub.StaleAfter > 0 && !pub.UpdatedAt.IsZero() {
		tripped.StaleAfter = now.Sub(pub.UpdatedAt) + pub.StaleAfter + pub.Trip.OpenDuration
	}
	return tripped, true
}
