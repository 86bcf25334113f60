package protocol_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestAcquireOpen(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		p.State = wire.Open
		p.OpenUntil = redisNow(t, rdb).Add(5 * time.Second)
		mustPublish(t, c, p)
		a := mustAcquire(t, c, time.Second)
		if a.Code != protocol.RefusedOpen {
			t.Fatalf("Acquire while Open = %v, want open", a.Code)
		}
		within(t, "Wait", a.Wait, 4*time.Second, 5*time.Second)

		// Past OpenUntil the breaker is still Open until the controller says
		// otherwise: refused, with no wait.
		p.OpenUntil = redisNow(t, rdb).Add(-time.Second)
		mustPublish(t, c, p)
		if a = mustAcquire(t, c, time.Second); a.Code != protocol.RefusedOpen || a.Wait != 0 {
			t.Errorf("Acquire while Open past OpenUntil = %v wait %v, want open, 0", a.Code, a.Wait)
		}
		if n, _ := rdb.ZCount(ctxT(t), c.Keys().Leases, "(-inf", "+inf").Result(); n != 0 {
			t.Errorf("refused acquisitions left %d leases", n)
		}
	})
}

func TestAcquireLimit(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		const n = 7
		c := newClient(t, rdb)
		p := policy(n)
		p.Epoch = 3
		mustPublish(t, c, p)
		members := map[string]bool{}
		for i := range n {
			a := mustAdmit(t, c, 10*time.Second)
			if a.Epoch != 3 || a.Limit != n {
				t.Errorf("admission %d: epoch %d limit %d, want 3 and %d", i, a.Epoch, a.Limit, n)
			}
			if !strings.HasPrefix(a.Member, "lease-") {
				t.Errorf("member %q is not the lease id", a.Member)
			}
			members[a.Member] = true
		}
		if len(members) != n {
			t.Errorf("%d distinct members, want %d", len(members), n)
		}
		for range 3 {
			a := mustAcquire(t, c, 10*time.Second)
			if a.Code != protocol.RefusedThrottled || a.Held != n || a.Limit != n {
				t.Fatalf("Acquire beyond the limit = %+v, want throttled with held %d limit %d", a, n, n)
			}
			// The first lease expires ~10 s after it was taken.
			within(t, "Wait", a.Wait, 8*time.Second, 10*time.Second)
		}
		if got, _ := rdb.ZCount(ctxT(t), c.Keys().Leases, "(-inf", "+inf").Result(); got != n {
			t.Errorf("leases = %d, want %d", got, n)
		}
	})
}

func TestAcquireReclaimsExpiredLeases(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(3))
		for range 3 {
			mustAdmit(t, c, 100*time.Millisecond)
		}
		a := mustAcquire(t, c, 100*time.Millisecond)
		if a.Code != protocol.RefusedThrottled {
			t.Fatalf("fourth acquisition = %v, want throttled", a.Code)
		}
		within(t, "Wait", a.Wait, 0, 100*time.Millisecond)
		time.Sleep(150 * time.Millisecond)
		for range 3 {
			mustAdmit(t, c, 10*time.Second)
		}
		if a = mustAcquire(t, c, time.Second); a.Code != protocol.RefusedThrottled || a.Held != 3 {
			t.Errorf("after reclaiming: %+v, want throttled with 3 held", a)
		}
	})
}

func TestAcquireLimitLoweredMidRun(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		mustPublish(t, c, p)
		var held []protocol.Admission
		for range 10 {
			held = append(held, mustAdmit(t, c, 10*time.Second))
		}
		p.Limit = 5
		mustPublish(t, c, p)
		for len(held) >= 5 {
			a := mustAcquire(t, c, 10*time.Second)
			if a.Code != protocol.RefusedThrottled || a.Held != int64(len(held)) || a.Limit != 5 {
				t.Fatalf("with %d held and limit 5: %+v, want throttled", len(held), a)
			}
			if !mustRelease(t, c, held[0], protocol.Success, 1) {
				t.Fatalf("release of a held lease returned false")
			}
			held = held[1:]
		}
		// 4 held: one more fits, then the limit holds again.
		mustAdmit(t, c, 10*time.Second)
		if a := mustAcquire(t, c, 10*time.Second); a.Code != protocol.RefusedThrottled || a.Held != 5 {
			t.Errorf("at the new limit: %+v, want throttled with 5 held", a)
		}
	})
}

