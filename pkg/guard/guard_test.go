package guard_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

const dep = "mail/template-api"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(runChild(mode))
	}
	os.Exit(m.Run())
}

// fastClient returns a client that fails fast when Redis is down: no command
// retries, and the context bounds every socket operation.
func fastClient(s *redistest.Server) *redis.Client {
	return s.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
		o.PoolSize = 128
	})
}

type published = protocol.Published

func defaultPublished(limit int64) published {
	return published{
		State:         wire.Closed,
		Limit:         limit,
		Capacity:      max(limit, 1),
		Epoch:         1,
		Backoff:       retry.Backoff{Base: 100 * time.Millisecond, Max: time.Second, Jitter: retry.JitterFull},
		Budget:        retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute},
		BreakerWindow: 30 * time.Second,
	}
}

func publish(t *testing.T, rdb redis.UniversalClient, p published) {
	t.Helper()
	d, err := protocol.ParseDependency(dep)
	if err != nil {
		t.Fatal(err)
	}
	c, err := protocol.NewClient(rdb, d)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Publish(context.Background(), p); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

func window(t *testing.T, rdb redis.UniversalClient) protocol.Window {
	t.Helper()
	d, _ := protocol.ParseDependency(dep)
	c, _ := protocol.NewClient(rdb, d)
	w, _, _, err := c.ReadWindow(context.Background(), time.Minute, time.Time{})
	if err != nil {
		t.Fatalf("read window: %v", err)
	}
	return w
}

func newGuard(t *testing.T, rdb redis.UniversalClient, opts guard.Options) *guard.Guard {
	t.Helper()
	g, err := guard.New(rdb, dep, opts)
	if err != nil {
		t.Fatalf("guard.New: %v", err)
	}
	if opts.Batch.Enabled {
		// Its refresher and subscription stop with the test, while its
		// Redis still runs (cleanups run last first).
		t.Cleanup(g.Close)
	}
	return g
}

func ok(context.Context) error { return nil }

// registered waits for the background registration that gd's first call
// started (registrar), so that a test counting Redis commands afterwards
// counts only its calls'.
func registered(t *testing.T, rdb redis.UniversalClient, gd *guard.Guard) {
	t.Helper()
	NewWithT(t).Eventually(func() int64 {
		return rdb.ZCard(t.Context(), protocol.KeysFor(gd.Dependency()).Clients).Val()
	}).WithTimeout(5*time.Second).WithPolling(time.Millisecond).Should(BeNumerically(">", 0), "the process registered")
}

func wantDecision(t *testing.T, err error, action guard.Action, reason error) time.Duration {
	t.Helper()
	a, after, decided := guard.Decide(err)
	if !decided || a != action || !errors.Is(err, reason) {
		t.Fatalf("got %v, want action %v with reason %v", err, action, reason)
	}
	return after
}

func TestDoReportsOneCallPerRun(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(5))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		g.Expect(gd.Do(t.Context(), guard.Job{Attempt: 1}, ok)).To(Succeed())
		g.Expect(gd.Do(t.Context(), guard.Job{Attempt: 3}, ok)).To(Succeed())
		gd.Close() // batch mode reports aggregated: Close flushes the report
		w := window(t, rdb)
		g.Expect(w.Calls).To(Equal(int64(2)))
		g.Expect(w.Successes).To(Equal(int64(2)))
		g.Expect(w.ByAttempt).To(Equal([4]int64{1, 0, 1, 0}))
		g.Expect(rdb.ZCount(t.Context(), protocol.KeysFor(gd.Dependency()).Leases, "(-inf", "+inf").Val()).To(BeZero(), "every lease released")
	})
}

func TestThrottledRefusalConsumesNothing(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		reg := prometheus.NewRegistry()
		gd := newGuard(t, rdb, guard.Options{Registerer: reg, Batch: batch})

		held, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		called := false
		err = gd.Do(t.Context(), guard.Job{Attempt: 2}, func(context.Context) error { called = true; return nil })
		after := wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)
		g.Expect(called).To(BeFalse())
		g.Expect(after).To(BeNumerically(">", 0), "a throttled refusal hints when the first lease expires")
		g.Expect(held.Done(nil)).To(Succeed())

		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Calls).To(Equal(int64(1)), "the refused acquisition is not a call")
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_throttled_total", "reason", "slots"))).To(Equal(1.0))
	})
}

