package controllers

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Condition types of a DependencyPolicy.
const (
	// ConditionReady is True when the controller evaluated the policy and
	// published the result to Redis on its last attempt, and every consumer
	// is bounded (ConsumersBounded is not False). It is the condition
	// `kubectl get dpol` shows as READY.
	ConditionReady = "Ready"
	// ConditionBreakerOpen is True while the breaker is Open or HalfOpen.
	ConditionBreakerOpen = "BreakerOpen"
	// ConditionRamping is True while the limit climbs back to the capacity.
	ConditionRamping = "Ramping"
	// ConditionConsumersBounded is True when every consumer's autoscaler is
	// bounded as the policy says.
	ConditionConsumersBounded = "ConsumersBounded"
	// ConditionStalled is True, with ReasonLastStateKept or
	// ReasonInvalidSpec, while the spec cannot be turned into a policy: the
	// controller makes no progress until the spec changes. It is absent
	// otherwise.
	ConditionStalled = "Stalled"
	// ConditionWorkersServed is True while every worker process that
	// registered for the dependency in the last minute speaks a protocol
	// version this manager serves (protocol.Served: one older, its own, one
	// newer), False with ReasonUnservedWorkers when one does not: those
	// workers defer every call until their library or the manager is
	// upgraded (docs/operations.md, Upgrading). The message says which
	// versions the fleet speaks. Absent until the evaluator has read it.
	ConditionWorkersServed = "WorkersServed"
)

// Reasons of the WorkersServed condition.
const (
	// ReasonWorkerVersionsServed (True): every worker seen speaks a served
	// version.
	ReasonWorkerVersionsServed = "WorkerVersionsServed"
	// ReasonUnservedWorkers (False): some registered worker processes speak
	// a protocol version this manager does not serve.
	ReasonUnservedWorkers = "UnservedWorkers"
)

// Reasons of the Ready condition.
const (
	// ReasonEvaluated (True): the state was evaluated and published.
	ReasonEvaluated = "Evaluated"
	// ReasonRedisUnavailable (False): Redis could not be read or written. The
	// limit workers enforce stays at what was last published; the controller
	// retries with backoff and continues from what Redis holds.
	ReasonRedisUnavailable = "RedisUnavailable"
	// ReasonInvalidSpec (False; Stalled True): the spec cannot be turned into
	// a policy. The controller publishes nothing until the spec changes: the
	// fleet keeps the state last published (Stalled's reason is then
	// ReasonLastStateKept), or, with none in Redis, workers defer their calls.
	ReasonInvalidSpec = "InvalidSpec"
	// ReasonLastStateKept (Stalled True): the spec cannot be turned into a
	// policy and the fleet keeps the state last published, which the message
	// names: Closed and Ramping keep their limit; Open and HalfOpen, no longer
	// refreshed, admit the dead-man trickle (halfOpenProbes calls at a time)
	// once their dead-man bound has passed (docs/protocol.md §7).
	ReasonLastStateKept = "LastStateKept"
	// ReasonStaleEpoch (False): Redis holds a newer epoch than this controller
	// decided from, because another controller published meanwhile. The
	// controller evaluates again from what Redis holds.
	ReasonStaleEpoch = "StaleEpoch"
	// ReasonNotEvaluated (Unknown), for Ready, BreakerOpen and Ramping: the
	// policy has not been evaluated yet.
	ReasonNotEvaluated = "NotEvaluated"
	// ReasonReleasePending (False): the policy is being deleted and the
	// controller waits to publish its fleet Closed at full capacity in Redis
	// before it removes the finalizer.
	ReasonReleasePending = "ReleasePending"
)

// Reasons of the BreakerOpen condition.
const (
	// ReasonFailureRatioExceeded (True): the breaker is Open; no calls are
	// admitted until it half-opens.
	ReasonFailureRatioExceeded = "FailureRatioExceeded"
	// ReasonProbing (True): the breaker is HalfOpen; a few probe calls test
	// the dependency.
	ReasonProbing = "Probing"
	// ReasonBreakerClosed (False): the breaker is closed.
	ReasonBreakerClosed = "BreakerClosed"
)

