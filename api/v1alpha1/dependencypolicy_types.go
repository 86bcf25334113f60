package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// DependencyPolicyKind is the kind of the DependencyPolicy object.
const DependencyPolicyKind = "DependencyPolicy"

// DependencyPolicySpec declares how much load a fleet of workers may put on one
// dependency, how the fleet recovers after the dependency fails, and which
// autoscaled workloads call it.
//
// +kubebuilder:validation:XValidation:rule="!has(self.ramp) || !has(self.ramp.steps) || self.ramp.steps.all(s, s <= self.capacity.concurrency)",message="every ramp step must be at most capacity.concurrency",fieldPath=".ramp.steps"
// +kubebuilder:validation:XValidation:rule="!has(self.ramp) || !has(self.ramp.earlyClimb) || !self.ramp.earlyClimb || !has(self.ramp.stepBack) || !has(self.ramp.stepBack.when) || self.ramp.stepBack.when != 'Never'",message="ramp.earlyClimb needs ramp.stepBack.when Ramping or Always: a step climbs early only on the step-back rule's proof",fieldPath=".ramp.earlyClimb"
// +kubebuilder:validation:XValidation:rule="!has(self.ramp) || !has(self.ramp.stepBack) || !has(self.ramp.stepBack.failureRatio) || self.ramp.stepBack.failureRatio < (has(self.breaker) && has(self.breaker.failureRatio) ? self.breaker.failureRatio : 0.5)",message="ramp.stepBack.failureRatio must be below breaker.failureRatio: the ramp steps back on a partial failure, before the breaker opens",fieldPath=".ramp.stepBack.failureRatio"
type DependencyPolicySpec struct {
	// capacity is what the dependency can serve, for the whole fleet together.
	// It is the limit in force once the breaker is closed and the ramp is done.
	// +required
	Capacity Capacity `json:"capacity"`

	// ramp is the slow start the fleet follows after the breaker closes: the
	// limit starts at the first step and climbs one step per clean stepDuration
	// (sooner when stepBack is on and the step's own calls prove it clean).
	// When omitted, the steps are derived from capacity.concurrency as
	// c/8, c/4, c/2 and c (values below 1 and repeats dropped), one per minute.
	// +kubebuilder:default={}
	// +optional
	Ramp Ramp `json:"ramp,omitempty"`

	// breaker configures the fleet-wide circuit breaker that the controller runs
	// on the outcomes workers report.
	// +kubebuilder:default={}
	// +optional
	Breaker Breaker `json:"breaker,omitempty"`

	// signals are what the breaker opens on besides the outcomes workers
	// report: a Prometheus query for the dependency's error ratio. When
	// omitted, the breaker runs on the workers' outcomes alone.
	// +optional
	Signals *Signals `json:"signals,omitempty"`

	// retryBudget bounds retries to a share of recent calls, across the fleet.
	// Over budget, a failing job is parked for a long jittered delay instead of
	// retried.
	// +kubebuilder:default={}
	// +optional
	RetryBudget RetryBudget `json:"retryBudget,omitempty"`

	// backoff is the retry timing workers use. Workers read it from Redis at
	// each failure, so a change applies to the fleet without a redeploy.
	// +kubebuilder:default={}
	// +optional
	Backoff Backoff `json:"backoff,omitempty"`

	// consumers are the workloads, in this policy's namespace, that call the
	// dependency, each named by its autoscaler (a KEDA ScaledObject or an
	// autoscaling/v2 HorizontalPodAutoscaler) or, when no autoscaler scales
	// it, by itself (scaleTargetRef). The controller bounds an autoscaler's
	// maximum replicas to the dependency's capacity and pins its minimum
	// during outages; it scales a workload without an autoscaler down to the
	// bound. Each consumer appears once. The list is atomic: a scaleTargetRef
	// cannot be a list-map key, so one field manager owns the whole list.
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:XValidation:rule="self.all(x, self.exists_one(y, y.scaledObjectName == x.scaledObjectName && y.horizontalPodAutoscalerName == x.horizontalPodAutoscalerName && (has(y.scaleTargetRef) ? y.scaleTargetRef.kind + '/' + y.scaleTargetRef.name : '') == (has(x.scaleTargetRef) ? x.scaleTargetRef.kind + '/' + x.scaleTargetRef.name : '')))",message="each consumer appears once: two consumers name the same ScaledObject, HorizontalPodAutoscaler or scaleTargetRef kind and name"
	// +optional
	Consumers []Consumer `json:"consumers,omitempty"`

	// pinMinReplicasDuringOutage keeps each consumer's minReplicaCount at the
	// replicas its workload had when the outage began, while the state is Open,
	// HalfOpen or Ramping, so the autoscaler neither scales in during the outage
	// nor during the ramp (when throttled workers look idle), and the ramp does
	// not reach full capacity with too few pods. The user's minimum comes back
	// when the state is Closed. Defaults to true.
	// +kubebuilder:default=true
	// +optional
	PinMinReplicasDuringOutage *bool `json:"pinMinReplicasDuringOutage,omitempty"`
}

