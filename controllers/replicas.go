package controllers

import (
	"encoding/json"
	"fmt"
)

// Replicas, the pair of autoscaler fields Spillway bounds and pins, and its
// annotation form; binding.go plans with it, consumers.go writes it.

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
