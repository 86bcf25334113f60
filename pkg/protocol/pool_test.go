package protocol_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

var requestSeq atomic.Int64

// testPool is one process's pool as a test drives it: its id and the
// members it holds.
type testPool struct {
	c    *protocol.Client
	id   string
	held []string
}

func newPool(c *protocol.Client, id string) *testPool {
	return &testPool{c: c, id: id}
}

// refresh sends one pool call with a new request id: it holds what the pool
// holds, returns ret, wants want; the granted members join held, the lost
// and returned ones leave it.
func (p *testPool) refresh(t testing.TB, want int64, ret []string, mod ...func(*protocol.PoolArgs)) protocol.PoolReply {
	t.Helper()
	settle(p.c)
	a := protocol.PoolArgs{
		PoolID:    p.id,
		RequestID: fmt.Sprint(requestSeq.Add(1)),
		TTL:       10 * time.Second,
		Held:      without(p.held, ret),
		Return:    ret,
		Want:      want,
	}
	for _, m := range mod {
		m(&a)
	}
	r, err := p.c.Pool(ctxT(t), a)
	lastRefresh.Store(p.c.Dependency(), time.Now()) // after the script ran
	if err != nil {
		t.Fatalf("Pool(%s): %v", p.id, err)
	}
	p.held = append(without(a.Held, r.Lost), r.Granted...)
	return r
}

// lastRefresh is when each dependency's pools last refreshed.
var lastRefresh sync.Map // protocol.Dependency -> time.Time

// settle waits until protocol.SplitEvery has passed since the dependency's
// last refresh, and so since the fair split was last computed: the refresh
// then sees every change made before it, as the tests' exact shares need.
func settle(c *protocol.Client) {
	if at, ok := lastRefresh.Load(c.Dependency()); ok {
		time.Sleep(time.Until(at.(time.Time).Add(protocol.SplitEvery + time.Millisecond)))
	}
}

// giveBack returns n of the pool's members (the last ones) in a refresh.
func (p *testPool) giveBack(t testing.TB, n int64, want int64) protocol.PoolReply {
	t.Helper()
	n = min(n, int64(len(p.held)))
	return p.refresh(t, want, append([]string(nil), p.held[int64(len(p.held))-n:]...))
}

func without(from, drop []string) []string {
	gone := map[string]bool{}
	for _, m := range drop {
		gone[m] = true
	}
	var out []string
	for _, m := range from {
		if !gone[m] {
			out = append(out, m)
		}
	}
	return out
}

func TestPoolGrantsUpToTheLimit(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		p.Epoch = 4
		mustPublish(t, c, p)
		a := newPool(c, "a")
		r := a.refresh(t, 6, nil)
		if len(r.Granted) != 6 || r.Epoch != 4 || r.State != wire.Closed || r.Limit != 10 || r.Excess != 0 || r.Stale {
			t.Fatalf("first refresh = %+v, want 6 granted, epoch 4, Closed, limit 10", r)
		}
		for _, m := range r.Granted {
			if !strings.HasPrefix(m, "a:") {
				t.Errorf("member %q is not named after the pool", m)
			}
		}
		if n := liveLeases(t, rdb, c); n != 6 {
			t.Errorf("live leases = %d, want 6", n)
		}
		// Per-call acquisitions count the pool's members and vice versa.
		mustAdmit(t, c, 10*time.Second)
		r = a.refresh(t, 20, nil)
		if len(r.Granted) != 3 || len(a.held) != 9 {
			t.Fatalf("refresh wanting 20 = %d granted (%d held), want 3 (9): the limit less the per-call lease", len(r.Granted), len(a.held))
		}
		if got := mustAcquire(t, c, time.Second); got.Code != protocol.RefusedThrottled {
			t.Errorf("per-call acquire with the pool holding the rest = %v, want throttled", got.Code)
		}
		// Returned members stop counting at once.
		r = a.giveBack(t, 4, 5)
		if n := liveLeases(t, rdb, c); n != 6 {
			t.Errorf("live leases after returning 4 = %d, want 6", n)
		}
		if len(r.Granted) != 0 || len(a.held) != 5 {
			t.Errorf("after returning 4 wanting 5: %d granted, %d held, want 0 and 5", len(r.Granted), len(a.held))
		}
	})
}

