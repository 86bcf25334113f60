package protocol_test

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestReleaseCounts(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(2))
		for _, r := range []struct {
			o       protocol.Outcome
			attempt int
		}{
			{protocol.Success, 1}, {protocol.Failure, 2}, {protocol.Timeout, 3},
			{protocol.Success, 7}, {protocol.Failure, 4}, {protocol.Success, 1},
		} {
			mustRelease(t, c, mustAdmit(t, c, 10*time.Second), r.o, r.attempt)
		}
		want := protocol.Window{
			Calls: 6, Successes: 3, Failures: 2, Timeouts: 1,
			ByAttempt: [4]int64{2, 1, 1, 2},
		}
		w, pr := mustWindow(t, c, time.Minute, time.Time{})
		if w != want {
			t.Errorf("window = %+v, want %+v", w, want)
		}
		if w.Retries() != 4 {
			t.Errorf("Retries() = %d, want 4", w.Retries())
		}
		if pr != (protocol.Probes{}) {
			t.Errorf("probes counted while Closed: %+v", pr)
		}

		// Refusals are not calls: throttled, rate, open and superseded.
		a := mustAdmit(t, c, 10*time.Second)
		mustAdmit(t, c, 10*time.Second)
		for range 3 {
			if r := mustAcquire(t, c, time.Second); r.Code != protocol.RefusedThrottled {
				t.Fatalf("%+v, want throttled", r)
			}
		}
		mustRelease(t, c, a, protocol.Success, 1)
		p := policy(100)
		p.RatePerSecond = 1
		mustPublish(t, c, p)
		mustAdmit(t, c, 10*time.Second)
		if r := mustAcquire(t, c, time.Second); r.Code != protocol.RefusedRate {
			t.Fatalf("%+v, want rate", r)
		}
		if _, err := c.Supersede(ctxT(t), "job", 9, time.Minute); err != nil {
			t.Fatal(err)
		}
		if r, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: "x", TTL: time.Second, JobKey: "job", JobVersion: 1, JobTTL: time.Minute}); err != nil || r.Code != protocol.RefusedSuperseded {
			t.Fatalf("%+v %v, want superseded", r, err)
		}
		p.State = wire.Open
		mustPublish(t, c, p)
		if r := mustAcquire(t, c, time.Second); r.Code != protocol.RefusedOpen {
			t.Fatalf("%+v, want open", r)
		}
		if w, _ = mustWindow(t, c, time.Minute, time.Time{}); w.Calls != 7 || w.Successes != 4 {
			t.Errorf("after refusals: calls %d successes %d, want 7 and 4 (only releases count)", w.Calls, w.Successes)
		}
	})
}