func TestAcquireHalfOpenAdmitsProbes(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(2)
		p.Capacity = 40
		p.State = wire.HalfOpen
		p.Epoch = 4
		mustPublish(t, c, p)
		var probes []protocol.Admission
		for range 2 {
			a := mustAdmit(t, c, 10*time.Second)
			if a.Epoch != 4 {
				t.Errorf("probe admitted at epoch %d, want 4", a.Epoch)
			}
			probes = append(probes, a)
		}
		for range 3 {
			if a := mustAcquire(t, c, 10*time.Second); a.Code != protocol.RefusedThrottled || a.Limit != 2 {
				t.Errorf("third probe = %+v, want throttled with limit 2", a)
			}
		}
		// The limit counts probes per epoch, not at a time: a probe that
		// failed fast makes no room for another before the controller
		// decides.
		for _, a := range probes {
			mustRelease(t, c, a, protocol.Failure, 1)
		}
		if a := mustAcquire(t, c, 10*time.Second); a.Code != protocol.RefusedThrottled {
			t.Errorf("probe after the epoch's probes ended = %+v, want throttled", a)
		}
		// The next HalfOpen epoch admits fresh probes.
		p.Epoch = 6
		mustPublish(t, c, p)
		mustAdmit(t, c, 10*time.Second)
	})
}

// TestAcquireRate checks GCRA against rates whose emission interval is not a
// whole number of milliseconds (3/s: 333333.3 µs, 7/s: 142857.1 µs, 333/s:
// 3003.003 µs): over a measured interval no more than burst + elapsed/interval
// calls get through, and the stored theoretical arrival time is an integer
// that advances by at least one whole interval per admitted call.
func TestAcquireRate(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		for _, rate := range []int64{3, 7, 333} {
			t.Run(strconv.FormatInt(rate, 10), func(t *testing.T) {
				t.Parallel()
				c := newClient(t, rdb)
				p := policy(1_000_000)
				p.RatePerSecond = rate
				mustPublish(t, c, p)
				burst, interval := protocol.RateBurst(rate), protocol.RateInterval(rate)
				ctx := ctxT(t)

				var admitted, refused int64
				var lastTAT int64
				start := time.Now()
				for time.Since(start) < 1100*time.Millisecond {
					a := mustAcquire(t, c, time.Minute)
					switch a.Code {
					case protocol.Admitted:
						admitted++
						s, err := rdb.Get(ctx, c.Keys().GCRA).Result()
						if err != nil {
							t.Fatal(err)
						}
						tat, err := strconv.ParseInt(s, 10, 64)
						if err != nil {
							t.Fatalf("gcra value %q is not an integer: %v", s, err)
						}
						if lastTAT != 0 && tat-lastTAT < interval {
							t.Fatalf("gcra advanced by %d µs on an admission, less than the interval %d", tat-lastTAT, interval)
						}
						lastTAT = tat
					case protocol.RefusedRate:
						refused++
						if a.Wait <= 0 || a.Wait > time.Duration((interval+999)/1000)*time.Millisecond {
							t.Fatalf("RefusedRate Wait = %v, want in (0, interval rounded up to ms]", a.Wait)
						}
					default:
						t.Fatalf("Acquire = %+v, want admitted or rate", a)
					}
				}
				elapsed := time.Since(start)
				bound := burst + elapsed.Microseconds()/interval
				t.Logf("rate %d/s: %d admitted, %d refused in %v; bound burst %d + elapsed/interval = %d",
					rate, admitted, refused, elapsed, burst, bound)
				if admitted > bound {
					t.Errorf("%d calls admitted in %v at %d/s (burst %d), more than %d", admitted, elapsed, rate, burst, bound)
				}
				if admitted < bound/2 {
					t.Errorf("only %d calls admitted in %v at %d/s, expected about %d", admitted, elapsed, rate, bound)
				}
				if refused == 0 {
					t.Errorf("no call was refused")
				}
			})
		}
	})
}

