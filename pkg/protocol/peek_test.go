package protocol_test

import (
	"maps"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestPeekWindowSumsTheCountersAndWritesNothing: PeekWindow sums the
// per-second counters of its window, for a short window and for an hour
// (many HMGETs), and leaves the stats hash and the leases as they were;
// ReadWindow, over the same hash, writes (its cached totals, the lease
// sweep), so the comparison would see a write.
func TestPeekWindowSumsTheCountersAndWritesNothing(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(10))
		now := redisNow(t, rdb).Unix()
		fillSeconds(t, rdb, c.Keys().Stats, now-3700, now-40, allSuffixes, 1)
		hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{
			-10: {"s": 1, "a1": 1, "ds": 900, "dn": 1},
			-5:  {"f": 10, "a2": 10, "g": 4},
			-2:  {"t": 100, "a4": 100, "b": 3},
		})
		// A lease that expired a minute ago: the window script sweeps it.
		if err := rdb.ZAdd(ctx, c.Keys().Leases, redis.Z{Score: float64((now - 60) * 1000), Member: "gone"}).Err(); err != nil {
			t.Fatal(err)
		}
		snapshot := func() (map[string]string, []redis.Z) {
			t.Helper()
			stats, err := rdb.HGetAll(ctx, c.Keys().Stats).Result()
			if err != nil {
				t.Fatal(err)
			}
			leases, err := rdb.ZRangeWithScores(ctx, c.Keys().Leases, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			return stats, leases
		}
		stats, leases := snapshot()

		for _, length := range []time.Duration{30 * time.Second, 3500 * time.Millisecond, time.Hour} {
			_, _, at, err := c.ReadPublishedAt(ctx)
			if err != nil {
				t.Fatal(err)
			}
			w, err := c.PeekWindow(ctx, length, at)
			if err != nil {
				t.Fatal(err)
			}
			seconds := int64((length + time.Second - 1) / time.Second)
			if want := windowFromCounters(t, rdb, c, at.Unix(), seconds, time.Time{}); w != want {
				t.Errorf("PeekWindow(%v) at %v = %+v, the counters sum to %+v", length, at, w, want)
			}
		}
		if got, gotLeases := snapshot(); !maps.Equal(got, stats) || len(gotLeases) != len(leases) {
			t.Errorf("PeekWindow wrote: the stats hash went from %d to %d fields, the leases from %v to %v", len(stats), len(got), leases, gotLeases)
		}

		if _, _, _, err := c.ReadWindow(ctx, time.Hour, time.Time{}); err != nil {
			t.Fatal(err)
		}
		if got, gotLeases := snapshot(); maps.Equal(got, stats) && len(gotLeases) == len(leases) {
			t.Error("ReadWindow left the stats hash and the leases as they were: the comparison above cannot see a write")
		}
	})
}