// TestReleaseProbes: probe outcomes count only while HalfOpen, and only for a
// call admitted in the current epoch.
func TestReleaseProbes(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		mustPublish(t, c, p)
		closed := mustAdmit(t, c, 10*time.Second) // epoch 1, Closed
		if closed.State != wire.Closed {
			t.Errorf("admission state = %q, want Closed", closed.State)
		}
		mustRelease(t, c, mustAdmit(t, c, 10*time.Second), protocol.Failure, 1)

		p.State, p.Epoch, p.Limit = wire.HalfOpen, 2, 3
		mustPublish(t, c, p)
		// The epoch-1 call ends during HalfOpen: not a probe, whether the
		// worker passes its epoch or 0.
		mustRelease(t, c, closed, protocol.Failure, 1)
		if _, err := c.Release(ctxT(t), "", 0, protocol.Failure, 1); err != nil {
			t.Fatal(err)
		}
		probe1 := mustAdmit(t, c, 10*time.Second)
		probe2 := mustAdmit(t, c, 10*time.Second)
		if probe1.Epoch != 2 || probe1.State != wire.HalfOpen {
			t.Fatalf("probe admitted at epoch %d in %q, want 2, HalfOpen", probe1.Epoch, probe1.State)
		}
		mustRelease(t, c, probe1, protocol.Success, 1)
		mustRelease(t, c, probe2, protocol.Timeout, 2)
		_, pr := mustWindow(t, c, time.Minute, time.Time{})
		if pr != (protocol.Probes{Successes: 1, Timeouts: 1}) {
			t.Errorf("probes = %+v, want 1 success and 1 timeout", pr)
		}

		// A probe of epoch 2 that ends after the breaker reopened (epoch 3)
		// and half-opened again (epoch 4) is not one of epoch 4's probes.
		late := mustAdmit(t, c, 10*time.Second)
		p.State, p.Epoch, p.Limit = wire.Open, 3, 0
		mustPublish(t, c, p)
		p.State, p.Epoch, p.Limit = wire.HalfOpen, 4, 3
		mustPublish(t, c, p)
		mustRelease(t, c, late, protocol.Success, 1)
		if _, pr = mustWindow(t, c, time.Minute, time.Time{}); pr != (protocol.Probes{}) {
			t.Errorf("probes of epoch 4 = %+v, want none: the epoch-2 probe does not count", pr)
		}
		// Closed again: a release with the current epoch is not a probe.
		p.State, p.Epoch, p.Limit = wire.Closed, 5, 10
		mustPublish(t, c, p)
		a := mustAdmit(t, c, 10*time.Second)
		if _, err := c.Release(ctxT(t), a.Member, 5, protocol.Failure, 1); err != nil {
			t.Fatal(err)
		}
		if _, pr = mustWindow(t, c, time.Minute, time.Time{}); pr != (protocol.Probes{}) {
			t.Errorf("probes while Closed = %+v, want none", pr)
		}
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		if w.Calls != 7 {
			t.Errorf("calls = %d, want 7 (probes are calls too)", w.Calls)
		}
	})
}

// hsetSeconds writes counters directly into the stats hash: fields maps a
// second offset from now (0, -5, ...) and a suffix to a count.
func hsetSeconds(t testing.TB, rdb redis.UniversalClient, c *protocol.Client, nowS int64, fields map[int64]map[string]int64) {
	t.Helper()
	var args []any
	for off, m := range fields {
		for suffix, n := range m {
			args = append(args, fmt.Sprintf("%d:%s", nowS+off, suffix), n)
		}
	}
	if err := rdb.HSet(ctxT(t), c.Keys().Stats, args...).Err(); err != nil {
		t.Fatal(err)
	}
}

func TestReadWindowFromAndLength(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		now := redisNow(t, rdb).Unix()
		// Counts at now-10, now-5 and now-2 s; the gaps absorb one tick of
		// the clock between here and the script.
		hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{
			-10: {"s": 1, "a1": 1},
			-5:  {"f": 10, "a2": 10, "g": 4},
			-2:  {"t": 100, "a4": 100, "b": 3},
		})
		for _, tc := range []struct {
			name   string
			length time.Duration
			from   time.Time
			calls  int64
		}{
			{"whole minute", time.Minute, time.Time{}, 111},
			{"7s window", 7 * time.Second, time.Time{}, 110},
			{"4s window", 4 * time.Second, time.Time{}, 100},
			{"length rounds up to whole seconds", 3500 * time.Millisecond, time.Time{}, 100},
			{"from before all", time.Minute, time.Unix(now-30, 0), 111},
			{"from excludes older seconds", time.Minute, time.Unix(now-7, 0), 110},
			{"from excludes its own second", time.Minute, time.Unix(now-5, 500_000_000), 100},
			{"from after all", time.Minute, time.Unix(now-1, 0), 0},
			{"shorter of from and length", 4 * time.Second, time.Unix(now-30, 0), 100},
		} {
			w, _ := mustWindow(t, c, tc.length, tc.from)
			if w.Calls != tc.calls {
				t.Errorf("%s: calls = %d, want %d", tc.name, w.Calls, tc.calls)
			}
		}
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		want := protocol.Window{Calls: 111, Successes: 1, Failures: 10, Timeouts: 100, ByAttempt: [4]int64{1, 10, 0, 100}, RetriesGranted: 4, BudgetRefused: 3}
		if w != want {
			t.Errorf("window = %+v, want %+v", w, want)
		}
		_, _, at, err := c.ReadWindow(ctxT(t), time.Minute, time.Time{})
		if err != nil || at.Unix() < now || at.Unix() > now+5 {
			t.Errorf("ReadWindow Redis time = %v (err %v), want about %v", at, err, time.Unix(now, 0))
		}
	})
}

