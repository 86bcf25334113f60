package guard_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
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
				case func() bool { dl, ok := ctx.Deadline(); return ok && !time.Now().Before(dl) }():
					// The deadline passed before its timer ended ctx: the
					// refusal is the wait's, as the guard answers it.
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
// (pub/sub), and within the refresh interval (plus a round trip; two
// intervals here) without them; the slots given back reach Redis as their calls end.
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
		// Without pub/sub: the next refresh, a round trip after its tick
		// (measured up to 28 ms; bounded at two intervals, for a busy
		// machine).
		{"lower limit, no pub/sub", lower, guard.BatchOptions{Enabled: true, Refresh: refresh, IgnoreChanges: true}, 2 * refresh},
		{"Open, no pub/sub", open, guard.BatchOptions{Enabled: true, Refresh: refresh, IgnoreChanges: true}, 2 * refresh},
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

// The window the controller reads holds what per-call reporting would:
// during a run it lags the calls that ended by one refresh at most (at
// 1 000 calls/s and a 40 ms refresh, 40 calls: 0.13% of a 30 s window), and
// once the calls end it equals their outcomes and attempts exactly, in both
// modes, without waiting for Close. (The mid-run check allows three
// refreshes, for a busy machine.)
func TestBatchWindowEqualsPerCallReporting(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(20))
		boom := errors.New("502")
		var ended, failures atomic.Int64
		var byAttempt [4]atomic.Int64
		ctx, stop := context.WithCancel(t.Context())
		var wg sync.WaitGroup
		for range 2 {
			gd := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: batch})
			for w := range 6 {
				wg.Go(func() {
					for i := w; ctx.Err() == nil; i++ {
						attempt := i%4 + 1
						fail := i%7 == 0
						_ = gd.Do(context.WithoutCancel(ctx), guard.Job{Attempt: attempt}, func(context.Context) error {
							time.Sleep(500 * time.Microsecond)
							if fail {
								return boom
							}
							return nil
						})
						if fail {
							failures.Add(1)
						}
						byAttempt[attempt-1].Add(1)
						ended.Add(1)
					}
				})
			}
		}
		time.Sleep(300 * time.Millisecond)
		before := ended.Load()
		time.Sleep(120 * time.Millisecond) // three refreshes: one, and room for a busy machine
		w := window(t, rdb)
		after := ended.Load()
		g.Expect(w.Calls).To(BeNumerically(">=", before), "the window lags more than three refreshes")
		g.Expect(w.Calls).To(BeNumerically("<=", after+12), "the window counts calls that never ran")
		stop()
		wg.Wait()

		want := [4]int64{}
		for i := range want {
			want[i] = byAttempt[i].Load()
		}
		g.Eventually(func() protocol.Window { return window(t, rdb) }).WithTimeout(200*time.Millisecond).WithPolling(10*time.Millisecond).
			Should(And(
				HaveField("Calls", ended.Load()),
				HaveField("Failures", failures.Load()),
				HaveField("ByAttempt", want),
			), "the window after the calls ended")
		t.Logf("%d calls, %d failures; mid-run the window read %d with %d ended 120ms before and %d after", ended.Load(), failures.Load(), w.Calls, before, after)
	})
}

// Batching processes and a per-call one under a fleet rate of 300/s (burst
// 30): the calls started in every 1 s window are at most rate + burst, and
// the fleet gets most of the rate.
func TestBatchRateBoundOverEvery1sWindow(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(50)
	p.RatePerSecond = 300
	publish(t, rdb, p)
	var mu sync.Mutex
	var starts []time.Time
	call := func(context.Context) error {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		return nil
	}
	ctx, stop := context.WithTimeout(t.Context(), 1600*time.Millisecond)
	defer stop()
	var waits []func() (int64, []error)
	for _, batch := range []bool{true, true, false} {
		gd := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: guard.BatchOptions{Enabled: batch}})
		waits = append(waits, load(ctx, gd, 6, call))
	}
	for _, wait := range waits {
		_, errs := wait()
		g.Expect(errs).To(BeEmpty())
	}
	bound := p.RatePerSecond + protocol.RateBurst(p.RatePerSecond)
	most := 0
	for i, j := 0, 0; i < len(starts); i++ {
		for j < len(starts) && starts[j].Sub(starts[i]) < time.Second {
			j++
		}
		most = max(most, j-i)
	}
	t.Logf("%d calls in 1.6s; at most %d in a 1s window (bound %d)", len(starts), most, bound)
	g.Expect(most).To(BeNumerically("<=", bound), "the fleet rate was exceeded")
	g.Expect(len(starts)).To(BeNumerically(">=", 380), "the fleet got less than 80% of the rate")
}

