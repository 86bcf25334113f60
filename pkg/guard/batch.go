package guard

import (
	"fmt"
	"time"
)

// BatchOptions turn on batch mode, for high call rates: the guard keeps a
// local pool of the fleet's slots, leased from Redis a batch at a time, and
// a call takes a slot from the pool and gives it back there, with no round
// trip (README "Batch mode", docs/protocol.md §4 pool). The zero value is
// off: every call makes its own round trips.
//
// The fleet's limits hold across both modes: the pool's slots are leases in
// the same set as per-call leases, rate tokens come from the same limiter,
// retries from the same budget, and outcomes reach the same window.
type BatchOptions struct {
	// Enabled turns batch mode on. A background goroutine per Guard then
	// refreshes the pool (one round trip each: renew its slots, give idle
	// ones back, take what the process's demand asks for, lease rate
	// tokens, report the calls' outcomes aggregated) and listens for the
	// controller's change announcements. Calls with a Job.Key still go per
	// call (supersession is checked and recorded in Redis when a call is
	// admitted), and so do all calls while the breaker is HalfOpen (probes
	// are counted per call), while the dead-man rule admits calls, and for
	// a rate limit too low to batch (below about 100 calls/s by default).
	Enabled bool
	// Refresh is how often the pool is refreshed while the process calls
	// the dependency (and at once when its demand outgrows the pool): it
	// bounds how late outcomes reach the window the controller reads, how
	// long idle slots stay with a process when another one waits for them,
	// and how late a lower limit, Open or a new epoch reaches the process
	// when the change announcement is lost (with IgnoreChanges, always).
	// Default 40ms, at most 50ms and LeaseTTL/4; the default is at most
	// LeaseTTL/4 too.
	Refresh time.Duration
	// IgnoreChanges skips the subscription to the dependency's change
	// announcements (docs/protocol.md §4 publish), for a Redis or a proxy
	// that refuses SUBSCRIBE: changes then reach the process at its next
	// refresh, within Refresh, instead of within a round trip.
	IgnoreChanges bool
}

// maxRefresh bounds BatchOptions.Refresh: outcomes are reported at least
// this often (issue 23: the window must equal per-call reporting's).
const maxRefresh = 50 * time.Millisecond

// maxBatch bounds the slots one process batches: a pool call names at most
// protocol.MaxPoolMembers members, held and returned together.
const maxBatch = 2000

func (b BatchOptions) withDefaults(leaseTTL time.Duration) (BatchOptions, error) {
	if !b.Enabled {
		return b, nil
	}
	switch {
	case b.Refresh < 0:
		return b, fmt.Errorf("Batch.Refresh must not be negative, got %v", b.Refresh)
	case b.Refresh == 0:
		b.Refresh = min(40*time.Millisecond, leaseTTL/4)
	case b.Refresh > maxRefresh || b.Refresh > leaseTTL/4:
		return b, fmt.Errorf("Batch.Refresh must be at most %v and LeaseTTL/4 (%v), got %v", maxRefresh, leaseTTL/4, b.Refresh)
	case b.Refresh < time.Millisecond:
		return b, fmt.Errorf("Batch.Refresh must be at least 1ms, got %v", b.Refresh)
	}
	return b, nil
}
