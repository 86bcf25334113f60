package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/spillway-dev/spillway/internal/sim"
)

// policyJSON has exactly the keys `spillway simulate --json` promises.
type policyJSON struct {
	Name                  string   `json:"name"`
	PeakOverCapacity      float64  `json:"peak_over_capacity"`
	SecondOutages         int      `json:"second_outages"`
	DrainSeconds          *float64 `json:"drain_seconds"`
	PredictedDrainSeconds *float64 `json:"predicted_drain_seconds"`
	Completed             int64    `json:"completed"`
	Stale                 int64    `json:"stale"`
	Superseded            int64    `json:"superseded"`
	Parked                int64    `json:"parked"`
	Lost                  int64    `json:"lost"`
	Calls                 int64    `json:"calls"`
	Amplification         float64  `json:"amplification"`
}

type reportJSON struct {
	Scenario string       `json:"scenario"`
	Policies []policyJSON `json:"policies"`
}

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestList(t *testing.T) {
	code, out, errOut := runCLI(t, "simulate", "--list")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range append(sim.BuiltinNames(), "spillway", "immediate-retry", "call_duration") {
		if !strings.Contains(out, want) {
			t.Errorf("--list does not mention %q:\n%s", want, out)
		}
	}
}

func TestJSONShape(t *testing.T) {
	code, out, errOut := runCLI(t, "simulate", "--scenario", "vehicle-api", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	var rep reportJSON
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("decoding with the exact keys: %v\n%s", err, out)
	}
	if rep.Scenario != "vehicle-api" {
		t.Errorf("scenario = %q", rep.Scenario)
	}
	var names []string
	for _, p := range rep.Policies {
		names = append(names, p.Name)
	}
	var want []string
	for _, p := range sim.Policies() {
		want = append(want, string(p))
	}
	if !slices.Equal(names, want) {
		t.Errorf("policies = %v, want %v", names, want)
	}
	var raw struct {
		Policies []map[string]json.RawMessage `json:"policies"`
	}
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatal(err)
	}
	if got := len(raw.Policies[0]); got != 12 {
		t.Errorf("a policy has %d keys, want the 12 documented", got)
	}
	last := rep.Policies[len(rep.Policies)-1]
	if last.Lost != 0 || last.SecondOutages != 0 || last.DrainSeconds == nil {
		t.Errorf("spillway result %+v", last)
	}
}

func TestTable(t *testing.T) {
	code, out, errOut := runCLI(t, "simulate", "--scenario", "vehicle-api", "--policies", "cap,spillway", "--seed", "3")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"vehicle-api (seed 3)", "peak/cap", "cap", "spillway", "backlog at recovery"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "immediate-retry") {
		t.Errorf("--policies did not select:\n%s", out)
	}
}

func TestPlot(t *testing.T) {
	file := filepath.Join(t.TempDir(), "rate.png")
	code, _, errOut := runCLI(t, "simulate", "--scenario", "vehicle-api", "--policies", "plain-backoff,spillway", "--plot", file)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(data, []byte("\x89PNG\r\n\x1a\n")) {
		t.Errorf("%s is not a PNG", file)
	}
}

