package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/proctest"
)

const (
	// DefaultMasters is the number of masters of a cluster when none is given.
	DefaultMasters = 3
	// clusterSlots is the number of hash slots of every Redis Cluster.
	clusterSlots = 16384
	// clusterTimeout bounds how long the nodes may take to agree on the cluster.
	clusterTimeout = 30 * time.Second
)

// Cluster is a Redis Cluster of masters without replicas, each a [Server]
// in cluster mode on its own loopback port. Its methods are safe for
// concurrent use.
type Cluster struct {
	nodes []*Server

	mu      sync.Mutex
	clients []*redis.ClusterClient
	closed  bool
}

// NewCluster starts masters redis-server processes ([DefaultMasters] if
// masters <= 0), joins them with CLUSTER MEET, splits the hash slots evenly
// between them with CLUSTER ADDSLOTSRANGE, and waits until every node reports
// cluster_state:ok with all slots served. The caller must call Close.
func NewCluster(masters int, opts ...Option) (*Cluster, error) {
	if masters <= 0 {
		masters = DefaultMasters
	}
	nodeOpts := append([]Option{func(c *config) { c.cluster = true }}, opts...)
	c := &Cluster{}
	for i := range masters {
		s, err := StartServer(nodeOpts...)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("start cluster node %d: %w", i, err)
		}
		c.nodes = append(c.nodes, s)
	}
	if err := c.form(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// StartCluster is [NewCluster] for tests: it fails tb if the cluster cannot
// be formed, and stops every node and closes the clients when the test ends.
// If the test failed, the end of each node's log is added to the test output.
func StartCluster(tb testing.TB, masters int, opts ...Option) *Cluster {
	tb.Helper()
	c, err := NewCluster(masters, opts...)
	if err != nil {
		tb.Fatalf("redistest: %v", withHint(err))
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			for _, n := range c.nodes {
				tb.Logf("redistest: last lines of the log of cluster node %s:\n%s", n.Addr(), proctest.Tail(n.logPath, 30))
			}
		}
		if err := c.Close(); err != nil {
			tb.Errorf("redistest: %v", err)
		}
	})
	return c
}

// Addrs returns the "127.0.0.1:port" addresses of the nodes.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// Nodes returns the nodes, in slot order: node i serves the i-th range of
// slots. Stop, Pause and Restart on a node simulate a failing shard; a
// restarted node keeps its cluster identity and slots, but not its data.
func (c *Cluster) Nodes() []*Server {
	return append([]*Server(nil), c.nodes...)
}

// Client returns a new go-redis cluster client seeded with every node's
// address, closed by Close. Each modify function may adjust the options first.
func (c *Cluster) Client(modify ...func(*redis.ClusterOptions)) *redis.ClusterClient {
	opts := &redis.ClusterOptions{Addrs: c.Addrs()}
	for _, m := range modify {
		m(opts)
	}
	client := redis.NewClusterClient(opts)
	c.mu.Lock()
	c.clients = append(c.clients, client)
	c.mu.Unlock()
	return client
}

// Close closes the clients made by Client and closes every node. It is safe
// to call more than once.
func (c *Cluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	for _, client := range c.clients {
		client.Close() // fails only if the caller closed it already
	}
	c.clients = nil
	var errs []error
	for _, n := range c.nodes {
		errs = append(errs, n.Close())
	}
	return errors.Join(errs...)
}

// form joins the nodes into one cluster and waits until all of them agree
// that every slot is served.
func (c *Cluster) form() error {
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()

	admins := make([]*redis.Client, len(c.nodes))
	for i, n := range c.nodes {
		admins[i] = redis.NewClient(&redis.Options{Addr: n.Addr()})
		defer admins[i].Close()
	}

	// Meeting one node is enough: gossip introduces the others to each other.
	for _, n := range c.nodes[1:] {
		host, port, err := net.SplitHostPort(n.Addr())
		if err != nil {
			return fmt.Errorf("cluster meet: %w", err)
		}
		if err := admins[0].ClusterMeet(ctx, host, port).Err(); err != nil {
			return fmt.Errorf("cluster meet %s: %w", n.Addr(), err)
		}
	}
	for i, a := range admins {
		first, last := i*clusterSlots/len(admins), (i+1)*clusterSlots/len(admins)-1
		if err := a.ClusterAddSlotsRange(ctx, first, last).Err(); err != nil {
			return fmt.Errorf("cluster addslotsrange %d %d on %s: %w", first, last, c.nodes[i].Addr(), err)
		}
	}

	for {
		err := clusterReady(ctx, admins)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not ready within %v: %w", clusterTimeout, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// clusterReady reports why the cluster is not ready yet, or nil once every
// node knows every other node and sees all slots served.
func clusterReady(ctx context.Context, admins []*redis.Client) error {
	for _, a := range admins {
		info, err := a.ClusterInfo(ctx).Result()
		if err != nil {
			return fmt.Errorf("cluster info on %s: %w", a.Options().Addr, err)
		}
		state, slotsOK, known := infoField(info, "cluster_state"), infoField(info, "cluster_slots_ok"), infoField(info, "cluster_known_nodes")
		if state != "ok" || slotsOK != strconv.Itoa(clusterSlots) || known != strconv.Itoa(len(admins)) {
			return fmt.Errorf("node %s has cluster_state:%s cluster_slots_ok:%s cluster_known_nodes:%s",
				a.Options().Addr, state, slotsOK, known)
		}
	}
	return nil
}
