package replay

import (
	"container/heap"
	"context"
	"sync"
	"time"
)

// Job is one unit of work in the replay's queue.
type Job struct {
	ID      int64
	Attempt int
	Created time.Time
	// Deadline, when set, makes the job stale once passed.
	Deadline time.Time
	// Key and Version, when Key is set, make older versions superseded.
	Key     string
	Version int64
	parked  bool
	backlog bool // created before the recovery
	due     time.Time
}

// Queue holds ready jobs in arrival order and delayed jobs until they are due,
// like a job framework's queue with scheduled retries.
type Queue struct {
	mu      sync.Mutex
	ready   []*Job
	delayed delayHeap
}

// Push adds j, runnable from due on.
func (q *Queue) Push(j *Job, due time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	j.due = due
	if !due.After(time.Now()) {
		q.ready = append(q.ready, j)
		return
	}
	heap.Push(&q.delayed, j)
}

// Len is the number of jobs waiting, ready or delayed: what an autoscaler on
// queue depth sees.
func (q *Queue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.ready) + len(q.delayed)
}

// Pop takes the next ready job, waiting for one until ctx ends.
func (q *Queue) Pop(ctx context.Context) (*Job, bool) {
	for ctx.Err() == nil {
		j, wait := q.tryPop(time.Now())
		if j != nil {
			return j, true
		}
		t := time.NewTimer(min(wait, 5*time.Millisecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, false
		case <-t.C:
		}
	}
	return nil, false
}

func (q *Queue) tryPop(now time.Time) (*Job, time.Duration) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.delayed) > 0 && !q.delayed[0].due.After(now) {
		q.ready = append(q.ready, heap.Pop(&q.delayed).(*Job))
	}
	if len(q.ready) > 0 {
		j := q.ready[0]
		q.ready[0] = nil
		q.ready = q.ready[1:]
		return j, 0
	}
	if len(q.delayed) > 0 {
		return nil, q.delayed[0].due.Sub(now)
	}
	return nil, time.Hour
}

type delayHeap []*Job

func (h delayHeap) Len() int           { return len(h) }
func (h delayHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h delayHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *delayHeap) Push(x any)        { *h = append(*h, x.(*Job)) }
func (h *delayHeap) Pop() any {
	old := *h
	j := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return j
}
