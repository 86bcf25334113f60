package guard_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// staleSetup starts Redis with a policy of the given limit, loads the
// scripts, and returns a direct client and a proxy in front of Redis whose
// clients make no retries of their own: a reply the proxy loses is an
// error for the guard, whose pool sends the same request again (under the
// same request id) at its next refresh.
func staleSetup(t *testing.T, limit int64) (*redis.Client, *lostReplies, func() *redis.Client) {
	t.Helper()
	srv := redistest.Start(t)
	direct := fastClient(srv)
	publish(t, direct, defaultPublished(limit))
	loader := newGuard(t, direct, guard.Options{Batch: guard.BatchOptions{Enabled: true}})
	if err := loader.Do(t.Context(), guard.Job{}, ok); err != nil {
		t.Fatalf("loading the scripts: %v", err)
	}
	loader.Close()
	proxy := newLostReplies(t, srv.Addr())
	return direct, proxy, func() *redis.Client {
		rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		return rdb
	}
}

// A pool request whose replies are lost for longer than LeaseTTL/2 is
// answered, when a resend gets through, with its first run's reply: the
// slot it granted may have expired in Redis since and be another process's
// now. The pool must not hand it to a call (Doorman's rule: a grant is dead
// once firstSent + LeaseTTL/2 has passed). Limit 1: a batching process
// loses its pool replies while a per-call process takes the slot its first
// refresh was granted, once that lease expired; when the replies get
// through again, the batching process must not run a call beside it.
func TestStaleGrantsOfAResentPoolRequestAreNotUsed(t *testing.T) {
	g := NewWithT(t)
	direct, proxy, client := staleSetup(t, 1)
	const ttl = 200 * time.Millisecond
	// Calls wait for the pool's refreshes (and so are there when the
	// resend's reply hands out its grant); a long RedisTimeout keeps that
	// reply fresh enough to admit calls on.
	a := newGuard(t, client(), guard.Options{LeaseTTL: ttl, RedisTimeout: time.Second, WaitForSlot: true, MaxWait: 100 * time.Millisecond,
		Batch: guard.BatchOptions{Enabled: true}})
	b := newGuard(t, direct, guard.Options{LeaseTTL: ttl, WaitForSlot: true, MaxWait: 2 * time.Second})

	proxy.lose(t, "pool", -1)
	var holding atomic.Bool // b runs its call
	var overlaps, admitted atomic.Int64
	ctx, stop := context.WithCancel(t.Context())
	defer stop()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			p, err := a.Acquire(ctx, guard.Job{})
			if err != nil {
				time.Sleep(2 * time.Millisecond)
				continue
			}
			admitted.Add(1)
			if holding.Load() {
				overlaps.Add(1)
			}
			_ = p.Done(nil)
		}
	}()
	g.Eventually(proxy.lost.Load).WithTimeout(2*time.Second).Should(BeNumerically(">=", 1), "no pool reply was lost")
	lostAt := time.Now()
	// The slot the lost reply granted expires in Redis within the TTL; b
	// waits for it.
	pb, err := b.Acquire(t.Context(), guard.Job{})
	g.Expect(err).NotTo(HaveOccurred(), "the slot granted in the lost reply never expired")
	holding.Store(true)
	t.Logf("the per-call process took the slot %v after the first lost reply", time.Since(lostAt).Round(time.Millisecond))
	g.Expect(admitted.Load()).To(BeZero(), "the batching process ran a call with every reply lost")
	proxy.lose(t, "pool", 0) // the resend gets through: the first run's reply
	time.Sleep(3 * ttl)
	holding.Store(false)
	g.Expect(pb.Done(nil)).To(Succeed())
	stop()
	<-done
	t.Logf("%d pool replies lost; the batching process ran %d calls, %d beside the per-call one", proxy.lost.Load(), admitted.Load(), overlaps.Load())
	g.Expect(overlaps.Load()).To(BeZero(), "a call ran on a grant of a reply older than LeaseTTL/2, beside the slot's holder: two calls at limit 1")
}

// A change the pool learned through the change channel (the breaker
// tripped) after its pending request was first sent outranks that
// request's reply: a resend answered with the first run's reply (Closed,
// the old epoch) must not put the pool back in batch mode. Calls after the
// trip are refused as Open, never admitted on local slots.
func TestResentPoolReplyDoesNotUndoALearnedTrip(t *testing.T) {
	g := NewWithT(t)
	direct, proxy, client := staleSetup(t, 5)
	a := newGuard(t, client(), guard.Options{Batch: guard.BatchOptions{Enabled: true}})
	g.Expect(a.Do(t.Context(), guard.Job{}, ok)).To(Succeed())

	proxy.lose(t, "pool", 2) // the first run's reply and the first resend's
	g.Expect(a.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	// The next refresh (within 40 ms) loses its reply.
	g.Eventually(proxy.lost.Load).WithTimeout(time.Second).WithPolling(time.Millisecond).Should(BeNumerically(">=", 1))
	open := defaultPublished(0)
	open.State, open.Epoch, open.OpenUntil = wire.Open, 2, time.Now().Add(time.Minute)
	publish(t, direct, open)
	// The announcement reaches the process within a round trip (calls
	// started before it are the protocol's); the resend that gets through
	// comes a refresh or two after the first loss.
	time.Sleep(15 * time.Millisecond)
	tripped := time.Now()

	var admitted, refusedOpen int
	for time.Since(tripped) < 500*time.Millisecond {
		err := a.Do(t.Context(), guard.Job{}, ok)
		switch {
		case err == nil:
			admitted++
		case errors.Is(err, guard.ErrOpen):
			refusedOpen++
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("%d pool replies lost; after the trip: %d calls admitted, %d refused as Open", proxy.lost.Load(), admitted, refusedOpen)
	g.Expect(proxy.lost.Load()).To(Equal(int64(2)))
	g.Expect(admitted).To(BeZero(), "calls were admitted after the trip: a resent reply restored Closed")
	g.Expect(refusedOpen).To(BeNumerically(">", 0))
}
