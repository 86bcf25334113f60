package controllers

import (
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// This file holds, without I/O, the state published outside the control
// law: the released state of a deleted policy (reconcileDelete's).

// releasedState is what a deleted policy leaves in Redis: Closed at full
// capacity, so no fleet stays held at the limit of an outage by a policy that
// no longer exists. Workers refuse to call a dependency with no state in
// Redis, so the state is written rather than deleted, also when Redis holds
// none (it lost its data). prev and found are what Redis holds; params are
// the policy's, when its spec is valid (paramsErr nil).
//
// The parameters are the spec's; with an unusable spec, the ones last
// published. An unusable spec with no state in Redis has nothing to release:
// ok is false, nothing is written, and the finalizer may go (workers find no
// policy and defer, as they did while it existed). The epoch is two past the
// stored one: an evaluation still in flight, which publishes at most one
// past it, is refused.
func releasedState(params policy.Params, paramsErr error, prev protocol.Published, found bool, now time.Time) (next protocol.Published, ok bool) {
	next = prev
	switch {
	case paramsErr == nil:
		next.Capacity = params.Capacity
		next.RatePerSecond = params.RatePerSecond
		next.Backoff = params.Backoff
		next.Budget = params.Budget
		next.BreakerWindow = params.Breaker.Window
		next.RampStep = len(params.Ramp.Steps) - 1
	case !found:
		return protocol.Published{}, false
	}
	// The released fleet never trips again (no controller would take the
	// trip over), and the release acknowledges the last trip, which publish
	// would otherwise refuse it for (protocol.ErrTripped).
	next.Trip = protocol.Trip{Acknowledged: prev.TripSeen(), AcknowledgedCount: prev.TripsSeen()}
	return closedAtCapacity(next, now, prev.Epoch+2), true
}

// closedAtCapacity is p published Closed at its full capacity from now, at
// epoch: what a deleted policy leaves the fleet in.
func closedAtCapacity(p protocol.Published, now time.Time, epoch int64) protocol.Published {
	p.State, p.Limit = wire.Closed, p.Capacity
	p.OpenUntil, p.BreakerSince, p.RampStepStarted = time.Time{}, now, now
	p.Epoch = epoch
	return p
}