// TestPoolFairShare: one pool holds every slot; two more start waiting. The
// holder is told to give back the slots above its share, and after that
// each waiting pool has at least floor(limit / waiting pools), and the
// shares add up to the limit. Every pool refreshes once a round, returning
// the excess it is told of (all its slots are idle here).
func TestPoolFairShare(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(10))
		a, b, d := newPool(c, "a"), newPool(c, "b"), newPool(c, "d")
		if r := a.refresh(t, 100, nil); len(r.Granted) != 10 {
			t.Fatalf("a alone wanting 100 got %d, want all 10: nobody else waits", len(r.Granted))
		}
		excess := map[*testPool]int64{}
		for round := range 3 {
			for _, p := range []*testPool{b, d, a} {
				r := p.giveBack(t, excess[p], 100)
				excess[p] = r.Excess
				if live := liveLeases(t, rdb, c); live > 10 {
					t.Fatalf("round %d: %d live leases, more than the limit", round, live)
				}
			}
		}
		total := 0
		for _, p := range []*testPool{a, b, d} {
			if len(p.held) < 10/3 {
				t.Errorf("pool %s holds %d after three rounds, want at least %d", p.id, len(p.held), 10/3)
			}
			total += len(p.held)
		}
		if total != 10 {
			t.Errorf("the pools hold %d in all, want the whole limit 10", total)
		}
	})
}

// TestPoolMaxMinShare: a small want is met in full and the rest is split
// evenly between the bigger ones, the remainder going one slot each to the
// first of them by id.
func TestPoolMaxMinShare(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(20))
		small, x, y, z := newPool(c, "s"), newPool(c, "x"), newPool(c, "y"), newPool(c, "z")
		small.refresh(t, 2, nil)
		x.refresh(t, 50, nil)
		y.refresh(t, 50, nil)
		z.refresh(t, 50, nil)
		// 18 left for three: 6 each.
		for _, tc := range []struct {
			p    *testPool
			want int64
		}{{small, 2}, {x, 6}, {y, 6}, {z, 6}} {
			if r := tc.p.refresh(t, map[bool]int64{true: 2, false: 50}[tc.p == small], nil); r.Share != tc.want {
				t.Errorf("pool %s share = %d, want %d", tc.p.id, r.Share, tc.want)
			}
		}
		// 19 slots: 17 left for three, 6 for x and y, 5 for z.
		p := policy(19)
		p.Epoch = 2
		mustPublish(t, c, p)
		for _, tc := range []struct {
			p    *testPool
			want int64
		}{{x, 6}, {y, 6}, {z, 5}} {
			if r := tc.p.refresh(t, 50, nil); r.Share != tc.want {
				t.Errorf("limit 19: pool %s share = %d, want %d", tc.p.id, r.Share, tc.want)
			}
		}
	})
}

// TestPoolPerCallDemandCounts: a pool holds every slot; a per-call acquire is
// refused for want of one and records per-call demand, so the pool's next
// refresh counts per-call workers as a contender and tells it to give back
// the slots above its share; per-call acquisitions then get them.
func TestPoolPerCallDemandCounts(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(10))
		a := newPool(c, "a")
		if r := a.refresh(t, 100, nil); len(r.Granted) != 10 || r.Excess != 0 {
			t.Fatalf("pool alone = %+v, want all 10 and no excess", r)
		}
		if got := mustAcquire(t, c, time.Second); got.Code != protocol.RefusedThrottled {
			t.Fatalf("per-call acquire = %v, want throttled", got.Code)
		}
		r := a.refresh(t, 100, nil)
		if r.Share != 5 || r.Excess != 5 || len(r.Granted) != 0 {
			t.Fatalf("refresh after a per-call refusal = share %d excess %d granted %d, want 5, 5, 0", r.Share, r.Excess, len(r.Granted))
		}
		a.giveBack(t, r.Excess, 100)
		for range 5 {
			mustAdmit(t, c, 10*time.Second)
		}
		if got := mustAcquire(t, c, time.Second); got.Code != protocol.RefusedThrottled {
			t.Errorf("sixth per-call acquire = %v, want throttled: the pool keeps its share", got.Code)
		}
		// Once per-call demand is over a second old it no longer counts.
		time.Sleep(1100 * time.Millisecond)
		if r = a.refresh(t, 100, nil); r.Excess != 0 || r.Share != 10 {
			t.Errorf("refresh with per-call demand gone = share %d excess %d, want 10 and 0", r.Share, r.Excess)
		}
	})
}

