package sim_test

import (
	"testing"

	"github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/sim"
)

// hindsight is, for each scenario of the ramp's failure class, the best
// fixed schedule chosen knowing the cold capacity and how long it lasts
// (found by a sweep, docs/replay.md), and the factor of its drain time within
// which the default ramp, which knows neither, must drain.
var hindsight = map[string]struct {
	steps  []int32
	step   string
	factor float64
}{
	"cold-small": {steps: []int32{1, 2}, step: "3m", factor: 1.1},
	"cold-tenth": {steps: []int32{4, 40}, step: "2m30s", factor: 1.1},
	"cold-step":  {steps: []int32{6, 20}, step: "1m", factor: 2.3},
}

// early is, for the same scenarios, the factor within which the ramp drains
// with ramp.earlyClimb on.
var early = map[string]float64{"cold-small": 1.1, "cold-tenth": 1.1, "cold-step": 1.6}

// TestColdStartScenarios checks issue 13's claims on the ramp's failure
// class: a fixed schedule (stepBack Never, the ramp before the rule) brings
// the dependency down again; the default ramp, which steps back, does not,
// stays within capacity, loses nothing, and drains within a stated factor of
// the best fixed schedule chosen with hindsight.
func TestColdStartScenarios(t *testing.T) {
	for name, best := range hindsight {
		t.Run(name, func(t *testing.T) {
			r := result(t, builtinReport(t, name), sim.Spillway)
			if r.SecondOutages != 0 || r.PeakOverCapacity > 1 || r.Lost != 0 || r.DrainSeconds == nil {
				t.Fatalf("spillway: second outages %d, peak %v, lost %d, drain %v; want 0, <= 1, 0, drained",
					r.SecondOutages, r.PeakOverCapacity, r.Lost, r.DrainSeconds)
			}

			fixed := runWith(t, name, func(spec *v1alpha1.DependencyPolicySpec) {
				spec.Ramp.StepBack.When = v1alpha1.StepBackNever
			})
			if fixed.SecondOutages == 0 {
				t.Errorf("fixed schedule: no second outage; the scenario does not show the failure class")
			}

			hs := runWith(t, name, func(spec *v1alpha1.DependencyPolicySpec) {
				spec.Ramp.StepBack.When = v1alpha1.StepBackNever
				spec.Ramp.Steps = best.steps
				if err := spec.Ramp.StepDuration.UnmarshalJSON([]byte(`"` + best.step + `"`)); err != nil {
					t.Fatal(err)
				}
			})
			if hs.SecondOutages != 0 || hs.DrainSeconds == nil {
				t.Fatalf("hindsight schedule: second outages %d, drain %v", hs.SecondOutages, hs.DrainSeconds)
			}
			if got, limit := *r.DrainSeconds, best.factor**hs.DrainSeconds; got > limit {
				t.Errorf("spillway drained in %vs, more than %v x the hindsight schedule's %vs", got, best.factor, *hs.DrainSeconds)
			}
			fast := runWith(t, name, func(spec *v1alpha1.DependencyPolicySpec) { spec.Ramp.EarlyClimb = true })
			if fast.SecondOutages != 0 || fast.PeakOverCapacity > 1 || fast.Lost != 0 || fast.DrainSeconds == nil {
				t.Fatalf("earlyClimb: second outages %d, peak %v, lost %d, drain %v; want 0, <= 1, 0, drained",
					fast.SecondOutages, fast.PeakOverCapacity, fast.Lost, fast.DrainSeconds)
			}
			if got, limit := *fast.DrainSeconds, early[name]**hs.DrainSeconds; got > limit {
				t.Errorf("earlyClimb drained in %vs, more than %v x the hindsight schedule's %vs", got, early[name], *hs.DrainSeconds)
			}
			t.Logf("spillway %vs, with earlyClimb %vs, fixed schedule %d second outages, hindsight %vs", *r.DrainSeconds, *fast.DrainSeconds, fixed.SecondOutages, *hs.DrainSeconds)
		})
	}
}

// runWith runs the built-in scenario name with its policy changed by edit,
// spillway only.
func runWith(t *testing.T, name string, edit func(*v1alpha1.DependencyPolicySpec)) sim.Result {
	t.Helper()
	sc, err := sim.Builtin(name)
	if err != nil {
		t.Fatal(err)
	}
	edit(&sc.Policy.Spec)
	rep, err := sim.Run(sc, []sim.Policy{sim.Spillway})
	if err != nil {
		t.Fatal(err)
	}
	return rep.Policies[0]
}