// Reasons of the Ramping condition.
const (
	// ReasonRampInProgress (True): the breaker closed and the limit is below
	// the capacity, climbing one step per clean stepDuration.
	ReasonRampInProgress = "RampInProgress"
	// ReasonSteppedBack (True): the ramp stepped back from a limit whose calls
	// failed more than ramp.stepBack allows (status.rampCeiling); it climbs
	// again, and tries that limit again after a longer clean hold.
	ReasonSteppedBack = "SteppedBack"
	// ReasonRampComplete (False): the limit is the full capacity.
	ReasonRampComplete = "RampComplete"
	// ReasonAwaitingRecovery (False): the breaker is Open or HalfOpen; the
	// ramp starts when it closes.
	ReasonAwaitingRecovery = "AwaitingRecovery"
)

// Reasons of the ConsumersBounded condition. When several consumers fail,
// the reason is the first failing consumer's, in spec order, and the message
// names every failing consumer.
const (
	// ReasonBounded (True): every consumer's maxReplicaCount is bounded (and
	// its minReplicaCount pinned during an outage).
	ReasonBounded = "Bounded"
	// ReasonNoConsumers (True): the policy names no consumers.
	ReasonNoConsumers = "NoConsumers"
	// ReasonScaledObjectNotFound (False): a consumer's ScaledObject does not
	// exist in the policy's namespace. Consumers can only name ScaledObjects
	// in the policy's own namespace: the name pattern forbids '/'.
	ReasonScaledObjectNotFound = "ScaledObjectNotFound"
	// ReasonHorizontalPodAutoscalerNotFound (False): a consumer's
	// HorizontalPodAutoscaler does not exist in the policy's namespace.
	ReasonHorizontalPodAutoscalerNotFound = "HorizontalPodAutoscalerNotFound"
	// ReasonOwnedByScaledObject (False): a consumer names an HPA that a KEDA
	// ScaledObject owns (KEDA's keda-hpa-<name>). KEDA writes that HPA's
	// replicas from the ScaledObject, so Spillway leaves it alone: name the
	// ScaledObject as the consumer instead.
	ReasonOwnedByScaledObject = "OwnedByScaledObject"
	// ReasonOwnedByHorizontalPodAutoscaler (False): a consumer's
	// scaleTargetRef names a workload that an HPA scales, and the HPA would
	// undo any replicas Spillway set: name the HPA as the consumer instead.
	// (A workload a ScaledObject scales is refused with
	// ReasonOwnedByScaledObject.)
	ReasonOwnedByHorizontalPodAutoscaler = "OwnedByHorizontalPodAutoscaler"
	// ReasonScaleTargetNotFound (False): the object an autoscaler's
	// scaleTargetRef names does not exist, or its kind is not served.
	ReasonScaleTargetNotFound = "ScaleTargetNotFound"
	// ReasonNoScaleSubresource (False): the scale target's kind has no scale
	// subresource, so its replicas cannot be read (or scaled by KEDA).
	ReasonNoScaleSubresource = "NoScaleSubresource"
	// ReasonScaleTargetForbidden (False): the controller's RBAC does not allow
	// reading the scale subresource of the target's kind; by default it may
	// read deployments/scale and statefulsets/scale.
	ReasonScaleTargetForbidden = "ScaleTargetForbidden"
	// ReasonKEDANotInstalled (False): a consumer names a ScaledObject and the
	// API server does not serve KEDA's ScaledObject CRD (keda.sh/v1alpha1).
	// The manager bounds the other consumers meanwhile, and the ScaledObject
	// once KEDA is installed, without a restart; or name the workload's
	// HorizontalPodAutoscaler instead.
	ReasonKEDANotInstalled = "KEDANotInstalled"
	// ReasonConflict (False): another DependencyPolicy already bounds the
	// autoscaler (see the spillway.dev/owner annotation). The first policy
	// keeps it; this one leaves it alone.
	ReasonConflict = "Conflict"
	// ReasonAPIError (False): reading or changing an autoscaler failed (for
	// example a write conflict); the controller retries.
	ReasonAPIError = "APIError"
)

// evalError is why an evaluation failed: the Ready condition's reason and
// the cause.
type evalError struct {
	reason string
	err    error
}

func (e *evalError) Error() string { return e.err.Error() }
func (e *evalError) Unwrap() error { return e.err }

// evalReason is the Ready reason of an evaluation error, "" for nil.
func evalReason(err error) string {
	if err == nil {
		return ""
	}
	var ee *evalError
	if errors.As(err, &ee) {
		return ee.reason
	}
	return ReasonRedisUnavailable
}