// TestPoolPerCallCallersCountOneEach: per-call callers that name themselves
// count one contender each. A second caller refused right after the first
// changes the split at the pool's next refresh (the cached split counted
// one), an anonymous caller adds one more, and a second later, with no
// refusal since, none counts.
func TestPoolPerCallCallersCountOneEach(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(12))
		a := newPool(c, "a")
		if r := a.refresh(t, 100, nil); len(r.Granted) != 12 {
			t.Fatalf("pool alone = %+v, want all 12", r)
		}
		refuse := func(caller string) {
			t.Helper()
			got, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Second, CallerID: caller})
			if err != nil {
				t.Fatalf("Acquire: %v", err)
			}
			if got.Code != protocol.RefusedThrottled {
				t.Fatalf("per-call acquire by %q = %v, want throttled", caller, got.Code)
			}
		}
		for _, step := range []struct {
			caller string
			share  int64
		}{{"x", 6}, {"x", 6}, {"y", 4}, {"", 3}} {
			refuse(step.caller)
			if r := a.refresh(t, 100, nil); r.Share != step.share || r.Excess != 12-step.share {
				t.Fatalf("refresh after a refusal of %q = share %d excess %d, want %d and %d",
					step.caller, r.Share, r.Excess, step.share, 12-step.share)
			}
		}
		time.Sleep(1100 * time.Millisecond)
		if r := a.refresh(t, 100, nil); r.Share != 12 || r.Excess != 0 {
			t.Errorf("refresh with per-call demand gone = share %d excess %d, want 12 and 0", r.Share, r.Excess)
		}
	})
}

// TestPoolResendAnswersTheFirstRun: the same request sent twice (its reply
// was lost) is answered with the first run's members and counts its report
// once; the pool's next request takes the normal path.
func TestPoolResendAnswersTheFirstRun(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(10))
		var rep protocol.Report
		rep.Add(protocol.Success, 1, 3*time.Millisecond)
		rep.Add(protocol.Failure, 2, -1)
		a := protocol.PoolArgs{PoolID: "a", RequestID: "r1", TTL: 10 * time.Second, Want: 4, Report: rep}
		first, err := c.Pool(ctxT(t), a)
		if err != nil {
			t.Fatal(err)
		}
		again, err := c.Pool(ctxT(t), a)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(first) != fmt.Sprint(again) {
			t.Errorf("resend = %+v, want the first run's %+v", again, first)
		}
		if n := liveLeases(t, rdb, c); n != 4 {
			t.Errorf("live leases after a resend = %d, want 4", n)
		}
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		if w.Calls != 2 || w.Successes != 1 || w.Failures != 1 {
			t.Errorf("window after a resent report = %+v, want it counted once", w)
		}
		a.RequestID, a.Report, a.Held, a.Want = "r2", protocol.Report{}, first.Granted, 6
		next, err := c.Pool(ctxT(t), a)
		if err != nil {
			t.Fatal(err)
		}
		if len(next.Granted) != 2 || len(without(next.Granted, first.Granted)) != 2 {
			t.Errorf("next request granted %v, want 2 new members", next.Granted)
		}
	})
}

