package shed_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/pkg/shed"
)

func TestOptionsValidate(t *testing.T) {
	tests := []struct {
		name    string
		opts    shed.Options
		wantErr string
	}{
		{name: "minimal", opts: shed.Options{MaxInFlight: 1}},
		{name: "full", opts: shed.Options{
			MaxInFlight: 40, QueueSize: 10, QueueTimeout: time.Second,
			RetryAfterMin: 2 * time.Second, RetryAfterMax: 2 * time.Second,
			CallerHeader: "X-Caller", DefaultQuota: 5, Quotas: map[string]int64{"big": 20, "": 2},
			Ramp: &shed.Ramp{Steps: []int64{5, 10, 20, 40}, StepDuration: time.Minute},
		}},
		{name: "zero maxInFlight", opts: shed.Options{}, wantErr: "MaxInFlight must be >= 1, got 0"},
		{name: "negative maxInFlight", opts: shed.Options{MaxInFlight: -3}, wantErr: "MaxInFlight must be >= 1, got -3"},
		{name: "negative queueSize", opts: shed.Options{MaxInFlight: 1, QueueSize: -1}, wantErr: "QueueSize must be >= 0"},
		{name: "negative queueTimeout", opts: shed.Options{MaxInFlight: 1, QueueTimeout: -time.Second}, wantErr: "QueueTimeout must be >= 0"},
		{name: "queue without timeout", opts: shed.Options{MaxInFlight: 1, QueueSize: 4}, wantErr: "QueueTimeout must be > 0 when QueueSize is 4"},
		{name: "retryAfterMin below 1s", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 500 * time.Millisecond}, wantErr: "RetryAfterMin must be >= 1s, got 500ms"},
		{name: "negative retryAfterMin", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: -time.Second}, wantErr: "RetryAfterMin must be >= 1s"},
		{name: "fractional retryAfterMin", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 1500 * time.Millisecond}, wantErr: "RetryAfterMin must be a whole number of seconds, got 1.5s"},
		{name: "fractional retryAfterMax", opts: shed.Options{MaxInFlight: 1, RetryAfterMax: 2500 * time.Millisecond}, wantErr: "RetryAfterMax must be a whole number of seconds"},
		{name: "min above max", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 20 * time.Second, RetryAfterMax: 10 * time.Second}, wantErr: "RetryAfterMax (10s) must be >= RetryAfterMin (20s)"},
		{name: "bad caller header", opts: shed.Options{MaxInFlight: 1, CallerHeader: "X Api Key"}, wantErr: "CallerHeader must be an HTTP header name"},
		{name: "negative defaultQuota", opts: shed.Options{MaxInFlight: 1, DefaultQuota: -1}, wantErr: "DefaultQuota must be >= 0, got -1"},
		{name: "zero quota", opts: shed.Options{MaxInFlight: 1, Quotas: map[string]int64{"secret-key": 0}}, wantErr: "Quotas must all be >= 1, got 0 for one key"},
		{name: "ramp step above maxInFlight", opts: shed.Options{MaxInFlight: 10, Ramp: &shed.Ramp{Steps: []int64{5, 20}, StepDuration: time.Minute}}, wantErr: "Ramp.Steps[1] must be <= MaxInFlight (10), got 20"},
		{name: "ramp without steps", opts: shed.Options{MaxInFlight: 10, Ramp: &shed.Ramp{StepDuration: time.Minute}}, wantErr: "Ramp.Steps must not be empty"},
		{name: "ramp step below 1", opts: shed.Options{MaxInFlight: 10, Ramp: &shed.Ramp{Steps: []int64{0, 10}, StepDuration: time.Minute}}, wantErr: "Ramp.Steps[0] must be >= 1, got 0"},
		{name: "ramp steps not increasing", opts: shed.Options{MaxInFlight: 10, Ramp: &shed.Ramp{Steps: []int64{5, 5, 10}, StepDuration: time.Minute}}, wantErr: "Ramp.Steps must be strictly increasing, got Ramp.Steps[1]=5 after Ramp.Steps[0]=5"},
		{name: "ramp without duration", opts: shed.Options{MaxInFlight: 10, Ramp: &shed.Ramp{Steps: []int64{5, 10}}}, wantErr: "Ramp.StepDuration must be > 0, got 0s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tt.wantErr)
			}
			if _, err := shed.New(tt.opts); err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("New() error = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

// fixedRand always returns the same float, to read the ends of the
// Retry-After range.
type fixedRand float64

func (r fixedRand) Float64() float64 { return float64(r) }

// TestRetryAfterDefaults checks how an unset RetryAfterMin or RetryAfterMax
// is filled in from the one the user set, and that errors name only the Go
// fields the user set.
func TestRetryAfterDefaults(t *testing.T) {
	const s = time.Second
	tests := []struct {
		name             string
		min, max         time.Duration
		wantLo, wantHi   time.Duration
		wantErr, notName string
	}{
		{name: "neither set", wantLo: 1 * s, wantHi: 10 * s},
		{name: "only a small min", min: 3 * s, wantLo: 3 * s, wantHi: 10 * s},
		{name: "only min at half the default max", min: 5 * s, wantLo: 5 * s, wantHi: 10 * s},
		{name: "only min 15s", min: 15 * s, wantLo: 15 * s, wantHi: 30 * s},
		{name: "only min above the default max", min: 11 * s, wantLo: 11 * s, wantHi: 22 * s},
		{name: "only max", max: 5 * s, wantLo: 1 * s, wantHi: 5 * s},
		{name: "only max at 1s", max: 1 * s, wantLo: 1 * s, wantHi: 1 * s},
		{name: "both set", min: 2 * s, max: 4 * s, wantLo: 2 * s, wantHi: 4 * s},
		{name: "both set equal", min: 15 * s, max: 15 * s, wantLo: 15 * s, wantHi: 15 * s},
		{name: "both set, max below min", min: 20 * s, max: 10 * s, wantErr: "RetryAfterMax (10s) must be >= RetryAfterMin (20s)"},
		{name: "only max below the 1s floor", max: 500 * time.Millisecond, wantErr: "RetryAfterMax must be >= 1s, got 500ms", notName: "RetryAfterMin"},
		{name: "only min, fractional", min: 1500 * time.Millisecond, wantErr: "RetryAfterMin must be a whole number of seconds, got 1.5s", notName: "RetryAfterMax"},
		{name: "only max, fractional", max: 2500 * time.Millisecond, wantErr: "RetryAfterMax must be a whole number of seconds, got 2.5s", notName: "RetryAfterMin"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := shed.Options{MaxInFlight: 1, RetryAfterMin: tt.min, RetryAfterMax: tt.max}
			if tt.wantErr != "" {
				_, err := shed.New(opts)
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("New() error = %v, want an error containing %q", err, tt.wantErr)
				}
				if tt.notName != "" && strings.Contains(err.Error(), tt.notName) {
					t.Fatalf("New() error = %v, names %s, which the user did not set", err, tt.notName)
				}
				return
			}
			for _, c := range []struct {
				u    float64
				want time.Duration
			}{{0, tt.wantLo}, {0.999999, tt.wantHi}} {
				opts.Rand = fixedRand(c.u)
				s, err := shed.New(opts)
				if err != nil {
					t.Fatalf("New() = %v, want nil", err)
				}
				defer admit(t, s, shed.Request{}).Release()
				if rej := rejection(t, t.Context(), s, shed.Request{}); rej.RetryAfter != c.want {
					t.Fatalf("Retry-After with Rand %v = %v, want %v", c.u, rej.RetryAfter, c.want)
				}
			}
		})
	}
}

