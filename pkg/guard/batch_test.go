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
	"github.com/spillway-dev/spillway/pkg/wire"
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

// load runs calls on gd from n goroutines until ctx ends, each call running
// fn; it returns a func that waits for them and the count of calls that
// ran, and of refusals by reason.
func load(ctx context.Context, gd *guard.Guard, n int, fn func(context.Context) error) (wait func() (ran int64, errs []error)) {
	var wg sync.WaitGroup
	var ran atomic.Int64
	var mu sync.Mutex
	var errs []error
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				err := gd.Do(ctx, guard.Job{}, fn)
				switch {
				case err == nil:
					ran.Add(1)
				case ctx.Err() != nil:
				default:
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					time.Sleep(time.Millisecond)
				}
			}
		})
	}
	return func() (int64, []error) {
		wg.Wait()
		return ran.Load(), errs
	}
}

// both counts a call in two counters: one guard's, and the fleet's.
func both(a, b *inFlight, d time.Duration) func(context.Context) error {
	return func(context.Context) error {
		for _, f := range []*inFlight{a, b} {
			v := f.now.Add(1)
			for p := f.peak.Load(); v > p && !f.peak.CompareAndSwap(p, v); p = f.peak.Load() {
			}
		}
		time.Sleep(d)
		a.now.Add(-1)
		b.now.Add(-1)
		return nil
	}
}

// A batching process holding the whole limit with calls still waiting, and
// a second one arriving with waiting calls: the second has its fair share,
// floor(limit / 2), running within 1 s, and the fleet never runs more than
// the limit meanwhile.
func TestBatchFairShareWithin1s(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(10))
	opts := guard.Options{WaitForSlot: true, Batch: guard.BatchOptions{Enabled: true}}
	ctx, stop := context.WithCancel(t.Context())
	var fleet, first, second inFlight
	waitFirst := load(ctx, newGuard(t, rdb, opts), 20, both(&first, &fleet, 5*time.Millisecond))
	g.Eventually(first.now.Load).WithTimeout(time.Second).WithPolling(time.Millisecond).Should(Equal(int64(10)), "the first process never held the limit")

	start := time.Now()
	waitSecond := load(ctx, newGuard(t, rdb, opts), 20, both(&second, &fleet, 5*time.Millisecond))
	g.Eventually(second.now.Load).WithTimeout(time.Second).WithPolling(time.Millisecond).Should(BeNumerically(">=", 5), "the second process has not its share within 1s")
	t.Logf("the second process ran floor(10/2) = 5 calls at once %v after it started waiting", time.Since(start).Round(time.Millisecond))
	time.Sleep(200 * time.Millisecond)
	stop()
	_, errs1 := waitFirst()
	_, errs2 := waitSecond()
	g.Expect(append(errs1, errs2...)).To(BeEmpty())
	g.Expect(fleet.peak.Load()).To(BeNumerically("<=", 10), "calls in flight over the limit")
}

// A batching process that just used the whole limit holds its slots idle
// for a few refreshes (its demand is remembered); once another process
// waits, per call or batching, they go back and its call is admitted within
// 100 ms.
func TestBatchIdleSlotsGoBackWithin100msOfAWaiter(t *testing.T) {
	for _, m := range modes {
		t.Run("waiter "+m.name, func(t *testing.T) {
			g := NewWithT(t)
			rdb := fastClient(redistest.Start(t))
			publish(t, rdb, defaultPublished(10))
			holder := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: guard.BatchOptions{Enabled: true}})
			var wg sync.WaitGroup
			var f inFlight
			for range 10 {
				wg.Go(func() {
					if err := holder.Do(t.Context(), guard.Job{}, f.call(20*time.Millisecond)); err != nil {
						t.Error(err)
					}
				})
			}
			wg.Wait()
			g.Expect(f.peak.Load()).To(Equal(int64(10)))
			g.Expect(liveLeases(t, rdb, holder)).To(Equal(int64(10)), "the holder does not hold its idle slots")

			waiter := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: m.batch})
			start := time.Now()
			admitted := make(chan time.Duration, 1)
			go func() {
				if err := waiter.Do(t.Context(), guard.Job{}, ok); err != nil {
					t.Error(err)
				}
				admitted <- time.Since(start)
			}()
			// A slot is back in Redis once fewer than 10 are held, or
			// once the waiter was admitted (it may take it at once).
			var back, took time.Duration
			for back == 0 {
				select {
				case took = <-admitted:
					back = took
				default:
					if liveLeases(t, rdb, holder) < 10 {
						back = time.Since(start)
					}
				}
			}
			if took == 0 {
				took = <-admitted
			}
			t.Logf("slots back in Redis %v after the waiter started waiting, the waiter admitted after %v",
				back.Round(time.Millisecond), took.Round(time.Millisecond))
			g.Expect(back).To(BeNumerically("<", 100*time.Millisecond), "idle slots went back too late")
			if m.batch.Enabled {
				// A per-call waiter polls at its own backoff; a batching
				// one takes them at its next refresh.
				g.Expect(took).To(BeNumerically("<", 100*time.Millisecond), "the batching waiter was admitted too late")
			}
		})
	}
}

