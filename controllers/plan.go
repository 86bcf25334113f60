package controllers

import (
	"time"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The control law lives in internal/control, shared with the simulator; these
// names keep the controller's API.

// Event reasons of the transitions Plan reports. The Evaluator emits each as a
// Kubernetes Event on the DependencyPolicy.
const (
	// EventOpened: the breaker opened; the limit is 0.
	EventOpened = control.EventOpened
	// EventHalfOpened: the breaker half-opened; only probe calls are admitted.
	EventHalfOpened = control.EventHalfOpened
	// EventClosed: the probes succeeded and the breaker closed; the ramp starts.
	EventClosed = control.EventClosed
	// EventRampStep: the ramp moved up one step, or completed.
	EventRampStep = control.EventRampStep
	// EventRampStepBack: the ramp stepped back from a step whose calls
	// failed more than ramp.stepBack allows.
	EventRampStepBack = control.EventRampStepBack
)

type (
	// PlanInput is everything Plan decides from (control.Input).
	PlanInput = control.Input
	// PlanOutput is what Plan decided (control.Output).
	PlanOutput = control.Output
	// Transition is one change Plan made, for an Event and the metrics.
	Transition = control.Transition
)

// Plan steps the breaker and the ramp once and computes what to publish
// (control.Plan).
func Plan(in PlanInput) PlanOutput { return control.Plan(in) }

// WindowStart is where the evaluator starts counting the window Plan reads
// (control.WindowStart).
func WindowStart(p policy.Params, prev protocol.Published, now time.Time) time.Time {
	return control.WindowStart(p, prev, now)
}

// Limit is the fleet-wide concurrency limit in state (control.Limit).
func Limit(p policy.Params, state wire.State, rampLimit int64) int64 {
	return control.Limit(p, state, rampLimit)
}

// RestoreFromStatus is what the controller continues from when Redis holds no
// state for the policy: the state, ramp step, limit, ramp ceiling and last
// transition time the controller last wrote to the policy's status
// (control.RestoreSaved), so that a step back survives too.
func RestoreFromStatus(st spillwayv1alpha1.DependencyPolicyStatus, p policy.Params, now time.Time) protocol.Published {
	var since time.Time
	if st.LastTransitionTime != nil {
		since = st.LastTransitionTime.Time
	}
	return control.RestoreSaved(p, control.Saved{
		State:          wireState(st.State),
		RampStep:       int(st.RampStep),
		Limit:          int64(st.CurrentLimit),
		RampCeiling:    int64(st.RampCeiling),
		LastTransition: since,
	}, now)
}
