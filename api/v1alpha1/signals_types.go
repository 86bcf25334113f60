package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Signals are what the breaker opens on besides the outcomes workers report
// through the Spillway library.
type Signals struct {
	// prometheus is a Prometheus query that yields the dependency's error
	// ratio, for callers that do not use the Spillway library or errors best
	// seen on the dependency's own metrics. The breaker opens when either the
	// workers' outcomes or this ratio reach breaker.failureRatio. A query
	// that fails, or a Prometheus that cannot be reached, never opens the
	// breaker by itself: it sets the SignalsHealthy condition False (and
	// Ready False) and emits an Event, and the breaker goes on with the
	// workers' outcomes alone.
	// +optional
	Prometheus *PrometheusSignal `json:"prometheus,omitempty"`
}

// PrometheusSignal is a Prometheus server and the queries that measure the
// dependency on it.
//
// +kubebuilder:validation:XValidation:rule="!has(self.interval) || !has(self.timeout) || !self.interval.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || !self.timeout.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || duration(self.timeout) <= duration(self.interval)",message="prometheus.timeout must be at most prometheus.interval"
type PrometheusSignal struct {
	// address is the base URL of the Prometheus HTTP API, such as
	// http://prometheus.monitoring:9090, http or https; the controller
	// appends /api/v1/query.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="isURL(self) && (url(self).getScheme() == 'http' || url(self).getScheme() == 'https') && url(self).getHost() != ''",message="address must be an http or https URL, such as http://prometheus.monitoring:9090"
	// +required
	Address string `json:"address"`

	// errorRatioQuery is a PromQL instant query that yields the dependency's
	// error ratio, between 0 and 1, over the breaker window: one sample or a
	// scalar, such as
	// sum(rate(http_requests_total{job="template-api",code=~"5.."}[30s])) /
	// sum(rate(http_requests_total{job="template-api"}[30s])). An empty
	// result (no traffic: 0/0 is NaN) is no data, which never opens the
	// breaker.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=4096
	// +kubebuilder:validation:XValidation:rule="self.trim().size() > 0",message="errorRatioQuery must not be empty"
	// +required
	ErrorRatioQuery string `json:"errorRatioQuery"`

	// rateQuery is a PromQL instant query that yields the dependency's
	// request rate, in requests per second, over the breaker window, such as
	// sum(rate(http_requests_total{job="template-api"}[30s])). The ratio
	// counts as rate × breaker.window calls, so breaker.minCalls applies to
	// it as it does to the workers' outcomes, and breaker.halfOpenProbes
	// calls are needed to close a half-open breaker. When omitted, every
	// ratio counts whatever the traffic: guard the query against low traffic
	// yourself (for example "... and sum(rate(...)) > 1").
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=4096
	// +kubebuilder:validation:XValidation:rule="self.trim().size() > 0",message="rateQuery must not be empty when set"
	// +optional
	RateQuery string `json:"rateQuery,omitempty"`

	// credentialsSecretRef names a Secret in the policy's namespace holding
	// the credentials Prometheus requires: a bearer token under the key
	// "token", or "username" and "password" for basic authentication. When
	// omitted, the queries are sent without credentials.
	// +optional
	CredentialsSecretRef *SecretReference `json:"credentialsSecretRef,omitempty"`

	// interval is how often the controller runs the queries, between 1s and
	// 10m. Defaults to 15s.
	// +kubebuilder:default="15s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1s') && duration(self) <= duration('10m')",message="interval must be a duration between 1s and 10m, such as 15s"
	// +optional
	Interval metav1.Duration `json:"interval,omitzero"`

	// timeout bounds each query, between 100ms and 1m and at most interval.
	// A query that times out is a failed query. Defaults to 5s.
	// +kubebuilder:default="5s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('100ms') && duration(self) <= duration('1m')",message="timeout must be a duration between 100ms and 1m, such as 5s"
	// +optional
	Timeout metav1.Duration `json:"timeout,omitzero"`
}

// SecretReference names a Secret in the policy's namespace.
type SecretReference struct {
	// name is the Secret's name.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +required
	Name string `json:"name"`
}

// LimitedBy is how a consumer's calls are held to the dependency's limit.
// +kubebuilder:validation:Enum=Library;Replicas
type LimitedBy string

const (
	// LimitedByLibrary: the workload's workers call the dependency through
	// the Spillway library, which holds the fleet-wide slots, rate and retry
	// budget at every call. Its maximum replicas (a ScaledObject's
	// maxReplicaCount, an HPA's maxReplicas) are bounded by the consumer's
	// share of the capacity.
	LimitedByLibrary LimitedBy = "Library"
	// LimitedByReplicas: the workload does not use the library, so its
	// concurrency is its replica count × slotsPerReplica and the replica
	// count is the only lever. Its maximum replicas are bounded by the
	// consumer's share of the limit in force: the current ramp step while Ramping, the
	// first ramp step while Open or HalfOpen (the fleet is held at the size
	// the ramp restarts from), the capacity while Closed.
	LimitedByReplicas LimitedBy = "Replicas"
)
