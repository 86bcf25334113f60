package control

import (
	"math"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestCallsOver(t *testing.T) {
	for _, tc := range []struct {
		rate   float64
		window time.Duration
		want   int64
	}{
		{rate: 4, window: 30 * time.Second, want: 120},
		{rate: 0.5, window: 5 * time.Second, want: 3}, // 2.5 rounds to 3
		{rate: 0, window: 30 * time.Second, want: 0},
		{rate: -1, window: 30 * time.Second, want: -1},
		{rate: math.NaN(), window: 30 * time.Second, want: -1},
		{rate: math.Inf(1), window: time.Second, want: math.MaxInt32},
	} {
		if got := CallsOver(tc.rate, tc.window); got != tc.want {
			t.Errorf("CallsOver(%v, %v) = %d, want %d", tc.rate, tc.window, got, tc.want)
		}
	}
}

// TestPlanWithSignal is the rule that combines an external error ratio with
// the workers' outcomes (withSignal), through Plan, for the seed's policy:
// failure ratio 0.5, minCalls 20, window 30s, openDuration 60s, 3 probes.
func TestPlanWithSignal(t *testing.T) {
	p := seedParams(40)
	failing := Signal{Valid: true, Ratio: 0.8, Calls: 100}
	healthy := Signal{Valid: true, Ratio: 0.02, Calls: 100}
	cases := []struct {
		name string
		// state and since: the published state and when it began.
		state  wire.State
		since  time.Duration // before t0
		window protocol.Window
		probes protocol.Probes
		ext    Signal
		want   wire.State
		// bySignal: the transition's message credits Prometheus.
		bySignal bool
	}{
		{name: "closed, ratio over the threshold opens", state: wire.Closed, since: time.Hour, ext: failing, want: wire.Open, bySignal: true},
		{name: "closed, ratio at the threshold opens", state: wire.Closed, since: time.Hour, ext: Signal{Valid: true, Ratio: 0.5, Calls: 20}, want: wire.Open, bySignal: true},
		{name: "closed, ratio just below stays", state: wire.Closed, since: time.Hour, ext: Signal{Valid: true, Ratio: 0.49, Calls: 100}, want: wire.Closed},
		{name: "closed, ratio above 1 is clamped and opens", state: wire.Closed, since: time.Hour, ext: Signal{Valid: true, Ratio: 7, Calls: 100}, want: wire.Open, bySignal: true},
		{name: "closed, too few calls stays", state: wire.Closed, since: time.Hour, ext: Signal{Valid: true, Ratio: 1, Calls: 19}, want: wire.Closed},
		{name: "closed, unknown call count opens", state: wire.Closed, since: time.Hour, ext: Signal{Valid: true, Ratio: 0.9, Calls: -1}, want: wire.Open, bySignal: true},
		{name: "closed, failed query never opens", state: wire.Closed, since: time.Hour, ext: Signal{Valid: false, Ratio: 1, Calls: 100}, want: wire.Closed},
		{name: "closed, no signal: workers alone", state: wire.Closed, since: time.Hour, window: protocol.Window{Calls: 30, Failures: 20}, want: wire.Open},
		{name: "closed, workers open it and the signal agrees: workers' message", state: wire.Closed, since: time.Hour, window: protocol.Window{Calls: 30, Failures: 20}, ext: failing, want: wire.Open},
		{name: "closed, workers open it while the signal is healthy", state: wire.Closed, since: time.Hour, window: protocol.Window{Calls: 30, Timeouts: 20}, ext: healthy, want: wire.Open},
		{name: "closed, a healthy signal does not hide nothing", state: wire.Closed, since: time.Hour, window: protocol.Window{Calls: 30, Failures: 2}, ext: healthy, want: wire.Closed},
		{name: "closed less than a window ago: errors from before are ignored", state: wire.Closed, since: 20 * time.Second, ext: failing, want: wire.Closed},
		{name: "closed a window ago, but the sample is older than that", state: wire.Closed, since: 40 * time.Second, ext: Signal{Valid: true, Ratio: 0.9, Calls: 100, Age: 15 * time.Second}, want: wire.Closed},
		{name: "closed a window ago, sample a window after", state: wire.Closed, since: 40 * time.Second, ext: Signal{Valid: true, Ratio: 0.9, Calls: 100, Age: 10 * time.Second}, want: wire.Open, bySignal: true},
		{name: "ramping, ratio over the threshold opens", state: wire.Ramping, since: time.Hour, ext: failing, want: wire.Open, bySignal: true},
		{name: "open: the signal is ignored", state: wire.Open, since: 30 * time.Second, ext: healthy, want: wire.Open},
		{name: "open past openDuration half-opens whatever the signal", state: wire.Open, since: 61 * time.Second, ext: failing, want: wire.HalfOpen},
		{name: "half-open, healthy signal closes", state: wire.HalfOpen, since: 40 * time.Second, ext: healthy, want: wire.Ramping, bySignal: true},
		{name: "half-open, healthy over exactly halfOpenProbes calls closes", state: wire.HalfOpen, since: 40 * time.Second, ext: Signal{Valid: true, Calls: 3}, want: wire.Ramping, bySignal: true},
		{name: "half-open, healthy over too few calls waits", state: wire.HalfOpen, since: 40 * time.Second, ext: Signal{Valid: true, Calls: 2}, want: wire.HalfOpen},
		{name: "half-open, healthy with unknown count closes", state: wire.HalfOpen, since: 40 * time.Second, ext: Signal{Valid: true, Ratio: 0.1, Calls: -1}, want: wire.Ramping, bySignal: true},
		{name: "half-open, failing signal reopens", state: wire.HalfOpen, since: 40 * time.Second, ext: failing, want: wire.Open, bySignal: true},
		{name: "half-open, failing over a single call reopens", state: wire.HalfOpen, since: 40 * time.Second, ext: Signal{Valid: true, Ratio: 1, Calls: 1}, want: wire.Open, bySignal: true},
		{name: "half-open, failing over no call waits", state: wire.HalfOpen, since: 40 * time.Second, ext: Signal{Valid: true, Ratio: 1, Calls: 0}, want: wire.HalfOpen},
		{name: "half-open, a sample from before half-opening waits", state: wire.HalfOpen, since: 20 * time.Second, ext: Signal{Valid: true, Ratio: 0, Calls: 100, Age: 20 * time.Second}, want: wire.HalfOpen},
		{name: "half-open, a sample from just after half-opening counts", state: wire.HalfOpen, since: 2 * time.Second, ext: Signal{Valid: true, Ratio: 0, Calls: 100, Age: time.Second}, want: wire.Ramping, bySignal: true},
		{name: "half-open, a failing sample from before half-opening waits", state: wire.HalfOpen, since: 2 * time.Second, ext: Signal{Valid: true, Ratio: 1, Calls: 100, Age: 3 * time.Second}, want: wire.HalfOpen},
		{name: "half-open, healthy signal but a worker probe failed reopens", state: wire.HalfOpen, since: 40 * time.Second, probes: protocol.Probes{Successes: 2, Failures: 1}, ext: healthy, want: wire.Open},
		{name: "half-open, worker probes close without the signal", state: wire.HalfOpen, since: 40 * time.Second, probes: protocol.Probes{Successes: 3}, ext: Signal{}, want: wire.Ramping},
		{name: "half-open, worker probes succeeded but the signal fails: reopens", state: wire.HalfOpen, since: 40 * time.Second, probes: protocol.Probes{Successes: 3}, ext: failing, want: wire.Open, bySignal: true},
		{name: "half-open, failed query: workers' probes alone", state: wire.HalfOpen, since: 40 * time.Second, ext: Signal{Valid: false, Calls: 100}, want: wire.HalfOpen},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			prev := Restore(p, tc.state, 0, t0.Add(-tc.since), t0)
			prev.Epoch = 4
			out := Plan(Input{Params: p, Previous: prev, Window: tc.window, Probes: tc.probes, External: tc.ext, Now: t0})
			g.Expect(out.Next.State).To(Equal(tc.want))
			if tc.want == tc.state {
				g.Expect(out.Transitions).To(BeEmpty())
				return
			}
			g.Expect(out.Transitions).To(HaveLen(1))
			msg := out.Transitions[0].Message
			if tc.bySignal {
				g.Expect(msg).To(HavePrefix("Prometheus error ratio"))
			} else {
				g.Expect(msg).NotTo(ContainSubstring("Prometheus"))
			}
		})
	}
}

