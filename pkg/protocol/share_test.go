package protocol_test

import (
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

func TestFairShares(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		limit int64
		wants map[string]int64
		want  map[string]int64
	}{
		{10, map[string]int64{"a": 10, "b": 10, "c": 10}, map[string]int64{"a": 4, "b": 3, "c": 3}},
		{20, map[string]int64{"s": 2, "x": 50, "y": 50, "z": 50}, map[string]int64{"s": 2, "x": 6, "y": 6, "z": 6}},
		{19, map[string]int64{"s": 2, "x": 50, "y": 50, "z": 50}, map[string]int64{"s": 2, "x": 6, "y": 6, "z": 5}},
		{10, map[string]int64{"a": 3, "b": 3}, map[string]int64{"a": 3, "b": 3}},
		{10, map[string]int64{"a": 0, "b": 12}, map[string]int64{"b": 10}},
		{5, map[string]int64{"pool": 9, protocol.PerCallContender: 5}, map[string]int64{"percall": 3, "pool": 2}},
		{0, map[string]int64{"a": 1}, map[string]int64{"a": 0}},
		// Byte order, not a locale's: '-' sorts before the digits.
		{3, map[string]int64{"a-1": 9, "a1": 9}, map[string]int64{"a-1": 2, "a1": 1}},
	} {
		if got := protocol.FairShares(tc.limit, tc.wants); !maps.Equal(got, tc.want) {
			t.Errorf("FairShares(%d, %v) = %v, want %v", tc.limit, tc.wants, got, tc.want)
		}
	}
}

// TestPoolSharesMatchFairShares is the differential test of the share rule:
// rounds of random wants over a few pools (ids that sort differently by byte
// and by a locale), with per-call demand in some rounds: anonymous, from
// callers that name themselves (each a contender of its own), or both. Once
// every pool has
// written its want, a new limit invalidates the cached split and every
// pool's share, the first computed afresh and the others from the cache,
// must be protocol.FairShares of the live wants.
func TestPoolSharesMatchFairShares(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		rng := rand.New(rand.NewPCG(3, 4))
		ids := []string{"a-1", "a1", "B", "b", "a_2", "zz"}
		pools := map[string]*testPool{}
		for _, id := range ids {
			pools[id] = newPool(c, id)
		}
		p := policy(10)
		mustPublish(t, c, p)
		for round := range 12 {
			wants := map[string]int64{}
			for _, id := range ids {
				wants[id] = rng.Int64N(14)
			}
			p.Limit, p.Epoch = 1+rng.Int64N(40), p.Epoch+1
			percall := round%3 == 2
			// The per-call callers of the round and whether anonymous ones
			// are refused too.
			callers := [][]string{nil, {"p-2", "p1"}, {"p1", "q", "r"}, {"z"}}[round/3]
			anon := len(callers) == 0 || len(callers) == 3
			if percall {
				// The pools give back every slot and per-call calls fill
				// the limit: the next one is refused and records per-call
				// demand.
				mustPublish(t, c, p)
				for _, id := range ids {
					pools[id].refresh(t, 0, append([]string(nil), pools[id].held...))
				}
				for range p.Limit {
					mustAdmit(t, c, time.Minute)
				}
				refuse := func(args protocol.AcquireArgs) {
					args.LeaseID, args.TTL = leaseID(), time.Minute
					a, err := c.Acquire(ctxT(t), args)
					if err != nil {
						t.Fatalf("round %d: Acquire: %v", round, err)
					}
					if a.Code != protocol.RefusedThrottled {
						t.Fatalf("round %d: per-call acquire = %v, want throttled", round, a.Code)
					}
				}
				if anon {
					refuse(protocol.AcquireArgs{})
					wants[protocol.PerCallContender] = p.Limit
				}
				for j, id := range callers {
					args := protocol.AcquireArgs{CallerID: id}
					if j == 0 {
						// A job key's arguments come before the caller id.
						args.JobKey, args.JobVersion, args.JobTTL = "job", int64(round), time.Minute
					}
					refuse(args)
					refuse(args) // the same caller again: still one contender
					wants[protocol.PerCallerContender(id)] = p.Limit
				}
			}
			for _, id := range ids {
				pools[id].refresh(t, wants[id], nil)
			}
			// A new limit (here: the same one again, with a new epoch, when
			// per-call demand is live) makes the next refresh split afresh.
			p.Limit, p.Epoch = p.Limit+1, p.Epoch+1
			if percall {
				p.Limit--
			}
			mustPublish(t, c, p)
			if percall {
				// The publication alone leaves the cached split; time it out.
				time.Sleep(260 * time.Millisecond)
			}
			want := protocol.FairShares(p.Limit, wants)
			got := map[string]int64{}
			for _, id := range ids {
				got[id] = pools[id].refresh(t, wants[id], nil).Share
			}
			delete(want, protocol.PerCallContender)
			for _, id := range callers {
				delete(want, protocol.PerCallerContender(id))
			}
			for _, id := range ids {
				if got[id] != want[id] {
					t.Errorf("round %d, limit %d, wants %v: shares %v, FairShares %v", round, p.Limit, wants, got, want)
					break
				}
			}
			if percall {
				// End the round's per-call leases and demand.
				if err := rdb.Del(ctxT(t), c.Keys().Leases, c.Keys().Wants, c.Keys().Callers).Err(); err != nil {
					t.Fatal(err)
				}
				for _, tp := range pools {
					tp.held = nil
				}
			}
		}
	})
}

// TestAcquireRecordsPerCallCallers: a refusal for want of a slot scores a
// caller that names itself in the callers set, once however often it is
// refused, and drops callers silent for more than a second; an anonymous
// refusal writes the wants hash's 'percall' field instead. An admission
// records nothing.
func TestAcquireRecordsPerCallCallers(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		k := c.Keys()
		mustPublish(t, c, policy(1))
		acquire := func(caller string) protocol.Code {
			a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Minute, CallerID: caller})
			if err != nil {
				t.Fatalf("Acquire: %v", err)
			}
			return a.Code
		}
		if got := acquire("a"); got != protocol.Admitted {
			t.Fatalf("first acquire = %v, want admitted", got)
		}
		if n := rdb.Exists(ctxT(t), k.Callers).Val(); n != 0 {
			t.Fatalf("an admission wrote the callers key")
		}
		// A caller last refused long ago: pruned by the next refusal.
		if err := rdb.ZAdd(ctxT(t), k.Callers, redis.Z{Score: 1, Member: "old"}).Err(); err != nil {
			t.Fatal(err)
		}
		for _, caller := range []string{"a", "b", "a"} {
			if got := acquire(caller); got != protocol.RefusedThrottled {
				t.Fatalf("acquire(%q) = %v, want throttled", caller, got)
			}
		}
		got, err := rdb.ZRange(ctxT(t), k.Callers, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, []string{"a", "b"}) && !slices.Equal(got, []string{"b", "a"}) {
			t.Errorf("callers = %v, want a and b", got)
		}
		if rdb.HExists(ctxT(t), k.Wants, protocol.PerCallContender).Val() {
			t.Errorf("a named caller's refusal wrote the anonymous field")
		}
		if got := acquire(""); got != protocol.RefusedThrottled {
			t.Fatalf("anonymous acquire = %v, want throttled", got)
		}
		if !rdb.HExists(ctxT(t), k.Wants, protocol.PerCallContender).Val() {
			t.Errorf("an anonymous refusal did not write the 'percall' field")
		}
		if n := rdb.ZCard(ctxT(t), k.Callers).Val(); n != 2 {
			t.Errorf("an anonymous refusal changed the callers set: %d members", n)
		}
	})
}
