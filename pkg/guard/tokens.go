package guard

import (
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// minTokenBatch is the fewest rate tokens a refresh must be able to grant
// for batch mode to lease tokens at all. A refresh grants at most
// (spread − lead) / interval + 1 tokens (docs/protocol.md §4 pool): below
// this, a batch saves no round trip, and the dependency is guarded per
// call, as at rates below about 100 calls/s with the default refresh.
const minTokenBatch = 4

// tokenBatch is the rate tokens of one pool reply, in local time. Token j
// (next <= j < count) may start a call from open + j × interval until
// due + j × interval.
type tokenBatch struct {
	next, count int64
	open, due   time.Time
	interval    time.Duration
}

// localTokens converts a reply's tokens to local time. Redis's clock is
// read from the reply: the script ran after the request was sent and before
// the reply arrived, at reply.Now truncated to the millisecond. So when the
// local clock reads t, Redis's reads at least reply.Now + (t − recv) and at
// most reply.Now + 1ms + (t − sent). A token is used only when both bounds
// lie in its window: never before its window opens, never after its due
// time, whatever the round trip.
func localTokens(t protocol.RateTokens, replyNow, sent, recv time.Time) tokenBatch {
	return tokenBatch{
		count:    t.Count,
		open:     recv.Add(t.First.Add(-t.Spread).Sub(replyNow)),
		due:      sent.Add(t.First.Sub(replyNow) - time.Millisecond),
		interval: t.Interval,
	}
}

// tokenStock is a batching process's rate tokens (Options.Batch): the
// batches of the replies not yet spent, oldest first. Tokens are spent in
// order; a token past its due time is dead (it cannot be saved for later,
// so the fleet's rate holds over every window) and skipped. Not safe for
// concurrent use: the pool's lock guards it.
type tokenStock struct {
	// limited is true when the dependency has a rate limit: every call
	// then needs a token.
	limited bool
	batches []tokenBatch
}

// add appends a reply's tokens.
func (s *tokenStock) add(b tokenBatch) {
	if b.count > 0 {
		s.batches = append(s.batches, b)
	}
}

// take spends the first live token at now; false when none may start a call
// now (none left, or the next one's window has not opened).
func (s *tokenStock) take(now time.Time) bool {
	for len(s.batches) > 0 {
		b := &s.batches[0]
		if b.interval > 0 && now.After(b.due.Add(time.Duration(b.next)*b.interval)) {
			// Skip the dead tokens at once: j is the first due at or after now.
			late := now.Sub(b.due)
			b.next = max(b.next, int64((late+b.interval-1)/b.interval))
		}
		if b.next >= b.count || (b.interval == 0 && now.After(b.due)) {
			s.batches = s.batches[1:]
			continue
		}
		if now.Before(b.open.Add(time.Duration(b.next) * b.interval)) {
			return false // later batches open later still
		}
		b.next++
		return true
	}
	return false
}

// live counts the tokens that may still start a call at or after now.
func (s *tokenStock) live(now time.Time) int64 {
	var n int64
	for _, b := range s.batches {
		first := b.next
		if b.interval > 0 && now.After(b.due) {
			first = max(first, int64((now.Sub(b.due)+b.interval-1)/b.interval))
		}
		n += max(0, b.count-first)
	}
	return n
}

// clear drops every token: the pool no longer batches.
func (s *tokenStock) clear() { s.batches = nil }
