package controllers

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// seedSpec is the seed's dependency: 40 concurrent calls, the ramp 5, 10,
// 20, 40 one step per clean minute, the API's default breaker.
func seedSpec() spillwayv1alpha1.DependencyPolicySpec {
	return spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: 40},
		Ramp:     spillwayv1alpha1.Ramp{StepDuration: metav1.Duration{Duration: time.Minute}},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio:   0.5,
			MinCalls:       20,
			Window:         metav1.Duration{Duration: 30 * time.Second},
			OpenDuration:   metav1.Duration{Duration: 60 * time.Second},
			HalfOpenProbes: 3,
		},
		RetryBudget: spillwayv1alpha1.RetryBudget{Ratio: 0.2, MinRetries: ptr.To[int32](10), Window: metav1.Duration{Duration: time.Minute}},
		Backoff:     spillwayv1alpha1.Backoff{Base: metav1.Duration{Duration: time.Second}, Max: metav1.Duration{Duration: 5 * time.Minute}, Jitter: spillwayv1alpha1.JitterFull},
	}
}

func seedParams(t *testing.T) policy.Params {
	t.Helper()
	p, err := policy.FromSpec(seedSpec())
	if err != nil {
		t.Fatalf("seed spec: %v", err)
	}
	return p
}

func TestRestoreFromStatus(t *testing.T) {
	p := seedParams(t)
	now := t0.Add(30 * time.Second) // the breaker opened at t0 half-opens at t0+60s
	ltt := &metav1.Time{Time: t0}
	tests := []struct {
		name   string
		status spillwayv1alpha1.DependencyPolicyStatus
		want   protocol.Published
		limit  int64
	}{
		{
			name:   "never evaluated: closed at full capacity, the ramp complete a step ago",
			status: spillwayv1alpha1.DependencyPolicyStatus{},
			want:   protocol.Published{State: wire.Closed, BreakerSince: now, RampStep: 3, RampStepStarted: now.Add(-p.Ramp.StepDuration)},
			limit:  40,
		},
		{
			name:   "closed keeps its transition time",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateClosed, RampStep: 3, LastTransitionTime: ltt},
			want:   protocol.Published{State: wire.Closed, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit:  40,
		},
		{
			name:   "open keeps its transition time",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateOpen, LastTransitionTime: ltt},
			want:   protocol.Published{State: wire.Open, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit:  0,
		},
		{
			name:   "half-open",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateHalfOpen, LastTransitionTime: ltt},
			want:   protocol.Published{State: wire.HalfOpen, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit:  3,
		},
		{
			name:   "ramping continues at its step, restarted now",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateRamping, RampStep: 2, LastTransitionTime: ltt},
			want:   protocol.Published{State: wire.Ramping, BreakerSince: t0, RampStep: 2, RampStepStarted: now},
			limit:  20,
		},
		{
			name: "a step back below the first step keeps its limit and ceiling",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateRamping, RampStep: 0, CurrentLimit: 2, RampCeiling: 5,
				LastTransitionTime: ltt},
			want: protocol.Published{State: wire.Ramping, BreakerSince: t0, RampStep: 0, RampStepStarted: now,
				RampLimit: 2, RampCeiling: 5, RampBackoffs: 1},
			limit: 2,
		},
		{
			name: "a step back to a step keeps its ceiling",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateRamping, RampStep: 1, CurrentLimit: 10, RampCeiling: 20,
				LastTransitionTime: ltt},
			want: protocol.Published{State: wire.Ramping, BreakerSince: t0, RampStep: 1, RampStepStarted: now,
				RampCeiling: 20, RampBackoffs: 1},
			limit: 10,
		},
		{
			name:   "a step beyond the schedule is clamped",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateRamping, RampStep: 9, LastTransitionTime: ltt},
			want:   protocol.Published{State: wire.Ramping, BreakerSince: t0, RampStep: 3, RampStepStarted: now},
		},
		{
			name:   "a transition time in the future is now",
			status: spillwayv1alpha1.DependencyPolicyStatus{State: spillwayv1alpha1.StateOpen, LastTransitionTime: &metav1.Time{Time: now.Add(time.Hour)}},
			want:   protocol.Published{State: wire.Open, BreakerSince: now, RampStep: 3, RampStepStarted: now},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got := RestoreFromStatus(tt.status, p, now)
			g.Expect(got).To(Equal(tt.want))
			if tt.limit != 0 || tt.want.State == wire.Open {
				// The first plan from a restored state keeps it, at epoch 1.
				out := Plan(PlanInput{Params: p, Previous: got, Now: now})
				g.Expect(out.Next.State).To(Equal(tt.want.State))
				g.Expect(out.Next.Limit).To(Equal(tt.limit))
				g.Expect(out.Next.Epoch).To(Equal(int64(1)))
			}
		})
	}
}

func TestStaleAfter(t *testing.T) {
	g := NewWithT(t)
	g.Expect(StaleAfter(time.Second)).To(Equal(30 * time.Second))
	g.Expect(StaleAfter(200 * time.Millisecond)).To(Equal(MinStaleAfter))
	g.Expect(StaleAfter(5 * time.Second)).To(Equal(150 * time.Second))
	g.Expect(Options{EvaluationInterval: 2 * time.Second}.staleAfter()).To(Equal(60 * time.Second))
	g.Expect(Options{EvaluationInterval: time.Second, StaleAfter: 3 * time.Second}.staleAfter()).To(Equal(3 * time.Second))
	g.Expect(Options{EvaluationInterval: time.Second, StaleAfter: -1}.staleAfter()).To(BeZero())
}