func TestWaitForSlotIsBoundedByContext(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	gd := newGuard(t, rdb, guard.Options{WaitForSlot: true})

	held, err := gd.Acquire(t.Context(), guard.Job{})
	g.Expect(err).NotTo(HaveOccurred())

	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = gd.Acquire(ctx, guard.Job{})
	wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)
	g.Expect(time.Since(start)).To(BeNumerically("<", 500*time.Millisecond))

	go func() {
		time.Sleep(150 * time.Millisecond)
		_ = held.Done(nil)
	}()
	start = time.Now()
	p, err := gd.Acquire(t.Context(), guard.Job{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(time.Since(start)).To(BeNumerically(">=", 100*time.Millisecond))
	g.Expect(p.Done(nil)).To(Succeed())
}

func TestOpenBreakerFailsFast(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		p := defaultPublished(0)
		p.State = wire.Open
		p.OpenUntil = time.Now().Add(5 * time.Second)
		publish(t, rdb, p)
		gd := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: batch})

		called := false
		start := time.Now()
		err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error { called = true; return nil })
		after := wantDecision(t, err, guard.ActionDefer, guard.ErrOpen)
		g.Expect(called).To(BeFalse())
		g.Expect(time.Since(start)).To(BeNumerically("<", 100*time.Millisecond), "open fails fast even when waiting for slots")
		g.Expect(after).To(BeNumerically("~", 6*time.Second, 1600*time.Millisecond), "no earlier than the probes, jittered up to half again")
	})
}

func TestHalfOpenAdmitsOnlyProbes(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		p := defaultPublished(3)
		p.State = wire.HalfOpen
		p.Capacity = 40
		publish(t, rdb, p)
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		for range 3 {
			_, err := gd.Acquire(t.Context(), guard.Job{})
			g.Expect(err).NotTo(HaveOccurred())
		}
		_, err := gd.Acquire(t.Context(), guard.Job{})
		after := wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)
		g.Expect(after).To(BeNumerically(">=", 100*time.Millisecond), "every probe was admitted: wait for the controller, do not spin")
	})
}

func TestStaleJobsAreDroppedBeforeAnyCall(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	reg := prometheus.NewRegistry()
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	gd := newGuard(t, rdb, guard.Options{Registerer: reg, Clock: fixedClock(now)})

	called := 0
	fn := func(context.Context) error { called++; return nil }
	wantDecision(t, gd.Do(t.Context(), guard.Job{Deadline: now.Add(-time.Second)}, fn), guard.ActionDrop, guard.ErrStale)
	wantDecision(t, gd.Do(t.Context(), guard.Job{Deadline: now}, fn), guard.ActionDrop, guard.ErrStale)
	g.Expect(gd.Do(t.Context(), guard.Job{Deadline: now.Add(time.Second)}, fn)).To(Succeed())
	g.Expect(gd.Do(t.Context(), guard.Job{}, fn)).To(Succeed(), "work with no deadline never expires")
	g.Expect(called).To(Equal(2))
	g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_stale_dropped_total"))).To(Equal(2.0))
	g.Expect(window(t, rdb).Calls).To(Equal(int64(2)))
}

func TestSupersededJobsRunOnlyTheNewest(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	gd := newGuard(t, rdb, guard.Options{})

	var ran []int64
	run := func(v int64) error {
		return gd.Do(t.Context(), guard.Job{Key: "price:42", Version: v}, func(context.Context) error {
			ran = append(ran, v)
			return nil
		})
	}
	g.Expect(gd.Supersede(t.Context(), "price:42", 5)).To(Succeed())
	wantDecision(t, run(4), guard.ActionDrop, guard.ErrSuperseded)
	g.Expect(run(5)).To(Succeed())
	g.Expect(run(7)).To(Succeed())
	wantDecision(t, run(6), guard.ActionDrop, guard.ErrSuperseded)
	g.Expect(run(7)).To(Succeed(), "the same version may run again (a retry)")
	g.Expect(gd.Do(t.Context(), guard.Job{Key: "price:43", Version: 1}, ok)).To(Succeed(), "keys are independent")
	g.Expect(ran).To(Equal([]int64{5, 7, 7}))
}