// TestAcquireRateArithmeticExact sets the theoretical arrival time to a known
// integer T a little in the future, within the burst's tolerance: the call is
// admitted and the stored time must be exactly T + interval, written as an
// integer (no float formatting, no rounding) for rates with fractional
// intervals.
func TestAcquireRateArithmeticExact(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		for _, rate := range []int64{333, 7777} {
			c := newClient(t, rdb)
			ctx := ctxT(t)
			p := policy(1_000_000)
			p.RatePerSecond = rate
			mustPublish(t, c, p)
			burst, interval := protocol.RateBurst(rate), protocol.RateInterval(rate)
			tolerance := (burst - 1) * interval // µs
			tat := redisNow(t, rdb).UnixMicro() + tolerance - 2000
			if err := rdb.Set(ctx, c.Keys().GCRA, tat, time.Minute).Err(); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			mustAdmit(t, c, time.Minute)
			if late := time.Since(start); late > time.Duration(tolerance-2000)*time.Microsecond {
				t.Skipf("the acquisition took %v, longer than the arrival time was ahead", late)
			}
			got, err := rdb.Get(ctx, c.Keys().GCRA).Result()
			if err != nil {
				t.Fatal(err)
			}
			if want := strconv.FormatInt(tat+interval, 10); got != want {
				t.Errorf("rate %d/s: gcra = %q after one admission from %d, want %s", rate, got, tat, want)
			}
		}
	})
}

func TestAcquireRateWaitIsEnough(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(100)
		p.RatePerSecond = 7 // burst 1, interval 142858 µs
		mustPublish(t, c, p)
		mustAdmit(t, c, time.Minute)
		a := mustAcquire(t, c, time.Minute)
		if a.Code != protocol.RefusedRate {
			t.Fatalf("second call = %v, want rate", a.Code)
		}
		within(t, "Wait", a.Wait, time.Millisecond, 143*time.Millisecond)
		n, _ := rdb.ZCount(ctxT(t), c.Keys().Leases, "(-inf", "+inf").Result()
		if n != 1 {
			t.Errorf("a rate refusal left %d leases, want 1", n)
		}
		time.Sleep(a.Wait)
		if a = mustAcquire(t, c, time.Minute); a.Code != protocol.Admitted {
			t.Errorf("after waiting the hinted time: %+v, want admitted", a)
		}
	})
}

// TestAcquireSlotRefusalKeepsRateToken: a call refused for want of a slot
// takes no rate token, so once a slot frees the next call runs at once.
func TestAcquireSlotRefusalKeepsRateToken(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		p := policy(1)
		p.RatePerSecond = 10 // burst 1, interval 100 ms
		mustPublish(t, c, p)
		first := mustAdmit(t, c, time.Minute)
		time.Sleep(150 * time.Millisecond) // the rate token is back
		before, _ := rdb.Get(ctx, c.Keys().GCRA).Result()
		for range 20 {
			if a := mustAcquire(t, c, time.Minute); a.Code != protocol.RefusedThrottled {
				t.Fatalf("with the slot held: %+v, want throttled", a)
			}
		}
		if after, _ := rdb.Get(ctx, c.Keys().GCRA).Result(); after != before {
			t.Errorf("slot refusals moved the gcra from %q to %q", before, after)
		}
		mustRelease(t, c, first, protocol.Success, 1)
		if a := mustAcquire(t, c, time.Minute); a.Code != protocol.Admitted {
			t.Errorf("after the slot freed: %+v, want admitted at once", a)
		}
	})
}

