package ramp

import (
	"math"
	"strings"
	"testing"
	"time"
)

// rule is the API's default step-back rule.
var rule = StepBack{When: Ramping, FailureRatio: 0.01, MinFailures: 3}

func TestStepBackValidate(t *testing.T) {
	tests := []struct {
		name    string
		sb      StepBack
		wantErr string
	}{
		{name: "zero is off", sb: StepBack{}},
		{name: "Never ignores the rest", sb: StepBack{When: Never, FailureRatio: 7}},
		{name: "default", sb: rule},
		{name: "always", sb: StepBack{When: Always, FailureRatio: 0.2, MinFailures: 1}},
		{name: "unknown when", sb: StepBack{When: "Sometimes", FailureRatio: 0.1, MinFailures: 1}, wantErr: "when"},
		{name: "ratio 0", sb: StepBack{When: Ramping, MinFailures: 1}, wantErr: "failureRatio"},
		{name: "ratio 1", sb: StepBack{When: Ramping, FailureRatio: 1, MinFailures: 1}, wantErr: "failureRatio"},
		{name: "min failures 0", sb: StepBack{When: Ramping, FailureRatio: 0.1}, wantErr: "minFailures"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.sb.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate() = %v, want error containing %q", err, tt.wantErr)
			}
		})
	}
	s := seed()
	s.StepBack = StepBack{When: Ramping}
	if err := s.Validate(40); err == nil || !strings.Contains(err.Error(), "stepBack: failureRatio") {
		t.Fatalf("Schedule.Validate() = %v, want the stepBack error", err)
	}
}

// TestWilsonLower checks the bound against values computed by hand and its
// limits.
func TestWilsonLower(t *testing.T) {
	tests := []struct {
		k, n int64
		z    float64
		want float64
	}{
		{k: 0, n: 0, z: Z, want: 0},
		{k: 0, n: 100, z: Z, want: 0},
		// p = 1/6, n = 18: center 0.2103, margin 0.1416
		{k: 3, n: 18, z: Z, want: 0.0687},
		// p = 0.5, n = 100, z = 1.96: the textbook 0.4038
		{k: 50, n: 100, z: 1.96, want: 0.4038},
		{k: 1, n: 1, z: 1.96, want: 0.2065},
	}
	for _, tt := range tests {
		if got := WilsonLower(tt.k, tt.n, tt.z); math.Abs(got-tt.want) > 5e-4 {
			t.Errorf("WilsonLower(%d, %d, %v) = %.4f, want %.4f", tt.k, tt.n, tt.z, got, tt.want)
		}
	}
	// It grows with the evidence at a fixed ratio, and stays below it.
	prev := 0.0
	for n := int64(10); n <= 100000; n *= 10 {
		got := WilsonLower(n/10, n, Z)
		if got <= prev || got >= 0.1 {
			t.Fatalf("WilsonLower(%d, %d) = %v after %v: want increasing and below 0.1", n/10, n, got, prev)
		}
		prev = got
	}
}

// TestJudge is the rule's table: every verdict, and the cases that must not
// step back (a single failure at tiny volume, a healthy dependency's noise at
// high volume).
func TestJudge(t *testing.T) {
	tests := []struct {
		name            string
		sb              StepBack
		calls, failures int64
		want            Verdict
	}{
		{name: "no calls", sb: rule, want: Clean},
		{name: "no failures", sb: rule, calls: 1000, want: Clean},
		{name: "one failure in one call holds", sb: rule, calls: 1, failures: 1, want: Hold},
		{name: "two failures in two calls hold: below minFailures", sb: rule, calls: 2, failures: 2, want: Hold},
		{name: "three failures in three calls step back", sb: rule, calls: 3, failures: 3, want: Back},
		{name: "1 in 6 over 3 s (cold capacity 1 of 2)", sb: rule, calls: 18, failures: 3, want: Back},
		{name: "1 in 41 over 5 s (cold capacity 4 of 40, 1 s timeouts)", sb: rule, calls: 205, failures: 5, want: Back},
		{name: "1 in 41 over 3 s: not yet conclusive", sb: rule, calls: 123, failures: 3, want: Hold},
		{name: "noise: 0.5% of 10000", sb: rule, calls: 10000, failures: 50, want: Clean},
		{name: "1% of 10000 holds but does not step back", sb: rule, calls: 10000, failures: 100, want: Hold},
		{name: "1.5% of 10000 steps back", sb: rule, calls: 10000, failures: 150, want: Back},
		{name: "more failures than calls are calls", sb: rule, calls: 3, failures: 9, want: Back},
		{name: "Never never judges", sb: StepBack{When: Never, FailureRatio: 0.01, MinFailures: 1}, calls: 10, failures: 10, want: Clean},
		{name: "zero rule never judges", calls: 10, failures: 10, want: Clean},
		{name: "minFailures 10", sb: StepBack{When: Always, FailureRatio: 0.01, MinFailures: 10}, calls: 9, failures: 9, want: Hold},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.sb.Judge(tt.calls, tt.failures); got != tt.want {
				t.Fatalf("Judge(%d calls, %d failures) = %v, want %v", tt.calls, tt.failures, got, tt.want)
			}
		})
	}
}