func TestRetryBudgetParksOverBudget(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		p := defaultPublished(5)
		p.Budget = retry.Budget{Ratio: 0.2, MinRetries: 2, Window: time.Minute}
		publish(t, rdb, p)
		reg := prometheus.NewRegistry()
		gd := newGuard(t, rdb, guard.Options{Registerer: reg, Batch: batch})
		boom := errors.New("503 from template-api")
		fail := func(context.Context) error { return boom }

		// granted < max(2, 0.2 × calls): the first two failures may retry.
		for i := range 2 {
			err := gd.Do(t.Context(), guard.Job{Attempt: 1}, fail)
			after := wantDecision(t, err, guard.ActionRetry, guard.ErrFailed)
			g.Expect(errors.Is(err, boom)).To(BeTrue(), "the cause is kept")
			g.Expect(after).To(BeNumerically("<=", 100*time.Millisecond), "retry %d: full jitter under the first ceiling", i)
		}
		err := gd.Do(t.Context(), guard.Job{Attempt: 1}, fail)
		after := wantDecision(t, err, guard.ActionPark, guard.ErrBudgetExhausted)
		g.Expect(after).To(BeNumerically(">=", time.Second))
		g.Expect(after).To(BeNumerically("<=", 2*time.Second))
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_budget_refusals_total"))).To(Equal(1.0))

		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Failures).To(Equal(int64(3)))
		g.Expect(w.RetriesGranted).To(Equal(int64(2)))
		g.Expect(w.BudgetRefused).To(Equal(int64(1)))
	})
}

func TestBackoffComesFromRedisAtEachFailure(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(5)
	p.Backoff = retry.Backoff{Base: 100 * time.Millisecond, Max: time.Minute, Jitter: retry.JitterNone}
	publish(t, rdb, p)
	gd := newGuard(t, rdb, guard.Options{})
	fail := func(context.Context) error { return errors.New("boom") }

	after := wantDecision(t, gd.Do(t.Context(), guard.Job{Attempt: 3}, fail), guard.ActionRetry, guard.ErrFailed)
	g.Expect(after).To(Equal(400 * time.Millisecond))

	p.Backoff.Base = 200 * time.Millisecond
	publish(t, rdb, p)
	after = wantDecision(t, gd.Do(t.Context(), guard.Job{Attempt: 3}, fail), guard.ActionRetry, guard.ErrFailed)
	g.Expect(after).To(Equal(800*time.Millisecond), "a policy change applies at the next failure, without a redeploy")
}

func TestServerRetryAfterIsHonoured(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(5)
	p.Budget.MinRetries = 1000
	publish(t, rdb, p)
	gd := newGuard(t, rdb, guard.Options{Rand: rand.New(rand.NewPCG(1, 2))})

	for range 50 {
		err := gd.Do(t.Context(), guard.Job{Attempt: 1}, func(context.Context) error {
			return guard.RetryAfter(errors.New("429 Too Many Requests"), 2*time.Second)
		})
		after := wantDecision(t, err, guard.ActionRetry, guard.ErrFailed)
		g.Expect(after).To(BeNumerically(">=", 2*time.Second), "never earlier than the server asked")
		g.Expect(after).To(BeNumerically("<=", 3*time.Second), "jittered upward by at most half")
	}
}

func TestPermanentErrorsAreNotRetried(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	gd := newGuard(t, rdb, guard.Options{})

	bad := errors.New("400: template has no subject")
	err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error { return guard.Permanent(bad) })
	g.Expect(err).To(Equal(bad))
	_, _, decided := guard.Decide(err)
	g.Expect(decided).To(BeFalse())
	w := window(t, rdb)
	g.Expect(w.Successes).To(Equal(int64(1)), "the dependency answered: not a breaker failure")
}

func TestReleaseWorksAfterTheCallersContextIsCancelled(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		ctx, cancel := context.WithCancel(t.Context())
		err := gd.Do(ctx, guard.Job{}, func(ctx context.Context) error {
			cancel()
			<-ctx.Done()
			return ctx.Err()
		})
		wantDecision(t, err, guard.ActionDefer, guard.ErrCancelled)
		g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "the slot is free again")
		gd.Close()
		g.Expect(liveLeases(t, rdb, gd)).To(BeZero())
		g.Expect(window(t, rdb).Calls).To(Equal(int64(1)), "the caller's cancellation is not the dependency's failure")
	})
}

func TestLongCallsRenewTheirLease(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: 150 * time.Millisecond, Batch: batch})

		p, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		time.Sleep(500 * time.Millisecond)
		_, err = gd.Acquire(t.Context(), guard.Job{})
		wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)
		g.Expect(p.Context().Err()).NotTo(HaveOccurred())
		g.Expect(p.Done(nil)).To(Succeed())
	})
}

