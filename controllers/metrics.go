package controllers

import (
	"strconv"
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

	// capacityGauge is each policy's capacity.concurrency, as published.
	capacityGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_capacity",
		Help: "Fleet-wide concurrency capacity (capacity.concurrency) each DependencyPolicy last published.",
	}, []string{"namespace", "name"})

	// rampStepGauge is the ramp's position each policy last published.
	rampStepGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_ramp_step",
		Help: "Ramp step each DependencyPolicy last published (0 before the first step).",
	}, []string{"namespace", "name"})

	// stepBacksTotal counts the ramp's step backs, per policy.
	stepBacksTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "spillway_policy_ramp_step_backs_total",
		Help: "Times each DependencyPolicy's ramp stepped back because a step failed more than ramp.stepBack allows.",
	}, []string{"namespace", "name"})

	// publishedTimestamp is when each policy was last published, in Redis
	// time: an alert compares it with the dead-man bound.
	publishedTimestamp = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_published_timestamp_seconds",
		Help: "Unix time (Redis time) of each DependencyPolicy's last publication.",
	}, []string{"namespace", "name"})

	// staleAfterGauge is the dead-man bound each policy last published.
	staleAfterGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_stale_after_seconds",
		Help: "Dead-man bound each DependencyPolicy last published: workers treat an Open state older than this as HalfOpen (0: the rule is off).",
	}, []string{"namespace", "name"})

	// consumersBoundedGauge is the ConsumersBounded condition as a number.
	consumersBoundedGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_consumers_bounded",
		Help: "1 when every consumer of a DependencyPolicy is bounded (ConsumersBounded not False), 0 when one is not.",
	}, []string{"namespace", "name"})

	// consumerMinReplicas and consumerMaxReplicas are what Spillway applied
	// to each consumer's autoscaler: the pinned (or the user's) minimum and
	// the bounded maximum.
	consumerMinReplicas = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_consumer_min_replicas",
		Help: "Minimum replicas Spillway set on each consumer's autoscaler: pinned through an outage and the ramp, else the user's.",
	}, []string{"namespace", "policy", "consumer"})
	consumerMaxReplicas = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_consumer_max_replicas",
		Help: "Maximum replicas Spillway set on each consumer's autoscaler: its share of the limit in force.",
	}, []string{"namespace", "policy", "consumer"})

	// workerProcesses counts the worker processes that registered in the
	// last minute, by client and protocol version, and callsByProtocol the
	// calls of the last whole minute by the callers' protocol version ("4":
	// workers of version 4, which do not register).
	workerProcesses = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_worker_processes",
		Help: "Worker processes of each DependencyPolicy's dependency that registered in the last minute, by client (go, python, node) and protocol version, and whether this manager serves that version (served true or false).",
	}, []string{"namespace", "name", "client", "protocol", "served"})
	callsByProtocol = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spillway_policy_calls_by_protocol",
		Help: "Calls of each DependencyPolicy's dependency over the last whole minute, by the protocol version of the workers that made them (4: workers of version 4, which do not count themselves).",
	}, []string{"namespace", "name", "protocol"})

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
	metrics.Registry.MustRegister(stateGauge, limitGauge, transitionsTotal, evaluationLag, reconcileErrors,
		capacityGauge, rampStepGauge, stepBacksTotal, publishedTimestamp, staleAfterGauge,
		consumersBoundedGauge, consumerMinReplicas, consumerMaxReplicas, workerProcesses, callsByProtocol)
}

// recordFleet sets the gauges of which protocol versions a policy's workers
// speak, dropping the series of versions no longer seen.
func recordFleet(key types.NamespacedName, f protocol.Fleet) {
	workerProcesses.DeletePartialMatch(prometheus.Labels{"namespace": key.Namespace, "name": key.Name})
	callsByProtocol.DeletePartialMatch(prometheus.Labels{"namespace": key.Namespace, "name": key.Name})
	for p, n := range f.Processes {
		workerProcesses.WithLabelValues(key.Namespace, key.Name, p.Client, strconv.Itoa(p.Version), strconv.FormatBool(protocol.Served(p.Version))).Set(float64(n))
	}
	for v, n := range f.CallsByVersion {
		callsByProtocol.WithLabelValues(key.Namespace, key.Name, strconv.Itoa(v)).Set(float64(n))
	}
	if n := f.Unversioned(); n > 0 || f.Calls > 0 {
		callsByProtocol.WithLabelValues(key.Namespace, key.Name, "4").Set(float64(n))
	}
}

