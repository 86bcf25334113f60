package breaker

import (
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/wire"
)

// fakeClock is a manually advanced clock.Clock.
type fakeClock struct{ now time.Time }

func (c *fakeClock) Now() time.Time          { return c.now }
func (c *fakeClock) Advance(d time.Duration) { c.now = c.now.Add(d) }

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

func newClock() *fakeClock { return &fakeClock{now: t0} }

func testConfig() Config {
	return Config{
		FailureRatio:   0.5,
		MinCalls:       10,
		Window:         time.Minute,
		OpenDuration:   30 * time.Second,
		HalfOpenProbes: 3,
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*Config)
		wantErr string
	}{
		{name: "valid", mutate: func(*Config) {}},
		{name: "ratio one", mutate: func(c *Config) { c.FailureRatio = 1 }},
		{name: "ratio zero", mutate: func(c *Config) { c.FailureRatio = 0 }, wantErr: "failureRatio"},
		{name: "ratio negative", mutate: func(c *Config) { c.FailureRatio = -0.1 }, wantErr: "failureRatio"},
		{name: "ratio above one", mutate: func(c *Config) { c.FailureRatio = 1.01 }, wantErr: "failureRatio"},
		{name: "ratio NaN", mutate: func(c *Config) { c.FailureRatio = nan() }, wantErr: "failureRatio"},
		{name: "minCalls zero", mutate: func(c *Config) { c.MinCalls = 0 }, wantErr: "minCalls"},
		{name: "window zero", mutate: func(c *Config) { c.Window = 0 }, wantErr: "window"},
		{name: "window negative", mutate: func(c *Config) { c.Window = -time.Second }, wantErr: "window"},
		{name: "openDuration zero", mutate: func(c *Config) { c.OpenDuration = 0 }, wantErr: "openDuration"},
		{name: "halfOpenProbes zero", mutate: func(c *Config) { c.HalfOpenProbes = 0 }, wantErr: "halfOpenProbes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig()
			tt.mutate(&cfg)
			err := cfg.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tt.wantErr+" ") {
				t.Fatalf("Validate() = %v, want error starting with %q", err, tt.wantErr)
			}
		})
	}
}

func nan() float64 {
	zero := 0.0
	return zero / zero
}

// A snapshot whose state is not the breaker's own (Ramping, an unknown or
// empty string) restores as New would: Closed since now.
func TestRestoreNonBreakerState(t *testing.T) {
	for _, s := range []wire.State{wire.Ramping, "", "closed", "Half-Open"} {
		clk := newClock()
		clk.Advance(time.Minute)
		b := Restore(testConfig(), clk, Snapshot{State: s, Since: t0})
		if got, want := b.Snapshot(), (Snapshot{State: wire.Closed, Since: clk.Now()}); got != want {
			t.Errorf("Restore(%q) = %+v, want %+v", s, got, want)
		}
	}
}

func TestNew(t *testing.T) {
	clk := newClock()
	b := New(testConfig(), clk)
	if got, want := b.Snapshot(), (Snapshot{State: wire.Closed, Since: t0}); got != want {
		t.Fatalf("Snapshot() = %+v, want %+v", got, want)
	}
	if b.State() != wire.Closed {
		t.Fatalf("wire.State() = %q, want wire.Closed", b.State())
	}
}

