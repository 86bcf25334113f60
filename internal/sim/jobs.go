package sim

import (
	"math"
	"math/rand/v2"
	"time"
)

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

// pendingFound counts the jobs still held somewhere at the horizon: the
// ready queue, the retry timers and the calls in flight. It is counted from
// the structures themselves, independently of the pending counter, so that
// a job that vanished shows up as lost.
func (e *engine) pendingFound() int64 {
	return int64(e.ready.len() + e.timers.len() + e.served.len() + e.rejected.len())
}
