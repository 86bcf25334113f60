// Package status is `spillway status` (and `kubectl spillway status`): one
// row per DependencyPolicy, read from the cluster (the policy's status and
// conditions, its consumers' autoscalers) and from Redis (the published
// state, the live leases and the breaker window's outcomes).
//
// The files, by concern:
//
//   - row.go: Row, what one line says, and the pure functions that build it
//     from what was read (FromCluster, WithRedis);
//   - format.go: the table (narrow and wide), JSON and YAML, pure;
//   - read.go: the I/O, the API server and Redis (Reader);
//   - redis.go: the Redis client, from flags named like the manager's;
//   - command.go: the flags, the kubeconfig and --watch (Run).
package status

import (
	"slices"
	"strconv"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/duration"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// Row is one DependencyPolicy as `spillway status` shows it. The cluster's
// fields are always set; the Redis fields only when Redis answered.
type Row struct {
	// Namespace and Name name the policy.
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// State is status.state: Closed, Open, HalfOpen or Ramping; empty
	// before the first evaluation.
	State string `json:"state"`
	// Limit is status.currentLimit, the fleet-wide concurrency in force.
	Limit int32 `json:"limit"`
	// Capacity is spec.capacity.concurrency.
	Capacity int32 `json:"capacity"`
	// Ramp is the ramp's position; nil unless Ramping.
	Ramp *Ramp `json:"ramp,omitempty"`
	// LastTransitionTime is when the state last changed.
	LastTransitionTime *metav1.Time `json:"lastTransitionTime,omitempty"`
	// Ready is the Ready condition; nil before the first reconcile.
	Ready *Condition `json:"ready,omitempty"`
	// BreakerOpen and Ramping are the conditions of the same types: why
	// the breaker is open, how the ramp goes.
	BreakerOpen *Condition `json:"breakerOpen,omitempty"`
	Ramping     *Condition `json:"ramping,omitempty"`
	// Consumers are the policy's consumers, in spec order.
	Consumers []Consumer `json:"consumers"`
	// Redis is what Redis holds for the policy; nil when Redis was not
	// read (unreachable, or not asked).
	Redis *RedisStatus `json:"redis,omitempty"`
	// RedisError is why Redis could not be read for this policy.
	RedisError string `json:"redisError,omitempty"`
}

// Ramp is where the ramp stands.
type Ramp struct {
	// Step is the current step, from 1; Steps the number of steps.
	Step  int `json:"step"`
	Steps int `json:"steps"`
	// Ceiling is status.rampCeiling, the lowest limit that failed and has
	// not been held clean since; 0 when none.
	Ceiling int32 `json:"ceiling,omitempty"`
}

// Condition is a condition's status, reason and message.
type Condition struct {
	Status  metav1.ConditionStatus `json:"status"`
	Reason  string                 `json:"reason"`
	Message string                 `json:"message,omitempty"`
}

// Consumer is one consumer's autoscaler, or its workload when no autoscaler
// scales it, as Spillway left it.
type Consumer struct {
	// Kind is ScaledObject or HorizontalPodAutoscaler, or the workload's
	// kind (Deployment, StatefulSet, ...) for a scaleTargetRef consumer;
	// Name its name.
	Kind string `json:"kind"`
	Name string `json:"name"`
	// Workload: the consumer is a workload without an autoscaler, and
	// MaxReplicas is its live spec.replicas.
	Workload bool `json:"workload,omitempty"`
	// Bound is whether the autoscaler carries this policy's owner
	// annotation, that is whether Spillway bounds it.
	Bound bool `json:"bound"`
	// MaxReplicas is the autoscaler's live maximum (the bound, when
	// Bound); nil when the autoscaler was not found.
	MaxReplicas *int32 `json:"maxReplicas,omitempty"`
	// PinnedMinReplicas is the minimum Spillway pinned for an outage or a
	// ramp; nil when none is pinned.
	PinnedMinReplicas *int32 `json:"pinnedMinReplicas,omitempty"`
	// Problem says why the consumer is not bound; empty when it is.
	Problem string `json:"problem,omitempty"`
}

// RedisStatus is what Redis holds for one policy.
type RedisStatus struct {
	// Published is false when the controller has not published the policy
	// yet; the other fields are then zero.
	Published bool `json:"published"`
	// State, Limit and Epoch are the published state hash's.
	State string `json:"state,omitempty"`
	Limit int64  `json:"limit"`
	Epoch int64  `json:"epoch"`
	// UpdatedAt is when the controller last published (Redis time).
	UpdatedAt *metav1.Time `json:"updatedAt,omitempty"`
	// InFlight is the number of live leases: calls holding a slot now.
	InFlight int64 `json:"inFlight"`
	// Window is the breaker window the counts below cover.
	Window metav1.Duration `json:"window"`
	// Calls, Failures (failures and timeouts) and Retries are the calls
	// that completed in the window.
	Calls    int64 `json:"calls"`
	Failures int64 `json:"failures"`
	Retries  int64 `json:"retries"`
	// Protocols are the protocol versions the dependency's workers spoke
	// in the last minute, newest first (4: workers of version 4, which do
	// not register, seen by their calls), and Workers says how many
	// processes of each client (protocol.Fleet.Summary); both empty when
	// they could not be read.
	Protocols []int  `json:"protocols,omitempty"`
	Workers   string `json:"workers,omitempty"`
}

// CallsPerSecond is the window's calls over its length.
func (r *RedisStatus) CallsPerSecond() float64 {
	if r.Window.Duration <= 0 {
		return 0
	}
	return float64(r.Calls) / r.Window.Seconds()
}

// FailurePercent is the window's share of failed calls, in percent; false
// when the window holds no call.
func (r *RedisStatus) FailurePercent() (float64, bool) { return percent(r.Failures, r.Calls) }

// RetryPercent is the window's share of calls that were retries, in
// percent; false when the window holds no call.
func (r *RedisStatus) RetryPercent() (float64, bool) { return percent(r.Retries, r.Calls) }

func percent(n, of int64) (float64, bool) {
	if of <= 0 {
		return 0, false
	}
	return 100 * float64(n) / float64(of), true
}

// Autoscalers are a policy's consumers' autoscalers as read, by name; a
// consumer whose autoscaler is absent from its map was not found. KindErr
// is why a kind could not be read at all (KEDA not installed, RBAC).
type Autoscalers struct {
	ScaledObjects map[string]*kedav1alpha1.ScaledObject
	HPAs          map[string]*autoscalingv2.HorizontalPodAutoscaler
	// ScaledObjectsErr and HPAsErr are why the kind could not be read.
	ScaledObjectsErr, HPAsErr error
	// Workloads are the scaleTargetRef consumers' workloads, by
	// "Kind/name"; WorkloadErrs why one could not be read.
	Workloads    map[string]*unstructured.Unstructured
	WorkloadErrs map[string]error
}

// FromCluster is the cluster's part of pol's row: its status, conditions
// and consumers.
func FromCluster(pol *spillwayv1alpha1.DependencyPolicy, as Autoscalers) Row {
	st := pol.Status
	row := Row{
		Namespace:          pol.Namespace,
		Name:               pol.Name,
		State:              string(st.State),
		Limit:              st.CurrentLimit,
		Capacity:           pol.Spec.Capacity.Concurrency,
		LastTransitionTime: st.LastTransitionTime,
		Consumers:          make([]Consumer, 0, len(pol.Spec.Consumers)),
	}
	if st.State == spillwayv1alpha1.StateRamping {
		row.Ramp = &Ramp{Step: int(st.RampStep) + 1, Steps: len(policy.Steps(pol.Spec)), Ceiling: st.RampCeiling}
	}
	row.Ready = condition(st.Conditions, controllers.ConditionReady)
	row.BreakerOpen = condition(st.Conditions, controllers.ConditionBreakerOpen)
	row.Ramping = condition(st.Conditions, controllers.ConditionRamping)
	for _, c := range pol.Spec.Consumers {
		row.Consumers = append(row.Consumers, consumer(pol.Name, c, as))
	}
	return row
}

// condition is the condition of type t in cs; nil when absent.
func condition(cs []metav1.Condition, t string) *Condition {
	c := apimeta.FindStatusCondition(cs, t)
	if c == nil {
		return nil
	}
	return &Condition{Status: c.Status, Reason: c.Reason, Message: c.Message}
}

// Explanation is the condition that says why the policy is where it is:
// Ready while it is not True (Redis unavailable, a consumer not bound, an
// invalid spec); else BreakerOpen while Open or HalfOpen and Ramping while
// Ramping; nil for a Ready policy that is Closed.
func (r Row) Explanation() *Condition {
	if r.Ready != nil && r.Ready.Status != metav1.ConditionTrue {
		return r.Ready
	}
	switch spillwayv1alpha1.DependencyState(r.State) {
	case spillwayv1alpha1.StateOpen, spillwayv1alpha1.StateHalfOpen:
		return r.BreakerOpen
	case spillwayv1alpha1.StateRamping:
		return r.Ramping
	}
	return nil
}

// consumer is how Spillway left c's autoscaler.
func consumer(policyName string, c spillwayv1alpha1.Consumer, as Autoscalers) Consumer {
	if ref := c.ScaleTargetRef; ref != nil {
		out := Consumer{Kind: ref.Kind, Name: ref.Name, Workload: true}
		key := ref.Kind + "/" + ref.Name
		w, ok := as.Workloads[key]
		if !ok {
			return describe(out, policyName, nil, nil, as.WorkloadErrs[key], ref.Kind)
		}
		var replicas *int32
		if n, found, _ := unstructured.NestedInt64(w.Object, "spec", "replicas"); found {
			replicas = ptr(int32(n))
		}
		return describe(out, policyName, w, replicas, nil, "")
	}
	if c.ScaledObjectName != "" {
		out := Consumer{Kind: "ScaledObject", Name: c.ScaledObjectName}
		so, ok := as.ScaledObjects[c.ScaledObjectName]
		if !ok {
			return describe(out, policyName, nil, nil, as.ScaledObjectsErr, "ScaledObjects")
		}
		max := so.Spec.MaxReplicaCount
		if max == nil {
			max = ptr(controllers.KEDADefaultMaxReplicas)
		}
		return describe(out, policyName, so, max, nil, "")
	}
	out := Consumer{Kind: "HorizontalPodAutoscaler", Name: c.HorizontalPodAutoscalerName}
	hpa, ok := as.HPAs[c.HorizontalPodAutoscalerName]
	if !ok {
		return describe(out, policyName, nil, nil, as.HPAsErr, "HorizontalPodAutoscalers")
	}
	return describe(out, policyName, hpa, ptr(hpa.Spec.MaxReplicas), nil, "")
}

// describe fills out from the autoscaler obj (nil when not found).
func describe(out Consumer, policyName string, obj metav1.Object, max *int32, kindErr error, kindName string) Consumer {
	switch {
	case kindErr != nil:
		out.Problem = "cannot read " + kindName + ": " + kindErr.Error()
		return out
	case obj == nil:
		out.Problem = "not found"
		return out
	}
	out.MaxReplicas = max
	ann := obj.GetAnnotations()
	switch owner := ann[controllers.AnnotationOwner]; owner {
	case policyName:
		out.Bound = true
	case "":
		out.Problem = "not bound"
	default:
		out.Problem = "bound by policy " + owner
	}
	if out.Bound {
		if n, err := strconv.ParseInt(ann[controllers.AnnotationPinnedMinReplicas], 10, 32); err == nil {
			out.PinnedMinReplicas = ptr(int32(n))
		}
	}
	return out
}

// WithRedis adds what Redis holds to row: the published state, the live
// leases counted at Redis time now, and the window's outcomes.
func WithRedis(row Row, published protocol.Published, ok bool, inFlight int64, window protocol.Window) Row {
	r := &RedisStatus{Published: ok}
	if ok {
		r.State = string(published.State)
		r.Limit = published.Limit
		r.Epoch = published.Epoch
		if !published.UpdatedAt.IsZero() {
			r.UpdatedAt = &metav1.Time{Time: published.UpdatedAt}
		}
		r.InFlight = inFlight
		r.Window = metav1.Duration{Duration: published.BreakerWindow}
		r.Calls = window.Calls
		r.Failures = window.Failures + window.Timeouts
		r.Retries = window.Retries()
	}
	row.Redis = r
	row.RedisError = ""
	return row
}

// WithFleet adds to row which protocol versions the dependency's workers
// speak.
func WithFleet(row Row, f protocol.Fleet) Row {
	if row.Redis == nil {
		return row
	}
	vs := f.Versions()
	slices.Reverse(vs)
	row.Redis.Protocols = vs
	row.Redis.Workers = f.Summary()
	return row
}

// Age is how long ago t was, from now, kubectl's way ("5m", "3h2m"); "-"
// when t is nil.
func Age(t *metav1.Time, now time.Time) string {
	if t == nil || t.IsZero() {
		return "-"
	}
	return duration.HumanDuration(now.Sub(t.Time))
}

func ptr[T any](v T) *T { return &v }
