package policy_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/retry"
)

const minimal = `apiVersion: spillway.dev/v1alpha1
kind: DependencyPolicy
metadata:
  name: template-api
spec:
  capacity:
    concurrency: 40
`

func TestLoadFileSamples(t *testing.T) {
	paths := []string{
		"testdata/template-api.yaml",
		"../../config/samples/spillway_v1alpha1_dependencypolicy.yaml",
	}
	for _, path := range paths {
		t.Run(filepath.Base(path), func(t *testing.T) {
			if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
				t.Skipf("%s does not exist yet", path)
			}
			p, err := policy.LoadFile(path)
			if err != nil {
				t.Fatalf("LoadFile: %v", err)
			}
			if _, err := policy.FromSpec(p.Spec); err != nil {
				t.Fatalf("FromSpec: %v", err)
			}
			if p.Name == "" {
				t.Errorf("name is empty")
			}
		})
	}
}

func TestLoadTemplateAPI(t *testing.T) {
	p, err := policy.LoadFile("testdata/template-api.yaml")
	if err != nil {
		t.Fatalf("LoadFile: %v", err)
	}
	params, err := policy.FromSpec(p.Spec)
	if err != nil {
		t.Fatalf("FromSpec: %v", err)
	}
	if got, want := params.Ramp.Steps, []int64{5, 10, 20, 40}; !equalSteps(got, want) {
		t.Errorf("steps = %v, want %v", got, want)
	}
	if got := p.Spec.Consumers[0].SlotsPerReplica; got != 2 {
		t.Errorf("slotsPerReplica = %d, want 2", got)
	}
	if got := p.Spec.Consumers[0].Weight; got != 1 {
		t.Errorf("weight = %d, want the default 1", got)
	}
}

func TestLoadDefaults(t *testing.T) {
	p, err := policy.Load([]byte(minimal))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	params, err := policy.FromSpec(p.Spec)
	if err != nil {
		t.Fatalf("FromSpec: %v", err)
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"breaker.failureRatio", params.Breaker.FailureRatio, 0.5},
		{"breaker.minCalls", params.Breaker.MinCalls, int64(20)},
		{"breaker.window", params.Breaker.Window, 30 * time.Second},
		{"breaker.openDuration", params.Breaker.OpenDuration, 10 * time.Second},
		{"breaker.halfOpenProbes", params.Breaker.HalfOpenProbes, int64(3)},
		{"retryBudget.ratio", params.Budget.Ratio, 0.2},
		{"retryBudget.minRetries", params.Budget.MinRetries, int64(10)},
		{"retryBudget.window", params.Budget.Window, 60 * time.Second},
		{"backoff.base", params.Backoff.Base, time.Second},
		{"backoff.max", params.Backoff.Max, 5 * time.Minute},
		{"backoff.jitter", params.Backoff.Jitter, retry.JitterFull},
		{"ramp.stepDuration", params.Ramp.StepDuration, time.Minute},
		{"ramp.steps", len(params.Ramp.Steps), 4},
		{"pinMinReplicasDuringOutage", params.PinMinReplicas, true},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestLoadRejects(t *testing.T) {
	tests := []struct {
		name     string
		manifest string
		want     string
	}{
		{
			name:     "steps not increasing",
			manifest: minimal + "  ramp:\n    steps: [5, 20, 10]\n",
			want:     "spec.ramp.steps",
		},
		{
			name:     "step above capacity",
			manifest: minimal + "  ramp:\n    steps: [5, 80]\n",
			want:     "spec.ramp.steps",
		},
		{
			name:     "failure ratio out of range",
			manifest: minimal + "  breaker:\n    failureRatio: 1.5\n",
			want:     "spec.breaker.failureRatio",
		},
		{
			name:     "zero capacity",
			manifest: strings.Replace(minimal, "concurrency: 40", "concurrency: 0", 1),
			want:     "spec.capacity.concurrency",
		},
		{
			name:     "missing capacity",
			manifest: strings.Replace(minimal, "  capacity:\n    concurrency: 40\n", "  ramp: {}\n", 1),
			want:     "spec.capacity",
		},
		{
			name:     "window too long",
			manifest: minimal + "  breaker:\n    window: 2h\n",
			want:     "spec.breaker.window",
		},
		{
			name:     "base above max",
			manifest: minimal + "  backoff:\n    base: 10m\n    max: 1m\n",
			want:     "spec.backoff",
		},
		{
			name:     "unknown jitter",
			manifest: minimal + "  backoff:\n    jitter: Some\n",
			want:     "spec.backoff.jitter",
		},
		{
			name:     "unknown field",
			manifest: minimal + "  capacityy: 3\n",
			want:     "spec.capacityy",
		},
		{
			name:     "wrong kind",
			manifest: strings.Replace(minimal, "kind: DependencyPolicy", "kind: ScaledObject", 1),
			want:     "kind",
		},
		{
			name:     "missing name",
			manifest: strings.Replace(minimal, "  name: template-api\n", "  labels: {a: b}\n", 1),
			want:     "metadata.name",
		},
		{
			name:     "two documents",
			manifest: minimal + "---\n" + minimal,
			want:     "exactly one YAML document",
		},
		{
			name:     "not YAML",
			manifest: "spec: [",
			want:     "YAML",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := policy.Load([]byte(tt.manifest))
			if err == nil {
				t.Fatalf("Load accepted an invalid manifest")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not name %q", err, tt.want)
			}
		})
	}
}

func TestLoadKeepsExplicitValues(t *testing.T) {
	p, err := policy.Load([]byte(minimal + "  retryBudget:\n    minRetries: 0\n  pinMinReplicasDuringOutage: false\n"))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if got := *p.Spec.RetryBudget.MinRetries; got != 0 {
		t.Errorf("minRetries = %d, want the explicit 0", got)
	}
	if got := *p.Spec.PinMinReplicasDuringOutage; got {
		t.Errorf("pinMinReplicasDuringOutage = true, want the explicit false")
	}
	if p.Kind != spillwayv1alpha1.DependencyPolicyKind {
		t.Errorf("kind = %q", p.Kind)
	}
}

func TestLoadFileMissing(t *testing.T) {
	if _, err := policy.LoadFile("testdata/does-not-exist.yaml"); err == nil {
		t.Fatal("LoadFile of a missing file succeeded")
	}
}

func equalSteps(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
