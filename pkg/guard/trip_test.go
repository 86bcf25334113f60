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

// The in-path trip at low volume and at the start of its window, in both
// modes, one call at a time so that every count is exact: under a ratio of
// 0.5 over at least 20 calls in a 10 s window, nine failures in a row stay
// under the minimum of calls, and 9 failures in 20 calls (45%) under the
// ratio: the breaker stays Closed. The next failures make 10 in 21
// (47.6%, Closed) and then 11 in 22 (50%): the breaker trips at that one,
// not before and not after. With "old", a second of 1,000 failures 12 s
// ago, before the window's start, is in the stats hash too: it must not
// count (nor move the trip by one call).
func TestFleetTripsAtLowVolumeExactly(t *testing.T) {
	for _, old := range []bool{false, true} {
		t.Run(fmt.Sprintf("failures before the window %v", old), func(t *testing.T) {
			inModes(t, func(t *testing.T, batch guard.BatchOptions) {
				g := NewWithT(t)
				rdb := fastClient(redistest.Start(t))
				ctx := t.Context()
				now, err := rdb.Time(ctx).Result()
				g.Expect(err).NotTo(HaveOccurred())
				keys := protocol.KeysFor(protocol.Dependency{Namespace: "mail", Name: "template-api"})
				if old {
					s := now.Unix() - 12
					g.Expect(rdb.HSet(ctx, keys.Stats, fmt.Sprintf("%d:f", s), 1000, fmt.Sprintf("%d:a1", s), 1000).Err()).To(Succeed())
				}
				p := defaultPublished(10)
				p.BreakerWindow = 10 * time.Second
				p.Trip = protocol.Trip{On: true, FailureRatio: 0.5, MinCalls: 20, Since: now.Add(-time.Minute), OpenDuration: time.Minute}
				publish(t, rdb, p)
				gd := newGuard(t, rdb, guard.Options{Batch: batch})
				down := errors.New("connection refused")
				state := func() string { return rdb.HGet(ctx, keys.State, "state").Val() }
				call := func(fail bool) {
					t.Helper()
					err := gd.Do(ctx, guard.Job{Attempt: 1}, func(context.Context) error {
						if fail {
							return down
						}
						return nil
					})
					if !fail {
						g.Expect(err).NotTo(HaveOccurred())
					}
					if batch.Enabled {
						time.Sleep(60 * time.Millisecond) // the report goes out with the next refresh
					}
				}
				for range 9 {
					call(true)
				}
				g.Expect(state()).To(Equal(string(wire.Closed)), "9 failures tripped the breaker below its minimum of 20 calls")
				for range 11 {
					call(false)
				}
				g.Expect(state()).To(Equal(string(wire.Closed)), "9 failures in 20 calls (45%%) tripped a breaker at 50%%")
				call(true)
				g.Expect(state()).To(Equal(string(wire.Closed)), "10 failures in 21 calls (47.6%%) tripped a breaker at 50%%")
				call(true)
				g.Eventually(state).WithTimeout(time.Second).Should(Equal(string(wire.Open)), "11 failures in 22 calls (50%%) did not trip a breaker at 50%%")
			})
		})
	}
}
