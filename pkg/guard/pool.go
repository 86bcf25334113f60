package guard

// Batch mode's local pool of fleet slots (Options.Batch): how a call takes a
// slot and gives it back with no round trip, waits for one, or is refused.
// refresh.go keeps the pool in step with the fleet.

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// poolMode is how calls are admitted, from the pool's last answer.
type poolMode int

const (
	// modeUnknown: no fresh answer (none yet, the last one too old, or a
	// change was announced since): calls wait for the next refresh.
	modeUnknown poolMode = iota
	// modeBatch: Closed or Ramping: calls take local slots.
	modeBatch
	// modeOpen: the breaker is Open (not stale): calls are refused
	// locally, as acquire would refuse them.
	modeOpen
	// modePerCall: HalfOpen, the dead-man rule, a rate limit too low to
	// batch, no policy, or a closed guard: calls take the per-call path.
	modePerCall
)

// poolSlot is one fleet slot the pool holds: a member of the leases set.
type poolSlot struct {
	member string
	busy   bool // a call holds it, or it was handed to a waiting call
	dead   bool // lost, past its lease by the local clock, or retired
	// drain: a lower limit arrived while its call ran: the slot goes back
	// when the call ends, and starts no other call (drainLocked).
	drain  bool
	permit *Permit // the call holding it, once its Permit is bound
}

// waiter is a call waiting for a slot, or for the next refresh.
type waiter struct {
	ready chan struct{} // buffered: a slot was handed over or a refresh ended
	slot  *poolSlot     // set when a slot is handed over
	gone  bool          // the call stopped waiting
}

// pool is a Guard's local pool of fleet slots. Its lock guards everything
// below mu; the refresher (refresh.go) is the only goroutine that talks to
// Redis for it.
type pool struct {
	g         *Guard
	id        string
	every     time.Duration // Options.Batch.Refresh
	lead      time.Duration // how long a leased rate token lives at least
	subscribe bool

	kick    chan struct{} // buffered: refresh now
	stop    chan struct{} // closed by close
	flushed chan struct{} // closed once Close's last report went out
	done    chan struct{} // closed when the refresher exits
	expiry  *time.Timer   // fires at validUntil

	mu    sync.Mutex
	mode  poolMode
	epoch int64
	limit int64
	// openUntil is when an Open breaker lets probes through, local time.
	openUntil time.Time
	// freshUntil is when the last answer becomes too old to admit calls
	// on: a refresh sent after it would have answered by then.
	freshUntil time.Time
	// validUntil is when the held slots may have expired in Redis, by the
	// local clock: LeaseTTL/2 after the last answered request was first
	// sent (pool.lua keeps every held member live at least that long).
	validUntil time.Time
	// learnedAt is when the change channel last told the pool of a change
	// (a new epoch, a state that does not batch, a lower limit): a reply to
	// a request first sent before it does not undo it.
	learnedAt time.Time
	lastErr   error     // the last refresh's error; nil once one succeeds
	failedAt  time.Time // when it failed
	// slotsCapped and tokensCapped say that the last refresh got fewer
	// slots or tokens than it asked for: asking again before the next
	// interval would spin on Redis.
	slotsCapped, tokensCapped bool
	lastWant, lastTokens      int64

	slots    map[string]*poolSlot // every slot held, idle or busy
	free     []*poolSlot          // idle slots
	inUse    int64                // calls running on live pool slots (not on dead ones)
	surplus  int64                // busy slots to give back when their calls end
	removed  int64                // slots that left since the pending request was built
	toReturn []string
	waiters  []*waiter
	waiting  int64 // waiters not gone
	tokens   tokenStock
	report   protocol.Report
	demand   demand
	pending  *poolRequest // built, not yet answered
	// started and completed count refreshes: a call that asked for a
	// refresh waits for the one after those started before it.
	started, completed uint64
	dormant            bool // the refresher waits for a kick, not a tick
	closed             bool
}

func newPool(g *Guard) *pool {
	p := &pool{
		g:         g,
		id:        protocol.NewLeaseID(),
		every:     g.opts.Batch.Refresh,
		lead:      g.opts.Batch.Refresh + 5*time.Millisecond,
		subscribe: !g.opts.Batch.IgnoreChanges,
		kick:      make(chan struct{}, 1),
		stop:      make(chan struct{}),
		flushed:   make(chan struct{}),
		done:      make(chan struct{}),
		slots:     map[string]*poolSlot{},
	}
	p.expiry = time.AfterFunc(time.Hour, p.expire)
	p.expiry.Stop()
	go p.run()
	return p
}

// modeLocked is how a call is admitted now.
func (p *pool) modeLocked(now time.Time) poolMode {
	switch {
	case p.closed:
		return modePerCall
	case !now.Before(p.freshUntil):
		return modeUnknown
	case p.mode == modeBatch && !now.Before(p.validUntil):
		// The slots may have expired in Redis (a LeaseTTL below about
		// 2 × (Refresh + RedisTimeout) leaves the answer fresh longer):
		// the expiry timer drops them, and no call starts on them before.
		return modeUnknown
	}
	return p.mode
}

// contends reports whether the pool takes slots in batch mode: it is then a
// contender of the fleet's fair split by its id.
func (p *pool) contends() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode == modeBatch && !p.closed
}

// failedRecently: the last refresh failed less than a refresh interval ago;
// calls fail now instead of asking Redis again.
func (p *pool) failedRecently(now time.Time) bool {
	return p.lastErr != nil && now.Sub(p.failedAt) < p.every
}

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
	pm.slot, pm.pool, pm.limit = s, p, p.limit
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

// gaugesLocked updates the batch gauges.
func (p *pool) gaugesLocked() {
	m := p.g.metrics
	m.batchSlots.Set(float64(len(p.slots)))
	local := 0.0
	if p.mode == modeBatch && !p.closed {
		local = 1
	}
	m.batchLocal.Set(local)
}

// batching reports whether a state lets pools hold slots.
func batching(s wire.State) bool { return s == wire.Closed || s == wire.Ramping }