// Capacity is what the dependency can serve.
type Capacity struct {
	// concurrency is the number of in-flight calls the whole fleet may make to
	// the dependency at once.
	// +kubebuilder:validation:Minimum=1
	// +required
	Concurrency int32 `json:"concurrency"`

	// ratePerSecond is the number of calls per second the whole fleet may start,
	// at most 1000000 (workers space calls in whole microseconds). When
	// omitted, only concurrency limits the fleet.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	RatePerSecond *int32 `json:"ratePerSecond,omitempty"`
}

// Ramp is the slow-start schedule after recovery.
type Ramp struct {
	// steps are the concurrency limits the fleet climbs through after the
	// breaker closes, strictly increasing, each between 1 and
	// capacity.concurrency. If the last step is below capacity.concurrency, the
	// full capacity follows it as a final step. When omitted, the steps are
	// derived from capacity.concurrency as c/8, c/4, c/2 and c.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:Minimum=1
	// +kubebuilder:validation:XValidation:rule="self.isSorted() && self.all(s, self.indexOf(s) == self.lastIndexOf(s))",message="ramp steps must be strictly increasing"
	// +listType=atomic
	// +optional
	Steps []int32 `json:"steps,omitempty"`

	// stepDuration is how long the breaker must stay closed at one step before
	// the limit moves up to the next, between 1s and 24h. Defaults to 1m. It is
	// a floor: no step is left before it has lasted stepDuration, unless
	// earlyClimb is set.
	// +kubebuilder:default="1m"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1s') && duration(self) <= duration('24h')",message="stepDuration must be a duration between 1s and 24h, such as 1m or 90s"
	// +optional
	StepDuration metav1.Duration `json:"stepDuration,omitzero"`

	// stepBack is the rule that makes the ramp listen to the outcomes of each
	// step: a step whose calls fail more than stepBack.failureRatio steps back
	// before the breaker opens, and the limit that failed is tried again only
	// after a longer clean hold. The defaults work without tuning.
	// +kubebuilder:default={}
	// +optional
	StepBack RampStepBack `json:"stepBack,omitempty"`

	// earlyClimb lets a step whose own calls prove it clean (1/stepBack.failureRatio
	// calls, 100 by default, and not one failure) move up after a quarter of
	// stepDuration (at most 10s) instead of a whole stepDuration, unless the
	// next limit is a ceiling. It needs stepBack on. The risk: a dependency
	// that is still cold (caches, connection pools, JIT) answers its first
	// calls at a low limit well, and the ramp reaches a limit it cannot serve
	// before the cold start is over; if it falls over there rather than
	// failing partially, the breaker opens. Leave it off for a dependency
	// whose cold start outlasts a few quarter steps. Defaults to false.
	// +optional
	EarlyClimb bool `json:"earlyClimb,omitempty"`

	// warmFor is the longest outage after which the dependency is still warm,
	// between 1s and 1h: when the breaker closes less than warmFor after it
	// opened, the fleet goes straight back to full capacity instead of climbing
	// the steps. Set it for a dependency whose short blips (a restart, a
	// failover, a deploy) leave its caches warm. An outage that began during
	// the ramp, or right after it, always ramps. When omitted, every outage
	// ramps.
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1s') && duration(self) <= duration('1h')",message="warmFor must be a duration between 1s and 1h, such as 45s or 2m"
	// +optional
	WarmFor *metav1.Duration `json:"warmFor,omitempty"`
}

