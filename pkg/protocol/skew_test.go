package protocol_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/skewtest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// previousScripts are the scripts of the previous protocol version, as the
// commit its pin names (pkg/protocol/pins/v<N-1>.sum) shipped them
// (skewtest.PreviousScript).
func previousScripts(t testing.TB) map[string]*redis.Script {
	t.Helper()
	out := map[string]*redis.Script{}
	for _, n := range []string{"acquire", "release", "publish", "pool", "budget"} {
		s, err := skewtest.PreviousScript(n)
		if err != nil {
			t.Fatal(err)
		}
		out[n] = s
	}
	return out
}

// prevAcquire runs the previous version's acquire for lease id with its keys.
func prevAcquire(t *testing.T, old map[string]*redis.Script, rdb redis.UniversalClient, k protocol.Keys, id string) []any {
	t.Helper()
	res, err := old["acquire"].Run(ctxT(t), rdb, []string{k.State, k.Leases, k.GCRA, k.Probes, k.Wants, k.Callers}, id, 30000, 0).Slice()
	if err != nil {
		t.Fatalf("previous version's acquire: %v", err)
	}
	return res
}

// TestVersionsShareOneCap: workers of the previous version (its real
// scripts, from the repository's history) and of this one, on one
// dependency, under a manager of either version, share one cap: the leases
// of both count against the one limit. A trip a worker of the previous
// version makes is counted and fenced by this version's publish like its
// own.
func TestVersionsShareOneCap(t *testing.T) {
	t.Parallel()
	old := previousScripts(t)
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		for _, manager := range []int{protocol.Version - 1, protocol.Version} {
			c := newClient(t, rdb)
			k := c.Keys()
			p := tripPolicy(wire.Closed, 4, 0.5, 4, 30*time.Second, redisNow(t, rdb).Add(-time.Minute))
			if manager == protocol.Version {
				mustPublish(t, c, p)
			} else {
				// The previous version's publish, with the fields its
				// Publish wrote (this version's minus its own).
				args := []any{p.Epoch, 0, "state", "Closed", "limit", 4, "capacity", 4, "trip_on", 1,
					"trip_failure_ratio", "0.5", "trip_min_calls", 4, "trip_open_ms", 7000, "breaker_window_s", 30,
					"trip_since_ms", redisNow(t, rdb).Add(-time.Minute).UnixMilli(), "trip_acked_ms", 0, "trip_acked_count", 0}
				if err := old["publish"].Run(ctxT(t), rdb, []string{k.State, k.Probes}, args...).Err(); err != nil {
					t.Fatalf("previous version's publish: %v", err)
				}
			}
			// Two slots to each version, then both are refused.
			for i := range 2 {
				if res := prevAcquire(t, old, rdb, k, "old-"+strconv.Itoa(i)); res[0].(int64) != 0 {
					t.Fatalf("manager %d: previous version's acquire %d = %v, want admitted", manager, i, res)
				}
				if a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: "new-" + strconv.Itoa(i), TTL: 30 * time.Second}); err != nil || a.Code != protocol.Admitted {
					t.Fatalf("manager %d: version %d acquire %d = %+v, %v; want admitted", manager, protocol.Version, i, a, err)
				}
			}
			if res := prevAcquire(t, old, rdb, k, "old-x"); res[0].(int64) != 2 {
				t.Errorf("manager %d: previous version's acquire past the limit = %v, want throttled", manager, res)
			}
			if a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: "new-x", TTL: 30 * time.Second}); err != nil || a.Code != protocol.RefusedThrottled || a.Held != 4 {
				t.Errorf("manager %d: version %d acquire past the limit = %+v, %v; want throttled with 4 held", manager, protocol.Version, a, err)
			}
			if manager != protocol.Version {
				continue
			}
			// Workers of the previous version trip the breaker; this version's publish
			// refuses a plan that did not see it, and takes it over.
			read := mustRead(t, c)
			for i := range 4 {
				if err := old["release"].Run(ctxT(t), rdb, []string{k.Leases, k.Stats, k.State, k.Probes, k.Calls}, "", "f", 1).Err(); err != nil {
					t.Fatalf("previous version's release %d: %v", i, err)
				}
			}
			tripped := mustRead(t, c)
			if tripped.State != wire.Open || tripped.TripCount != read.TripCount+1 {
				t.Fatalf("after 4 failures of the previous version: state %s, trips %d; want Open, counted once", tripped.State, tripped.TripCount)
			}
			stale := p
			stale.Seq, stale.Trip.Acknowledged, stale.Trip.AcknowledgedCount = read.Seq, read.TripSeen(), read.TripsSeen()
			if _, err := c.Publish(ctxT(t), stale); !errors.Is(err, protocol.ErrTripped) {
				t.Errorf("publish of a plan made before the previous version's trip = %v, want ErrTripped", err)
			}
		}
	})
}

