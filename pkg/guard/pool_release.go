package guard

// Batch mode's way back: a call gives its slot back to the local pool
// (pool.go), or the pool lets slots go (a lower limit, a slot lost, past
// its lease or its call's lifetime). pool_admit.go is the way in.

import (
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// put gives back the slot of a call that ended with outcome (empty: the
// call never ran), counting the outcome in the next report.
func (p *pool) put(s *poolSlot, o protocol.Outcome, attempt int, took time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.putLocked(s, o, attempt, took)
}

func (p *pool) putLocked(s *poolSlot, o protocol.Outcome, attempt int, took time.Duration) {
	s.busy, s.permit = false, nil
	if s.dead {
		// The fleet stopped counting it: release would count nothing.
		// Its call left inUse when the slot died.
		return
	}
	p.inUse--
	if o != "" {
		p.report.Add(o, attempt, took)
	}
	switch {
	case s.drain || p.surplus > 0 || p.closed || p.mode == modeOpen || p.mode == modePerCall:
		p.surplus = max(0, p.surplus-1)
		p.giveBackLocked(s)
		if p.closed && p.inUse == 0 {
			p.kickLocked() // the last report goes out now
		}
	default:
		p.free = append(p.free, s)
		if p.waiting > 0 {
			p.serveLocked(time.Now())
		}
	}
}

// drainLocked gives back every slot the pool holds, idle ones now and busy
// ones as their calls end, because the limit went down. A held slot is
// already a lease, so Redis would not stop it from starting a call while
// the fleet is over the new limit; a slot granted afresh is granted only
// while the fleet's leases are below it, as per-call acquire admits. So no
// call starts on this process's slots under the lower limit while the
// fleet runs as many calls as that limit or more, in batch mode as per call
// (TestCapHoldsAcrossProcesses); the cost is one refresh of refilling.
func (p *pool) drainLocked() {
	for len(p.free) > 0 {
		p.giveBackLocked(p.free[len(p.free)-1])
	}
	for _, s := range p.slots {
		s.drain = true
	}
}

// giveBackLocked takes s out of the pool and queues it to be returned.
func (p *pool) giveBackLocked(s *poolSlot) {
	if p.dropLocked(s) {
		p.toReturn = append(p.toReturn, s.member)
	}
}

// dropLocked takes s out of the pool: it is no longer renewed. false if it
// already was.
func (p *pool) dropLocked(s *poolSlot) bool {
	if _, ok := p.slots[s.member]; !ok {
		return false
	}
	delete(p.slots, s.member)
	p.removed++
	if !s.busy {
		for i := len(p.free) - 1; i >= 0; i-- {
			if p.free[i] == s {
				p.free = append(p.free[:i], p.free[i+1:]...)
				break
			}
		}
	}
	return true
}

// killLocked takes s out of the pool because its lease is gone or may be:
// the call on it, if any, is cancelled with ErrLeaseLost. giveBack queues
// it to be returned all the same (it may still count in Redis).
func (p *pool) killLocked(s *poolSlot, giveBack bool) {
	if giveBack {
		p.giveBackLocked(s)
	} else {
		p.dropLocked(s)
	}
	p.dieLocked(s)
	if s.permit != nil {
		s.permit.lost()
	}
}

// dieLocked marks s dead. A call on it no longer counts as the pool's
// demand: it is cancelled or cut, and no new slot is taken for it.
func (p *pool) dieLocked(s *poolSlot) {
	if !s.dead && s.busy {
		p.inUse--
	}
	s.dead = true
}

// retire takes the slot of a Permit past MaxCallLifetime out of the pool
// without returning it: the call may still run, so its lease expires with
// its TTL, as a per-call lease that stops renewing does. It does nothing
// once the slot is no longer pm's (its call ended and gave it back). The
// caller holds pm.mu (lock order: a Permit's, then the pool's).
func (p *pool) retire(s *poolSlot, pm *Permit) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.permit != pm {
		return
	}
	p.dropLocked(s)
	p.dieLocked(s)
}

// expire drops every slot once they may have expired in Redis, by the local
// clock, with no refresh answered since: the calls on them are cancelled.
func (p *pool) expire() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Now().Before(p.validUntil) {
		return // a refresh answered meanwhile
	}
	p.expireLocked()
}

// expireLocked drops every slot: they may have expired in Redis.
func (p *pool) expireLocked() {
	p.free, p.surplus = p.free[:0], 0
	for _, s := range p.slots {
		p.killLocked(s, true)
	}
	p.tokens.clear()
	p.freshUntil = time.Time{}
	p.gaugesLocked()
}