// StepBackWhen says when the ramp's step-back rule applies.
// +kubebuilder:validation:Enum=Never;Ramping;Always
type StepBackWhen string

const (
	// StepBackNever is a fixed schedule: one step up per stepDuration,
	// whatever the outcomes; only the breaker stops the ramp.
	StepBackNever StepBackWhen = "Never"
	// StepBackRamping holds and steps back while the ramp climbs, up to and
	// including its first stepDuration at full capacity.
	StepBackRamping StepBackWhen = "Ramping"
	// StepBackAlways also steps back from full capacity at any time, as
	// capacity discovery: a dependency that fails partially at
	// capacity.concurrency gets the ramp back, below the limit that failed.
	StepBackAlways StepBackWhen = "Always"
)

// RampStepBack is the ramp's step-back rule. Each step is judged on its own
// calls and failures (failures and timeouts), counted since the step started
// and over at most the breaker window. The step steps back when it holds at
// least minFailures failures and the failure ratio is at least failureRatio
// with 95% confidence (the lower bound of the one-sided Wilson score
// interval); it holds, without moving up, while the observed failure ratio is
// at least failureRatio; and it moves up after a clean stepDuration, or early
// once its calls prove it clean (see stepDuration). A step
// back goes to the previous step; from the first step, to the highest power
// of two below it, then on down by halves to 1 (the ramp climbs back by
// doubling). The limit that failed is a ceiling: the ramp moves up to it
// again only after stepDuration × 2^n clean, n being the step backs since the
// ceiling was last held clean, at most 8 × stepDuration. The first quarter of
// stepDuration (at most 10s) after a step back is not judged: calls admitted
// under the higher limit end then.
type RampStepBack struct {
	// when is Never, Ramping or Always. Ramping applies the rule while the
	// ramp climbs, up to and including the first stepDuration at full
	// capacity; Always also at full capacity later on (capacity discovery);
	// Never is a fixed schedule. Defaults to Ramping.
	// +kubebuilder:default=Ramping
	// +optional
	When StepBackWhen `json:"when,omitempty"`

	// failureRatio is the share of failed calls a step must stay below, in
	// (0, breaker.failureRatio). Set it above the dependency's normal failure
	// ratio. Defaults to 0.01.
	// +kubebuilder:default=0.01
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +kubebuilder:validation:Maximum=1
	// +kubebuilder:validation:ExclusiveMaximum=true
	// +optional
	FailureRatio float64 `json:"failureRatio,omitempty"`

	// minFailures is the fewest failures that can step back, so that a
	// single failure at low traffic never does, between 1 and 1000000.
	// Defaults to 3.
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	MinFailures int32 `json:"minFailures,omitempty"`
}

// Breaker configures the fleet-wide circuit breaker.
type Breaker struct {
	// failureRatio is the share of failed calls (failures and timeouts over all
	// calls in the window) at or above which the breaker opens, in (0, 1].
	// Defaults to 0.5.
	// +kubebuilder:default=0.5
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +kubebuilder:validation:Maximum=1
	// +optional
	FailureRatio float64 `json:"failureRatio,omitempty"`

	// minCalls is the number of calls the window must hold before the failure
	// ratio can open the breaker, so a handful of failures at low traffic does
	// not. At most 1000000. Defaults to 20.
	// +kubebuilder:default=20
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	MinCalls int32 `json:"minCalls,omitempty"`

	// window is how far back the controller counts calls and failures, between
	// 1s and 1h, rounded up to whole seconds. Defaults to 30s.
	// +kubebuilder:default="30s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1s') && duration(self) <= duration('1h')",message="window must be a duration between 1s and 1h, such as 30s"
	// +optional
	Window metav1.Duration `json:"window,omitzero"`

	// openDuration is how long the breaker stays open, with no calls admitted,
	// before it lets probe calls through, between 1s and 24h. Probes are
	// halfOpenProbes calls for the whole fleet, so a short openDuration costs
	// the dependency little during a long outage and lets the fleet back
	// soon after a short one: on average openDuration/2 after the dependency
	// recovers. Defaults to 10s.
	// +kubebuilder:default="10s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1s') && duration(self) <= duration('24h')",message="openDuration must be a duration between 1s and 24h, such as 60s"
	// +optional
	OpenDuration metav1.Duration `json:"openDuration,omitzero"`

	// halfOpenProbes is the number of probe calls admitted while half open; the
	// breaker closes once that many have succeeded with no failure among them,
	// and reopens on the first failure. A value above capacity.concurrency
	// admits capacity.concurrency probes. Defaults to 3.
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +optional
	HalfOpenProbes int32 `json:"halfOpenProbes,omitempty"`
}