// TestLongWindowsWithinLuaLimits: windows of 10 minutes work for the
// controller's read and the budget.
func TestLongWindowsWithinLuaLimits(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		p.BreakerWindow, p.Budget.Window = 10*time.Minute, 10*time.Minute
		mustPublish(t, c, p)
		now := redisNow(t, rdb).Unix()
		hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{-590: {"s": 100, "a1": 100}, -3: {"f": 50, "a1": 50}})
		w, _, _, err := c.ReadWindow(ctxT(t), 10*time.Minute, time.Time{})
		if err != nil || w.Calls != 150 {
			t.Errorf("ReadWindow(10m) = %+v, %v; want 150 calls", w, err)
		}
		d, err := c.RetryBudget(ctxT(t))
		if err != nil || !d.Allowed || d.Calls != 150 {
			t.Errorf("RetryBudget over 10m = %+v, %v; want allowed with 150 calls", d, err)
		}
	})
}

// TestLongWindows: the API allows breaker and budget windows of up to 1h;
// the controller reads the breaker window with ReadWindow and every failed
// job asks RetryBudget over the budget window.
func TestLongWindows(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		p.BreakerWindow, p.Budget.Window = time.Hour, time.Hour
		mustPublish(t, c, p)
		now := redisNow(t, rdb).Unix()
		hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{-3590: {"s": 100, "a1": 100}, -3: {"f": 50, "a1": 50}})
		for _, length := range []time.Duration{15 * time.Minute, time.Hour} {
			w, _, _, err := c.ReadWindow(ctxT(t), length, time.Time{})
			if err != nil || w.Calls < 50 {
				t.Errorf("ReadWindow(%v) = calls %d, err %v", length, w.Calls, err)
			}
		}
		d, err := c.RetryBudget(ctxT(t))
		if err != nil || !d.Allowed || d.Calls != 150 {
			t.Errorf("RetryBudget over 1h = %+v, %v; want allowed with 150 calls", d, err)
		}
	})
}

