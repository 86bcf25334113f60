package sim

import (
	"math"
	"math/rand/v2"
	"time"
)

// jobState is how a job ended.
type jobState uint8

const (
	jobDone jobState = iota
	jobStale
	jobSuperseded
	jobGaveUp
)

// jobTable holds every job of a run, named by index (its id), as parallel
// arrays of small fields rather than one struct per job: a scenario at fleet
// scale has tens of millions of jobs per policy. A field that no class uses
// has no array: deadline is nil when no class has a deadline, key when no
// class is versioned. 12¼ bytes a job with both, 2¼ without.
type jobTable struct {
	// deadline is when the job stops being useful, in nanoseconds of
	// virtual time split into its low 32 and high 16 bits (up to 78 h; the
	// horizon is at most 24 h); 0: never.
	deadlineLo []uint32
	deadlineHi []uint16
	// key is the entity a versioned job updates; -1: not versioned.
	key []int32
	// attempts counts the job's calls, saturating at maxAttempts (scenario
	// validation keeps MaxAttempts within it, and backoff is constant long
	// before it).
	attempts []uint16
	// parked is set once the job has been parked; ended once it has
	// finished.
	parked, ended bitset
}

// maxAttempts is the most calls a job counts.
const maxAttempts = math.MaxUint16

// reset empties the table and makes room for n jobs, reusing its arrays
// where they are large enough; deadlines and keys say whether any class has
// a deadline or keys.
func (t *jobTable) reset(n int, deadlines, keys bool) {
	t.attempts = reuse(t.attempts, n, true)
	t.deadlineLo = reuse(t.deadlineLo, n, deadlines)
	t.deadlineHi = reuse(t.deadlineHi, n, deadlines)
	t.key = reuse(t.key, n, keys)
	t.parked = reuse(t.parked, (n+63)/64, true)
	t.ended = reuse(t.ended, (n+63)/64, true)
}

// reuse returns s emptied with room for n elements, or nil if not needed.
func reuse[S ~[]E, E any](s S, n int, needed bool) S {
	switch {
	case !needed:
		return nil
	case cap(s) >= n:
		return s[:0]
	}
	return make(S, 0, n)
}

func (t *jobTable) len() int { return len(t.attempts) }

// add appends a job and returns its id; deadline must be below 2^48 ns.
func (t *jobTable) add(deadline time.Duration, key int32) int32 {
	id := int32(len(t.attempts))
	t.attempts = append(t.attempts, 0)
	if t.deadlineLo != nil {
		t.deadlineLo = append(t.deadlineLo, uint32(deadline))
		t.deadlineHi = append(t.deadlineHi, uint16(deadline>>32))
	}
	if t.key != nil {
		t.key = append(t.key, key)
	}
	t.parked.grow(len(t.attempts))
	t.ended.grow(len(t.attempts))
	return id
}

func (t *jobTable) deadlineOf(id int32) time.Duration {
	if t.deadlineLo == nil {
		return 0
	}
	return time.Duration(t.deadlineHi[id])<<32 | time.Duration(t.deadlineLo[id])
}

func (t *jobTable) keyOf(id int32) int32 {
	if t.key == nil {
		return -1
	}
	return t.key[id]
}

// attempt counts a call of job id.
func (t *jobTable) attempt(id int32) {
	if t.attempts[id] < maxAttempts {
		t.attempts[id]++
	}
}

// bitset is one bit per job.
type bitset []uint64

// grow makes room for n bits; the bits added are clear.
func (b *bitset) grow(n int) {
	for len(*b)*64 < n {
		*b = append(*b, 0)
	}
}

func (b bitset) has(i int32) bool { return b[i/64]&(1<<(i%64)) != 0 }

func (b bitset) set(i int32) { b[i/64] |= 1 << (i % 64) }

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
	var deadline time.Duration
	if c.deadline > 0 {
		// A deadline after the horizon is as good as one at it: the run
		// never looks at a later time. It then fits the job table.
		deadline = min(e.clock.now+c.deadline, e.horizon)
	}
	key := int32(-1)
	if c.keys > 0 {
		key = c.keyBase + rnd.Int32N(c.keys)
	}
	id := e.jobs.add(deadline, key)
	if key >= 0 {
		e.keyLatest[key] = id
	}
	e.stats.pending++
	e.ready.push(id)
}

// dropUseless finishes a job that is past its deadline or superseded, and
// reports whether it did.
func (e *engine) dropUseless(id int32) bool {
	switch {
	case e.pastDeadline(id, e.clock.now):
		e.finish(id, jobStale)
	case e.superseded(id):
		e.finish(id, jobSuperseded)
	default:
		return false
	}
	return true
}

// pastDeadline reports whether job id has a deadline before now.
func (e *engine) pastDeadline(id int32, now time.Duration) bool {
	d := e.jobs.deadlineOf(id)
	return d > 0 && now > d
}

// superseded reports whether a newer job for job id's key has arrived.
func (e *engine) superseded(id int32) bool {
	k := e.jobs.keyOf(id)
	return k >= 0 && e.keyLatest[k] != id
}

// finish records a job's end.
func (e *engine) finish(id int32, s jobState) {
	e.jobs.ended.set(id)
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
	for id := range int32(e.jobs.len()) {
		if e.jobs.ended.has(id) {
			continue
		}
		switch {
		case e.pastDeadline(id, now):
			b.PastDeadline++
		case e.superseded(id):
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
