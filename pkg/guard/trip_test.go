package guard_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestFleetTripsOnFailuresNotOnNoise: four guards calling as fast as they
// can, in each mode, under a policy with the in-path trip on (ratio 0.5 over
// at least 20 calls in a 10 s window, nine seconds of history at 45%
// failures behind it). While 45% of their calls fail at random, just under
// the ratio, the breaker stays Closed for 1.5 s of calls, at every
// failure's check (per-call) or every report's (batch). When every call
// fails, the fleet trips it in the fleet's path, with no controller, and
// the guards refuse the next calls.
func TestFleetTripsOnFailuresNotOnNoise(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		ctx := t.Context()
		now, err := rdb.Time(ctx).Result()
		g.Expect(err).NotTo(HaveOccurred())
		keys := protocol.KeysFor(protocol.Dependency{Namespace: "mail", Name: "template-api"})
		var hist []any
		for s := now.Unix() - 9; s < now.Unix(); s++ {
			hist = append(hist, fmt.Sprintf("%d:s", s), 550, fmt.Sprintf("%d:f", s), 450)
		}
		g.Expect(rdb.HSet(ctx, keys.Stats, hist...).Err()).To(Succeed())
		p := defaultPublished(1000)
		p.BreakerWindow = 10 * time.Second
		p.Trip = protocol.Trip{On: true, FailureRatio: 0.5, MinCalls: 20, Since: now.Add(-time.Minute), OpenDuration: time.Minute}
		publish(t, rdb, p)

		down := errors.New("connection refused")
		var failShare atomic.Uint64 // the share of calls that fail, in thousandths
		failShare.Store(450)
		var calls, failed atomic.Int64
		var guards []*guard.Guard
		for range 4 {
			guards = append(guards, newGuard(t, rdb, guard.Options{Batch: batch}))
		}
		run := func(d time.Duration) {
			rctx, cancel := context.WithTimeout(ctx, d)
			defer cancel()
			var waits []func() (int64, []error)
			for i, gd := range guards {
				rng := rand.New(rand.NewPCG(uint64(i), 45))
				waits = append(waits, load(rctx, gd, 4, func(context.Context) error {
					calls.Add(1)
					if rng.Uint64N(1000) < failShare.Load() {
						failed.Add(1)
						return down
					}
					return nil
				}))
			}
			for _, w := range waits {
				w()
			}
		}

		run(1500 * time.Millisecond)
		state := rdb.HGet(ctx, keys.State, "state").Val()
		t.Logf("noise: %d calls, %d failed (%.1f%%): %s", calls.Load(), failed.Load(), 100*float64(failed.Load())/float64(max(calls.Load(), 1)), state)
		g.Expect(calls.Load()).To(BeNumerically(">", 500), "too few calls to test anything")
		g.Expect(state).To(Equal(string(wire.Closed)), "45% failures tripped a breaker at 50%")

		failShare.Store(1000)
		calls.Store(0)
		start := time.Now()
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		wait := load(rctx, guards[0], 4, func(context.Context) error { calls.Add(1); return down })
		g.Eventually(func() string { return rdb.HGet(ctx, keys.State, "state").Val() }).WithTimeout(5*time.Second).WithPolling(time.Millisecond).
			Should(Equal(string(wire.Open)), "every call failing did not trip the breaker")
		tripped := time.Since(start)
		time.Sleep(100 * time.Millisecond) // batch mode: the pools drop their slots
		before := calls.Load()
		time.Sleep(300 * time.Millisecond)
		cancel()
		wait()
		t.Logf("all failing: tripped after %v and %d calls", tripped.Round(time.Millisecond), before)
		g.Expect(calls.Load()).To(Equal(before), "calls reached the dependency after the trip")
		g.Expect(rdb.HGet(ctx, keys.State, "tripped_from").Val()).To(Equal(string(wire.Closed)))
	})
}
