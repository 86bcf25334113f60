package guard_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// A failover to a replica that missed every lease (a new replication id,
// the leases key gone) while a call runs: the guard puts the call's lease
// back by itself within a hold period, in both modes, while another process
// is refused for the learning second; after it the cap counts the running
// call, and the slot is free only once the call ends.
func TestLeaseComesBackAfterAFailover(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		ctx := t.Context()
		srv := redistest.Start(t)
		rdb := fastClient(srv)
		publish(t, rdb, defaultPublished(1))
		gd := newGuard(t, rdb, guard.Options{Batch: batch})
		other := newGuard(t, rdb, guard.Options{Batch: batch})

		stop, done := runningCall(ctx, gd)
		// The replica that takes over missed every lease, and what it holds
		// was written a second before: a failover follows a crash that
		// takes that long to detect, so its scripts read the replication
		// id at once (protocol.ReplicationCheckEvery).
		keys := protocol.KeysFor(gd.Dependency())
		old := time.Now().Add(-time.Second).UnixMilli()
		g.Expect(srv.Promote(ctx, func(p redis.Pipeliner) {
			p.Del(ctx, keys.Leases)
			p.HSet(ctx, keys.State, "replid_at_ms", old)
		})).Error().NotTo(HaveOccurred())
		promoted := time.Now()

		g.Eventually(func() int64 { return liveLeases(t, rdb, gd) }).
			WithTimeout(protocol.HoldEvery+250*time.Millisecond).WithPolling(5*time.Millisecond).
			Should(Equal(int64(1)), "the running call's lease is back")
		wantDecision(t, other.Do(ctx, guard.Job{}, ok), guard.ActionDefer, guard.ErrThrottled)
		time.Sleep(time.Until(promoted.Add(protocol.LearnFor + 100*time.Millisecond)))
		wantDecision(t, other.Do(ctx, guard.Job{}, ok), guard.ActionDefer, guard.ErrThrottled)

		close(stop)
		g.Expect(<-done).To(Succeed())
		g.Eventually(func() error { return other.Do(ctx, guard.Job{}, ok) }).
			WithTimeout(5*time.Second).WithPolling(20*time.Millisecond).Should(Succeed(), "the slot is free once the call ended")
	})
}

// TestHolderTriesAgainSoonAfterAFailedHold: a hold that fails (Redis down,
// failing over, or the client's pool still dialling the old master) is
// tried again after holdRetryEvery, not after a whole HoldEvery: the
// learning second counts from the first script on the new server, and a
// holder that comes back a hold period late may miss it. go-redis's pool
// adds up to a second of its own after a burst of failed dials (it probes
// the server once a second), so every hold period the holder loses after
// that counts. Counted here as failed holds per second while Redis refuses
// connections (the client dials once, at once): 4 every second with
// HoldEvery alone.
func TestHolderTriesAgainSoonAfterAFailedHold(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	srv := redistest.Start(t)
	rdb := srv.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
		o.DialerRetries = 1
		o.PoolSize = 1024 // no dial-error fast path: the holder's own schedule is measured
	})
	publish(t, rdb, defaultPublished(1))
	reg := prometheus.NewRegistry()
	gd := newGuard(t, rdb, guard.Options{Registerer: reg})
	errs := func() float64 { return testutil.ToFloat64(counter(t, reg, "spillway_worker_redis_errors_total")) }

	stop, done := runningCall(ctx, gd)
	srv.Stop()
	before := errs()
	time.Sleep(time.Second)
	failed := errs() - before
	g.Expect(failed).To(BeNumerically(">=", 10), "failed holds in the second Redis refused connections")

	// Redis back without its data (no state: hold puts the lease back).
	g.Expect(srv.Restart()).To(Succeed())
	back := time.Now()
	g.Eventually(func() int64 { return liveLeases(t, rdb, gd) }).
		WithTimeout(protocol.HoldEvery+time.Second).WithPolling(2*time.Millisecond).
		Should(Equal(int64(1)), "the running call's lease is back")
	t.Logf("%v failed holds in the second Redis was down; the lease back %v after Redis answered again",
		failed, time.Since(back).Round(time.Millisecond))
	close(stop)
	g.Expect(<-done).To(Succeed())
}

