package sim_test

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/sim"
)

// policyOf20 is inlinePolicy with a concurrency of 20, the dependency's in
// the tests below.
var policyOf20 = strings.Replace(inlinePolicy, "concurrency: 10", "concurrency: 20", 1)

// runOne parses the scenario doc and runs it under policy p alone.
func runOne(t *testing.T, doc string, p sim.Policy) (*sim.Scenario, sim.Result) {
	t.Helper()
	sc, err := sim.ParseScenario([]byte(doc), nil)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := sim.Run(sc, []sim.Policy{p})
	if err != nil {
		t.Fatal(err)
	}
	return sc, rep.Policies[0]
}

// TestNoCollapseAtConcurrency: a dependency that never holds more than its
// concurrency in flight is not overloaded, whatever its call time. With a
// call time that does not divide a second, a slot at work all the time
// starts 3 calls of 350 ms in six seconds out of seven (2 in the seventh),
// and 4 calls of 300 ms in one second out of three: more than C/S starts in
// those seconds, although no more than C calls ever run. One pod of C slots
// makes exactly C calls in flight; arrivals far above C/S keep every slot
// busy from the first 10 ms on, so the slots start their calls in step.
func TestNoCollapseAtConcurrency(t *testing.T) {
	for _, tt := range []struct {
		call, after string
	}{
		{"300ms", "1s"},
		{"350ms", "5s"},
		{"700ms", "1s"},
		{"100ms", "1s"}, // divides a second: fine before and after
	} {
		t.Run(tt.call, func(t *testing.T) {
			doc := fmt.Sprintf(`name: at-concurrency
timeline: {warmup: 40s, outage: 1s, horizon: 60s}
arrivals: {ratePerSecond: 5000}
dependency:
  concurrency: 20
  callDuration: %s
  collapse: {after: %s}
workers: {minReplicas: 1, maxReplicas: 1, slotsPerPod: 20}
`, tt.call, tt.after) + policyOf20
			sc, r := runOne(t, doc, sim.ImmediateRetry)
			t0 := int(sc.T0() / time.Second)
			for k, c := range r.Series.Capacity[:t0] {
				if c == 0 {
					t.Fatalf("the dependency collapsed at second %d of the warm-up, with never more than 20 calls of %s in flight (calls started per second: %v)", k, tt.call, r.Series.Calls[:k+1])
				}
			}
		})
	}
}

// TestCollapseAboveConcurrency: the same fleet with one slot more than the
// dependency serves offers it more than it can do, and it collapses.
func TestCollapseAboveConcurrency(t *testing.T) {
	for _, call := range []string{"300ms", "350ms", "100ms"} {
		t.Run(call, func(t *testing.T) {
			doc := fmt.Sprintf(`name: above-concurrency
timeline: {warmup: 40s, outage: 1s, horizon: 60s}
arrivals: {ratePerSecond: 5000}
dependency:
  concurrency: 20
  callDuration: %s
  failDuration: %s
  collapse: {after: 5s}
workers: {minReplicas: 1, maxReplicas: 1, slotsPerPod: 22}
`, call, call) + policyOf20
			sc, r := runOne(t, doc, sim.ImmediateRetry)
			t0 := int(sc.T0() / time.Second)
			for _, c := range r.Series.Capacity[:t0] {
				if c == 0 {
					return
				}
			}
			t.Fatalf("22 calls of %s offered to 20 slots for %d s: no collapse", call, t0)
		})
	}
}