// RetryBudget bounds retries, across the fleet, to a share of recent calls: a
// retry is allowed only while retries < max(minRetries, ratio × calls) over the
// window.
type RetryBudget struct {
	// ratio is the share of recent calls that may be retries, in (0, 1].
	// Defaults to 0.2.
	// +kubebuilder:default=0.2
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +kubebuilder:validation:Maximum=1
	// +optional
	Ratio float64 `json:"ratio,omitempty"`

	// minRetries is the number of retries allowed in any window whatever the
	// traffic, so a quiet dependency can still be retried. Defaults to 10.
	// +kubebuilder:default=10
	// +kubebuilder:validation:Minimum=0
	// +optional
	MinRetries *int32 `json:"minRetries,omitempty"`

	// window is how far back calls and retries are counted, between 1s and 1h,
	// rounded up to whole seconds. Defaults to 60s.
	// +kubebuilder:default="60s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1s') && duration(self) <= duration('1h')",message="window must be a duration between 1s and 1h, such as 60s"
	// +optional
	Window metav1.Duration `json:"window,omitzero"`
}

// JitterMode is how a retry delay is randomised below its exponential ceiling.
// +kubebuilder:validation:Enum=Full;Equal;None
type JitterMode string

const (
	// JitterFull draws the delay uniformly from zero to the ceiling, spreading a
	// cohort of retries over the whole interval.
	JitterFull JitterMode = "Full"
	// JitterEqual waits half the ceiling plus a uniform draw over the other half.
	JitterEqual JitterMode = "Equal"
	// JitterNone waits exactly the ceiling; retries that failed together stay
	// together.
	JitterNone JitterMode = "None"
)

// Backoff is capped exponential backoff: the ceiling for attempt n is
// min(max, base × 2^(n-1)).
//
// +kubebuilder:validation:XValidation:rule="!has(self.base) || !has(self.max) || !self.base.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || !self.max.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') || duration(self.base) <= duration(self.max)",message="backoff.base must be at most backoff.max"
type Backoff struct {
	// base is the ceiling after the first failed attempt, between 1ms and 24h
	// and at most max. Defaults to 1s.
	// +kubebuilder:default="1s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1ms') && duration(self) <= duration('24h')",message="base must be a duration between 1ms and 24h, such as 1s or 500ms"
	// +optional
	Base metav1.Duration `json:"base,omitzero"`

	// max caps the ceiling, at most 24h; it is also the base of the parking
	// delay used over the retry budget. Defaults to 5m.
	// +kubebuilder:default="5m"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$') && duration(self) >= duration('1ms') && duration(self) <= duration('24h')",message="max must be a duration between 1ms and 24h, such as 5m"
	// +optional
	Max metav1.Duration `json:"max,omitzero"`

	// jitter is Full, Equal or None. Defaults to Full.
	// +kubebuilder:default=Full
	// +optional
	Jitter JitterMode `json:"jitter,omitempty"`
}

