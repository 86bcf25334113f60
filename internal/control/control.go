// Package control is Spillway's control law: from what workers reported and
// what was last published, what to publish next. It is pure (its inputs are
// values and a time, its output a value) and shared by the controller's
// evaluator, which reads its inputs from Redis and publishes its output, and
// by the simulator (internal/sim), which runs it on virtual time. The
// arithmetic is internal/breaker's and internal/ramp's; this package combines
// it into the published state of docs/protocol.md.
package control

import (
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Event reasons of the transitions Plan reports. Reconcile emits each as a
// Kubernetes Event on the DependencyPolicy.
const (
	// EventOpened: the breaker opened; the limit is 0.
	EventOpened = "Opened"
	// EventHalfOpened: the breaker half-opened; only probe calls are admitted.
	EventHalfOpened = "HalfOpened"
	// EventClosed: the probes succeeded and the breaker closed; the ramp starts.
	EventClosed = "Closed"
	// EventRampStep: the ramp moved up one step, or completed.
	EventRampStep = "RampStep"
	// EventRampStepBack: the current step failed more than the ramp's
	// step-back rule allows (ramp.StepBack) and the ramp stepped back.
	EventRampStepBack = "RampStepBack"
)

// Input is everything Plan decides from. The evaluator reads it all before
// calling Plan: Previous from Redis (or Restore), Window and Probes with
// ReadWindow from WindowStart(Params, Previous, Now).
type Input struct {
	Params policy.Params
	// Previous is the state Redis holds, as read: after a trip the workers
	// made in the fleet's path, Open with the trip's TrippedAt and
	// TrippedFrom, which Plan takes over.
	Previous protocol.Published
	Window   protocol.Window
	Probes   protocol.Probes
	// Now is Redis's time: the scripts compare what Plan publishes with it.
	Now time.Time
	// StaleAfter is the dead-man bound to publish (StaleAfter); 0 turns the
	// rule off.
	StaleAfter time.Duration
	// External is the error ratio measured outside the fleet (a Prometheus
	// query), combined with Window and Probes by withSignal; the zero Signal
	// is none.
	External Signal
}

// Transition is one change Plan made, for an Event and the metrics.
type Transition struct {
	// Reason is one of EventOpened, EventHalfOpened, EventClosed,
	// EventRampStep and EventRampStepBack.
	Reason string
	// From and To are the published states; they are equal for a ramp step
	// inside Ramping.
	From, To wire.State
	// Message says what happened, for the Event.
	Message string
}

// Output is what Plan decided.
type Output struct {
	// Next is what to publish.
	Next protocol.Published
	// Transitions are the changes from Previous, at most one breaker
	// transition or one ramp step.
	Transitions []Transition
}

// fixedClock is the instant a plan is made at: a clock.Clock that stands
// still.
type fixedClock time.Time

func (c fixedClock) Now() time.Time { return time.Time(c) }

// Plan steps the breaker and the ramp once and computes what to publish. It is
// pure: everything comes from in, and the same input always gives the same
// output.
//
// The breaker counts failures and timeouts as failures. When the breaker
// closes, the ramp restarts from its first step (it is also reset when the
// breaker opens, so status shows step 0 through an outage); while the breaker
// stays closed the ramp moves at most one step per evaluation. With the
// ramp's step-back rule on (ramp.StepBack), the window is the current step's
// (WindowStart) and the rule judges it: Back steps back (Ramp.StepBack),
// Hold keeps the step, Clean lets it climb once it has lasted its hold time,
// or earlier once its own calls prove it clean (StepBack.ProvenClean) and it
// has lasted Schedule.Settle, unless the next limit is at or above the
// ceiling (Ramp.AdvanceEarly);
// while the step is settling after a step back, nothing is judged and the
// window counts for neither the rule nor the breaker. A step the rule steps
// back from while at least MinFailures of its calls succeeded is a partial
// failure: it steps back instead of opening the breaker, unless the limit is
// already 1. The published
// state is the breaker's, except Ramping while the breaker is closed and the
// ramp is not done. The limit is 0 when Open, breaker.halfOpenProbes when
// HalfOpen, the ramp's step when Ramping and the capacity when Closed. The
// epoch increases by one whenever the published state changes, so that probe
// outcomes count only for the HalfOpen epoch that admitted them, and on the
// first publication (Previous.Epoch 0).
//
// An external signal (Input.External) opens the breaker as the workers'
// outcomes do, and while half-open it can fail or pass the probes
// (withSignal); an invalid one is ignored.
//
// A trip the workers made in the fleet's path since the last plan
// (Previous.TrippedAt after Previous.Trip.Acknowledged: release.lua wrote
// Open over the Closed or Ramping in Previous.TrippedFrom) is taken over as
// the plan's one breaker transition: the breaker opens as of TrippedAt
// (breaker.Breaker.Tripped; openDuration counts from the trip), the ramp
// collapses or restarts as for any opening, the outage starts at the trip,
// the Opened transition is reported and the next epoch published. Next
// acknowledges the trip (Trip.Acknowledged), so publish accepts it, and
// carries the rule the workers trip by until the next plan (tripFor).
//
// Next carries Previous.Seq, the sequence number of the state the plan was
// made from, which fences the publication (protocol.Published.Seq), and the
// dead-man rule's fields: the policy's halfOpenProbes, and StaleAfter, which
// for an Open state is extended by the time left until OpenUntil, so that the
// rule never lets probes through before the breaker would have.
func Plan(in Input) Output {
	clk := fixedClock(in.Now)
	trippedAt, tripped := pendingTrip(in.Previous)
	prev := beforeTrip(in.Previous)
	restoreAt := clk
	if tripped {
		// The trip is the breaker's transition, made at its own time: the
		// breaker and the ramp move as they would have, had the controller
		// opened the breaker then.
		if trippedAt.After(in.Now) {
			trippedAt = in.Now
		}
		restoreAt = fixedClock(trippedAt)
	}
	b, r := restore(in.Params, prev, restoreAt)

	window := breaker.Counts{
		Calls:    in.Window.Calls,
		Failures: in.Window.Failures + in.Window.Timeouts,
	}
	probes := breaker.Counts{
		Calls:    in.Probes.Successes + in.Probes.Failures + in.Probes.Timeouts,
		Failures: in.Probes.Failures + in.Probes.Timeouts,
	}

	sb := in.Params.Ramp.StepBack
	if prev.State == wire.Ramping && judged(in.Params, r, in.Now) && in.Now.Before(settledAt(in.Params, r)) {
		window = breaker.Counts{}
	}

	// The step-back rule's verdict on the current step, from the workers'
	// outcomes. A step that fails while the dependency still serves part of
	// its calls (at least MinFailures successes) is a partial failure: the
	// ramp steps back instead of the breaker opening, as long as there is a
	// lower limit to step back to and no external signal says the
	// dependency is failing. Fast rejections (a shedding or overloaded
	// dependency's 503s) can fail most calls of a step above the cold
	// capacity while it serves the rest; opening the breaker would drop the
	// limit to 0 and start the ramp again at the same step.
	verdict := ramp.Clean
	if b.State() == wire.Closed && judged(in.Params, r, in.Now) {
		verdict = sb.Judge(window.Calls, window.Failures)
	}

	before := b.Snapshot()
	counted, countedProbes, v := withSignal(in.Params, before, in.Now, window, probes, in.External)
	partial := verdict == ramp.Back && window.Calls-window.Failures >= sb.MinFailures && r.Limit() > 1 && v != verdictFailing

	var transitions []Transition
	outageSince := prev.OutageSince
	t, ok := breaker.Transition{}, false
	if tripped {
		t, ok = b.Tripped(trippedAt)
	} else {
		t, ok = evaluateBreaker(b, counted, countedProbes, partial)
	}
	if ok {
		warm := false
		switch {
		case t.To == wire.Open && t.From == wire.Closed:
			outageSince = t.At
			if collapsed(in.Params, prev, r, t.At) {
				r.Collapse()
			} else {
				r.Restart()
			}
		case t.To == wire.Closed:
			warm = isWarm(in.Params, outageSince, r, in.Now)
			switch {
			case warm:
				r.Skip()
			case r.Ceiling() > 0:
				r.Rewind()
			default:
				r.Restart()
			}
		}
		state := publishedState(b.State(), r)
		msg := breakerMessage(in.Params, t, window, probes, r)
		if warm {
			msg = warmMessage(in.Params, probes, in.Now.Sub(outageSince), r)
		}
		switch {
		case tripped:
			msg = tripMessage(in.Params, t.At, in.Now, window)
		case v != verdictNone && decidedBySignal(in.Params, before, clk, window, probes, t):
			msg = signalMessage(in.Params, t, in.External, r)
		}
		transitions = append(transitions, Transition{
			Reason:  breakerReason(t.To),
			From:    prev.State,
			To:      state,
			Message: msg,
		})
	} else if b.State() == wire.Closed {
		from := r.Limit()
		switch {
		case verdict == ramp.Back && r.StepBack():
			transitions = append(transitions, Transition{
				Reason:  EventRampStepBack,
				From:    prev.State,
				To:      publishedState(b.State(), r),
				Message: stepBackMessage(in.Params, window, from, r),
			})
		case verdict == ramp.Clean && (r.Advance() || in.Params.Ramp.EarlyClimb && sb.ProvenClean(window.Calls, window.Failures) && r.AdvanceEarly(in.Params.Ramp.Settle())):
			transitions = append(transitions, Transition{
				Reason:  EventRampStep,
				From:    prev.State,
				To:      publishedState(b.State(), r),
				Message: rampMessage(in.Params, r),
			})
		}
	}

	snap := b.Snapshot()
	rs := r.Snapshot()
	next := protocol.Published{
		State:           publishedState(snap.State, r),
		Capacity:        in.Params.Capacity,
		RatePerSecond:   in.Params.RatePerSecond,
		Epoch:           prev.Epoch,
		Backoff:         in.Params.Backoff,
		Budget:          in.Params.Budget,
		BreakerWindow:   in.Params.Breaker.Window,
		BreakerSince:    snap.Since,
		RampStep:        rs.Step,
		RampStepStarted: rs.StepStarted,
		RampLimit:       rs.Limit,
		RampCeiling:     rs.Ceiling,
		RampBackoffs:    rs.Backoffs,
		RampSettling:    rs.Settling,
		HalfOpenProbes:  in.Params.Breaker.HalfOpenProbes,
		StaleAfter:      in.StaleAfter,
		OutageSince:     outageSince,
		SuccessLatency:  prev.SuccessLatency,
		Seq:             prev.Seq,
	}
	if l := in.Window.MeanSuccessLatency(); l > 0 {
		next.SuccessLatency = l
	}
	next.Limit = Limit(in.Params, next.State, r.Limit())
	next.RatePerSecond = RateBound(in.Params, rateBounded(in.Params, next.State, r, in.Now), next.Limit, next.SuccessLatency)
	if next.State == wire.Open {
		next.OpenUntil = snap.Since.Add(in.Params.Breaker.OpenDuration)
		if next.StaleAfter > 0 {
			next.StaleAfter += max(next.OpenUntil.Sub(in.Now), 0)
		}
	}
	if prev.Epoch == 0 || next.State != prev.State {
		next.Epoch++
	}
	next.Trip = tripFor(in.Params, next, r, in.Now)
	next.Trip.Acknowledged = in.Previous.TripSeen()
	next.Trip.AcknowledgedCount = in.Previous.TripsSeen()
	return Output{Next: next, Transitions: transitions}
}

// WindowStart is where the evaluator starts counting the window Plan reads:
// max(now - breaker window, the breaker's last transition), so failures from
// before the breaker last closed never reopen it. While the step-back rule
// judges a step of the ramp (Ramping, and the first StepDuration at full
// capacity), the window is also the step's: it starts no earlier than the
// step did, and, for a step entered by a step back, than the end of its
// settling (Schedule.Settle), so every step is judged on its own outcomes
// only.
func WindowStart(p policy.Params, prev protocol.Published, now time.Time) time.Time {
	prev = beforeTrip(prev)
	b, r := restore(p, prev, fixedClock(now))
	start := b.WindowStart()
	if (prev.State == wire.Ramping || prev.State == wire.Closed) && judged(p, r, now) {
		start = later(start, r.Started())
		if r.Settling() {
			start = later(start, settledAt(p, r))
		}
	}
	return start
}

// evaluateBreaker is b.Evaluate, except that a partial failure the ramp steps
// back from does not open a closed breaker.
func evaluateBreaker(b *breaker.Breaker, window, probes breaker.Counts, partial bool) (breaker.Transition, bool) {
	if partial && b.State() == wire.Closed {
		return breaker.Transition{}, false
	}
	return b.Evaluate(window, probes)
}

// judged reports whether the step-back rule judges the ramp's current step at
// now: with Always, every step; with Ramping, every step but full
// capacity once it has lasted a StepDuration, so that the step up to full
// capacity is judged like the others.
func judged(p policy.Params, r *ramp.Ramp, now time.Time) bool {
	switch p.Ramp.StepBack.When {
	case ramp.Always:
		return true
	case ramp.Ramping:
		return !r.Done() || justRamped(p, r, now)
	}
	return false
}

// justRamped reports whether the ramp reached full capacity less than a
// StepDuration ago: its last step, judged like the others (judged), where a
// collapse is still the ramp's (collapsed) and the call rate is still
// bounded (rateBounded).
func justRamped(p policy.Params, r *ramp.Ramp, now time.Time) bool {
	return r.Done() && now.Sub(r.Started()) < p.Ramp.StepDuration
}

// settledAt is when the current step's settling ends: its start, plus
// Schedule.Settle for a step entered by a step back.
func settledAt(p policy.Params, r *ramp.Ramp) time.Time {
	if !r.Settling() {
		return r.Started()
	}
	return r.Started().Add(p.Ramp.Settle())
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// PinsMinReplicas reports whether a policy that pins (spec
// pinMinReplicasDuringOutage) holds its consumers' minimum replicas in state:
// through Open and HalfOpen, so the autoscaler does not scale in while
// throttled workers look idle, and through Ramping, so the fleet that the ramp
// gives slots to is still there; it lets go once Closed at full capacity.
func PinsMinReplicas(p policy.Params, state wire.State) bool {
	return p.PinMinReplicas && (state == wire.Open || state == wire.HalfOpen || state == wire.Ramping)
}

// Limit is the fleet-wide concurrency limit in state: 0 when Open,
// breaker.halfOpenProbes when HalfOpen, rampLimit when Ramping and the
// capacity when Closed.
func Limit(p policy.Params, state wire.State, rampLimit int64) int64 {
	switch state {
	case wire.Open:
		return 0
	case wire.HalfOpen:
		return p.Breaker.HalfOpenProbes
	case wire.Ramping:
		return rampLimit
	}
	return p.Capacity
}

// publishedState is Ramping for a closed breaker whose ramp is not done, and
// the breaker's state otherwise.
func publishedState(s wire.State, r *ramp.Ramp) wire.State {
	if s == wire.Closed && !r.Done() {
		return wire.Ramping
	}
	return s
}