// TestRetryBudgetMatchesAllowsPPM checks the Lua decision against the pure
// rule on a table of states, boundaries included.
func TestRetryBudgetMatchesAllowsPPM(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		rows := []struct {
			calls, granted int64
			ratio          float64
			min            int64
		}{
			{0, 0, 0.2, 10}, {0, 9, 0.2, 10}, {0, 10, 0.2, 10}, {0, 11, 0.2, 10},
			{49, 9, 0.2, 10}, {50, 10, 0.2, 10}, {55, 10, 0.2, 10}, {56, 11, 0.2, 10},
			{100, 19, 0.2, 10}, {100, 20, 0.2, 10}, {101, 20, 0.2, 10}, {104, 20, 0.2, 10}, {105, 21, 0.2, 10},
			{1000, 199, 0.2, 10}, {1000, 200, 0.2, 10},
			{0, 0, 0, 0}, {1000, 0, 0, 0}, {1000, 0, 0.000001, 0}, {999_999, 0, 0.000001, 0}, {1_000_000, 0, 0.000001, 0}, {1_000_001, 1, 0.000001, 0},
			{5, 4, 1, 0}, {5, 5, 1, 0}, {3, 0, 1.0 / 3, 0}, {3, 1, 1.0 / 3, 0}, {300, 99, 1.0 / 3, 0}, {300, 100, 1.0 / 3, 0},
			{7, 1, 0.142857, 0}, {7, 0, 0.142857, 0}, {1_000_000, 142_856, 0.142857, 1}, {1_000_000, 142_857, 0.142857, 1},
			{10, 3, 0.25, 3}, {12, 3, 0.25, 3}, {13, 3, 0.25, 3},
			// Large counts, exact below 2^53 in Lua's doubles.
			{9_000_000_000, 1_799_999_999, 0.2, 10}, {9_000_000_000, 1_800_000_000, 0.2, 10},
			{9_000_000_000, 8_999_999_999, 1, 10}, {9_000_000_000, 9_000_000_000, 1, 10},
			{0, 4_000_000_000, 0.2, 4_000_000_001}, {0, 4_000_000_001, 0.2, 4_000_000_001},
		}
		for i, r := range rows {
			p := policy(10)
			p.Budget = retry.Budget{Ratio: r.ratio, MinRetries: r.min, Window: time.Minute}
			mustPublish(t, c, p)
			if err := rdb.Del(ctx, c.Keys().Stats).Err(); err != nil {
				t.Fatal(err)
			}
			now := redisNow(t, rdb).Unix()
			// Calls over two seconds, grants in a third: the window sums them.
			hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{
				-7: {"s": r.calls / 2, "a1": r.calls / 2},
				-6: {"f": r.calls / 4, "t": r.calls - r.calls/2 - r.calls/4, "a2": r.calls - r.calls/2},
				-5: {"g": r.granted},
			})
			want := retry.AllowsPPM(r.granted, r.calls, retry.RatioPPM(r.ratio), r.min)
			d, err := c.RetryBudget(ctx)
			if err != nil {
				t.Fatalf("row %d: %v", i, err)
			}
			if d.Allowed != want || d.Calls != r.calls || d.Granted != r.granted {
				t.Errorf("row %d %+v: RetryBudget = allowed %v calls %d granted %d; AllowsPPM = %v",
					i, r, d.Allowed, d.Calls, d.Granted, want)
			}
			w, _ := mustWindow(t, c, time.Minute, time.Time{})
			wantG, wantB := r.granted, int64(1)
			if want {
				wantG, wantB = r.granted+1, 0
			}
			if w.RetriesGranted != wantG || w.BudgetRefused != wantB {
				t.Errorf("row %d: window granted %d refused %d, want %d and %d", i, w.RetriesGranted, w.BudgetRefused, wantG, wantB)
			}
		}
	})
}

// TestRetryBudgetCacheFollowsTheWindow: the budget keeps the totals of its
// window's closed seconds and moves them forward each second. Over more than
// a window of random reports, each decision's counts must be the sum of the
// per-second counters of its window, read back from the hash, also after the
// window changes.
func TestRetryBudgetCacheFollowsTheWindow(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		rng := rand.New(rand.NewPCG(1, 2))
		compared := 0
		for _, window := range []time.Duration{2 * time.Second, 3 * time.Second} {
			p := policy(1000)
			p.Budget = retry.Budget{Ratio: 0.5, MinRetries: 3, Window: window}
			mustPublish(t, c, p)
			for end := time.Now().Add(window + 1500*time.Millisecond); time.Now().Before(end); {
				reportAtRandom(t, c, rng)
				before := redisNow(t, rdb)
				d, err := c.RetryBudget(ctx)
				if err != nil {
					t.Fatal(err)
				}
				after := redisNow(t, rdb)
				time.Sleep(time.Duration(rng.IntN(50)) * time.Millisecond)
				if before.Unix() != after.Unix() {
					continue // the decision's second is not known
				}
				w := windowFromCounters(t, rdb, c, before.Unix(), int64(window/time.Second), time.Time{})
				grant := int64(0)
				if d.Allowed {
					grant = 1
				}
				if d.Calls != w.Calls || d.Granted+grant != w.RetriesGranted {
					t.Fatalf("window %v: the budget counted %d calls and %d granted; the window holds %d calls and %d granted, this decision included (%d)",
						window, d.Calls, d.Granted, w.Calls, w.RetriesGranted, grant)
				}
				compared++
			}
		}
		if compared < 40 {
			t.Errorf("only %d decisions compared, want at least 40", compared)
		}
	})
}

