package sim

import (
	"slices"
	"time"

	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// controller is the Spillway controller and the part of Redis it talks
// through, on virtual time. Every second it runs the control law
// (internal/control, the evaluator's Plan) on the window read the way
// window.lua reads it, and publishes the plan. Admission follows
// acquire.lua (Open admits nothing, HalfOpen admits the limit's probes per
// epoch in all, otherwise calls in flight stay under the limit) and the
// probe accounting release.lua (a probe's outcome counts when it ends in the
// HalfOpen epoch that admitted it, and a failure of another call may trip
// the breaker in the fleet's path, trip); a new epoch clears the probes, as
// publish.lua does.
type controller struct {
	params policy.Params
	pub    protocol.Published
	// probes are the current epoch's probe outcomes, and admitted the probes
	// it admitted: the probes hash.
	probes   protocol.Probes
	admitted int64
	// running are the jobs of the current epoch's probes still in flight:
	// a probe's outcome counts when its job is here as it ends.
	running []int32
	// callDur is how long a success takes: the workers time every call, so
	// each success in the window is a timed one of callDur (release.lua's
	// ds and dn).
	callDur time.Duration
}

// newController starts Closed with the ramp done, as a policy never
// evaluated (control.Restore), and publishes the first plan at now: the
// fleet is at full capacity before the outage.
func newController(params policy.Params, now time.Time, callDur time.Duration) *controller {
	c := &controller{params: params, pub: control.Restore(params, "", 0, time.Time{}, now), callDur: callDur}
	c.publish(control.Plan(control.Input{Params: params, Previous: c.pub, Now: now}).Next)
	return c
}

// evaluate runs one evaluation at now on the outcomes cnt counted, as the
// evaluator does: the window from control.WindowStart (one second early, so
// that the second of the last transition counts whole), the current epoch's
// probes, Plan, publish. It reports whether the breaker closed, and whether
// it opened from Closed or Ramping (an outage began).
func (c *controller) evaluate(cnt *counters, now time.Time) (closed, opened bool) {
	from := control.WindowStart(c.params, c.pub, now).Add(-time.Second)
	window := cnt.window(now, c.params.Breaker.Window, from)
	window.TimedSuccesses, window.SuccessMicros = window.Successes, window.Successes*c.callDur.Microseconds()
	out := control.Plan(control.Input{Params: c.params, Previous: c.pub, Window: window, Probes: c.probes, Now: now})
	c.publish(out.Next)
	for _, t := range out.Transitions {
		switch {
		case t.Reason == control.EventClosed:
			closed = true
		case t.Reason == control.EventOpened && t.From != wire.HalfOpen:
			opened = true
		}
	}
	return closed, opened
}

// publish makes next the published state; a new epoch clears the probes.
func (c *controller) publish(next protocol.Published) {
	if next.Epoch != c.pub.Epoch {
		c.probes, c.admitted, c.running = protocol.Probes{}, 0, c.running[:0]
	}
	c.pub = next
}

// allows reports whether the published state lets one more call start while
// busy calls are in flight: never while Open, while HalfOpen as long as the
// epoch has admitted fewer probes than the limit (calls of earlier epochs
// still in flight do not count), otherwise while busy is under the limit.
func (c *controller) allows(busy int64) bool {
	switch c.pub.State {
	case wire.Open:
		return false
	case wire.HalfOpen:
		return c.admitted < c.pub.Limit
	}
	return busy < c.pub.Limit
}

// started records that job's call, which allows let through, started, and
// reports whether it is a probe: whether the state is HalfOpen.
func (c *controller) started(job int32) (probe bool) {
	if c.pub.State != wire.HalfOpen {
		return false
	}
	c.admitted++
	c.running = append(c.running, job)
	return true
}

// released counts the outcome of job's call, which ended: a probe's, in the
// probes, when the epoch that admitted it is still the current one (its job
// is still running in this epoch), which is then HalfOpen.
func (c *controller) released(job int32, probe, ok bool) {
	if !probe {
		return
	}
	i := slices.Index(c.running, job)
	if i < 0 {
		return
	}
	c.running = slices.Delete(c.running, i, i+1)
	if ok {
		c.probes.Successes++
	} else {
		c.probes.Failures++
	}
}

// trip is the in-path trip (control.Trip, release.lua's): after a failure of
// a call that is not a probe, counted in cnt at now, the published state
// opens when the window the controller will read, from the published
// Trip.Since, crosses the breaker's rule. The controller takes it over at its
// next evaluation. It reports whether it tripped.
func (c *controller) trip(cnt *counters, now time.Time) bool {
	if !c.pub.Trip.On {
		return false
	}
	next, ok := control.Trip(c.pub, cnt.window(now, c.pub.BreakerWindow, c.pub.Trip.Since), now)
	if ok {
		c.pub = next
	}
	return ok
}

// rate is the published fleet-wide rate limit (control.RateBound), 0 for
// none.
func (c *controller) rate() int64 { return c.pub.RatePerSecond }

// limit is the published fleet-wide concurrency limit.
func (c *controller) limit() int64 { return c.pub.Limit }

// second is the index of the virtual second holding t.
func second(t time.Time) int {
	d := t.Sub(epoch)
	s := int(d / time.Second)
	if d < 0 && d%time.Second != 0 {
		s--
	}
	return s
}
