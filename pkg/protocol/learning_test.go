package protocol_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// promote gives the server a new replication id with its data kept, as a
// failover's promoted replica gets one. A failover follows a crash that
// takes a second or more to detect: it first waits out
// ReplicationCheckEvery, so that nothing the scripts recorded is more recent.
func promote(t *testing.T, srv *redistest.Server) {
	t.Helper()
	time.Sleep(protocol.ReplicationCheckEvery + 50*time.Millisecond)
	if _, err := srv.Promote(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

func replID(t *testing.T, rdb *redis.Client) string {
	t.Helper()
	id, err := redistest.ReplicationID(ctxT(t), rdb)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestFailoverLearnsBeforeAdmitting: after a failover to a replica that
// missed a lease (the promotion gives it a new replication id; the lease is
// removed as the replica never received it), the first admission is refused
// for LearnFor while the holder puts its lease back with hold, and after the
// second the cap counts it: nothing is admitted into the slot it holds.
// Without learning the lost lease's slot is admitted at once.
func TestFailoverLearnsBeforeAdmitting(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	c := newClient(t, rdb)
	mustPublish(t, c, policy(2))
	a := mustAdmit(t, c, 30*time.Second)
	b := mustAdmit(t, c, 30*time.Second)
	// The state recorded the server's replication id at the first admission.
	if got := rdb.HGet(ctxT(t), c.Keys().State, "replid").Val(); got != replID(t, rdb) {
		t.Fatalf("state replid = %q, want the server's %q", got, replID(t, rdb))
	}

	promote(t, srv)
	rdb.ZRem(ctxT(t), c.Keys().Leases, b.Member) // the write the replica missed

	x := mustAcquire(t, c, 30*time.Second)
	if x.Code != protocol.RefusedThrottled || x.Wait <= 0 || x.Wait > protocol.LearnFor {
		t.Fatalf("the first acquisition after the failover = %v (%+v), want refused while learning, for at most %v", x.Code, x, protocol.LearnFor)
	}
	if p := mustRead(t, c); p.LearningUntil.IsZero() {
		t.Error("the state does not say until when the dependency learns")
	}
	h, err := c.Hold(ctxT(t), []string{a.Member, b.Member}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if h.Learning <= 0 || h.NoState || h.PutBack != 1 {
		t.Fatalf("Hold = %+v, want learning, one lease put back", h)
	}
	time.Sleep(protocol.LearnFor + 50*time.Millisecond)
	if x := mustAcquire(t, c, 30*time.Second); x.Code != protocol.RefusedThrottled || x.Held != 2 {
		t.Fatalf("after learning, acquisition = %v (%+v), want throttled with the 2 leases held", x.Code, x)
	}
	// Outside learning hold writes nothing, and a lease the fleet stopped
	// counting is not put back.
	rdb.ZRem(ctxT(t), c.Keys().Leases, b.Member)
	if h, err := c.Hold(ctxT(t), []string{a.Member, b.Member}, 30*time.Second); err != nil || h.Learning != 0 || h.NoState || h.PutBack != 0 ||
		len(h.Lost) != 1 || h.Lost[0] != b.Member {
		t.Fatalf("Hold outside learning = %+v, %v; want nothing put back, and %s named lost (the fleet no longer counts it)", h, err, b.Member)
	}
	if ok, err := c.Renew(ctxT(t), b.Member, 30*time.Second); err != nil || ok {
		t.Fatalf("Renew of a missing lease outside learning = %v, %v; want lost", ok, err)
	}
	mustAdmit(t, c, 30*time.Second)
}

// TestRenewPutsBackWhileLearning: a per-call permit's renewal, the first
// script on the new server, finds the failover out itself and puts its
// lease back.
func TestRenewPutsBackWhileLearning(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	c := newClient(t, rdb)
	mustPublish(t, c, policy(1))
	a := mustAdmit(t, c, 30*time.Second)
	promote(t, srv)
	rdb.ZRem(ctxT(t), c.Keys().Leases, a.Member)
	if ok, err := c.Renew(ctxT(t), a.Member, 30*time.Second); err != nil || !ok {
		t.Fatalf("Renew of a lease the failover lost = %v, %v; want renewed", ok, err)
	}
	time.Sleep(protocol.LearnFor + 50*time.Millisecond)
	if x := mustAcquire(t, c, 30*time.Second); x.Code != protocol.RefusedThrottled || x.Held != 1 {
		t.Fatalf("after learning, acquisition = %v (%+v), want throttled with the lease held", x.Code, x)
	}
}

// TestRestartWithoutDataLearns: Redis restarted without its data holds no
// state: hold puts the holders' leases back (nobody admits without a state),
// and the manager's publication over the state it had published (Restored)
// starts learning, so the first admissions wait for the holders.
func TestRestartWithoutDataLearns(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(func(o *redis.Options) { o.MaxRetries = 5 })
	c := newClient(t, rdb)
	mustPublish(t, c, policy(2))
	a := mustAdmit(t, c, 30*time.Second)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	h, err := c.Hold(ctxT(t), []string{a.Member}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !h.NoState || h.PutBack != 1 {
		t.Fatalf("Hold with no state = %+v, want the lease put back", h)
	}
	p := policy(2)
	p.Restored = true
	mustPublish(t, c, p)
	if x := mustAcquire(t, c, 30*time.Second); x.Code != protocol.RefusedThrottled || x.Wait <= 0 {
		t.Fatalf("the first acquisition after a restored publication = %v (%+v), want refused while learning", x.Code, x)
	}
	time.Sleep(protocol.LearnFor + 50*time.Millisecond)
	mustAdmit(t, c, 30*time.Second)
	if x := mustAcquire(t, c, 30*time.Second); x.Code != protocol.RefusedThrottled || x.Held != 2 {
		t.Fatalf("acquisition = %v (%+v), want throttled: the put-back lease and the new one", x.Code, x)
	}

	// A publication over a state that is there does not learn, Restored or
	// not: Redis lost nothing.
	p.Epoch = 2
	mustPublish(t, c, p)
	if got := mustRead(t, c).LearningUntil; time.Until(got) > 0 {
		t.Errorf("learning until %v after publishing over a stored state", got)
	}
}

// TestPoolPutsBackWhileLearning: a batching pool's refresh after a failover
// puts back the members it holds that Redis lost, and grants nothing new
// until learning ends.
func TestPoolPutsBackWhileLearning(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	c := newClient(t, rdb)
	mustPublish(t, c, policy(4))
	r, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: "r1", TTL: 30 * time.Second, Want: 2})
	if err != nil || len(r.Granted) != 2 {
		t.Fatalf("Pool = %+v, %v; want 2 granted", r, err)
	}
	promote(t, srv)
	rdb.ZRem(ctxT(t), c.Keys().Leases, r.Granted[0], r.Granted[1])
	r2, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: "r2", TTL: 30 * time.Second, Want: 4, Held: r.Granted})
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.Lost) != 0 || len(r2.Granted) != 0 {
		t.Fatalf("refresh while learning = lost %v, granted %v; want both members kept, nothing granted", r2.Lost, r2.Granted)
	}
	if n := rdb.ZCount(ctxT(t), c.Keys().Leases, "("+strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Val(); n != 2 {
		t.Fatalf("%d live leases after the refresh, want the 2 put back", n)
	}
	time.Sleep(protocol.LearnFor + 50*time.Millisecond)
	r3, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: "r3", TTL: 30 * time.Second, Want: 4, Held: r.Granted})
	if err != nil || len(r3.Granted) != 2 {
		t.Fatalf("refresh after learning = %+v, %v; want the 2 free slots granted", r3, err)
	}
}

