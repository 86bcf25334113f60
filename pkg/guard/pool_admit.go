package guard

// Batch mode's admission: a call's way to a slot of the local pool (pool.go)
// with no round trip, its wait for one, or its refusal. pool_release.go
// is the way back.

import (
	"context"
	"errors"
	"time"

	"github.com/spillway-dev/spillway/pkg/retry"
)

// admit admits a call on a local slot. perCall is true when the call must
// take the per-call path instead; then permit and err are nil.
func (p *pool) admit(ctx context.Context, job Job, bounded bool) (permit *Permit, perCall bool, err error) {
	g := p.g
	start := time.Now()
	pm := &Permit{g: g, job: job, parent: ctx}
	pm.ctx, pm.cancel = context.WithCancelCause(WithAttempt(ctx, job.attempt()))
	var w *waiter
	var refreshed uint64 // the refresh a call that does not wait for slots waits for
	waitCtx, stopWait := ctx, context.CancelFunc(func() {})
	defer func() { stopWait() }()

	p.mu.Lock()
	p.demand.touch()
	if p.dormant {
		p.dormant = false
		p.kickLocked()
	}
	// time.Now is read as seldom as it can be: on a virtual machine's
	// clock source (kvm-clock) a reading costs 70-100 ns, a third of a
	// call on a local slot when read five times.
	for now := start; ; now = time.Now() {
		if w != nil && w.slot != nil {
			s := w.slot
			w = nil
			if !s.dead {
				p.bindLocked(pm, s)
				p.mu.Unlock()
				return pm.admit(start, now, bounded), false, nil
			}
			p.putLocked(s, "", 0, 0) // lost while handed over: wait on
		}
		mode := p.modeLocked(now)
		var refusal *Error
		switch mode {
		case modePerCall:
			p.leaveLocked(w)
			p.mu.Unlock()
			pm.cancel(nil)
			return nil, true, nil
		case modeOpen:
			p.leaveLocked(w)
			refusal = &Error{Action: ActionDefer, Reason: ErrOpen, After: g.jitterUp(max(p.openUntil.Sub(now), g.opts.ThrottleDelay))}
			p.mu.Unlock()
			pm.cancel(nil)
			g.count(refusal)
			return nil, false, refusal
		case modeBatch:
			s, rate := p.takeLocked(now)
			if s != nil {
				p.leaveLocked(w)
				p.bindLocked(pm, s)
				p.mu.Unlock()
				return pm.admit(start, now, bounded), false, nil
			}
			refusal = p.refusalLocked(rate)
		case modeUnknown:
			if p.failedRecently(now) {
				p.leaveLocked(w)
				cause := p.lastErr
				p.mu.Unlock()
				pm.cancel(nil)
				permit, err := g.unavailable(ctx, job, cause)
				return permit, false, err
			}
		}
		if w == nil {
			w = p.joinLocked()
		}
		asked := p.askLocked(mode)
		if !g.opts.WaitForSlot {
			// A call that does not wait for slots waits for one refresh
			// that knows of it, if one is due; else it is refused now.
			switch {
			case refreshed == 0 && (asked || mode == modeUnknown):
				refreshed = p.started + 1
			case refreshed == 0 && p.started > p.completed:
				// A refresh under way may bring the slot (it asked for
				// the calls it knew of, this one's peers).
				refreshed = p.started
			case refreshed == 0 || p.completed >= refreshed:
				p.leaveLocked(w)
				cause := p.lastErr
				p.mu.Unlock()
				pm.cancel(nil)
				if refusal == nil { // the refresh it waited for failed
					permit, err := g.unavailable(ctx, job, cause)
					return permit, false, err
				}
				p.refused(refusal)
				return nil, false, refusal
			}
		} else if waitCtx == ctx {
			waitCtx, stopWait = g.waitContext(ctx)
		}
		p.mu.Unlock()
		select {
		case <-w.ready:
			p.mu.Lock()
			continue
		case <-waitCtx.Done():
		}
		p.mu.Lock()
		if w.slot != nil && ctx.Err() == nil {
			continue // handed a slot as the wait ended: take it
		}
		p.leaveLocked(w)
		p.mu.Unlock()
		pm.cancel(nil)
		switch {
		case callerEnded(ctx) && (refusal == nil || errors.Is(ctx.Err(), context.Canceled)):
			return nil, false, callerErr(ctx)
		case refusal == nil:
			refusal = &Error{Action: ActionDefer, Reason: ErrRedisUnavailable, After: g.jitterUp(g.opts.DeferDelay),
				Cause: errors.New("no refresh of the pool answered within MaxWait")}
		}
		p.refused(refusal)
		return nil, false, refusal
	}
}

