package guard_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// Calls keep failing, one every 10 ms for a second, while Redis does not
// answer: each must learn within a few RedisTimeouts that the budget is
// unknown (ActionPark), in both modes. Batch mode asks the budget for the
// calls that fail meanwhile in one lookup: that lookup's result, error
// included, goes to every call waiting for it, instead of each waiter
// making its own lookup in turn (the k-th waiting about k × RedisTimeout
// while failures keep coming).
func TestFailedCallsDuringAnOutageAreParkedTogether(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		srv := redistest.Start(t)
		rdb := fastClient(srv)
		publish(t, rdb, defaultPublished(100))
		const timeout = 100 * time.Millisecond
		gd := newGuard(t, rdb, guard.Options{RedisTimeout: timeout, WaitForSlot: true, Batch: batch})

		const n = 100
		var running sync.WaitGroup
		running.Add(n)
		fail := make(chan struct{})
		boom := errors.New("503")
		var worst atomic.Int64
		errs := make(chan error, n)
		for i := range n {
			go func() {
				var failed time.Time
				var err error
				for failed.IsZero() && t.Context().Err() == nil {
					// Refused on a loaded machine (Redis slow to answer
					// 100 acquisitions at once): try again.
					err = gd.Do(t.Context(), guard.Job{Attempt: 1}, func(context.Context) error {
						running.Done()
						<-fail
						time.Sleep(time.Duration(i) * 10 * time.Millisecond)
						failed = time.Now()
						return boom
					})
				}
				took := int64(time.Since(failed))
				for w := worst.Load(); took > w && !worst.CompareAndSwap(w, took); w = worst.Load() {
				}
				errs <- err
			}()
		}
		running.Wait()
		g.Expect(srv.Pause()).To(Succeed())
		defer func() { _ = srv.Resume() }()
		close(fail)
		for range n {
			wantDecision(t, <-errs, guard.ActionPark, guard.ErrBudgetExhausted)
		}
		t.Logf("slowest decision with Redis paused: %v", time.Duration(worst.Load()).Round(time.Millisecond))
		// Per call: the release and the budget lookup, a RedisTimeout each.
		g.Expect(time.Duration(worst.Load())).To(BeNumerically("<", 5*timeout), "failed calls waited for each other's lookups")
	})
}