// TestReadWindowCacheFollowsTheCounters: the controller's window read keeps
// the totals of its closed seconds and moves them forward each second. Over
// more than a window of random reports and budget decisions, every read must
// equal the sum of the per-second counters it covers, read back from the
// hash, for two lengths and with and without a recent transition (from).
func TestReadWindowCacheFollowsTheCounters(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(1000))
		rng := rand.New(rand.NewPCG(3, 4))
		reads, recent := 0, 0
		for _, length := range []time.Duration{2 * time.Second, 3 * time.Second} {
			for end := time.Now().Add(length + 1500*time.Millisecond); time.Now().Before(end); {
				reportAtRandom(t, c, rng)
				if rng.IntN(3) == 0 {
					if _, err := c.RetryBudget(ctx); err != nil {
						t.Fatal(err)
					}
				}
				var from time.Time
				if rng.IntN(4) == 0 {
					from = redisNow(t, rdb).Add(-time.Second) // a transition a second ago
					recent++
				}
				w, _, at, err := c.ReadWindow(ctx, length, from)
				if err != nil {
					t.Fatal(err)
				}
				want := windowFromCounters(t, rdb, c, at.Unix(), int64(length/time.Second), from)
				if w != want {
					t.Fatalf("ReadWindow(%v, from %v) at %v = %+v, the counters sum to %+v", length, from, at, w, want)
				}
				reads++
				time.Sleep(time.Duration(rng.IntN(50)) * time.Millisecond)
			}
		}
		if reads < 40 || recent == 0 {
			t.Errorf("%d reads, %d with a recent transition; want at least 40 and 1", reads, recent)
		}
	})
}

// reportAtRandom releases up to three calls admitted without a lease, each
// with a random outcome and attempt (1 to 5).
func reportAtRandom(t *testing.T, c *protocol.Client, rng *rand.Rand) {
	t.Helper()
	outcomes := []protocol.Outcome{protocol.Success, protocol.Failure, protocol.Timeout}
	for range rng.IntN(4) {
		if _, err := c.Release(ctxT(t), "", 0, outcomes[rng.IntN(3)], 1+rng.IntN(5)); err != nil {
			t.Fatal(err)
		}
	}
}

