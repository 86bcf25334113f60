package guard_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// modes are the worker library's two ways to admit a call: a round trip per
// call, or slots leased in batches (Options.Batch).
var modes = []struct {
	name  string
	batch guard.BatchOptions
}{
	{"per-call", guard.BatchOptions{}},
	{"batch", guard.BatchOptions{Enabled: true}},
}

// inModes runs a test once in each mode: the fault rules hold in both.
func inModes(t *testing.T, run func(t *testing.T, batch guard.BatchOptions)) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) { run(t, m.batch) })
	}
}

// inFlight counts calls running at the dependency and the most at once.
type inFlight struct{ now, peak atomic.Int64 }

// call is a dependency call that takes d.
func (f *inFlight) call(d time.Duration) func(context.Context) error {
	return func(context.Context) error {
		v := f.now.Add(1)
		for p := f.peak.Load(); v > p && !f.peak.CompareAndSwap(p, v); p = f.peak.Load() {
		}
		time.Sleep(d)
		f.now.Add(-1)
		return nil
	}
}

// Batching processes and a per-call one share a limit of 10 under
// contention: never more than 10 calls run at the dependency, every process
// gets calls through, and once they close every slot is back in Redis and
// every call is in the window the controller reads.
func TestBatchCapHoldsCountingCallsInFlight(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(10))
	guards := []*guard.Guard{newGuard(t, rdb, guard.Options{WaitForSlot: true})}
	for range 3 {
		guards = append(guards, newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: guard.BatchOptions{Enabled: true}}))
	}
	var f inFlight
	done := make([]atomic.Int64, len(guards))
	var wg sync.WaitGroup
	end := time.Now().Add(800 * time.Millisecond)
	for i, gd := range guards {
		for range 8 {
			wg.Go(func() {
				for time.Now().Before(end) {
					if err := gd.Do(t.Context(), guard.Job{}, f.call(time.Millisecond)); err != nil {
						t.Errorf("guard %d: %v", i, err)
						return
					}
					done[i].Add(1)
				}
			})
		}
	}
	wg.Wait()
	var total int64
	for i, gd := range guards {
		gd.Close()
		g.Expect(done[i].Load()).To(BeNumerically(">", 0), "guard %d got no call through", i)
		total += done[i].Load()
	}
	t.Logf("calls per guard (per-call first): %v, peak in flight %d", []int64{done[0].Load(), done[1].Load(), done[2].Load(), done[3].Load()}, f.peak.Load())
	g.Expect(f.peak.Load()).To(BeNumerically("<=", 10), "calls in flight over the limit")
	g.Expect(f.peak.Load()).To(BeNumerically(">=", 8), "the limit was not used")
	g.Expect(liveLeases(t, rdb, guards[0])).To(BeZero(), "slots still held after Close")
	g.Expect(window(t, rdb).Calls).To(Equal(total), "calls missing from the window after Close")
}
