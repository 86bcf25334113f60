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
	return false
}

// release frees the slot of a served call that ends at now.
func (d *dependency) release(now time.Duration) {
	d.busy(now)
	d.served--
}

// busy adds the slot-time served since the last count to the offered work,
// while up.
func (d *dependency) busy(now time.Duration) {
	if d.up {
		d.offered += time.Duration(d.served) * (now - d.servedSince)
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