// Consumer is a workload that calls the dependency, named by exactly one of:
// its KEDA ScaledObject (scaledObjectName), its autoscaling/v2
// HorizontalPodAutoscaler (horizontalPodAutoscalerName), or, for a workload
// whose replicas a person, a GitOps manifest or a CI job sets, the workload
// itself (scaleTargetRef). Spillway bounds a ScaledObject's
// spec.maxReplicaCount and pins its spec.minReplicaCount; an HPA's
// spec.maxReplicas and spec.minReplicas; a workload's replicas, through its
// scale subresource. An HPA that KEDA made for a ScaledObject (keda-hpa-*)
// cannot be a consumer: name the ScaledObject instead. Nor can a workload
// that an HPA or a ScaledObject scales: name the autoscaler instead.
//
// +kubebuilder:validation:XValidation:rule="[has(self.scaledObjectName) && size(self.scaledObjectName) > 0, has(self.horizontalPodAutoscalerName) && size(self.horizontalPodAutoscalerName) > 0, has(self.scaleTargetRef)].filter(b, b).size() == 1",message="a consumer names exactly one of scaledObjectName, horizontalPodAutoscalerName and scaleTargetRef"
type Consumer struct {
	// scaledObjectName is the name of a KEDA ScaledObject in the policy's
	// namespace. Unique within the list. Empty (the default) when the
	// consumer is an HPA.
	// +kubebuilder:default=""
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$`
	// +optional
	ScaledObjectName string `json:"scaledObjectName,omitempty"`

	// horizontalPodAutoscalerName is the name of an autoscaling/v2
	// HorizontalPodAutoscaler in the policy's namespace, one that no
	// ScaledObject owns. Unique within the list. Empty (the default) when the
	// consumer is a ScaledObject.
	// +kubebuilder:default=""
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$`
	// +optional
	HorizontalPodAutoscalerName string `json:"horizontalPodAutoscalerName,omitempty"`

	// scaleTargetRef names a workload in the policy's namespace that no
	// autoscaler scales and that has a scale subresource: a Deployment, a
	// StatefulSet, a ReplicaSet or a custom resource such as an Argo
	// Rollout, in the shape of an HPA's scaleTargetRef. Spillway scales it
	// down to the bound through its scale subresource, records its own
	// replicas in the spillway.dev/original-replicas annotation and puts them
	// back when the consumer leaves the policy. Absent when the consumer is a
	// ScaledObject or an HPA.
	// +optional
	ScaleTargetRef *ScaleTargetRef `json:"scaleTargetRef,omitempty"`

	// slotsPerReplica is the number of concurrent calls one replica of the
	// workload makes to the dependency, at most 10000. Defaults to 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10000
	// +optional
	SlotsPerReplica int32 `json:"slotsPerReplica,omitempty"`

	// weight is this consumer's share of the capacity relative to the other
	// consumers, at most 1000. Defaults to 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +optional
	Weight int32 `json:"weight,omitempty"`

	// limitedBy is how the workload's calls are held to the dependency's
	// limit: Library when its workers use the Spillway library (the bound on
	// its replicas, a ScaledObject's maxReplicaCount, an HPA's maxReplicas
	// or a scaleTargetRef's replicas, is the consumer's share of the
	// capacity), or
	// Replicas when they do not, so the bound follows the limit in force (the
	// ramp step while Ramping, the first step while Open or HalfOpen) and the
	// workload's concurrency follows the ramp through its replica count.
	// Defaults to Library.
	// +kubebuilder:default=Library
	// +optional
	LimitedBy LimitedBy `json:"limitedBy,omitempty"`
}

// ScaleTargetRef names a workload with a scale subresource, as an
// autoscaling/v2 HorizontalPodAutoscaler's spec.scaleTargetRef does.
type ScaleTargetRef struct {
	// apiVersion is the workload's API group and version, such as apps/v1
	// or argoproj.io/v1alpha1. Defaults to apps/v1.
	// +kubebuilder:default="apps/v1"
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=317
	// +optional
	APIVersion string `json:"apiVersion,omitempty"`

	// kind is the workload's kind, such as Deployment, StatefulSet,
	// ReplicaSet or Rollout.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[A-Z][A-Za-z0-9]*$`
	// +required
	Kind string `json:"kind"`

	// name is the workload's name in the policy's namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +required
	Name string `json:"name"`
}

// DependencyState is the fleet's state for one dependency, as the controller
// decides it and workers enforce it: the breaker's three states, and Ramping,
// a Closed breaker whose slow start is not done (not a breaker state, hence
// the name). The Go side of the wire is pkg/wire.State, with the same strings.
// +kubebuilder:validation:Enum=Closed;Open;HalfOpen;Ramping
type DependencyState string

