package guard

// Batch mode's local pool of fleet slots (Options.Batch): its state, shared
// by the batch path's files. A call takes a slot and gives it back with no
// round trip: pool_admit.go (take one, wait for one, or be refused), then
// pool_release.go (give it back, or the pool lets it go); refresh.go keeps
// the pool in step with the fleet, retrystock.go its retry grants.

import (
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
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
