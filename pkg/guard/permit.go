package guard

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Permit is one admitted call. Call Done exactly once, with the call's error.
type Permit struct {
	g          *Guard
	job        Job
	parent     context.Context // the caller's context
	ctx        context.Context
	cancel     context.CancelCauseFunc
	member     string
	probeEpoch int64
	limit      int64
	local      bool
	// slot and pool: a call on a slot of the batch mode's local pool.
	slot *poolSlot
	pool *pool

	mu      sync.Mutex
	done    bool
	renewer *time.Timer
	// expires is when the lease has expired in Redis at the latest, by the
	// local monotonic clock: the last acquire or renew that Redis answered,
	// counted from when it was sent, plus the lease TTL.
	expires time.Time
	// endOfLife is when the Permit stops renewing (MaxCallLifetime); zero
	// for a Permit under Do, which renews until Done.
	endOfLife time.Time
	// admitted is when the admission's reply arrived: release reports the
	// time since as the call's duration.
	admitted time.Time
	// startBy is when the lease may have expired in Redis at the earliest
	// as the admission knew it, by the local clock: Do does not start the
	// call after it (a process stopped between the admission and the
	// call). Zero for a local Permit. Set once, before the Permit is shared.
	startBy time.Time
}

func (g *Guard) newPermit(ctx context.Context, job Job, adm protocol.Admission, sent time.Time, bounded bool) *Permit {
	p := &Permit{
		g: g, job: job, parent: ctx, member: adm.Member, limit: adm.Limit,
		expires:  sent.Add(g.opts.LeaseTTL),
		startBy:  sent.Add(g.opts.LeaseTTL),
		admitted: time.Now(),
	}
	if bounded {
		p.endOfLife = sent.Add(g.opts.MaxCallLifetime)
	}
	if adm.State == wire.HalfOpen {
		p.probeEpoch = adm.Epoch // only probes are checked against the epoch
	}
	p.ctx, p.cancel = context.WithCancelCause(WithAttempt(ctx, job.attempt()))
	g.metrics.inFlight.Inc()
	// The timer's callback takes p.mu, so it sees p.renewer assigned.
	p.mu.Lock()
	p.renewer = time.AfterFunc(p.nextRenew(g.opts.LeaseTTL/3), p.renew)
	p.mu.Unlock()
	g.hold.add(p)
	return p
}

func (g *Guard) newLocalPermit(ctx context.Context, job Job) *Permit {
	p := &Permit{g: g, job: job, parent: ctx, local: true}
	p.ctx, p.cancel = context.WithCancelCause(WithAttempt(ctx, job.attempt()))
	g.metrics.inFlight.Inc()
	return p
}

// admit completes the Permit of a call that asked at start and was admitted
// on a pool slot at now (batch mode): the pool renews the slot, so a Permit
// from Acquire has only its lifetime to watch.
func (p *Permit) admit(start, now time.Time, bounded bool) *Permit {
	g := p.g
	p.admitted = now
	g.metrics.inFlight.Inc()
	g.metrics.slotWait.Observe(p.admitted.Sub(start).Seconds())
	if bounded {
		p.mu.Lock()
		p.endOfLife = p.admitted.Add(g.opts.MaxCallLifetime)
		p.renewer = time.AfterFunc(g.opts.MaxCallLifetime, p.lifetimeOver)
		p.mu.Unlock()
	}
	return p
}

// lifetimeOver cuts a call on a pool slot at MaxCallLifetime: its context is
// cancelled and its slot leaves the pool without being returned, so that it
// expires within the lease TTL, as a per-call lease that stops renewing.
//
// It holds the Permit's lock throughout, so that Done (finish) comes either
// before it, and the cut does nothing, or after the cut is complete: a
// call that Done ended keeps its outcome, and the slot it gave back, which
// another call may hold by now, is never retired (pool.retire checks the
// slot is still this Permit's).
func (p *Permit) lifetimeOver() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.cancel(ErrLifetimeExceeded)
	p.pool.retire(p.slot, p)
}

// Context is the context the call should run under: it carries the attempt
// number (see AttemptFromContext) and is cancelled with ErrLeaseLost if the
// lease expires before it could be renewed, or, for a Permit from Acquire,
// with ErrLifetimeExceeded after MaxCallLifetime.
func (p *Permit) Context() context.Context { return p.ctx }

// Limit is the fleet-wide limit in force when the call was admitted; 0 for a
// call admitted by the local fail-open cap.
func (p *Permit) Limit() int64 { return p.limit }

// nextRenew is the delay to the next renewal wanted after d, brought forward
// to the end of the Permit's lifetime. p.mu must be held.
func (p *Permit) nextRenew(d time.Duration) time.Duration {
	if p.endOfLife.IsZero() {
		return max(d, 0)
	}
	return max(min(d, time.Until(p.endOfLife)), 0)
}

