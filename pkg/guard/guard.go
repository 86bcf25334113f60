// Package guard is the worker side of Spillway: every protection the fleet
// puts on calls to one dependency, enforced at the moment of each call through
// Redis (docs/protocol.md), so that the limits the controller publishes hold
// across every pod.
//
// A call goes deadline → supersession → breaker → rate → slot → call →
// release and report. Refusals and failures come back as *Error values that a
// job framework maps to an action: defer (no attempt consumed), retry after a
// delay, park, or drop.
//
//	g, err := guard.New(rdb, "mail/template-api", guard.Options{})
//	...
//	defer g.Close()
//	err = g.Do(ctx, guard.Job{Attempt: attempt, Deadline: enqueuedAt.Add(5 * time.Minute)},
//		func(ctx context.Context) error { return render(ctx, tmpl) })
//	switch action, after, _ := guard.Decide(err); action {
//	case guard.ActionDefer, guard.ActionRetry, guard.ActionPark:
//		job.RetryIn(after)
//	case guard.ActionDrop:
//		job.Ack()
//	}
//
// The package imports go-redis, prometheus/client_golang and the standard
// library; never controller-runtime or client-go.
package guard

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// Options tune a Guard. The zero value is valid: every field has a default.
type Options struct {
	// LeaseTTL bounds how long a worker that dies keeps its slot. Calls longer
	// than a third of it renew their lease. A call whose lease could not be
	// renewed for LeaseTTL (Redis unreachable), counted by the worker's own
	// clock from the last renewal it sent, is cancelled with ErrLeaseLost:
	// by then the fleet no longer counts it. Default 30s: since unread
	// acquisitions no longer hold slots for the TTL, it only decides how
	// long a killed pod's slots stay taken, against how long Redis may be
	// away (a Sentinel failover takes seconds to tens of seconds) before
	// long calls are cancelled. The fleet of
	// TestFleetOnDefaultsUsesItsSlotsUnderLoad (8 × 64 goroutines, limit 40
	// then 10, 50ms calls) left no lease behind at 30s.
	LeaseTTL time.Duration
	// RedisTimeout bounds every Redis round trip a call waits for, and so
	// how long a call waits before it is refused when Redis does not
	// answer. Default 250ms. The client must have ContextTimeoutEnabled so
	// the bound reaches the socket.
	//
	// The default is measured (docs/benchmarks.md): the fleet of
	// TestFleetOnDefaultsUsesItsSlotsUnderLoad on two shared, loaded cores
	// (load average 7-15, a core burnt) saw 5-11% of its
	// acquisitions refused as Redis unavailable at 50ms, 1-3% at 100ms and
	// at most 1% at 250ms (0 at 500ms), acquire p99 about 100-200ms: a
	// starved process (CPU-throttled pods wait out 100ms CFS periods) reads
	// its reply late, not Redis. Lower it on quiet machines for faster
	// fail-closed refusals.
	//
	// An acquisition whose reply is not read (RedisTimeout passed, the
	// caller cancelled, the connection broke) holds no slot for long: it
	// carries a deadline in Redis time (the guard's estimate of Redis's
	// clock plus the round trip's timeout; before the first reply, the
	// local wall clock plus the timeout plus 1s of tolerated skew), past
	// which Redis refuses it and writes nothing, and the guard hands its
	// lease to a background forgetter (Close stops it) that makes it stop
	// counting. Such a lease holds its slot until Redis answers the forget:
	// at most about 1s after Redis answers again (the forgetter retries
	// every 500ms at most while Redis does not answer), and never longer
	// than the lease TTL after its deadline. A release whose reply is not
	// read is forgotten the same way. An admission that arrives after the
	// caller cancelled is released at once.
	RedisTimeout time.Duration
	// MaxCallLifetime bounds how long a Permit renews its lease: a holder
	// that never calls Done (a leaked Permit) keeps its slot at most
	// MaxCallLifetime plus LeaseTTL. At MaxCallLifetime the Permit's
	// context is cancelled with ErrLifetimeExceeded and a call that ends
	// with an error then counts as a timeout. Default 10m.
	MaxCallLifetime time.Duration
	// WaitForSlot makes Acquire wait, bounded by its context and MaxWait, when
	// every slot is held or the rate is reached, instead of returning an
	// ActionDefer error at once.
	WaitForSlot bool
	// MaxWait bounds the wait for a slot; 0 means only the context bounds it.
	MaxWait time.Duration
	// FailOpenLimit, when above 0, admits up to that many concurrent calls per
	// process while Redis is unavailable, instead of refusing every call (the
	// default, fail closed). Such calls report no outcome to the fleet.
	FailOpenLimit int
	// JobTTL is how long the newest version of a job key is remembered.
	// Default 24h.
	JobTTL time.Duration
	// DeferDelay is the After of refusals that carry no better hint (Redis
	// unavailable, no policy). Default 1s, jittered.
	DeferDelay time.Duration
	// ThrottleDelay caps the After of a refusal because every slot is held:
	// a slot usually frees long before the first lease expires. Default
	// 200ms; the After is drawn from its upper half, so deferred jobs do not
	// come back together.
	ThrottleDelay time.Duration
	// Classify maps a call's error to the outcome reported to the fleet.
	// Default: nil is a success, a Permanent error a success (the dependency
	// answered), context.DeadlineExceeded a timeout, anything else a failure.
	Classify func(error) protocol.Outcome
	// Registerer receives the guard's metrics; nil registers none.
	Registerer prometheus.Registerer
	// Rand draws the jitter (retry.FullJitter). Default math/rand/v2's
	// global source; a seeded source is made safe for concurrent use by the
	// guard.
	Rand retry.Rand
	// Clock is the clock a job's deadline is compared with. Default
	// clock.System.
	Clock clock.Clock
}

