package sim

import (
	"time"

	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// tick closes the second that just ended and runs what happens once per
// second: the collapse check, the controller, the autoscaler and the drain
// check.
func (e *engine) tick() {
	now := e.clock.now
	k := int(now / time.Second) // the second starting now
	starts := e.counters.closeSecond(k)
	e.timers.startSecond(k)
	e.stats.record(k-1, starts, e.dep.closeLoad(now, k-1), e.dep.throughput(now, e.callDur))
	if e.dep.overloaded(now) {
		e.collapse()
	}
	if e.ctl != nil {
		e.control()
	}
	if now%e.sc.Workers.PollingInterval.Duration == 0 {
		lo, hi := e.replicaBounds()
		e.workers.poll(now, e.stats.pending, lo, hi)
	}
	e.drain.observe(now, e.t0, e.t1, e.stats.pending-e.stats.parking)
	e.nextTick += time.Second
}

// collapse takes the dependency down after sustained overload.
func (e *engine) collapse() {
	now := e.clock.now
	e.dep.goDown(now, now+e.sc.Dependency.Collapse.DownFor.Duration)
	if now >= e.t1 {
		e.stats.secondOutages++
		e.stats.downAfterRecovery += e.sc.Dependency.Collapse.DownFor.Duration
	}
}

// control runs the controller's evaluation; admit follows what it publishes.
func (e *engine) control() {
	closed, opened := e.ctl.evaluate(&e.counters, e.clock.Now())
	now := e.clock.now
	if closed && now >= e.t1 && e.closedAfterT1 < 0 {
		e.closedAfterT1 = now
		e.skippedRamp = e.ctl.pub.State == wire.Closed
	} else if e.closedAfterT1 >= 0 && (e.ctl.pub.RampCeiling > 0 || e.ctl.pub.State == wire.Open) {
		e.rampFailed = true
	}
	if opened {
		e.workers.pinAtOutage()
	}
}

// replicaBounds returns the autoscaler's bounds; Spillway's controller
// lowers the maximum to what the capacity can use and pins the minimum
// while the breaker is not Closed.
func (e *engine) replicaBounds() (lo, hi int) {
	w := e.sc.Workers
	lo, hi = w.MinReplicas, w.MaxReplicas
	if !e.mech.boundReplicas || e.ctl == nil || e.sc.Policy == nil {
		return lo, hi
	}
	if consumers := e.sc.Policy.Spec.Consumers; len(consumers) > 0 {
		slots := int64(max(consumers[0].SlotsPerReplica, 1))
		useful := int((e.params.Capacity + slots - 1) / slots)
		hi = max(lo, min(hi, useful))
	}
	if control.PinsMinReplicas(e.params, e.ctl.pub.State) {
		lo = min(max(lo, e.workers.pinned), hi)
	}
	return lo, hi
}