// readyCondition is True with ReasonEvaluated when err is nil, and False
// with the evalError's reason otherwise (ReasonRedisUnavailable for any other
// error, since Redis is the only other thing an evaluation talks to).
func readyCondition(err error, published protocol.Published) metav1.Condition {
	if err == nil {
		return metav1.Condition{
			Type:    ConditionReady,
			Status:  metav1.ConditionTrue,
			Reason:  ReasonEvaluated,
			Message: fmt.Sprintf("Published state %s with limit %d (epoch %d)", published.State, published.Limit, published.Epoch),
		}
	}
	reason := ReasonRedisUnavailable
	var ee *evalError
	if errors.As(err, &ee) {
		reason = ee.reason
	}
	msg := err.Error()
	if reason == ReasonRedisUnavailable {
		msg = "Cannot reach Redis; workers keep the limit last published: " + msg
	}
	return metav1.Condition{Type: ConditionReady, Status: metav1.ConditionFalse, Reason: reason, Message: msg}
}

// readySummary is the Ready condition from the evaluation's (readyCondition)
// and the consumers' (consumersBoundedCondition): the evaluation's while it
// is not True, and False with the consumers' reason while they are not all
// bounded, so that READY never shows True for a policy that does not bound
// its consumers.
func readySummary(evaluated, consumers metav1.Condition) metav1.Condition {
	if evaluated.Status != metav1.ConditionTrue || consumers.Status != metav1.ConditionFalse {
		return evaluated
	}
	return metav1.Condition{
		Type:    ConditionReady,
		Status:  metav1.ConditionFalse,
		Reason:  consumers.Reason,
		Message: evaluated.Message + ", but " + consumers.Message,
	}
}

// stalledCondition is the Stalled condition for a spec that cannot be
// turned into a policy; held is the state Redis holds for the policy, the
// zero value when it holds none or the evaluator has not read it yet.
func stalledCondition(specErr error, held protocol.Published) metav1.Condition {
	c := metav1.Condition{Type: ConditionStalled, Status: metav1.ConditionTrue, Reason: ReasonInvalidSpec,
		Message: "The spec cannot be used; nothing is published until it changes: " + specErr.Error()}
	if held.State != "" {
		c.Reason = ReasonLastStateKept
		c.Message = fmt.Sprintf("The spec cannot be used; the fleet keeps the state last published, %s with limit %d (epoch %d), until it changes", held.State, held.Limit, held.Epoch)
		if held.State == wire.Open || held.State == wire.HalfOpen {
			c.Message += fmt.Sprintf(", and admits %d calls at a time once the dead-man bound has passed", held.HalfOpenProbes)
		}
		c.Message += ": " + specErr.Error()
	}
	return c
}

// releasePendingCondition is the Ready condition of a deleted policy whose
// fleet could not be released in Redis yet.
func releasePendingCondition(err error) metav1.Condition {
	return metav1.Condition{
		Type:   ConditionReady,
		Status: metav1.ConditionFalse,
		Reason: ReasonReleasePending,
		Message: fmt.Sprintf("The policy is being deleted; the finalizer stays until the fleet is published Closed at full capacity in Redis, "+
			"retried with backoff (annotate %s=true to let it go without, if Redis is gone for good): %v", AnnotationSkipRedisRelease, err),
	}
}

// breakerOpenCondition describes the breaker in state; openUntil is when an
// Open breaker half-opens.
func breakerOpenCondition(state wire.State, openUntil time.Time, probes int64) metav1.Condition {
	c := metav1.Condition{Type: ConditionBreakerOpen}
	switch state {
	case wire.Open:
		c.Status, c.Reason = metav1.ConditionTrue, ReasonFailureRatioExceeded
		c.Message = "The breaker is open: workers make no calls"
		if !openUntil.IsZero() {
			c.Message += " until " + openUntil.UTC().Format(time.RFC3339)
		}
	case wire.HalfOpen:
		c.Status, c.Reason = metav1.ConditionTrue, ReasonProbing
		c.Message = fmt.Sprintf("The breaker is half-open: %d probe calls test the dependency", probes)
	case wire.Closed, wire.Ramping:
		c.Status, c.Reason = metav1.ConditionFalse, ReasonBreakerClosed
		c.Message = "The breaker is closed"
	default:
		c.Status, c.Reason = metav1.ConditionUnknown, ReasonNotEvaluated
		c.Message = "The policy has not been evaluated yet"
	}
	return c
}