func TestAcquireArgsValidation(t *testing.T) {
	t.Parallel()
	c, err := protocol.NewClient(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), protocol.Dependency{Namespace: "a", Name: "b"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	for _, a := range []protocol.AcquireArgs{
		{TTL: time.Second},
		{LeaseID: "x", TTL: time.Microsecond},
		{LeaseID: "x", TTL: time.Second, JobKey: "j", JobVersion: -1, JobTTL: time.Second},
		{LeaseID: "x", TTL: time.Second, JobKey: "j", JobVersion: protocol.MaxJobVersion + 1, JobTTL: time.Second},
		{LeaseID: "x", TTL: time.Second, JobKey: "j", JobVersion: 1},
	} {
		if _, err := c.Acquire(ctx, a); err == nil {
			t.Errorf("Acquire(%+v) succeeded, want a validation error", a)
		}
	}
	if _, err := protocol.NewClient(nil, protocol.Dependency{Namespace: "a", Name: "b"}); err == nil {
		t.Error("NewClient(nil) succeeded")
	}
	if _, err := protocol.NewClient(redis.NewClient(&redis.Options{}), protocol.Dependency{Namespace: "A", Name: "b"}); err == nil {
		t.Error("NewClient with an invalid namespace succeeded")
	}
}

func TestRenew(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(5))

		a := mustAdmit(t, c, 300*time.Millisecond)
		ok, err := c.Renew(ctx, a.Member, 10*time.Second)
		if err != nil || !ok {
			t.Fatalf("Renew of a held lease = %v, %v; want true", ok, err)
		}
		score, err := rdb.ZScore(ctx, c.Keys().Leases, a.Member).Result()
		if err != nil {
			t.Fatal(err)
		}
		within(t, "expiry after renew", time.UnixMilli(int64(score)).Sub(redisNow(t, rdb)), 9*time.Second, 10*time.Second)
		time.Sleep(400 * time.Millisecond) // past the original TTL
		if ok, err := c.Renew(ctx, a.Member, 10*time.Second); err != nil || !ok {
			t.Errorf("Renew after the original TTL but within the renewed one = %v, %v; want true", ok, err)
		}

		b := mustAdmit(t, c, 50*time.Millisecond)
		time.Sleep(100 * time.Millisecond)
		ok, err = c.Renew(ctx, b.Member, 10*time.Second)
		if err != nil || ok {
			t.Fatalf("Renew of an expired lease = %v, %v; want false", ok, err)
		}
		if err := rdb.ZScore(ctx, c.Keys().Leases, b.Member).Err(); !errors.Is(err, redis.Nil) {
			t.Errorf("ZSCORE of the expired lease after renew: err = %v, want redis.Nil (not re-added)", err)
		}
		if ok, err := c.Renew(ctx, "1:never-held", 10*time.Second); err != nil || ok {
			t.Errorf("Renew of a lease never held = %v, %v; want false", ok, err)
		}
		if err := rdb.ZScore(ctx, c.Keys().Leases, "1:never-held").Err(); !errors.Is(err, redis.Nil) {
			t.Errorf("Renew added a lease never held: err = %v", err)
		}
	})
}

func TestReleaseHeld(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(5))
		a := mustAdmit(t, c, 10*time.Second)
		if !mustRelease(t, c, a, protocol.Success, 1) {
			t.Error("release of a held lease = false, want true")
		}
		if mustRelease(t, c, a, protocol.Success, 1) {
			t.Error("second release of the same lease = true, want false")
		}
		// A call admitted without a lease.
		if mustRelease(t, c, protocol.Admission{}, protocol.Success, 1) {
			t.Error("release without a member = true, want false")
		}

		// Expired, and swept by the controller's window meanwhile.
		b := mustAdmit(t, c, 50*time.Millisecond)
		time.Sleep(100 * time.Millisecond)
		mustWindow(t, c, time.Minute, time.Time{})
		if mustRelease(t, c, b, protocol.Success, 1) {
			t.Error("release of an expired, swept lease = true, want false")
		}
		// Only the releases that removed their lease report, and the one
		// without a lease (docs/protocol.md §4a): the second release of a
		// and the release of the swept b count nothing.
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		if w.Calls != 2 {
			t.Errorf("calls = %d, want 2: a release of a lease no longer there reports nothing", w.Calls)
		}
	})
}

// TestExpiredLeases: an expired lease stops counting at once, before anything
// sweeps it; a refused acquisition and the controller's window sweep it, and
// its release then says it was gone.
func TestExpiredLeases(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(1))
		leases := func() int64 {
			t.Helper()
			n, err := rdb.ZCount(ctxT(t), c.Keys().Leases, "(-inf", "+inf").Result()
			if err != nil {
				t.Fatal(err)
			}
			return n
		}

		dead := mustAdmit(t, c, 50*time.Millisecond)
		time.Sleep(100 * time.Millisecond)
		live := mustAdmit(t, c, 10*time.Second) // the expired lease does not count
		if n := leases(); n != 2 {
			t.Fatalf("leases after an admission = %d, want 2 (admission does not sweep)", n)
		}
		if a := mustAcquire(t, c, time.Second); a.Code != protocol.RefusedThrottled || a.Held != 1 {
			t.Fatalf("third acquisition = %+v, want throttled with 1 held", a)
		}
		if n := leases(); n != 1 {
			t.Fatalf("leases after a refusal = %d, want 1 (the refusal sweeps)", n)
		}
		if mustRelease(t, c, dead, protocol.Success, 1) {
			t.Error("release of a swept lease = true, want false")
		}
		if !mustRelease(t, c, live, protocol.Success, 1) {
			t.Error("release of a live lease = false, want true")
		}

		dead = mustAdmit(t, c, 50*time.Millisecond)
		time.Sleep(100 * time.Millisecond)
		mustWindow(t, c, time.Minute, time.Time{})
		if n := leases(); n != 0 {
			t.Errorf("leases after window = %d, want 0 (window sweeps)", n)
		}
		// The sweeps spare the member that keeps the set a skiplist.
		if enc, err := rdb.ObjectEncoding(ctxT(t), c.Keys().Leases).Result(); err != nil || enc != "skiplist" {
			t.Errorf("leases encoding after the sweeps = %q, %v; want skiplist", enc, err)
		}
	})
}

