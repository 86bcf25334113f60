package protocol_test

import (
	"errors"
	"testing"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// CheckNoEviction refuses a Redis that evicts keys, on a single server and
// on every Cluster master, and accepts one that does not.
func TestCheckNoEviction(t *testing.T) {
	t.Run("noeviction", func(t *testing.T) {
		rdb := redistest.Start(t).Client()
		if err := protocol.CheckNoEviction(ctxT(t), rdb); err != nil {
			t.Fatalf("CheckNoEviction = %v on a Redis that keeps every key", err)
		}
	})
	t.Run("allkeys-lru", func(t *testing.T) {
		rdb := redistest.Start(t, redistest.WithArgs("--maxmemory-policy", "allkeys-lru")).Client()
		err := protocol.CheckNoEviction(ctxT(t), rdb)
		var ee *protocol.EvictionError
		if !errors.As(err, &ee) || ee.Policy != "allkeys-lru" || !errors.Is(err, protocol.ErrEvictionPolicy) {
			t.Fatalf("CheckNoEviction = %v, want an EvictionError naming allkeys-lru", err)
		}
		t.Log(err)
	})
	t.Run("cluster, one master volatile-lru", func(t *testing.T) {
		c := redistest.StartCluster(t, 3)
		rdb := c.Client()
		if err := protocol.CheckNoEviction(ctxT(t), rdb); err != nil {
			t.Fatalf("CheckNoEviction = %v on a Cluster that keeps every key", err)
		}
		node := c.Nodes()[1].Client()
		if err := node.ConfigSet(ctxT(t), "maxmemory-policy", "volatile-lru").Err(); err != nil {
			t.Fatal(err)
		}
		err := protocol.CheckNoEviction(ctxT(t), rdb)
		var ee *protocol.EvictionError
		if !errors.As(err, &ee) || ee.Policy != "volatile-lru" {
			t.Fatalf("CheckNoEviction = %v, want an EvictionError naming the evicting master", err)
		}
	})
}