// rampingCondition describes the ramp in state at step (from 0) of steps,
// with the limit in force and the ceiling its step backs left (0: none).
func rampingCondition(state wire.State, step int, limit, ceiling int64, steps []int64) metav1.Condition {
	c := metav1.Condition{Type: ConditionRamping}
	switch state {
	case wire.Ramping:
		c.Status, c.Reason = metav1.ConditionTrue, ReasonRampInProgress
		if limit <= 0 && step >= 0 && step < len(steps) {
			limit = steps[step]
		}
		c.Message = fmt.Sprintf("Ramp step %d of %d: limit %d", step+1, len(steps), limit)
		if ceiling > 0 {
			c.Reason = ReasonSteppedBack
			c.Message = fmt.Sprintf("Stepped back: limit %d, below limit %d, whose calls failed more than ramp.stepBack allows; limit %d is tried again after a longer clean hold (step %d of %d)",
				limit, ceiling, ceiling, step+1, len(steps))
		}
	case wire.Closed:
		c.Status, c.Reason = metav1.ConditionFalse, ReasonRampComplete
		c.Message = "The limit is the full capacity"
	case wire.Open, wire.HalfOpen:
		c.Status, c.Reason = metav1.ConditionFalse, ReasonAwaitingRecovery
		c.Message = "The ramp starts from its first step when the breaker closes"
	default:
		c.Status, c.Reason = metav1.ConditionUnknown, ReasonNotEvaluated
		c.Message = "The policy has not been evaluated yet"
	}
	return c
}

// consumerResult is how bounding one consumer went: Reason is empty when it
// is bounded, one of the ConsumersBounded reasons otherwise.
type consumerResult struct {
	Name    string
	Reason  string
	Message string
	// Replicas are the bounds applied to a bounded consumer's autoscaler.
	Replicas *Replicas
}

// consumersBoundedCondition sums up the consumers' results, in spec order.
func consumersBoundedCondition(results []consumerResult) metav1.Condition {
	c := metav1.Condition{Type: ConditionConsumersBounded}
	if len(results) == 0 {
		c.Status, c.Reason = metav1.ConditionTrue, ReasonNoConsumers
		c.Message = "The policy names no consumers"
		return c
	}
	var failed []string
	for _, r := range results {
		if r.Reason == "" {
			continue
		}
		if c.Reason == "" {
			c.Reason = r.Reason
		}
		failed = append(failed, fmt.Sprintf("%s: %s", r.Name, r.Message))
	}
	if len(failed) == 0 {
		c.Status, c.Reason = metav1.ConditionTrue, ReasonBounded
		c.Message = fmt.Sprintf("%d consumers bounded", len(results))
		return c
	}
	c.Status = metav1.ConditionFalse
	c.Message = fmt.Sprintf("%d of %d consumers not bounded: %s", len(failed), len(results), strings.Join(failed, "; "))
	return c
}

// workersServedCondition is the WorkersServed condition of a fleet whose
// versions the evaluator read.
func workersServedCondition(f protocol.Fleet) metav1.Condition {
	unserved := f.Unserved()
	if len(unserved) == 0 {
		return metav1.Condition{Type: ConditionWorkersServed, Status: metav1.ConditionTrue, Reason: ReasonWorkerVersionsServed,
			Message: "Workers seen in the last minute, by protocol version: " + f.Summary()}
	}
	var who []string
	for p, n := range unserved {
		who = append(who, fmt.Sprintf("%d %s process(es) at protocol version %d", n, p.Client, p.Version))
	}
	slices.Sort(who)
	return metav1.Condition{Type: ConditionWorkersServed, Status: metav1.ConditionFalse, Reason: ReasonUnservedWorkers,
		Message: fmt.Sprintf("%s: this manager speaks protocol version %d and serves workers at versions %d to %d, so those workers defer every call; upgrade their Spillway library (or roll the manager to a version that serves them), see docs/operations.md \"Upgrading\". Workers seen in the last minute: %s",
			strings.Join(who, ", "), protocol.Version, protocol.Version-1, protocol.Version+1, f.Summary())}
}
