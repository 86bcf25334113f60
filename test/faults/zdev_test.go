package faults

import (
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestDevWorkerFaults(t *testing.T) {
	requirePython(t)
	f := startFleet(t, false, false)
	_, err := f.proto.Publish(t.Context(), protocol.Published{State: wire.Closed, Limit: limit, Capacity: limit, Epoch: 1,
		Backoff:       retry.Backoff{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond, Jitter: retry.JitterFull},
		Budget:        retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute},
		BreakerWindow: 5 * time.Second, HalfOpenProbes: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []workerKind{goPerCall, goBatch, python} {
		f.startWorker(k)
	}
	c := &campaign{t: t, f: f, injected: map[string]int{}}
	start := time.Now()
	for _, s := range []struct {
		name   string
		target workerKind
	}{
		{"sigstop", goBatch},
		{"sigstop", goPerCall},
		{"sigstop", goBatch},
		{"sigstop", goPerCall},
		{"sigstop", goBatch},
		{"sigstop", python},
		{"sigstop", goBatch},
		{"sigstop", goBatch},
		{"partition-long", goBatch},
		{"partition-long", goPerCall},
		{"partition-long", python},
	} {
		c.run(byName(t, s.name), s.target)
	}
	c.report(time.Since(start))
}
