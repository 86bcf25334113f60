package sim_test

import (
	"strings"
	"testing"

	"github.com/spillway-dev/spillway/internal/sim"
)

// TestDurationErrorsNameTheirField: a duration that does not parse is
// reported with the field that holds it, like every other error.
func TestDurationErrorsNameTheirField(t *testing.T) {
	tests := []struct {
		name, from, to, field string
	}{
		{"outage", "outage: 1m", "outage: ten minutes", "timeline.outage"},
		{"horizon", "horizon: 10m", "horizon: 600", "timeline.horizon"},
		{"call duration", "callDuration: 100ms", "callDuration: fast", "dependency.callDuration"},
		{"collapse", "after: 10s", "after: 10 s", "dependency.collapse.after"},
		{"class deadline", "{ratePerSecond: 5}", "{ratePerSecond: 5, classes: [{name: a, share: 1, deadline: soon}]}", "arrivals.classes[0].deadline"},
		{"workers", "slotsPerPod: 5}", "slotsPerPod: 5, startupDelay: 1 minute}", "workers.startupDelay"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !strings.Contains(minimalScenario, tt.from) {
				t.Fatalf("the test's scenario has no %q", tt.from)
			}
			doc := strings.Replace(minimalScenario, tt.from, tt.to, 1) + inlinePolicy
			_, err := sim.ParseScenario([]byte(doc), nil)
			if err == nil {
				t.Fatal("ParseScenario accepted a duration that does not parse")
			}
			if !strings.Contains(err.Error(), tt.field+":") {
				t.Errorf("error %q does not name %s", err, tt.field)
			}
		})
	}
}
