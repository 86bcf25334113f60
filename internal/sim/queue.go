package sim

import (
	"slices"
	"time"
)

// fifo is the queue of ready work, job ids in the order the jobs became
// ready. It is a list of fixed blocks, not a ring buffer that doubles: a
// fleet-scale backlog holds tens of millions of ids, and doubling would
// reserve up to twice them and copy them all at each growth. An emptied
// block is kept for reuse.
type fifo struct {
	blocks     []*fifoBlock
	head, tail int // next to pop in blocks[0], next free in the last block
	size       int
	spare      []*fifoBlock
}

const fifoBlockLen = 4096

type fifoBlock [fifoBlockLen]int32

func (q *fifo) len() int { return q.size }

func (q *fifo) push(id int32) {
	if len(q.blocks) == 0 || q.tail == fifoBlockLen {
		var b *fifoBlock
		if n := len(q.spare); n > 0 {
			b, q.spare = q.spare[n-1], q.spare[:n-1]
		} else {
			b = new(fifoBlock)
		}
		q.blocks = append(q.blocks, b)
		q.tail = 0
	}
	q.blocks[len(q.blocks)-1][q.tail] = id
	q.tail++
	q.size++
}

func (q *fifo) peek() int32 { return q.blocks[0][q.head] }

func (q *fifo) pop() int32 {
	id := q.blocks[0][q.head]
	q.head++
	q.size--
	if q.head == fifoBlockLen || q.size == 0 {
		// The first block is used up, or the queue is empty and that block
		// is the only one: keep it for reuse. An emptied list starts again
		// at the start of its array: a queue that empties at every job, as
		// a drained one does, would otherwise creep along the array and
		// allocate a new one every few jobs.
		q.spare = append(q.spare, q.blocks[0])
		q.blocks[0] = nil
		if len(q.blocks) == 1 {
			q.blocks = q.blocks[:0]
		} else {
			q.blocks = q.blocks[1:]
		}
		q.head = 0
	}
	return id
}

// call is a call in flight at the dependency.
type call struct {
	// done is when the call completes.
	done time.Duration
	// started is when the call started.
	started time.Duration
	// job is the calling job.
	job int32
	// served is true when the dependency accepted the call within its
	// capacity; a served call succeeds unless the dependency went down
	// while it ran.
	served bool
	// probe is true for a probe: a call admitted HalfOpen. It fits in the
	// padding after served: calls are the bulk of the simulator's memory
	// traffic.
	probe bool
}

// lane holds calls that all take the same time, so they complete in the
// order they started: a FIFO is a correct (and O(1)) event queue for them.
type lane struct {
	buf        []call
	head, size int
}

func (l *lane) len() int { return l.size }

func (l *lane) push(c call) {
	if l.size == len(l.buf) {
		buf := make([]call, max(2*len(l.buf), 256))
		for i := 0; i < l.size; i++ {
			buf[i] = l.buf[(l.head+i)%len(l.buf)]
		}
		l.buf, l.head = buf, 0
	}
	l.buf[(l.head+l.size)%len(l.buf)] = c
	l.size++
}

func (l *lane) peek() call { return l.buf[l.head] }

func (l *lane) pop() call {
	c := l.buf[l.head]
	l.head = (l.head + 1) % len(l.buf)
	l.size--
	return c
}

// timer is a job waiting out a retry delay, or parked, until at.
type timer struct {
	at      time.Duration
	job     int32
	parking bool
}

// timerKey is a timer of a second the queue knows, packed into one integer
// that sorts the way timers are popped, by time and then by job (a job has
// at most one timer, so equal times pop in a deterministic order): the
// nanoseconds into the second (under 2^30) in the high 32 bits, then the
// job (under 2^31), then parking. Half the size of a timer, and sorted
// without a comparison function.
type timerKey uint64

// keyIn packs t, which falls in second sec.
func keyIn(t timer, sec int) timerKey {
	k := uint64(t.at-time.Duration(sec)*time.Second)<<32 | uint64(t.job)<<1
	if t.parking {
		k |= 1
	}
	return timerKey(k)
}

// in unpacks k, a timer of second sec.
func (k timerKey) in(sec int) timer {
	return timer{at: time.Duration(sec)*time.Second + time.Duration(k>>32), job: int32(uint32(k) >> 1), parking: k&1 != 0}
}

