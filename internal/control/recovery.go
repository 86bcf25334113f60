package control

import (
	"fmt"
	"math"
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// collapsed reports whether a breaker that opens at now, from the state prev
// with the ramp r, opens because of the ramp: during a step (Ramping), or
// within a StepDuration of the last step (Closed at full capacity, the step
// up to it not yet held for a whole StepDuration). The ramp then remembers
// the limit (ramp.Ramp.Collapse). A policy never evaluated starts with its
// last step a StepDuration old (Restore), so its first outage is not a
// collapse.
func collapsed(p policy.Params, prev protocol.Published, r *ramp.Ramp, now time.Time) bool {
	switch prev.State {
	case wire.Ramping:
		return true
	case wire.Closed:
		return justRamped(p, r, now)
	}
	return false
}

// isWarm reports whether a breaker that closes at now skips the ramp: the
// policy declares ramp.warmFor, the outage began less than WarmFor ago, and
// the ramp remembers no collapse (an outage that began during the ramp, or
// right after it, always ramps).
func isWarm(p policy.Params, outageSince time.Time, r *ramp.Ramp, now time.Time) bool {
	return p.Ramp.WarmFor > 0 && !outageSince.IsZero() && now.Sub(outageSince) < p.Ramp.WarmFor && r.Ceiling() == 0
}

func warmMessage(p policy.Params, probes breaker.Counts, outage time.Duration, r *ramp.Ramp) string {
	return fmt.Sprintf("%d probe calls succeeded: breaker closed after an outage of %v, shorter than ramp.warmFor %v: limit %d (full capacity, no ramp)",
		probes.Calls, outage.Round(time.Second), p.Ramp.WarmFor, r.Limit())
}

// RateBound is the fleet-wide call rate to publish. While bounded (Ramping,
// HalfOpen, and the first StepDuration at full capacity after a ramp: see
// rateBounded) the rate is bounded as well as the concurrency, so that calls
// which fail in milliseconds cannot multiply the load: at most limit /
// successLatency calls a second, the rate at which limit calls in flight
// would start if each took as long as a success does (so the bound costs
// nothing to calls that take their usual time), and at most
// capacity.ratePerSecond. While the success latency is unknown (0: too few
// timed successes so far), a policy with capacity.ratePerSecond is bounded
// at its share of it, limit / capacity × ratePerSecond, and one without is
// not rate-bounded. The bound is at least 1. Otherwise it is
// capacity.ratePerSecond, 0 for none.
func RateBound(p policy.Params, bounded bool, limit int64, successLatency time.Duration) int64 {
	if !bounded {
		return p.RatePerSecond
	}
	var bound int64
	switch {
	case successLatency > 0:
		bound = int64(math.Ceil(float64(limit) / successLatency.Seconds()))
		if p.RatePerSecond > 0 {
			bound = min(bound, p.RatePerSecond)
		}
	case p.RatePerSecond > 0 && p.Capacity > 0:
		bound = (limit*p.RatePerSecond + p.Capacity - 1) / p.Capacity
	default:
		return 0
	}
	return max(bound, 1)
}

// rateBounded reports whether the published state's call rate is bounded
// (RateBound): while HalfOpen and Ramping, and for the first StepDuration at
// full capacity after a ramp, the step a collapse is still remembered from
// (collapsed).
func rateBounded(p policy.Params, state wire.State, r *ramp.Ramp, now time.Time) bool {
	switch state {
	case wire.HalfOpen, wire.Ramping:
		return true
	case wire.Closed:
		return justRamped(p, r, now)
	}
	return false
}
