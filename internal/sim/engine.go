package sim

import (
	"math"
	"math/rand/v2"
	"time"

	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
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

// jobState is where a job is in its life.
type jobState uint8

const (
	jobPending jobState = iota
	jobDone
	jobStale
	jobSuperseded
	jobGaveUp
)

// job is one unit of work. Jobs live in one slice and are named by index.
type job struct {
	deadline time.Duration // 0: never expires
	key      int32         // -1: not versioned
	attempts int32
	state    jobState
	// parked is set once the job has been parked.
	parked bool
}

// class is a JobClass prepared for drawing.
type class struct {
	upTo     float64 // cumulative share
	deadline time.Duration
	keyBase  int32
	keys     int32
}

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
	jobs             []job
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

// newEngine prepares a run; the scenario must be defaulted and valid.
func newEngine(sc *Scenario, params policy.Params, p Policy) *engine {
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
	e.jobs = make([]job, 0, int(expected))
	e.prepareClasses()
	if e.mech.controlled {
		e.ctl = newController(params, e.clock.Now(), e.callDur)
	}
	e.nextArrival = e.interarrival()
	return e
}

func (e *engine) prepareClasses() {
	var upTo float64
	var keys int32
	for _, c := range e.sc.Arrivals.Classes {
		upTo += c.Share
		pc := class{upTo: upTo, keyBase: keys, keys: int32(c.Keys)}
		if c.Deadline != nil {
			pc.deadline = c.Deadline.Duration
		}
		keys += int32(c.Keys)
		e.classes = append(e.classes, pc)
	}
	e.classes[len(e.classes)-1].upTo = math.Inf(1)
	e.keyLatest = make([]int32, keys)
	for i := range e.keyLatest {
		e.keyLatest[i] = -1
	}
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

// interarrival draws the gap to the next Poisson arrival.
func (e *engine) interarrival() time.Duration {
	return time.Duration(e.arrivals.ExpFloat64() / e.rate * float64(time.Second))
}

// arrive enqueues a new job of a class drawn from rnd.
func (e *engine) arrive(rnd *rand.Rand) {
	u := rnd.Float64()
	c := e.classes[0]
	for _, candidate := range e.classes {
		if u < candidate.upTo {
			c = candidate
			break
		}
	}
	now := e.clock.now
	j := job{key: -1}
	if c.deadline > 0 {
		j.deadline = now + c.deadline
	}
	id := int32(len(e.jobs))
	if c.keys > 0 {
		j.key = c.keyBase + rnd.Int32N(c.keys)
		e.keyLatest[j.key] = id
	}
	e.jobs = append(e.jobs, j)
	e.stats.pending++
	e.ready.push(id)
}

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

// dropUseless finishes a job that is past its deadline or superseded, and
// reports whether it did.
func (e *engine) dropUseless(id int32) bool {
	j := &e.jobs[id]
	switch {
	case j.deadline > 0 && e.clock.now > j.deadline:
		e.finish(id, jobStale)
	case j.key >= 0 && e.keyLatest[j.key] != id:
		e.finish(id, jobSuperseded)
	default:
		return false
	}
	return true
}

// admit reports whether the fleet limit lets one more call start now: the
// controller's published state when there is one, else the fixed cap.
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
	e.jobs[id].attempts++
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
	j := &e.jobs[id]
	if limit := e.sc.Arrivals.MaxAttempts; limit > 0 && int(j.attempts) >= limit {
		e.finish(id, jobGaveUp)
		return
	}
	now := e.clock.now
	if e.mech.budgeted {
		calls, retries := e.counters.budgetWindow(now, e.params.Budget.Window)
		if !e.params.Budget.Allows(retries, calls) {
			if !j.parked {
				j.parked = true
				e.stats.parked++
			}
			e.stats.parking++
			e.timers.add(now+retry.Park(e.params.Backoff, e.jitter), id, true)
			return
		}
		e.counters.retryGranted()
	}
	if d := e.mech.delay(int(j.attempts), e.jitter); d > 0 {
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

// finish records a job's end.
func (e *engine) finish(id int32, s jobState) {
	e.jobs[id].state = s
	e.stats.pending--
	switch s {
	case jobDone:
		e.stats.completed++
	case jobStale:
		e.stats.stale++
	case jobSuperseded:
		e.stats.superseded++
	case jobGaveUp:
		e.stats.gaveUp++
	}
}

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

// snapshotRecovery records the backlog at recovery and how much of it is
// still useful: neither past its deadline nor superseded.
func (e *engine) snapshotRecovery() {
	now := e.clock.now
	b := Backlog{Pending: e.stats.pending}
	for id := range e.jobs {
		j := &e.jobs[id]
		if j.state != jobPending {
			continue
		}
		switch {
		case j.deadline > 0 && now > j.deadline:
			b.PastDeadline++
		case j.key >= 0 && e.keyLatest[j.key] != int32(id):
			b.Superseded++
		default:
			b.Useful++
		}
	}
	e.recovery = b
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

// pendingFound counts the jobs still held somewhere at the horizon: the
// ready queue, the retry timers and the calls in flight. It is counted from
// the structures themselves, independently of the pending counter, so that
// a job that vanished shows up as lost.
func (e *engine) pendingFound() int64 {
	return int64(e.ready.len() + e.timers.len() + e.served.len() + e.rejected.len())
}