// TestVersionRefusalNamesBothVersions: a state this version does not act on
// (a manager two versions newer) is refused with a *VersionError that names
// the state's version, the manager's and this worker's, and what to do; by
// acquire, budget and pool alike.
func TestVersionRefusalNamesBothVersions(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(4))
		seq := mustRead(t, c).Seq
		if err := rdb.HSet(ctxT(t), c.Keys().State, "version", protocol.MaxStateVersion+1, "manager_version", protocol.Version+2, "manager_seq", seq).Err(); err != nil {
			t.Fatal(err)
		}
		_, errA := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Second})
		_, errB := c.RetryBudget(ctxT(t))
		_, errP := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: "r", TTL: time.Second, Want: 1})
		_, _, errR := c.ReadPublished(ctxT(t))
		for what, err := range map[string]error{"acquire": errA, "budget": errB, "pool": errP, "read": errR} {
			var ve *protocol.VersionError
			if !errors.As(err, &ve) || !errors.Is(err, protocol.ErrVersion) {
				t.Errorf("%s = %v, want a *VersionError", what, err)
				continue
			}
			if ve.State != protocol.MaxStateVersion+1 || ve.Manager != protocol.Version+2 {
				t.Errorf("%s: state version %d, manager %d; want %d and %d", what, ve.State, ve.Manager, protocol.MaxStateVersion+1, protocol.Version+2)
			}
			msg := err.Error()
			for _, want := range []string{"protocol version " + strconv.Itoa(protocol.Version+2), "speaks version " + strconv.Itoa(protocol.Version), "upgrade this worker"} {
				if !strings.Contains(msg, want) {
					t.Errorf("%s: %q does not say %q", what, msg, want)
				}
			}
		}
	})
}

