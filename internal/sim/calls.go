package sim

import (
	"github.com/spillway-dev/spillway/pkg/retry"
)

// dispatch hands ready jobs to free worker slots while the fleet limit
// admits them. A worker first drops a job that is stale or superseded (when
// the policy does), so dropping needs a free worker but no admission.
func (e *engine) dispatch() {
	slots := e.workers.slots()
	for e.ready.len() > 0 && e.busy < slots {
		id := e.ready.peek()
		if e.mech.dropUseless && e.dropUseless(id) {
			e.ready.pop()
			continue
		}
		if !e.admit() {
			return
		}
		e.ready.pop()
		var probe bool
		if e.ctl != nil {
			probe = e.ctl.started(id)
		}
		e.startCall(id, probe)
	}
}

// admit reports whether the fleet limit lets one more call start now: the
// controller's published state (its limit and its rate, control.RateBound)
// when there is one, else the fixed cap and capacity.ratePerSecond.
func (e *engine) admit() bool {
	if !e.mech.capped {
		return true
	}
	rate := e.params.RatePerSecond
	if e.ctl != nil {
		if !e.ctl.allows(e.busy) {
			return false
		}
		rate = e.ctl.rate()
	} else if e.busy >= e.limit {
		return false
	}
	return rate == 0 || e.counters.startsThisSecond < rate
}

// startCall makes one call to the dependency; probe says that the controller
// admitted it as a probe.
func (e *engine) startCall(id int32, probe bool) {
	now := e.clock.now
	e.jobs.attempt(id)
	e.busy++
	e.counters.startCall()
	c := call{started: now, job: id, probe: probe}
	if e.dep.accept(now) {
		c.served, c.done = true, now+e.callDur
		e.served.push(c)
		return
	}
	c.done = now + e.failDur
	e.rejected.push(c)
}

// complete ends a call: a served call succeeds unless the dependency went
// down while it ran; a rejected call fails.
func (e *engine) complete(c call) {
	e.busy--
	ok := c.served && e.dep.upSince(c.started)
	if c.served {
		e.dep.release(e.clock.now)
	}
	e.counters.outcome(ok)
	if e.ctl != nil {
		e.ctl.released(c.job, c.probe, ok)
		if !ok && !c.probe && e.ctl.trip(&e.counters, e.clock.Now()) {
			e.stats.trips++
		}
	}
	if ok {
		e.finish(c.job, jobDone)
		return
	}
	e.fail(c.job)
}

// fail applies the policy to a job whose call failed: give up, retry after a
// delay, or park when over the retry budget.
func (e *engine) fail(id int32) {
	attempts := int(e.jobs.attempts[id])
	if limit := e.sc.Arrivals.MaxAttempts; limit > 0 && attempts >= limit {
		e.finish(id, jobGaveUp)
		return
	}
	now := e.clock.now
	if e.mech.budgeted {
		calls, retries := e.counters.budgetWindow(now, e.params.Budget.Window)
		if !e.params.Budget.Allows(retries, calls) {
			if !e.jobs.parked.has(id) {
				e.jobs.parked.set(id)
				e.stats.parked++
			}
			e.stats.parking++
			e.timers.add(now+retry.Park(e.params.Backoff, e.jitter), id, true)
			return
		}
		e.counters.retryGranted()
	}
	if d := e.mech.delay(attempts, e.jitter); d > 0 {
		e.timers.add(now+d, id, false)
		return
	}
	e.ready.push(id)
}

// wake makes a job whose retry or park delay is over ready again.
func (e *engine) wake(t timer) {
	if t.parking {
		e.stats.parking--
	}
	e.ready.push(t.job)
}
