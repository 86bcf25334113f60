package sim_test

import (
	"os"
	"strconv"
	"testing"

	"github.com/spillway-dev/spillway/internal/sim"
)

// fleetScale loads testdata/fleet-scale.yaml: 10,000 jobs/s for an hour,
// 36 million jobs per policy. SIM_FLEET_RATE, when set, replaces the
// arrival rate, to profile a smaller run.
func fleetScale(tb testing.TB) *sim.Scenario {
	tb.Helper()
	sc, err := sim.LoadScenarioFile("testdata/fleet-scale.yaml")
	if err != nil {
		tb.Fatal(err)
	}
	if v := os.Getenv("SIM_FLEET_RATE"); v != "" {
		rate, err := strconv.ParseFloat(v, 64)
		if err != nil {
			tb.Fatalf("SIM_FLEET_RATE: %v", err)
		}
		sc.Arrivals.RatePerSecond = rate
	}
	return sc
}

// TestFleetScaleScenario checks that the benchmark's scenario is accepted at
// its full 36 million jobs, and that it replays without losing a job at a
// rate small enough for every test run.
func TestFleetScaleScenario(t *testing.T) {
	sc := fleetScale(t)
	if jobs := sc.Arrivals.RatePerSecond * sc.Timeline.Horizon.Seconds(); jobs != 36_000_000 {
		t.Fatalf("fleet-scale has %.0f jobs, want 36,000,000", jobs)
	}
	sc.Arrivals.RatePerSecond = 20
	rep, err := sim.Run(sc, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Policies {
		if r.Lost != 0 || r.Jobs < 70_000 {
			t.Errorf("%s: %d jobs, %d lost", r.Policy, r.Jobs, r.Lost)
		}
	}
}

// BenchmarkFleetScale replays testdata/fleet-scale.yaml with all eight
// policies: run it once, under /usr/bin/time -v, for the CPU time and the
// peak memory of docs/benchmarks.md.
func BenchmarkFleetScale(b *testing.B) {
	sc := fleetScale(b)
	for b.Loop() {
		rep, err := sim.Run(sc, nil)
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range rep.Policies {
			if r.Lost != 0 {
				b.Fatalf("%s lost %d jobs", r.Policy, r.Lost)
			}
		}
	}
}
