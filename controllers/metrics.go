package controllers

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The controller's metrics, registered on controller-runtime's registry and
// served with its own on the manager's metrics endpoint.
var (
	// stateGauge is 1 for each policy's current state and 0 for the others.
	stateGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_state",
		Help: "1 for the state each DependencyPolicy is in (Closed, Open, HalfOpen or Ramping), 0 for the others.",
	}, []string{"namespace", "name", "state"})

	// limitGauge is the fleet-wide concurrency limit each policy published.
	limitGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_limit",
		Help: "Fleet-wide concurrency limit each DependencyPolicy last published.",
	}, []string{"namespace", "name"})

	// transitionsTotal counts state changes by from and to state.
	transitionsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "spillway_transitions_total",
		Help: "State transitions of all DependencyPolicies, by from and to state.",
	}, []string{"from", "to"})

	// evaluationLag is how late each evaluation came after the one before:
	// the time since the previous publication, minus the evaluation interval.
	evaluationLag = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "spillway_evaluation_lag_seconds",
		Help:    "Time since a DependencyPolicy was last evaluated, minus the evaluation interval, measured at each evaluation in Redis time.",
		Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30},
	})

	// reconcileErrors counts failed reconciles by reason.
	reconcileErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "spillway_reconcile_errors_total",
		Help: "Reconciles of DependencyPolicies that failed, by reason (a Ready or ConsumersBounded condition reason, or KubernetesAPI).",
	}, []string{"reason"})
)

// ReasonKubernetesAPI labels reconcile errors from reading or patching the
// DependencyPolicy itself.
const ReasonKubernetesAPI = "KubernetesAPI"

var allStates = []wire.State{wire.Closed, wire.Open, wire.HalfOpen, wire.Ramping}

func init() {
	metrics.Registry.MustRegister(stateGauge, limitGauge, transitionsTotal, evaluationLag, reconcileErrors)
}

// recordState sets the state and limit gauges of a policy.
func recordState(key types.NamespacedName, p protocol.Published) {
	for _, s := range allStates {
		v := 0.0
		if s == p.State {
			v = 1
		}
		stateGauge.WithLabelValues(key.Namespace, key.Name, string(s)).Set(v)
	}
	limitGauge.WithLabelValues(key.Namespace, key.Name).Set(float64(p.Limit))
}

// forgetPolicy drops a deleted policy's series.
func forgetPolicy(key types.NamespacedName) {
	for _, s := range allStates {
		stateGauge.DeleteLabelValues(key.Namespace, key.Name, string(s))
	}
	limitGauge.DeleteLabelValues(key.Namespace, key.Name)
}

// observeLag records the evaluation lag from two Redis times: the previous
// publication and now. Evaluations that run early (an event triggered them)
// count as 0.
func observeLag(previous, now time.Time, interval time.Duration) {
	if previous.IsZero() || now.IsZero() {
		return
	}
	evaluationLag.Observe(max(now.Sub(previous)-interval, 0).Seconds())
}