// TestHolderIsBackAtOnceBehindAClientThatDialsOnceASecond: after as many
// failed dials as its PoolSize, go-redis's pool fails every command at once
// and dials the server only once a second, until a dial succeeds. A holder
// whose holds and refreshes went through the user's client came back up to
// a second after Redis answered again (measured 7-915 ms), and could miss
// the learning second. Here Redis comes back just after one of that pool's
// probes failed, the worst moment: the lease must be back well within the
// second, in both modes.
func TestHolderIsBackAtOnceBehindAClientThatDialsOnceASecond(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		ctx := t.Context()
		srv := redistest.Start(t)
		failed := newFailedDials()
		rdb := srv.Client(func(o *redis.Options) {
			o.ContextTimeoutEnabled = true
			o.MaxRetries = -1
			o.DialerRetries = 1
			o.PoolSize = 2
			o.Dialer = failed.dial
		})
		check := fastClient(srv)
		publish(t, check, defaultPublished(1))
		// No subscription: its reconnections dial too, and the failed dial
		// waited for below must be the pool's probe.
		batch.IgnoreChanges = true
		gd := newGuard(t, rdb, guard.Options{Batch: batch})

		stop, done := runningCall(ctx, gd)
		srv.Stop()
		for range 4 { // more failed dials than the pool's size
			_ = rdb.Ping(ctx).Err()
		}
		failed.next(t)                        // the pool probes once a second
		g.Expect(srv.Restart()).To(Succeed()) // without its data
		back := time.Now()
		g.Eventually(func() int64 { return leasesOrNone(ctx, check, gd) }).
			WithTimeout(2*time.Second).WithPolling(2*time.Millisecond).
			Should(BeNumerically(">=", 1), "the running call's lease is back")
		took := time.Since(back)
		t.Logf("the lease back %v after Redis answered again", took.Round(time.Millisecond))
		g.Expect(took).To(BeNumerically("<", 500*time.Millisecond),
			"the lease is back within half the user's pool's probe period")
		close(stop)
		g.Expect(<-done).To(Succeed())
	})
}

// TestHolderIsBackAtOnceOnACluster: the same on Redis Cluster, where the
// link is a cluster client of its own. The dependency's master restarts
// without its data (keeping its identity and slots) while the user's
// cluster client's pool for it dials once a second; the restarted master
// answers CLUSTERDOWN until it has rejoined, so the lease is timed from
// the first script it runs. (The user's pool has long probed by then:
// unlike the standalone case, this one passes without the link too; it
// keeps the cluster's link working.)
func TestHolderIsBackAtOnceOnACluster(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	cluster := redistest.StartCluster(t, 3)
	failed := newFailedDials()
	rdb := cluster.Client(func(o *redis.ClusterOptions) {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
		o.DialerRetries = 1
		o.PoolSize = 2
		o.Dialer = failed.dial
	})
	check := cluster.Client(func(o *redis.ClusterOptions) { o.ContextTimeoutEnabled = true })
	publish(t, check, defaultPublished(1))
	gd := newGuard(t, rdb, guard.Options{})
	keys := protocol.KeysFor(gd.Dependency())
	master, err := check.MasterForKey(ctx, keys.Leases)
	g.Expect(err).NotTo(HaveOccurred())
	var node *redistest.Server
	for _, n := range cluster.Nodes() {
		if n.Addr() == master.Options().Addr {
			node = n
		}
	}
	g.Expect(node).NotTo(BeNil(), "no node at %s", master.Options().Addr)

	stop, done := runningCall(ctx, gd)
	node.Stop() // shorter than cluster-node-timeout: no failover
	for range 4 {
		_ = rdb.Get(ctx, keys.State).Err()
	}
	failed.next(t)
	g.Expect(node.Restart()).To(Succeed())
	fresh := cluster.Client(func(o *redis.ClusterOptions) { o.ContextTimeoutEnabled = true })
	g.Eventually(func() error { return fresh.Eval(ctx, "return 1", []string{keys.State}).Err() }).
		WithTimeout(10*time.Second).WithPolling(2*time.Millisecond).Should(Succeed(), "the master runs scripts again")
	back := time.Now()
	g.Eventually(func() int64 { return leasesOrNone(ctx, fresh, gd) }).
		WithTimeout(2*time.Second).WithPolling(2*time.Millisecond).
		Should(BeNumerically(">=", 1), "the running call's lease is back")
	took := time.Since(back)
	t.Logf("the lease back %v after the master ran scripts again", took.Round(time.Millisecond))
	g.Expect(took).To(BeNumerically("<", 500*time.Millisecond))
	close(stop)
	g.Expect(<-done).To(Succeed())
}

