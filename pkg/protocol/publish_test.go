package protocol_test

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestPublishReadPublishedRoundTrip(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)

		if _, ok, err := c.ReadPublished(ctx); err != nil || ok {
			t.Fatalf("ReadPublished before any publish = ok %v, err %v; want false, nil", ok, err)
		}

		base := time.UnixMilli(time.Now().UnixMilli())
		want := protocol.Published{
			State:         wire.Ramping,
			Limit:         17,
			Capacity:      40,
			RatePerSecond: 333,
			Epoch:         7,
			OpenUntil:     base.Add(1500 * time.Millisecond),
			Backoff:       retry.Backoff{Base: 150 * time.Millisecond, Max: 20 * time.Second, Jitter: retry.JitterEqual},
			Budget:        retry.Budget{Ratio: 0.2, MinRetries: 12, Window: 90 * time.Second},
			BreakerWindow: 45 * time.Second,
			BreakerSince:  base.Add(-time.Minute),
			RampStep:      3,

			RampStepStarted: base.Add(-7 * time.Second),
			RampLimit:       2,
			RampCeiling:     5,
			RampBackoffs:    2,
			RampSettling:    true,
			HalfOpenProbes:  4,
			StaleAfter:      45500 * time.Millisecond,
			OutageSince:     base.Add(-90 * time.Second),
			SuccessLatency:  1234 * time.Microsecond,
			Trip: protocol.Trip{
				On: true, FailureRatio: 0.07, MinCalls: 25, Since: base.Add(-31 * time.Second),
				OpenDuration: 12500 * time.Millisecond, Acknowledged: base.Add(-time.Hour), AcknowledgedCount: 3,
			},
		}
		at, err := c.Publish(ctx, want)
		if err != nil {
			t.Fatalf("Publish: %v", err)
		}
		if d := time.Since(at); d < -time.Second || d > 5*time.Second {
			t.Errorf("Publish returned Redis time %v, %v from the local clock", at, d)
		}
		got, ok, err := c.ReadPublished(ctx)
		if err != nil || !ok {
			t.Fatalf("ReadPublished = ok %v, err %v", ok, err)
		}
		if !got.UpdatedAt.Equal(at) {
			t.Errorf("UpdatedAt = %v, want the publish time %v", got.UpdatedAt, at)
		}
		got.UpdatedAt = time.Time{}
		want.Seq = 1 // the first publication
		want.ManagerVersion = protocol.Version
		checkPublished(t, got, want)

		// The raw hash holds the derived fields workers read, with the units
		// the contract states.
		m, err := rdb.HGetAll(ctx, c.Keys().State).Result()
		if err != nil {
			t.Fatal(err)
		}
		for field, v := range map[string]string{
			"version":          strconv.Itoa(protocol.StateVersion),
			"epoch":            "7",
			"state":            "Ramping",
			"rate_interval_us": "3004", // ceil(1e6/333)
			"rate_burst":       "33",
			"budget_ratio_ppm": "200000",
			"budget_window_s":  "90",
			"breaker_window_s": "45",
			// max(45s, 90s) + 1m
			"stats_retention_s": "150",
			"seq":               "1",
			"half_open_probes":  "4",
			"stale_after_ms":    "45500",
			// the ramp's step-back memory (controller only)
			"ctrl_ramp_limit":    "2",
			"ctrl_ramp_ceiling":  "5",
			"ctrl_ramp_backoffs": "2",
			"ctrl_ramp_settling": "1",
			// the in-path trip's rule, the ratio as the shortest decimal
			"trip_on":            "1",
			"trip_failure_ratio": "0.07",
			"trip_min_calls":     "25",
			"trip_open_ms":       "12500",
			// not a publication over a state Redis lost
			"restored": "0",
		} {
			if m[field] != v {
				t.Errorf("state field %s = %q, want %q", field, m[field], v)
			}
		}
		if len(m) != 40 {
			t.Errorf("state hash has %d fields, want 40: %v", len(m), m)
		}

		// Zero times and rates survive as zero.
		zero := policy(5)
		zero.Epoch = 8
		mustPublish(t, c, zero)
		got, _, err = c.ReadPublished(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got.UpdatedAt = time.Time{}
		zero.Seq = 2
		zero.ManagerVersion = protocol.Version
		checkPublished(t, got, zero)
	})
}

