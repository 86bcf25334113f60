package replay

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spillway-dev/spillway/pkg/guard"
)

// ledger accounts for every job: each one created ends completed, stale or
// superseded, or is still pending; nothing is lost.
type ledger struct {
	created, completed, stale, superseded, parked atomic.Int64
	calls                                         atomic.Int64
	// backlog counts pending jobs created before the recovery;
	// backlogDone those of them that completed.
	backlog, backlogDone atomic.Int64
	recovered            atomic.Bool
}

func (l *ledger) add(j *Job) {
	l.created.Add(1)
	if !l.recovered.Load() {
		j.backlog = true
		l.backlog.Add(1)
	}
}

// finish records a job's end in the counter ended.
func (l *ledger) finish(j *Job, ended *atomic.Int64) {
	ended.Add(1)
	if j.backlog {
		l.backlog.Add(-1)
		if ended == &l.completed {
			l.backlogDone.Add(1)
		}
	}
}

// pending is the number of jobs created and not yet ended.
func (l *ledger) pending() int64 {
	return l.created.Load() - l.completed.Load() - l.stale.Load() - l.superseded.Load()
}

// worker runs jobs from the queue until stopped.
type worker struct {
	queue     *Queue
	ledger    *ledger
	guard     *guard.Guard // nil: the unprotected fleet
	client    *http.Client
	url       string
	naiveWait time.Duration
}

func (w *worker) run(ctx context.Context) {
	for {
		j, ok := w.queue.Pop(ctx)
		if !ok {
			return
		}
		if w.guard == nil {
			w.runNaive(ctx, j)
		} else {
			w.runGuarded(ctx, j)
		}
	}
}

// runNaive is the fleet without Spillway: call, and on failure retry almost
// at once, as the seeds' incidents did.
func (w *worker) runNaive(ctx context.Context, j *Job) {
	w.ledger.calls.Add(1)
	if err := w.call(ctx, 0); err != nil {
		j.Attempt++
		w.queue.Push(j, time.Now().Add(w.naiveWait))
		return
	}
	w.ledger.finish(j, &w.ledger.completed)
}

// runGuarded goes through the worker library and does what it decides.
func (w *worker) runGuarded(ctx context.Context, j *Job) {
	p, err := w.guard.Acquire(ctx, guard.Job{Attempt: j.Attempt, Deadline: j.Deadline, Key: j.Key, Version: j.Version})
	if err == nil {
		w.ledger.calls.Add(1)
		err = p.Done(w.call(p.Context(), p.Limit()))
	}
	if err == nil {
		w.ledger.finish(j, &w.ledger.completed)
		return
	}
	action, after, decided := guard.Decide(err)
	if !decided {
		if ctx.Err() != nil {
			// Shutting down: the job goes back as it was.
			w.queue.Push(j, time.Now())
			return
		}
		w.ledger.finish(j, &w.ledger.completed) // a permanent answer ends the job
		return
	}
	now := time.Now()
	switch action {
	case guard.ActionDrop:
		if errors.Is(err, guard.ErrStale) {
			w.ledger.finish(j, &w.ledger.stale)
		} else {
			w.ledger.finish(j, &w.ledger.superseded)
		}
	case guard.ActionDefer:
		w.queue.Push(j, now.Add(after))
	case guard.ActionRetry:
		j.Attempt++
		w.queue.Push(j, now.Add(after))
	case guard.ActionPark:
		if !j.parked {
			j.parked = true
			w.ledger.parked.Add(1)
		}
		j.Attempt++
		w.queue.Push(j, now.Add(after))
	}
}

func (w *worker) call(ctx context.Context, limit int64) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.url, nil)
	if err != nil {
		return err
	}
	if limit > 0 {
		req.Header.Set(AdmittedLimitHeader, strconv.FormatInt(limit, 10))
	}
	resp, err := w.client.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	return guard.CheckResponse(resp)
}

// pool is a set of worker goroutines that can grow and shrink, like pods.
type pool struct {
	mu      sync.Mutex
	ctx     context.Context
	newW    func() *worker
	stops   []context.CancelFunc
	wg      sync.WaitGroup
	running atomic.Int64
}

func newPool(ctx context.Context, newW func() *worker) *pool {
	return &pool{ctx: ctx, newW: newW}
}

// scale sets the number of workers.
func (p *pool) scale(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.stops) < n {
		ctx, cancel := context.WithCancel(p.ctx)
		p.stops = append(p.stops, cancel)
		w := p.newW()
		p.running.Add(1)
		p.wg.Go(func() {
			defer p.running.Add(-1)
			w.run(ctx)
		})
	}
	for len(p.stops) > n {
		last := len(p.stops) - 1
		p.stops[last]()
		p.stops = p.stops[:last]
	}
}

func (p *pool) size() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.stops)
}

func (p *pool) stop() {
	p.scale(0)
	p.wg.Wait()
}
