package protocol_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The package shares one standalone server and one 3-master cluster between
// its tests and benchmarks. Each is started on first use, so a run that needs
// only one of them does not pay for the other, and stopped by TestMain. Tests
// stay independent because each uses its own dependency, hence its own keys.
var (
	standaloneOnce sync.Once
	standaloneSrv  *redistest.Server
	standaloneRDB  *redis.Client
	standaloneErr  error

	clusterOnce sync.Once
	clusterSrv  *redistest.Cluster
	clusterRDB  *redis.ClusterClient
	clusterErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if standaloneSrv != nil {
		standaloneSrv.Close()
	}
	if clusterSrv != nil {
		clusterSrv.Close()
	}
	os.Exit(code)
}

// sharedStandalone is the package's standalone server, started on first use.
func sharedStandalone(tb testing.TB) (*redistest.Server, *redis.Client) {
	tb.Helper()
	standaloneOnce.Do(func() {
		standaloneSrv, standaloneErr = redistest.StartServer()
		if standaloneErr == nil {
			standaloneRDB = standaloneSrv.Client(func(o *redis.Options) { o.PoolSize = 80 })
		}
	})
	if standaloneErr != nil {
		tb.Fatalf("start redis-server (run hack/setup-redis.sh): %v", standaloneErr)
	}
	return standaloneSrv, standaloneRDB
}

// sharedCluster is the package's 3-master cluster, started on first use.
func sharedCluster(tb testing.TB) (*redistest.Cluster, *redis.ClusterClient) {
	tb.Helper()
	clusterOnce.Do(func() {
		clusterSrv, clusterErr = redistest.NewCluster(3)
		if clusterErr == nil {
			clusterRDB = clusterSrv.Client(func(o *redis.ClusterOptions) { o.PoolSize = 80 })
		}
	})
	if clusterErr != nil {
		tb.Fatalf("start redis cluster (run hack/setup-redis.sh): %v", clusterErr)
	}
	return clusterSrv, clusterRDB
}

// forEachTopology runs fn as two parallel subtests, "standalone" and
// "cluster", each with a client of that topology.
func forEachTopology(t *testing.T, fn func(t *testing.T, rdb redis.UniversalClient)) {
	t.Helper()
	t.Run("standalone", func(t *testing.T) {
		t.Parallel()
		_, rdb := sharedStandalone(t)
		fn(t, rdb)
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		_, rdb := sharedCluster(t)
		fn(t, rdb)
	})
}

var depSeq atomic.Int64

// newDep returns a dependency no other test uses, named after the test.
func newDep(t testing.TB) protocol.Dependency {
	var b strings.Builder
	dash := false
	for _, r := range strings.ToLower(t.Name()) {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
			dash = false
		} else if !dash && b.Len() > 0 {
			b.WriteByte('-')
			dash = true
		}
	}
	name := strings.Trim(b.String(), "-")
	if len(name) > 200 {
		name = name[:200]
	}
	return protocol.Dependency{Namespace: "test", Name: fmt.Sprintf("%s-%d", name, depSeq.Add(1))}
}

// newClient returns a protocol client for a fresh dependency.
func newClient(t testing.TB, rdb redis.UniversalClient) *protocol.Client {
	t.Helper()
	c, err := protocol.NewClient(rdb, newDep(t))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	return c
}

// policy is a Closed policy with the seed parameters and the given limit.
func policy(limit int64) protocol.Published {
	return protocol.Published{
		State:    wire.Closed,
		Limit:    limit,
		Capacity: max(limit, 1),
		Epoch:    1,
		Backoff:  retry.Backoff{Base: 100 * time.Millisecond, Max: 10 * time.Second, Jitter: retry.JitterFull},
		Budget:   retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute},

		BreakerWindow: 30 * time.Second,
	}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func mustPublish(t testing.TB, c *protocol.Client, p protocol.Published) time.Time {
	t.Helper()
	at, err := c.Publish(ctxT(t), p)
	if err != nil {
		t.Fatalf("Publish(%+v): %v", p, err)
	}
	return at
}

var leaseSeq atomic.Int64

func leaseID() string { return fmt.Sprintf("lease-%d", leaseSeq.Add(1)) }

func mustAcquire(t testing.TB, c *protocol.Client, ttl time.Duration) protocol.Admission {
	t.Helper()
	a, err := c.Acquire(ctxT(t), protocol.AcquireArgs{LeaseID: leaseID(), TTL: ttl})
	if err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	return a
}

// mustAdmit acquires a lease and fails the test unless it is admitted.
func mustAdmit(t testing.TB, c *protocol.Client, ttl time.Duration) protocol.Admission {
	t.Helper()
	a := mustAcquire(t, c, ttl)
	if a.Code != protocol.Admitted {
		t.Fatalf("Acquire = %v (%+v), want admitted", a.Code, a)
	}
	return a
}

func mustRelease(t testing.TB, c *protocol.Client, a protocol.Admission, o protocol.Outcome, attempt int) bool {
	t.Helper()
	held, err := c.Release(ctxT(t), a.Member, a.Epoch, o, attempt)
	if err != nil {
		t.Fatalf("Release: %v", err)
	}
	return held
}

func mustWindow(t testing.TB, c *protocol.Client, length time.Duration, from time.Time) (protocol.Window, protocol.Probes) {
	t.Helper()
	w, p, _, err := c.ReadWindow(ctxT(t), length, from)
	if err != nil {
		t.Fatalf("ReadWindow: %v", err)
	}
	return w, p
}

// redisNow is the server's clock (every node of the test cluster runs on this
// machine, so any node's TIME will do).
func redisNow(t testing.TB, rdb redis.UniversalClient) time.Time {
	t.Helper()
	now, err := rdb.Time(ctxT(t)).Result()
	if err != nil {
		t.Fatalf("TIME: %v", err)
	}
	return now
}

// within fails the test unless got is in [lo, hi].
func within(t testing.TB, what string, got, lo, hi time.Duration) {
	t.Helper()
	if got < lo || got > hi {
		t.Errorf("%s = %v, want within [%v, %v]", what, got, lo, hi)
	}
}
