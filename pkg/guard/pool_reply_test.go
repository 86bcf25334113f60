package guard

// Pure unit tests of how the pool applies a refresh's reply: the rules that
// keep a late or resent reply from granting, restoring or extending
// anything older than what the pool already knows (Doorman's rule). The
// fleet-level tests are in stalereply_test.go.

import (
	"fmt"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// testPool is a pool with no refresher: the test applies replies itself.
func testPool(t *testing.T, leaseTTL time.Duration) *pool {
	t.Helper()
	opts, err := Options{LeaseTTL: leaseTTL, Batch: BatchOptions{Enabled: true}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	m, err := newMetrics(nil, "ns/dep")
	if err != nil {
		t.Fatal(err)
	}
	g := &Guard{opts: opts, metrics: m}
	p := &pool{g: g, id: "p", every: opts.Batch.Refresh, kick: make(chan struct{}, 1), slots: map[string]*poolSlot{}}
	p.expiry = time.AfterFunc(time.Hour, func() {}) // never expires on its own here
	t.Cleanup(func() { p.expiry.Stop() })
	return p
}

func closedReply(epoch, limit int64, granted ...string) protocol.PoolReply {
	return protocol.PoolReply{Epoch: epoch, State: wire.Closed, Limit: limit, Granted: granted, Now: time.Now()}
}

// A reply that arrives once its request's firstSent + LeaseTTL/2 has passed
// (a resend answered with the first run's reply after a long partition)
// grants nothing: its grants may have expired in Redis and be another
// process's now. No waiting call gets one, no call can take one, and the
// slots it renewed are not trusted either.
func TestApplyDropsGrantsOfAReplyOlderThanHalfTheLeaseTTL(t *testing.T) {
	const ttl = 400 * time.Millisecond
	p := testPool(t, ttl)
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.joinLocked()
	now := time.Now()
	req := &poolRequest{args: protocol.PoolArgs{Want: 1}, firstSent: now.Add(-ttl/2 - time.Millisecond)}
	p.applyLocked(req, closedReply(1, 5, "p:1"), now)
	if w.slot != nil {
		t.Fatal("a waiting call was handed a grant of a reply older than LeaseTTL/2")
	}
	if s, _ := p.takeLocked(now); s != nil && p.modeLocked(now) == modeBatch {
		t.Fatal("a call can take a grant of a reply older than LeaseTTL/2")
	}
	if p.modeLocked(now) == modeBatch {
		t.Fatal("calls are admitted locally on a reply older than LeaseTTL/2")
	}

	// The same reply a moment earlier is good.
	q := testPool(t, ttl)
	q.mu.Lock()
	defer q.mu.Unlock()
	w = q.joinLocked()
	req = &poolRequest{args: protocol.PoolArgs{Want: 1}, firstSent: now.Add(-ttl/2 + 20*time.Millisecond)}
	q.applyLocked(req, closedReply(1, 5, "p:1"), now)
	if w.slot == nil {
		t.Fatal("a fresh grant was not handed to the waiting call")
	}
}

// Local admission checks that the slots may still be live in Redis
// (validUntil), not only that the last answer is fresh (freshUntil): with
// a LeaseTTL below about 2 × (Refresh + RedisTimeout), the answer stays
// fresh after the slots may have expired.
func TestNoLocalAdmissionPastValidUntil(t *testing.T) {
	const ttl = 200 * time.Millisecond // LeaseTTL/2 = 100ms < 40ms + 250ms
	p := testPool(t, ttl)
	p.mu.Lock()
	defer p.mu.Unlock()
	sent := time.Now()
	p.applyLocked(&poolRequest{args: protocol.PoolArgs{Want: 1}, firstSent: sent}, closedReply(1, 5, "p:1"), sent)
	if got := p.modeLocked(sent); got != modeBatch {
		t.Fatalf("mode right after the answer = %v, want batch", got)
	}
	later := sent.Add(ttl/2 + time.Millisecond) // still before freshUntil
	if got := p.modeLocked(later); got == modeBatch {
		t.Fatalf("mode past validUntil (freshUntil %v after sending) = batch: calls start on slots that may have expired",
			p.freshUntil.Sub(sent))
	}
}

// A change the pool learned (a trip, a new epoch, a lower limit) after a
// request was first sent outranks that request's reply: the reply does not
// restore the epoch, the limit or batch mode, hands out none of its
// grants, and the pool refreshes again.
func TestApplyKeepsAChangeLearnedAfterTheRequestWasSent(t *testing.T) {
	for _, c := range []struct {
		name   string
		change protocol.Change
	}{
		{"trip", protocol.Change{Epoch: 2, State: wire.Open, Limit: 0}},
		{"lower limit", protocol.Change{Epoch: 1, State: wire.Closed, Limit: 2}},
		{"new epoch", protocol.Change{Epoch: 2, State: wire.Closed, Limit: 5}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := testPool(t, 30*time.Second)
			sent := time.Now()
			p.mu.Lock()
			p.applyLocked(&poolRequest{args: protocol.PoolArgs{Want: 1}, firstSent: sent}, closedReply(1, 5), sent)
			p.mu.Unlock()
			req := &poolRequest{args: protocol.PoolArgs{Want: 3}, firstSent: time.Now()}
			time.Sleep(time.Millisecond)
			p.change(fmt.Sprintf("%d %s %d", c.change.Epoch, c.change.State, c.change.Limit))
			p.mu.Lock()
			defer p.mu.Unlock()
			select { // drain
			case <-p.kick:
			default:
			}
			w := p.joinLocked()
			now := time.Now()
			p.applyLocked(req, closedReply(1, 5, "p:1", "p:2", "p:3"), now)
			if w.slot != nil {
				t.Error("a waiting call was handed a grant of a reply older than the change")
			}
			if p.modeLocked(now) == modeBatch && c.change.State != wire.Closed {
				t.Error("the reply restored batch mode over the change")
			}
			if c.change.Epoch == 2 && p.modeLocked(now) == modeBatch {
				t.Error("the reply restored the old epoch's batch mode")
			}
			if p.limit > c.change.Limit && c.change.Limit < 5 {
				t.Errorf("limit = %d after the reply, want the learned %d", p.limit, c.change.Limit)
			}
			if p.epoch < c.change.Epoch {
				t.Errorf("epoch = %d after the reply, want the learned %d", p.epoch, c.change.Epoch)
			}
			select {
			case <-p.kick:
			default:
				t.Error("no refresh was asked for after a reply the pool could not use")
			}
		})
	}
}