func TestLostLeaseIsReportedNeverReacquired(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		reg := prometheus.NewRegistry()
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: 90 * time.Millisecond, Registerer: reg, Batch: batch})
		leases := protocol.KeysFor(gd.Dependency()).Leases

		p, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		// The slot is taken away (as if the lease had expired during a pause).
		g.Expect(rdb.Del(t.Context(), leases).Err()).To(Succeed())
		g.Eventually(p.Context().Done()).Within(time.Second).Should(BeClosed())
		g.Expect(context.Cause(p.Context())).To(MatchError(guard.ErrLeaseLost))
		if !batch.Enabled {
			g.Consistently(func() int64 { return rdb.ZCount(t.Context(), leases, "(-inf", "+inf").Val() }).
				Within(200 * time.Millisecond).Should(BeZero())
		}
		// The lost call still runs, and no slot is held for it: another
		// process takes the only slot (from a batching pool, once it sees the
		// waiter, if its recent demand kept one).
		wctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		other, err := newGuard(t, rdb, guard.Options{WaitForSlot: true}).Acquire(wctx, guard.Job{})
		g.Expect(err).NotTo(HaveOccurred(), "the lost call's slot was taken back for it")
		g.Expect(other.Done(nil)).To(Succeed())
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_lease_lost_total"))).To(Equal(1.0))
		_ = p.Done(context.Cause(p.Context()))
	})
}

func TestRedisDownFailsClosedWithinTheTimeout(t *testing.T) {
	for _, m := range modes {
		for _, outage := range []string{"stopped", "paused"} {
			batch := m.batch
			t.Run(m.name+"/"+outage, func(t *testing.T) {
				g := NewWithT(t)
				srv := redistest.Start(t)
				rdb := fastClient(srv)
				publish(t, rdb, defaultPublished(5))
				gd := newGuard(t, rdb, guard.Options{RedisTimeout: 30 * time.Millisecond, Batch: batch})
				g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())

				if outage == "stopped" {
					srv.Stop()
				} else {
					g.Expect(srv.Pause()).To(Succeed())
					defer func() { _ = srv.Resume() }()
				}
				if batch.Enabled {
					// Slots held locally admit calls until the last answered
					// refresh is a refresh interval and a RedisTimeout old
					// (README "Batch mode"): the bound, not a round trip.
					time.Sleep(40*time.Millisecond + 30*time.Millisecond + 10*time.Millisecond) // default Refresh
				}
				called := false
				var worst time.Duration
				for range 5 {
					start := time.Now()
					err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error { called = true; return nil })
					worst = max(worst, time.Since(start))
					after := wantDecision(t, err, guard.ActionDefer, guard.ErrRedisUnavailable)
					g.Expect(after).To(BeNumerically(">=", time.Second))
				}
				g.Expect(called).To(BeFalse(), "fail closed: no call without the fleet's permission")
				t.Logf("slowest refusal with Redis %s: %v", outage, worst)
				g.Expect(worst).To(BeNumerically("<", 250*time.Millisecond), "tens of milliseconds, not seconds")
			})
		}
	}
}

func TestFailOpenAdmitsUpToTheLocalCap(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		srv := redistest.Start(t)
		rdb := fastClient(srv)
		publish(t, rdb, defaultPublished(50))
		gd := newGuard(t, rdb, guard.Options{RedisTimeout: 30 * time.Millisecond, FailOpenLimit: 2, Batch: batch})
		srv.Stop()

		release := make(chan struct{})
		var running atomic.Int32
		errs := make(chan error, 3)
		for range 3 {
			go func() {
				errs <- gd.Do(t.Context(), guard.Job{}, func(context.Context) error {
					running.Add(1)
					<-release
					return nil
				})
			}()
		}
		err := <-errs
		wantDecision(t, err, guard.ActionDefer, guard.ErrRedisUnavailable)
		g.Eventually(running.Load).Should(Equal(int32(2)))
		close(release)
		g.Expect(<-errs).To(Succeed())
		g.Expect(<-errs).To(Succeed())

		// Redis back: the fleet's limits apply again and outcomes are reported.
		g.Expect(srv.Restart()).To(Succeed())
		publish(t, rdb, defaultPublished(50))
		// (Batch mode's first calls may still fail open: its last refresh
		// failed less than a refresh ago; its report goes out with the
		// next refresh.)
		g.Eventually(func() int64 {
			g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
			return window(t, rdb).Calls
		}).WithTimeout(3 * time.Second).Should(BeNumerically(">=", 1))
	})
}

