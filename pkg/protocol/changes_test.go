package protocol_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestPublishAnnouncesChanges: a subscriber of the changes channel receives
// "<epoch> <state> <limit>" when a publication changes the epoch, the state
// or the limit, and nothing when it changes other fields only; on a
// standalone server and across the nodes of a Redis Cluster.
func TestPublishAnnouncesChanges(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		sub := c.SubscribeChanges(ctx)
		defer sub.Close()
		if _, err := sub.Receive(ctx); err != nil { // the subscription's confirmation
			t.Fatalf("subscribe: %v", err)
		}
		msgs := sub.Channel()
		next := func() protocol.Change {
			t.Helper()
			select {
			case m := <-msgs:
				ch, err := protocol.ParseChange(m.Payload)
				if err != nil {
					t.Fatal(err)
				}
				return ch
			case <-time.After(2 * time.Second):
				t.Fatal("no change announced within 2 s")
			}
			return protocol.Change{}
		}
		p := policy(10)
		mustPublish(t, c, p)
		if got := next(); got != (protocol.Change{Epoch: 1, State: wire.Closed, Limit: 10}) {
			t.Errorf("first publication announced %+v", got)
		}
		p.Backoff.Base = time.Second // not announced
		mustPublish(t, c, p)
		p.Limit = 4
		mustPublish(t, c, p)
		if got := next(); got != (protocol.Change{Epoch: 1, State: wire.Closed, Limit: 4}) {
			t.Errorf("after a backoff change and a lower limit: %+v, want the limit's announcement only", got)
		}
		p.State, p.Epoch, p.Limit = wire.Open, 2, 0
		mustPublish(t, c, p)
		if got := next(); got != (protocol.Change{Epoch: 2, State: wire.Open, Limit: 0}) {
			t.Errorf("Open announced %+v", got)
		}
		p.Epoch = 3 // a new epoch alone
		mustPublish(t, c, p)
		if got := next(); got.Epoch != 3 {
			t.Errorf("new epoch announced %+v", got)
		}
		// A refused publication announces nothing.
		p.Epoch, p.State, p.Limit = 1, wire.Closed, 10
		if _, err := c.Publish(ctx, p); err == nil {
			t.Fatal("a stale epoch was published")
		}
		select {
		case m := <-msgs:
			t.Errorf("a refused publication announced %q", m.Payload)
		case <-time.After(100 * time.Millisecond):
		}
	})
}

func TestParseChange(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want protocol.Change
		ok   bool
	}{
		{"7 Ramping 25", protocol.Change{Epoch: 7, State: wire.Ramping, Limit: 25}, true},
		{"0 Open 0", protocol.Change{State: wire.Open}, true},
		{"7 Ramping", protocol.Change{}, false},
		{"x Closed 1", protocol.Change{}, false},
		{"1 Closed y", protocol.Change{}, false},
		{"", protocol.Change{}, false},
	} {
		got, err := protocol.ParseChange(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseChange(%q) = %+v, %v; want %+v, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// TestChangesReachEveryClusterNode: on a Redis Cluster, a subscriber
// connected to any node, not only the master of the dependency's slot,
// receives the announcement.
func TestChangesReachEveryClusterNode(t *testing.T) {
	t.Parallel()
	cluster, rdb := sharedCluster(t)
	c := newClient(t, rdb)
	ctx := ctxT(t)
	var subs []*redis.PubSub
	for _, n := range cluster.Nodes() {
		sub := n.Client().Subscribe(ctx, c.Keys().Changes)
		defer sub.Close()
		if _, err := sub.Receive(ctx); err != nil {
			t.Fatalf("subscribe on %s: %v", n.Addr(), err)
		}
		subs = append(subs, sub)
	}
	mustPublish(t, c, policy(3))
	for i, sub := range subs {
		select {
		case m := <-sub.Channel():
			if m.Payload != "1 Closed 3" {
				t.Errorf("node %d received %q, want \"1 Closed 3\"", i, m.Payload)
			}
		case <-time.After(2 * time.Second):
			t.Errorf("node %d received no announcement within 2 s", i)
		}
	}
}
