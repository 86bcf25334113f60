package guard_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// A holder that never calls Done stops renewing after MaxCallLifetime: its
// context is cancelled then and its slot comes back within the lease TTL.
func TestAbandonedPermitStopsRenewingAfterItsLifetime(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		const lifetime, ttl = 400 * time.Millisecond, 150 * time.Millisecond
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: ttl, MaxCallLifetime: lifetime, Batch: batch})

		start := time.Now()
		p, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		time.Sleep(lifetime / 2)
		_, err = gd.Acquire(t.Context(), guard.Job{})
		wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)

		g.Eventually(p.Context().Done()).Within(lifetime + time.Second).Should(BeClosed())
		g.Expect(time.Since(start)).To(BeNumerically(">=", lifetime))
		g.Expect(context.Cause(p.Context())).To(MatchError(guard.ErrLifetimeExceeded))
		g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, ok) }).
			WithTimeout(ttl + time.Second).WithPolling(10 * time.Millisecond).Should(Succeed())
		g.Expect(time.Since(start)).To(BeNumerically("<", lifetime+ttl+time.Second))
	})
}

// A call under Do is ended by Do itself, so MaxCallLifetime does not bound
// it: a render longer than the lifetime keeps its context and renews its
// lease for as long as it runs (issue 21: a fleet of 15-minute renders was
// cancelled at 10 minutes and counted as timeouts).
func TestCallUnderDoRenewsPastMaxCallLifetime(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		const lifetime, ttl = 300 * time.Millisecond, 150 * time.Millisecond
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: ttl, MaxCallLifetime: lifetime, Batch: batch})
		other := newGuard(t, rdb, guard.Options{LeaseTTL: ttl, Batch: batch})

		var othersDuring error
		err := gd.Do(t.Context(), guard.Job{}, func(ctx context.Context) error {
			select {
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-time.After(3 * lifetime):
			}
			// Past the lifetime and many lease TTLs: the slot is still this
			// call's.
			_, othersDuring = other.Acquire(t.Context(), guard.Job{})
			return ctx.Err()
		})
		g.Expect(err).NotTo(HaveOccurred(), "a call under Do was cut at MaxCallLifetime")
		wantDecision(t, othersDuring, guard.ActionDefer, guard.ErrThrottled)
		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Successes).To(Equal(int64(1)))
		g.Expect(w.Timeouts + w.Failures).To(BeZero())
	})
}

// A Permit that outlives MaxCallLifetime is cut, and the cut is the guard's
// doing, not the dependency's: it counts as cancelled (no timeout, no
// failure, no retry budget) and Done answers ActionDefer with
// ErrLifetimeExceeded.
func TestLifetimeCutCountsCancelled(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: 150 * time.Millisecond, MaxCallLifetime: 300 * time.Millisecond, Batch: batch})

		p, err := gd.Acquire(t.Context(), guard.Job{Attempt: 1})
		g.Expect(err).NotTo(HaveOccurred())
		g.Eventually(p.Context().Done()).Within(2 * time.Second).Should(BeClosed())
		err = p.Done(fmt.Errorf("render: %w", p.Context().Err()))
		wantDecision(t, err, guard.ActionDefer, guard.ErrLifetimeExceeded)
		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Calls).To(BeZero(), "a lifetime cut counted as a call: %+v", w)
		g.Expect(w.RetriesGranted+w.BudgetRefused).To(BeZero(), "a lifetime cut spent retry budget: %+v", w)
	})
}

