package guard_test

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// TestInFlightCountsAdmittedCalls: spillway_worker_in_flight counts the calls
// running now, those the fleet admitted and those the local fail-open cap
// admitted, and nothing once they are done.
func TestInFlightCountsAdmittedCalls(t *testing.T) {
	tests := []struct {
		name        string
		redisDown   bool
		wantRunning float64
	}{
		{name: "admitted by the fleet", wantRunning: 2},
		{name: "admitted by the fail-open cap", redisDown: true, wantRunning: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			srv := redistest.Start(t)
			rdb := fastClient(srv)
			publish(t, rdb, defaultPublished(5))
			reg := prometheus.NewRegistry()
			gd := newGuard(t, rdb, guard.Options{Registerer: reg, RedisTimeout: 50 * time.Millisecond, FailOpenLimit: 2})
			if tt.redisDown {
				srv.Stop()
			}
			inFlight := func() float64 { return gauge(t, reg, "spillway_worker_in_flight") }
			g.Expect(inFlight()).To(BeZero())

			release := make(chan struct{})
			errs := make(chan error, 2)
			for range 2 {
				go func() {
					errs <- gd.Do(t.Context(), guard.Job{}, func(context.Context) error { <-release; return nil })
				}()
			}
			g.Eventually(inFlight).Should(Equal(tt.wantRunning))
			close(release)
			g.Expect(<-errs).To(Succeed())
			g.Expect(<-errs).To(Succeed())
			g.Expect(inFlight()).To(BeZero())
		})
	}
}

// gauge reads the value of a worker gauge for dep in reg; it fails t when
// the series does not exist.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "dependency" && l.GetValue() == dep {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no series %s{dependency=%q}", name, dep)
	return 0
}