// TestRegisterAndReadFleet: registered processes are counted by client and
// version for a minute, and the calls of the last whole minute are split
// between this version's workers (counted by its release and pool) and the
// rest, which older workers made.
func TestRegisterAndReadFleet(t *testing.T) {
	t.Parallel()
	old := previousScripts(t)
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		k := c.Keys()
		mustPublish(t, c, policy(100))
		for _, r := range [][2]string{{"go", "a"}, {"go", "b"}, {"python", "c"}, {"go", "a"}} {
			if err := c.Register(ctxT(t), r[0], r[1]); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Register(ctxT(t), "go", "with space"); err == nil {
			t.Error("Register accepted a process id with a space")
		}
		// A stale member (6 minutes old) is dropped by the next
		// registration; one 2 minutes old is kept but not counted.
		now := redisNow(t, rdb)
		rdb.ZAdd(ctxT(t), k.Clients, redis.Z{Score: float64(now.Add(-6 * time.Minute).UnixMilli()), Member: "go 5 gone"},
			redis.Z{Score: float64(now.Add(-2 * time.Minute).UnixMilli()), Member: "go 5 quiet"})
		if err := c.Register(ctxT(t), "node", "d"); err != nil {
			t.Fatal(err)
		}
		if n, _ := rdb.ZCard(ctxT(t), k.Clients).Result(); n != 5 {
			t.Errorf("clients set holds %d members, want 5 (the 6-minute-old one dropped)", n)
		}
		// Calls: 3 by this version, 2 by the previous one, in the current 10 s
		// bucket; the fleet read counts whole buckets only, so wait for
		// the next one.
		releaseN(t, c, 3, protocol.Success)
		for range 2 {
			if err := old["release"].Run(ctxT(t), rdb, []string{k.Leases, k.Stats, k.State, k.Probes, k.Calls}, "", "s", 1).Err(); err != nil {
				t.Fatal(err)
			}
		}
		now = redisNow(t, rdb)
		time.Sleep(now.Truncate(10 * time.Second).Add(10*time.Second + 20*time.Millisecond).Sub(now))
		f, err := c.ReadFleet(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		v := protocol.Version
		want := map[protocol.Process]int{{Client: "go", Version: v}: 2, {Client: "python", Version: v}: 1, {Client: "node", Version: v}: 1}
		if len(f.Processes) != len(want) {
			t.Errorf("processes %v, want %v", f.Processes, want)
		}
		for p, n := range want {
			if f.Processes[p] != n {
				t.Errorf("processes %v: %v = %d, want %d", f.Processes, p, f.Processes[p], n)
			}
		}
		// The previous version (5) counts its own calls: none is unversioned.
		if f.Calls != 5 || f.CallsByVersion[v] != 3 || f.CallsByVersion[v-1] != 2 || f.Unversioned() != 0 {
			t.Errorf("calls %d, by version %v, unversioned %d; want 5, 3 by version %d and 2 by %d, 0", f.Calls, f.CallsByVersion, f.Unversioned(), v, v-1)
		}
		if got, want := f.Summary(), fmt.Sprintf("v%d: 2 go, 1 node, 1 python; v%d: 2 calls/min", v, v-1); got != want {
			t.Errorf("Summary = %q, want %q", got, want)
		}
		if vs := f.Versions(); len(vs) != 2 || vs[0] != v-1 || vs[1] != v || f.Oldest() != v-1 {
			t.Errorf("Versions = %v, Oldest %d; want [%d %d], %d", vs, f.Oldest(), v-1, v, v-1)
		}
	})
}