func TestEvaluateClosed(t *testing.T) {
	tests := []struct {
		name     string
		ratio    float64
		minCalls int64
		window   Counts
		wantOpen bool
	}{
		{name: "no calls", ratio: 0.5, minCalls: 10, window: Counts{}},
		{name: "below minCalls even if all fail", ratio: 0.5, minCalls: 10, window: Counts{Calls: 9, Failures: 9}},
		{name: "at minCalls below ratio", ratio: 0.5, minCalls: 10, window: Counts{Calls: 10, Failures: 4}},
		{name: "at minCalls exactly at ratio", ratio: 0.5, minCalls: 10, window: Counts{Calls: 10, Failures: 5}, wantOpen: true},
		{name: "above ratio", ratio: 0.5, minCalls: 10, window: Counts{Calls: 100, Failures: 90}, wantOpen: true},
		{name: "just below ratio", ratio: 0.5, minCalls: 10, window: Counts{Calls: 101, Failures: 50}},
		{name: "ratio one needs all failing", ratio: 1, minCalls: 1, window: Counts{Calls: 10, Failures: 9}},
		{name: "ratio one all failing", ratio: 1, minCalls: 1, window: Counts{Calls: 10, Failures: 10}, wantOpen: true},
		{name: "ratio 0.2 exact boundary", ratio: 0.2, minCalls: 5, window: Counts{Calls: 50, Failures: 10}, wantOpen: true},
		{name: "ratio 0.2 just below", ratio: 0.2, minCalls: 5, window: Counts{Calls: 50, Failures: 9}},
		{name: "ratio 0.1 exact boundary", ratio: 0.1, minCalls: 1, window: Counts{Calls: 30, Failures: 3}, wantOpen: true},
		{name: "invalid minCalls zero still needs a call", ratio: 0.5, minCalls: 0, window: Counts{}},
		{name: "invalid minCalls zero one failure", ratio: 0.5, minCalls: 0, window: Counts{Calls: 1, Failures: 1}, wantOpen: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newClock()
			cfg := testConfig()
			cfg.FailureRatio, cfg.MinCalls = tt.ratio, tt.minCalls
			b := New(cfg, clk)
			clk.Advance(5 * time.Second)
			// Probe counts are ignored while Closed.
			tr, ok := b.Evaluate(tt.window, Counts{Calls: 100, Failures: 100})
			if ok != tt.wantOpen {
				t.Fatalf("Evaluate(%+v) changed = %v, want %v", tt.window, ok, tt.wantOpen)
			}
			if !ok {
				if tr != (Transition{}) || b.State() != wire.Closed || b.Snapshot().Since != t0 {
					t.Fatalf("no-op Evaluate returned %+v, snapshot %+v", tr, b.Snapshot())
				}
				return
			}
			now := t0.Add(5 * time.Second)
			if want := (Transition{From: wire.Closed, To: wire.Open, At: now}); tr != want {
				t.Fatalf("Evaluate() = %+v, want %+v", tr, want)
			}
			if got, want := b.Snapshot(), (Snapshot{State: wire.Open, Since: now}); got != want {
				t.Fatalf("Snapshot() = %+v, want %+v", got, want)
			}
		})
	}
}

func TestEvaluateOpen(t *testing.T) {
	tests := []struct {
		name         string
		elapsed      time.Duration
		wantHalfOpen bool
	}{
		{name: "just opened", elapsed: 0},
		{name: "one nanosecond short", elapsed: 30*time.Second - 1},
		{name: "exactly open duration", elapsed: 30 * time.Second, wantHalfOpen: true},
		{name: "long after", elapsed: time.Hour, wantHalfOpen: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newClock()
			b := Restore(testConfig(), clk, Snapshot{State: wire.Open, Since: t0})
			clk.Advance(tt.elapsed)
			// Counts are ignored while Open: neither a clean window nor
			// failed probes change anything.
			tr, ok := b.Evaluate(Counts{Calls: 1000}, Counts{Calls: 5, Failures: 5})
			if ok != tt.wantHalfOpen {
				t.Fatalf("Evaluate() changed = %v, want %v", ok, tt.wantHalfOpen)
			}
			if !ok {
				if b.State() != wire.Open {
					t.Fatalf("wire.State() = %q, want wire.Open", b.State())
				}
				return
			}
			now := t0.Add(tt.elapsed)
			if want := (Transition{From: wire.Open, To: wire.HalfOpen, At: now}); tr != want {
				t.Fatalf("Evaluate() = %+v, want %+v", tr, want)
			}
			if got := b.Snapshot(); got.Since != now {
				t.Fatalf("Since = %v, want %v", got.Since, now)
			}
		})
	}
}