// A refusal says what was missing: with every slot held, a call is
// throttled (ErrThrottled), never rate limited, though no rate token is
// left either; with slots free and the rate spent, it is ErrRateLimited.
func TestBatchRefusalReasons(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		p := defaultPublished(1)
		p.RatePerSecond = 200 // burst 20
		publish(t, rdb, p)
		gd := newGuard(t, rdb, guard.Options{Batch: batch})
		// Another process holds the only slot.
		held, err := newGuard(t, rdb, guard.Options{WaitForSlot: true}).Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())
		for range 40 {
			wantDecision(t, gd.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrThrottled)
		}
		g.Expect(held.Done(nil)).To(Succeed())

		p.Limit, p.Capacity = 50, 50
		publish(t, rdb, p)
		time.Sleep(100 * time.Millisecond) // the change reaches a batching process
		var refusal error
		for i := 0; i < 100 && refusal == nil; i++ {
			refusal = gd.Do(t.Context(), guard.Job{}, ok)
		}
		wantDecision(t, refusal, guard.ActionDefer, guard.ErrRateLimited)
	})
}

// Failing calls from two processes at once: the retries granted stay
// within the fleet's budget (a retry is granted while granted < max(MinRetries,
// Ratio × calls)), in both modes
// (batch mode takes grants in batches; a grant it took and did not hand out
// only makes the budget stricter), and most of the budget is used.
func TestBatchRetryBudgetWithinBudget(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t))
		p := defaultPublished(20)
		p.Budget = retry.Budget{Ratio: 0.1, MinRetries: 5, Window: time.Minute}
		publish(t, rdb, p)
		boom := errors.New("503")
		var retries atomic.Int64
		var wg sync.WaitGroup
		end := time.Now().Add(400 * time.Millisecond)
		var guards []*guard.Guard
		for range 2 {
			gd := newGuard(t, rdb, guard.Options{WaitForSlot: true, Batch: batch})
			guards = append(guards, gd)
			for w := range 8 {
				wg.Go(func() {
					for i := w; time.Now().Before(end); i++ {
						err := gd.Do(t.Context(), guard.Job{Attempt: 1 + i%2}, func(context.Context) error {
							time.Sleep(200 * time.Microsecond)
							if i%3 == 0 {
								return boom
							}
							return nil
						})
						if a, _, _ := guard.Decide(err); err != nil && a == guard.ActionRetry {
							retries.Add(1)
						}
					}
				})
			}
		}
		wg.Wait()
		for _, gd := range guards {
			gd.Close()
		}
		w := window(t, rdb)
		bound := max(float64(p.Budget.MinRetries), p.Budget.Ratio*float64(w.Calls))
		t.Logf("%d calls, %d failures; %d retries handed out, %d granted in Redis, %d refused; budget %.0f",
			w.Calls, w.Failures, retries.Load(), w.RetriesGranted, w.BudgetRefused, bound)
		// Each grant needs granted < bound before it: after the last one,
		// granted < bound + 1.
		g.Expect(float64(w.RetriesGranted)).To(BeNumerically("<", bound+1), "over the budget")
		g.Expect(retries.Load()).To(BeNumerically("<=", w.RetriesGranted), "retries handed out that Redis never granted")
		g.Expect(float64(retries.Load())).To(BeNumerically(">=", bound/2), "most of the budget unused")
	})
}