// A custom Classify that panics inside Done still releases the slot (counting
// nothing), and the panic goes on to the caller.
func TestPanicInClassifyReleasesTheSlot(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(1))
		// gd waits for its slot: the check below is a per-call caller that
		// may be refused while gd's pool still holds the slot, and a
		// refused per-call caller is owed its fair share for 1 s after
		// (docs/protocol.md §4 pool "Fair share"), admitted since or not.
		gd := newGuard(t, rdb, guard.Options{Classify: func(error) protocol.Outcome { panic("classifier bug") },
			WaitForSlot: true, MaxWait: 3 * time.Second, Batch: batch})

		for _, run := range []func(){
			func() { _ = gd.Do(t.Context(), guard.Job{}, ok) },
			func() {
				p, err := gd.Acquire(t.Context(), guard.Job{})
				g.Expect(err).NotTo(HaveOccurred())
				_ = p.Done(nil)
			},
		} {
			g.Expect(run).To(PanicWith("classifier bug"))
			// A batching pool keeps the slot (idle) until another process
			// waits for it: this one waits, for much less than a lease TTL.
			ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
			p, err := newGuard(t, rdb, guard.Options{WaitForSlot: true}).Acquire(ctx, guard.Job{})
			cancel()
			g.Expect(err).NotTo(HaveOccurred(), "the slot of the call whose Classify panicked is still held")
			g.Expect(p.Done(nil)).To(Succeed())
		}
		gd.Close()
		w := window(t, rdb)
		g.Expect(w.Calls).To(Equal(int64(2)), "only the two clean calls count: %+v", w)
	})
}

// Calls that end right at MaxCallLifetime race the lifetime's cut: a call
// whose Done wins keeps its outcome, and the cut of a call that already
// ended never reaches the slot's next call (its outcome dropped, its lease
// no longer renewed). Forty holders share twenty slots, each ending its call
// around the lifetime: every call the guard did not cut is in the window,
// and no other.
func TestLifetimeCutNeverReachesTheSlotsNextCall(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(20))
		// A batching pool's cut slot is not returned: it comes back with its
		// lease TTL, kept short. A per-call cut is released by Done: a TTL
		// far above the renewals' lateness on a loaded machine keeps the
		// leases from expiring unseen (their releases would count nothing).
		const lifetime = 2 * time.Millisecond
		ttl := time.Second
		if batch.Enabled {
			ttl = 40 * time.Millisecond
		}
		reg := prometheus.NewRegistry()
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: ttl, MaxCallLifetime: lifetime, WaitForSlot: true, Registerer: reg, Batch: batch})

		var uncut, cut, lost, raced atomic.Int64
		var wg sync.WaitGroup
		end := time.Now().Add(1500 * time.Millisecond)
		for w := range 40 {
			wg.Go(func() {
				for i := 0; time.Now().Before(end); i++ {
					p, err := gd.Acquire(t.Context(), guard.Job{Attempt: 1})
					if err != nil {
						continue
					}
					// Around the lifetime: before, at and after it.
					time.Sleep(lifetime - time.Millisecond + time.Duration((w+i)%9)*250*time.Microsecond)
					// nil unless the guard cut the call: a cut call is
					// cancelled and counts nothing.
					passed := context.Cause(p.Context())
					_ = p.Done(passed)
					switch cause := context.Cause(p.Context()); {
					case passed == nil && errors.Is(cause, guard.ErrLifetimeExceeded):
						// Cut between the test's look and Done: per call it
						// counts the success Done reported, batching nothing.
						raced.Add(1)
					case errors.Is(cause, guard.ErrLifetimeExceeded):
						cut.Add(1)
					case errors.Is(cause, context.Canceled): // Done's own
						uncut.Add(1)
					default: // lost (a 40 ms lease on a loaded machine)
						lost.Add(1)
					}
				}
			})
		}
		wg.Wait()
		gd.Close()
		w := window(t, rdb)
		t.Logf("%d calls ended by Done, %d cut at the lifetime (%d as Done ran), %d lost their lease; window: %d successes",
			uncut.Load(), cut.Load()+raced.Load(), raced.Load(), lost.Load(), w.Successes)
		g.Expect(cut.Load()).To(BeNumerically(">", 0), "no call was cut: the race was not run")
		// A slot can be lost (a 40 ms lease on a loaded machine) after its
		// call's Done cancelled the call and before it gave the slot back:
		// the call counts as ended by Done, and its outcome, like a per-call
		// release of an expired lease, counts nothing. Each such loss is in
		// the lease-lost counter and not among the calls seen lost.
		unseen := int64(testutil.ToFloat64(counter(t, reg, "spillway_worker_lease_lost_total"))) - lost.Load()
		g.Expect(w.Successes).To(BeNumerically(">=", uncut.Load()-max(unseen, 0)), "calls that Done ended lost their outcome")
		g.Expect(w.Successes).To(BeNumerically("<=", uncut.Load()+raced.Load()), "cut calls counted")
	})
}
