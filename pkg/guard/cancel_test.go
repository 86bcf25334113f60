package guard_test

import (
	"context"
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// opens says whether the controller's breaker would open on window, with a
// policy that opens on half the calls failing out of at least 10.
func opens(w protocol.Window) bool {
	b := breaker.New(breaker.Config{FailureRatio: 0.5, MinCalls: 10, Window: time.Minute, OpenDuration: time.Minute, HalfOpenProbes: 1}, clock.System{})
	_, moved := b.Evaluate(breaker.Counts{Calls: w.Calls, Failures: w.Failures + w.Timeouts}, breaker.Counts{})
	return moved
}

// A worker shutting down cancels the context of 100 calls in flight. None of
// them is a failure of the dependency: the breaker window counts none, no
// retry budget is spent, the breaker stays closed and every slot is freed.
func TestCancelledCallsAreNotDependencyFailures(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(200))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		const n = 100
		ctx, cancel := context.WithCancel(t.Context())
		started := make(chan struct{}, n)
		errs := make(chan error, n)
		for range n {
			go func() {
				for {
					ran := false
					err := gd.Do(ctx, guard.Job{Attempt: 1}, func(ctx context.Context) error {
						ran = true
						started <- struct{}{}
						<-ctx.Done()
						return ctx.Err()
					})
					if ran || ctx.Err() != nil {
						errs <- err
						return
					}
					time.Sleep(10 * time.Millisecond) // refused on a busy machine: try again
				}
			}()
		}
		for i := range n {
			select {
			case <-started:
			case <-time.After(10 * time.Second):
				t.Fatalf("only %d of %d calls started", i, n)
			}
		}
		cancel()
		for range n {
			err := <-errs
			g.Expect(errors.Is(err, context.Canceled)).To(BeTrue(), "the caller's cancellation comes back: %v", err)
			g.Expect(errors.Is(err, guard.ErrFailed) || errors.Is(err, guard.ErrBudgetExhausted)).To(BeFalse(), "not a failed call: %v", err)
		}
		gd.Close() // batch mode: the last report goes out
		w := window(t, rdb)
		t.Logf("window after cancelling %d calls: %+v", n, w)
		g.Expect(w.Failures).To(BeZero(), "no failure counted")
		g.Expect(w.Timeouts).To(BeZero(), "no timeout counted")
		g.Expect(w.RetriesGranted+w.BudgetRefused).To(BeZero(), "no retry budget spent")
		g.Expect(opens(w)).To(BeFalse(), "the breaker does not open")
		// A release that timed out on a busy machine is retried by the guard's
		// forgetter, so the slots are free within the ghost bound, not at once.
		g.Eventually(func() int64 {
			return rdb.ZCount(t.Context(), protocol.KeysFor(gd.Dependency()).Leases, "(0", "+inf").Val()
		}, ghostBound, 50*time.Millisecond).Should(BeZero(), "every slot freed")
	})
}

// A call whose own deadline expired, with the caller still waiting, is a
// timeout of the dependency.
func TestACallsOwnDeadlineIsStillATimeout(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(5))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		err := gd.Do(t.Context(), guard.Job{Attempt: 1}, func(ctx context.Context) error {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
			defer cancel()
			<-ctx.Done()
			return ctx.Err()
		})
		wantDecision(t, err, guard.ActionRetry, guard.ErrFailed)
		gd.Close()
		g.Expect(window(t, rdb).Timeouts).To(Equal(int64(1)))
	})
}

// A panic in the guarded function frees its slot at once, counts nothing
// against the dependency, and still reaches the caller.
func TestPanicInTheCallReleasesItsSlot(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		recovered := func() (r any) {
			defer func() { r = recover() }()
			_ = gd.Do(t.Context(), guard.Job{}, func(context.Context) error { panic("template engine bug") })
			return nil
		}()
		g.Expect(recovered).To(Equal("template engine bug"), "the panic reaches the caller")
		g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "the only slot is free again")
		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Failures+w.Timeouts).To(BeZero(), "the panic is not the dependency's failure")
		g.Expect(w.Calls).To(Equal(int64(1)), "only the second call counts")
	})
}

// A lease that expired while Redis was unreachable cancels its call by the
// guard's own clock, before Redis is back, so the fleet never runs the call
// beside the one that takes its slot; releasing it counts nothing.
func TestLeaseExpiredDuringAnOutageCancelsTheCall(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		srv := redistest.Start(t)
		rdb := fastClient(srv)
		publish(t, rdb, defaultPublished(1))
		reg := prometheus.NewRegistry()
		const ttl = 300 * time.Millisecond
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: ttl, Registerer: reg, Batch: batch})

		p, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		time.Sleep(ttl / 2) // renewing
		g.Expect(srv.Pause()).To(Succeed())
		paused := time.Now()
		select {
		case <-p.Context().Done():
			t.Logf("call cancelled %v into the outage (lease TTL %v)", time.Since(paused).Round(time.Millisecond), ttl)
		case <-time.After(1500 * time.Millisecond):
			t.Errorf("the call still runs %v into the outage, past its lease TTL %v", time.Since(paused).Round(time.Millisecond), ttl)
		}
		g.Expect(srv.Resume()).To(Succeed())
		g.Expect(context.Cause(p.Context())).To(MatchError(guard.ErrLeaseLost))
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_lease_lost_total"))).To(Equal(1.0))

		g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, ok) }).
			WithTimeout(2 * time.Second).WithPolling(10 * time.Millisecond).Should(Succeed())
		err = p.Done(context.Cause(p.Context()))
		g.Expect(errors.Is(err, guard.ErrLeaseLost)).To(BeTrue(), "%v", err)
		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Failures+w.Timeouts).To(BeZero(), "a lost lease is not the dependency's failure")
		g.Expect(w.RetriesGranted + w.BudgetRefused).To(BeZero())
	})
}

// A caller that cancels while Acquire waits for a slot gets its own
// cancellation back, not a throttled refusal.
func TestCancelWhileWaitingForASlotIsTheCallers(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: batch})
		held, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		defer func() { _ = held.Done(nil) }()

		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(50*time.Millisecond, cancel)
		_, err = gd.Acquire(ctx, guard.Job{})
		g.Expect(errors.Is(err, context.Canceled)).To(BeTrue(), "got %v", err)
		g.Expect(errors.Is(err, guard.ErrThrottled)).To(BeFalse())
	})
}