// A pool refresh that Redis ran but whose reply was lost is sent again under
// the same request id, and pool.lua answers it with the first run's reply:
// the slots it granted are not held by nobody for a lease TTL, and the
// outcomes it reported count once. Five failing calls, with the replies of
// three refreshes lost, add exactly five failures; after Close no slot is
// held.
func TestBatchRefreshWhoseReplyWasLostCountsOnce(t *testing.T) {
	g := NewWithT(t)
	srv := redistest.Start(t)
	direct := fastClient(srv)
	publish(t, direct, defaultPublished(2))
	batch := guard.Options{Batch: guard.BatchOptions{Enabled: true}}
	loader := newGuard(t, direct, batch)
	g.Expect(loader.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "loading the scripts")
	loader.Close()
	before := window(t, direct)

	proxy := newLostReplies(t, srv.Addr())
	gd := newGuard(t, readmeClient(t, proxy.addr()), batch)
	proxy.lose(t, "pool", 3)
	failing := errors.New("dependency failed")
	for range 5 {
		err := gd.Do(t.Context(), guard.Job{Attempt: 1}, func(context.Context) error { return failing })
		g.Expect(errors.Is(err, failing)).To(BeTrue(), "Do = %v, want the call's failure", err)
		time.Sleep(30 * time.Millisecond) // a refresh or so apart
	}
	gd.Close()
	t.Logf("%d pool replies lost", proxy.lost.Load())
	g.Expect(proxy.lost.Load()).To(BeNumerically(">=", 1), "the proxy lost no pool reply")
	after := window(t, direct)
	g.Expect(after.Failures-before.Failures).To(Equal(int64(5)), "failures added by five calls")
	g.Expect(after.Calls-before.Calls).To(Equal(int64(5)), "calls added by five calls")
	g.Expect(after.ByAttempt[0]-before.ByAttempt[0]).To(Equal(int64(5)), "first attempts added by five calls")
	g.Expect(liveLeases(t, direct, gd)).To(BeZero(), "a slot granted in a lost reply is held by nobody")
}

// Redis restarted empty under a running call (protocol 6): with no state
// stored nobody admits, and the holder puts the call's lease back, in both
// modes (a per-call Permit through its renewal or hold, a batching pool at
// its refresh); the manager's publication over the lost state (Restored)
// then learns for a second, so the call keeps its slot and the fleet counts
// it throughout. Calls flow again after, and no slot is held by nobody.
func TestRedisRestartedEmptyKeepsTheRunningCallsSlots(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		srv := redistest.Start(t)
		rdb := fastClient(srv)
		publish(t, rdb, defaultPublished(2))
		gd := newGuard(t, rdb, guard.Options{LeaseTTL: 300 * time.Millisecond, Batch: batch})
		p, err := gd.Acquire(t.Context(), guard.Job{})
		g.Expect(err).NotTo(HaveOccurred())

		g.Expect(srv.Restart()).To(Succeed())
		g.Eventually(func() int64 { return liveLeases(t, rdb, gd) }).
			WithTimeout(time.Second).WithPolling(5*time.Millisecond).Should(Equal(int64(1)), "the running call's lease is back")
		restored := defaultPublished(2)
		restored.Restored = true
		publish(t, rdb, restored)
		g.Consistently(p.Context().Done()).WithTimeout(protocol.LearnFor).ShouldNot(BeClosed(), "the call keeps its slot")
		g.Expect(liveLeases(t, rdb, gd)).To(Equal(int64(1)))
		g.Expect(p.Done(nil)).To(Succeed())

		g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, ok) }).
			WithTimeout(2 * time.Second).WithPolling(10 * time.Millisecond).Should(Succeed())
		gd.Close()
		g.Expect(liveLeases(t, rdb, gd)).To(BeZero())
	})
}

// The batch gauges say what an SRE needs to know of a process: whether its
// calls take local slots (batch_local 1) and how many slots it holds. Open
// sends its calls per call and empties its pool.
func TestBatchGauges(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	reg := prometheus.NewRegistry()
	gd := newGuard(t, rdb, guard.Options{Registerer: reg, Batch: guard.BatchOptions{Enabled: true}})
	local := func() float64 { return gauge(t, reg, "spillway_worker_batch_local") }
	slots := func() float64 { return gauge(t, reg, "spillway_worker_batch_slots") }

	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error { time.Sleep(20 * time.Millisecond); return nil }); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	g.Expect(local()).To(Equal(1.0), "calls take local slots")
	g.Expect(slots()).To(BeNumerically(">=", 1), "the pool holds slots")

	open := defaultPublished(0)
	open.State, open.OpenUntil = wire.Open, time.Now().Add(time.Minute)
	publish(t, rdb, open)
	// Open reaches the process within a round trip of the publish.
	g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, ok) }).WithTimeout(100 * time.Millisecond).
		WithPolling(time.Millisecond).Should(MatchError(guard.ErrOpen))
	g.Eventually(local).WithTimeout(time.Second).Should(Equal(0.0), "Open: calls no longer take local slots")
	g.Eventually(slots).WithTimeout(time.Second).Should(Equal(0.0), "Open: the pool gave its slots back")
}