func TestValidateKeepsKeysOutOfErrors(t *testing.T) {
	err := shed.Options{MaxInFlight: 1, Quotas: map[string]int64{"sk-live-123": -1}}.Validate()
	if err == nil || strings.Contains(err.Error(), "sk-live-123") {
		t.Fatalf("Validate() = %v, want an error without the API key", err)
	}
}

func TestNewRegistersMetrics(t *testing.T) {
	_, reg := newShedder(t, shed.Options{MaxInFlight: 1})
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	got := map[string]bool{}
	for _, f := range families {
		got[f.GetName()] = true
	}
	for _, name := range []string{
		"spillway_service_requests_total", "spillway_service_amplification_ratio",
		"spillway_service_admitted_total", "spillway_service_shed_total",
		"spillway_service_malformed_headers_total", "spillway_service_in_flight",
		"spillway_service_queue_depth", "spillway_service_limit",
	} {
		if !got[name] {
			t.Errorf("metric %s not registered", name)
		}
	}
}

func TestNewFailsOnDuplicateRegistration(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := shed.New(shed.Options{MaxInFlight: 1, Registerer: reg}); err != nil {
		t.Fatalf("first New: %v", err)
	}
	_, err := shed.New(shed.Options{MaxInFlight: 1, Registerer: reg})
	if err == nil || !strings.Contains(err.Error(), "failed to register service metrics") {
		t.Fatalf("second New error = %v, want a registration error", err)
	}
}

func TestNilRegistererMeansNoMetrics(t *testing.T) {
	s, err := shed.New(shed.Options{MaxInFlight: 1})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	tk, err := s.Admit(t.Context(), shed.Request{Attempt: 1})
	if err != nil {
		t.Fatalf("Admit: %v", err)
	}
	tk.Release()
}