func TestSettle(t *testing.T) {
	for _, tt := range []struct{ step, want time.Duration }{
		{step: time.Minute, want: 10 * time.Second},
		{step: 20 * time.Second, want: 5 * time.Second},
		{step: time.Second, want: 250 * time.Millisecond},
		{step: time.Hour, want: MaxSettle},
	} {
		if got := (Schedule{StepDuration: tt.step}).Settle(); got != tt.want {
			t.Errorf("Settle(stepDuration %v) = %v, want %v", tt.step, got, tt.want)
		}
	}
}

// state is what the transition table compares.
type state struct {
	limit    int64
	step     int
	ceiling  int64
	backoffs int
	settling bool
	done     bool
}

func stateOf(r *Ramp) state {
	s := r.Snapshot()
	return state{limit: r.Limit(), step: s.Step, ceiling: s.Ceiling, backoffs: s.Backoffs, settling: s.Settling, done: r.Done()}
}

// TestStepBackTransitions walks the seed's schedule through every transition
// of the rule: up, back to the previous step, back below the first step,
// halving to 1, nothing below 1, the doubled hold before a ceiling, the
// ceiling cleared once held clean, the hold capped at 8 step durations, and
// a restart forgetting it all.
func TestStepBackTransitions(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	type op struct {
		wait time.Duration
		do   string // "up" (Advance), "back" (StepBack), "restart"
		ok   bool
		want state
	}
	ops := []op{
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 10, step: 1}},
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 20, step: 2}},
		// 20 fails: back to 10, 20 is the ceiling, first backoff.
		{wait: 5 * time.Second, do: "back", ok: true, want: state{limit: 10, step: 1, ceiling: 20, backoffs: 1, settling: true}},
		// One clean minute is not enough to go back up to the ceiling ...
		{wait: time.Minute, do: "up", ok: false, want: state{limit: 10, step: 1, ceiling: 20, backoffs: 1, settling: true}},
		// ... two are.
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 20, step: 2, ceiling: 20, backoffs: 1}},
		// 20 fails again: the hold before it doubles again.
		{wait: 5 * time.Second, do: "back", ok: true, want: state{limit: 10, step: 1, ceiling: 20, backoffs: 2, settling: true}},
		{wait: 3 * time.Minute, do: "up", ok: false, want: state{limit: 10, step: 1, ceiling: 20, backoffs: 2, settling: true}},
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 20, step: 2, ceiling: 20, backoffs: 2}},
		// Held clean for a step duration: the ceiling is cleared on the way up.
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 40, step: 3, done: true}},
		// From full capacity (mode Always): back to 20.
		{wait: time.Second, do: "back", ok: true, want: state{limit: 20, step: 2, ceiling: 40, backoffs: 1, settling: true}},
		{wait: time.Second, do: "restart", want: state{limit: 5}},
		// The first step fails: the highest power of two below it, then
		// halves, down to 1.
		{wait: time.Second, do: "back", ok: true, want: state{limit: 4, ceiling: 5, backoffs: 1, settling: true}},
		{wait: time.Second, do: "back", ok: true, want: state{limit: 2, ceiling: 4, backoffs: 2, settling: true}},
		{wait: time.Second, do: "back", ok: true, want: state{limit: 1, ceiling: 2, backoffs: 3, settling: true}},
		// Nothing below 1: the breaker decides.
		{wait: time.Second, do: "back", ok: false, want: state{limit: 1, ceiling: 2, backoffs: 3, settling: true}},
		// Up from 1 to the ceiling 2 after 8 minutes (the cap) ...
		{wait: 7 * time.Minute, do: "up", ok: false, want: state{limit: 1, ceiling: 2, backoffs: 3, settling: true}},
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 2, ceiling: 2, backoffs: 3}},
		// ... then doubling up to the first step, one clean minute each: 2
		// was held.
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 4}},
		{wait: time.Minute, do: "up", ok: true, want: state{limit: 5}},
	}
	for i, o := range ops {
		clk.Advance(o.wait)
		var ok bool
		switch o.do {
		case "up":
			ok = r.Advance()
		case "back":
			ok = r.StepBack()
		case "restart":
			r.Restart()
		}
		if ok != o.ok {
			t.Fatalf("op %d (%s after %v) = %v, want %v; state %+v", i, o.do, o.wait, ok, o.ok, stateOf(r))
		}
		if got := stateOf(r); got != o.want {
			t.Fatalf("op %d (%s after %v): state %+v, want %+v", i, o.do, o.wait, got, o.want)
		}
	}
}

