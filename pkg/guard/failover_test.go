package guard_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// failoverCounts are the answers the fleet got, by what they were.
type failoverCounts struct {
	admitted, unavailable, throttled, leaseLost, otherTyped, untyped atomic.Int64
	// maxGuard is the longest a Do spent outside the call itself, in ns.
	maxGuard atomic.Int64
	// example keeps one untyped error, for the failure message.
	example atomic.Value
}

// failoverLeaseTTLEnv sets the LeaseTTL of TestFleetSurvivesSentinelFailover,
// to measure others than the default.
const failoverLeaseTTLEnv = "SPILLWAY_FAILOVER_LEASE_TTL"

// failoverPauseEnv, when set to a duration, stops the replica (SIGSTOP) that
// long before the master is killed and resumes it right after: a replica
// that lags, to measure the over-admission of leases it never received. A
// 32 MiB write goes first, so that the leases granted meanwhile wait in the
// master's replication buffer, which dies with it, rather than in the
// kernel's socket buffers, which the replica would still read.
//
// With failoverBurstEnv set too, the fleet starts only once the replica is
// stopped, so every lease it takes is one the replica never receives: the
// worst case, where the new master counts none of the calls in flight. Its
// calls last 4 to 8 s, so that they outlive the switch.
const failoverBurstEnv = "SPILLWAY_FAILOVER_BURST"
const failoverPauseEnv = "SPILLWAY_FAILOVER_PAUSE_REPLICA"

