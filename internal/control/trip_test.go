package control

import (
	"strings"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// tripAt is what release.lua writes over the published state prev when the
// workers trip the breaker at at (lib.lua trip): Open, limit 0, open until
// at + openDuration, the trip and the state it replaced.
func tripAt(prev protocol.Published, at time.Time) protocol.Published {
	tripped := prev
	tripped.State, tripped.Limit = wire.Open, 0
	tripped.OpenUntil = at.Add(prev.Trip.OpenDuration)
	tripped.TrippedAt, tripped.TrippedFrom = at, prev.State
	tripped.TripCount++
	tripped.TrippedLimit, tripped.TrippedEpoch = prev.Limit, prev.Epoch
	return tripped
}

// failing is a window that crosses the seed's breaker rule (ratio 0.5, 20
// calls).
var failing = protocol.Window{Calls: 24, Successes: 4, Failures: 20}

// TestPlanTakesOverATrip: a trip the workers made between two evaluations is
// the next plan's breaker transition, exactly as if the controller had opened
// the breaker itself at the trip's instant: the plan made from the tripped
// state at a later Now publishes what a plan made from the state before the
// trip, at the trip's time, with a failing window, publishes (the ramp
// collapsed or restarted, the outage and openDuration counted from the trip,
// the next epoch), but acknowledges the trip and reports it as one. The
// breaker half-opens openDuration after the trip, not after the take-over.
func TestPlanTakesOverATrip(t *testing.T) {
	tests := []struct {
		name string
		// to brings the evaluator to the state the workers trip.
		to        func(t *testing.T, e *evaluator)
		from      wire.State
		collapsed bool
	}{
		{
			name: "closed at full capacity",
			to: func(t *testing.T, e *evaluator) {
				runSteps(t, e, []step{{name: "closed", state: wire.Closed, limit: 40, epoch: 1}})
			},
			from: wire.Closed,
		},
		{
			name: "ramping: the ramp collapses",
			to: func(t *testing.T, e *evaluator) {
				toRamping(t, e, 5)
				runSteps(t, e, []step{{name: "a clean minute", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}}})
			},
			from:      wire.Ramping,
			collapsed: true,
		},
		{
			name: "closed right after the ramp: the ramp collapses",
			to: func(t *testing.T, e *evaluator) {
				toRamping(t, e, 5)
				for _, limit := range []int64{10, 20} {
					runSteps(t, e, []step{{name: "clean minute", advance: time.Minute, window: healthy, state: wire.Ramping, limit: limit, epoch: 4, events: []string{EventRampStep}}})
				}
				runSteps(t, e, []step{{name: "ramp done", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5, events: []string{EventRampStep}}})
			},
			from:      wire.Closed,
			collapsed: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEvaluator()
			tt.to(t, e)
			prev := e.pub
			if !prev.Trip.On || prev.Trip.FailureRatio != 0.5 || prev.Trip.MinCalls != 20 || prev.Trip.OpenDuration != time.Minute {
				t.Fatalf("the plan before the trip publishes the rule %+v, want on, 0.5 over 20 calls, open 1m", prev.Trip)
			}
			at := e.now.Add(400 * time.Millisecond)

			ref := Plan(Input{Params: e.params, Previous: prev, Window: failing, Now: at})
			tripped := tripAt(prev, at)
			got := Plan(Input{Params: e.params, Previous: tripped, Window: failing, Now: at.Add(700 * time.Millisecond)})

			if len(got.Transitions) != 1 {
				t.Fatalf("transitions %+v, want one", got.Transitions)
			}
			tr := got.Transitions[0]
			if tr.Reason != EventOpened || tr.From != tt.from || tr.To != wire.Open || !strings.Contains(tr.Message, "tripped the breaker in the fleet's path 700ms before this evaluation") {
				t.Errorf("transition %+v, want Opened from %s to Open, reported as the workers' trip 700ms ago", tr, tt.from)
			}
			n := got.Next
			if n.State != wire.Open || n.Limit != 0 || n.Epoch != prev.Epoch+1 {
				t.Errorf("published %s, limit %d, epoch %d; want Open, 0, %d", n.State, n.Limit, n.Epoch, prev.Epoch+1)
			}
			if !n.BreakerSince.Equal(at) || !n.OpenUntil.Equal(at.Add(time.Minute)) || !n.OutageSince.Equal(at) {
				t.Errorf("since %v, open until %v, outage since %v; want the trip %v and the trip + 1m", n.BreakerSince, n.OpenUntil, n.OutageSince, at)
			}
			if (n.RampCeiling > 0) != tt.collapsed {
				t.Errorf("ramp ceiling %d: collapsed %v, want %v", n.RampCeiling, n.RampCeiling > 0, tt.collapsed)
			}
			if n.Trip.On || !n.Trip.Acknowledged.Equal(at) || n.Trip.AcknowledgedCount != tripped.TripCount {
				t.Errorf("trip %+v, want off (Open) and acknowledging %v, trip %d", n.Trip, at, tripped.TripCount)
			}
			want := ref.Next
			want.Trip.Acknowledged, want.Trip.AcknowledgedCount = at, tripped.TripCount
			if n != want {
				t.Errorf("the take-over publishes\n%+v\nthe controller's own opening at the trip\n%+v", n, want)
			}

			// What follows is the controller's, from the trip's time.
			e.pub, e.now = n, at.Add(time.Minute-time.Millisecond)
			runSteps(t, e, []step{
				{name: "open until the trip + openDuration", state: wire.Open, limit: 0, epoch: n.Epoch},
				{name: "half-open at the trip + openDuration", advance: time.Millisecond, state: wire.HalfOpen, limit: 3, epoch: n.Epoch + 1, events: []string{EventHalfOpened}},
			})
			if !e.pub.Trip.Acknowledged.Equal(at) || e.pub.Trip.On {
				t.Errorf("half-open: trip %+v, want off, still acknowledging %v", e.pub.Trip, at)
			}
		})
	}
}