// TestOrphanTripEndsByItself: a trip that no manager takes over (none runs)
// is probed by the workers once its open duration has passed. The probes'
// successes put back the state and limit the trip replaced, acknowledging
// it; a probe's failure opens the breaker again; probes whose outcome never
// comes (their worker died) give way to a new round an open duration later.
func TestOrphanTripEndsByItself(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		const open = 300 * time.Millisecond
		p := tripPolicy(wire.Ramping, 6, 0.5, 4, 30*time.Second, redisNow(t, rdb).Add(-time.Minute))
		const stale = 200 * time.Millisecond // the dead-man bound: probes start that long after open_until
		p.Trip.OpenDuration, p.HalfOpenProbes, p.StaleAfter = open, 2, stale
		mustPublish(t, c, p)
		acquire := func() protocol.Admission {
			t.Helper()
			a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			return a
		}
		waitOpen := func() {
			t.Helper()
			time.Sleep(time.Until(mustRead(t, c).OpenUntil) + stale + 20*time.Millisecond)
		}

		releaseN(t, c, 4, protocol.Failure)
		tripped := mustRead(t, c)
		if tripped.State != wire.Open || tripped.TrippedLimit != 6 || tripped.TrippedEpoch != p.Epoch || tripped.TripCount != 1 {
			t.Fatalf("after 4 failures: %+v; want Open, tripped from limit 6 at epoch %d, one trip", tripped, p.Epoch)
		}
		if a := acquire(); a.Code != protocol.RefusedOpen {
			t.Fatalf("acquire before the open duration passed = %+v, want refused open", a)
		}
		time.Sleep(time.Until(tripped.OpenUntil) + 20*time.Millisecond)
		if a := acquire(); a.Code != protocol.RefusedOpen {
			t.Fatalf("acquire after the open duration, within the dead-man bound = %+v, want refused open (a manager may still take the trip over)", a)
		}

		// A probe fails: open again for the open duration.
		waitOpen()
		a := acquire()
		if a.Code != protocol.Admitted || a.State != wire.HalfOpen || a.Epoch != p.Epoch {
			t.Fatalf("acquire after the open duration = %+v, want a HalfOpen probe of epoch %d", a, p.Epoch)
		}
		if _, err := c.Release(ctxT(t), a.Member, a.Epoch, protocol.Failure, 1); err != nil {
			t.Fatal(err)
		}
		reopened := mustRead(t, c)
		if reopened.State != wire.Open || !reopened.OpenUntil.After(tripped.OpenUntil) || reopened.TripCount != 2 {
			t.Fatalf("after a failed probe: %+v; want Open again, later open-until, trip counted", reopened)
		}
		if a := acquire(); a.Code != protocol.RefusedOpen {
			t.Fatalf("acquire right after the failed probe = %+v, want refused open", a)
		}

		// Probes that never answer: a new round an open duration later.
		waitOpen()
		lost1, lost2 := acquire(), acquire()
		if lost1.Code != protocol.Admitted || lost2.Code != protocol.Admitted {
			t.Fatalf("two probes = %+v, %+v; want admitted", lost1, lost2)
		}
		if a := acquire(); a.Code != protocol.RefusedThrottled {
			t.Fatalf("a third probe = %+v, want throttled (2 probes a round)", a)
		}
		time.Sleep(open + 20*time.Millisecond)
		ok1, ok2 := acquire(), acquire()
		if ok1.Code != protocol.Admitted || ok1.State != wire.HalfOpen || ok2.Code != protocol.Admitted {
			t.Fatalf("probes of a new round = %+v, %+v; want admitted HalfOpen", ok1, ok2)
		}

		// Two successes end the trip: Ramping at limit 6, acknowledged.
		for _, a := range []protocol.Admission{ok1, ok2} {
			if _, err := c.Release(ctxT(t), a.Member, a.Epoch, protocol.Success, 1); err != nil {
				t.Fatal(err)
			}
		}
		healed := mustRead(t, c)
		if healed.State != wire.Ramping || healed.Limit != 6 || healed.TripPending() || healed.Epoch != p.Epoch {
			t.Fatalf("after 2 successful probes: %+v; want Ramping at 6, the trip acknowledged, epoch %d", healed, p.Epoch)
		}
		if a := acquire(); a.Code != protocol.Admitted || a.State != wire.Ramping {
			t.Fatalf("acquire after the trip ended = %+v, want admitted Ramping", a)
		}
		// The failures before the end do not trip it again.
		releaseN(t, c, 1, protocol.Failure)
		if got := mustRead(t, c); got.State != wire.Ramping {
			t.Fatalf("one failure after the trip ended: state %s, want Ramping (the window starts afresh)", got.State)
		}
	})
}

