package protocol_test

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

var requestSeq atomic.Int64

// testPool is one process's pool as a test drives it: its id and the
// members it holds.
type testPool struct {
	c    *protocol.Client
	id   string
	held []string
}

func newPool(c *protocol.Client, id string) *testPool {
	return &testPool{c: c, id: id}
}

// refresh sends one pool call with a new request id: it holds what the pool
// holds, returns ret, wants want; the granted members join held, the lost
// and returned ones leave it.
func (p *testPool) refresh(t testing.TB, want int64, ret []string, mod ...func(*protocol.PoolArgs)) protocol.PoolReply {
	t.Helper()
	a := protocol.PoolArgs{
		PoolID:    p.id,
		RequestID: fmt.Sprint(requestSeq.Add(1)),
		TTL:       10 * time.Second,
		Held:      without(p.held, ret),
		Return:    ret,
		Want:      want,
	}
	for _, m := range mod {
		m(&a)
	}
	r, err := p.c.Pool(ctxT(t), a)
	if err != nil {
		t.Fatalf("Pool(%s): %v", p.id, err)
	}
	p.held = append(without(a.Held, r.Lost), r.Granted...)
	return r
}

// giveBack returns n of the pool's members (the last ones) in a refresh.
func (p *testPool) giveBack(t testing.TB, n int64, want int64) protocol.PoolReply {
	t.Helper()
	n = min(n, int64(len(p.held)))
	return p.refresh(t, want, append([]string(nil), p.held[int64(len(p.held))-n:]...))
}

func without(from, drop []string) []string {
	gone := map[string]bool{}
	for _, m := range drop {
		gone[m] = true
	}
	var out []string
	for _, m := range from {
		if !gone[m] {
			out = append(out, m)
		}
	}
	return out
}

func TestPoolGrantsUpToTheLimit(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		p := policy(10)
		p.Epoch = 4
		mustPublish(t, c, p)
		a := newPool(c, "a")
		r := a.refresh(t, 6, nil)
		if len(r.Granted) != 6 || r.Epoch != 4 || r.State != wire.Closed || r.Limit != 10 || r.Excess != 0 || r.Stale {
			t.Fatalf("first refresh = %+v, want 6 granted, epoch 4, Closed, limit 10", r)
		}
		for _, m := range r.Granted {
			if !strings.HasPrefix(m, "a:") {
				t.Errorf("member %q is not named after the pool", m)
			}
		}
		if n := liveLeases(t, rdb, c); n != 6 {
			t.Errorf("live leases = %d, want 6", n)
		}
		// Per-call acquisitions count the pool's members and vice versa.
		mustAdmit(t, c, 10*time.Second)
		r = a.refresh(t, 20, nil)
		if len(r.Granted) != 3 || len(a.held) != 9 {
			t.Fatalf("refresh wanting 20 = %d granted (%d held), want 3 (9): the limit less the per-call lease", len(r.Granted), len(a.held))
		}
		if got := mustAcquire(t, c, time.Second); got.Code != protocol.RefusedThrottled {
			t.Errorf("per-call acquire with the pool holding the rest = %v, want throttled", got.Code)
		}
		// Returned members stop counting at once.
		r = a.giveBack(t, 4, 5)
		if n := liveLeases(t, rdb, c); n != 6 {
			t.Errorf("live leases after returning 4 = %d, want 6", n)
		}
		if len(r.Granted) != 0 || len(a.held) != 5 {
			t.Errorf("after returning 4 wanting 5: %d granted, %d held, want 0 and 5", len(r.Granted), len(a.held))
		}
	})
}