// TestHalfOpenProbesPerEpoch: with calls that fail in 5 ms while the
// dependency is down, HalfOpen admits halfOpenProbes calls in the epoch in
// all, as acquire.lua does, not halfOpenProbes at a time (which would let
// a new probe start each time one fails: hundreds a second).
func TestHalfOpenProbesPerEpoch(t *testing.T) {
	doc := `name: fast-failures
timeline: {warmup: 30s, outage: 10m, horizon: 12m}
arrivals: {ratePerSecond: 50}
dependency:
  concurrency: 20
  callDuration: 100ms
  failDuration: 5ms
  collapse: {after: 30s}
workers: {minReplicas: 2, maxReplicas: 2, slotsPerPod: 20}
policy:
  apiVersion: spillway.dev/v1alpha1
  kind: DependencyPolicy
  metadata: {name: api}
  spec:
    capacity: {concurrency: 20}
    breaker: {halfOpenProbes: 3, openDuration: 10s}
`
	sc, err := sim.ParseScenario([]byte(doc), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []sim.Policy{sim.CapRamp, sim.Spillway} {
		rep, err := sim.Run(sc, []sim.Policy{p})
		if err != nil {
			t.Fatal(err)
		}
		r := rep.Policies[0]
		t0, t1 := int(sc.T0()/time.Second), int(sc.T1()/time.Second)
		// Once the breaker has opened (the first second without a call),
		// every call is a probe: 3 per epoch, one epoch per openDuration at
		// most.
		opened := t0
		for opened < t1 && r.Series.Calls[opened] > 0 {
			opened++
		}
		if opened > t0+30 {
			t.Fatalf("%s: the breaker did not open in the first 30 s of the outage: %v", p, r.Series.Calls[t0:opened])
		}
		var probes int32
		for k := opened; k < t1; k++ {
			if c := r.Series.Calls[k]; c > 3 {
				t.Fatalf("%s: %d calls in second %d of the outage, want at most the 3 probes of one HalfOpen epoch (calls per second from the outage on: %v)", p, c, k-t0, r.Series.Calls[t0:k+1])
			}
			probes += r.Series.Calls[k]
		}
		if probes == 0 {
			t.Fatalf("%s: no probe in the outage; the test needs HalfOpen epochs", p)
		}
	}
}

// TestPredictionAccuracy: the drain forecast is the fluid limit of the
// model. For the fixed schedule (stepBack.when Never: one step per
// stepDuration, the climb the forecast assumes), where nothing expires,
// nothing collapses and the backlog outlasts the ramp, it is off only by the
// randomness of the arrivals: over a drain of D seconds the Poisson count
// differs from A×D by about √(A×D), which moves the drain by √(A×D)/(T−A).
// The test allows 1% plus two such standard deviations, over variations of
// the built-in scenarios. With the default rule (Ramping) a step its calls
// prove clean climbs early, so the forecast is an upper bound: the drain
// must lie between the forecast without the ramp's withheld capacity and
// the forecast, each with the same allowance.
func TestPredictionAccuracy(t *testing.T) {
	variations := []struct {
		scenario string
		sweep    [][2]string
	}{
		{"vehicle-api", [][2]string{{"seed", "1"}, {"seed", "2"}, {"seed", "3"}, {"outage", "30s"}, {"outage", "5m"}, {"outage", "10m"},
			{"arrival_rate", "20"}, {"arrival_rate", "40"}, {"arrival_rate", "50"}, {"arrival_rate", "60"}, {"arrival_rate", "70"},
			{"backlog", "1000"}, {"backlog", "10000"}, {"backlog", "30000"},
			{"call_duration", "150ms"}, {"call_duration", "250ms"}, {"call_duration", "300ms"}, {"call_duration", "350ms"}, {"call_duration", "400ms"}, {"call_duration", "500ms"}}},
		{"interview-model", [][2]string{{"seed", "2"}, {"outage", "1m"}, {"arrival_rate", "400"}, {"arrival_rate", "600"}, {"backlog", "50000"}, {"call_duration", "30ms"}}},
		{"email-outage", [][2]string{{"seed", "2"}, {"outage", "5m"}, {"outage", "30m"}, {"arrival_rate", "20"}, {"arrival_rate", "200"}, {"backlog", "20000"}, {"call_duration", "50ms"}, {"call_duration", "300ms"}}},
	}
	for _, v := range variations {
		for _, kv := range v.sweep {
			sc, err := sim.Builtin(v.scenario)
			if err != nil {
				t.Fatal(err)
			}
			if err := sc.Set(kv[0], kv[1]); err != nil {
				t.Fatal(err)
			}
			checkBounded(t, sc, fmt.Sprintf("%s %s=%s (Ramping)", v.scenario, kv[0], kv[1]))
			sc.Policy.Spec.Ramp.StepBack.When = "Never"
			params, err := policy.FromSpec(sc.Policy.Spec)
			if err != nil {
				t.Fatal(err)
			}
			rep, err := sim.Run(sc, []sim.Policy{sim.CapRamp})
			if err != nil {
				t.Fatal(err)
			}
			r := rep.Policies[0]
			name := fmt.Sprintf("%s %s=%s (Never)", v.scenario, kv[0], kv[1])
			if r.DrainSeconds == nil || r.PredictedDrainSeconds == nil || r.SecondOutages > 0 {
				t.Errorf("%s: drain %v, predicted %v, %d second outages: the variation is not one the forecast covers", name, r.DrainSeconds, r.PredictedDrainSeconds, r.SecondOutages)
				continue
			}
			drain, predicted := *r.DrainSeconds, *r.PredictedDrainSeconds
			pr := r.Prediction
			rampTop := pr.Shut + float64(len(params.Ramp.Steps)-1)*params.Ramp.StepDuration.Seconds()
			if drain < rampTop {
				t.Errorf("%s: drained at %vs, before the ramp topped out at %vs: the variation is not one the forecast covers", name, drain, rampTop)
				continue
			}
			sigma := math.Sqrt(pr.Arrivals*drain) / (pr.Throughput - pr.Arrivals)
			allowed := 0.01*predicted + 2*sigma
			t.Logf("%s: drained in %vs, predicted %vs (%+.1f%%), allowed ±%.1fs", name, drain, predicted, 100*(drain-predicted)/predicted, allowed)
			if math.Abs(drain-predicted) > allowed {
				t.Errorf("%s: drained in %vs, predicted %vs: more than 1%% + 2σ (%.1fs) apart", name, drain, predicted, allowed)
			}
		}
	}
}

// checkBounded runs sc's cap-ramp with its own (default, adaptive) ramp and
// checks the drain lies within the forecast's bracket: no longer than the
// forecast (a climb of one step per stepDuration) and no shorter than the
// forecast without the ramp's withheld capacity (a climb in no time), each
// with TestPredictionAccuracy's allowance of 1% plus two standard deviations.
func checkBounded(t *testing.T, sc *sim.Scenario, name string) {
	t.Helper()
	rep, err := sim.Run(sc, []sim.Policy{sim.CapRamp})
	if err != nil {
		t.Fatal(err)
	}
	r := rep.Policies[0]
	if r.DrainSeconds == nil || r.PredictedDrainSeconds == nil || r.SecondOutages > 0 {
		t.Errorf("%s: drain %v, predicted %v, %d second outages: the variation is not one the forecast covers", name, r.DrainSeconds, r.PredictedDrainSeconds, r.SecondOutages)
		return
	}
	drain, predicted := *r.DrainSeconds, *r.PredictedDrainSeconds
	pr := r.Prediction
	floor := predicted - pr.Withheld/(pr.Throughput-pr.Arrivals)
	sigma := math.Sqrt(pr.Arrivals*drain) / (pr.Throughput - pr.Arrivals)
	allowed := 0.01*predicted + 2*sigma
	t.Logf("%s: drained in %vs, forecast between %.1fs and %vs, allowed ±%.1fs", name, drain, floor, predicted, allowed)
	if drain > predicted+allowed || drain < floor-allowed {
		t.Errorf("%s: drained in %vs, outside the forecast's bracket [%.1fs, %vs] ± %.1fs", name, drain, floor, predicted, allowed)
	}
}

// peakRun runs one pod of slots slots, always busy, against a dependency of
// 20 slots with calls of call; failed calls take as long as served ones, so
// during the outage each slot still wants one call's worth of slot-time at
// a time. After the outage it comes back at half its concurrency for 5 s,
// so half the slots' calls are turned away.
func peakRun(t *testing.T, call string, slots int) sim.Result {
	t.Helper()
	doc := fmt.Sprintf(`name: peak
timeline: {warmup: 20s, outage: 2s, horizon: 30s}
arrivals: {ratePerSecond: 5000}
dependency:
  concurrency: 20
  callDuration: %s
  coldStart: {factor: 0.5, duration: 5s}
  collapse: {after: 1h}
workers: {minReplicas: 1, maxReplicas: 1, slotsPerPod: %d}
`, call, slots) + policyOf20
	_, r := runOne(t, doc, sim.ImmediateRetry)
	return r
}

// TestPeakAtConcurrency: a fleet that never has more calls in flight than
// the dependency's concurrency offers at most its capacity, so the peak is
// at most 1.0, whatever the call time. Counting calls started per second
// against C/S reads 1.05 for 350 ms calls (3 starts in most seconds against
// 2.86) and 1.2 for 300 ms.
func TestPeakAtConcurrency(t *testing.T) {
	for _, call := range []string{"100ms", "300ms", "350ms", "700ms", "1500ms"} {
		t.Run(call, func(t *testing.T) {
			r := peakRun(t, call, 20)
			if r.PeakOverCapacity > 1.0 {
				t.Errorf("peak_over_capacity = %v with never more than 20 calls of %s in flight at a dependency of concurrency 20, want <= 1.0 (calls started per second: %v)", r.PeakOverCapacity, call, r.Series.Calls[:5])
			}
			if r.PeakOverCapacity < 0.99 {
				t.Errorf("peak_over_capacity = %v with 20 calls of %s always in flight at a dependency of concurrency 20, want 1.0", r.PeakOverCapacity, call)
			}
		})
	}
}

// TestPeakAboveConcurrency: two slots more than the dependency holds offer
// 22 calls' worth of slot-time a second against 20: the peak is 1.1.
func TestPeakAboveConcurrency(t *testing.T) {
	for _, call := range []string{"100ms", "350ms", "1500ms"} {
		t.Run(call, func(t *testing.T) {
			r := peakRun(t, call, 22)
			if r.PeakOverCapacity <= 1.0 || math.Abs(r.PeakOverCapacity-1.1) > 0.011 {
				t.Errorf("peak_over_capacity = %v with 22 calls of %s always wanting a slot at a dependency of concurrency 20, want 1.1", r.PeakOverCapacity, call)
			}
		})
	}
}