// Guard enforces one dependency's fleet-wide limits. It is safe for
// concurrent use; create one per dependency and share it.
type Guard struct {
	proto    *protocol.Client
	dep      protocol.Dependency
	opts     Options
	metrics  *metrics
	rnd      retry.Rand
	local    chan struct{}
	fallback retry.Backoff

	clock  *redisClock
	forget *forgetter

	mu       sync.Mutex
	lastSeen retry.Backoff
}

// New returns a Guard for the dependency "namespace/name" (the
// DependencyPolicy's namespace and name) over rdb.
func New(rdb redis.UniversalClient, dependency string, opts Options) (*Guard, error) {
	if rdb == nil {
		return nil, errors.New("redis client must not be nil")
	}
	dep, err := protocol.ParseDependency(dependency)
	if err != nil {
		return nil, err
	}
	if err := checkClient(rdb); err != nil {
		return nil, err
	}
	opts, err = opts.withDefaults()
	if err != nil {
		return nil, err
	}
	proto, err := protocol.NewClient(rdb, dep)
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(opts.Registerer, dep.String())
	if err != nil {
		return nil, err
	}
	g := &Guard{
		proto:    proto,
		dep:      dep,
		opts:     opts,
		metrics:  m,
		rnd:      opts.Rand,
		fallback: retry.Backoff{Base: time.Second, Max: 5 * time.Minute, Jitter: retry.JitterFull},
		clock:    newRedisClock(),
		forget:   newForgetter(proto, opts.RedisTimeout, m),
	}
	g.lastSeen = g.fallback
	if opts.FailOpenLimit > 0 {
		g.local = make(chan struct{}, opts.FailOpenLimit)
	}
	return g, nil
}

func (o Options) withDefaults() (Options, error) {
	def := func(d *time.Duration, name string, v time.Duration) error {
		if *d < 0 {
			return fmt.Errorf("%s must not be negative, got %v", name, *d)
		}
		if *d == 0 {
			*d = v
		}
		return nil
	}
	for _, f := range []struct {
		d    *time.Duration
		name string
		v    time.Duration
	}{
		{&o.LeaseTTL, "LeaseTTL", 30 * time.Second},
		{&o.RedisTimeout, "RedisTimeout", 250 * time.Millisecond},
		{&o.MaxCallLifetime, "MaxCallLifetime", 10 * time.Minute},
		{&o.JobTTL, "JobTTL", 24 * time.Hour},
		{&o.DeferDelay, "DeferDelay", time.Second},
		{&o.ThrottleDelay, "ThrottleDelay", 200 * time.Millisecond},
	} {
		if err := def(f.d, f.name, f.v); err != nil {
			return o, err
		}
	}
	if o.MaxWait < 0 {
		return o, fmt.Errorf("MaxWait must not be negative, got %v", o.MaxWait)
	}
	if o.LeaseTTL < 10*time.Millisecond {
		return o, fmt.Errorf("LeaseTTL must be at least 10ms, got %v", o.LeaseTTL)
	}
	if o.FailOpenLimit < 0 {
		return o, fmt.Errorf("FailOpenLimit must not be negative, got %d", o.FailOpenLimit)
	}
	if o.Classify == nil {
		o.Classify = Classify
	}
	if o.Rand != nil { // nil draws from math/rand/v2's global source
		o.Rand = &lockedRand{r: o.Rand}
	}
	if o.Clock == nil {
		o.Clock = clock.System{}
	}
	return o, nil
}

// checkClient refuses a client whose socket deadlines ignore the context: with
// it, RedisTimeout could not bound a call to a Redis that stopped answering.
func checkClient(rdb redis.UniversalClient) error {
	var enabled bool
	switch c := rdb.(type) {
	case *redis.Client:
		enabled = c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		enabled = c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		enabled = c.Options().ContextTimeoutEnabled
	default:
		return nil
	}
	if !enabled {
		return errors.New("redis client must set ContextTimeoutEnabled: true, so that RedisTimeout bounds every call")
	}
	return nil
}

