package guard

// Admission: a call's way from Acquire to a Permit or a refusal, and the
// acquisition's one Redis round trip.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// Acquire admits one call or refuses it. On admission the caller must call
// Done on the Permit exactly once, with the call's error. When ctx is
// cancelled or its deadline passes before an answer, Acquire returns
// ctx.Err() (context.DeadlineExceeded for a deadline, even before the
// context's timer has run): the caller's own doing, not a refusal, not a
// Redis error, and never a FailOpenLimit admission. With WaitForSlot, a
// deadline that ends the wait for a slot returns the refusal being waited
// out. The Permit renews its lease for at most Options.MaxCallLifetime.
func (g *Guard) Acquire(ctx context.Context, job Job) (*Permit, error) {
	return g.admit(ctx, job, true)
}

// admit is Acquire; bounded limits the Permit's renewals to
// MaxCallLifetime, for a Permit whose holder may never end it. Do ends every
// Permit it takes, so its Permits renew for as long as the call runs. In
// batch mode a call without a job key takes a slot of the local pool,
// unless the pool sends it per call.
func (g *Guard) admit(ctx context.Context, job Job, bounded bool) (*Permit, error) {
	if err := g.check(ctx, job); err != nil {
		return nil, err
	}
	if g.pool != nil && job.Key == "" {
		p, perCall, err := g.pool.admit(ctx, job, bounded)
		if !perCall {
			return p, err
		}
	}
	return g.acquire(ctx, job, bounded)
}

// check refuses a call before anything else: the caller gave up, bad input,
// or a job past its deadline.
func (g *Guard) check(ctx context.Context, job Job) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if job.Attempt < 0 {
		return fmt.Errorf("job attempt must not be negative, got %d", job.Attempt)
	}
	if !job.Deadline.IsZero() && !g.opts.Clock.Now().Before(job.Deadline) {
		g.metrics.stale.Inc()
		return &Error{Action: ActionDrop, Reason: ErrStale}
	}
	if job.Key != "" && (job.Version < 0 || job.Version > protocol.MaxJobVersion) {
		return fmt.Errorf("job version must be in [0, 2^53), got %d", job.Version)
	}
	return nil
}

// acquire admits a call per call: one acquisition round trip (or more,
// waiting for a slot).
func (g *Guard) acquire(ctx context.Context, job Job, bounded bool) (*Permit, error) {
	args := protocol.AcquireArgs{
		TTL:        g.opts.LeaseTTL,
		JobKey:     job.Key,
		JobVersion: job.Version,
		JobTTL:     g.opts.JobTTL,
		CallerID:   g.caller,
	}
	if g.pool != nil && job.Key != "" && g.pool.contends() {
		// The process already contends in the fair split by its pool id:
		// its keyed calls, refused for want of a slot, count with the
		// anonymous per-call callers (one contender for the whole fleet),
		// not as a second contender of its own. pool.lua would need to
		// know the two ids for one process to count it once.
		args.CallerID = ""
	}
	waitCtx, cancel := g.waitContext(ctx)
	defer cancel()
	start := time.Now()
	g.reg.maybe(start)
	var pause time.Duration
	var waiting *Error // the refusal the caller is waiting out, if any
	for {
		adm, sent, err := g.acquireOnce(ctx, args)
		if err != nil {
			if waiting != nil && callerEnded(ctx) && !errors.Is(ctx.Err(), context.Canceled) {
				// The caller's deadline, not Redis, ended the round trip
				// of a wait for a slot: a deadline gets the refusal, as
				// between polls.
				g.count(waiting)
				return nil, waiting
			}
			return g.unavailable(ctx, job, err)
		}
		refusal := g.refusal(adm)
		if ctx.Err() != nil && (refusal == nil || errors.Is(ctx.Err(), context.Canceled)) {
			// The caller gave up while Redis answered (go-redis reads on
			// until the deadline, not the cancel): a slot goes back at once.
			if refusal == nil {
				g.newPermit(ctx, job, adm, sent, bounded).abandon()
			}
			return nil, ctx.Err()
		}
		if refusal == nil {
			g.metrics.slotWait.Observe(time.Since(start).Seconds())
			return g.newPermit(ctx, job, adm, sent, bounded), nil
		}
		if !g.opts.WaitForSlot || refusal.Action != ActionDefer || refusal.Reason == ErrOpen {
			g.count(refusal)
			return nil, refusal
		}
		waiting = refusal
		// Wait without hot polling: capped exponential steps with full jitter,
		// never past the next lease expiry or rate slot the server hinted at.
		pause = min(max(2*pause, 5*time.Millisecond), 250*time.Millisecond)
		sleep := retry.FullJitter(pause, g.rnd)
		if refusal.After > 0 && refusal.After < sleep {
			sleep = refusal.After
		}
		if !sleepCtx(waitCtx, sleep) {
			if errors.Is(ctx.Err(), context.Canceled) {
				return nil, ctx.Err() // the caller gave up; a deadline gets the refusal
			}
			g.count(refusal)
			return nil, refusal
		}
	}
}

// acquireOnce asks Redis for a slot, under a fresh lease id, and returns the
// local time the request was sent (the lease's expiry counts from it).
//
// The request carries the Redis time after which its reply would no longer
// be read; Redis refuses it then, writing nothing. If the reply is not read
// all the same (it ran in time but arrived late, the caller cancelled, the
// connection broke), the lease is handed to the forgetter. A reply that
// arrived in time but was refused as late means Redis's clock moved: the
// offset estimate starts again and the request is made once more.
func (g *Guard) acquireOnce(ctx context.Context, args protocol.AcquireArgs) (protocol.Admission, time.Time, error) {
	for retried := false; ; retried = true {
		rctx, cancel := g.redisContext(ctx)
		args.LeaseID = protocol.NewLeaseID() // never reuse an id that may be forgotten
		sentAt := time.Now()
		sent := g.clock.now()
		dl, _ := rctx.Deadline() // always set: redisContext has a timeout
		var late time.Duration   // how long after sentAt Redis may still run it
		args.Deadline, late = g.clock.deadline(sent, time.Until(dl))
		adm, err := g.proto.Acquire(rctx, args)
		cancel()
		switch {
		case errors.Is(err, protocol.ErrNoPolicy) || errors.Is(err, protocol.ErrVersion):
			// Redis answered: nothing was written.
		case errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrClosed):
			// The request never left the client.
		case err != nil:
			// If it ran, it ran by its deadline: its lease ends a TTL later.
			g.forget.add(unread{member: args.LeaseID, expires: sentAt.Add(late + args.TTL)})
		case adm.Code == protocol.RefusedLate:
			g.clock.reset(sent, adm.Now)
			if !retried {
				continue
			}
		default:
			g.clock.observe(sent, adm.Now)
		}
		return adm, sentAt, err
	}
}