func TestNoPolicyFailsClosed(t *testing.T) {
	rdb := fastClient(redistest.Start(t))
	gd := newGuard(t, rdb, guard.Options{})
	wantDecision(t, gd.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrNoPolicy)
}

func TestBadInputIsRefusedBeforeRedis(t *testing.T) {
	g := NewWithT(t)
	srv := redistest.Start(t)
	rdb := fastClient(srv)
	g.Expect(rdb.ConfigResetStat(t.Context()).Err()).To(Succeed())

	for _, d := range []string{"", "mail", "mail/", "/x", "Mail/x", "mail/x/y", "mail/Template", strings.Repeat("a", 64) + "/x"} {
		_, err := guard.New(rdb, d, guard.Options{})
		g.Expect(err).To(HaveOccurred(), "dependency %q", d)
	}
	for name, opts := range map[string]guard.Options{
		"LeaseTTL":        {LeaseTTL: -time.Second},
		"RedisTimeout":    {RedisTimeout: -time.Millisecond},
		"JobTTL":          {JobTTL: -time.Hour},
		"MaxWait":         {MaxWait: -time.Second},
		"FailOpenLimit":   {FailOpenLimit: -1},
		"MaxCallLifetime": {MaxCallLifetime: -time.Minute},
	} {
		_, err := guard.New(rdb, dep, opts)
		g.Expect(err).To(MatchError(ContainSubstring(name)))
	}
	_, err := guard.New(nil, dep, guard.Options{})
	g.Expect(err).To(HaveOccurred())
	_, err = guard.New(srv.Client(), dep, guard.Options{})
	g.Expect(err).To(MatchError(ContainSubstring("ContextTimeoutEnabled")))

	gd := newGuard(t, rdb, guard.Options{})
	g.Expect(gd.Do(t.Context(), guard.Job{}, nil)).To(MatchError(ContainSubstring("function must not be nil")))
	g.Expect(gd.Do(t.Context(), guard.Job{Key: "k", Version: -1}, ok)).To(MatchError(ContainSubstring("version")))
	g.Expect(gd.Do(t.Context(), guard.Job{Attempt: -1}, ok)).To(MatchError(ContainSubstring("attempt")))
	g.Expect(gd.Supersede(t.Context(), "", 1)).To(HaveOccurred())

	stats := rdb.Info(t.Context(), "commandstats").Val()
	g.Expect(stats).NotTo(ContainSubstring("cmdstat_evalsha"), "nothing reached Redis")
	g.Expect(stats).NotTo(ContainSubstring("cmdstat_eval:"))
}

func TestOneRoundTripToAcquireAndOneToRelease(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	gd := newGuard(t, rdb, guard.Options{})
	g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed()) // loads the scripts
	registered(t, rdb, gd)

	var trips atomic.Int64
	rdb.AddHook(countingHook{&trips})
	g.Expect(rdb.ConfigResetStat(t.Context()).Err()).To(Succeed())
	trips.Store(0)
	const n = 25
	for range n {
		g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	}
	g.Expect(trips.Load()).To(Equal(int64(2*n)), "round trips the client made")
	calls := commandCalls(t, rdb)
	g.Expect(calls["evalsha"]).To(Equal(2*n), "one EVALSHA to acquire, one to release and report")
	g.Expect(calls).NotTo(HaveKey("eval"))
}

// countingHook counts the commands and pipelines a client sends.
type countingHook struct{ n *atomic.Int64 }

