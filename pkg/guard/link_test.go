package guard

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// The link's client is the user's, but for its pool: same address,
// credentials and timeouts (a "none" included, which go-redis turned into 0
// when it initialised the user's options), two connections, one dial per
// attempt.
func TestLinkKeepsTheUsersOptions(t *testing.T) {
	dep := protocol.Dependency{Namespace: "ns", Name: "api"}
	user := redis.NewClient(&redis.Options{
		Addr: "127.0.0.1:1", Username: "worker", Password: "secret", DB: 3,
		ContextTimeoutEnabled: true, ReadTimeout: -1, WriteTimeout: 2 * time.Second,
		MaxRetries: 5, MinRetryBackoff: -1, PoolSize: 64, MinIdleConns: 8,
	})
	defer user.Close()
	l := newLink(user, dep, nil)
	if l.build == nil || l.reach == nil {
		t.Fatal("no own client for a *redis.Client")
	}
	c := l.build().(*redis.Client)
	defer c.Close()
	got, want := c.Options(), user.Options()
	if got.Addr != want.Addr || got.Username != want.Username || got.Password != want.Password || got.DB != want.DB ||
		!got.ContextTimeoutEnabled || got.ReadTimeout != want.ReadTimeout || got.WriteTimeout != want.WriteTimeout ||
		got.MinRetryBackoff != want.MinRetryBackoff || got.MaxRetryBackoff != want.MaxRetryBackoff {
		t.Errorf("link options %+v differ from the user's %+v", got, want)
	}
	if got.PoolSize != linkPoolSize || got.MinIdleConns != 0 || got.DialerRetries != 1 || got.MaxRetries != want.MaxRetries {
		t.Errorf("link pool: size %d, min idle %d, dialer retries %d, max retries %d; want %d, 0, 1, 5",
			got.PoolSize, got.MinIdleConns, got.DialerRetries, got.MaxRetries, linkPoolSize)
	}
	if user.Options().PoolSize != 64 || user.Options().MaxRetries != 5 {
		t.Errorf("the user's options changed: %+v", user.Options())
	}

	cluster := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: []string{"127.0.0.1:1"}, Password: "secret", ContextTimeoutEnabled: true,
		ReadTimeout: -1, MaxRedirects: -1, PoolSize: 64,
	})
	defer cluster.Close()
	l = newLink(cluster, dep, nil)
	cc := l.build().(*redis.ClusterClient)
	defer cc.Close()
	gotC, wantC := cc.Options(), cluster.Options()
	if gotC.Password != wantC.Password || gotC.ReadTimeout != wantC.ReadTimeout || gotC.MaxRedirects != wantC.MaxRedirects ||
		len(gotC.Addrs) != 1 || gotC.PoolSize != linkPoolSize || gotC.DialerRetries != 1 {
		t.Errorf("link cluster options %+v, user's %+v", gotC, wantC)
	}
	if cluster.Options().PoolSize != 64 {
		t.Errorf("the user's cluster options changed: %+v", cluster.Options())
	}

	if l := newLink(redis.NewRing(&redis.RingOptions{}), dep, nil); l.build != nil {
		t.Error("a Ring must be shared, not rebuilt")
	}
}
