package controllers

import (
	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// ConsumerBounds returns, for each consumer in order, the most replicas its
// workload may run in state, with limit the published limit:
//
//   - a consumer limited by the library (spec limitedBy Library, the
//     default) gets its share of the capacity, whatever the state (Bounds):
//     its workers hold the fleet-wide slots, so its pods need not follow the
//     limit, and the pods the pin keeps are there when the ramp gives them
//     slots;
//   - a consumer limited by its replicas (limitedBy Replicas) gets its share
//     of replicaLimit: its replica count is its concurrency, so its maximum
//     follows the ramp step by step.
//
// The shares are those of Bounds: all consumers' weights count, whatever
// limits each.
func ConsumerBounds(p policy.Params, state wire.State, limit int64, consumers []spillwayv1alpha1.Consumer) []int32 {
	bounds := Bounds(p.Capacity, consumers)
	rl := replicaLimit(p, state, limit)
	if rl == p.Capacity {
		return bounds
	}
	ramped := Bounds(rl, consumers)
	for i, c := range consumers {
		if c.LimitedBy == spillwayv1alpha1.LimitedByReplicas {
			bounds[i] = ramped[i]
		}
	}
	return bounds
}

// replicaLimit is the fleet-wide concurrency a fleet limited by its replicas
// is sized for in state: the published limit while Ramping (the current
// step), the first ramp step while Open or HalfOpen, and the capacity while
// Closed or not evaluated yet. Open and HalfOpen do not take the published
// limit (0, then halfOpenProbes): without the library a worker cannot be
// stopped call by call, so the fleet is held at the size the ramp restarts
// from. Its first calls after the outage are then the first step's, and
// while HalfOpen it is its own probe (the Prometheus signal judges it).
func replicaLimit(p policy.Params, state wire.State, limit int64) int64 {
	first := p.Capacity
	if len(p.Ramp.Steps) > 0 {
		first = p.Ramp.Steps[0]
	}
	switch state {
	case wire.Ramping:
		return min(max(limit, first), p.Capacity)
	case wire.Open, wire.HalfOpen:
		return first
	}
	return p.Capacity
}

// limit is the limit published with state (observed.state): the last
// evaluation's, or what status says until the evaluator's first.
func (o *observed) limit(pol *spillwayv1alpha1.DependencyPolicy) int64 {
	if o.Evaluated && o.Evaluation.Err == nil {
		return o.Evaluation.Published.Limit
	}
	return int64(pol.Status.CurrentLimit)
}