// renew extends the lease every third of its TTL while the call runs. A renew
// that finds the lease gone reports the loss and cancels the call; it never
// re-acquires silently. A renew that cannot reach Redis tries again sooner;
// once the lease's TTL has passed by the local clock since the last renewal
// Redis answered, the fleet no longer counts the call, so it is cancelled
// then, whether or not Redis answers: a slot taken by another call after
// Redis returns must not run beside this one. Past MaxCallLifetime a Permit
// from Acquire stops renewing and cancels the call.
func (p *Permit) renew() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	g := p.g
	if !p.endOfLife.IsZero() && !time.Now().Before(p.endOfLife) {
		p.cancel(ErrLifetimeExceeded)
		return
	}
	if !time.Now().Before(p.expires) {
		p.lost()
		return
	}
	ctx, cancel := g.redisContext(context.WithoutCancel(p.ctx))
	sent := time.Now()
	held, err := g.proto.Renew(ctx, p.member, g.opts.LeaseTTL)
	cancel()
	switch {
	case err != nil:
		g.metrics.redisErrors.Inc()
		p.renewer.Reset(p.nextRenew(min(g.opts.LeaseTTL/6, time.Until(p.expires))))
	case !held:
		p.lost()
	default:
		p.expires = sent.Add(g.opts.LeaseTTL)
		p.renewer.Reset(p.nextRenew(g.opts.LeaseTTL / 3))
	}
}

// late reports whether the call would start after its lease may have
// expired in Redis: the process stopped (SIGSTOP, a frozen VM, a long pause)
// between the admission and the call, and another call may hold the slot
// by now.
func (p *Permit) late(now time.Time) bool {
	return !p.startBy.IsZero() && !now.Before(p.startBy)
}

// lost cancels a call whose lease is gone. p.mu must be held.
func (p *Permit) lost() {
	p.g.metrics.leaseLost.Inc()
	p.cancel(ErrLeaseLost)
}

// finish marks the Permit done and stops its renewals; false if it already was.
func (p *Permit) finish() bool {
	p.mu.Lock()
	if p.done {
		p.mu.Unlock()
		return false
	}
	p.done = true
	if p.renewer != nil {
		p.renewer.Stop()
	}
	p.mu.Unlock()
	if p.member != "" && p.slot == nil {
		p.g.hold.remove(p)
	}
	return true
}

// abandon releases the slot of a call that ended without Done (its function
// panicked), counting nothing against the dependency. It does nothing after
// Done.
func (p *Permit) abandon() {
	if !p.finish() {
		return
	}
	p.cancel(context.Canceled)
	p.release(protocol.Cancelled)
}

// Done releases the slot and reports the call's outcome in one round trip,
// then decides what happens to the job: nil on success, callErr itself for a
// Permanent error, or an *Error with ActionRetry (after a jittered backoff, or
// no earlier than the server's Retry-After) or ActionPark (the fleet's retry
// budget is spent, or Redis could not say whether it is). A call cut short
// by the caller's cancellation, a lost lease or MaxCallLifetime is not the
// dependency's failure: it is released as protocol.Cancelled, spends no retry
// budget and returns an *Error with ActionDefer and reason ErrCancelled,
// ErrLeaseLost or ErrLifetimeExceeded. If the Options' Classify panics, the
// slot is released as cancelled and the panic goes on. Done works after the
// caller's context is cancelled.
func (p *Permit) Done(callErr error) error {
	if !p.finish() {
		return errors.New("permit is already done")
	}
	outcome := p.classify(callErr)
	p.cancel(context.Canceled)
	if !outcome.Valid() {
		p.release(protocol.Cancelled)
		err := fmt.Errorf("classify returned the unknown outcome %q (want s, f, t or c): the call counted nothing", outcome)
		if callErr != nil {
			err = fmt.Errorf("%w; the call's error: %w", err, callErr)
		}
		return err
	}
	p.release(outcome)

	g := p.g
	if callErr == nil {
		// Done, even if the lease was lost meanwhile (counted when renew
		// found it gone): running the job again would repeat its effects.
		return nil
	}
	switch perm := permanentOf(callErr); {
	case perm != nil:
		return perm.err
	case outcome == protocol.Cancelled:
		reason := ErrCancelled
		switch cause := context.Cause(p.ctx); {
		case errors.Is(cause, ErrLeaseLost):
			reason = ErrLeaseLost
		case errors.Is(cause, ErrLifetimeExceeded):
			reason = ErrLifetimeExceeded
		}
		return &Error{Action: ActionDefer, Reason: reason, After: g.jitterUp(g.opts.DeferDelay), Cause: callErr}
	}
	return g.decideRetry(p.ctx, p.job, callErr)
}

// classify is outcome, for a finished Permit: if the Options' Classify
// panics, the slot is released as cancelled before the panic goes on (Do's
// abandon does nothing once the Permit is finished).
func (p *Permit) classify(callErr error) protocol.Outcome {
	classified := false
	defer func() {
		if !classified {
			p.cancel(context.Canceled)
			p.release(protocol.Cancelled)
		}
	}()
	o := p.outcome(callErr)
	classified = true
	return o
}

