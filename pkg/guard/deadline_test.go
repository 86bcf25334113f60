package guard_test

import (
	"context"
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// lateTimer is a context whose deadline passes before it says so: its
// Deadline is set, but Done never closes and Err stays nil. It is what a
// context.WithTimeout looks like on a starved machine between the instant
// its deadline passes, which go-redis has made the connection's I/O
// deadline, and the instant its timer goroutine runs and cancels it.
type lateTimer struct {
	context.Context
	deadline time.Time
}

func (c lateTimer) Deadline() (time.Time, bool) { return c.deadline, true }

// meteredGuard is a guard with its own metrics registry, on a fresh
// redis-server whose policy allows one call at a time.
func meteredGuard(t *testing.T, opts guard.Options) (*guard.Guard, *prometheus.Registry) {
	t.Helper()
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	reg := prometheus.NewRegistry()
	opts.Registerer = reg
	return newGuard(t, rdb, opts), reg
}

// TestCallerDeadlineIsNotRedisUnavailable: when the caller's own deadline
// ends a Redis round trip (the connection's I/O deadline is the caller's),
// Redis did not fail: a caller that was waiting for a slot gets the throttled
// refusal, as when the deadline ends the wait between polls, and one whose
// deadline had passed before Redis answered at all gets
// context.DeadlineExceeded. Neither counts as a Redis error, and neither is
// admitted by the local fail-open cap, which is for Redis being unavailable:
// under load that would admit calls past the fleet's limit. Found by a
// clean-clone CI run with a core burnt, where TestWaitForSlotIsBoundedByContext
// got "redis unavailable: ... i/o timeout" instead of throttled.
func TestCallerDeadlineIsNotRedisUnavailable(t *testing.T) {
	t.Run("waiting for a slot", func(t *testing.T) {
		g := NewWithT(t)
		gd, reg := meteredGuard(t, guard.Options{WaitForSlot: true, FailOpenLimit: 1})
		held, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		defer held.Done(nil)

		ctx := lateTimer{Context: t.Context(), deadline: time.Now().Add(100 * time.Millisecond)}
		p, err := gd.Acquire(ctx, guard.Job{})
		if p != nil {
			_ = p.Done(nil)
			t.Fatal("a caller whose deadline passed while it waited for a slot was admitted")
		}
		wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_redis_errors_total"))).To(BeZero())
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_fail_open_calls_total"))).To(BeZero())
	})
	t.Run("before Redis answered", func(t *testing.T) {
		g := NewWithT(t)
		gd, reg := meteredGuard(t, guard.Options{FailOpenLimit: 1})

		ctx := lateTimer{Context: t.Context(), deadline: time.Now().Add(-time.Millisecond)}
		p, err := gd.Acquire(ctx, guard.Job{})
		if p != nil {
			_ = p.Done(nil)
			t.Fatal("a caller whose deadline had passed was admitted")
		}
		g.Expect(errors.Is(err, context.DeadlineExceeded)).To(BeTrue(), "got %v", err)
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_redis_errors_total"))).To(BeZero())
		g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_fail_open_calls_total"))).To(BeZero())
	})
}

// TestSupersedeCallerDeadlineIsNotARedisError: a Supersede that the caller's
// deadline ends returns context.DeadlineExceeded and counts no Redis error,
// even before the context's timer has run.
func TestSupersedeCallerDeadlineIsNotARedisError(t *testing.T) {
	g := NewWithT(t)
	gd, reg := meteredGuard(t, guard.Options{})

	ctx := lateTimer{Context: t.Context(), deadline: time.Now().Add(-time.Millisecond)}
	err := gd.Supersede(ctx, "invoice-42", 2)
	g.Expect(errors.Is(err, context.DeadlineExceeded)).To(BeTrue(), "got %v", err)
	g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_redis_errors_total"))).To(BeZero())

	g.Expect(gd.Supersede(t.Context(), "invoice-42", 2)).To(Succeed(), "a live context supersedes")
}
