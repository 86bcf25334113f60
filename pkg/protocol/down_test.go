package protocol_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// TestRedisDown: with Redis stopped, or hung (accepting connections and never
// answering), an acquisition with a 50 ms context fails promptly instead of
// blocking the call path, given ContextTimeoutEnabled and MaxRetries -1. After
// Redis comes back, the same client works again.
func TestRedisDown(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
	})
	c := newClient(t, rdb)
	mustPublish(t, c, policy(10))
	mustRelease(t, c, mustAdmit(t, c, time.Minute), protocol.Success, 1) // scripts loaded, a pooled connection

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	acquireFails(t, c, "paused")
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}

	srv.Stop()
	acquireFails(t, c, "stopped")

	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	// The restarted server is empty: the state is gone and scripts must be
	// loaded again (EVALSHA gets NOSCRIPT, go-redis falls back to EVAL).
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := c.Publish(ctxT(t), policy(10))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Publish after restart: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mustAdmit(t, c, time.Minute)
}

// TestRedisDownCluster is TestRedisDown with the master that owns the
// dependency's slot paused, then stopped, in a dedicated 3-master cluster.
func TestRedisDownCluster(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3)
	rdb := cl.Client(func(o *redis.ClusterOptions) {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
	})
	c := newClient(t, rdb)
	mustPublish(t, c, policy(10))
	mustRelease(t, c, mustAdmit(t, c, time.Minute), protocol.Success, 1)
	owner := cl.Nodes()[keySlot(c.Keys().State)*len(cl.Nodes())/16384]

	if err := owner.Pause(); err != nil {
		t.Fatal(err)
	}
	acquireFails(t, c, "owner paused")
	if err := owner.Resume(); err != nil {
		t.Fatal(err)
	}
	owner.Stop()
	acquireFails(t, c, "owner stopped")
}

// acquireFails checks that three acquisitions with a 50 ms budget each fail,
// and in well under a second (generous for a loaded machine; the typical time
// is about the budget).
func acquireFails(t *testing.T, c *protocol.Client, what string) {
	t.Helper()
	const budget, bound = 50 * time.Millisecond, time.Second
	for i := range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), budget)
		start := time.Now()
		_, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Second})
		took := time.Since(start)
		cancel()
		if err == nil {
			t.Fatalf("%s, attempt %d: Acquire succeeded", what, i)
		}
		t.Logf("%s, attempt %d: failed after %v: %v", what, i, took, err)
		if took > bound {
			t.Errorf("%s, attempt %d: Acquire took %v to fail, want < %v", what, i, took, bound)
		}
	}
}