// TestReadPublishedAt returns Redis's time with the state, and with no state.
func TestReadPublishedAt(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		_, ok, now, err := c.ReadPublishedAt(ctx)
		if err != nil || ok {
			t.Fatalf("ReadPublishedAt before any publish = ok %v, err %v; want false, nil", ok, err)
		}
		if d := time.Since(now); d < -time.Second || d > 5*time.Second {
			t.Errorf("ReadPublishedAt returned Redis time %v, %v from the local clock", now, d)
		}
		at := mustPublish(t, c, policy(10))
		p, ok, now, err := c.ReadPublishedAt(ctx)
		if err != nil || !ok {
			t.Fatalf("ReadPublishedAt = ok %v, err %v", ok, err)
		}
		if now.Before(at) || !p.UpdatedAt.Equal(at) || p.Limit != 10 {
			t.Errorf("ReadPublishedAt = limit %d updated %v at %v; want 10, %v, not before it", p.Limit, p.UpdatedAt, now, at)
		}
	})
}

func checkPublished(t *testing.T, got, want protocol.Published) {
	t.Helper()
	eqTime := func(name string, g, w time.Time) {
		if !g.Equal(w) {
			t.Errorf("%s = %v, want %v", name, g, w)
		}
	}
	eqTime("OpenUntil", got.OpenUntil, want.OpenUntil)
	eqTime("BreakerSince", got.BreakerSince, want.BreakerSince)
	eqTime("RampStepStarted", got.RampStepStarted, want.RampStepStarted)
	eqTime("UpdatedAt", got.UpdatedAt, want.UpdatedAt)
	eqTime("OutageSince", got.OutageSince, want.OutageSince)
	eqTime("Trip.Since", got.Trip.Since, want.Trip.Since)
	eqTime("Trip.Acknowledged", got.Trip.Acknowledged, want.Trip.Acknowledged)
	eqTime("TrippedAt", got.TrippedAt, want.TrippedAt)
	for _, p := range []*protocol.Published{&got, &want} {
		p.OpenUntil, p.BreakerSince, p.RampStepStarted, p.UpdatedAt = time.Time{}, time.Time{}, time.Time{}, time.Time{}
		p.OutageSince, p.Trip.Since, p.Trip.Acknowledged, p.TrippedAt = time.Time{}, time.Time{}, time.Time{}, time.Time{}
	}
	if got != want {
		t.Errorf("ReadPublished =\n%+v\nwant\n%+v", got, want)
	}
}

func TestPublishEpochFencing(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		p := policy(10)
		p.Epoch = 5
		mustPublish(t, c, p)

		// The same epoch may be rewritten (a parameter change without a
		// transition).
		p.Limit = 8
		mustPublish(t, c, p)

		stale := p
		stale.Epoch = 4
		stale.Limit = 99
		if _, err := c.Publish(ctx, stale); !errors.Is(err, protocol.ErrStaleEpoch) {
			t.Fatalf("Publish with a lower epoch: err = %v, want ErrStaleEpoch", err)
		}
		got, _, err := c.ReadPublished(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got.Epoch != 5 || got.Limit != 8 {
			t.Errorf("after a refused publish: epoch %d limit %d, want 5 and 8", got.Epoch, got.Limit)
		}
	})
}

func TestPublishNewEpochClearsProbes(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(4)
		p.State = wire.HalfOpen
		p.Epoch = 2
		mustPublish(t, c, p)
		for _, o := range []protocol.Outcome{protocol.Success, protocol.Failure, protocol.Timeout, protocol.Success} {
			mustRelease(t, c, mustAdmit(t, c, 10*time.Second), o, 1)
		}
		_, pr := mustWindow(t, c, time.Minute, time.Time{})
		if pr != (protocol.Probes{Successes: 2, Failures: 1, Timeouts: 1}) {
			t.Fatalf("probes = %+v, want 2/1/1", pr)
		}

		// Same epoch: kept.
		mustPublish(t, c, p)
		if _, pr = mustWindow(t, c, time.Minute, time.Time{}); pr.Successes != 2 {
			t.Errorf("probes after republishing the same epoch = %+v, want kept", pr)
		}
		// New epoch: cleared.
		p.Epoch = 3
		mustPublish(t, c, p)
		if _, pr = mustWindow(t, c, time.Minute, time.Time{}); pr != (protocol.Probes{}) {
			t.Errorf("probes after a new epoch = %+v, want zero", pr)
		}
	})
}

