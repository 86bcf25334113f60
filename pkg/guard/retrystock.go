package guard

import (
	"context"
	"sync"
	"time"
)

const (
	// retryBatchMax bounds the retries one budget round trip asks for.
	retryBatchMax = 64
	// retryGrantsKept is how long batch mode keeps retry grants it has not
	// handed out yet. They were counted as granted when Redis granted them,
	// so one left unused only makes the budget stricter; kept longer, it
	// would let a retry through on a grant decided on older counts.
	retryGrantsKept = time.Second
)

// retryStock is batch mode's stock of retry grants (Options.Batch): a
// failed call takes a grant from the stock, and when there is none, one
// round trip asks the fleet's budget for as many retries as calls asked
// for since the last round trip and were not served from the stock
// (protocol.Client.RetryBudgetN grants what as many one-at-a-time
// decisions would have granted, never more). Calls that fail meanwhile wait
// for that round trip instead of making their own, and its result goes to
// every one of them, an error included: while Redis does not answer, every
// waiting call learns it from one lookup, within one RedisTimeout, instead
// of each making its own lookup in turn. When the budget granted fewer than
// asked, it is spent: once the grants are gone, failed calls park without
// asking for a refresh interval.
type retryStock struct {
	g *Guard

	mu           sync.Mutex
	grants       int64
	expires      time.Time
	refusedUntil time.Time
	// asked counts the calls that found no grant in the stock since the
	// last round trip started and wait for the next one; round numbers the
	// round trips, so that a call counted in asked before the last one
	// started (and so asked for by it) is not taken out of asked again.
	asked    int64
	round    uint64
	fetching *budgetLookup // the round trip under way, nil if none
}

// budgetLookup is one round trip to the fleet's retry budget; its error
// goes to every call that waited for it.
type budgetLookup struct {
	done chan struct{} // closed when it ends
	err  error         // set before done is closed
}

// take decides whether a failed call may retry: from the stock, or after a
// round trip. An error means Redis did not answer.
func (s *retryStock) take(ctx context.Context) (bool, error) {
	g := s.g
	s.mu.Lock()
	// inAsked: this call is counted in asked, since round counted.
	inAsked, counted := false, uint64(0)
	isCounted := func() bool { return inAsked && counted == s.round }
	uncount := func() {
		if isCounted() {
			s.asked--
		}
	}
	for {
		now := time.Now()
		switch {
		case s.grants > 0 && now.Before(s.expires):
			s.grants--
			uncount()
			s.mu.Unlock()
			return true, nil
		case now.Before(s.refusedUntil):
			uncount()
			s.mu.Unlock()
			return false, nil
		case s.fetching != nil:
			f := s.fetching
			if !isCounted() {
				s.asked++
				inAsked, counted = true, s.round
			}
			s.mu.Unlock()
			<-f.done
			s.mu.Lock()
			if f.err != nil {
				uncount()
				s.mu.Unlock()
				return false, f.err
			}
			continue
		}
		break
	}
	if !isCounted() {
		s.asked++
	}
	n := min(s.asked, retryBatchMax)
	s.asked = 0
	s.round++
	f := &budgetLookup{done: make(chan struct{})}
	s.fetching = f
	s.mu.Unlock()

	rctx, cancel := g.redisContext(context.WithoutCancel(ctx))
	d, err := g.proto.RetryBudgetN(rctx, n)
	cancel()

	s.mu.Lock()
	defer s.mu.Unlock()
	s.fetching = nil
	f.err = err
	close(f.done)
	if err != nil {
		return false, err
	}
	g.sawBackoff(d.Backoff)
	now := time.Now()
	s.grants, s.expires = d.Grants, now.Add(retryGrantsKept)
	if d.Grants < n {
		s.refusedUntil = now.Add(g.opts.Batch.Refresh)
	}
	if s.grants == 0 {
		return false, nil
	}
	s.grants--
	return true, nil
}
