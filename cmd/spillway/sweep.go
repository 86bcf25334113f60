package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/spillway-dev/spillway/internal/sim"
)

// sweepPoint names the value of one run of a sweep.
type sweepPoint struct {
	Param string `json:"param"`
	Value string `json:"value"`
}

// sweepReport is one line of `--sweep --json` output: the report of one
// value, with the value.
type sweepReport struct {
	Scenario string       `json:"scenario"`
	Sweep    sweepPoint   `json:"sweep"`
	Policies []sim.Result `json:"policies"`
}

// parseSweep splits PARAM=a,b,c and builds one scenario per value; every
// value is checked before anything runs.
func parseSweep(spec string, sc *sim.Scenario) (string, []string, []*sim.Scenario, error) {
	name, list, ok := strings.Cut(spec, "=")
	name = strings.TrimSpace(name)
	if !ok || name == "" || strings.TrimSpace(list) == "" {
		return "", nil, nil, badInput("--sweep wants PARAM=a,b,c, got %q", spec)
	}
	var values []string
	var scenarios []*sim.Scenario
	for _, v := range strings.Split(list, ",") {
		v = strings.TrimSpace(v)
		if v == "" {
			return "", nil, nil, badInput("--sweep %s: empty value in %q", name, list)
		}
		c := sc.Clone()
		if err := c.Set(name, v); err != nil {
			return "", nil, nil, badInput("--sweep: %w", err)
		}
		values = append(values, v)
		scenarios = append(scenarios, c)
	}
	return name, values, scenarios, nil
}

// sweep runs the scenario once per value and prints a table per value, or
// one JSON object per line with --json.
func sweep(f simulateFlags, sc *sim.Scenario, policies []sim.Policy, stdout io.Writer) error {
	name, values, scenarios, err := parseSweep(f.sweep, sc)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(stdout)
	for i, c := range scenarios {
		rep, err := sim.Run(c, policies)
		if err != nil {
			return usageError{err}
		}
		if f.json {
			line := sweepReport{Scenario: rep.Scenario, Sweep: sweepPoint{Param: name, Value: values[i]}, Policies: rep.Policies}
			if err := enc.Encode(line); err != nil {
				return fmt.Errorf("failed to write JSON: %w", err)
			}
			continue
		}
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		fmt.Fprintf(stdout, "== %s=%s\n", name, values[i])
		if err := writeTable(stdout, c, rep); err != nil {
			return err
		}
	}
	return nil
}
