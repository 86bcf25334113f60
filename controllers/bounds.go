package controllers

import (
	"encoding/json"
	"fmt"
	"math"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// KEDADefaultMaxReplicas is the maxReplicaCount KEDA uses when a ScaledObject
// sets none.
const KEDADefaultMaxReplicas int32 = 100

// Replicas is an autoscaler's minimum and maximum replicas (a ScaledObject's
// minReplicaCount and maxReplicaCount, an HPA's minReplicas and
// maxReplicas); nil means unset. It is also the JSON of the AnnotationOriginalReplicas annotation,
// {"min":2,"max":null}, where null keeps "unset" distinct from any number.
type Replicas struct {
	Min *int32 `json:"min"`
	Max *int32 `json:"max"`
}

// String is "min=2 max=unset".
func (r Replicas) String() string {
	return fmt.Sprintf("min=%s max=%s", fmtReplicas(r.Min), fmtReplicas(r.Max))
}

// Equal reports whether r and o set the same fields to the same values.
func (r Replicas) Equal(o Replicas) bool {
	return equalInt32(r.Min, o.Min) && equalInt32(r.Max, o.Max)
}

// parseReplicas reads the AnnotationOriginalReplicas annotation.
func parseReplicas(s string) (Replicas, error) {
	var r Replicas
	if err := json.Unmarshal([]byte(s), &r); err != nil {
		return Replicas{}, fmt.Errorf("failed to parse %q: %w", s, err)
	}
	return r, nil
}

// marshal is the AnnotationOriginalReplicas annotation's value.
func (r Replicas) marshal() string {
	b, _ := json.Marshal(r) // two pointers to int32 always marshal
	return string(b)
}

// Bounds returns, for each consumer in order, the most replicas its workload
// may run so that all consumers together never ask for more than the
// dependency's capacity: floor(capacity × weight / Σweights / slotsPerReplica),
// and at least 1, so a consumer is never scaled to nothing by a bound. A weight
// or slotsPerReplica of 0 (a spec built in Go, not defaulted by the API server)
// counts as 1.
func Bounds(capacity int64, consumers []spillwayv1alpha1.Consumer) []int32 {
	var total int64
	for _, c := range consumers {
		total += max(int64(c.Weight), 1)
	}
	bounds := make([]int32, len(consumers))
	for i, c := range consumers {
		weight := max(int64(c.Weight), 1)
		slots := max(int64(c.SlotsPerReplica), 1)
		// capacity ≤ 2^31 and weight × len ≤ 2^31 × 32: the product fits an int64.
		b := capacity * weight / (total * slots)
		bounds[i] = int32(min(max(b, 1), math.MaxInt32))
	}
	return bounds
}

// DesiredReplicas is what Spillway sets on a ScaledObject whose user declared
// user, for a bound from Bounds and, during an outage, the replicas to pin
// (nil when not pinning):
//
//   - max is min(user's max, bound), where an unset max is KEDA's default of
//     100; it stays unset when the user's is unset and the bound is not lower
//     than 100. Spillway only ever lowers a maximum.
//   - min is the pinned replicas, raised to the user's min and capped at the
//     max, while pinning; otherwise the user's min, capped at the max so that
//     min ≤ max holds as KEDA requires, and unset when the user's is unset.
func DesiredReplicas(user Replicas, bound int32, pin *int32) Replicas {
	return desiredReplicas(scaledObjectKind, user, bound, pin)
}

// desiredReplicas is DesiredReplicas for an autoscaler of kind k, whose unset
// min and max mean k.DefaultMin and k.DefaultMax. A kind whose max is
// required (an HPA) always gets one.
func desiredReplicas(k *autoscalerKind, user Replicas, bound int32, pin *int32) Replicas {
	var out Replicas
	userMax := bound
	switch {
	case user.Max != nil:
		userMax = *user.Max
	case k.DefaultMax > 0:
		userMax = k.DefaultMax
	}
	effectiveMax := min(userMax, bound)
	if user.Max != nil || k.DefaultMax == 0 || bound < k.DefaultMax {
		out.Max = &effectiveMax
	}
	userMin := k.DefaultMin
	if user.Min != nil {
		userMin = *user.Min
	}
	switch {
	case pin != nil:
		v := min(max(*pin, userMin), effectiveMax)
		out.Min = &v
	case user.Min != nil:
		v := min(userMin, effectiveMax)
		out.Min = &v
	}
	return out
}

func equalInt32(a, b *int32) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func fmtReplicas(v *int32) string {
	if v == nil {
		return "unset"
	}
	return fmt.Sprint(*v)
}
