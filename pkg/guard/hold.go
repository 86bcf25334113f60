package guard

import (
	"context"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// holder puts back the leases of the guard's per-call Permits that Redis
// lost (docs/protocol.md §4 "Learning"): restarted without its data, or
// failed over to a replica that missed the last writes. While at least one
// per-call Permit runs, every protocol.HoldEvery (holdRetryEvery after a
// failed one) it sends hold.lua the leases whose TTL has not passed by the
// local clock; the script writes nothing unless the dependency learns or
// Redis holds no state, and otherwise names the leases the fleet no longer
// counts, whose calls the holder cuts (a holder back after the learning
// second). Renewals come only every LeaseTTL/3, too late for the second
// during which Redis admits nothing new. Batch mode's slots are the pool's,
// put back by its refresh.
type holder struct {
	g *Guard

	mu      sync.Mutex
	permits map[*Permit]struct{}
	running bool
}

// add counts p as held, and starts the loop if it is not running.
func (h *holder) add(p *Permit) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.permits == nil {
		h.permits = map[*Permit]struct{}{}
	}
	h.permits[p] = struct{}{}
	if !h.running {
		h.running = true
		go h.loop()
	}
}

// remove stops counting p. p.mu must not be held.
func (h *holder) remove(p *Permit) {
	h.mu.Lock()
	delete(h.permits, p)
	h.mu.Unlock()
}

// holdRetryEvery is how soon the holder tries again after a hold failed.
// The learning second counts from the first script on the new server: a
// holder that waited a whole HoldEvery after it could reach the server
// again may miss it. After a failed hold, holds go on the guard's link
// (link.go), which dials at each try, not on go-redis's schedule.
const holdRetryEvery = 50 * time.Millisecond

// loop runs while Permits are held: every protocol.HoldEvery, and
// holdRetryEvery after a hold that failed.
func (h *holder) loop() {
	t := time.NewTimer(protocol.HoldEvery)
	defer t.Stop()
	for range t.C {
		held, ok := h.live()
		if !ok {
			return
		}
		next := protocol.HoldEvery
		if len(held) > 0 {
			members := make([]string, len(held))
			for i, p := range held {
				members[i] = p.member
			}
			ctx, cancel := context.WithTimeout(context.Background(), h.g.opts.RedisTimeout)
			res, err := onLink(ctx, h.g.link, func(c *protocol.Client) (protocol.Held, error) {
				return c.Hold(ctx, members, h.g.opts.LeaseTTL)
			})
			cancel()
			if err != nil {
				// A Permit whose TTL passes meanwhile is lost by its own
				// renewal.
				h.g.metrics.redisErrors.Inc()
				next = holdRetryEvery
			}
			h.cut(held, res.Lost)
		}
		t.Reset(next)
	}
}

// cut stops the calls of the held Permits whose leases hold named lost:
// their holder came back after the learning second, and another call may
// hold their slots. A Permit done meanwhile released its lease itself.
func (h *holder) cut(held []*Permit, lost []string) {
	if len(lost) == 0 {
		return
	}
	gone := make(map[string]struct{}, len(lost))
	for _, m := range lost {
		gone[m] = struct{}{}
	}
	for _, p := range held {
		if _, ok := gone[p.member]; !ok {
			continue
		}
		p.mu.Lock()
		if !p.done {
			p.lost()
		}
		p.mu.Unlock()
	}
}

// live returns the held Permits whose leases' TTL has not passed by the
// local clock, at most protocol.MaxPoolMembers of them; false when none is
// held, and then the loop stops. Each Permit's lock is taken after h.mu is
// released: a renewal holds it for a round trip, and admissions and Done
// (add, remove) must not wait behind that.
func (h *holder) live() ([]*Permit, bool) {
	h.mu.Lock()
	if len(h.permits) == 0 {
		h.running = false
		h.mu.Unlock()
		return nil, false
	}
	held := make([]*Permit, 0, min(len(h.permits), protocol.MaxPoolMembers))
	for p := range h.permits {
		if len(held) == protocol.MaxPoolMembers {
			break
		}
		held = append(held, p)
	}
	h.mu.Unlock()
	now := time.Now()
	live := held[:0]
	for _, p := range held {
		p.mu.Lock()
		if !p.done && now.Before(p.expires) {
			live = append(live, p)
		}
		p.mu.Unlock()
	}
	return live, true
}
