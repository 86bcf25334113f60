package guard_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

func TestSmokeBatch(t *testing.T) {
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(10))
	gd := newGuard(t, rdb, guard.Options{Batch: guard.BatchOptions{Enabled: true}, WaitForSlot: true})
	var inflight, peak, n atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 32 {
		wg.Go(func() {
			for time.Since(start) < time.Second {
				err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error {
					v := inflight.Add(1)
					for p := peak.Load(); v > p && !peak.CompareAndSwap(p, v); p = peak.Load() {
					}
					time.Sleep(time.Millisecond)
					inflight.Add(-1)
					return nil
				})
				if err != nil {
					t.Logf("err %v", err)
				} else {
					n.Add(1)
				}
			}
		})
	}
	wg.Wait()
	gd.Close()
	w := window(t, rdb)
	t.Logf("calls %d peak %d window %+v", n.Load(), peak.Load(), w)
}