// TestPoolReturnedAndLostMembers: returned members are written expired, not
// removed, and a pool that names one as held is told it is lost; so is a
// member past its TTL. Members of another pool are neither renewed nor
// returned.
func TestPoolReturnedAndLostMembers(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(10))
		a, b := newPool(c, "a"), newPool(c, "b")
		a.refresh(t, 3, nil)
		b.refresh(t, 2, nil)
		gone := a.held[0]
		a.refresh(t, 2, []string{gone})
		if s, err := rdb.ZScore(ctx, c.Keys().Leases, gone).Result(); err != nil || s != 0 {
			t.Errorf("returned member score = %v (%v), want 0: written expired", s, err)
		}
		r, err := c.Pool(ctx, protocol.PoolArgs{PoolID: "a", RequestID: "x1", TTL: 10 * time.Second,
			Held: []string{gone, a.held[0], b.held[0]}, Return: []string{b.held[1]}})
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(r.Lost) != fmt.Sprint([]string{gone, b.held[0]}) {
			t.Errorf("lost = %v, want the returned member and the other pool's", r.Lost)
		}
		if n := liveLeases(t, rdb, c); n != 4 {
			t.Errorf("live leases = %d, want 4: b's members untouched by a", n)
		}
		// A member past its TTL is lost, and not renewed.
		short, err := c.Pool(ctx, protocol.PoolArgs{PoolID: "e", RequestID: "e1", TTL: 50 * time.Millisecond, Want: 1})
		if err != nil || len(short.Granted) != 1 {
			t.Fatalf("short pool: %+v, %v", short, err)
		}
		time.Sleep(80 * time.Millisecond)
		r, err = c.Pool(ctx, protocol.PoolArgs{PoolID: "e", RequestID: "e2", TTL: 10 * time.Second, Held: short.Granted})
		if err != nil || len(r.Lost) != 1 {
			t.Errorf("refresh after the ttl = %+v, %v, want the member lost", r, err)
		}
		if n := liveLeases(t, rdb, c); n != 4 {
			t.Errorf("live leases = %d, want 4: an expired member is not renewed", n)
		}
	})
}

// TestPoolGrantsNothingUnlessClosedOrRamping: Open and HalfOpen grant no
// slot and tell the pool to give back every slot (held ones are still
// renewed: their calls run on); the dead-man rule's stale Open is flagged
// and grants none either. Ramping grants up to its limit.
func TestPoolGrantsNothingUnlessClosedOrRamping(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		mustPublish(t, c, p)
		a := newPool(c, "a")
		a.refresh(t, 4, nil)
		for i, s := range []wire.State{wire.Open, wire.HalfOpen} {
			p.State, p.Epoch, p.Limit = s, int64(2+i), 1
			p.OpenUntil = redisNow(t, rdb).Add(time.Minute)
			mustPublish(t, c, p)
			r := a.refresh(t, 10, nil)
			if len(r.Granted) != 0 || r.Excess != 4 || r.Share != 0 || r.State != s || r.Batching() || r.Stale {
				t.Errorf("%s: %+v, want nothing granted and all 4 in excess", s, r)
			}
			if len(r.Lost) != 0 || liveLeases(t, rdb, c) != 4 {
				t.Errorf("%s: held members were not renewed (lost %v)", s, r.Lost)
			}
			if s == wire.Open && r.OpenUntil.IsZero() {
				t.Errorf("Open reply has no OpenUntil")
			}
		}
		if err := rdb.HSet(ctxT(t), c.Keys().State, "stale_after_ms", 1000,
			"updated_at_ms", redisNow(t, rdb).Add(-time.Minute).UnixMilli()).Err(); err != nil {
			t.Fatal(err)
		}
		if r := a.refresh(t, 10, nil); !r.Stale || len(r.Granted) != 0 || r.Excess != 4 {
			t.Errorf("stale HalfOpen: %+v, want flagged stale, nothing granted", r)
		}
		p.State, p.Epoch, p.Limit = wire.Ramping, 5, 6
		mustPublish(t, c, p)
		if r := a.refresh(t, 10, nil); len(r.Granted) != 2 || !r.Batching() {
			t.Errorf("Ramping at 6 with 4 held: %+v, want 2 granted", r)
		}
	})
}

// TestPoolLoweredLimitShrinks: alone, a pool keeps idle slots, but a lowered
// limit makes the slots above it excess.
func TestPoolLoweredLimitShrinks(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		mustPublish(t, c, p)
		a := newPool(c, "a")
		a.refresh(t, 10, nil)
		if r := a.refresh(t, 2, nil); r.Excess != 0 {
			t.Errorf("alone, wanting 2 of 10 held: excess %d, want 0", r.Excess)
		}
		p.Limit, p.Epoch = 3, 2
		mustPublish(t, c, p)
		if r := a.refresh(t, 2, nil); r.Excess != 7 || len(r.Granted) != 0 {
			t.Errorf("limit lowered to 3 with 10 held: %+v, want excess 7", r)
		}
	})
}