func (h countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

func TestMetricsByOutcomeAndAttempt(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	reg := prometheus.NewRegistry()
	gd := newGuard(t, rdb, guard.Options{Registerer: reg})
	// A second guard for another dependency shares the registry.
	_, err := guard.New(rdb, "mail/other", guard.Options{Registerer: reg})
	g.Expect(err).NotTo(HaveOccurred())

	g.Expect(gd.Do(t.Context(), guard.Job{Attempt: 1}, ok)).To(Succeed())
	_ = gd.Do(t.Context(), guard.Job{Attempt: 2}, func(context.Context) error { return errors.New("boom") })
	_ = gd.Do(t.Context(), guard.Job{Attempt: 9}, func(ctx context.Context) error { return context.DeadlineExceeded })

	for _, c := range []struct{ outcome, attempt string }{{"success", "1"}, {"failure", "2"}, {"timeout", "4+"}} {
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_calls_total", "outcome", c.outcome, "attempt", c.attempt))).
			To(Equal(1.0), "%v", c)
	}
}

// counter finds one series of a worker metric in reg by its labels; the
// dependency label is always dep.
func counter(t *testing.T, reg *prometheus.Registry, name string, labels ...string) prometheus.Collector {
	t.Helper()
	return metricVec(t, reg, name, append([]string{"dependency", dep}, labels...)...)
}

// commandCalls parses INFO commandstats into calls per command.
func commandCalls(t *testing.T, rdb *redis.Client) map[string]int {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, found := strings.Cut(strings.TrimSpace(line), ":")
		if !found || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		var n int
		if _, err := fmt.Sscanf(rest, "calls=%d", &n); err == nil {
			calls[strings.TrimPrefix(name, "cmdstat_")] = n
		}
	}
	return calls
}

func TestWorkerLibraryIsLean(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "./", "../protocol", "../retry").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "sigs.k8s.io/controller-runtime") || strings.HasPrefix(dep, "k8s.io/") {
			t.Errorf("the worker library imports %s", dep)
		}
	}
}

func TestFleetRateLimit(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(50)
	p.RatePerSecond = 20 // burst 2
	publish(t, rdb, p)

	refusing := newGuard(t, rdb, guard.Options{})
	admitted := 0
	var err error
	for ; err == nil; admitted++ {
		err = refusing.Do(t.Context(), guard.Job{}, ok)
	}
	after := wantDecision(t, err, guard.ActionDefer, guard.ErrRateLimited)
	g.Expect(admitted-1).To(Equal(2), "the burst")
	g.Expect(after).To(BeNumerically(">", 0))
	g.Expect(after).To(BeNumerically("<=", 75*time.Millisecond), "the next token within 50ms, jittered up by half at most")

	waiting := newGuard(t, rdb, guard.Options{WaitForSlot: true})
	start := time.Now()
	for range 20 {
		g.Expect(waiting.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	}
	g.Expect(time.Since(start)).To(BeNumerically(">=", 900*time.Millisecond), "20 calls at 20/s take about a second")
}

// An Open breaker past its openUntil (the controller has not moved it to
// HalfOpen yet) still defers jobs for a moment, never for zero.
func TestOpenPastItsDeadlineNeverHintsZero(t *testing.T) {
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(0)
	p.State = wire.Open
	p.OpenUntil = time.Now().Add(-time.Second)
	publish(t, rdb, p)
	gd := newGuard(t, rdb, guard.Options{})
	after := wantDecision(t, gd.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrOpen)
	NewWithT(t).Expect(after).To(BeNumerically(">=", 200*time.Millisecond))
}

// fixedClock is a clock.Clock that stands still.
type fixedClock time.Time

func (c fixedClock) Now() time.Time { return time.Time(c) }

// Successes report their duration at most every 10 ms per guard (the
// window's mean success latency needs a sample, and timing costs Redis two
// counters a release); spaced further apart, every one does.
func TestSuccessDurationsAreSampled(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	gd := newGuard(t, rdb, guard.Options{})
	timed := func() int64 {
		all, err := rdb.HGetAll(t.Context(), protocol.KeysFor(gd.Dependency()).Stats).Result()
		g.Expect(err).NotTo(HaveOccurred())
		var n int64
		for f, v := range all {
			if strings.HasSuffix(f, ":dn") {
				k, _ := strconv.ParseInt(v, 10, 64)
				n += k
			}
		}
		return n
	}
	start := time.Now()
	const burst = 50
	for range burst {
		g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	}
	elapsed := time.Since(start)
	n := timed()
	g.Expect(n).To(BeNumerically(">=", 1))
	g.Expect(n).To(BeNumerically("<=", 1+int64(elapsed/(10*time.Millisecond))), "%d of %d successes timed in %v", n, burst, elapsed)
	g.Expect(n).To(BeNumerically("<", burst))
	for range 3 {
		time.Sleep(15 * time.Millisecond)
		g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	}
	g.Expect(timed()).To(Equal(n+3), "successes 15 ms apart are each timed")
}