// windowFromCounters sums the per-second counters of (max(nowS - length,
// from), nowS] straight from the stats hash.
func windowFromCounters(t *testing.T, rdb redis.UniversalClient, c *protocol.Client, nowS, length int64, from time.Time) protocol.Window {
	t.Helper()
	fields, err := rdb.HGetAll(ctxT(t), c.Keys().Stats).Result()
	if err != nil {
		t.Fatal(err)
	}
	lo := nowS - length
	if !from.IsZero() {
		lo = max(lo, from.Unix())
	}
	var w protocol.Window
	for k, v := range fields {
		sec, suffix, ok := strings.Cut(k, ":")
		s, err := strconv.ParseInt(sec, 10, 64)
		if !ok || err != nil || s <= lo || s > nowS {
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		switch suffix {
		case "s":
			w.Successes += n
		case "f":
			w.Failures += n
		case "t":
			w.Timeouts += n
		case "a1", "a2", "a3", "a4":
			w.ByAttempt[suffix[1]-'1'] += n
		case "g":
			w.RetriesGranted += n
		case "b":
			w.BudgetRefused += n
		case "ds":
			w.SuccessMicros += n
		case "dn":
			w.TimedSuccesses += n
		}
	}
	w.Calls = w.Successes + w.Failures + w.Timeouts
	return w
}

// TestRetryBudgetSeed: the seed policy (ratio 0.2, minimum 10) with 100 calls
// in the window grants 20 retries and refuses the 21st, and counts both.
func TestRetryBudgetSeed(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(10))
		// Fewer than 10 calls: the minimum applies.
		for i := range 10 {
			if d, err := c.RetryBudget(ctx); err != nil || !d.Allowed || d.Granted != int64(i) {
				t.Fatalf("retry %d with no calls = %+v, %v; want allowed", i+1, d, err)
			}
		}
		if d, _ := c.RetryBudget(ctx); d.Allowed {
			t.Fatalf("11th retry with no calls allowed, want refused")
		}
		if err := rdb.Del(ctx, c.Keys().Stats).Err(); err != nil {
			t.Fatal(err)
		}
		hsetSeconds(t, rdb, c, redisNow(t, rdb).Unix(), map[int64]map[string]int64{-3: {"s": 60, "f": 40, "a1": 100}})
		for i := range 20 {
			if d, err := c.RetryBudget(ctx); err != nil || !d.Allowed || d.Calls != 100 {
				t.Fatalf("retry %d of 20 = %+v, %v; want allowed", i+1, d, err)
			}
		}
		d, err := c.RetryBudget(ctx)
		if err != nil || d.Allowed || d.Granted != 20 {
			t.Fatalf("21st retry = %+v, %v; want refused with 20 granted", d, err)
		}
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		if w.RetriesGranted != 20 || w.BudgetRefused != 1 {
			t.Errorf("window granted %d refused %d, want 20 and 1", w.RetriesGranted, w.BudgetRefused)
		}
	})
}

func TestRetryBudgetBackoffFollowsPublish(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		p := policy(10)
		mustPublish(t, c, p)
		d, err := c.RetryBudget(ctx)
		if err != nil || d.Backoff != p.Backoff {
			t.Fatalf("Backoff = %+v (%v), want %+v", d.Backoff, err, p.Backoff)
		}
		p.Backoff = retry.Backoff{Base: 250 * time.Millisecond, Max: 30 * time.Second, Jitter: retry.JitterEqual}
		mustPublish(t, c, p)
		if d, err = c.RetryBudget(ctx); err != nil || d.Backoff != p.Backoff {
			t.Errorf("after republishing: Backoff = %+v (%v), want %+v", d.Backoff, err, p.Backoff)
		}
		// A refusal carries the backoff too (the caller parks with it).
		p.Budget = retry.Budget{Ratio: 0, MinRetries: 0, Window: time.Minute}
		mustPublish(t, c, p)
		if d, err = c.RetryBudget(ctx); err != nil || d.Allowed || d.Backoff != p.Backoff {
			t.Errorf("refusal = %+v (%v), want refused with backoff %+v", d, err, p.Backoff)
		}
	})
}

// statsSeconds returns the distinct seconds of the stats hash's counter
// fields.
// TestStatsHashTable: the first report and the first budget decision make
// the stats hash a hash table, whose field lookups do not scan the hash.
func TestStatsHashTable(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		for _, first := range []string{"release", "budget"} {
			t.Run(first, func(t *testing.T) {
				c := newClient(t, rdb)
				mustPublish(t, c, policy(5))
				if first == "release" {
					mustRelease(t, c, mustAdmit(t, c, time.Second), protocol.Success, 1)
				} else if _, err := c.RetryBudget(ctxT(t)); err != nil {
					t.Fatal(err)
				}
				enc, err := rdb.ObjectEncoding(ctxT(t), c.Keys().Stats).Result()
				if err != nil {
					t.Fatal(err)
				}
				if enc != "hashtable" {
					t.Errorf("stats encoding after the first %s = %q, want hashtable", first, enc)
				}
			})
		}
	})
}

