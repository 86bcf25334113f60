package guard

// Batch mode's refresher: the one goroutine per Guard that keeps its pool of
// fleet slots in step with the fleet, one pool round trip at a time
// (docs/protocol.md §4 pool), and listens for the controller's change
// announcements.

import (
	"context"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// closeDrain bounds how long Close waits for the pool's last report and
// the return of its idle slots.
const closeDrain = time.Second

// poolRequest is a refresh built and not yet answered. One whose reply was
// not read is sent again as it is, under the same request id: pool.lua
// answers a resend with the first run's reply, so the slots it granted are
// never lost to a dropped reply (they would hold slots that no call uses
// for a lease TTL) and its report counts once.
type poolRequest struct {
	args protocol.PoolArgs
	// firstSent is when it was first sent: Redis ran it, if at all, after
	// that, so every member it kept lives at least LeaseTTL/2 from then.
	firstSent time.Time
	sends     int
	// demand is the slots the process could use when it was built, before
	// the limit, the state or maxBatch capped what it asks for: when it
	// asks for less, asking again before the next interval gets no more.
	demand int64
}

// run is the refresher: it refreshes every interval while the pool is in
// use, at once when a call asks for more or a change is announced, and
// sleeps while the process does not call the dependency.
func (p *pool) run() {
	defer close(p.done)
	var changes <-chan *redis.Message
	if p.subscribe {
		ps := p.g.proto.SubscribeChanges(context.Background())
		defer func() { _ = ps.Close() }()
		changes = ps.Channel()
	}
	tick := time.NewTimer(p.every)
	defer tick.Stop()
	for {
		p.mu.Lock()
		idle := p.idleLocked()
		p.dormant = idle
		p.mu.Unlock()
		var tickC <-chan time.Time
		if !idle {
			tick.Reset(p.every)
			tickC = tick.C
		}
		select {
		case <-p.stop:
			p.final()
			return
		case now := <-tickC:
			p.g.reg.maybe(now)
		case <-p.kick:
		case m, ok := <-changes:
			if !ok {
				changes = nil
				continue
			}
			p.change(m.Payload)
		}
		p.refresh(time.Time{})
	}
}

// idleLocked: nothing to renew, return, report or ask for.
func (p *pool) idleLocked() bool {
	return len(p.slots) == 0 && p.inUse == 0 && p.waiting == 0 && p.report.IsZero() &&
		len(p.toReturn) == 0 && p.pending == nil && p.demand.idle()
}

// change acts on a change announcement at once, before the refresh that
// follows it: a new epoch or a state that does not batch (Open, HalfOpen)
// stops calls from starting on local slots until that refresh says what
// to do, and a limit below the slots held gives back the idle ones above
// it. A lost announcement is caught by the next refresh, within the
// refresh interval.
func (p *pool) change(payload string) {
	c, err := protocol.ParseChange(payload)
	if err != nil {
		return // the refresh that follows reads the state itself
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if c.Epoch < p.epoch {
		return // older than what the pool knows
	}
	learned := false
	if c.Epoch != p.epoch || !batching(c.State) {
		p.freshUntil = time.Time{}
		p.epoch = c.Epoch
		learned = true
	}
	if c.Limit < p.limit {
		p.drainLocked()
		p.limit = c.Limit
		learned = true
	}
	if learned {
		// A reply to a request sent before now may predate the change: it
		// must not undo it (applyLocked).
		p.learnedAt = time.Now()
	}
	p.gaugesLocked()
}

// refresh sends the pending request, or builds one, and applies the answer.
// by, when set, bounds the round trips (Close's drain).
func (p *pool) refresh(by time.Time) {
	g := p.g
	p.mu.Lock()
	if p.pending == nil {
		p.pending = p.buildLocked()
	}
	req := p.pending
	p.started++
	p.mu.Unlock()

	var reply protocol.PoolReply
	var err error
	var recv time.Time
	for retried := false; ; retried = true {
		timeout := g.opts.RedisTimeout
		if !by.IsZero() {
			timeout = min(timeout, time.Until(by))
		}
		sent := time.Now()
		sentC := g.clock.now()
		if req.sends == 0 {
			req.firstSent = sent
		}
		req.sends++
		req.args.Deadline, _ = g.clock.deadline(sentC, timeout)
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		reply, err = onLink(ctx, g.link, func(c *protocol.Client) (protocol.PoolReply, error) {
			return c.Pool(ctx, req.args)
		})
		cancel()
		recv = time.Now()
		switch {
		case errors.Is(err, protocol.ErrLate):
			// Redis's clock is ahead of the estimate: nothing was written,
			// and no run of this request will write anything.
			g.clock.reset(sentC, reply.Now)
			if !retried {
				continue
			}
		case err == nil && req.sends == 1:
			// A resend may be answered with a stored reply, whose time is
			// older than the send: it says nothing of the offset.
			g.clock.observe(sentC, reply.Now)
		}
		break
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case err == nil:
		p.pending = nil
		p.applyLocked(req, reply, recv)
	case errors.Is(err, protocol.ErrNoPolicy) || errors.Is(err, protocol.ErrVersion):
		// Redis answered: it took back the members returned and wrote
		// nothing else (sending them again changes nothing). Calls go per
		// call, where acquire refuses them with the same reason, and the
		// idle slots go back with the next request.
		p.unbuildLocked(req)
		p.lastErr = nil
		p.mode = modePerCall
		p.freshUntil = recv.Add(p.every)
		for len(p.free) > 0 {
			p.giveBackLocked(p.free[len(p.free)-1])
		}
	case errors.Is(err, protocol.ErrLate):
		p.unbuildLocked(req)
		p.failLocked(err, recv)
	default:
		// It may have run: it is sent again as it is.
		p.failLocked(err, recv)
	}
	p.completed++
	p.wakeLocked()
	p.gaugesLocked()
}

func (p *pool) failLocked(err error, now time.Time) {
	p.lastErr, p.failedAt = err, now
	p.g.metrics.redisErrors.Inc()
}

// unbuildLocked puts back what a request that wrote nothing carried: its
// report and the members it returned go out with the next one.
func (p *pool) unbuildLocked(req *poolRequest) {
	p.pending = nil
	p.report.Merge(req.args.Report)
	p.toReturn = append(append([]string(nil), req.args.Return...), p.toReturn...)
}

// buildLocked builds the next request from the pool's state: what to renew
// (every slot held), what to give back (the slots queued, and idle slots
// above the process's demand), what to ask for and the report.
func (p *pool) buildLocked() *poolRequest {
	g := p.g
	want, tokens := p.demand.roll(p.inUse + p.waiting)
	tokens += p.waiting
	demand := want
	want = min(want, maxBatch)
	switch {
	case p.closed:
		want, tokens = min(want, p.inUse), 0
	case p.mode == modeOpen || p.mode == modePerCall:
		want, tokens = 0, 0
	case p.mode == modeBatch:
		want = min(want, p.limit)
	}
	for int64(len(p.slots)) > want && len(p.free) > 0 {
		p.giveBackLocked(p.free[len(p.free)-1])
	}
	held := make([]string, 0, len(p.slots))
	for m := range p.slots {
		held = append(held, m)
	}
	n := min(len(p.toReturn), protocol.MaxPoolMembers-len(held))
	ret := p.toReturn[:n:n]
	p.toReturn = append([]string(nil), p.toReturn[n:]...)
	req := &poolRequest{args: protocol.PoolArgs{
		PoolID:    p.id,
		RequestID: protocol.NewLeaseID(),
		TTL:       g.opts.LeaseTTL,
		Held:      held,
		Return:    ret,
		Want:      want,
		Tokens:    tokens,
		TokenLead: p.lead,
		Report:    p.report,
	}, demand: demand}
	p.report = protocol.Report{}
	p.lastWant, p.lastTokens = want, tokens
	p.removed = 0
	return req
}

// applyLocked applies a refresh's answer. Times in it are Redis's: they are
// read against when the request was first sent (Redis ran it after that)
// and when the answer arrived (Redis ran it before that).
//
// A reply never grants, restores or extends anything older than what the
// pool already knows (Doorman's rule). A resend is answered with the first
// run's reply (pool.lua), which may be old by now:
//   - once req.firstSent + LeaseTTL/2 has passed, every member the run
//     granted or renewed may have expired in Redis and be another process's
//     now: the reply is dead. Its grants go back unused, the slots held are
//     dropped as the expiry timer would drop them (their calls cancelled
//     with ErrLeaseLost), and the pool refreshes again;
//   - when the pool learned a change (a new epoch, a state that does not
//     batch, a lower limit) through the change channel after the request
//     was first sent, the reply may predate it: its epoch, limit, state and
//     rate tokens are not taken, its grants go back unused, and the pool
//     refreshes again at once. Its renewals and lost members still hold:
//     the run renewed after firstSent whatever it answered.
func (p *pool) applyLocked(req *poolRequest, r protocol.PoolReply, recv time.Time) {
	g := p.g
	sent := req.firstSent
	removed := p.removed // slots that left since the request was built
	p.lastErr = nil
	valid := sent.Add(g.opts.LeaseTTL / 2)
	if !recv.Before(valid) {
		for _, m := range r.Granted {
			p.toReturn = append(p.toReturn, m)
		}
		p.validUntil = recv
		p.expireLocked()
		p.kickLocked()
		return
	}
	if p.learnedAt.After(sent) || r.Epoch < p.epoch {
		for _, m := range r.Lost {
			if s := p.slots[m]; s != nil {
				p.killLocked(s, false)
			}
		}
		p.toReturn = append(p.toReturn, r.Granted...)
		if valid.After(p.validUntil) {
			p.validUntil = valid
			p.expiry.Reset(time.Until(valid))
		}
		p.slotsCapped, p.tokensCapped = false, false
		p.kickLocked()
		return
	}
	if r.Limit < p.limit {
		// A lower limit the change announcement did not bring: the slots
		// held before this answer go back (drainLocked); its grants were
		// made under the new limit.
		p.drainLocked()
	}
	p.epoch, p.limit = r.Epoch, r.Limit
	p.freshUntil = sent.Add(p.every + g.opts.RedisTimeout)
	p.validUntil = valid
	p.expiry.Reset(time.Until(p.validUntil))
	for _, m := range r.Lost {
		if s := p.slots[m]; s != nil {
			p.killLocked(s, false)
		}
	}
	for _, m := range r.Granted {
		s := &poolSlot{member: m}
		p.slots[m] = s
		p.free = append(p.free, s)
	}

	t := r.Tokens
	p.tokens.limited = t.Interval > 0
	switch {
	case r.Batching() && !r.Stale && (t.Interval == 0 || int64((t.Spread-p.lead)/t.Interval)+1 >= minTokenBatch):
		p.mode = modeBatch
	case r.State == wire.Open && !r.Stale:
		p.mode = modeOpen
		p.openUntil = time.Time{}
		if !r.OpenUntil.IsZero() {
			p.openUntil = recv.Add(r.OpenUntil.Sub(r.Now))
		}
	default:
		p.mode = modePerCall
	}

	// Excess: the slots the fleet wants back, less those gone since the
	// request; idle ones go at once, busy ones as their calls end.
	excess := max(0, r.Excess-removed)
	if p.mode == modeBatch {
		p.tokens.add(localTokens(t, r.Now, sent, recv))
	} else {
		excess = int64(len(p.slots))
		p.tokens.clear()
	}
	returned := false
	for excess > 0 && len(p.free) > 0 {
		p.giveBackLocked(p.free[len(p.free)-1])
		excess--
		returned = true
	}
	p.surplus = excess
	if returned {
		p.kickLocked() // another process waits for them
	}
	kept := int64(len(req.args.Held) - len(r.Lost))
	p.slotsCapped = int64(len(r.Granted)) < req.args.Want-kept || req.args.Want < req.demand
	p.tokensCapped = t.Count < req.args.Tokens
	p.serveLocked(recv)
}

// close stops the refresher once it has sent the pool's last report and
// returned its idle slots (at most closeDrain); the slots of calls still
// running go back as they end.
func (p *pool) close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.stop)
		p.wakeLocked() // waiting calls go per call
		p.gaugesLocked()
	}
	p.mu.Unlock()
	<-p.flushed
}

// final is the refresher's last work: the pending request, then one with
// the last report and every idle slot, within closeDrain; then, while calls
// still run on pool slots, a refresh every interval to renew their slots
// and return them as they end.
func (p *pool) final() {
	by := time.Now().Add(closeDrain)
	for range 2 {
		p.mu.Lock()
		need := !p.idleLocked()
		p.mu.Unlock()
		if !need || !time.Now().Before(by) {
			break
		}
		p.refresh(by)
	}
	close(p.flushed)
	tick := time.NewTicker(p.every)
	defer tick.Stop()
	for {
		p.mu.Lock()
		running := p.inUse > 0
		p.mu.Unlock()
		if !running {
			p.mu.Lock()
			idle := p.idleLocked()
			p.mu.Unlock()
			if !idle {
				p.refresh(time.Now().Add(closeDrain)) // what the last calls left
			}
			return
		}
		select {
		case <-tick.C:
		case <-p.kick:
		}
		p.refresh(time.Time{})
	}
}