// TestPoolResendIsAnsweredAfterThePolicyIsGone: a pool request whose reply
// was lost is answered, when sent again, as its first run was, even after
// the policy was deleted or another version published: answered {5} or {6},
// the pool would merge back a report Redis already counted.
func TestPoolResendIsAnsweredAfterThePolicyIsGone(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		for _, gone := range []string{"deleted", "other version"} {
			c := newClient(t, rdb)
			mustPublish(t, c, policy(4))
			args := protocol.PoolArgs{PoolID: "p1", RequestID: "r1", TTL: 10 * time.Second, Want: 2}
			args.Report.Add(protocol.Success, 1, 0)
			first, err := c.Pool(ctxT(t), args)
			if err != nil {
				t.Fatal(err)
			}
			if gone == "deleted" {
				rdb.Del(ctxT(t), c.Keys().State)
			} else {
				rdb.HSet(ctxT(t), c.Keys().State, "version", protocol.MaxStateVersion+1)
			}
			again, err := c.Pool(ctxT(t), args)
			if err != nil {
				t.Fatalf("%s: the resend = %v, want the first run's reply", gone, err)
			}
			if len(again.Granted) != len(first.Granted) || again.Now != first.Now {
				t.Errorf("%s: the resend answered %+v, want %+v", gone, again, first)
			}
		}
	})
}

// TestTwoVersionsScriptsOnOneConnection: the previous version's scripts and this
// version's, loaded on one Redis and run through one client connection, do
// not collide: EVALSHA is keyed by each script's content, so each runs its
// own text, and a NOSCRIPT for one (after SCRIPT FLUSH) loads that one only.
func TestTwoVersionsScriptsOnOneConnection(t *testing.T) {
	t.Parallel()
	old := previousScripts(t)
	srv, _ := sharedStandalone(t)
	rdb := srv.Client(func(o *redis.Options) { o.PoolSize = 1 })
	t.Cleanup(func() { _ = rdb.Close() })
	c := newClient(t, rdb)
	k := c.Keys()
	mustPublish(t, c, policy(2))
	for round := range 2 {
		if res := prevAcquire(t, old, rdb, k, "old-"+strconv.Itoa(round)); res[0].(int64) != 0 {
			t.Fatalf("round %d: previous version's acquire = %v, want admitted", round, res)
		}
		if a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: "new-" + strconv.Itoa(round), TTL: time.Second}); err != nil || a.Code != protocol.Admitted {
			t.Fatalf("round %d: version %d acquire = %+v, %v; want admitted", round, protocol.Version, a, err)
		}
		for _, id := range []string{"old-" + strconv.Itoa(round), "new-" + strconv.Itoa(round)} {
			if _, err := c.Release(ctxT(t), id, 0, protocol.Success, 1); err != nil {
				t.Fatal(err)
			}
		}
		if round == 0 {
			if err := rdb.ScriptFlush(ctxT(t)).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	lib, err1 := os.ReadFile(filepath.Join("lua", "lib.lua"))
	acq, err2 := os.ReadFile(filepath.Join("lua", "acquire.lua"))
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	if now := redis.NewScript(string(lib) + string(acq)).Hash(); old["acquire"].Hash() == now {
		t.Errorf("the previous version's acquire and this version's have one SHA1 %s", now)
	}
	if n := rdb.PoolStats().TotalConns; n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

// TestTripPendingUnderAVersion4Manager: a manager of version 4 takes a trip
// over by its time alone (trip_acked_ms) and never writes trip_acked_count,
// so the trips workers of version 5 counted under it are not pending for a
// manager of version 5 that reads its publication; one a manager of version
// 5 published still fences by the count (the rolling-upgrade test found the
// first: the upgraded manager reopened the breaker mid-ramp).
func TestTripPendingUnderAVersion4Manager(t *testing.T) {
	at := time.Unix(1_800_000_000, 0)
	p := protocol.Published{TrippedAt: at, TripCount: 2, Trip: protocol.Trip{Acknowledged: at, AcknowledgedCount: 1}}
	if p.TripPending() {
		t.Error("a trip a manager of version 4 took over by its time is pending")
	}
	p.ManagerVersion = protocol.Version
	if !p.TripPending() {
		t.Error("a trip counted after the last acknowledgement of a manager of version 5 is not pending")
	}
	p.ManagerVersion, p.TrippedAt = 0, at.Add(time.Millisecond)
	if !p.TripPending() {
		t.Error("a trip after the time a manager of version 4 acknowledged is not pending")
	}
}
