// Package policy turns a DependencyPolicy spec into the parameters the pure
// breaker, ramp and retry packages take. The controller and the simulator both
// go through it, so a policy means the same thing to each.
package policy

import (
	"fmt"
	"time"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// Params is a DependencyPolicy spec in the form the arithmetic packages take.
type Params struct {
	// Capacity is the fleet-wide concurrency limit once the ramp is done.
	Capacity int64
	// RatePerSecond is the fleet-wide rate limit; 0 means none.
	RatePerSecond int64
	Breaker       breaker.Config
	// Ramp always ends at Capacity.
	Ramp    ramp.Schedule
	Backoff retry.Backoff
	Budget  retry.Budget
	// PinMinReplicas pins consumers' minReplicaCount while Open, HalfOpen or
	// Ramping (the controller lets go once the ramp reaches full capacity).
	PinMinReplicas bool
}

// FromSpec converts a spec that the API server has defaulted and validated.
// It validates again, so a spec built in Go (tests, the simulator) gets the same
// errors, each naming the field.
func FromSpec(spec spillwayv1alpha1.DependencyPolicySpec) (Params, error) {
	capacity := int64(spec.Capacity.Concurrency)
	if capacity < 1 {
		return Params{}, fmt.Errorf("capacity.concurrency must be at least 1, got %d", capacity)
	}
	p := Params{
		Capacity: capacity,
		Breaker: breaker.Config{
			FailureRatio:   spec.Breaker.FailureRatio,
			MinCalls:       int64(spec.Breaker.MinCalls),
			Window:         wholeSeconds(spec.Breaker.Window.Duration),
			OpenDuration:   spec.Breaker.OpenDuration.Duration,
			HalfOpenProbes: int64(spec.Breaker.HalfOpenProbes),
		},
		Ramp: ramp.Schedule{
			Steps:        Steps(spec),
			StepDuration: spec.Ramp.StepDuration.Duration,
			StepBack: ramp.StepBack{
				When:         ramp.When(spec.Ramp.StepBack.When),
				FailureRatio: spec.Ramp.StepBack.FailureRatio,
				MinFailures:  int64(spec.Ramp.StepBack.MinFailures),
			},
			EarlyClimb: spec.Ramp.EarlyClimb,
		},
		Backoff: retry.Backoff{
			Base:   spec.Backoff.Base.Duration,
			Max:    spec.Backoff.Max.Duration,
			Jitter: retry.Jitter(spec.Backoff.Jitter),
		},
		Budget: retry.Budget{
			Ratio:  spec.RetryBudget.Ratio,
			Window: wholeSeconds(spec.RetryBudget.Window.Duration),
		},
		PinMinReplicas: spec.PinMinReplicasDuringOutage == nil || *spec.PinMinReplicasDuringOutage,
	}
	if spec.Capacity.RatePerSecond != nil {
		p.RatePerSecond = int64(*spec.Capacity.RatePerSecond)
		if p.RatePerSecond < 1 {
			return Params{}, fmt.Errorf("capacity.ratePerSecond must be at least 1, got %d", p.RatePerSecond)
		}
	}
	if spec.Ramp.WarmFor != nil {
		p.Ramp.WarmFor = spec.Ramp.WarmFor.Duration
	}
	if spec.RetryBudget.MinRetries != nil {
		p.Budget.MinRetries = int64(*spec.RetryBudget.MinRetries)
	}
	if err := p.Breaker.Validate(); err != nil {
		return Params{}, fmt.Errorf("breaker: %w", err)
	}
	// More probes than the capacity cannot run at once; admit the capacity.
	p.Breaker.HalfOpenProbes = min(p.Breaker.HalfOpenProbes, capacity)
	if err := p.Ramp.Validate(capacity); err != nil {
		return Params{}, fmt.Errorf("ramp: %w", err)
	}
	if sb := p.Ramp.StepBack; sb.On() && sb.FailureRatio >= p.Breaker.FailureRatio {
		return Params{}, fmt.Errorf("ramp.stepBack.failureRatio must be below breaker.failureRatio %v, got %v", p.Breaker.FailureRatio, sb.FailureRatio)
	}
	if err := p.Backoff.Validate(); err != nil {
		return Params{}, fmt.Errorf("backoff: %w", err)
	}
	if p.Budget.Ratio <= 0 {
		return Params{}, fmt.Errorf("retryBudget.ratio must be in (0, 1], got %v", p.Budget.Ratio)
	}
	if err := p.Budget.Validate(); err != nil {
		return Params{}, fmt.Errorf("retryBudget: %w", err)
	}
	return p, nil
}

// Steps is the ramp the controller follows for spec: the declared steps, or
// c/8, c/4, c/2, c when none are declared, always ending at the capacity.
func Steps(spec spillwayv1alpha1.DependencyPolicySpec) []int64 {
	capacity := int64(spec.Capacity.Concurrency)
	if len(spec.Ramp.Steps) == 0 {
		return ramp.DefaultSteps(capacity)
	}
	steps := make([]int64, 0, len(spec.Ramp.Steps)+1)
	for _, s := range spec.Ramp.Steps {
		steps = append(steps, int64(s))
	}
	if steps[len(steps)-1] < capacity {
		steps = append(steps, capacity)
	}
	return steps
}

// wholeSeconds rounds a window up to whole seconds: workers count outcomes in
// one-second buckets.
func wholeSeconds(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return ((d + time.Second - 1) / time.Second) * time.Second
}