func TestEvaluateHalfOpen(t *testing.T) {
	tests := []struct {
		name   string
		probes Counts
		want   wire.State // "" means no transition
	}{
		{name: "no probes yet", probes: Counts{}},
		{name: "some successes", probes: Counts{Calls: 2}},
		{name: "enough successes", probes: Counts{Calls: 3}, want: wire.Closed},
		{name: "more than enough", probes: Counts{Calls: 7}, want: wire.Closed},
		{name: "one failure", probes: Counts{Calls: 1, Failures: 1}, want: wire.Open},
		{name: "failure after successes", probes: Counts{Calls: 4, Failures: 1}, want: wire.Open},
		{name: "failure beats enough successes", probes: Counts{Calls: 10, Failures: 1}, want: wire.Open},
		{name: "inconsistent counts still reopen", probes: Counts{Calls: 0, Failures: 2}, want: wire.Open},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newClock()
			b := Restore(testConfig(), clk, Snapshot{State: wire.HalfOpen, Since: t0})
			clk.Advance(time.Second)
			// The window is ignored while HalfOpen.
			tr, ok := b.Evaluate(Counts{Calls: 100, Failures: 100}, tt.probes)
			if ok != (tt.want != "") {
				t.Fatalf("Evaluate(probes %+v) changed = %v, want %v", tt.probes, ok, tt.want != "")
			}
			if !ok {
				if b.State() != wire.HalfOpen {
					t.Fatalf("wire.State() = %q, want wire.HalfOpen", b.State())
				}
				return
			}
			now := t0.Add(time.Second)
			if want := (Transition{From: wire.HalfOpen, To: tt.want, At: now}); tr != want {
				t.Fatalf("Evaluate() = %+v, want %+v", tr, want)
			}
			if got, want := b.Snapshot(), (Snapshot{State: tt.want, Since: now}); got != want {
				t.Fatalf("Snapshot() = %+v, want %+v", got, want)
			}
		})
	}
}

func TestEvaluateOneTransitionPerCall(t *testing.T) {
	clk := newClock()
	b := New(testConfig(), clk)
	tripping := Counts{Calls: 10, Failures: 10}
	clean := Counts{Calls: 3}

	clk.Advance(time.Hour)
	if tr, _ := b.Evaluate(tripping, clean); tr.To != wire.Open {
		t.Fatalf("first Evaluate = %+v, want wire.Closed->wire.Open", tr)
	}
	// Even with counts that would satisfy every later rule, the breaker
	// stays Open until OpenDuration has elapsed since it opened.
	if tr, ok := b.Evaluate(tripping, clean); ok {
		t.Fatalf("second Evaluate at same instant = %+v, want no transition", tr)
	}
	clk.Advance(30 * time.Second)
	if tr, _ := b.Evaluate(tripping, clean); tr.To != wire.HalfOpen {
		t.Fatalf("third Evaluate = %+v, want wire.Open->wire.HalfOpen", tr)
	}
	if tr, _ := b.Evaluate(tripping, clean); tr.To != wire.Closed {
		t.Fatalf("fourth Evaluate = %+v, want wire.HalfOpen->wire.Closed", tr)
	}
}

func TestFullCycle(t *testing.T) {
	clk := newClock()
	b := New(testConfig(), clk)
	type step struct {
		advance time.Duration
		window  Counts
		probes  Counts
		want    wire.State // "" means no transition
	}
	steps := []step{
		{advance: 10 * time.Second, window: Counts{Calls: 20, Failures: 2}},
		{advance: 10 * time.Second, window: Counts{Calls: 20, Failures: 12}, want: wire.Open},
		{advance: 29 * time.Second},
		{advance: time.Second, want: wire.HalfOpen},
		{advance: time.Second, probes: Counts{Calls: 1, Failures: 1}, want: wire.Open},
		{advance: 30 * time.Second, want: wire.HalfOpen},
		{advance: time.Second, probes: Counts{Calls: 2}},
		{advance: time.Second, probes: Counts{Calls: 3}, want: wire.Closed},
		{advance: time.Second, window: Counts{Calls: 9, Failures: 9}},
	}
	for i, s := range steps {
		clk.Advance(s.advance)
		before := b.State()
		tr, ok := b.Evaluate(s.window, s.probes)
		if ok != (s.want != "") || (ok && tr != (Transition{From: before, To: s.want, At: clk.Now()})) {
			t.Fatalf("step %d: Evaluate() = %+v, %v; want transition to %q", i, tr, ok, s.want)
		}
	}
}

