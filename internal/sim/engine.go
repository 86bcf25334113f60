package sim

import (
	"math"
	"math/rand/v2"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
)

// never is a time after every event.
const never = time.Duration(math.MaxInt64)

// epoch is virtual time 0 as wall-clock time, for the breaker and the ramp.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// virtualClock is the clock the breaker and the ramp read: it only moves
// when the event loop moves it.
type virtualClock struct{ now time.Duration }

// Now returns the virtual time as wall-clock time.
func (c *virtualClock) Now() time.Time { return epoch.Add(c.now) }

// event sources, in the order they are handled when they fall at the same
// instant: the tick first, so that it closes the second before anything of
// the next second happens.
const (
	evTick = iota
	evOutage
	evDependency
	evServed
	evRejected
	evTimer
	evArrival
	evBacklog
	evPod
)

// engine is one policy's run of one scenario.
type engine struct {
	sc     *Scenario
	params policy.Params
	mech   mechanisms
	clock  virtualClock
	// arrivals draws arrival times, classes and keys: it is seeded the same
	// for every policy, so every policy sees the very same jobs.
	arrivals *rand.Rand
	// batch draws the classes of the backlog batch.
	batch *rand.Rand
	// jitter draws retry delays.
	jitter *rand.Rand

	t0, t1, horizon  time.Duration
	callDur, failDur time.Duration
	rate             float64
	classes          []class
	jobs             *jobTable
	keyLatest        []int32
	ready            fifo
	timers           delayQueue
	served, rejected lane
	nextArrival      time.Duration
	nextTick         time.Duration
	backlogDue       bool
	outageDue        bool
	dep              dependency
	workers          autoscaler
	ctl              *controller
	limit            int64 // the fixed cap of a policy without a controller
	busy             int64
	stats            stats
	counters         counters
	drain            drainTracker
	closedAfterT1    time.Duration
	// skippedRamp is whether the breaker's first close after T1 went
	// straight to full capacity (ramp.warmFor); rampFailed whether the ramp
	// stepped back or the breaker reopened after it, which makes the
	// forecast a lower bound.
	skippedRamp, rampFailed bool
	recovery                Backlog
}

// newEngine prepares a run; the scenario must be defaulted and valid. It
// reuses buf, the buffers of an earlier run (or none).
func newEngine(sc *Scenario, params policy.Params, p Policy, buf buffers) *engine {
	seconds := int(sc.Timeline.Horizon.Duration/time.Second) + 2
	e := &engine{
		sc:            sc,
		params:        params,
		mech:          mechanismsFor(p, params),
		arrivals:      rand.New(rand.NewPCG(sc.Seed, 0xa441a15)),
		batch:         rand.New(rand.NewPCG(sc.Seed, 0xba7c4)),
		jitter:        rand.New(rand.NewPCG(sc.Seed, 0x717732)),
		t0:            sc.T0(),
		t1:            sc.T1(),
		horizon:       sc.Timeline.Horizon.Duration,
		callDur:       sc.Dependency.CallDuration.Duration,
		failDur:       sc.Dependency.FailDuration.Duration,
		rate:          sc.Arrivals.RatePerSecond,
		nextTick:      time.Second,
		backlogDue:    sc.Arrivals.Backlog > 0,
		outageDue:     true,
		limit:         params.Capacity,
		counters:      newCounters(seconds),
		timers:        newDelayQueue(seconds),
		stats:         newStats(int((sc.Timeline.Horizon.Duration + time.Second - 1) / time.Second)),
		drain:         drainTracker{drainedAt: -1},
		dep:           newDependency(sc),
		workers:       newAutoscaler(sc.Workers),
		closedAfterT1: -1,
	}
	expected := sc.Arrivals.RatePerSecond*sc.Timeline.Horizon.Seconds()*1.01 + float64(sc.Arrivals.Backlog) + 1024
	e.prepareClasses()
	var deadlines, keys bool
	for _, c := range e.classes {
		deadlines = deadlines || c.deadline > 0
		keys = keys || c.keys > 0
	}
	e.jobs = buf.jobs
	if e.jobs == nil {
		e.jobs = new(jobTable)
	}
	e.jobs.reset(int(expected), deadlines, keys)
	e.ready.spare = buf.ready
	e.timers.spare = buf.timers
	if e.mech.controlled {
		e.ctl = newController(params, e.clock.Now(), e.callDur)
	}
	e.nextArrival = e.interarrival()
	return e
}

// release returns the run's buffers, once it has its result, for another
// run to reuse: what they hold is overwritten as they fill again.
func (e *engine) release() buffers {
	b := buffers{jobs: e.jobs, ready: append(e.ready.spare, e.ready.blocks...), timers: e.timers.spare}
	for _, bucket := range e.timers.buckets {
		b.timers = append(b.timers, bucket.blocks...)
	}
	e.jobs, e.ready, e.timers = nil, fifo{}, delayQueue{}
	return b
}

// run processes events in time order over [0, horizon): the run ends with
// the tick at the horizon, which closes the last whole second, and nothing
// else happens at the horizon, so that every call started is in a second of
// the series. A horizon that is not a whole second ends with its partial
// last second recorded.
func (e *engine) run() {
	for {
		at, ev := e.next()
		if at > e.horizon || at == e.horizon && ev != evTick {
			break
		}
		e.clock.now = at
		e.handle(ev)
		if at == e.horizon {
			return
		}
		e.dispatch()
	}
	e.clock.now = e.horizon
	sec := int(e.horizon / time.Second)
	e.stats.record(sec, e.counters.startsThisSecond, e.dep.closeLoad(e.horizon, sec), e.dep.throughput(e.horizon, e.callDur))
}

// next returns the earliest event and its source; ties go to the lower
// source number.
func (e *engine) next() (time.Duration, int) {
	at, ev := e.nextTick, evTick
	consider := func(t time.Duration, source int) {
		if t < at {
			at, ev = t, source
		}
	}
	if e.outageDue {
		consider(e.t0, evOutage)
	}
	consider(e.dep.changeAt, evDependency)
	if e.served.len() > 0 {
		consider(e.served.peek().done, evServed)
	}
	if e.rejected.len() > 0 {
		consider(e.rejected.peek().done, evRejected)
	}
	consider(e.timers.next(), evTimer)
	consider(e.nextArrival, evArrival)
	if e.backlogDue {
		consider(e.t0, evBacklog)
	}
	consider(e.workers.nextReady(), evPod)
	return at, ev
}

func (e *engine) handle(ev int) {
	switch ev {
	case evTick:
		e.tick()
	case evOutage:
		e.outageDue = false
		e.dep.goDown(e.clock.now, e.t1)
	case evDependency:
		e.dep.comeUp(e.clock.now)
		if e.clock.now == e.t1 {
			e.snapshotRecovery()
		}
	case evServed:
		e.complete(e.served.pop())
	case evRejected:
		e.complete(e.rejected.pop())
	case evTimer:
		e.wake(e.timers.pop())
	case evArrival:
		e.arrive(e.arrivals)
		e.nextArrival = e.clock.now + e.interarrival()
	case evBacklog:
		e.backlogDue = false
		for range e.sc.Arrivals.Backlog {
			e.arrive(e.batch)
		}
	case evPod:
		e.workers.podReady()
	}
}