// TestPoolRenewsHeldMembersAtHalfTheirTTL: a refresh leaves a held member's
// expiry alone while more than half its ttl is left, and moves it to now +
// ttl once less is: a member refreshed every tenth of its ttl never lapses,
// and never lives more than a ttl past the last refresh.
func TestPoolRenewsHeldMembersAtHalfTheirTTL(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(10))
		const ttl = 400 * time.Millisecond
		a := newPool(c, "a")
		a.refresh(t, 1, nil, func(p *protocol.PoolArgs) { p.TTL = ttl })
		m := a.held[0]
		first, _ := rdb.ZScore(ctx, c.Keys().Leases, m).Result()
		a.refresh(t, 1, nil, func(p *protocol.PoolArgs) { p.TTL = ttl })
		if s, _ := rdb.ZScore(ctx, c.Keys().Leases, m).Result(); s != first {
			t.Errorf("expiry moved from %v to %v with most of the ttl left", first, s)
		}
		for range 10 {
			time.Sleep(ttl / 10)
			if r := a.refresh(t, 1, nil, func(p *protocol.PoolArgs) { p.TTL = ttl }); len(r.Lost) != 0 {
				t.Fatalf("member lost while refreshed every tenth of its ttl")
			}
			s, _ := rdb.ZScore(ctx, c.Keys().Leases, m).Result()
			now := redisNow(t, rdb)
			if left := time.UnixMilli(int64(s)).Sub(now); left > ttl || left < ttl/2-ttl/10 {
				t.Errorf("%v left of the ttl %v after a refresh, want between half and all of it", left, ttl)
			}
		}
		if s, _ := rdb.ZScore(ctx, c.Keys().Leases, m).Result(); s == first {
			t.Errorf("expiry never renewed over a ttl of refreshes")
		}
	})
}

// TestPoolLateRequestTakesNothing: a pool request that reaches the script
// after its deadline (here: queued in the socket of a paused Redis while its
// caller gave up) grants nothing, renews nothing and counts no report; a
// resend of a request that ran is answered as it ran, deadline or not.
func TestPoolLateRequestTakesNothing(t *testing.T) {
	t.Parallel()
	srv, err := redistest.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	rdb := srv.Client(func(o *redis.Options) { o.MaxRetries, o.ContextTimeoutEnabled = -1, true })
	c := newClient(t, rdb)
	mustPublish(t, c, policy(10))
	var rep protocol.Report
	rep.Add(protocol.Success, 1, -1)
	first, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "a", RequestID: "1", TTL: time.Minute, Want: 2})
	if err != nil {
		t.Fatal(err)
	}

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err = c.Pool(ctx, protocol.PoolArgs{PoolID: "a", RequestID: "2", TTL: time.Minute, Want: 8,
		Held: first.Granted, Report: rep, Deadline: first.Now.Add(50 * time.Millisecond)})
	cancel()
	if err == nil {
		t.Fatal("a refresh against a paused Redis succeeded")
	}
	time.Sleep(100 * time.Millisecond)
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	// The queued request has run by the time this one is answered.
	if _, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "a", RequestID: "3", TTL: time.Minute,
		Deadline: redisNow(t, rdb).Add(-time.Millisecond)}); !errors.Is(err, protocol.ErrLate) {
		t.Errorf("a request past its deadline = %v, want ErrLate", err)
	}
	if n := liveLeases(t, rdb, c); n != 2 {
		t.Errorf("live leases = %d, want the first request's 2: the late ones granted nothing", n)
	}
	if w, _ := mustWindow(t, c, time.Minute, time.Time{}); w.Calls != 0 {
		t.Errorf("the late request's report was counted: %+v", w)
	}
	again, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "a", RequestID: "1", TTL: time.Minute, Want: 2,
		Deadline: redisNow(t, rdb).Add(-time.Second)})
	if err != nil || fmt.Sprint(again.Granted) != fmt.Sprint(first.Granted) {
		t.Errorf("late resend of a request that ran = %+v, %v; want the first run's members %v", again, err, first.Granted)
	}
}

