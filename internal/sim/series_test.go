package sim_test

import (
	"strings"
	"testing"

	"github.com/spillway-dev/spillway/internal/sim"
)

// TestCallsInSeries: every call counted in calls is in a second of the
// series, including calls that would start exactly at the horizon.
func TestCallsInSeries(t *testing.T) {
	for _, name := range sim.BuiltinNames() {
		for _, r := range builtinReport(t, name).Policies {
			var sum int64
			for _, c := range r.Series.Calls {
				sum += int64(c)
			}
			if sum != r.Calls {
				t.Errorf("%s %s: calls = %d, the series holds %d", name, r.Policy, r.Calls, sum)
			}
		}
	}
	// A horizon that is not a whole second: its last, partial second is in
	// the series too.
	doc := strings.Replace(minimalScenario, "horizon: 10m", "horizon: 600500ms", 1) + inlinePolicy
	sc, err := sim.ParseScenario([]byte(doc), nil)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := sim.Run(sc, []sim.Policy{sim.ImmediateRetry, sim.Spillway})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Policies {
		var sum int64
		for _, c := range r.Series.Calls {
			sum += int64(c)
		}
		if sum != r.Calls || len(r.Series.Calls) != 601 {
			t.Errorf("horizon 600.5 s, %s: calls = %d, the series holds %d in %d seconds (want 601)", r.Policy, r.Calls, sum, len(r.Series.Calls))
		}
	}
}