// A fleet runs on a Sentinel-managed Redis when its master is killed with
// SIGKILL. Every call returns within a bound, every refusal is a typed
// *guard.Error, and the fleet is back at its limit within 10 s of the
// sentinels electing the new master. What the dependency sees above the limit
// during the switch (leases the replica had not received yet are lost) is
// measured, and bounded by the limit itself.
//
// The guards run on defaults, two of the four in batch mode. Calls that end while there is no master cannot
// release their leases, and the replica has them: the fleet is back at its
// limit soon after the election only because the guard forgets those leases
// once Redis answers again, not a LeaseTTL (30 s) later.
func TestFleetSurvivesSentinelFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for about 25 s")
	}
	g := NewWithT(t)
	// Calls last from 10 ms to 3 s, so that some outlive the ~2.5 s switch.
	const limit, guards, goroutines = 20, 4, 32
	minHold, maxHold := 10*time.Millisecond, 3*time.Second
	const guardBound = 2 * time.Second
	var leaseTTL time.Duration // the default
	if v := os.Getenv(failoverLeaseTTLEnv); v != "" {
		var err error
		leaseTTL, err = time.ParseDuration(v)
		g.Expect(err).NotTo(HaveOccurred())
	}
	s := redistest.StartSentinel(t)
	admin := s.Client(func(o *redis.FailoverOptions) { o.ContextTimeoutEnabled = true })
	publish(t, admin, defaultPublished(limit))
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	// The policy must survive the failover: wait until the replica has it.
	g.Expect(admin.Wait(ctx, 1, 5000).Result()).To(Equal(int64(1)), "the replica received the policy")

	var inflight atomic.Int64
	call := func(ctx context.Context) error {
		inflight.Add(1)
		defer inflight.Add(-1)
		hold := minHold + time.Duration(rand.Int64N(int64(maxHold-minHold)))
		select {
		case <-time.After(hold):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}

	var lag time.Duration
	if v := os.Getenv(failoverPauseEnv); v != "" {
		var err error
		lag, err = time.ParseDuration(v)
		g.Expect(err).NotTo(HaveOccurred())
	}
	burst := os.Getenv(failoverBurstEnv) != ""
	if burst && lag <= 0 {
		t.Fatalf("%s needs %s", failoverBurstEnv, failoverPauseEnv)
	}
	if burst {
		minHold, maxHold = 4*time.Second, 8*time.Second
	}
	lagReplica := func() {
		g.Expect(s.Servers()[1].Pause()).To(Succeed())
		g.Expect(admin.Set(ctx, "filler", strings.Repeat("x", 32<<20), 0).Err()).To(Succeed())
	}

	var c failoverCounts
	gate := make(chan struct{}) // closed when the fleet may start
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range guards {
		// One client and one guard per simulated worker process, each on
		// defaults but for the context timeouts the guard requires.
		rdb := s.Client(func(o *redis.FailoverOptions) { o.ContextTimeoutEnabled = true })
		// Its pool is filled before the fleet starts, as a running worker's
		// would be.
		var warm sync.WaitGroup
		for range goroutines {
			warm.Go(func() { _ = rdb.Ping(ctx).Err() })
		}
		warm.Wait()
		// Half the fleet batches (a mixed fleet): the failover's rules
		// hold in both modes.
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: leaseTTL, Batch: guard.BatchOptions{Enabled: i%2 == 1}})
		for range goroutines {
			wg.Go(func() {
				select {
				case <-gate:
				case <-stop:
					return
				}
				for {
					select {
					case <-stop:
						return
					default:
					}
					var inCall time.Duration
					start := time.Now()
					err := gd.Do(context.Background(), guard.Job{}, func(ctx context.Context) error {
						t0 := time.Now()
						defer func() { inCall = time.Since(t0) }()
						return call(ctx)
					})
					spent := int64(time.Since(start) - inCall)
					for m := c.maxGuard.Load(); spent > m && !c.maxGuard.CompareAndSwap(m, spent); m = c.maxGuard.Load() {
					}
					if err == nil {
						c.admitted.Add(1)
						continue
					}
					_, after, typed := guard.Decide(err)
					switch {
					case !typed:
						c.untyped.Add(1)
						c.example.CompareAndSwap(nil, err.Error())
					case errors.Is(err, guard.ErrRedisUnavailable):
						c.unavailable.Add(1)
					case errors.Is(err, guard.ErrThrottled):
						c.throttled.Add(1)
					case errors.Is(err, guard.ErrLeaseLost):
						c.leaseLost.Add(1)
					default:
						c.otherTyped.Add(1)
					}
					// What a job framework does with the job: run it again later.
					select {
					case <-time.After(min(max(after, time.Millisecond), time.Second)):
					case <-stop:
						return
					}
				}
			})
		}
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()

	// sample returns the most calls in flight, sampled every millisecond,
	// until d has passed or done says so, and when the limit was first seen.
	var overLimit time.Duration // how long more calls than the limit were in flight
	sample := func(d time.Duration, done func(reached time.Duration) bool) (peak int64, reached time.Duration) {
		reached = -1
		start := time.Now()
		last := start
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for now := range tick.C {
			elapsed := now.Sub(start)
			n := inflight.Load()
			peak = max(peak, n)
			if n > limit {
				overLimit += now.Sub(last)
			}
			last = now
			if n >= limit && reached < 0 {
				reached = elapsed
			}
			if elapsed >= d || done(reached) {
				return peak, reached
			}
		}
		return peak, reached
	}
	var peakBefore int64
	if burst {
		lagReplica()
		close(gate)
		peakBefore, _ = sample(lag, func(time.Duration) bool { return false })
	} else {
		close(gate)
		peakBefore, _ = sample(4*time.Second, func(time.Duration) bool { return false })
		if lag > 0 {
			lagReplica()
			time.Sleep(lag)
		}
	}
	g.Expect(peakBefore).To(BeNumerically("==", limit), "before the failover the fleet runs at its limit")
	admittedBefore, unavailableBefore := c.admitted.Load(), c.unavailable.Load()

	old, err := s.KillMaster(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	killed := time.Now()
	if lag > 0 {
		g.Expect(s.Servers()[1].Resume()).To(Succeed())
	}
	var elected time.Time
	var peakSwitch int64
	electedCh := make(chan error, 1)
	go func() {
		_, err := s.WaitFailover(ctx, old.Addr())
		electedCh <- err
	}()
	peakSwitch, _ = sample(20*time.Second, func(time.Duration) bool {
		select {
		case err := <-electedCh:
			g.Expect(err).NotTo(HaveOccurred(), "the sentinels elect a new master")
			elected = time.Now()
			return true
		default:
			return false
		}
	})
	g.Expect(elected).NotTo(BeZero())
	newMaster := s.Servers()[1].Client()
	stale, _ := newMaster.ZCount(ctx, protocol.KeysFor(mustDependency(t)).Leases, "("+strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()

	// After the election: back at the limit within 10 s, and how far above.
	const recoverWithin = 10 * time.Second
	peakAfter, reached := sample(recoverWithin+3*time.Second, func(reached time.Duration) bool {
		return reached >= 0 && time.Since(elected) > reached+3*time.Second
	})
	backAt := "never within " + (recoverWithin + 3*time.Second).String()
	if reached >= 0 {
		backAt = reached.Round(time.Millisecond).String()
	}
	t.Logf("LeaseTTL %v, replica stopped %v before the kill: failover %v after SIGKILL; %d leases live on the new master at election; back at the limit %s after the election; "+
		"calls in flight: peak %d before, %d during the switch, %d after (limit %d); "+
		"answers: admitted %d, redis unavailable %d (%d before the kill), throttled %d, lease lost %d, other typed %d, untyped %d; "+
		"more than the limit in flight for %v; longest time a Do spent outside the call %v",
		durationOr(leaseTTL, "30s (default)"), lag, elected.Sub(killed).Round(time.Millisecond), stale, backAt,
		peakBefore, peakSwitch, peakAfter, limit,
		c.admitted.Load()-admittedBefore, c.unavailable.Load(), unavailableBefore, c.throttled.Load(), c.leaseLost.Load(), c.otherTyped.Load(), c.untyped.Load(),
		overLimit.Round(time.Millisecond), time.Duration(c.maxGuard.Load()).Round(time.Millisecond))

	g.Expect(c.untyped.Load()).To(BeZero(), "every refusal is a *guard.Error (first: %v)", c.example.Load())
	g.Expect(c.unavailable.Load()).To(BeNumerically(">", unavailableBefore), "the switch shows as ErrRedisUnavailable")
	g.Expect(time.Duration(c.maxGuard.Load())).To(BeNumerically("<=", guardBound), "no Do hangs on the dead master")
	g.Expect(reached).To(BeNumerically(">=", 0), "the fleet is back at its limit within %v of the election", recoverWithin)
	g.Expect(reached).To(BeNumerically("<=", recoverWithin))
	g.Expect(max(peakSwitch, peakAfter)).To(BeNumerically("<=", 2*limit), "over-admission is bounded by the leases lost, at most the limit")
}