// TestPoolWaitingProcessesGetTheirShareWithin1s: one process's pool holds
// the whole limit; three more start waiting for more than the limit. Each
// refreshes every 20 ms in its own goroutine and gives back the excess it is
// told of (its slots are idle). Within 1 s each waiting process holds at
// least floor(limit / 4), and the fleet never holds more than the limit.
func TestPoolWaitingProcessesGetTheirShareWithin1s(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		const limit = 21
		c := newClient(t, rdb)
		mustPublish(t, c, policy(limit))
		pools := []*testPool{newPool(c, "holder"), newPool(c, "w1"), newPool(c, "w2"), newPool(c, "w3")}
		if r := pools[0].refresh(t, 100, nil); len(r.Granted) != limit {
			t.Fatalf("holder got %d, want all %d", len(r.Granted), limit)
		}
		start := time.Now()
		got := make([]time.Duration, len(pools))
		var wg sync.WaitGroup
		for i, p := range pools {
			wg.Go(func() {
				var excess int64
				for time.Since(start) < 1100*time.Millisecond {
					r := p.giveBack(t, excess, 100)
					excess = r.Excess
					if got[i] == 0 && len(p.held) >= limit/len(pools) {
						got[i] = time.Since(start)
					}
					time.Sleep(20 * time.Millisecond)
				}
			})
		}
		for time.Since(start) < 1100*time.Millisecond {
			if n := liveLeases(t, rdb, c); n > limit {
				t.Errorf("%d live leases, more than the limit %d", n, limit)
			}
			time.Sleep(10 * time.Millisecond)
		}
		wg.Wait()
		for i, p := range pools[1:] {
			if d := got[i+1]; d == 0 || d > time.Second {
				t.Errorf("pool %s reached floor(%d/%d) = %d slots after %v, want within 1 s (holds %d)",
					p.id, limit, len(pools), limit/len(pools), d, len(p.held))
			} else {
				t.Logf("pool %s had its share after %v", p.id, d)
			}
		}
	})
}

// TestPoolAndPerCallCapIsExact: batching pools (random wants, random
// returns) and per-call workers share one limit concurrently. Each side
// counts a slot as held from the moment Redis granted it until before it
// asks Redis to free it, an upper bound on what the dependency sees in
// flight; it never exceeds the limit, and both sides got slots.
func TestPoolAndPerCallCapIsExact(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		const limit = 12
		c := newClient(t, rdb)
		mustPublish(t, c, policy(limit))
		ctx, cancel := context.WithTimeout(ctxT(t), 800*time.Millisecond)
		defer cancel()
		var inFlight, most, pooled, perCall atomic.Int64
		hold := func(n int64) {
			v := inFlight.Add(n)
			for m := most.Load(); v > m && !most.CompareAndSwap(m, v); m = most.Load() {
			}
		}
		var wg sync.WaitGroup
		for i := range 3 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(i), 9))
				var held []string
				for k := 0; ctx.Err() == nil; k++ {
					ret := held[:rng.IntN(len(held)+1)]
					hold(-int64(len(ret)))
					r, err := c.Pool(ctx, protocol.PoolArgs{PoolID: fmt.Sprint("p", i), RequestID: fmt.Sprint(k),
						TTL: 10 * time.Second, Held: held[len(ret):], Return: ret, Want: rng.Int64N(limit + 1)})
					if err != nil {
						return
					}
					held = append(without(held[len(ret):], r.Lost), r.Granted...)
					hold(int64(len(r.Granted)))
					pooled.Add(int64(len(r.Granted)))
				}
			})
		}
		for range 6 {
			wg.Go(func() {
				for ctx.Err() == nil {
					a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: protocol.NewLeaseID(), TTL: 10 * time.Second})
					if err != nil {
						return
					}
					if a.Code != protocol.Admitted {
						time.Sleep(time.Millisecond)
						continue
					}
					hold(1)
					perCall.Add(1)
					time.Sleep(time.Millisecond)
					hold(-1)
					if _, err := c.Release(context.Background(), a.Member, 0, protocol.Success, 1); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		t.Logf("most in flight %d of %d; %d pooled grants, %d per-call admissions", most.Load(), limit, pooled.Load(), perCall.Load())
		if most.Load() > limit {
			t.Errorf("%d slots held at once, more than the limit %d", most.Load(), limit)
		}
		if pooled.Load() == 0 || perCall.Load() == 0 {
			t.Errorf("%d pooled grants and %d per-call admissions: want both", pooled.Load(), perCall.Load())
		}
	})
}