// TestReleasedLeaseStaysReleasedWhileLearning: a holder's hold (or a
// renewal) sent before its call ended can reach Redis after that call's
// release, on another connection. While the dependency learns, or with no
// state stored, hold puts back a missing lease, and would put the released
// one back: its slot stays taken, by nobody, until the lease's TTL passes.
// The release is remembered instead, and neither hold nor renew brings the
// lease back: after learning the slot is free. Each case is a failover in
// which the lease survived (released after the promotion, before anyone
// read the new replication id), one that lost it, and a restart without
// data.
func TestReleasedLeaseStaysReleasedWhileLearning(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		lose func(t *testing.T, srv *redistest.Server, rdb *redis.Client, c *protocol.Client, member string)
	}{
		{"failover, lease kept", func(t *testing.T, srv *redistest.Server, _ *redis.Client, _ *protocol.Client, _ string) {
			promote(t, srv)
		}},
		{"failover, lease lost", func(t *testing.T, srv *redistest.Server, rdb *redis.Client, c *protocol.Client, member string) {
			promote(t, srv)
			rdb.ZRem(ctxT(t), c.Keys().Leases, member)
		}},
		{"restart without data", func(t *testing.T, srv *redistest.Server, _ *redis.Client, _ *protocol.Client, _ string) {
			if err := srv.Restart(); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			rdb := srv.Client(func(o *redis.Options) { o.MaxRetries = 5 })
			c := newClient(t, rdb)
			mustPublish(t, c, policy(1))
			a := mustAdmit(t, c, 30*time.Second)
			tc.lose(t, srv, rdb, c, a.Member)

			if _, err := c.Release(ctxT(t), a.Member, 0, protocol.Success, 1); err != nil {
				t.Fatal(err)
			}
			h, err := c.Hold(ctxT(t), []string{a.Member}, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if h.PutBack != 0 {
				t.Errorf("a hold that arrived after the release put the lease back: %+v", h)
			}
			if ok, err := c.Renew(ctxT(t), a.Member, 30*time.Second); err != nil || ok {
				t.Errorf("a renewal that arrived after the release = %v, %v; want lost", ok, err)
			}
			if n := rdb.ZCard(ctxT(t), c.Keys().Leases).Val(); n > 1 {
				t.Errorf("%d leases stored, want at most the encoding member", n)
			}
			if h.NoState {
				p := policy(1)
				p.Restored = true
				mustPublish(t, c, p)
			}
			time.Sleep(protocol.LearnFor + 50*time.Millisecond)
			mustAdmit(t, c, 30*time.Second)
		})
	}
}
