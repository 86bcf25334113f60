package guard

// Refusal mapping: what a caller is told when Redis refuses a call or does
// not answer.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// refusal turns a refused admission into the *Error a caller sees.
func (g *Guard) refusal(adm protocol.Admission) *Error {
	switch adm.Code {
	case protocol.Admitted:
		return nil
	case protocol.RefusedOpen:
		// Past open_until the breaker waits for the controller's next
		// evaluation: never hint 0, or deferred jobs would spin.
		return &Error{Action: ActionDefer, Reason: ErrOpen, After: g.jitterUp(max(adm.Wait, g.opts.ThrottleDelay))}
	case protocol.RefusedThrottled:
		d := g.opts.ThrottleDelay
		if adm.Wait > 0 {
			d = min(adm.Wait, d) // the first lease expires sooner
		}
		return &Error{Action: ActionDefer, Reason: ErrThrottled, After: d/2 + retry.FullJitter(d/2, g.rnd)}
	case protocol.RefusedRate:
		// Never before the next token, and spread upward like the other
		// refusals so that the jobs refused together do not return together.
		return &Error{Action: ActionDefer, Reason: ErrRateLimited, After: g.jitterUp(adm.Wait)}
	case protocol.RefusedSuperseded:
		return &Error{Action: ActionDrop, Reason: ErrSuperseded}
	case protocol.RefusedLate:
		// Refused as late twice in a row, though the replies came in time.
		return &Error{Action: ActionDefer, Reason: ErrRedisUnavailable, After: g.jitterUp(g.opts.DeferDelay),
			Cause: errors.New("redis refused the acquisition as late twice: its clock is not where the guard estimates it")}
	}
	return &Error{Action: ActionDefer, Reason: ErrRedisUnavailable, After: g.jitterUp(g.opts.DeferDelay),
		Cause: fmt.Errorf("unknown admission code %v", adm.Code)}
}

func (g *Guard) count(e *Error) {
	switch e.Reason {
	case ErrSuperseded:
		g.metrics.superseded.Inc()
	default:
		if c, ok := g.metrics.throttled[e.Reason]; ok {
			c.Inc()
		}
	}
}

// unavailable handles a failed acquisition: the caller gave up, no policy,
// or Redis not answering. It fails closed unless FailOpenLimit admits the
// call locally.
func (g *Guard) unavailable(ctx context.Context, job Job, err error) (*Permit, error) {
	if callerEnded(ctx) {
		// The caller's cancellation or deadline ended the wait, not Redis:
		// no Redis error, and no fail-open admission for a caller that is
		// out of time.
		return nil, callerErr(ctx)
	}
	if errors.Is(err, protocol.ErrNoPolicy) || errors.Is(err, protocol.ErrVersion) {
		reason := ErrNoPolicy
		if errors.Is(err, protocol.ErrVersion) {
			reason = ErrVersion
		}
		e := &Error{Action: ActionDefer, Reason: reason, After: g.jitterUp(g.opts.DeferDelay), Cause: err}
		g.count(e)
		return nil, e
	}
	g.metrics.redisErrors.Inc()
	if g.local != nil {
		select {
		case g.local <- struct{}{}:
			g.metrics.failOpen.Inc()
			return g.newLocalPermit(ctx, job), nil
		default:
		}
	}
	e := &Error{Action: ActionDefer, Reason: ErrRedisUnavailable, After: g.jitterUp(g.opts.DeferDelay), Cause: err}
	g.count(e)
	return nil, e
}

// jitterUp spreads a delay upward by up to half, so refusals that share a
// hint do not come back together.
func (g *Guard) jitterUp(d time.Duration) time.Duration {
	return retry.RetryAfter(d, g.rnd)
}