// TestLeasesSkiplist: the first admission makes the lease set a skiplist,
// whose lookups do not scan it; the member that does so never counts as a
// lease and never delays a throttled caller's hint.
func TestLeasesSkiplist(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(2))
		a := mustAdmit(t, c, 10*time.Second)
		if enc, err := rdb.ObjectEncoding(ctxT(t), c.Keys().Leases).Result(); err != nil || enc != "skiplist" {
			t.Fatalf("leases encoding after one admission = %q, %v; want skiplist", enc, err)
		}
		mustAdmit(t, c, 10*time.Second)
		r := mustAcquire(t, c, time.Second)
		if r.Code != protocol.RefusedThrottled || r.Held != 2 {
			t.Fatalf("third acquisition = %+v, want throttled with 2 held", r)
		}
		within(t, "Wait", r.Wait, 8*time.Second, 10*time.Second)
		mustRelease(t, c, a, protocol.Success, 1)
		mustAdmit(t, c, 10*time.Second)
	})
}

func TestSupersede(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(100))
		job := func(key string, v int64) protocol.Admission {
			t.Helper()
			a, err := c.Acquire(ctx, protocol.AcquireArgs{
				LeaseID: leaseID(), TTL: 10 * time.Second,
				JobKey: key, JobVersion: v, JobTTL: time.Minute,
			})
			if err != nil {
				t.Fatalf("Acquire job %s v%d: %v", key, v, err)
			}
			return a
		}
		sup := func(key string, v int64) int64 {
			t.Helper()
			n, err := c.Supersede(ctx, key, v, time.Minute)
			if err != nil {
				t.Fatalf("Supersede(%s, %d): %v", key, v, err)
			}
			return n
		}

		if got := sup("order-1", 5); got != 5 {
			t.Errorf("Supersede(5) = %d, want 5", got)
		}
		if got := sup("order-1", 3); got != 5 {
			t.Errorf("Supersede(3) after 5 = %d, want 5 (the max)", got)
		}
		if a := job("order-1", 4); a.Code != protocol.RefusedSuperseded || a.Newest != 5 {
			t.Errorf("older version = %+v, want superseded with newest 5", a)
		}
		for range 2 { // equal versions both run
			if a := job("order-1", 5); a.Code != protocol.Admitted {
				t.Errorf("newest version = %+v, want admitted", a)
			}
		}
		if a := job("order-1", 6); a.Code != protocol.Admitted {
			t.Errorf("newer version = %+v, want admitted", a)
		}
		// The admitted newer version is recorded.
		if got := sup("order-1", 5); got != 6 {
			t.Errorf("Supersede(5) after v6 ran = %d, want 6", got)
		}
		if a := job("order-1", 5); a.Code != protocol.RefusedSuperseded || a.Newest != 6 {
			t.Errorf("v5 after v6 = %+v, want superseded by 6", a)
		}
		// Other job keys are independent; the largest exact version works.
		if a := job("order-2", 0); a.Code != protocol.Admitted {
			t.Errorf("another job = %+v, want admitted", a)
		}
		if got := sup("order-3", protocol.MaxJobVersion); got != protocol.MaxJobVersion {
			t.Errorf("Supersede(MaxJobVersion) = %d", got)
		}
		if a := job("order-3", protocol.MaxJobVersion-1); a.Code != protocol.RefusedSuperseded || a.Newest != protocol.MaxJobVersion {
			t.Errorf("MaxJobVersion-1 = %+v, want superseded by %d", a, int64(protocol.MaxJobVersion))
		}
		ttl, err := rdb.PTTL(ctx, c.Keys().Job("order-1")).Result()
		if err != nil || ttl <= 0 || ttl > time.Minute {
			t.Errorf("job key PTTL = %v, %v; want in (0, 1m]", ttl, err)
		}
		if _, err := c.Supersede(ctx, "", 1, time.Minute); err == nil {
			t.Error("Supersede with an empty key succeeded")
		}
	})
}