// failedDials is a dialer that tells of its failed dials.
type failedDials chan struct{}

func newFailedDials() failedDials { return make(failedDials, 1) }

func (f failedDials) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		select {
		case f <- struct{}{}:
		default:
		}
	}
	return c, err
}

// next waits 1.5 s, for a client's pool to probe once a second, then
// returns just after the next failed dial.
func (f failedDials) next(t *testing.T) {
	t.Helper()
	time.Sleep(1500 * time.Millisecond)
	select {
	case <-f:
	default:
	}
	select {
	case <-f:
	case <-time.After(2 * time.Second):
		t.Fatal("no dial failed in 2s while the server was down")
	}
}

// leasesOrNone is liveLeases, or -1 while rdb cannot read them.
func leasesOrNone(ctx context.Context, rdb redis.UniversalClient, gd *guard.Guard) int64 {
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return -1
	}
	n, err := rdb.ZCount(ctx, protocol.KeysFor(gd.Dependency()).Leases,
		"("+strconv.FormatInt(now.UnixMilli(), 10), "+inf").Result()
	if err != nil {
		return -1
	}
	return n
}

// TestHoldCutsACallWhoseLeaseTheFleetLost: a holder that reaches Redis
// after the learning second (its client came back late) finds its lease
// gone, and another call may already hold the slot. Its hold names the
// lease lost, and the call is cancelled with ErrLeaseLost at once, not at
// its next renewal (LeaseTTL/3, 10 s by default): the time over the cap is
// bounded by the holder's return, not by the call's length.
func TestHoldCutsACallWhoseLeaseTheFleetLost(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	srv := redistest.Start(t)
	rdb := fastClient(srv)
	publish(t, rdb, defaultPublished(1))
	gd := newGuard(t, rdb, guard.Options{})

	_, done := runningCall(ctx, gd)
	// Redis lost the lease and learned while this holder could not reach it.
	g.Expect(rdb.Del(ctx, protocol.KeysFor(gd.Dependency()).Leases).Err()).To(Succeed())
	lost := time.Now()
	var err error
	g.Eventually(done).WithTimeout(protocol.HoldEvery+time.Second).Should(Receive(&err), "the call is cut at the next hold")
	g.Expect(err).To(MatchError(guard.ErrLeaseLost))
	t.Logf("the call was cut %v after its lease was lost", time.Since(lost).Round(time.Millisecond))
}

// runningCall starts a call through gd that runs until stop is closed (and
// then succeeds) or the guard cuts it (and then returns the cause), and
// returns once it runs; done receives what Do returned.
func runningCall(ctx context.Context, gd *guard.Guard) (stop chan struct{}, done chan error) {
	running := make(chan struct{})
	stop, done = make(chan struct{}), make(chan error, 1)
	go func() {
		done <- gd.Do(ctx, guard.Job{}, func(ctx context.Context) error {
			close(running)
			select {
			case <-stop:
				return nil
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		})
	}()
	<-running
	return stop, done
}