func TestWindowStart(t *testing.T) {
	tests := []struct {
		name  string
		since time.Duration // offset of Since from t0
		now   time.Duration // offset of now from t0
		want  time.Duration // offset of WindowStart from t0
	}{
		{name: "just closed", since: 0, now: 0, want: 0},
		{name: "closed less than a window ago", since: 0, now: 20 * time.Second, want: 0},
		{name: "closed exactly a window ago", since: 0, now: time.Minute, want: 0},
		{name: "closed long ago", since: 0, now: 5 * time.Minute, want: 4 * time.Minute},
		{name: "recent transition", since: 4*time.Minute + 30*time.Second, now: 5 * time.Minute, want: 4*time.Minute + 30*time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := &fakeClock{now: t0.Add(tt.now)}
			b := Restore(testConfig(), clk, Snapshot{State: wire.Closed, Since: t0.Add(tt.since)})
			if got, want := b.WindowStart(), t0.Add(tt.want); !got.Equal(want) {
				t.Fatalf("WindowStart() = %v, want %v", got, want)
			}
		})
	}
}

func TestWindowStartExcludesFailuresBeforeClose(t *testing.T) {
	clk := newClock()
	b := Restore(testConfig(), clk, Snapshot{State: wire.HalfOpen, Since: t0})
	clk.Advance(10 * time.Second)
	if _, ok := b.Evaluate(Counts{}, Counts{Calls: 3}); !ok || b.State() != wire.Closed {
		t.Fatalf("breaker did not close: %+v", b.Snapshot())
	}
	closedAt := clk.Now()
	clk.Advance(5 * time.Second)
	if got := b.WindowStart(); !got.Equal(closedAt) {
		t.Fatalf("WindowStart() = %v, want the close time %v", got, closedAt)
	}
}