// refused counts a refusal of batch mode's own: the caller waited it out or
// did not wait.
func (p *pool) refused(e *Error) {
	p.g.count(e)
	p.mu.Lock()
	p.demand.refuse(errors.Is(e, ErrRateLimited))
	p.mu.Unlock()
}

// refusalLocked is the refusal of a call that found no idle slot (rate
// false) or a slot but no rate token (rate true).
func (p *pool) refusalLocked(rate bool) *Error {
	g := p.g
	if rate {
		return &Error{Action: ActionDefer, Reason: ErrRateLimited, After: g.jitterUp(p.every)}
	}
	d := g.opts.ThrottleDelay
	return &Error{Action: ActionDefer, Reason: ErrThrottled, After: d/2 + retry.FullJitter(d/2, g.rnd)}
}

// takeLocked takes an idle slot and, under a rate limit, a rate token: the
// slot is checked first, as acquire does, so that a call throttled by slots
// leaves the token for the next one. rate says which one was missing.
func (p *pool) takeLocked(now time.Time) (s *poolSlot, rate bool) {
	if len(p.free) == 0 {
		return nil, false
	}
	if p.tokens.limited {
		if !p.tokens.take(now) {
			return nil, true
		}
		p.demand.start()
	}
	s = p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	s.busy = true
	p.inUse++
	p.demand.observe(p.inUse + p.waiting)
	return s, false
}

// bindLocked ties a taken slot and the call's Permit.
func (p *pool) bindLocked(pm *Permit, s *poolSlot) {
	s.permit = pm
	pm.slot, pm.pool, pm.limit, pm.startBy = s, p, p.limit, p.validUntil
}

// joinLocked queues a waiting call.
func (p *pool) joinLocked() *waiter {
	w := &waiter{ready: make(chan struct{}, 1)}
	p.waiters = append(p.waiters, w)
	p.waiting++
	p.demand.observe(p.inUse + p.waiting)
	return w
}

// leaveLocked takes w (nil: none) out of the queue; a slot handed to it
// meanwhile goes to the next call.
func (p *pool) leaveLocked(w *waiter) {
	if w == nil {
		return
	}
	if !w.gone {
		w.gone = true
		p.waiting--
	}
	if s := w.slot; s != nil {
		w.slot = nil
		p.putLocked(s, "", 0, 0)
	}
}

// askLocked kicks a refresh when the pool would ask for more than its last
// request did, and that request got all it asked for: asking again for what
// the fleet just refused would spin on Redis. It reports whether a refresh
// will know of the calls waiting now.
func (p *pool) askLocked(mode poolMode) bool {
	more := false
	switch mode {
	case modeUnknown:
		more = true
	case modeBatch:
		more = (!p.slotsCapped && p.inUse+p.waiting+p.demand.refused > p.lastWant) ||
			(p.tokens.limited && !p.tokensCapped && p.waiting > 0 && p.demand.starts+p.waiting > p.lastTokens)
	}
	if more {
		p.kickLocked()
	}
	return more
}

func (p *pool) kickLocked() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// serveLocked hands idle slots (and rate tokens) to the waiting calls, the
// longest waiting first.
func (p *pool) serveLocked(now time.Time) {
	if !now.Before(p.validUntil) {
		return // the slots may have expired: the expiry timer drops them
	}
	for p.waiting > 0 && len(p.free) > 0 {
		w := p.waiters[0]
		if w.gone || w.slot != nil {
			p.waiters = p.waiters[1:]
			continue
		}
		s, _ := p.takeLocked(now)
		if s == nil {
			return // no rate token: the next refresh brings some
		}
		p.waiters = p.waiters[1:]
		p.waiting-- // handed over: it leaves the queue
		w.gone = true
		w.slot = s
		// ready holds one wake-up at most: a refresh's may already be in
		// it, and the call finds its slot either way. A blocking send here
		// would wait, holding the pool's lock, for a call that needs it.
		select {
		case w.ready <- struct{}{}:
		default:
		}
	}
	if p.waiting == 0 {
		p.waiters = p.waiters[:0]
	}
}

// wakeLocked tells every waiting call that a refresh ended.
func (p *pool) wakeLocked() {
	for _, w := range p.waiters {
		if !w.gone {
			select {
			case w.ready <- struct{}{}:
			default:
			}
		}
	}
}
