package redistest_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
)

func ctxTimeout(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestServerSetGet(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client()
	ctx := ctxTimeout(t, 5*time.Second)

	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("ping: %v", err)
	}
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("set: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("get k = %q, %v; want \"v\", nil", got, err)
	}
}

func TestStopFailsFastAndRestartKeepsAddress(t *testing.T) {
	s := redistest.Start(t)
	addr := s.Addr()
	c := s.Client()
	ctx := ctxTimeout(t, 30*time.Second)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("set: %v", err)
	}

	s.Stop()
	start := time.Now()
	if err := c.Ping(ctx).Err(); err == nil {
		t.Fatal("ping after Stop succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("ping after Stop took %v to fail; want it to fail fast", d)
	}

	if err := s.Restart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if s.Addr() != addr {
		t.Fatalf("address after Restart = %s; want %s", s.Addr(), addr)
	}
	// A new client connects at once; the old one may wait out go-redis's
	// dial back-off after the failures above.
	if err := s.Client().Ping(ctx).Err(); err != nil {
		t.Fatalf("ping after Restart: %v", err)
	}
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("ping with the old client after Restart: %v", err)
	}
	if n, err := c.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Fatalf("exists k after Restart = %d, %v; want 0 (empty data), nil", n, err)
	}
}

func TestPauseBlocksAndResumeRestores(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(func(o *redis.Options) { o.ContextTimeoutEnabled = true })
	if err := c.Ping(ctxTimeout(t, 5*time.Second)).Err(); err != nil {
		t.Fatalf("ping: %v", err)
	}

	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := c.Ping(ctxTimeout(t, 50*time.Millisecond)).Err(); err == nil {
		t.Fatal("ping on a paused server succeeded")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("ping on a paused server took %v to fail; want about 50ms", d)
	}

	if err := s.Resume(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(ctxTimeout(t, 5*time.Second)).Err(); err != nil {
		t.Fatalf("ping after Resume: %v", err)
	}
}

func TestParallelStartsGetDifferentPorts(t *testing.T) {
	var servers [2]*redistest.Server
	var wg sync.WaitGroup
	for i := range servers {
		wg.Go(func() { servers[i] = redistest.Start(t) })
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	if a, b := servers[0].Addr(), servers[1].Addr(); a == b {
		t.Fatalf("both servers have the address %s", a)
	}
	for _, s := range servers {
		if err := s.Client().Ping(ctxTimeout(t, 5*time.Second)).Err(); err != nil {
			t.Fatalf("ping %s: %v", s.Addr(), err)
		}
	}
}

func TestCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	if got := len(cl.Addrs()); got != 3 {
		t.Fatalf("cluster has %d nodes; want 3", got)
	}
	c := cl.Client()
	ctx := ctxTimeout(t, 30*time.Second)

	// Keys spread over many slots, hence over all three masters.
	for i := range 30 {
		key := "key-" + string(rune('a'+i))
		if err := c.Set(ctx, key, i, 0).Err(); err != nil {
			t.Fatalf("set %s: %v", key, err)
		}
	}
	var mu sync.Mutex
	owners := map[string]bool{}
	err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		n, err := m.DBSize(ctx).Result()
		mu.Lock()
		defer mu.Unlock()
		owners[m.Options().Addr] = n > 0
		return err
	})
	if err != nil {
		t.Fatalf("dbsize on masters: %v", err)
	}
	for addr, hasKeys := range owners {
		if !hasKeys {
			t.Errorf("master %s got none of the keys", addr)
		}
	}
	if len(owners) != 3 {
		t.Errorf("cluster client sees %d masters; want 3", len(owners))
	}

	// Keys with the same hash tag share a slot, so one script may touch both.
	const script = `redis.call("SET", KEYS[1], ARGV[1]); redis.call("SET", KEYS[2], ARGV[2]); return redis.call("MGET", KEYS[1], KEYS[2])`
	got, err := c.Eval(ctx, script, []string{"{dep}:a", "{dep}:b"}, "1", "2").StringSlice()
	if err != nil {
		t.Fatalf("eval on {dep}:a {dep}:b: %v", err)
	}
	if len(got) != 2 || got[0] != "1" || got[1] != "2" {
		t.Fatalf("eval returned %q; want [1 2]", got)
	}
}

func TestSentinelFailover(t *testing.T) {
	s := redistest.StartSentinel(t)
	c := s.Client(func(o *redis.FailoverOptions) { o.ContextTimeoutEnabled = true })
	ctx := ctxTimeout(t, 30*time.Second)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("set: %v", err)
	}
	// WAIT makes the write reach the replica before the master dies.
	if n, err := c.Wait(ctx, 1, 5000).Result(); err != nil || n != 1 {
		t.Fatalf("wait for the replica = %d, %v; want 1, nil", n, err)
	}

	old, err := s.KillMaster(ctx)
	if err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	addr, err := s.WaitFailover(ctx, old.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("sentinels promoted %s %v after the master %s was killed", addr, time.Since(killed).Round(time.Millisecond), old.Addr())
	if addr != s.Servers()[1].Addr() {
		t.Fatalf("new master %s; want the replica %s", addr, s.Servers()[1].Addr())
	}
	// The failover client finds the new master and its replicated data.
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("get k after failover = %q, %v; want \"v\", nil", got, err)
	}
	if err := c.Set(ctx, "k2", "v2", 0).Err(); err != nil {
		t.Fatalf("set after failover: %v", err)
	}
}
