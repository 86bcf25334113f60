package replay

import (
	"testing"
	"time"
)

// A fleet that does not drain its backlog within MaxRecovery is never shown
// as drained: the demo's unprotected run ended on rows reading "drained" with
// a backlog of 150 while its summary said the drain never happened.
func TestPhaseIsDrainedOnlyOnceTheBacklogIs(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Warm, cfg.Outage, cfg.MaxRecovery = 300*time.Millisecond, time.Second, 500*time.Millisecond
	cfg.SampleEvery = 100 * time.Millisecond
	res, err := Run(t.Context(), cfg, Fleet{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.DrainSeconds >= 0 {
		t.Fatalf("the unprotected fleet drained %d jobs in %.1fs, in a run meant to leave a backlog", res.Backlog, res.DrainSeconds)
	}
	for _, s := range res.Samples {
		if s.Phase == "drained" {
			t.Fatalf("at %v the phase is drained with a backlog of %d, and the run never drained", s.At, s.Backlog)
		}
	}
}
