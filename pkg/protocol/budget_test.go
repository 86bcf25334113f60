package protocol_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/retry"
)

// TestRetryBudgetNGrantsWhatOneAtATimeWould: n retries asked at once are
// granted exactly as many as n one-at-a-time decisions would grant
// (retry.AllowsPPM, each after the grants before it), and the window
// counts those grants and the rest as refusals; on the rule's boundaries,
// with large counts, and when nothing is left.
func TestRetryBudgetNGrantsWhatOneAtATimeWould(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		rows := []struct {
			calls, granted int64
			ratio          float64
			min            int64
		}{
			{0, 0, 0.2, 10}, {0, 9, 0.2, 10}, {0, 10, 0.2, 10}, {49, 9, 0.2, 10}, {56, 11, 0.2, 10},
			{100, 13, 0.2, 10}, {104, 20, 0.2, 10}, {1000, 0, 0.000001, 0}, {1_000_001, 0, 0.000001, 0},
			{300, 95, 1.0 / 3, 0}, {1_000_000, 142_850, 0.142857, 1},
			{9_000_000_000, 1_799_999_990, 0.2, 10}, {9_000_000_000, 1_800_000_000, 0.2, 10},
		}
		for i, r := range rows {
			for _, n := range []int64{1, 3, 50} {
				p := policy(10)
				p.Budget = retry.Budget{Ratio: r.ratio, MinRetries: r.min, Window: time.Minute}
				mustPublish(t, c, p)
				if err := rdb.Del(ctx, c.Keys().Stats).Err(); err != nil {
					t.Fatal(err)
				}
				now := redisNow(t, rdb).Unix()
				hsetSeconds(t, rdb, c, now, map[int64]map[string]int64{
					-7: {"s": r.calls, "a1": r.calls},
					-5: {"g": r.granted},
				})
				var want int64
				for want < n && retry.AllowsPPM(r.granted+want, r.calls, retry.RatioPPM(r.ratio), r.min) {
					want++
				}
				d, err := c.RetryBudgetN(ctx, n)
				if err != nil {
					t.Fatalf("row %d: %v", i, err)
				}
				if d.Grants != want || d.Allowed != (want > 0) || d.Calls != r.calls || d.Granted != r.granted {
					t.Errorf("row %d %+v, n %d: granted %d (allowed %v, calls %d, granted before %d), want %d",
						i, r, n, d.Grants, d.Allowed, d.Calls, d.Granted, want)
				}
				w, _ := mustWindow(t, c, time.Minute, time.Time{})
				if w.RetriesGranted != r.granted+want || w.BudgetRefused != n-want {
					t.Errorf("row %d, n %d: window granted %d refused %d, want %d and %d",
						i, n, w.RetriesGranted, w.BudgetRefused, r.granted+want, n-want)
				}
			}
		}
		if _, err := c.RetryBudgetN(ctx, 0); err == nil {
			t.Errorf("RetryBudgetN(0) succeeded, want an error")
		}
	})
}

// TestRetryBudgetReportsOneGrant: the per-call decision reports Grants 1
// when allowed, 0 when refused.
func TestRetryBudgetReportsOneGrant(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		p.Budget = retry.Budget{Ratio: 0, MinRetries: 1, Window: time.Minute}
		mustPublish(t, c, p)
		for i, want := range []int64{1, 0} {
			d, err := c.RetryBudget(ctxT(t))
			if err != nil || d.Grants != want || d.Allowed != (want == 1) {
				t.Errorf("decision %d = %+v, %v, want %d granted", i, d, err, want)
			}
		}
	})
}
