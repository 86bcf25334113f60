package controllers

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestRecordStateSetsThePolicysGauges(t *testing.T) {
	g := NewWithT(t)
	key := types.NamespacedName{Namespace: "metrics-state", Name: "dep"}
	t.Cleanup(func() { forgetPolicy(key) })
	at := time.UnixMilli(1_700_000_000_250)
	recordState(key, protocol.Published{State: wire.Ramping, Limit: 10, Capacity: 40, RampStep: 2, StaleAfter: 30 * time.Second}, at)
	recordStepBack(key)

	g.Expect(testutil.ToFloat64(stateGauge.WithLabelValues(key.Namespace, key.Name, string(wire.Ramping)))).To(Equal(1.0))
	g.Expect(testutil.ToFloat64(stateGauge.WithLabelValues(key.Namespace, key.Name, string(wire.Open)))).To(Equal(0.0))
	g.Expect(testutil.ToFloat64(limitGauge.WithLabelValues(key.Namespace, key.Name))).To(Equal(10.0))
	g.Expect(testutil.ToFloat64(capacityGauge.WithLabelValues(key.Namespace, key.Name))).To(Equal(40.0))
	g.Expect(testutil.ToFloat64(rampStepGauge.WithLabelValues(key.Namespace, key.Name))).To(Equal(2.0))
	g.Expect(testutil.ToFloat64(staleAfterGauge.WithLabelValues(key.Namespace, key.Name))).To(Equal(30.0))
	g.Expect(testutil.ToFloat64(publishedTimestamp.WithLabelValues(key.Namespace, key.Name))).To(Equal(1_700_000_000.25))
	g.Expect(testutil.ToFloat64(stepBacksTotal.WithLabelValues(key.Namespace, key.Name))).To(Equal(1.0))

	// A publication without a Redis time leaves the timestamp alone.
	recordState(key, protocol.Published{State: wire.Closed, Limit: 40, Capacity: 40}, time.Time{})
	g.Expect(testutil.ToFloat64(publishedTimestamp.WithLabelValues(key.Namespace, key.Name))).To(Equal(1_700_000_000.25))
	g.Expect(testutil.ToFloat64(stepBacksTotal.WithLabelValues(key.Namespace, key.Name))).To(Equal(1.0))

	forgetPolicy(key)
	g.Expect(seriesOf(t, "spillway_policy_capacity", key.Namespace)).To(BeZero())
	g.Expect(seriesOf(t, "spillway_policy_ramp_step_backs_total", key.Namespace)).To(BeZero())
	g.Expect(seriesOf(t, "spillway_policy_published_timestamp_seconds", key.Namespace)).To(BeZero())
}

func TestRecordConsumers(t *testing.T) {
	key := types.NamespacedName{Namespace: "metrics-consumers", Name: "dep"}
	bounded := consumerResult{Name: "ScaledObject/workers", Replicas: &Replicas{Min: ptr.To[int32](3), Max: ptr.To[int32](8)}}
	tests := []struct {
		name       string
		results    []consumerResult
		bounded    bool
		wantGauge  float64
		wantSeries int // min and max series of the policy's consumers
		wantMax    map[string]float64
	}{
		{name: "all bounded", results: []consumerResult{bounded}, bounded: true, wantGauge: 1, wantSeries: 2, wantMax: map[string]float64{"ScaledObject/workers": 8}},
		{name: "one not found", results: []consumerResult{bounded, {Name: "HorizontalPodAutoscaler/gone", Reason: "HorizontalPodAutoscalerNotFound"}},
			bounded: false, wantGauge: 0, wantSeries: 2, wantMax: map[string]float64{"ScaledObject/workers": 8}},
		{name: "none left", results: nil, bounded: true, wantGauge: 1, wantSeries: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			// A previous run's consumers are replaced, not kept.
			recordConsumers(key, []consumerResult{{Name: "ScaledObject/old", Replicas: &Replicas{Max: ptr.To[int32](1)}}}, true)
			t.Cleanup(func() { forgetPolicy(key) })

			recordConsumers(key, tt.results, tt.bounded)
			g.Expect(testutil.ToFloat64(consumersBoundedGauge.WithLabelValues(key.Namespace, key.Name))).To(Equal(tt.wantGauge))
			g.Expect(seriesOf(t, "spillway_consumer_min_replicas", key.Namespace) + seriesOf(t, "spillway_consumer_max_replicas", key.Namespace)).To(Equal(tt.wantSeries))
			for consumer, want := range tt.wantMax {
				g.Expect(testutil.ToFloat64(consumerMaxReplicas.WithLabelValues(key.Namespace, key.Name, consumer))).To(Equal(want))
			}
		})
	}
}

// seriesOf counts the series of the metric name whose namespace label is ns.
func seriesOf(t *testing.T, name, ns string) int {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	n := 0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "namespace" && l.GetValue() == ns {
					n++
				}
			}
		}
	}
	return n
}