func TestRestore(t *testing.T) {
	tests := []struct {
		name string
		snap Snapshot
		want Snapshot
	}{
		{name: "closed", snap: Snapshot{State: wire.Closed, Since: t0.Add(-time.Hour)}, want: Snapshot{State: wire.Closed, Since: t0.Add(-time.Hour)}},
		{name: "open", snap: Snapshot{State: wire.Open, Since: t0.Add(-time.Second)}, want: Snapshot{State: wire.Open, Since: t0.Add(-time.Second)}},
		{name: "half open", snap: Snapshot{State: wire.HalfOpen, Since: t0.Add(-time.Second)}, want: Snapshot{State: wire.HalfOpen, Since: t0.Add(-time.Second)}},
		{name: "zero snapshot", snap: Snapshot{}, want: Snapshot{State: wire.Closed, Since: t0}},
		{name: "unknown state", snap: Snapshot{State: "open", Since: t0.Add(-time.Hour)}, want: Snapshot{State: wire.Closed, Since: t0}},
		{name: "since in the future", snap: Snapshot{State: wire.Open, Since: t0.Add(time.Minute)}, want: Snapshot{State: wire.Open, Since: t0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := Restore(testConfig(), newClock(), tt.snap)
			if got := b.Snapshot(); got != tt.want {
				t.Fatalf("Snapshot() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestRestoreContinuesOpenTimer(t *testing.T) {
	clk := newClock()
	b := New(testConfig(), clk)
	b.Evaluate(Counts{Calls: 10, Failures: 10}, Counts{})
	snap := b.Snapshot()

	// The controller restarts 20s later and continues from the snapshot:
	// only the remaining 10s of OpenDuration are left.
	clk.Advance(20 * time.Second)
	r := Restore(testConfig(), clk, snap)
	if _, ok := r.Evaluate(Counts{}, Counts{}); ok {
		t.Fatalf("restored breaker half-opened early: %+v", r.Snapshot())
	}
	clk.Advance(10 * time.Second)
	if tr, ok := r.Evaluate(Counts{}, Counts{}); !ok || tr.To != wire.HalfOpen {
		t.Fatalf("Evaluate() = %+v, %v; want wire.Open->wire.HalfOpen", tr, ok)
	}
}

func TestSetConfig(t *testing.T) {
	clk := newClock()
	b := Restore(testConfig(), clk, Snapshot{State: wire.Open, Since: t0})
	clk.Advance(10 * time.Second)
	if _, ok := b.Evaluate(Counts{}, Counts{}); ok {
		t.Fatal("half-opened before OpenDuration")
	}
	cfg := testConfig()
	cfg.OpenDuration = 5 * time.Second
	cfg.HalfOpenProbes = 1
	b.SetConfig(cfg)
	if got := b.Snapshot(); got != (Snapshot{State: wire.Open, Since: t0}) {
		t.Fatalf("SetConfig changed the state: %+v", got)
	}
	if tr, ok := b.Evaluate(Counts{}, Counts{}); !ok || tr.To != wire.HalfOpen {
		t.Fatalf("Evaluate() after shortening OpenDuration = %+v, %v", tr, ok)
	}
	if tr, ok := b.Evaluate(Counts{}, Counts{Calls: 1}); !ok || tr.To != wire.Closed {
		t.Fatalf("Evaluate() with new HalfOpenProbes = %+v, %v", tr, ok)
	}
	cfg.Window = 10 * time.Second
	b.SetConfig(cfg)
	clk.Advance(time.Minute)
	if got, want := b.WindowStart(), clk.Now().Add(-10*time.Second); !got.Equal(want) {
		t.Fatalf("WindowStart() after new Window = %v, want %v", got, want)
	}
}

func TestConcurrentUse(t *testing.T) {
	b := New(testConfig(), newClock())
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				b.Evaluate(Counts{Calls: 10, Failures: 10}, Counts{Calls: 3})
				_ = b.State()
				_ = b.WindowStart()
				_ = b.Snapshot()
			}
		})
	}
	wg.Wait()
	if b.State() != wire.Open {
		t.Fatalf("wire.State() = %q, want wire.Open (clock never advanced)", b.State())
	}
}

// Probes that never report (their worker died) must not hold the breaker half
// open forever: after OpenDuration it reopens, and the next HalfOpen admits
// fresh probes.
func TestHalfOpenReopensWhenProbesNeverReport(t *testing.T) {
	cfg := testConfig()
	clk := newClock()
	b := Restore(cfg, clk, Snapshot{State: wire.HalfOpen, Since: t0})
	clk.Advance(cfg.OpenDuration - time.Millisecond)
	if _, ok := b.Evaluate(Counts{}, Counts{Calls: cfg.HalfOpenProbes - 1}); ok {
		t.Fatalf("reopened before OpenDuration: %+v", b.Snapshot())
	}
	clk.Advance(time.Millisecond)
	tr, ok := b.Evaluate(Counts{}, Counts{Calls: cfg.HalfOpenProbes - 1})
	if !ok || tr.To != wire.Open {
		t.Fatalf("Evaluate() = %+v, %v; want a transition to wire.Open after OpenDuration", tr, ok)
	}
	clk.Advance(cfg.OpenDuration)
	if tr, ok := b.Evaluate(Counts{}, Counts{}); !ok || tr.To != wire.HalfOpen {
		t.Fatalf("Evaluate() = %+v, %v; want wire.HalfOpen again", tr, ok)
	}
}

// Trips is the rule Evaluate opens a Closed breaker by: for every window the
// two agree, on the boundaries of TestEvaluateClosed and on random counts
// near the threshold.
func TestConfigTrips(t *testing.T) {
	tests := []struct {
		name     string
		ratio    float64
		minCalls int64
		window   Counts
		want     bool
	}{
		{name: "empty", ratio: 0.5, minCalls: 1, window: Counts{}},
		{name: "below minCalls", ratio: 0.5, minCalls: 10, window: Counts{Calls: 9, Failures: 9}},
		{name: "at minCalls at ratio", ratio: 0.5, minCalls: 10, window: Counts{Calls: 10, Failures: 5}, want: true},
		{name: "one failure short", ratio: 0.5, minCalls: 10, window: Counts{Calls: 10, Failures: 4}},
		{name: "0.1 of 30 is 3 in float64", ratio: 0.1, minCalls: 1, window: Counts{Calls: 30, Failures: 3}, want: true},
		{name: "0.07 of 100 is above 7 in float64", ratio: 0.07, minCalls: 1, window: Counts{Calls: 100, Failures: 7}},
		{name: "0.57 of 100 is below 57 in float64", ratio: 0.57, minCalls: 1, window: Counts{Calls: 100, Failures: 57}, want: true},
		{name: "minCalls zero still needs a call", ratio: 0.5, minCalls: 0, window: Counts{}},
		{name: "ratio one all fail", ratio: 1, minCalls: 3, window: Counts{Calls: 3, Failures: 3}, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig()
			cfg.FailureRatio, cfg.MinCalls = tt.ratio, tt.minCalls
			if got := cfg.Trips(tt.window); got != tt.want {
				t.Fatalf("Trips(%+v) = %v, want %v", tt.window, got, tt.want)
			}
		})
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		cfg := testConfig()
		cfg.FailureRatio = float64(1+rng.IntN(100)) / 100
		cfg.MinCalls = int64(1 + rng.IntN(20))
		calls := rng.Int64N(60)
		w := Counts{Calls: calls, Failures: rng.Int64N(calls + 1)}
		b := New(cfg, newClock())
		if _, opened := b.Evaluate(w, Counts{}); opened != cfg.Trips(w) {
			t.Fatalf("ratio %v minCalls %d window %+v: Evaluate opened %v, Trips %v", cfg.FailureRatio, cfg.MinCalls, w, opened, cfg.Trips(w))
		}
	}
}

