package sim

import (
	"math"
	"time"
)

// dependency is the service the jobs call: Concurrency slots, a cold start
// after each recovery, and a collapse under sustained overload.
type dependency struct {
	concurrency   int64
	coldFactor    float64
	coldFor       time.Duration
	collapseAfter int
	// up is whether it serves calls at all.
	up bool
	// changeAt is when it next comes back up, or never.
	changeAt time.Duration
	// lastDown is when it last went down; lastUp when it last came up.
	lastDown, lastUp time.Duration
	// served is the number of calls it is serving.
	served int64
	// callDur is the service time of a call it serves.
	callDur time.Duration
	// offered is the work offered to it since the last tick while up, in
	// slot-time: the time its slots spent serving calls, plus callDur for
	// every call it turned away for lack of a slot (the work that call
	// wanted). servedSince is when served last changed or was counted.
	offered, servedSince time.Duration
	// overloadRun counts consecutive overloaded seconds.
	overloadRun int
	// load is the slot-time its slots spent serving calls since the last
	// tick, up or down; wanted[s%len(wanted)] is the slot-time that the
	// calls it turned away, up or down, wanted in second s: callDur from
	// each one's start, split over the seconds it spans. Together they are
	// the load of the second, for PeakOverCapacity. Nothing is booked at
	// or after horizon, the end of the run.
	load    time.Duration
	wanted  []time.Duration
	horizon time.Duration
}

func newDependency(sc *Scenario) dependency {
	d := sc.Dependency
	return dependency{
		concurrency:   int64(d.Concurrency),
		coldFactor:    d.ColdStart.Factor,
		coldFor:       d.ColdStart.Duration.Duration,
		callDur:       d.CallDuration.Duration,
		collapseAfter: int(math.Ceil(d.Collapse.After.Seconds())),
		up:            true,
		changeAt:      never,
		lastDown:      -1,
		lastUp:        math.MinInt64 / 2,
		// A call turned away in second s wants slot-time in seconds s to
		// s+callDur/1s+1 at most, none of them closed yet.
		wanted:  make([]time.Duration, d.CallDuration.Duration/time.Second+2),
		horizon: sc.Timeline.Horizon.Duration,
	}
}

// effective is the number of calls it can serve at once at now: 0 while
// down, Concurrency × ColdStart.Factor (at least 1) while cold, else
// Concurrency.
func (d *dependency) effective(now time.Duration) int64 {
	switch {
	case !d.up:
		return 0
	case now-d.lastUp < d.coldFor:
		return max(1, int64(float64(d.concurrency)*d.coldFactor))
	}
	return d.concurrency
}

// throughput is the effective capacity in calls per second.
func (d *dependency) throughput(now, callDur time.Duration) float64 {
	return float64(d.effective(now)) / callDur.Seconds()
}

// accept reports whether a call starting at now is served, and takes a slot
// if so. A call beyond the effective capacity, or while down, fails; one
// turned away while up counts as offered work.
func (d *dependency) accept(now time.Duration) bool {
	if d.served < d.effective(now) {
		d.busy(now)
		d.served++
		return true
	}
	if d.up {
		d.offered += d.callDur
	}
	d.turnAway(now)
	return false
}

// turnAway books the slot-time that a call turned away at now wanted,
// callDur from now but not past the horizon, in the seconds it falls in.
func (d *dependency) turnAway(now time.Duration) {
	for from, to := now, min(now+d.callDur, d.horizon); from < to; {
		sec := from / time.Second
		end := min(to, (sec+1)*time.Second)
		d.wanted[int(sec)%len(d.wanted)] += end - from
		from = end
	}
}

// closeLoad returns the load of second sec, which ends at or after now
// (after only for a partial last second): the slot-time its slots spent
// serving calls in it, plus the slot-time the calls it turned away wanted
// in it. It is the time integral over the second of the calls that wanted
// a slot, so it is at most Concurrency × 1 s while no more calls want a
// slot than it holds, whatever the call time.
func (d *dependency) closeLoad(now time.Duration, sec int) time.Duration {
	d.busy(now)
	load := d.load
	d.load = 0
	if sec >= 0 {
		i := sec % len(d.wanted)
		load += d.wanted[i]
		d.wanted[i] = 0
	}
	return load
}

// release frees the slot of a served call that ends at now.
func (d *dependency) release(now time.Duration) {
	d.busy(now)
	d.served--
}

// busy adds the slot-time served since the last count to the load, and to
// the offered work while up.
func (d *dependency) busy(now time.Duration) {
	slotTime := time.Duration(d.served) * (now - d.servedSince)
	d.load += slotTime
	if d.up {
		d.offered += slotTime
	}
	d.servedSince = now
}

// upSince reports whether it has not gone down since t.
func (d *dependency) upSince(t time.Duration) bool { return d.lastDown < t }

// goDown takes it down until upAt.
func (d *dependency) goDown(now, upAt time.Duration) {
	d.busy(now)
	d.up, d.lastDown, d.changeAt, d.overloadRun = false, now, upAt, 0
}

// comeUp brings it back, cold.
func (d *dependency) comeUp(now time.Duration) {
	d.busy(now)
	d.up, d.lastUp, d.changeAt, d.overloadRun = true, now, never, 0
}

// overloaded closes the second that ended at now and reports whether the
// work offered has now been above the effective capacity for collapseAfter
// consecutive seconds. A second is overloaded when the work offered in it
// (slot-time served, plus callDur for each call turned away) exceeds the
// effective concurrency × 1 s: more calls wanted a slot than it holds. A
// dependency that never has more than its concurrency asked of it is never
// overloaded, whatever its call time; counting calls started in the second
// against C/S would judge one overloaded whenever the call time does not
// divide a second (a slot busy all the time starts 3 calls of 350 ms in six
// seconds out of seven, more than 1/0.35).
func (d *dependency) overloaded(now time.Duration) bool {
	d.busy(now)
	offered := d.offered
	d.offered = 0
	if !d.up {
		d.overloadRun = 0
		return false
	}
	if offered > time.Duration(d.effective(now))*time.Second {
		d.overloadRun++
	} else {
		d.overloadRun = 0
	}
	return d.overloadRun >= d.collapseAfter
}