// TestPlanIgnoresAcknowledgedTrips: a trip a plan has taken over is not taken
// over again, and a trip over a state no trip can replace is acknowledged
// (so that publish accepts the plan) but changes nothing.
func TestPlanIgnoresAcknowledgedTrips(t *testing.T) {
	e := newEvaluator()
	runSteps(t, e, []step{{name: "closed", state: wire.Closed, limit: 40, epoch: 1}})
	at := e.now.Add(time.Second)
	e.now = at.Add(time.Second)
	e.pub = tripAt(e.pub, at)
	runSteps(t, e, []step{
		{name: "take-over", state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}},
		{name: "no second take-over", advance: time.Second, state: wire.Open, limit: 0, epoch: 2},
	})
	if !e.pub.BreakerSince.Equal(at) {
		t.Errorf("breaker since %v, want the trip %v", e.pub.BreakerSince, at)
	}

	half := e.pub
	half.State, half.TrippedAt, half.TrippedFrom = wire.HalfOpen, at.Add(time.Hour), wire.HalfOpen
	out := Plan(Input{Params: e.params, Previous: half, Now: e.now})
	if len(out.Transitions) != 0 || out.Next.State != wire.HalfOpen || !out.Next.Trip.Acknowledged.Equal(half.TrippedAt) {
		t.Errorf("a trip recorded over HalfOpen: %+v, state %s, acknowledged %v; want nothing taken over, acknowledged", out.Transitions, out.Next.State, out.Next.Trip.Acknowledged)
	}
}

