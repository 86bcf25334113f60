package sim

import (
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
)

// controller is the Spillway controller's evaluation, run every second of
// virtual time: the shipped breaker on the window's outcome counts, the
// shipped ramp, and the fleet limit they give.
type controller struct {
	br       *breaker.Breaker
	rp       *ramp.Ramp
	capacity int64
	probes   int64
}

// newController starts Closed with the ramp done: the fleet is at full
// capacity before the outage.
func newController(params policy.Params, clk *virtualClock) *controller {
	done := ramp.Snapshot{Step: len(params.Ramp.Steps) - 1, StepStarted: clk.Now()}
	return &controller{
		br:       breaker.New(params.Breaker, clk),
		rp:       ramp.Restore(params.Ramp, clk, done),
		capacity: params.Capacity,
		probes:   params.Breaker.HalfOpenProbes,
	}
}

// evaluate hands the breaker the outcomes since WindowStart (Closed) and
// since it entered HalfOpen (probes), restarts the ramp when it closes and
// advances the ramp while Closed. It reports whether the breaker closed,
// and whether it opened from Closed (an outage began).
func (c *controller) evaluate(cnt *counters) (closed, opened bool) {
	window := cnt.outcomesSince(second(c.br.WindowStart()))
	probes := cnt.outcomesSince(second(c.br.Snapshot().Since))
	tr, changed := c.br.Evaluate(window, probes)
	if changed && tr.To == breaker.Closed {
		c.rp.Restart()
		closed = true
	}
	opened = changed && tr.From == breaker.Closed && tr.To == breaker.Open
	if c.br.State() == breaker.Closed {
		c.rp.Advance()
	}
	return closed, opened
}

// limit is the fleet-wide concurrency limit: 0 while Open, the probes while
// HalfOpen, the ramp's step while Ramping and the capacity once Closed and
// done.
func (c *controller) limit() int64 {
	switch c.br.State() {
	case breaker.Open:
		return 0
	case breaker.HalfOpen:
		return c.probes
	}
	if c.rp.Done() {
		return c.capacity
	}
	return c.rp.Limit()
}

func (c *controller) closed() bool { return c.br.State() == breaker.Closed }

// second is the index of the virtual second holding t.
func second(t time.Time) int { return int(t.Sub(epoch) / time.Second) }
