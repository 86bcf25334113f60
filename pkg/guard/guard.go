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
	"sync/atomic"
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
	// MaxCallLifetime bounds how long a Permit from Acquire renews its
	// lease: a holder that never calls Done (a leaked Permit) keeps its slot
	// at most MaxCallLifetime plus LeaseTTL. At MaxCallLifetime the Permit's
	// context is cancelled with ErrLifetimeExceeded, and the call, cut by
	// the guard and not by the dependency, counts as cancelled: no failure,
	// no timeout, no retry budget. It does not apply to calls under Do,
	// which ends every call it starts: they renew for as long as they run.
	// Default 10m.
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
	// AllowEviction lets the guard start on a Redis configured to evict
	// keys (a maxmemory-policy other than noeviction), which New refuses by
	// default: under memory pressure such a Redis may drop leases, the
	// published state or a job's version, and the fleet would then run more
	// calls than its limit. With it, the guard starts and the gauge
	// spillway_worker_redis_evicting says 1; alert on it. New reads the
	// policy with INFO memory (which works where CONFIG is disabled) on
	// every master the client writes to; when Redis does not answer, New
	// does not wait for it and the guard starts unchecked.
	AllowEviction bool
	// Batch turns on batch mode, for high call rates: slots, rate tokens
	// and retries are leased from the fleet in batches and outcomes
	// reported aggregated, so that most calls make no round trip (see
	// BatchOptions). Off by default.
	Batch BatchOptions
}

// Guard enforces one dependency's fleet-wide limits. It is safe for
// concurrent use; create one per dependency and share it.
type Guard struct {
	proto *protocol.Client
	dep   protocol.Dependency
	// caller names this Guard in per-call acquisitions
	// (protocol.AcquireArgs.CallerID): refused for want of a slot, it is a
	// contender of its own in the batching pools' fair split.
	caller   string
	opts     Options
	metrics  *metrics
	rnd      retry.Rand
	local    chan struct{}
	fallback retry.Backoff

	clock  *redisClock
	forget *forgetter
	// link carries the holds and the pool's refreshes (link.go).
	link *link
	reg  registrar
	hold holder
	// pool and budget are batch mode's (Options.Batch); nil when it is off.
	pool   *pool
	budget *retryStock

	mu       sync.Mutex
	lastSeen retry.Backoff

	// timedAt is when, in Unix ns, the next per-call success may report its
	// duration (timeDue).
	timedAt atomic.Int64
}

// timeEvery spaces the per-call successes whose release reports the
// call's duration: at most one every 10 ms per guard. The window's mean
// success latency (the controller's rate bound) needs a sample, not every
// call, and timing costs Redis two counters a release (docs/benchmarks.md);
// below 100 successes a second every one is timed.
const timeEvery = 10 * time.Millisecond

// timeDue reports whether a success ending at now reports its duration.
func (g *Guard) timeDue(now time.Time) bool {
	next := g.timedAt.Load()
	return now.UnixNano() >= next && g.timedAt.CompareAndSwap(next, now.Add(timeEvery).UnixNano())
}

// New returns a Guard for the dependency "namespace/name" (the
// DependencyPolicy's namespace and name) over rdb. For a *redis.Client
// (standalone or Sentinel) or a *redis.ClusterClient, the holds that put
// leases back after Redis lost them, and batch mode's pool refreshes, go
// on a short-lived client of the guard's own, built from rdb's options,
// while they fail on rdb (docs/protocol.md §4 "Learning").
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
	if err := checkEviction(rdb, opts, m); err != nil {
		return nil, err
	}
	g := &Guard{
		proto:    proto,
		dep:      dep,
		caller:   protocol.NewLeaseID(),
		opts:     opts,
		metrics:  m,
		rnd:      opts.Rand,
		fallback: retry.Backoff{Base: time.Second, Max: 5 * time.Minute, Jitter: retry.JitterFull},
		clock:    newRedisClock(),
		forget:   newForgetter(proto, opts.RedisTimeout, m),
		link:     newLink(rdb, dep, proto),
	}
	g.lastSeen = g.fallback
	g.reg = registrar{proto: proto, timeout: max(opts.RedisTimeout, forgetTimeoutMin)}
	g.hold.g = g
	if opts.FailOpenLimit > 0 {
		g.local = make(chan struct{}, opts.FailOpenLimit)
	}
	if opts.Batch.Enabled {
		g.budget = &retryStock{g: g}
		g.pool = newPool(g)
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
	var err error
	if o.Batch, err = o.Batch.withDefaults(o.LeaseTTL); err != nil {
		return o, err
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

// checkEviction refuses a Redis that evicts keys, unless the Options allow
// it; then the evicting gauge says so. A Redis that does not answer within
// RedisTimeout is not waited for: calls fail closed until it does.
func checkEviction(rdb redis.UniversalClient, opts Options, m *metrics) error {
	ctx, cancel := context.WithTimeout(context.Background(), opts.RedisTimeout)
	defer cancel()
	err := protocol.CheckNoEviction(ctx, rdb)
	if !errors.Is(err, protocol.ErrEvictionPolicy) {
		return nil
	}
	if !opts.AllowEviction {
		return fmt.Errorf("%w (or set guard.Options.AllowEviction to start anyway, and alert on spillway_worker_redis_evicting)", err)
	}
	m.redisEvicting.Set(1)
	return nil
}

// Close stops the guard's background work: the forgetting of leases whose
// reply was never read (see Options.RedisTimeout). It first makes one
// attempt to forget each lease still waiting, for at most 1s (a round trip
// each while Redis answers); those it could not forget expire with their
// TTL. Permits already admitted keep renewing until Done. In batch mode it
// first sends the pool's last report and returns its idle slots, within 1s
// more; the slots of calls still running go back as they end, and calls
// after Close go per call. Call it when the guard is no longer used, before
// the process exits; it is safe to call more than once.
func (g *Guard) Close() {
	if g.pool != nil {
		g.pool.close()
	}
	g.forget.close()
	g.link.close()
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
	p, err := g.admit(ctx, job, false) // Do ends the Permit: no lifetime
	if err != nil {
		return err
	}
	if p.late(time.Now()) {
		// Stopped between the admission and the call for longer than the
		// lease may live: the call is not made, and the job comes back.
		p.cancel(ErrLeaseLost)
		g.metrics.leaseLost.Inc()
		return p.Done(ErrLeaseLost)
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
