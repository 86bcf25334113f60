package protocol_test

import (
	"maps"
	"math/rand/v2"
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
// and by a locale), with per-call demand in some rounds. Once every pool has
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
				if a := mustAcquire(t, c, time.Minute); a.Code != protocol.RefusedThrottled {
					t.Fatalf("round %d: per-call acquire = %v, want throttled", round, a.Code)
				}
				wants[protocol.PerCallContender] = p.Limit
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
			for _, id := range ids {
				if got[id] != want[id] {
					t.Errorf("round %d, limit %d, wants %v: shares %v, FairShares %v", round, p.Limit, wants, got, want)
					break
				}
			}
			if percall {
				// End the round's per-call leases and demand.
				if err := rdb.Del(ctxT(t), c.Keys().Leases, c.Keys().Wants).Err(); err != nil {
					t.Fatal(err)
				}
				for _, tp := range pools {
					tp.held = nil
				}
			}
		}
	})
}