const (
	// StateClosed admits calls up to the full capacity.
	StateClosed DependencyState = "Closed"
	// StateOpen admits no calls: workers fail fast.
	StateOpen DependencyState = "Open"
	// StateHalfOpen admits only breaker.halfOpenProbes probe calls.
	StateHalfOpen DependencyState = "HalfOpen"
	// StateRamping admits calls up to the current ramp step.
	StateRamping DependencyState = "Ramping"
)

// ObservedWindow is what the workers reported over the breaker window.
type ObservedWindow struct {
	// calls is the number of calls that completed in the window.
	// +optional
	Calls int64 `json:"calls"`

	// failures is the number of those calls that failed or timed out.
	// +optional
	Failures int64 `json:"failures"`

	// retries is the number of those calls that were retries.
	// +optional
	Retries int64 `json:"retries"`

	// observedAt is when the controller read these counts. The controller
	// evaluates every second but writes the window to status only along with
	// a change of the state, the limit, the ramp step or a condition, or when
	// the counts changed and observedAt is older than its status interval
	// (10s by default, spread over its second half per policy).
	// +optional
	ObservedAt *metav1.Time `json:"observedAt,omitempty"`
}

// DependencyPolicyStatus is the state the controller last decided.
type DependencyPolicyStatus struct {
	// observedGeneration is the generation of the spec the controller last
	// acted on: published to Redis, or found unusable (Stalled).
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// state is Closed, Open, HalfOpen or Ramping.
	// +optional
	State DependencyState `json:"state,omitempty"`

	// currentLimit is the fleet-wide concurrency limit in force: 0 while Open,
	// breaker.halfOpenProbes while HalfOpen, the current step while Ramping and
	// capacity.concurrency while Closed.
	// +optional
	CurrentLimit int32 `json:"currentLimit"`

	// rampStep is the index of the current ramp step, from 0.
	// +optional
	RampStep int32 `json:"rampStep"`

	// rampCeiling is the lowest ramp limit that failed (ramp.stepBack) and
	// has not been held clean since; the ramp moves up to it again only
	// after a longer hold. Absent when none.
	// +optional
	RampCeiling int32 `json:"rampCeiling,omitempty"`

	// lastTransitionTime is when state last changed.
	// +optional
	LastTransitionTime *metav1.Time `json:"lastTransitionTime,omitempty"`

	// window is what workers reported over the last breaker window.
	// +optional
	Window ObservedWindow `json:"window,omitempty"`

	// workloads are the workloads without an autoscaler (scaleTargetRef
	// consumers) whose replicas the controller may have lowered: those the
	// spec names, and those it has not yet given their replicas back after
	// they left the spec. The controller finds them here to let go of them.
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=64
	// +optional
	Workloads []ScaleTargetRef `json:"workloads,omitempty"`

	// conditions are Ready, BreakerOpen, Ramping, ConsumersBounded,
	// SignalsHealthy when the policy names a Prometheus signal and, while the
	// spec cannot be used, Stalled.
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=16
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// DependencyPolicy declares the capacity of one dependency and how a fleet of
// workers recovers after it fails, so that the recovery does not cause a
// second outage.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=dpol,categories=spillway
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.status.state`
// +kubebuilder:printcolumn:name="Limit",type=integer,JSONPath=`.status.currentLimit`
// +kubebuilder:printcolumn:name="Capacity",type=integer,JSONPath=`.spec.capacity.concurrency`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type DependencyPolicy struct {
	metav1.TypeMeta `json:",inline"`

	// metadata is the standard object metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec declares the dependency's capacity and the recovery policy.
	// +required
	Spec DependencyPolicySpec `json:"spec"`

	// status is what the controller last decided and observed.
	// +optional
	Status DependencyPolicyStatus `json:"status,omitempty"`
}

// DependencyPolicyList is a list of DependencyPolicy objects.
//
// +kubebuilder:object:root=true
type DependencyPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []DependencyPolicy `json:"items"`
}

func init() {
	SchemeBuilder.Register(&DependencyPolicy{}, &DependencyPolicyList{})
}