// TestCeilingAtFullCapacity: full capacity that failed and is reached again
// keeps its ceiling, so a second failure there doubles the hold again; held
// clean for a step duration, the ceiling is cleared.
func TestCeilingAtFullCapacity(t *testing.T) {
	clk := newClock()
	r := Restore(seed(), clk, Snapshot{Step: 3, StepStarted: clk.Now()})
	r.StepBack() // 40 -> 20, ceiling 40
	clk.Advance(2 * time.Minute)
	if !r.Advance() || !r.Done() {
		t.Fatalf("not back at full capacity after 2 clean minutes: %+v", stateOf(r))
	}
	r.StepBack()
	if got := stateOf(r); got != (state{limit: 20, step: 2, ceiling: 40, backoffs: 2, settling: true}) {
		t.Fatalf("second failure at full capacity: %+v, want backoffs 2", got)
	}
	clk.Advance(4 * time.Minute)
	r.Advance()
	clk.Advance(time.Minute)
	if r.Advance() {
		t.Fatal("Advance moved past full capacity")
	}
	if got := stateOf(r); got != (state{limit: 40, step: 3, done: true}) {
		t.Fatalf("held clean at full capacity for a minute: %+v, want the ceiling cleared", got)
	}
}

// TestHoldIsCapped: however often a limit fails, it is tried again within
// 2^MaxBackoffs step durations.
func TestHoldIsCapped(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	clk.Advance(time.Minute)
	r.Advance() // 10
	for range 10 {
		if !r.StepBack() {
			t.Fatal("StepBack from 10 refused")
		}
		if got, want := r.Hold(), time.Minute<<min(r.Snapshot().Backoffs, MaxBackoffs); got != want {
			t.Fatalf("Hold() = %v, want %v", got, want)
		}
		clk.Advance(r.Hold())
		if !r.Advance() {
			t.Fatalf("Advance after Hold() %v refused", r.Hold())
		}
	}
	if got := r.Snapshot().Backoffs; got != MaxBackoffs {
		t.Fatalf("Backoffs = %d, want the cap %d", got, MaxBackoffs)
	}
	if r.StepBack(); r.Hold() != 8*time.Minute {
		t.Fatalf("Hold() = %v, want 8m", r.Hold())
	}
}

