package protocol_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// liveLeases counts the leases that hold a slot now, by Redis time.
func liveLeases(t *testing.T, rdb redis.UniversalClient, c *protocol.Client) int64 {
	t.Helper()
	now := redisNow(t, rdb).UnixMilli()
	n, err := rdb.ZCount(ctxT(t), c.Keys().Leases, "("+strconv.FormatInt(now, 10), "+inf").Result()
	if err != nil {
		t.Fatalf("ZCOUNT: %v", err)
	}
	return n
}

// TestAcquireLateRequestTakesNoSlot: an acquisition that reaches the script
// after its deadline (it waited behind a slow script, or in the socket of a
// paused Redis, while its caller gave up) is refused and writes nothing, so
// no lease is left that no call holds.
func TestAcquireLateRequestTakesNoSlot(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(1)
		p.RatePerSecond = 1
		mustPublish(t, c, p)
		now := redisNow(t, rdb).Truncate(time.Millisecond)

		a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: 30 * time.Second, Deadline: now.Add(-time.Millisecond)})
		if err != nil {
			t.Fatalf("Acquire: %v", err)
		}
		if a.Code != protocol.RefusedLate {
			t.Fatalf("late acquisition = %+v, want %v", a, protocol.RefusedLate)
		}
		if a.Now.Before(now) || a.Now.After(now.Add(5*time.Second)) {
			t.Errorf("late refusal carries Redis time %v, want about %v", a.Now, now)
		}
		if n := liveLeases(t, rdb, c); n != 0 {
			t.Fatalf("a late acquisition left %d live leases", n)
		}
		// Nor did it spend the rate token (1/s, burst 1): a call in time
		// is admitted at once and carries Redis's time.
		a, err = c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: 30 * time.Second, Deadline: redisNow(t, rdb).Add(time.Second)})
		if err != nil || a.Code != protocol.Admitted {
			t.Fatalf("acquisition in time = %+v, %v, want admitted", a, err)
		}
		if a.Now.IsZero() {
			t.Errorf("admission carries no Redis time")
		}
	})
}

// TestForgetBeforeAndAfterAcquire: Forget makes a lease stop counting whether
// the acquisition it abandons already ran or runs after it (it was queued in
// Redis behind the Forget), and is idempotent.
func TestForgetBeforeAndAfterAcquire(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(1))

		// After: the acquisition ran, its reply was never read.
		a := mustAdmit(t, c, 30*time.Second)
		if err := c.Forget(ctxT(t), a.Member); err != nil {
			t.Fatalf("Forget: %v", err)
		}
		if err := c.Forget(ctxT(t), a.Member); err != nil {
			t.Fatalf("second Forget: %v", err)
		}
		if n := liveLeases(t, rdb, c); n != 0 {
			t.Fatalf("after Forget %d live leases, want 0", n)
		}

		// Before: the Forget runs first, the abandoned acquisition later.
		id := leaseID()
		if err := c.Forget(ctxT(t), id); err != nil {
			t.Fatalf("Forget: %v", err)
		}
		late, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: id, TTL: 30 * time.Second})
		if err != nil || late.Code != protocol.Admitted {
			t.Fatalf("Acquire = %+v, %v, want admitted", late, err)
		}
		if n := liveLeases(t, rdb, c); n != 0 {
			t.Fatalf("an acquisition forgotten before it ran holds %d live leases, want 0", n)
		}
		// The slot is free for a real call.
		mustAdmit(t, c, 30*time.Second)
	})
}

// TestReleaseCancelledCountsNothing: a call released as cancelled frees its
// slot and reports no outcome, so a fleet that cancels its calls (shutdown,
// callers gone) never opens the breaker or spends the retry budget.
func TestReleaseCancelledCountsNothing(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(5))
		for range 5 {
			a := mustAdmit(t, c, 30*time.Second)
			if !mustRelease(t, c, a, protocol.Cancelled, 2) {
				t.Fatalf("cancelled release found no lease")
			}
		}
		if n := liveLeases(t, rdb, c); n != 0 {
			t.Fatalf("%d live leases after cancelled releases", n)
		}
		w, _, _, err := c.ReadWindow(ctxT(t), 30*time.Second, time.Time{})
		if err != nil {
			t.Fatalf("ReadWindow: %v", err)
		}
		if w.Calls != 0 || w.Failures != 0 {
			t.Errorf("window after 5 cancelled calls = %+v, want nothing counted", w)
		}
	})
}