func TestNoPolicy(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		if _, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: "x", TTL: time.Second}); !errors.Is(err, protocol.ErrNoPolicy) {
			t.Errorf("Acquire without a policy: err = %v, want ErrNoPolicy", err)
		}
		if _, err := c.RetryBudget(ctx); !errors.Is(err, protocol.ErrNoPolicy) {
			t.Errorf("RetryBudget without a policy: err = %v, want ErrNoPolicy", err)
		}
		if n, err := rdb.Exists(ctx, c.Keys().Leases, c.Keys().GCRA, c.Keys().Stats).Result(); err != nil || n != 0 {
			t.Errorf("keys written without a policy: %d (err %v), want none", n, err)
		}
	})
}

func TestVersionMismatch(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(10))
		if err := rdb.HSet(ctx, c.Keys().State, "version", "1").Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: "x", TTL: time.Second}); !errors.Is(err, protocol.ErrVersion) {
			t.Errorf("Acquire: err = %v, want ErrVersion", err)
		}
		if _, err := c.RetryBudget(ctx); !errors.Is(err, protocol.ErrVersion) {
			t.Errorf("RetryBudget: err = %v, want ErrVersion", err)
		}
		if _, _, err := c.ReadPublished(ctx); !errors.Is(err, protocol.ErrVersion) {
			t.Errorf("ReadPublished: err = %v, want ErrVersion", err)
		}
		if n, _ := rdb.ZCount(ctx, c.Keys().Leases, "(-inf", "+inf").Result(); n != 0 {
			t.Errorf("a refused acquisition left %d leases", n)
		}
	})
}

// TestPublishOutOfOrder: two managers read the same state and plan from it at
// the same epoch, with different views of the spec (a deposed leader's cache
// still holds the old capacity). B publishes first; A's publish, planned
// before B's, must be refused instead of overwriting the newer decision. A
// publishes again once it has re-read.
func TestPublishOutOfOrder(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		a := newClient(t, rdb)
		b, err := protocol.NewClient(rdb, a.Dependency())
		if err != nil {
			t.Fatal(err)
		}
		ctx := ctxT(t)
		first := policy(40)
		first.Epoch = 3
		mustPublish(t, a, first)

		readA, _, err := a.ReadPublished(ctx)
		if err != nil {
			t.Fatal(err)
		}
		readB, _, err := b.ReadPublished(ctx)
		if err != nil {
			t.Fatal(err)
		}
		planA, planB := readA, readB
		planA.Limit, planA.Capacity = 40, 40
		planB.Limit, planB.Capacity = 20, 20

		mustPublish(t, b, planB)
		if _, err := a.Publish(ctx, planA); !errors.Is(err, protocol.ErrStaleSequence) {
			t.Errorf("A's publish, planned before B's: err = %v, want ErrStaleSequence", err)
		}
		got, _, err := a.ReadPublished(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got.Limit != 20 || got.Epoch != 3 || got.Seq != readB.Seq+1 {
			t.Fatalf("after A's late publish: limit %d epoch %d seq %d, want B's 20 at epoch 3, seq %d", got.Limit, got.Epoch, got.Seq, readB.Seq+1)
		}

		// A re-reads and plans again: accepted.
		again, _, err := a.ReadPublished(ctx)
		if err != nil {
			t.Fatal(err)
		}
		again.Limit = 30
		mustPublish(t, a, again)
		if got, _, _ = a.ReadPublished(ctx); got.Limit != 30 || got.Seq != again.Seq+1 {
			t.Errorf("after A re-read and published: limit %d seq %d, want 30 and %d", got.Limit, got.Seq, again.Seq+1)
		}

		// A higher epoch planned from an old state is refused too.
		late := again
		late.Epoch = 4
		late.State = wire.Open
		if _, err := b.Publish(ctx, late); !errors.Is(err, protocol.ErrStaleSequence) {
			t.Errorf("a new epoch planned from an old state: err = %v, want ErrStaleSequence", err)
		}
		// A zero sequence is not fenced: it follows the stored one.
		unfenced := got
		unfenced.Seq = 0
		unfenced.Limit = 25
		mustPublish(t, b, unfenced)
		if got, _, _ = a.ReadPublished(ctx); got.Limit != 25 || got.Seq != again.Seq+2 {
			t.Errorf("after an unfenced publish: limit %d seq %d, want 25 and %d", got.Limit, got.Seq, again.Seq+2)
		}
	})
}
