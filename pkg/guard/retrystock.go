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
// round trip asks the fleet's budget for as many retries as were asked for
// since the last time (protocol.Client.RetryBudgetN grants what as many
// one-at-a-time decisions would have granted, never more). Calls that fail
// meanwhile wait for that round trip instead of making their own. When the
// budget granted fewer than asked, it is spent: once the grants are gone,
// failed calls park without asking for a refresh interval.
type retryStock struct {
	g *Guard

	mu           sync.Mutex
	grants       int64
	expires      time.Time
	refusedUntil time.Time
	asked        int64         // retries asked for since the last round trip
	fetching     chan struct{} // closed when the round trip under way ends
}

// take decides whether a failed call may retry: from the stock, or after a
// round trip. An error means Redis did not answer.
func (s *retryStock) take(ctx context.Context) (bool, error) {
	g := s.g
	s.mu.Lock()
	s.asked++
	for {
		now := time.Now()
		switch {
		case s.grants > 0 && now.Before(s.expires):
			s.grants--
			s.mu.Unlock()
			return true, nil
		case now.Before(s.refusedUntil):
			s.mu.Unlock()
			return false, nil
		case s.fetching != nil:
			ch := s.fetching
			s.mu.Unlock()
			<-ch
			s.mu.Lock()
			continue
		}
		break
	}
	n := min(s.asked, retryBatchMax)
	s.asked = 0
	ch := make(chan struct{})
	s.fetching = ch
	s.mu.Unlock()

	rctx, cancel := g.redisContext(context.WithoutCancel(ctx))
	d, err := g.proto.RetryBudgetN(rctx, n)
	cancel()

	s.mu.Lock()
	defer s.mu.Unlock()
	s.fetching = nil
	close(ch)
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