// recordState sets the gauges of a policy's published state; at is when
// Redis stored it (zero: unknown, the timestamp is left as it was).
func recordState(key types.NamespacedName, p protocol.Published, at time.Time) {
	for _, s := range allStates {
		v := 0.0
		if s == p.State {
			v = 1
		}
		stateGauge.WithLabelValues(key.Namespace, key.Name, string(s)).Set(v)
	}
	limitGauge.WithLabelValues(key.Namespace, key.Name).Set(float64(p.Limit))
	capacityGauge.WithLabelValues(key.Namespace, key.Name).Set(float64(p.Capacity))
	rampStepGauge.WithLabelValues(key.Namespace, key.Name).Set(float64(p.RampStep))
	staleAfterGauge.WithLabelValues(key.Namespace, key.Name).Set(p.StaleAfter.Seconds())
	if !at.IsZero() {
		publishedTimestamp.WithLabelValues(key.Namespace, key.Name).Set(float64(at.UnixMilli()) / 1000)
	}
	// The step-back counter exists from the first publication, so that a
	// rate over it is 0, not absent, until the first step back.
	stepBacksTotal.WithLabelValues(key.Namespace, key.Name)
}

// recordStepBack counts one step back of a policy's ramp.
func recordStepBack(key types.NamespacedName) {
	stepBacksTotal.WithLabelValues(key.Namespace, key.Name).Inc()
}

// recordConsumers sets a policy's ConsumersBounded gauge and the replicas
// applied to each consumer it bounded; consumers it did not bound have no
// replicas series.
func recordConsumers(key types.NamespacedName, results []consumerResult, bounded bool) {
	v := 0.0
	if bounded {
		v = 1
	}
	consumersBoundedGauge.WithLabelValues(key.Namespace, key.Name).Set(v)
	forgetConsumers(key)
	for _, r := range results {
		if r.Reason != "" || r.Replicas == nil {
			continue
		}
		if r.Replicas.Min != nil {
			consumerMinReplicas.WithLabelValues(key.Namespace, key.Name, r.Name).Set(float64(*r.Replicas.Min))
		}
		if r.Replicas.Max != nil {
			consumerMaxReplicas.WithLabelValues(key.Namespace, key.Name, r.Name).Set(float64(*r.Replicas.Max))
		}
	}
}

// forgetConsumers drops the replicas series of a policy's consumers.
func forgetConsumers(key types.NamespacedName) {
	match := prometheus.Labels{"namespace": key.Namespace, "policy": key.Name}
	consumerMinReplicas.DeletePartialMatch(match)
	consumerMaxReplicas.DeletePartialMatch(match)
}

// forgetPolicy drops a deleted policy's series.
func forgetPolicy(key types.NamespacedName) {
	for _, s := range allStates {
		stateGauge.DeleteLabelValues(key.Namespace, key.Name, string(s))
	}
	for _, g := range []*prometheus.GaugeVec{limitGauge, capacityGauge, rampStepGauge, publishedTimestamp, staleAfterGauge, consumersBoundedGauge} {
		g.DeleteLabelValues(key.Namespace, key.Name)
	}
	stepBacksTotal.DeleteLabelValues(key.Namespace, key.Name)
	workerProcesses.DeletePartialMatch(prometheus.Labels{"namespace": key.Namespace, "name": key.Name})
	callsByProtocol.DeletePartialMatch(prometheus.Labels{"namespace": key.Namespace, "name": key.Name})
	forgetConsumers(key)
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