// TestStepBackSnapshotRoundTrip: a restart (Snapshot, Restore) keeps a step
// back: the limit below the first step, the ceiling, the backoffs, the
// settling.
func TestStepBackSnapshotRoundTrip(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	r.StepBack() // 5 -> 4
	r.StepBack() // 4 -> 2
	snap := r.Snapshot()
	clk.Advance(time.Second)
	got := Restore(seed(), clk, snap)
	if stateOf(got) != stateOf(r) || got.Hold() != r.Hold() || !got.Started().Equal(r.Started()) {
		t.Fatalf("restored %+v (hold %v), want %+v (hold %v)", stateOf(got), got.Hold(), stateOf(r), r.Hold())
	}

	for _, tt := range []struct {
		name string
		snap Snapshot
		want state
	}{
		{name: "a limit at a step above 0 is ignored", snap: Snapshot{Step: 1, Limit: 2}, want: state{limit: 10, step: 1}},
		{name: "a limit at or above the first step is ignored", snap: Snapshot{Limit: 5}, want: state{limit: 5}},
		{name: "a ceiling below the limit is dropped", snap: Snapshot{Step: 2, Ceiling: 10, Backoffs: 2}, want: state{limit: 20, step: 2}},
		{name: "a ceiling at the limit is kept", snap: Snapshot{Step: 2, Ceiling: 20, Backoffs: 2}, want: state{limit: 20, step: 2, ceiling: 20, backoffs: 2}},
		{name: "a ceiling at full capacity is kept until held", snap: Snapshot{Step: 3, Ceiling: 40, Backoffs: 1}, want: state{limit: 40, step: 3, ceiling: 40, backoffs: 1, done: true}},
		{name: "backoffs are clamped", snap: Snapshot{Ceiling: 10, Backoffs: 99}, want: state{limit: 5, ceiling: 10, backoffs: MaxBackoffs}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := stateOf(Restore(seed(), clk, tt.snap)); got != tt.want {
				t.Fatalf("Restore(%+v) = %+v, want %+v", tt.snap, got, tt.want)
			}
		})
	}
}

// TestWilsonLowerContainsTheRatio: the lower bound never exceeds the
// observed ratio.
func TestWilsonLowerContainsTheRatio(t *testing.T) {
	for n := int64(1); n < 100000; n *= 3 {
		for _, k := range []int64{0, n / 10, n / 2, n} {
			if lo := WilsonLower(k, n, Z); lo > float64(k)/float64(n) {
				t.Fatalf("k=%d n=%d: lower bound %v above the ratio %v", k, n, lo, float64(k)/float64(n))
			}
		}
	}
}

// TestProvenClean is the early-advance evidence table: 1/FailureRatio calls
// with no failure prove a step clean; fewer calls, any failure, or a rule
// that is off do not.
func TestProvenClean(t *testing.T) {
	tests := []struct {
		name            string
		sb              StepBack
		calls, failures int64
		want            bool
	}{
		{name: "no calls", sb: rule, want: false},
		{name: "99 clean calls are not enough at 1%", sb: rule, calls: 99, want: false},
		{name: "100 clean calls are", sb: rule, calls: 100, want: true},
		{name: "one failure in 100 is not", sb: rule, calls: 100, failures: 1, want: false},
		{name: "one failure in 10000 is not either: it climbs by time", sb: rule, calls: 10000, failures: 1, want: false},
		{name: "more failures than calls", sb: rule, calls: 1000, failures: 5000, want: false},
		{name: "20 clean calls at 5%", sb: StepBack{When: Ramping, FailureRatio: 0.05, MinFailures: 3}, calls: 20, want: true},
		{name: "19 are not", sb: StepBack{When: Ramping, FailureRatio: 0.05, MinFailures: 3}, calls: 19, want: false},
		{name: "4 clean calls at 0.3 (1/0.3 rounds up)", sb: StepBack{When: Ramping, FailureRatio: 0.3, MinFailures: 1}, calls: 4, want: true},
		{name: "3 are not", sb: StepBack{When: Ramping, FailureRatio: 0.3, MinFailures: 1}, calls: 3, want: false},
		{name: "Never proves nothing", sb: StepBack{When: Never, FailureRatio: 0.01, MinFailures: 3}, calls: 100000, want: false},
		{name: "zero rule proves nothing", calls: 100000, want: false},
		{name: "Always", sb: StepBack{When: Always, FailureRatio: 0.01, MinFailures: 3}, calls: 100, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.sb.ProvenClean(tt.calls, tt.failures); got != tt.want {
				t.Fatalf("ProvenClean(%d, %d) = %v, want %v", tt.calls, tt.failures, got, tt.want)
			}
			if tt.want && tt.sb.Judge(tt.calls, tt.failures) != Clean {
				t.Fatalf("proven clean but Judge = %v", tt.sb.Judge(tt.calls, tt.failures))
			}
		})
	}
}

