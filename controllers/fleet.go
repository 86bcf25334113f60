package controllers

import (
	"errors"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// This file holds, without I/O, the two states published outside the control
// law: the safe state of a policy whose spec cannot be used (the evaluator's)
// and the released state of a deleted policy (reconcileDelete's).

// EventSafeState (Warning): the spec of a policy cannot be used and its
// fleet was published in the safe state (see safeState).
const EventSafeState = "SafeState"

// releasedState is what a deleted policy leaves in Redis: Closed at full
// capacity, so no fleet stays held at the limit of an outage by a policy that
// no longer exists. Workers refuse to call a dependency with no state in
// Redis, so the state is written rather than deleted, also when Redis holds
// none (it lost its data). prev and found are what Redis holds; params are
// the policy's, when its spec is valid (paramsErr nil).
//
// The parameters are the spec's; with an unusable spec, the ones last
// published. The epoch is two past the stored one: an evaluation still in
// flight, which publishes at most one past it, is refused.
func releasedState(params policy.Params, paramsErr error, prev protocol.Published, found bool, now time.Time) (protocol.Published, error) {
	next := prev
	switch {
	case paramsErr == nil:
		next.Capacity = params.Capacity
		next.RatePerSecond = params.RatePerSecond
		next.Backoff = params.Backoff
		next.Budget = params.Budget
		next.BreakerWindow = params.Breaker.Window
		next.RampStep = len(params.Ramp.Steps) - 1
	case !found:
		return protocol.Published{}, errors.New("the spec is invalid and Redis holds no state to release the fleet from")
	}
	return closedAtCapacity(next, now, prev.Epoch+2), nil
}

// closedAtCapacity is p published Closed at its full capacity from now, at
// epoch: what a deleted policy and an unusable spec both leave the fleet in.
func closedAtCapacity(p protocol.Published, now time.Time, epoch int64) protocol.Published {
	p.State, p.Limit = wire.Closed, p.Capacity
	p.OpenUntil, p.BreakerSince, p.RampStepStarted = time.Time{}, now, now
	p.Epoch = epoch
	return p
}

// safeState is what the evaluator publishes for a policy whose spec cannot
// be turned into parameters (Stalled): Closed at the capacity last
// published, with the parameters last published. The breaker and the ramp
// cannot run without a valid spec; holding the fleet Open or HalfOpen until
// someone fixes the spec would strand it, so the fleet is bounded by the
// capacity alone, as after a deletion. It reports false when prev already is
// that state. A state change takes the next epoch, as a transition does.
func safeState(prev protocol.Published, now time.Time) (protocol.Published, bool) {
	if prev.State == wire.Closed && prev.Limit == prev.Capacity {
		return prev, false
	}
	return closedAtCapacity(prev, now, prev.Epoch+1), true
}