// TestPlanPublishesTheTripRule: the workers may trip while the published
// state is Closed or Ramping and the breaker's rule alone decides, counting
// from the window start the evaluator reads (one second early); not while
// Open or HalfOpen, nor while the step-back rule judges the ramp's step.
func TestPlanPublishesTheTripRule(t *testing.T) {
	never := newEvaluator()
	runSteps(t, never, []step{{name: "closed", state: wire.Closed, limit: 40, epoch: 1}})
	checkTrip(t, "closed", never, true)
	runSteps(t, never, []step{{name: "open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}}})
	checkTrip(t, "open", never, false)
	runSteps(t, never, []step{{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 3, events: []string{EventHalfOpened}}})
	checkTrip(t, "half-open", never, false)
	runSteps(t, never, []step{{name: "close", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventClosed}}})
	checkTrip(t, "ramping, no step-back rule", never, true)
	if want := never.now.Add(-time.Second); !never.pub.Trip.Since.Equal(want) {
		t.Errorf("ramping: the trip counts after %v, want a second before the close, %v", never.pub.Trip.Since, want)
	}

	judged := listening(ramp.Ramping, 40)
	runSteps(t, judged, []step{{name: "closed, ramp done long ago", state: wire.Closed, limit: 40, epoch: 1}})
	checkTrip(t, "closed, step-back rule only while ramping", judged, true)
	judged = newListening(judged)
	toRamping(t, judged, 5)
	checkTrip(t, "ramping, step-back rule judging", judged, false)
	for _, limit := range []int64{10, 20} {
		runSteps(t, judged, []step{{name: "clean minute", advance: time.Minute, window: healthy, state: wire.Ramping, limit: limit, epoch: 4, events: []string{EventRampStep}}})
	}
	runSteps(t, judged, []step{{name: "ramp done", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5, events: []string{EventRampStep}}})
	checkTrip(t, "the last step's first stepDuration, judged", judged, false)
	runSteps(t, judged, []step{{name: "a stepDuration at full capacity", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5}})
	checkTrip(t, "after it", judged, true)

	always := listening(ramp.Always, 40)
	runSteps(t, always, []step{{name: "closed", state: wire.Closed, limit: 40, epoch: 1}})
	checkTrip(t, "closed, step-back rule always on", always, false)
}

// newListening is a fresh evaluator with e's parameters.
func newListening(e *evaluator) *evaluator {
	n := newEvaluator()
	n.params = e.params
	n.pub = Restore(n.params, "", 0, time.Time{}, t0)
	return n
}

// checkTrip checks the trip rule e last published: on or off as want, and
// when on, the policy's breaker rule from the window start the evaluator
// reads.
func checkTrip(t *testing.T, name string, e *evaluator, on bool) {
	t.Helper()
	tr := e.pub.Trip
	if tr.On != on {
		t.Errorf("%s: trip on %v, want %v", name, tr.On, on)
		return
	}
	if tr.FailureRatio != e.params.Breaker.FailureRatio || tr.MinCalls != e.params.Breaker.MinCalls || tr.OpenDuration != e.params.Breaker.OpenDuration {
		t.Errorf("%s: trip rule %+v, want the policy's breaker", name, tr)
	}
	if want := WindowStart(e.params, e.pub, e.now).Add(-time.Second); on && !tr.Since.Equal(want) {
		t.Errorf("%s: trip counts after %v, want the evaluator's window start %v", name, tr.Since, want)
	}
}

// TestTrip: the in-path trip as the simulator makes it (control.Trip, the Go
// statement of lib.lua trip): only with the rule on, only from Closed or
// Ramping, only when the window crosses breaker.Config.Trips (timeouts count
// as failures); it writes what release.lua writes (tripAt) at the
// millisecond, and extends the dead-man bound by the time since the
// publication plus openDuration.
func TestTrip(t *testing.T) {
	e := newEvaluator()
	runSteps(t, e, []step{{name: "closed", state: wire.Closed, limit: 40, epoch: 1}})
	closed := e.pub
	closed.UpdatedAt = e.now
	at := e.now.Add(1500*time.Millisecond + 300*time.Microsecond)
	ramping := closed
	ramping.State = wire.Ramping
	off := closed
	off.Trip.On = false
	half := closed
	half.State = wire.HalfOpen
	stale := closed
	stale.StaleAfter = 30 * time.Second

	tests := []struct {
		name   string
		pub    protocol.Published
		window protocol.Window
		trips  bool
	}{
		{"closed, crossing", closed, failing, true},
		{"ramping, crossing", ramping, failing, true},
		{"timeouts count as failures", closed, protocol.Window{Calls: 20, Successes: 10, Failures: 4, Timeouts: 6}, true},
		{"at the ratio, below minCalls", closed, protocol.Window{Calls: 19, Failures: 19}, false},
		{"minCalls, just below the ratio", closed, protocol.Window{Calls: 21, Successes: 11, Failures: 10}, false},
		{"rule off", off, failing, false},
		{"half-open", half, failing, false},
		{"dead-man bound extended", stale, failing, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := Trip(tt.pub, tt.window, at)
			if ok != tt.trips {
				t.Fatalf("tripped %v, want %v", ok, tt.trips)
			}
			if !ok {
				if got != tt.pub {
					t.Errorf("no trip changed the state: %+v", got)
				}
				return
			}
			want := tripAt(tt.pub, at.Truncate(time.Millisecond))
			if tt.pub.StaleAfter > 0 {
				want.StaleAfter = 1500*time.Millisecond + tt.pub.StaleAfter + tt.pub.Trip.OpenDuration
			}
			if got != want {
				t.Errorf("tripped\n%+v\nwant\n%+v", got, want)
			}
		})
	}
}
