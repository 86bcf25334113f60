package guard

// Redis round trips: the bounds every round trip runs under, and how a
// caller's own deadline is told from Redis not answering.

import (
	"context"
	"time"
)

// callerEnded reports whether the caller's context has ended: cancelled, or
// past its deadline. The deadline is read from the clock as well as from Err:
// go-redis makes it the connection's I/O deadline, so a round trip can fail
// with an I/O timeout at the deadline before the context's timer has run and
// set Err, which on a starved machine can be late by many milliseconds.
func callerEnded(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// callerErr is why the caller's context ended (callerEnded): its Err, or
// context.DeadlineExceeded while its timer has not run yet.
func callerErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return context.DeadlineExceeded
}

// redisContext bounds one Redis round trip.
func (g *Guard) redisContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, g.opts.RedisTimeout)
}

func (g *Guard) waitContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if g.opts.MaxWait > 0 {
		return context.WithTimeout(ctx, g.opts.MaxWait)
	}
	return ctx, func() {}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