// A batching process running at the limit with calls waiting: a lower
// limit or Open published by the controller stops calls from starting over
// the new limit within 100 ms of the publish with the change announcements
// (pub/sub), and within the refresh interval (plus a round trip) without
// them; the slots given back reach Redis as their calls end.
func TestBatchShrinksOnAPublishedChange(t *testing.T) {
	const refresh = 20 * time.Millisecond
	lower := defaultPublished(4)
	open := defaultPublished(0)
	open.State = wire.Open
	open.OpenUntil = time.Now().Add(time.Minute)
	for _, c := range []struct {
		name   string
		change published
		batch  guard.BatchOptions
		bound  time.Duration
	}{
		// The bound is 100 ms; with pub/sub the bound here is half
		// the refresh interval, so that the announcement, not the next
		// refresh, is seen to act (about 1 ms measured).
		{"lower limit, pub/sub", lower, guard.BatchOptions{Enabled: true, Refresh: 50 * time.Millisecond}, 25 * time.Millisecond},
		{"Open, pub/sub", open, guard.BatchOptions{Enabled: true, Refresh: 50 * time.Millisecond}, 25 * time.Millisecond},
		{"lower limit, no pub/sub", lower, guard.BatchOptions{Enabled: true, Refresh: refresh, IgnoreChanges: true}, refresh + 20*time.Millisecond},
		{"Open, no pub/sub", open, guard.BatchOptions{Enabled: true, Refresh: refresh, IgnoreChanges: true}, refresh + 20*time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := NewWithT(t)
			rdb := fastClient(redistest.Start(t))
			publish(t, rdb, defaultPublished(10))
			gd := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: c.batch})
			var running, lastOver, starts atomic.Int64 // lastOver: since the publish
			var limit atomic.Int64
			limit.Store(10)
			var changed time.Time
			call := func(context.Context) error {
				starts.Add(1)
				if running.Add(1) > limit.Load() {
					lastOver.Store(int64(time.Since(changed)))
				}
				time.Sleep(2 * time.Millisecond)
				running.Add(-1)
				return nil
			}
			ctx, stop := context.WithCancel(t.Context())
			wait := load(ctx, gd, 16, call)
			g.Eventually(running.Load).WithTimeout(time.Second).WithPolling(time.Millisecond).Should(Equal(int64(10)))
			// Calls wait for slots the whole time: the refresher must not
			// spin on Redis for more than the limit lets it have.
			c0 := commandCalls(t, rdb)
			time.Sleep(100 * time.Millisecond)
			refreshes := commandCalls(t, rdb)["evalsha"] - c0["evalsha"]
			g.Expect(refreshes).To(BeNumerically("<=", int(100*time.Millisecond/c.batch.Refresh)+2), "refreshes in 100ms with calls waiting")

			changed = time.Now()
			lastOver.Store(0)
			before := starts.Load()
			limit.Store(c.change.Limit) // from the moment the publish starts
			publish(t, rdb, c.change)
			time.Sleep(c.bound + 200*time.Millisecond)
			live := liveLeases(t, rdb, gd)
			started := starts.Load() - before
			stop()
			_, errs := wait()
			over := time.Duration(lastOver.Load())
			t.Logf("%d refreshes in 100ms; the last call over the new limit started %v after the publish; %d calls started after it; %d slots live in Redis %v after it",
				refreshes, over.Round(100*time.Microsecond), started, live, c.bound+200*time.Millisecond)
			g.Expect(over).To(BeNumerically("<", c.bound), "calls kept starting over the new limit")
			g.Expect(live).To(BeNumerically("<=", c.change.Limit), "surplus slots were not given back")
			for _, err := range errs {
				if c.change.State != wire.Open || !errors.Is(err, guard.ErrOpen) {
					t.Errorf("unexpected refusal: %v", err)
				}
			}
		})
	}
}