// delayQueue is the event queue of the jobs waiting to retry: a calendar
// queue with one bucket per virtual second. The engine calls startSecond at
// every tick, which is itself an event, so a timer in a later second can
// never be the next event while the current second has none left. Adding a
// timer for a later second is an append to its bucket, a list of fixed
// blocks shared with every other bucket, so that a fleet-scale run neither
// copies buckets as they grow nor leaves their old arrays to the garbage
// collector. When its second becomes current, the bucket is copied into one
// reused array and sorted once, which costs far less than a heap's sift per
// timer. Timers added for the current second itself go to a 4-ary min-heap,
// and pop takes the earlier of the two heads. Timers past the last bucket
// never fire. Timers are held as timerKeys of their second.
type delayQueue struct {
	buckets []bucket // timers of second k, for k > cur
	cur     int      // the current second
	// sorted is the current second's bucket in order; its timers from head
	// on are still waiting.
	sorted []timerKey
	head   int
	// h holds the timers added for the current second while it was current.
	h     []timerKey
	n     int
	spare []*timerBlock // emptied blocks, for any bucket to reuse
}

// bucket is the timers of one second: n timers in blocks, all full but the
// last.
type bucket struct {
	blocks []*timerBlock
	n      int
}

const timerBlockLen = 1024

type timerBlock [timerBlockLen]timerKey

func newDelayQueue(seconds int) delayQueue {
	return delayQueue{buckets: make([]bucket, seconds)}
}

func (d *delayQueue) len() int { return d.n }

// add adds a timer at at, which is not before the current second.
func (d *delayQueue) add(at time.Duration, job int32, parking bool) {
	d.n++
	t := timer{at: at, job: job, parking: parking}
	sec := int(at / time.Second)
	switch {
	case sec <= d.cur:
		d.push(keyIn(t, d.cur))
	case sec < len(d.buckets):
		b := &d.buckets[sec]
		if b.n%timerBlockLen == 0 {
			var block *timerBlock
			if n := len(d.spare); n > 0 {
				block, d.spare = d.spare[n-1], d.spare[:n-1]
			} else {
				block = new(timerBlock)
			}
			b.blocks = append(b.blocks, block)
		}
		b.blocks[len(b.blocks)-1][b.n%timerBlockLen] = keyIn(t, sec)
		b.n++
	}
}

// startSecond makes second k current, sorting its bucket. The second before
// has no timer left then: its timers all fell before k.
func (d *delayQueue) startSecond(k int) {
	d.cur = k
	d.sorted, d.head = d.sorted[:0], 0
	if k >= len(d.buckets) || d.buckets[k].n == 0 {
		return
	}
	b := d.buckets[k]
	for i, block := range b.blocks {
		d.sorted = append(d.sorted, block[:min(timerBlockLen, b.n-i*timerBlockLen)]...)
		d.spare = append(d.spare, block)
	}
	d.buckets[k] = bucket{}
	slices.Sort(d.sorted)
}

// fromSorted reports whether the earliest timer is the sorted bucket's
// head: false when the bucket is used up.
func (d *delayQueue) fromSorted() bool {
	if d.head == len(d.sorted) {
		return false
	}
	return len(d.h) == 0 || d.sorted[d.head] < d.h[0]
}

// next returns the earliest time in the current second, or never.
func (d *delayQueue) next() time.Duration {
	var k timerKey
	switch {
	case d.fromSorted():
		k = d.sorted[d.head]
	case len(d.h) > 0:
		k = d.h[0]
	default:
		return never
	}
	return time.Duration(d.cur)*time.Second + time.Duration(k>>32)
}

// pop removes the earliest timer; next must have returned a time.
func (d *delayQueue) pop() timer {
	d.n--
	if d.fromSorted() {
		k := d.sorted[d.head]
		d.head++
		return k.in(d.cur)
	}
	top := d.h[0]
	last := d.h[len(d.h)-1]
	d.h = d.h[:len(d.h)-1]
	if len(d.h) > 0 {
		d.siftDown(0, last)
	}
	return top.in(d.cur)
}

func (d *delayQueue) push(k timerKey) {
	d.h = append(d.h, k)
	i := len(d.h) - 1
	for i > 0 {
		parent := (i - 1) / 4
		if k >= d.h[parent] {
			break
		}
		d.h[i] = d.h[parent]
		i = parent
	}
	d.h[i] = k
}

// siftDown places k at index i or below.
func (d *delayQueue) siftDown(i int, k timerKey) {
	n := len(d.h)
	for {
		first := 4*i + 1
		if first >= n {
			break
		}
		best := first
		for c := first + 1; c < min(first+4, n); c++ {
			if d.h[c] < d.h[best] {
				best = c
			}
		}
		if d.h[best] >= k {
			break
		}
		d.h[i] = d.h[best]
		i = best
	}
	d.h[i] = k
}
