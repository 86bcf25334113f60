package replay

import (
	"context"
	"errors"
	"sync/atomic"
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

// A sample whose read of the autoscaler's bounds failed (the API server slow,
// or the run stopping under it) is not recorded with made-up bounds: the
// e2e replay once ended on a sample reading the Config's min 3 max 30, and
// failed "the ScaledObject stays bounded to the capacity".
func TestSampleNeverMakesUpBounds(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Warm, cfg.Outage, cfg.MaxRecovery = 300*time.Millisecond, 300*time.Millisecond, 300*time.Millisecond
	cfg.SampleEvery = 20 * time.Millisecond
	var calls atomic.Int64
	fleet := Fleet{Bounds: func(context.Context) (int, int, error) {
		if calls.Add(1)%2 == 0 {
			return 0, 0, errors.New("the API server did not answer")
		}
		return 2, 7, nil
	}}
	res, err := Run(t.Context(), cfg, fleet, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Samples) < 5 {
		t.Fatalf("only %d samples", len(res.Samples))
	}
	for _, s := range res.Samples {
		if s.MinReplicas != 2 || s.MaxReplicas != 7 {
			t.Fatalf("at %v the sample reads min %d max %d; the autoscaler only ever said min 2 max 7", s.At, s.MinReplicas, s.MaxReplicas)
		}
	}
}