// Tripped opens a Closed breaker as of the trip, so OpenDuration counts from
// it; a time after now or before Since is clamped; any other state stays.
func TestTripped(t *testing.T) {
	tests := []struct {
		name   string
		state  wire.State
		at     time.Duration // after t0; now is t0 + 10s
		wantAt time.Duration
		wantOK bool
	}{
		{name: "closed", state: wire.Closed, at: 7 * time.Second, wantAt: 7 * time.Second, wantOK: true},
		{name: "closed, trip in the future", state: wire.Closed, at: time.Minute, wantAt: 10 * time.Second, wantOK: true},
		{name: "closed, trip before since", state: wire.Closed, at: -time.Second, wantAt: 0, wantOK: true},
		{name: "open", state: wire.Open, at: 7 * time.Second},
		{name: "half-open", state: wire.HalfOpen, at: 7 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newClock()
			b := Restore(testConfig(), clk, Snapshot{State: tt.state, Since: t0})
			clk.Advance(10 * time.Second)
			tr, ok := b.Tripped(t0.Add(tt.at))
			if ok != tt.wantOK {
				t.Fatalf("Tripped ok = %v, want %v", ok, tt.wantOK)
			}
			if !ok {
				if got := b.Snapshot(); got != (Snapshot{State: tt.state, Since: t0}) {
					t.Fatalf("a %s breaker moved: %+v", tt.state, got)
				}
				return
			}
			at := t0.Add(tt.wantAt)
			if want := (Transition{From: wire.Closed, To: wire.Open, At: at}); tr != want {
				t.Fatalf("Tripped = %+v, want %+v", tr, want)
			}
			if got := b.Snapshot(); got != (Snapshot{State: wire.Open, Since: at}) {
				t.Fatalf("Snapshot = %+v, want Open since %v", got, at)
			}
			// OpenDuration (30s) counts from the trip.
			clk.Advance(at.Add(30*time.Second).Sub(clk.Now()) - time.Millisecond)
			if _, moved := b.Evaluate(Counts{}, Counts{}); moved {
				t.Fatalf("half-opened before openDuration after the trip")
			}
			clk.Advance(time.Millisecond)
			if tr, moved := b.Evaluate(Counts{}, Counts{}); !moved || tr.To != wire.HalfOpen {
				t.Fatalf("Evaluate at the trip + openDuration = %+v, %v; want HalfOpen", tr, moved)
			}
		})
	}
}
