package control

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// seedParams are the seed's dependency: 40 concurrent calls, the ramp 5, 10,
// 20, 40 one step per clean minute, the API's default breaker.
func seedParams(capacity int64, steps ...int64) policy.Params {
	if len(steps) == 0 {
		steps = ramp.DefaultSteps(capacity)
	}
	return policy.Params{
		Capacity: capacity,
		Breaker: breaker.Config{
			FailureRatio:   0.5,
			MinCalls:       20,
			Window:         30 * time.Second,
			OpenDuration:   60 * time.Second,
			HalfOpenProbes: 3,
		},
		Ramp:    ramp.Schedule{Steps: steps, StepDuration: time.Minute},
		Backoff: retry.Backoff{Base: time.Second, Max: 5 * time.Minute, Jitter: retry.JitterFull},
		Budget:  retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute},
	}
}

// evaluator runs Plan the way the reconciler does: each output is the next
// input's Previous.
type evaluator struct {
	params policy.Params
	now    time.Time
	pub    protocol.Published
}

func newEvaluator() *evaluator {
	e := &evaluator{params: seedParams(40), now: t0}
	e.pub = Restore(e.params, "", 0, time.Time{}, t0)
	return e
}

func (e *evaluator) eval(w protocol.Window, p protocol.Probes) Output {
	out := Plan(Input{Params: e.params, Previous: e.pub, Window: w, Probes: p, Now: e.now})
	e.pub = out.Next
	return out
}

func reasons(out Output) []string {
	var rs []string
	for _, t := range out.Transitions {
		rs = append(rs, t.Reason)
	}
	return rs
}

// step is one evaluation of a scripted scenario: advance the clock, report
// a window and probes, expect a state, limit, epoch and event reasons.
type step struct {
	name    string
	advance time.Duration
	window  protocol.Window
	probes  protocol.Probes
	state   wire.State
	limit   int64
	epoch   int64
	events  []string
}

func runSteps(t *testing.T, e *evaluator, steps []step) {
	t.Helper()
	for _, s := range steps {
		e.now = e.now.Add(s.advance)
		out := e.eval(s.window, s.probes)
		if out.Next.State != s.state || out.Next.Limit != s.limit || out.Next.Epoch != s.epoch || !equalStrings(reasons(out), s.events) {
			t.Fatalf("%s: got state %s limit %d epoch %d events %v, want %s %d %d %v",
				s.name, out.Next.State, out.Next.Limit, out.Next.Epoch, reasons(out), s.state, s.limit, s.epoch, s.events)
		}
	}
}

