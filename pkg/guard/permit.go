package guard

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// Permit is one admitted call. Call Done exactly once, with the call's error.
type Permit struct {
	g          *Guard
	job        Job
	ctx        context.Context
	cancel     context.CancelCauseFunc
	member     string
	probeEpoch int64
	limit      int64
	local      bool
	renewer    *time.Timer

	mu   sync.Mutex
	done bool
}

func (g *Guard) newPermit(ctx context.Context, job Job, adm protocol.Admission) *Permit {
	p := &Permit{g: g, job: job, member: adm.Member, limit: adm.Limit}
	if adm.State == protocol.HalfOpen {
		p.probeEpoch = adm.Epoch // only probes are checked against the epoch
	}
	p.ctx, p.cancel = context.WithCancelCause(WithAttempt(ctx, job.attempt()))
	// The timer's callback takes p.mu, so it sees p.renewer assigned.
	p.mu.Lock()
	p.renewer = time.AfterFunc(g.opts.LeaseTTL/3, p.renew)
	p.mu.Unlock()
	return p
}

func (g *Guard) newLocalPermit(ctx context.Context, job Job) *Permit {
	p := &Permit{g: g, job: job, local: true}
	p.ctx, p.cancel = context.WithCancelCause(WithAttempt(ctx, job.attempt()))
	return p
}

// Context is the context the call should run under: it carries the attempt
// number (see AttemptFromContext) and is cancelled with ErrLeaseLost if the
// lease expires before it could be renewed.
func (p *Permit) Context() context.Context { return p.ctx }

// Limit is the fleet-wide limit in force when the call was admitted; 0 for a
// call admitted by the local fail-open cap.
func (p *Permit) Limit() int64 { return p.limit }

// renew extends the lease every third of its TTL while the call runs. A renew
// that finds the lease gone reports the loss and cancels the call; it never
// re-acquires silently. A renew that cannot reach Redis tries again at the
// next tick: the lease is still valid until its TTL runs out.
func (p *Permit) renew() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	ctx, cancel := p.g.redisContext(context.WithoutCancel(p.ctx))
	held, err := p.g.proto.Renew(ctx, p.member, p.g.opts.LeaseTTL)
	cancel()
	switch {
	case err != nil:
		p.g.metrics.redisErrors.Inc()
	case !held:
		p.g.metrics.leaseLost.Inc()
		p.cancel(ErrLeaseLost)
		return
	}
	p.renewer.Reset(p.g.opts.LeaseTTL / 3)
}

// Done releases the slot and reports the call's outcome in one round trip,
// then decides what happens to the job: nil on success, callErr itself for a
// Permanent error, or an *Error with ActionRetry (after a jittered backoff, or
// no earlier than the server's Retry-After) or ActionPark (the fleet's retry
// budget is spent, or Redis could not say whether it is). Done works after
// the caller's context is cancelled.
func (p *Permit) Done(callErr error) error {
	p.mu.Lock()
	if p.done {
		p.mu.Unlock()
		return errors.New("permit is already done")
	}
	p.done = true
	if p.renewer != nil {
		p.renewer.Stop()
	}
	p.mu.Unlock()
	p.cancel(context.Canceled)

	g := p.g
	outcome := g.opts.Classify(callErr)
	g.metrics.call(outcome, p.job.attempt())
	if p.local {
		<-g.local
	} else {
		// The release outlives the caller's context: a cancelled call still
		// frees its slot and reports.
		ctx, cancel := g.redisContext(context.WithoutCancel(p.ctx))
		_, err := g.proto.Release(ctx, p.member, p.probeEpoch, outcome, p.job.attempt())
		cancel()
		if err != nil {
			g.metrics.redisErrors.Inc()
		}
	}

	var perm *permanentError
	switch {
	case callErr == nil:
		// Done, even if the lease was lost meanwhile (counted when renew
		// found it gone): running the job again would repeat its effects.
		return nil
	case errors.As(callErr, &perm):
		return perm.err
	}
	return g.decideRetry(p.ctx, p.job, callErr)
}

// decideRetry asks the fleet's retry budget whether a failed job may retry,
// and when.
func (g *Guard) decideRetry(ctx context.Context, job Job, callErr error) error {
	rctx, cancel := g.redisContext(context.WithoutCancel(ctx))
	decision, err := g.proto.RetryBudget(rctx)
	cancel()
	if err != nil {
		// Without Redis the budget is unknown: park rather than pile on.
		g.metrics.redisErrors.Inc()
		g.metrics.budgetRefuse.Inc()
		return &Error{Action: ActionPark, Reason: ErrBudgetExhausted, After: retry.Park(g.backoff(), g.rnd), Cause: callErr}
	}
	b := decision.Backoff
	if b.Validate() != nil {
		b = g.fallback
	}
	g.mu.Lock()
	g.lastSeen = b
	g.mu.Unlock()
	if !decision.Allowed {
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

// backoff is the backoff last read from Redis, or the default before any.
func (g *Guard) backoff() retry.Backoff {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.lastSeen
}
