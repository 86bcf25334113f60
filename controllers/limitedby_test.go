package controllers

import (
	"slices"
	"testing"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestConsumerBounds(t *testing.T) {
	// Capacity 40, ramp 5, 10, 20, 40; a library fleet and a fleet without
	// the library, weights 1 and 1, 2 and 1 slots per replica.
	p := policy.Params{Capacity: 40, Ramp: ramp.Schedule{Steps: []int64{5, 10, 20, 40}}}
	consumers := []spillwayv1alpha1.Consumer{
		{ScaledObjectName: "library", SlotsPerReplica: 2, Weight: 1},
		{ScaledObjectName: "plain", SlotsPerReplica: 1, Weight: 1, LimitedBy: spillwayv1alpha1.LimitedByReplicas},
	}
	cases := []struct {
		name  string
		state wire.State
		limit int64
		want  []int32
	}{
		{name: "not evaluated", state: "", limit: 0, want: []int32{10, 20}},
		{name: "closed", state: wire.Closed, limit: 40, want: []int32{10, 20}},
		{name: "open: held at the first step", state: wire.Open, limit: 0, want: []int32{10, 2}},
		{name: "half-open: held at the first step", state: wire.HalfOpen, limit: 3, want: []int32{10, 2}},
		{name: "ramping step 1", state: wire.Ramping, limit: 5, want: []int32{10, 2}},
		{name: "ramping step 2", state: wire.Ramping, limit: 10, want: []int32{10, 5}},
		{name: "ramping step 3", state: wire.Ramping, limit: 20, want: []int32{10, 10}},
		{name: "ramping, a limit above the capacity is capped", state: wire.Ramping, limit: 80, want: []int32{10, 20}},
		{name: "ramping, a limit below the first step counts as the first", state: wire.Ramping, limit: 1, want: []int32{10, 2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := ConsumerBounds(p, tc.state, tc.limit, consumers); !slices.Equal(got, tc.want) {
				t.Errorf("ConsumerBounds(%s, %d) = %v, want %v", tc.state, tc.limit, got, tc.want)
			}
		})
	}

	// A share below one replica is still one: a bound never scales a
	// workload to nothing.
	small := policy.Params{Capacity: 40, Ramp: ramp.Schedule{Steps: []int64{1, 40}}}
	if got := ConsumerBounds(small, wire.Open, 0, consumers); !slices.Equal(got, []int32{10, 1}) {
		t.Errorf("a share below one replica: %v, want [10 1]", got)
	}

	// Only library consumers: the bounds are Bounds' whatever the state.
	library := consumers[:1]
	for _, st := range []wire.State{wire.Open, wire.HalfOpen, wire.Ramping, wire.Closed} {
		if got := ConsumerBounds(p, st, 5, library); !slices.Equal(got, Bounds(40, library)) {
			t.Errorf("library consumer in %s: %v, want %v", st, got, Bounds(40, library))
		}
	}
}
