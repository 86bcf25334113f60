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
	// overloadRun counts consecutive overloaded seconds.
	overloadRun int
}

func newDependency(sc *Scenario) dependency {
	d := sc.Dependency
	return dependency{
		concurrency:   int64(d.Concurrency),
		coldFactor:    d.ColdStart.Factor,
		coldFor:       d.ColdStart.Duration.Duration,
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
// if so. A call beyond the effective capacity, or while down, fails.
func (d *dependency) accept(now time.Duration) bool {
	if d.served < d.effective(now) {
		d.served++
		return true
	}
	return false
}

// release frees the slot of a served call.
func (d *dependency) release() { d.served-- }

// upSince reports whether it has not gone down since t.
func (d *dependency) upSince(t time.Duration) bool { return d.lastDown < t }

// goDown takes it down until upAt.
func (d *dependency) goDown(now, upAt time.Duration) {
	d.up, d.lastDown, d.changeAt, d.overloadRun = false, now, upAt, 0
}

// comeUp brings it back, cold.
func (d *dependency) comeUp(now time.Duration) {
	d.up, d.lastUp, d.changeAt, d.overloadRun = true, now, never, 0
}

// overloaded takes the calls started in the second that ended at now and
// reports whether offered load has now been above the effective capacity
// for collapseAfter consecutive seconds.
func (d *dependency) overloaded(now time.Duration, starts int64, callDur time.Duration) bool {
	if !d.up {
		d.overloadRun = 0
		return false
	}
	if float64(starts) > d.throughput(now, callDur) {
		d.overloadRun++
	} else {
		d.overloadRun = 0
	}
	return d.overloadRun >= d.collapseAfter
}