func TestSweep(t *testing.T) {
	code, out, errOut := runCLI(t, "simulate", "--scenario", "vehicle-api", "--policies", "spillway", "--sweep", "capacity=20,30", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var values []string
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var line struct {
			Scenario string       `json:"scenario"`
			Sweep    sweepPoint   `json:"sweep"`
			Policies []policyJSON `json:"policies"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		if line.Sweep.Param != "capacity" || len(line.Policies) != 1 {
			t.Errorf("line %+v", line)
		}
		values = append(values, line.Sweep.Value)
	}
	if !slices.Equal(values, []string{"20", "30"}) {
		t.Errorf("sweep values = %v", values)
	}
	code, out, errOut = runCLI(t, "simulate", "--scenario", "vehicle-api", "--policies", "spillway", "--sweep", "seed=1,2")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if strings.Count(out, "== seed=") != 2 || strings.Count(out, "peak/cap") != 2 {
		t.Errorf("want one table per value:\n%s", out)
	}
}

func TestScenarioFileAndPolicyFlag(t *testing.T) {
	dir := t.TempDir()
	scenario := filepath.Join(dir, "s.yaml")
	write(t, scenario, `name: tiny
timeline: {outage: 1m, horizon: 5m}
arrivals: {ratePerSecond: 5}
dependency: {concurrency: 10, callDuration: 100ms, collapse: {after: 10s}}
workers: {minReplicas: 1, maxReplicas: 2, slotsPerPod: 5}
policyFile: p.yaml
`)
	write(t, filepath.Join(dir, "p.yaml"), policyYAML(10))
	code, out, errOut := runCLI(t, "simulate", "--scenario-file", scenario, "--json", "--policies", "spillway")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if !strings.Contains(out, `"scenario": "tiny"`) {
		t.Errorf("output:\n%s", out)
	}
	other := filepath.Join(dir, "other.yaml")
	write(t, other, policyYAML(8))
	if code, _, errOut := runCLI(t, "simulate", "--scenario-file", scenario, "--policy", other, "--policies", "spillway"); code != 0 {
		t.Fatalf("--policy: exit %d: %s", code, errOut)
	}
}

func TestErrorsExit2(t *testing.T) {
	dir := t.TempDir()
	badYAML := filepath.Join(dir, "bad.yaml")
	write(t, badYAML, "name: [")
	badPolicy := filepath.Join(dir, "policy.yaml")
	write(t, badPolicy, strings.Replace(policyYAML(10), "concurrency: 10", "concurrency: -1", 1))
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"no command", nil, "Usage"},
		{"unknown command", []string{"simulat"}, "unknown command"},
		{"unknown scenario", []string{"simulate", "--scenario", "nope"}, "unknown scenario"},
		{"bad scenario YAML", []string{"simulate", "--scenario-file", badYAML}, "parse"},
		{"missing scenario file", []string{"simulate", "--scenario-file", filepath.Join(dir, "none.yaml")}, "none.yaml"},
		{"bad policy", []string{"simulate", "--policy", badPolicy}, "spec.capacity.concurrency"},
		{"unknown sweep param", []string{"simulate", "--sweep", "colour=1,2"}, "unknown parameter"},
		{"bad sweep value", []string{"simulate", "--sweep", "capacity=10,x"}, "capacity=x"},
		{"bad sweep syntax", []string{"simulate", "--sweep", "capacity"}, "PARAM=a,b,c"},
		{"unknown policy", []string{"simulate", "--policies", "spillway,yolo"}, "unknown policy"},
		{"unknown flag", []string{"simulate", "--fast"}, "fast"},
		{"both scenarios", []string{"simulate", "--scenario", "vehicle-api", "--scenario-file", badYAML}, "not both"},
		{"plot with sweep", []string{"simulate", "--plot", "x.png", "--sweep", "seed=1,2"}, "--sweep"},
		{"stray argument", []string{"simulate", "email-outage"}, "unexpected arguments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, _, errOut := runCLI(t, tt.args...)
			if code != 2 {
				t.Errorf("exit %d, want 2", code)
			}
			if !strings.Contains(errOut, tt.want) {
				t.Errorf("stderr %q does not mention %q", errOut, tt.want)
			}
		})
	}
}

func TestHelp(t *testing.T) {
	if code, out, _ := runCLI(t, "help"); code != 0 || !strings.Contains(out, "simulate") {
		t.Errorf("help: exit %d, %q", code, out)
	}
	if code, _, errOut := runCLI(t, "simulate", "-h"); code != 0 || !strings.Contains(errOut, "--scenario") {
		t.Errorf("simulate -h: exit %d, %q", code, errOut)
	}
}

func policyYAML(concurrency int) string {
	return strings.Replace(`apiVersion: spillway.dev/v1alpha1
kind: DependencyPolicy
metadata:
  name: api
spec:
  capacity:
    concurrency: 10
`, "concurrency: 10", "concurrency: "+strconv.Itoa(concurrency), 1)
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
