package guard_test

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestDeadManCallsInHalfOpenAreNotProbes: a HalfOpen that no controller
// refreshed for its dead-man bound admits calls by the dead-man rule
// (docs/protocol.md §7). They are not probes: a cancelled one gives back no
// probe (probes.admitted keeps counting the epoch's one real probe), and
// their outcomes go to the stats, never toward closing the breaker. The real
// probe, admitted before the state went stale, still counts.
func TestDeadManCallsInHalfOpenAreNotProbes(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		p := defaultPublished(3)
		p.State, p.Capacity, p.Epoch = wire.HalfOpen, 40, 5
		p.HalfOpenProbes = 3
		p.StaleAfter = 300 * time.Millisecond
		publish(t, rdb, p)
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		probe, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(probesAdmitted(t, rdb)).To(Equal(int64(1)))
		time.Sleep(400 * time.Millisecond) // past the dead-man bound: no controller published

		ctx, cancel := context.WithCancel(t.Context())
		cancelled, err := gd.Acquire(ctx, guard.Job{})
		g.Expect(err).NotTo(HaveOccurred(), "the dead-man rule admits calls in a stale HalfOpen")
		succeeded, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(probesAdmitted(t, rdb)).To(Equal(int64(1)), "dead-man admissions take no probe")

		cancel()
		_ = cancelled.Done(context.Canceled)
		g.Expect(succeeded.Done(nil)).To(Succeed())
		g.Expect(probesAdmitted(t, rdb)).To(Equal(int64(1)), "a cancelled dead-man call gave back a probe it never took")
		w, probes := windowAndProbes(t, rdb)
		g.Expect(probes.Successes).To(BeZero(), "a dead-man call counted toward closing the breaker")
		g.Expect(w.Successes).To(Equal(int64(1)), "its outcome goes to the stats like any call's")

		g.Expect(probe.Done(nil)).To(Succeed())
		_, probes = windowAndProbes(t, rdb)
		g.Expect(probes.Successes).To(Equal(int64(1)), "the epoch's real probe counts")
	})
}

// probesAdmitted is the probes hash's admitted count.
func probesAdmitted(t *testing.T, rdb redis.UniversalClient) int64 {
	t.Helper()
	d, _ := protocol.ParseDependency(dep)
	n, err := rdb.HGet(context.Background(), protocol.KeysFor(d).Probes, "admitted").Int64()
	if err != nil && err != redis.Nil {
		t.Fatalf("read probes: %v", err)
	}
	return n
}

// windowAndProbes reads the window and the probe outcomes as the controller
// does.
func windowAndProbes(t *testing.T, rdb redis.UniversalClient) (protocol.Window, protocol.Probes) {
	t.Helper()
	d, _ := protocol.ParseDependency(dep)
	c, _ := protocol.NewClient(rdb, d)
	w, probes, _, err := c.ReadWindow(context.Background(), time.Minute, time.Time{})
	if err != nil {
		t.Fatalf("read window: %v", err)
	}
	return w, probes
}
