package policy

import (
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// defaulted is a spec as the API server stores it after defaulting.
func defaulted(concurrency int32) spillwayv1alpha1.DependencyPolicySpec {
	return spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: concurrency},
		Ramp:     spillwayv1alpha1.Ramp{StepDuration: metav1.Duration{Duration: time.Minute}},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio: 0.5, MinCalls: 20, HalfOpenProbes: 3,
			Window:       metav1.Duration{Duration: 30 * time.Second},
			OpenDuration: metav1.Duration{Duration: time.Minute},
		},
		RetryBudget: spillwayv1alpha1.RetryBudget{Ratio: 0.2, MinRetries: ptr.To[int32](10), Window: metav1.Duration{Duration: time.Minute}},
		Backoff: spillwayv1alpha1.Backoff{
			Base: metav1.Duration{Duration: time.Second}, Max: metav1.Duration{Duration: 5 * time.Minute}, Jitter: spillwayv1alpha1.JitterFull,
		},
	}
}

func TestFromSpec(t *testing.T) {
	p, err := FromSpec(defaulted(40))
	if err != nil {
		t.Fatal(err)
	}
	if p.Capacity != 40 || p.RatePerSecond != 0 || !p.PinMinReplicas {
		t.Errorf("capacity, rate, pin = %d, %d, %v", p.Capacity, p.RatePerSecond, p.PinMinReplicas)
	}
	if got := p.Ramp.Steps; len(got) != 4 || got[0] != 5 || got[3] != 40 {
		t.Errorf("default steps = %v, want [5 10 20 40]", got)
	}
	if p.Breaker.Window != 30*time.Second || p.Breaker.HalfOpenProbes != 3 || p.Budget.MinRetries != 10 {
		t.Errorf("breaker %+v, budget %+v", p.Breaker, p.Budget)
	}
	if p.Backoff.Jitter != retry.JitterFull || p.Backoff.Max != 5*time.Minute {
		t.Errorf("backoff %+v", p.Backoff)
	}
}

func TestFromSpecDerivesAndClamps(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*spillwayv1alpha1.DependencyPolicySpec)
		check  func(t *testing.T, p Params)
	}{{
		name:   "declared steps below capacity end at capacity",
		mutate: func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Ramp.Steps = []int32{5, 10, 20} },
		check: func(t *testing.T, p Params) {
			if got := p.Ramp.Steps; len(got) != 4 || got[3] != 40 {
				t.Errorf("steps = %v, want [5 10 20 40]", got)
			}
		},
	}, {
		name:   "declared steps ending at capacity are kept",
		mutate: func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Ramp.Steps = []int32{10, 40} },
		check: func(t *testing.T, p Params) {
			if got := p.Ramp.Steps; len(got) != 2 {
				t.Errorf("steps = %v, want [10 40]", got)
			}
		},
	}, {
		name:   "probes above a small capacity are clamped",
		mutate: func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Capacity.Concurrency = 2 },
		check: func(t *testing.T, p Params) {
			if p.Breaker.HalfOpenProbes != 2 {
				t.Errorf("probes = %d, want 2", p.Breaker.HalfOpenProbes)
			}
		},
	}, {
		name:   "windows round up to whole seconds",
		mutate: func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Breaker.Window.Duration = 1500 * time.Millisecond },
		check: func(t *testing.T, p Params) {
			if p.Breaker.Window != 2*time.Second {
				t.Errorf("window = %v, want 2s", p.Breaker.Window)
			}
		},
	}, {
		name: "rate and pinning",
		mutate: func(s *spillwayv1alpha1.DependencyPolicySpec) {
			s.Capacity.RatePerSecond = ptr.To[int32](100)
			s.PinMinReplicasDuringOutage = ptr.To(false)
		},
		check: func(t *testing.T, p Params) {
			if p.RatePerSecond != 100 || p.PinMinReplicas {
				t.Errorf("rate %d, pin %v", p.RatePerSecond, p.PinMinReplicas)
			}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			s := defaulted(40)
			tc.mutate(&s)
			p, err := FromSpec(s)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, p)
		})
	}
}

func TestFromSpecRejectsBadSpecsNamingTheField(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*spillwayv1alpha1.DependencyPolicySpec)
		field  string
	}{
		{"zero capacity", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Capacity.Concurrency = 0 }, "capacity.concurrency"},
		{"zero rate", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Capacity.RatePerSecond = ptr.To[int32](0) }, "capacity.ratePerSecond"},
		{"steps out of order", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Ramp.Steps = []int32{10, 5} }, "ramp"},
		{"step above capacity", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Ramp.Steps = []int32{50} }, "ramp"},
		{"failure ratio", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Breaker.FailureRatio = 1.5 }, "breaker"},
		{"budget ratio", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.RetryBudget.Ratio = 0 }, "retryBudget.ratio"},
		{"jitter", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Backoff.Jitter = "Random" }, "backoff: jitter"},
		{"base above max", func(s *spillwayv1alpha1.DependencyPolicySpec) { s.Backoff.Base.Duration = time.Hour }, "backoff"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := defaulted(40)
			tc.mutate(&s)
			_, err := FromSpec(s)
			if err == nil || !strings.Contains(err.Error(), tc.field) {
				t.Errorf("error %v does not name %s", err, tc.field)
			}
		})
	}
}
