package guard_test

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// A failover to a replica that missed every lease (a new replication id,
// the leases key gone) while a call runs: the guard puts the call's lease
// back by itself within a hold period, in both modes, while another process
// is refused for the learning second; after it the cap counts the running
// call, and the slot is free only once the call ends.
func TestLeaseComesBackAfterAFailover(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		ctx := t.Context()
		srv := redistest.Start(t)
		rdb := fastClient(srv)
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})
		other := newGuard(t, rdb, guard.Options{Batch: batch})

		running, stop, done := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		go func() {
			done <- gd.Do(ctx, guard.Job{}, func(context.Context) error {
				close(running)
				<-stop
				return nil
			})
		}()
		<-running
		g.Expect(srv.Promote(ctx)).Error().NotTo(HaveOccurred())
		promoted := time.Now()
		g.Expect(rdb.Del(ctx, protocol.KeysFor(gd.Dependency()).Leases).Err()).To(Succeed()) // the writes the replica missed

		g.Eventually(func() int64 { return liveLeases(t, rdb, gd) }).
			WithTimeout(protocol.HoldEvery+250*time.Millisecond).WithPolling(5*time.Millisecond).
			Should(Equal(int64(1)), "the running call's lease is back")
		wantDecision(t, other.Do(ctx, guard.Job{}, ok), guard.ActionDefer, guard.ErrThrottled)
		time.Sleep(time.Until(promoted.Add(protocol.LearnFor + 100*time.Millisecond)))
		wantDecision(t, other.Do(ctx, guard.Job{}, ok), guard.ActionDefer, guard.ErrThrottled)

		close(stop)
		g.Expect(<-done).To(Succeed())
		g.Eventually(func() error { return other.Do(ctx, guard.Job{}, ok) }).
			WithTimeout(5*time.Second).WithPolling(20*time.Millisecond).Should(Succeed(), "the slot is free once the call ended")
	})
}