// TestCancelledProbeGivesItsProbeBack: HalfOpen admits `limit` probes per
// epoch; a probe cancelled by its caller told the controller nothing, so the
// epoch may send another.
func TestCancelledProbeGivesItsProbeBack(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(1)
		p.State = wire.HalfOpen
		p.Epoch = 5
		mustPublish(t, c, p)
		a := mustAdmit(t, c, 30*time.Second)
		if b := mustAcquire(t, c, 30*time.Second); b.Code != protocol.RefusedThrottled {
			t.Fatalf("second probe = %+v, want throttled", b)
		}
		mustRelease(t, c, a, protocol.Cancelled, 1)
		b := mustAdmit(t, c, 30*time.Second)
		mustRelease(t, c, b, protocol.Success, 1)
		_, probes, _, err := c.ReadWindow(ctxT(t), 30*time.Second, time.Time{})
		if err != nil {
			t.Fatalf("ReadWindow: %v", err)
		}
		if probes.Successes != 1 || probes.Failures+probes.Timeouts != 0 {
			t.Errorf("probes = %+v, want 1 success and nothing else", probes)
		}
	})
}

// TestHalfOpenIgnoresOldLeases: calls admitted before the outage may still
// hold leases when the breaker goes HalfOpen; they must not keep the epoch's
// probes out, or the breaker cycles Open/HalfOpen until they end.
func TestHalfOpenIgnoresOldLeases(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(3)
		mustPublish(t, c, p)
		for range 3 {
			mustAdmit(t, c, 30*time.Second)
		}
		p.State, p.Epoch, p.Limit = wire.Open, 2, 0
		p.OpenUntil = redisNow(t, rdb)
		mustPublish(t, c, p)
		p.State, p.Epoch, p.Limit = wire.HalfOpen, 3, 3
		mustPublish(t, c, p)
		for i := range 3 {
			if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.Admitted {
				t.Fatalf("probe %d with 3 leases from epoch 1 = %+v, want admitted", i, a)
			}
		}
		if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.RefusedThrottled {
			t.Fatalf("fourth probe = %+v, want throttled", a)
		}
	})
}

// TestStaleOpenAdmitsProbes is the dead-man rule: when no manager has
// published for stale_after_ms, an Open breaker admits the policy's probes,
// at most half_open_probes in flight, instead of refusing the fleet forever;
// a fresh publish ends it.
func TestStaleOpenAdmitsProbes(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(0)
		p.State, p.Epoch = wire.Open, 2
		p.OpenUntil = redisNow(t, rdb).Add(time.Hour)
		mustPublish(t, c, p)
		setState := func(kv ...any) {
			t.Helper()
			if err := rdb.HSet(ctxT(t), c.Keys().State, kv...).Err(); err != nil {
				t.Fatalf("HSET: %v", err)
			}
		}
		setState("stale_after_ms", 10_000, "half_open_probes", 2)
		if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.RefusedOpen {
			t.Fatalf("fresh Open = %+v, want open", a)
		}
		// The manager last published 11 s ago.
		setState("updated_at_ms", redisNow(t, rdb).Add(-11*time.Second).UnixMilli())
		var held []protocol.Admission
		for range 2 {
			a := mustAdmit(t, c, 30*time.Second)
			held = append(held, a)
		}
		if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.RefusedThrottled || a.Limit != 2 {
			t.Fatalf("third call under a stale Open = %+v, want throttled at 2", a)
		}
		// In flight, not per epoch: a finished call makes room.
		mustRelease(t, c, held[0], protocol.Success, 1)
		mustAdmit(t, c, 30*time.Second)

		// Without the rule's fields, or with a fresh publish, Open refuses.
		mustPublish(t, c, p)
		if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.RefusedOpen {
			t.Fatalf("Open after a fresh publish = %+v, want open", a)
		}
		setState("stale_after_ms", 0, "updated_at_ms", redisNow(t, rdb).Add(-time.Hour).UnixMilli())
		if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.RefusedOpen {
			t.Fatalf("Open with the rule off = %+v, want open", a)
		}

		// A stale HalfOpen whose probes are spent admits probes at a time
		// too: no manager reads their outcomes to start the next epoch.
		p.State, p.Epoch, p.Limit = wire.HalfOpen, 3, 1
		mustPublish(t, c, p)
		setState("stale_after_ms", 10_000, "half_open_probes", 3) // two calls from the stale Open still run
		probe := mustAdmit(t, c, 30*time.Second)
		mustRelease(t, c, probe, protocol.Success, 1)
		if a := mustAcquire(t, c, 30*time.Second); a.Code != protocol.RefusedThrottled {
			t.Fatalf("fresh HalfOpen with its probe spent = %+v, want throttled", a)
		}
		setState("updated_at_ms", redisNow(t, rdb).Add(-11*time.Second).UnixMilli())
		mustAdmit(t, c, 30*time.Second)
	})
}
