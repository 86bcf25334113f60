package sim

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// param is one scenario parameter that a sweep can vary.
type param struct {
	name, help string
	set        func(s *Scenario, value string) error
}

var params = []param{
	{"capacity", "dependency.concurrency: what the dependency really serves (the policy is kept as written)", setCapacity},
	{"outage", "timeline.outage, a duration (5m) or seconds (300)", setOutage},
	{"arrival_rate", "arrivals.ratePerSecond, new jobs per second", setArrivalRate},
	{"backlog", "arrivals.backlog, extra jobs queued when the outage starts", setBacklog},
	{"call_duration", "dependency.callDuration, a duration (100ms) or seconds (0.1)", setCallDuration},
	{"seed", "seed of the random streams", setSeed},
}

// SweepParams returns the names of the parameters Set accepts, with a line
// of help each.
func SweepParams() [][2]string {
	out := make([][2]string, len(params))
	for i, p := range params {
		out[i] = [2]string{p.name, p.help}
	}
	return out
}

// Set sets one sweep parameter from its text form and checks the result.
func (s *Scenario) Set(name, value string) error {
	for _, p := range params {
		if p.name != name {
			continue
		}
		if err := p.set(s, strings.TrimSpace(value)); err != nil {
			return fmt.Errorf("%s=%s: %w", name, value, err)
		}
		s.Default()
		if err := errors.Join(s.validateWorld()...); err != nil {
			return fmt.Errorf("%s=%s: %w", name, value, err)
		}
		return nil
	}
	names := make([]string, len(params))
	for i, p := range params {
		names[i] = p.name
	}
	return fmt.Errorf("unknown parameter %q (known: %s)", name, strings.Join(names, ", "))
}

func setCapacity(s *Scenario, v string) error {
	n, err := strconv.Atoi(v)
	if err != nil {
		return fmt.Errorf("want an integer: %w", err)
	}
	s.Dependency.Concurrency = n
	return nil
}

func setOutage(s *Scenario, v string) error {
	d, err := parseDuration(v)
	s.Timeline.Outage.Duration = d
	return err
}

func setArrivalRate(s *Scenario, v string) error {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return fmt.Errorf("want a number: %w", err)
	}
	s.Arrivals.RatePerSecond = f
	return nil
}

func setBacklog(s *Scenario, v string) error {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return fmt.Errorf("want an integer: %w", err)
	}
	s.Arrivals.Backlog = n
	return nil
}

func setCallDuration(s *Scenario, v string) error {
	d, err := parseDuration(v)
	s.Dependency.CallDuration.Duration = d
	return err
}

func setSeed(s *Scenario, v string) error {
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return fmt.Errorf("want a non-negative integer: %w", err)
	}
	s.Seed = n
	return nil
}

// parseDuration accepts a Go duration or a number of seconds.
func parseDuration(v string) (time.Duration, error) {
	if d, err := time.ParseDuration(v); err == nil {
		return d, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return 0, fmt.Errorf("want a duration such as 90s or a number of seconds")
	}
	return time.Duration(f * float64(time.Second)), nil
}