// outcome classifies a call that ended with callErr. A call that failed while
// its context was cancelled by the caller or by the guard (lost lease,
// MaxCallLifetime) ended for that reason, whatever the error says, and counts
// as cancelled. A call whose own deadline expired is the Classify's to judge:
// a timeout by default. Must run before Done cancels the context itself.
func (p *Permit) outcome(callErr error) protocol.Outcome {
	if callErr == nil || permanentOf(callErr) != nil || p.ctx.Err() == nil {
		return p.g.opts.Classify(callErr)
	}
	switch cause := context.Cause(p.ctx); {
	case errors.Is(cause, ErrLifetimeExceeded), errors.Is(cause, ErrLeaseLost),
		errors.Is(p.parent.Err(), context.Canceled):
		return protocol.Cancelled
	}
	return p.g.opts.Classify(callErr)
}

// release frees the slot and reports outcome. The release outlives the
// caller's context: a cancelled call still frees its slot. A release whose
// reply is not read may not have run: its lease goes to the forgetter.
func (p *Permit) release(outcome protocol.Outcome) {
	g := p.g
	g.metrics.call(outcome, p.job.attempt())
	g.metrics.inFlight.Dec()
	if p.local {
		<-g.local
		return
	}
	if p.slot != nil {
		// The slot goes back to the pool and the outcome into its next
		// report: no round trip.
		p.pool.put(p.slot, outcome, p.job.attempt(), time.Since(p.admitted))
		return
	}
	took := time.Duration(-1)
	if outcome == protocol.Success && g.timeDue(time.Now()) {
		took = time.Since(p.admitted)
	}
	ctx, cancel := g.redisContext(context.WithoutCancel(p.ctx))
	_, err := g.proto.ReleaseTimed(ctx, p.member, p.probeEpoch, outcome, p.job.attempt(), took)
	cancel()
	if err != nil {
		// A renewal whose reply was lost may have run, so the lease may
		// outlive p.expires: it lasts at most a TTL from now.
		g.metrics.redisErrors.Inc()
		g.forget.add(unread{member: p.member, expires: time.Now().Add(g.opts.LeaseTTL)})
	}
}

// decideRetry asks the fleet's retry budget whether a failed job may retry,
// and when.
func (g *Guard) decideRetry(ctx context.Context, job Job, callErr error) error {
	var allowed bool
	var err error
	if g.budget != nil {
		allowed, err = g.budget.take(ctx)
	} else {
		allowed, err = g.budgetOnce(ctx)
	}
	if errors.Is(err, protocol.ErrNoPolicy) || errors.Is(err, protocol.ErrVersion) {
		// Redis answered: the policy is gone, or its state is of a version
		// this worker does not act on. The job waits as a refusal does,
		// and says why; the call's own error comes with it.
		reason := ErrNoPolicy
		if errors.Is(err, protocol.ErrVersion) {
			reason = ErrVersion
		}
		e := &Error{Action: ActionDefer, Reason: reason, After: g.jitterUp(g.opts.DeferDelay), Cause: errors.Join(err, callErr)}
		g.count(e)
		return e
	}
	if err != nil {
		// Without Redis the budget is unknown: park rather than pile on.
		g.metrics.redisErrors.Inc()
		g.metrics.budgetRefuse.Inc()
		return &Error{Action: ActionPark, Reason: ErrBudgetExhausted, After: retry.Park(g.backoff(), g.rnd), Cause: callErr}
	}
	b := g.backoff()
	if !allowed {
		g.metrics.budgetRefuse.Inc()
		return &Error{Action: ActionPark, Reason: ErrBudgetExhausted, After: retry.Park(b, g.rnd), Cause: callErr}
	}
	g.metrics.retries.Inc()
	after := b.Delay(job.attempt(), g.rnd)
	var ra *retryAfterError
	if errors.As(callErr, &ra) {
		after = max(after, retry.RetryAfter(ra.after, g.rnd))
	}
	return &Error{Action: ActionRetry, Reason: ErrFailed, After: after, Cause: callErr}
}

// budgetOnce asks the fleet's retry budget for one retry, in one round trip.
func (g *Guard) budgetOnce(ctx context.Context) (bool, error) {
	rctx, cancel := g.redisContext(context.WithoutCancel(ctx))
	decision, err := g.proto.RetryBudget(rctx)
	cancel()
	if err != nil {
		return false, err
	}
	g.sawBackoff(decision.Backoff)
	return decision.Allowed, nil
}

// sawBackoff keeps the backoff a budget decision read, or the default when
// it is not valid.
func (g *Guard) sawBackoff(b retry.Backoff) {
	if b.Validate() != nil {
		b = g.fallback
	}
	g.mu.Lock()
	g.lastSeen = b
	g.mu.Unlock()
}

// backoff is the backoff last read from Redis, or the default before any.
func (g *Guard) backoff() retry.Backoff {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.lastSeen
}