func equalStrings(a, b []string) bool {
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

var (
	burst   = protocol.Window{Calls: 20, Failures: 8, Timeouts: 2}
	healthy = protocol.Window{Calls: 100, Successes: 100}
	probes3 = protocol.Probes{Successes: 3}
)

func TestPlanSeedRecovery(t *testing.T) {
	e := newEvaluator()
	runSteps(t, e, []step{
		{name: "first evaluation", state: wire.Closed, limit: 40, epoch: 1},
		{name: "healthy", advance: time.Second, window: healthy, state: wire.Closed, limit: 40, epoch: 1},
		{name: "19 calls cannot open", advance: time.Second, window: protocol.Window{Calls: 19, Failures: 19}, state: wire.Closed, limit: 40, epoch: 1},
		{name: "failures and timeouts open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}},
		{name: "still open", advance: 59 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2},
		{name: "half-open after 60s", advance: time.Second, state: wire.HalfOpen, limit: 3, epoch: 3, events: []string{EventHalfOpened}},
		{name: "two probes are not enough", advance: time.Second, probes: protocol.Probes{Successes: 2}, state: wire.HalfOpen, limit: 3, epoch: 3},
		{name: "three probes close", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventClosed}},
		{name: "59 clean seconds", advance: 59 * time.Second, window: healthy, state: wire.Ramping, limit: 5, epoch: 4},
		{name: "one clean minute", advance: time.Second, window: healthy, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		{name: "two clean minutes", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 20, epoch: 4, events: []string{EventRampStep}},
		{name: "three clean minutes", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5, events: []string{EventRampStep}},
		{name: "closed stays closed", advance: time.Minute, window: healthy, state: wire.Closed, limit: 40, epoch: 5},
	})
	if e.pub.OpenUntil != (time.Time{}) {
		t.Errorf("OpenUntil = %v once closed, want zero", e.pub.OpenUntil)
	}
}

func TestPlanErrorsMidRampRestartFromBottom(t *testing.T) {
	e := newEvaluator()
	runSteps(t, e, []step{
		{name: "closed", state: wire.Closed, limit: 40, epoch: 1},
		{name: "open", advance: time.Second, window: burst, state: wire.Open, limit: 0, epoch: 2, events: []string{EventOpened}},
		{name: "half-open", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 3, events: []string{EventHalfOpened}},
		{name: "closed, ramp at 5", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 4, events: []string{EventClosed}},
		{name: "ramp at 10", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 4, events: []string{EventRampStep}},
		{name: "errors mid-ramp reopen", advance: 10 * time.Second, window: burst, state: wire.Open, limit: 0, epoch: 5, events: []string{EventOpened}},
		{name: "half-open again", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 6, events: []string{EventHalfOpened}},
		{name: "a probe fails", advance: time.Second, probes: protocol.Probes{Successes: 1, Timeouts: 1}, state: wire.Open, limit: 0, epoch: 7, events: []string{EventOpened}},
		{name: "half-open a third time", advance: time.Minute, state: wire.HalfOpen, limit: 3, epoch: 8, events: []string{EventHalfOpened}},
		{name: "closed: the ramp restarts from 5", advance: time.Second, probes: probes3, state: wire.Ramping, limit: 5, epoch: 9, events: []string{EventClosed}},
		{name: "a clean minute: 10, where it fell over, is a ceiling", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 5, epoch: 9},
		{name: "then 10 after twice the stepDuration", advance: time.Minute, window: healthy, state: wire.Ramping, limit: 10, epoch: 9, events: []string{EventRampStep}},
	})
}

func TestPlanPublishesParamsAndPersistedState(t *testing.T) {
	e := newEvaluator()
	e.eval(protocol.Window{}, protocol.Probes{})
	e.now = e.now.Add(time.Second)
	out := e.eval(burst, protocol.Probes{})
	n := out.Next
	opened := t0.Add(time.Second)
	g := NewWithT(t)
	g.Expect(n.State).To(Equal(wire.Open))
	g.Expect(n.OpenUntil).To(Equal(opened.Add(time.Minute)))
	g.Expect(n.BreakerSince).To(Equal(opened))
	g.Expect(n.RampStep).To(Equal(0), "the ramp is reset while open")
	g.Expect(n.Capacity).To(Equal(int64(40)))
	g.Expect(n.BreakerWindow).To(Equal(30 * time.Second))
	g.Expect(n.Backoff).To(Equal(e.params.Backoff))
	g.Expect(n.Budget).To(Equal(e.params.Budget))
	g.Expect(out.Transitions).To(HaveLen(1))
	g.Expect(out.Transitions[0].From).To(Equal(wire.Closed))
	g.Expect(out.Transitions[0].To).To(Equal(wire.Open))
	g.Expect(out.Transitions[0].Message).To(ContainSubstring("10 of 20 calls failed or timed out"))
}

func TestPlanAdvancesAtMostOneStepAfterAGap(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(40)
	prev := protocol.Published{
		State: wire.Ramping, Epoch: 4, BreakerSince: t0, RampStep: 1, RampStepStarted: t0,
	}
	out := Plan(Input{Params: p, Previous: prev, Window: healthy, Now: t0.Add(time.Hour)})
	g.Expect(out.Next.State).To(Equal(wire.Ramping))
	g.Expect(out.Next.Limit).To(Equal(int64(20)), "one step up from 10, not the full capacity")
	g.Expect(out.Next.RampStep).To(Equal(2))
	g.Expect(out.Next.Epoch).To(Equal(int64(4)))
}

func TestPlanCapacityChangeKeepsAClosedBreakerClosed(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(400)
	prev := protocol.Published{State: wire.Closed, Epoch: 3, BreakerSince: t0, RampStep: 3, RampStepStarted: t0}
	out := Plan(Input{Params: p, Previous: prev, Window: healthy, Now: t0.Add(time.Second)})
	g.Expect(out.Next.State).To(Equal(wire.Closed))
	g.Expect(out.Next.Limit).To(Equal(int64(400)))
	g.Expect(out.Transitions).To(BeEmpty())
}

func TestPlanIgnoresFailuresFromBeforeTheBreakerClosed(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(40)
	closedAt := t0.Add(-5 * time.Second)
	prev := protocol.Published{State: wire.Ramping, Epoch: 4, BreakerSince: closedAt, RampStep: 0, RampStepStarted: closedAt}
	g.Expect(WindowStart(p, prev, t0)).To(Equal(closedAt), "the window starts at the close, not 30s back")
	prev.BreakerSince = t0.Add(-time.Hour)
	g.Expect(WindowStart(p, prev, t0)).To(Equal(t0.Add(-30 * time.Second)))
}

func TestPlanSingleStepRampClosesStraightAway(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(3, 3)
	prev := protocol.Published{State: wire.HalfOpen, Epoch: 3, BreakerSince: t0}
	out := Plan(Input{Params: p, Previous: prev, Probes: probes3, Now: t0.Add(time.Second)})
	g.Expect(out.Next.State).To(Equal(wire.Closed))
	g.Expect(out.Next.Limit).To(Equal(int64(3)))
	g.Expect(out.Next.Epoch).To(Equal(int64(4)))
	g.Expect(reasons(out)).To(Equal([]string{EventClosed}))
}

func TestLimit(t *testing.T) {
	p := seedParams(40)
	tests := []struct {
		state wire.State
		ramp  int64
		want  int64
	}{
		{wire.Open, 10, 0},
		{wire.HalfOpen, 10, 3},
		{wire.Ramping, 10, 10},
		{wire.Closed, 10, 40},
	}
	for _, tt := range tests {
		t.Run(string(tt.state), func(t *testing.T) {
			if got := Limit(p, tt.state, tt.ramp); got != tt.want {
				t.Errorf("Limit(%s) = %d, want %d", tt.state, got, tt.want)
			}
		})
	}
}

func TestRestore(t *testing.T) {
	p := seedParams(40)
	now := t0.Add(30 * time.Second) // the breaker opened at t0 half-opens at t0+60s
	tests := []struct {
		name  string
		state wire.State
		step  int
		since time.Time
		want  protocol.Published
		limit int64
	}{
		{
			name:  "never evaluated: closed at full capacity, the ramp complete a step ago",
			want:  protocol.Published{State: wire.Closed, BreakerSince: now, RampStep: 3, RampStepStarted: now.Add(-time.Minute)},
			limit: 40,
		},
		{
			name: "closed keeps its transition time", state: wire.Closed, step: 3, since: t0,
			want:  protocol.Published{State: wire.Closed, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit: 40,
		},
		{
			name: "open keeps its transition time", state: wire.Open, since: t0,
			want:  protocol.Published{State: wire.Open, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit: 0,
		},
		{
			name: "half-open", state: wire.HalfOpen, since: t0,
			want:  protocol.Published{State: wire.HalfOpen, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit: 3,
		},
		{
			name: "ramping continues at its step, restarted now", state: wire.Ramping, step: 2, since: t0,
			want:  protocol.Published{State: wire.Ramping, BreakerSince: t0, RampStep: 2, RampStepStarted: now},
			limit: 20,
		},
		{
			name: "a step beyond the schedule is clamped", state: wire.Ramping, step: 9, since: t0,
			want: protocol.Published{State: wire.Ramping, BreakerSince: t0, RampStep: 3, RampStepStarted: now},
		},
		{
			name: "a transition time in the future is now", state: wire.Open, since: now.Add(time.Hour),
			want: protocol.Published{State: wire.Open, BreakerSince: now, RampStep: 3, RampStepStarted: now},
		},
		{
			name: "an unknown state is closed", state: "Stalled", since: t0,
			want:  protocol.Published{State: wire.Closed, BreakerSince: t0, RampStep: 3, RampStepStarted: t0},
			limit: 40,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got := Restore(p, tt.state, tt.step, tt.since, now)
			g.Expect(got).To(Equal(tt.want))
			if tt.limit != 0 || tt.want.State == wire.Open {
				// The first plan from a restored state keeps it, at epoch 1.
				out := Plan(Input{Params: p, Previous: got, Now: now})
				g.Expect(out.Next.State).To(Equal(tt.want.State))
				g.Expect(out.Next.Limit).To(Equal(tt.limit))
				g.Expect(out.Next.Epoch).To(Equal(int64(1)))
			}
		})
	}
}

// TestPlanDeadManFields: every plan carries the policy's halfOpenProbes and
// the dead-man bound; an Open plan's bound runs from OpenUntil, so the rule
// never admits probes before the breaker would have; 0 keeps the rule off.
func TestPlanDeadManFields(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(40)
	prev := Restore(p, "", 0, time.Time{}, t0)
	in := Input{Params: p, Previous: prev, Now: t0, StaleAfter: 30 * time.Second}

	closed := Plan(in).Next
	g.Expect(closed.State).To(Equal(wire.Closed))
	g.Expect(closed.HalfOpenProbes).To(Equal(int64(3)))
	g.Expect(closed.StaleAfter).To(Equal(30 * time.Second))

	// 20 failures open the breaker for 60 s: stale 60 s + 30 s after now.
	in.Window = protocol.Window{Calls: 20, Failures: 20}
	open := Plan(in).Next
	g.Expect(open.State).To(Equal(wire.Open))
	g.Expect(open.StaleAfter).To(Equal(90 * time.Second))
	// 45 s later, still Open: 15 s + 30 s.
	later := Plan(Input{Params: p, Previous: open, Now: t0.Add(45 * time.Second), StaleAfter: 30 * time.Second}).Next
	g.Expect(later.State).To(Equal(wire.Open))
	g.Expect(later.StaleAfter).To(Equal(45 * time.Second))

	in.StaleAfter = 0
	g.Expect(Plan(in).Next.StaleAfter).To(BeZero(), "0 keeps the rule off, Open too")
}

// TestPlanCarriesTheSequenceItWasMadeFrom: the plan is fenced by the sequence
// of the state it was read from, whatever it decides.
func TestPlanCarriesTheSequenceItWasMadeFrom(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(40)
	prev := Restore(p, "", 0, time.Time{}, t0)
	prev.Epoch, prev.Seq = 4, 17
	g.Expect(Plan(Input{Params: p, Previous: prev, Now: t0}).Next.Seq).To(Equal(int64(17)))
	open := Plan(Input{Params: p, Previous: prev, Now: t0, Window: protocol.Window{Calls: 20, Failures: 20}}).Next
	g.Expect(open.State).To(Equal(wire.Open))
	g.Expect(open.Seq).To(Equal(int64(17)))
}

// TestPlanTimesAheadOfRedis: times written by a clock ahead of Redis's (a
// manager that planned by its own clock) count as now, so failures reported
// now still open the breaker and an Open breaker half-opens openDuration from
// now, not from a time in the future.
func TestPlanTimesAheadOfRedis(t *testing.T) {
	g := NewWithT(t)
	p := seedParams(40)
	prev := Restore(p, "", 0, time.Time{}, t0)
	prev.Epoch = 1
	prev.BreakerSince = t0.Add(40 * time.Second)
	prev.RampStepStarted = prev.BreakerSince
	g.Expect(WindowStart(p, prev, t0)).To(Equal(t0))
	open := Plan(Input{Params: p, Previous: prev, Now: t0, Window: protocol.Window{Calls: 20, Failures: 20}}).Next
	g.Expect(open.State).To(Equal(wire.Open))
	g.Expect(open.OpenUntil).To(Equal(t0.Add(time.Minute)))

	open.BreakerSince = t0.Add(40 * time.Second)
	still := Plan(Input{Params: p, Previous: open, Now: t0}).Next
	g.Expect(still.State).To(Equal(wire.Open))
	g.Expect(still.BreakerSince).To(Equal(t0), "the future time is replaced by now")
	half := Plan(Input{Params: p, Previous: still, Now: t0.Add(time.Minute)}).Next
	g.Expect(half.State).To(Equal(wire.HalfOpen), "an Open since a future time half-opens openDuration after now")
}

// TestPinsMinReplicas: a pinning policy holds the minimum through Open,
// HalfOpen and Ramping and lets go once Closed; a policy that does not pin
// never does.
func TestPinsMinReplicas(t *testing.T) {
	pinning, free := seedParams(40), seedParams(40)
	pinning.PinMinReplicas, free.PinMinReplicas = true, false
	for _, c := range []struct {
		state wire.State
		want  bool
	}{
		{wire.Open, true},
		{wire.HalfOpen, true},
		{wire.Ramping, true},
		{wire.Closed, false},
	} {
		if got := PinsMinReplicas(pinning, c.state); got != c.want {
			t.Errorf("PinsMinReplicas(pinning, %s) = %v, want %v", c.state, got, c.want)
		}
		if PinsMinReplicas(free, c.state) {
			t.Errorf("PinsMinReplicas(not pinning, %s) = true", c.state)
		}
	}
}
