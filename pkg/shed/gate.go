package shed

import (
	"container/list"
	"context"
	"errors"
	"sync"
	"time"
)

// gate is the global admission limit with its bounded FIFO queue. The fast
// path is one uncontended mutex; only a request that has to wait allocates.
type gate struct {
	maxInFlight  int64
	queueSize    int
	queueTimeout time.Duration
	// limit returns the effective limit, <= maxInFlight; it may be called
	// with mu held.
	limit func() int64

	mu           sync.Mutex
	inFlight     int64
	waiters      list.List // of *waiter, oldest first
	peakInFlight int64
	peakQueued   int64
}

// waiter is one queued request. ready is closed when it is granted a slot.
type waiter struct {
	ready   chan struct{}
	granted bool
}

// take counts one more request in flight; g.mu must be held.
func (g *gate) take() {
	g.inFlight++
	g.peakInFlight = max(g.peakInFlight, g.inFlight)
}

// acquire takes a slot, waiting in the queue if there is room in it. It
// returns "" when admitted, or why not: ReasonOverload or ReasonRamp when the
// queue is full (ramp while the ramp holds the limit below maxInFlight), or
// ReasonQueueTimeout, ReasonDeadline or ReasonCanceled when the wait ended
// without a slot.
func (g *gate) acquire(ctx context.Context) Reason {
	limit := g.limit()
	g.mu.Lock()
	g.grant(limit) // the limit may have risen since the last release
	if g.waiters.Len() == 0 && g.inFlight < limit {
		g.take()
		g.mu.Unlock()
		return ""
	}
	if g.waiters.Len() >= g.queueSize {
		g.mu.Unlock()
		if limit < g.maxInFlight {
			return ReasonRamp
		}
		return ReasonOverload
	}
	w := &waiter{ready: make(chan struct{})}
	e := g.waiters.PushBack(w)
	g.peakQueued = max(g.peakQueued, int64(g.waiters.Len()))
	g.mu.Unlock()
	return g.wait(ctx, w, e)
}

// wait blocks until w is granted a slot, the queue timeout passes or ctx is
// done.
func (g *gate) wait(ctx context.Context, w *waiter, e *list.Element) Reason {
	timer := time.NewTimer(g.queueTimeout)
	defer timer.Stop()
	reason := ReasonQueueTimeout
	select {
	case <-w.ready:
		return ""
	case <-timer.C:
	case <-ctx.Done():
		reason = ReasonCanceled
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			reason = ReasonDeadline
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !w.granted {
		g.waiters.Remove(e)
		return reason
	}
	if reason == ReasonQueueTimeout {
		return "" // granted just as the timer fired: take the slot
	}
	// Granted as the caller gave up: the slot is ours, but nobody wants it.
	g.inFlight--
	g.grant(g.limit())
	return reason
}

// release frees a slot and hands free slots to queued requests.
func (g *gate) release() {
	limit := g.limit()
	g.mu.Lock()
	g.inFlight--
	g.grant(limit)
	g.mu.Unlock()
}

// grant hands free slots under limit to the oldest waiters; g.mu must be
// held.
func (g *gate) grant(limit int64) {
	for g.inFlight < limit && g.waiters.Len() > 0 {
		w := g.waiters.Remove(g.waiters.Front()).(*waiter)
		w.granted = true
		g.take()
		close(w.ready)
	}
}

// gateStats is a consistent snapshot of the gate.
type gateStats struct {
	inFlight, queued, peakInFlight, peakQueued int64
}

func (g *gate) stats() gateStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	return gateStats{
		inFlight:     g.inFlight,
		queued:       int64(g.waiters.Len()),
		peakInFlight: g.peakInFlight,
		peakQueued:   g.peakQueued,
	}
}