// Close stops the guard's background work: the forgetting of leases whose
// reply was never read (see Options.RedisTimeout). Leases it had not
// forgotten yet expire with their TTL. Permits already admitted keep renewing
// until Done. Call it when the guard is no longer used; it is safe to call
// more than once.
func (g *Guard) Close() {
	g.forget.close()
}

// Dependency is the dependency this guard protects.
func (g *Guard) Dependency() protocol.Dependency { return g.dep }

// Job describes one run of a job.
type Job struct {
	// Attempt is this run's attempt number: 1 for the first call, 2 for the
	// first retry. Deferred runs (ActionDefer) keep their attempt number.
	Attempt int
	// Deadline, when set, drops the job as stale once passed. Leave it zero
	// for work that never expires (payments, orders).
	Deadline time.Time
	// Key and Version, when Key is set, deduplicate superseded work: a run is
	// dropped if a newer version of Key has run or been announced with
	// Supersede. Versions are integers in [0, 2^53).
	Key     string
	Version int64
}

func (j Job) attempt() int { return max(j.Attempt, 1) }

// Do runs fn once under the fleet's protections and returns nil, fn's
// Permanent error, or an *Error saying what to do with the job. If fn panics,
// its slot is released at once, counting nothing against the dependency, and
// the panic goes on to the caller.
func (g *Guard) Do(ctx context.Context, job Job, fn func(context.Context) error) error {
	if fn == nil {
		return errors.New("function must not be nil")
	}
	p, err := g.Acquire(ctx, job)
	if err != nil {
		return err
	}
	// Runs only when fn panics (or calls runtime.Goexit): Done has not run.
	// Not recovering keeps the panic's own stack.
	defer p.abandon()
	return p.Done(fn(p.Context()))
}

// Supersede announces that version of the job key exists (call it when the
// newer job is enqueued), so queued older versions are dropped before they
// call the dependency.
func (g *Guard) Supersede(ctx context.Context, key string, version int64) error {
	rctx, cancel := g.redisContext(ctx)
	defer cancel()
	if _, err := g.proto.Supersede(rctx, key, version, g.opts.JobTTL); err != nil {
		if callerEnded(ctx) {
			return callerErr(ctx)
		}
		g.metrics.redisErrors.Inc()
		return err
	}
	return nil
}

// Acquire admits one call or refuses it. On admission the caller must call
// Done on the Permit exactly once, with the call's error. When ctx is
// cancelled or its deadline passes before an answer, Acquire returns
// ctx.Err() (context.DeadlineExceeded for a deadline, even before the
// context's timer has run): the caller's own doing, not a refusal, not a
// Redis error, and never a FailOpenLimit admission. With WaitForSlot, a
// deadline that ends the wait for a slot returns the refusal being waited
// out.
func (g *Guard) Acquire(ctx context.Context, job Job) (*Permit, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if job.Attempt < 0 {
		return nil, fmt.Errorf("job attempt must not be negative, got %d", job.Attempt)
	}
	if !job.Deadline.IsZero() && !g.opts.Clock.Now().Before(job.Deadline) {
		g.metrics.stale.Inc()
		return nil, &Error{Action: ActionDrop, Reason: ErrStale}
	}
	if job.Key != "" && (job.Version < 0 || job.Version > protocol.MaxJobVersion) {
		return nil, fmt.Errorf("job version must be in [0, 2^53), got %d", job.Version)
	}
	args := protocol.AcquireArgs{
		TTL:        g.opts.LeaseTTL,
		JobKey:     job.Key,
		JobVersion: job.Version,
		JobTTL:     g.opts.JobTTL,
	}
	waitCtx, cancel := g.waitContext(ctx)
	defer cancel()
	start := time.Now()
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
				g.newPermit(ctx, job, adm, sent).abandon()
			}
			return nil, ctx.Err()
		}
		if refusal == nil {
			g.metrics.slotWait.Observe(time.Since(start).Seconds())
			return g.newPermit(ctx, job, adm, sent), nil
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
		e := &Error{Action: ActionDefer, Reason: ErrNoPolicy, After: g.jitterUp(g.opts.DeferDelay), Cause: err}
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

// jitterUp spreads a delay upward by up to half, so refusals that share a
// hint do not come back together.
func (g *Guard) jitterUp(d time.Duration) time.Duration {
	return retry.RetryAfter(d, g.rnd)
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

// Classify is the default outcome classifier.
func Classify(err error) protocol.Outcome {
	var p *permanentError
	switch {
	case err == nil, errors.As(err, &p):
		return protocol.Success
	case errors.Is(err, context.DeadlineExceeded):
		return protocol.Timeout
	}
	return protocol.Failure
}

// lockedRand makes a caller's seeded source safe for concurrent use.
type lockedRand struct {
	mu sync.Mutex
	r  retry.Rand
}

func (l *lockedRand) Float64() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}