// TestSignalAloneRunsTheCycle is a fleet that does not use the library: no
// worker reports anything, and the Prometheus ratio alone opens the breaker,
// passes the half-open probes once it falls, and the ramp climbs to the
// capacity.
func TestSignalAloneRunsTheCycle(t *testing.T) {
	g := NewWithT(t)
	e := newEvaluator()
	e.params.Breaker.Window = 10 * time.Second
	e.params.Breaker.OpenDuration = 30 * time.Second
	e.pub = Restore(e.params, "", 0, time.Time{}, t0)
	eval := func(advance time.Duration, s Signal) Output {
		e.now = e.now.Add(advance)
		out := Plan(Input{Params: e.params, Previous: e.pub, External: s, Now: e.now})
		e.pub = out.Next
		return out
	}
	failing := Signal{Valid: true, Ratio: 0.9, Calls: 50}
	healthy := Signal{Valid: true, Ratio: 0.01, Calls: 20}

	g.Expect(eval(0, Signal{}).Next.State).To(Equal(wire.Closed))
	// Within the first window after the policy's creation the ratio counts
	// for nothing (it may hold errors from before).
	g.Expect(eval(5*time.Second, failing).Next.State).To(Equal(wire.Closed))
	out := eval(5*time.Second, failing)
	g.Expect(out.Next.State).To(Equal(wire.Open))
	g.Expect(out.Next.Limit).To(BeZero())
	g.Expect(reasons(out)).To(Equal([]string{EventOpened}))

	// Open: nothing until openDuration.
	g.Expect(eval(29*time.Second, healthy).Next.State).To(Equal(wire.Open))
	out = eval(time.Second, healthy)
	g.Expect(out.Next.State).To(Equal(wire.HalfOpen))
	// Half-open: a sample measured before half-opening waits; the next one
	// closes, and the ramp starts at its first step.
	g.Expect(eval(time.Second, Signal{Valid: true, Ratio: 0.01, Calls: 20, Age: 2 * time.Second}).Next.State).To(Equal(wire.HalfOpen))
	out = eval(time.Second, healthy)
	g.Expect(out.Next.State).To(Equal(wire.Ramping))
	g.Expect(out.Next.Limit).To(Equal(int64(5)))
	g.Expect(reasons(out)).To(Equal([]string{EventClosed}))

	// The ramp climbs one step per clean minute while the ratio stays low.
	var limits []int64
	for range 3 {
		limits = append(limits, eval(time.Minute, healthy).Next.Limit)
	}
	g.Expect(limits).To(Equal([]int64{10, 20, 40}))
	g.Expect(e.pub.State).To(Equal(wire.Closed))

	// And a failing Prometheus (an invalid signal) changes nothing.
	g.Expect(eval(time.Minute, Signal{Valid: false, Ratio: 1, Calls: 1000}).Next.State).To(Equal(wire.Closed))
}
