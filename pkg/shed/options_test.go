package shed_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/internal/ramp"
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
			Ramp: &ramp.Schedule{Steps: []int64{5, 10, 20, 40}, StepDuration: time.Minute},
		}},
		{name: "zero maxInFlight", opts: shed.Options{}, wantErr: "maxInFlight must be >= 1, got 0"},
		{name: "negative maxInFlight", opts: shed.Options{MaxInFlight: -3}, wantErr: "maxInFlight must be >= 1, got -3"},
		{name: "negative queueSize", opts: shed.Options{MaxInFlight: 1, QueueSize: -1}, wantErr: "queueSize must be >= 0"},
		{name: "negative queueTimeout", opts: shed.Options{MaxInFlight: 1, QueueTimeout: -time.Second}, wantErr: "queueTimeout must be >= 0"},
		{name: "queue without timeout", opts: shed.Options{MaxInFlight: 1, QueueSize: 4}, wantErr: "queueTimeout must be > 0 when queueSize is 4"},
		{name: "retryAfterMin below 1s", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 500 * time.Millisecond}, wantErr: "retryAfterMin must be >= 1s, got 500ms"},
		{name: "negative retryAfterMin", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: -time.Second}, wantErr: "retryAfterMin must be >= 1s"},
		{name: "fractional retryAfterMin", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 1500 * time.Millisecond}, wantErr: "retryAfterMin must be a whole number of seconds, got 1.5s"},
		{name: "fractional retryAfterMax", opts: shed.Options{MaxInFlight: 1, RetryAfterMax: 2500 * time.Millisecond}, wantErr: "retryAfterMax must be a whole number of seconds"},
		{name: "min above max", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 20 * time.Second, RetryAfterMax: 10 * time.Second}, wantErr: "retryAfterMax must be >= retryAfterMin (20s), got 10s"},
		{name: "min above default max", opts: shed.Options{MaxInFlight: 1, RetryAfterMin: 11 * time.Second}, wantErr: "retryAfterMax must be >= retryAfterMin (11s), got 10s"},
		{name: "bad caller header", opts: shed.Options{MaxInFlight: 1, CallerHeader: "X Api Key"}, wantErr: "callerHeader must be an HTTP header name"},
		{name: "negative defaultQuota", opts: shed.Options{MaxInFlight: 1, DefaultQuota: -1}, wantErr: "defaultQuota must be >= 0, got -1"},
		{name: "zero quota", opts: shed.Options{MaxInFlight: 1, Quotas: map[string]int64{"secret-key": 0}}, wantErr: "quotas must all be >= 1, got 0 for one key"},
		{name: "ramp step above maxInFlight", opts: shed.Options{MaxInFlight: 10, Ramp: &ramp.Schedule{Steps: []int64{5, 20}, StepDuration: time.Minute}}, wantErr: "ramp: steps[1] must be <= capacity 10, got 20"},
		{name: "ramp without duration", opts: shed.Options{MaxInFlight: 10, Ramp: &ramp.Schedule{Steps: []int64{5, 10}}}, wantErr: "ramp: stepDuration must be > 0"},
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
