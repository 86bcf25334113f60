package guard_test

import (
	"testing"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// A batching process is one contender in the pools' fair split, by its
// pool id: its keyed calls, which go per call, must not make it a second
// one under a caller id of their own (docs/protocol.md §4 pool "Fair
// share"). Refused for want of a slot, they count with the anonymous
// per-call callers instead: one contender for the whole fleet's.
func TestBatchingProcessKeyedCallsAreNoSecondContender(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	holder := newGuard(t, rdb, guard.Options{})
	p, err := holder.Acquire(t.Context(), guard.Job{})
	g.Expect(err).NotTo(HaveOccurred())
	defer func() { _ = p.Done(nil) }()

	gd := newGuard(t, rdb, guard.Options{Batch: guard.BatchOptions{Enabled: true}})
	// A call without a key: the pool wants a slot, a contender by its id.
	wantDecision(t, gd.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrThrottled)
	err = gd.Do(t.Context(), guard.Job{Key: "invoice-7", Version: 1}, ok)
	wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)

	keys := protocol.KeysFor(gd.Dependency())
	callers, err := rdb.ZRange(t.Context(), keys.Callers, 0, -1).Result()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(callers).To(BeEmpty(), "the batching process's keyed call named a contender of its own")
	percall, err := rdb.HGet(t.Context(), keys.Wants, "percall").Result()
	g.Expect(err).NotTo(HaveOccurred(), "the refused keyed call counted as no per-call demand at all")
	g.Expect(percall).NotTo(BeEmpty())
}