func statsSeconds(t *testing.T, rdb redis.UniversalClient, c *protocol.Client) map[int64]bool {
	t.Helper()
	keys, err := rdb.HKeys(ctxT(t), c.Keys().Stats).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]bool{}
	for _, k := range keys {
		if k == "pruned" || k == "retention" || k == "sweep" || k == "sweep_upto" || k == "seen" || k == "rolled_from" || k == "born" || k == "encoding" || strings.HasPrefix(k, "budget_") || strings.HasPrefix(k, "window_") {
			continue
		}
		s, _, ok := strings.Cut(k, ":")
		n, err := strconv.ParseInt(s, 10, 64)
		if !ok || err != nil {
			t.Fatalf("stats field %q is not <second>:<suffix>", k)
		}
		out[n] = true
	}
	return out
}

// TestStatsPruning: the controller's window read and the budget prune the
// counters of seconds older than the retention, 16 seconds per call, behind
// the cursor 'pruned'. Old fields are written directly, since the shortest
// retention is 61 s.
func TestStatsPruning(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		p := policy(1_000_000)
		p.BreakerWindow, p.Budget.Window = time.Second, time.Second // retention 61 s
		mustPublish(t, c, p)
		retention := int64(protocol.StatsRetention(p) / time.Second)
		now := redisNow(t, rdb).Unix()
		target := now - retention

		// 40 seconds of old counters behind a cursor that lags 41 s, plus
		// one recent second that must survive.
		old := map[int64]map[string]int64{}
		for s := target - 40; s < target; s++ {
			old[s-now] = map[string]int64{"s": 2, "f": 1, "t": 1, "a1": 3, "a2": 1, "a3": 0, "a4": 0, "g": 1, "b": 1}
		}
		old[-10] = map[string]int64{"s": 5}
		hsetSeconds(t, rdb, c, now, old)
		if err := rdb.HSet(ctx, c.Keys().Stats, "pruned", target-41).Err(); err != nil {
			t.Fatal(err)
		}

		// Three evaluations catch up on 41 seconds.
		for range 3 {
			mustWindow(t, c, time.Minute, time.Time{})
		}
		secs := statsSeconds(t, rdb, c)
		for s := range secs {
			if s <= target {
				t.Errorf("second %d (%d s ago) survived pruning with retention %d s", s, now-s, retention)
			}
		}
		if !secs[now-10] {
			t.Errorf("second now-10, within the retention, was pruned")
		}
		cursor, err := rdb.HGet(ctx, c.Keys().Stats, "pruned").Int64()
		if err != nil || cursor < target {
			t.Errorf("pruned cursor = %d (%v), want >= %d", cursor, err, target)
		}

		// The budget prunes too.
		older := map[int64]map[string]int64{}
		for s := target - 20; s <= target; s++ {
			older[s-now] = map[string]int64{"s": 1, "g": 1}
		}
		hsetSeconds(t, rdb, c, now, older)
		if err := rdb.HSet(ctx, c.Keys().Stats, "pruned", target-21).Err(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := c.RetryBudget(ctx); err != nil {
				t.Fatal(err)
			}
		}
		for s := range statsSeconds(t, rdb, c) {
			if s <= target {
				t.Errorf("second %d (%d s ago) survived pruning by the budget", s, now-s)
			}
		}

		// Reports and evaluations keep the hash bounded: fields only for the
		// seconds within the retention, and an expiry.
		for range 50 {
			mustRelease(t, c, mustAdmit(t, c, time.Minute), protocol.Failure, 2)
			mustWindow(t, c, time.Minute, time.Time{})
		}
		n, err := rdb.HLen(ctx, c.Keys().Stats).Result()
		if err != nil {
			t.Fatal(err)
		}
		elapsed := redisNow(t, rdb).Unix() - now
		// Nine counters a second and nine minute totals a minute, plus
		// pruned, retention, seen, rolled_from, born, encoding, and the
		// budget's and the window's cached totals (2 + 4 and 2 + 9 fields).
		const bookkeeping = 1 + 1 + 1 + 1 + 1 + 1 + 6 + 11
		if limit := 9*(elapsed+2) + 9*(elapsed/60+2) + bookkeeping; n > limit {
			t.Errorf("stats hash has %d fields after %d s, want at most %d", n, elapsed, limit)
		}
		if ttl, _ := rdb.TTL(ctx, c.Keys().Stats).Result(); ttl <= 0 || ttl > time.Hour+2*time.Minute {
			t.Errorf("stats TTL = %v, want in (0, 1h2m]", ttl)
		}
	})
}