// TestAdvanceEarly is the early-advance table: each condition that refuses
// it, and the move it makes.
func TestAdvanceEarly(t *testing.T) {
	const dwell = 10 * time.Second
	tests := []struct {
		name      string
		snap      Snapshot
		after     time.Duration
		want      bool
		wantLimit int64
	}{
		{name: "after the dwell", snap: Snapshot{Step: 0}, after: dwell, want: true, wantLimit: 10},
		{name: "before the dwell", snap: Snapshot{Step: 0}, after: dwell - time.Millisecond, want: false, wantLimit: 5},
		{name: "at the last step", snap: Snapshot{Step: 3}, after: time.Hour, want: false, wantLimit: 40},
		{name: "next limit is the ceiling", snap: Snapshot{Step: 1, Ceiling: 20, Backoffs: 1}, after: time.Hour, want: false, wantLimit: 10},
		{name: "next limit above the ceiling", snap: Snapshot{Step: 1, Ceiling: 15, Backoffs: 1}, after: time.Hour, want: false, wantLimit: 10},
		{name: "ceiling further up", snap: Snapshot{Step: 0, Ceiling: 20, Backoffs: 1}, after: dwell, want: true, wantLimit: 10},
		{name: "below the first step", snap: Snapshot{Step: 0, Limit: 1}, after: dwell, want: true, wantLimit: 2},
		{name: "below the first step, up to it", snap: Snapshot{Step: 0, Limit: 4}, after: dwell, want: true, wantLimit: 5},
		{name: "settling after a step back", snap: Snapshot{Step: 0, Limit: 4, Ceiling: 5, Backoffs: 1, Settling: true}, after: time.Hour, want: false, wantLimit: 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newClock()
			tt.snap.StepStarted = clk.Now()
			r := Restore(seed(), clk, tt.snap)
			clk.Advance(tt.after)
			if got := r.AdvanceEarly(dwell); got != tt.want {
				t.Fatalf("AdvanceEarly() = %v, want %v", got, tt.want)
			}
			if r.Limit() != tt.wantLimit {
				t.Fatalf("Limit() = %d, want %d", r.Limit(), tt.wantLimit)
			}
			if tt.want && (r.Started() != clk.Now() || r.Settling()) {
				t.Fatalf("after an early advance: Started() = %v, Settling() = %v; want now, false", r.Started(), r.Settling())
			}
			if got := r.Ceiling(); got != tt.snap.Ceiling {
				t.Fatalf("Ceiling() = %d, want %d unchanged", got, tt.snap.Ceiling)
			}
		})
	}
}

// TestProofCalls: 1/FailureRatio rounded up, exact for the ratios a user
// writes as a whole reciprocal; 0 for a rule that is off.
func TestProofCalls(t *testing.T) {
	tests := []struct {
		sb   StepBack
		want int64
	}{
		{sb: rule, want: 100},
		{sb: StepBack{When: Always, FailureRatio: 0.1, MinFailures: 1}, want: 10},
		{sb: StepBack{When: Ramping, FailureRatio: 0.05, MinFailures: 1}, want: 20},
		{sb: StepBack{When: Ramping, FailureRatio: 0.07, MinFailures: 1}, want: 15},
		{sb: StepBack{When: Ramping, FailureRatio: 0.001, MinFailures: 1}, want: 1000},
		{sb: StepBack{When: Ramping, FailureRatio: 0.99, MinFailures: 1}, want: 2},
		{sb: StepBack{When: Never, FailureRatio: 0.01, MinFailures: 1}, want: 0},
		{want: 0},
	}
	for _, tt := range tests {
		if got := tt.sb.ProofCalls(); got != tt.want {
			t.Errorf("ProofCalls(%+v) = %d, want %d", tt.sb, got, tt.want)
		}
	}
}