// TestStatsPruningFarBehind: when the cursor lags more than an hour (the
// controller, which prunes at each evaluation, was down for an hour while
// workers kept reporting; or evaluations came less often than every 16 s for
// hours), the counters of the seconds the cursor jumps over must still be
// deleted, or the hash grows for as long as traffic refreshes its expiry.
func TestStatsPruningFarBehind(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		p := policy(1_000_000)
		p.BreakerWindow, p.Budget.Window = time.Second, time.Second // retention 61 s
		mustPublish(t, c, p)
		retention := int64(protocol.StatsRetention(p) / time.Second)
		now := redisNow(t, rdb).Unix()
		target := now - retention
		hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{
			target - 4000 - now: {"s": 1, "a1": 1},
			target - 100 - now:  {"s": 1, "a1": 1},
		})
		if err := rdb.HSet(ctx, c.Keys().Stats, "pruned", target-5000).Err(); err != nil {
			t.Fatal(err)
		}
		// Far more evaluations than the cursor needs to reach the target.
		for range 400 {
			mustWindow(t, c, time.Minute, time.Time{})
		}
		for s := range statsSeconds(t, rdb, c) {
			if s <= target {
				t.Errorf("second %d (%d s ago) never pruned", s, now-s)
			}
		}
	})
}

// TestReleaseTimesSuccesses: a release that says how long its call took adds
// a success's duration to the window's success latency; failures, untimed
// releases and probes' epochs do not disturb it.
func TestReleaseTimesSuccesses(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(10))
		for _, r := range []struct {
			o    protocol.Outcome
			took time.Duration
		}{
			{protocol.Success, 100 * time.Millisecond}, {protocol.Success, 200 * time.Millisecond},
			{protocol.Success, 300 * time.Millisecond}, {protocol.Failure, 5 * time.Millisecond},
			{protocol.Success, -1}, {protocol.Timeout, time.Second},
		} {
			a := mustAdmit(t, c, 10*time.Second)
			if _, err := c.ReleaseTimed(ctxT(t), a.Member, 0, r.o, 1, r.took); err != nil {
				t.Fatalf("ReleaseTimed: %v", err)
			}
		}
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		if w.Successes != 4 || w.TimedSuccesses != 3 || w.SuccessMicros != 600_000 || w.Calls != 6 {
			t.Errorf("window = %+v, want 4 successes, 3 of them timed for 600000 µs, 6 calls", w)
		}
		if got := w.MeanSuccessLatency(); got != 0 {
			t.Errorf("MeanSuccessLatency() = %v from 3 timed successes, want 0 (unknown below %d)", got, protocol.MinTimedSuccesses)
		}
		for range protocol.MinTimedSuccesses {
			a := mustAdmit(t, c, 10*time.Second)
			if _, err := c.ReleaseTimed(ctxT(t), a.Member, 0, protocol.Success, 1, 200*time.Millisecond); err != nil {
				t.Fatalf("ReleaseTimed: %v", err)
			}
		}
		w, _ = mustWindow(t, c, time.Minute, time.Time{})
		if got := w.MeanSuccessLatency(); got != 200*time.Millisecond {
			t.Errorf("MeanSuccessLatency() = %v, want 200ms", got)
		}
	})
}
