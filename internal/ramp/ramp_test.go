package ramp

import (
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeClock is a manually advanced clock.Clock.
type fakeClock struct{ now time.Time }

func (c *fakeClock) Now() time.Time          { return c.now }
func (c *fakeClock) Advance(d time.Duration) { c.now = c.now.Add(d) }

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

func newClock() *fakeClock { return &fakeClock{now: t0} }

// seed is the article's schedule: 5, 10, 20, 40, one step per clean minute.
func seed() Schedule {
	return Schedule{Steps: []int64{5, 10, 20, 40}, StepDuration: time.Minute}
}

func TestScheduleValidate(t *testing.T) {
	tests := []struct {
		name     string
		steps    []int64
		dur      time.Duration
		capacity int64
		wantErr  string
	}{
		{name: "seed", steps: []int64{5, 10, 20, 40}, dur: time.Minute, capacity: 40},
		{name: "single step", steps: []int64{1}, dur: time.Second, capacity: 1},
		{name: "top below capacity", steps: []int64{5, 10}, dur: time.Minute, capacity: 40},
		{name: "capacity zero", steps: []int64{1}, dur: time.Minute, capacity: 0, wantErr: "capacity"},
		{name: "empty", steps: nil, dur: time.Minute, capacity: 40, wantErr: "steps must not be empty"},
		{name: "zero step", steps: []int64{0, 10}, dur: time.Minute, capacity: 40, wantErr: "steps[0] must be >= 1"},
		{name: "negative step", steps: []int64{-5, 10}, dur: time.Minute, capacity: 40, wantErr: "steps[0] must be >= 1"},
		{name: "above capacity", steps: []int64{5, 50}, dur: time.Minute, capacity: 40, wantErr: "steps[1] must be <= capacity"},
		{name: "duplicate", steps: []int64{5, 10, 10, 40}, dur: time.Minute, capacity: 40, wantErr: "strictly increasing"},
		{name: "decreasing", steps: []int64{5, 20, 10, 40}, dur: time.Minute, capacity: 40, wantErr: "strictly increasing"},
		{name: "zero duration", steps: []int64{5, 40}, dur: 0, capacity: 40, wantErr: "stepDuration"},
		{name: "negative duration", steps: []int64{5, 40}, dur: -time.Second, capacity: 40, wantErr: "stepDuration"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Schedule{Steps: tt.steps, StepDuration: tt.dur}.Validate(tt.capacity)
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
}

func TestDefaultSteps(t *testing.T) {
	tests := []struct {
		capacity int64
		want     []int64
	}{
		{capacity: 40, want: []int64{5, 10, 20, 40}},
		{capacity: 1, want: []int64{1}},
		{capacity: 2, want: []int64{1, 2}},
		{capacity: 3, want: []int64{1, 3}},
		{capacity: 4, want: []int64{1, 2, 4}},
		{capacity: 7, want: []int64{1, 3, 7}},
		{capacity: 8, want: []int64{1, 2, 4, 8}},
		{capacity: 10, want: []int64{1, 2, 5, 10}},
		{capacity: 100, want: []int64{12, 25, 50, 100}},
		{capacity: 0, want: nil},
		{capacity: -8, want: nil},
	}
	for _, tt := range tests {
		got := DefaultSteps(tt.capacity)
		if !slices.Equal(got, tt.want) {
			t.Errorf("DefaultSteps(%d) = %v, want %v", tt.capacity, got, tt.want)
		}
		if tt.capacity >= 1 {
			if err := (Schedule{Steps: got, StepDuration: time.Minute}).Validate(tt.capacity); err != nil {
				t.Errorf("DefaultSteps(%d) does not validate: %v", tt.capacity, err)
			}
			if got[len(got)-1] != tt.capacity {
				t.Errorf("DefaultSteps(%d) ends at %d, want capacity", tt.capacity, got[len(got)-1])
			}
		}
	}
}

func TestDefaultStepsAlwaysValid(t *testing.T) {
	for capacity := int64(1); capacity <= 1000; capacity++ {
		steps := DefaultSteps(capacity)
		if err := (Schedule{Steps: steps, StepDuration: time.Second}).Validate(capacity); err != nil {
			t.Fatalf("DefaultSteps(%d) = %v: %v", capacity, steps, err)
		}
		if steps[len(steps)-1] != capacity {
			t.Fatalf("DefaultSteps(%d) = %v does not end at capacity", capacity, steps)
		}
	}
}

func TestWithheld(t *testing.T) {
	tests := []struct {
		name     string
		sched    Schedule
		capacity int64
		want     float64
	}{
		// (40-5 + 40-10 + 40-20) slots × 60 s = 85 × 60.
		{name: "seed", sched: seed(), capacity: 40, want: 5100},
		{name: "single step withholds nothing", sched: Schedule{Steps: []int64{40}, StepDuration: time.Minute}, capacity: 40, want: 0},
		{name: "empty", sched: Schedule{StepDuration: time.Minute}, capacity: 40, want: 0},
		{name: "half-second steps", sched: Schedule{Steps: []int64{1, 2, 4}, StepDuration: 500 * time.Millisecond}, capacity: 4, want: (3 + 2) * 0.5},
		{name: "top below capacity counts only climbing steps", sched: Schedule{Steps: []int64{5, 10}, StepDuration: 2 * time.Second}, capacity: 40, want: 35 * 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.sched.Withheld(tt.capacity); math.Abs(got-tt.want) > 1e-9 {
				t.Fatalf("Withheld(%d) = %v, want %v", tt.capacity, got, tt.want)
			}
		})
	}
}

// TestWithheldMatchesSimulation checks Withheld against a second-by-second
// replay of a clean ramp.
func TestWithheldMatchesSimulation(t *testing.T) {
	const capacity = 40
	clk := newClock()
	r := New(seed(), clk)
	var withheld float64
	for !r.Done() {
		withheld += float64(capacity - r.Limit())
		clk.Advance(time.Second)
		r.Advance()
	}
	if want := seed().Withheld(capacity); withheld != want {
		t.Fatalf("simulated withheld = %v, Withheld() = %v", withheld, want)
	}
}

func TestSeedSchedule(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	type check struct {
		at        time.Duration // offset from t0
		advanced  bool
		wantLimit int64
		wantDone  bool
	}
	checks := []check{
		{at: 0, wantLimit: 5},
		{at: 30 * time.Second, wantLimit: 5},
		{at: time.Minute - time.Nanosecond, wantLimit: 5},
		{at: time.Minute, advanced: true, wantLimit: 10},
		{at: time.Minute + 59*time.Second, wantLimit: 10},
		{at: 2 * time.Minute, advanced: true, wantLimit: 20},
		{at: 3 * time.Minute, advanced: true, wantLimit: 40, wantDone: true},
		{at: 4 * time.Minute, wantLimit: 40, wantDone: true},
		{at: time.Hour, wantLimit: 40, wantDone: true},
	}
	for _, c := range checks {
		clk.now = t0.Add(c.at)
		if got := r.Advance(); got != c.advanced {
			t.Fatalf("at +%v: Advance() = %v, want %v", c.at, got, c.advanced)
		}
		if got := r.Limit(); got != c.wantLimit {
			t.Fatalf("at +%v: Limit() = %d, want %d", c.at, got, c.wantLimit)
		}
		if got := r.Done(); got != c.wantDone {
			t.Fatalf("at +%v: Done() = %v, want %v", c.at, got, c.wantDone)
		}
	}
}

func TestRestartMidRamp(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	clk.Advance(time.Minute)
	r.Advance()
	clk.Advance(time.Minute)
	r.Advance()
	if r.Limit() != 20 {
		t.Fatalf("Limit() = %d before reopen, want 20", r.Limit())
	}

	// Errors reappear: the breaker reopens and the ramp starts from 5.
	clk.Advance(30 * time.Second)
	r.Restart()
	restartedAt := clk.Now()
	if got, want := r.Snapshot(), (Snapshot{Step: 0, StepStarted: restartedAt}); got != want {
		t.Fatalf("Snapshot() after Restart = %+v, want %+v", got, want)
	}
	if r.Limit() != 5 || r.Done() {
		t.Fatalf("after Restart: Limit() = %d, Done() = %v; want 5, false", r.Limit(), r.Done())
	}
	// The first step lasts a full minute from the restart.
	clk.Advance(59 * time.Second)
	if r.Advance() {
		t.Fatal("advanced less than a minute after Restart")
	}
	clk.Advance(time.Second)
	if !r.Advance() || r.Limit() != 10 {
		t.Fatalf("Limit() = %d a minute after Restart, want 10", r.Limit())
	}
}

func TestRestartWhenDone(t *testing.T) {
	clk := newClock()
	r := Restore(seed(), clk, Snapshot{Step: 3, StepStarted: t0})
	if !r.Done() {
		t.Fatal("Done() = false at the last step")
	}
	r.Restart()
	if r.Step() != 0 || r.Limit() != 5 || r.Done() {
		t.Fatalf("after Restart: Step() = %d, Limit() = %d, Done() = %v", r.Step(), r.Limit(), r.Done())
	}
}

func TestAdvanceOneStepPerCall(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	// A long gap (e.g. a restarted controller) still moves a single step,
	// and the next step starts now, not at the scheduled boundary.
	clk.Advance(10 * time.Minute)
	if !r.Advance() {
		t.Fatal("Advance() = false after a long gap")
	}
	if got, want := r.Snapshot(), (Snapshot{Step: 1, StepStarted: clk.Now()}); got != want {
		t.Fatalf("Snapshot() = %+v, want %+v", got, want)
	}
	if r.Advance() {
		t.Fatal("second Advance() at the same instant moved again")
	}
	if r.Limit() != 10 {
		t.Fatalf("Limit() = %d, want 10", r.Limit())
	}
}

func TestRestore(t *testing.T) {
	tests := []struct {
		name      string
		snap      Snapshot
		want      Snapshot
		wantLimit int64
	}{
		{name: "mid ramp", snap: Snapshot{Step: 2, StepStarted: t0.Add(-30 * time.Second)}, want: Snapshot{Step: 2, StepStarted: t0.Add(-30 * time.Second)}, wantLimit: 20},
		{name: "negative step", snap: Snapshot{Step: -3, StepStarted: t0}, want: Snapshot{Step: 0, StepStarted: t0}, wantLimit: 5},
		{name: "step past the end", snap: Snapshot{Step: 9, StepStarted: t0}, want: Snapshot{Step: 3, StepStarted: t0}, wantLimit: 40},
		{name: "started in the future", snap: Snapshot{Step: 1, StepStarted: t0.Add(time.Hour)}, want: Snapshot{Step: 1, StepStarted: t0}, wantLimit: 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Restore(seed(), newClock(), tt.snap)
			if got := r.Snapshot(); got != tt.want {
				t.Fatalf("Snapshot() = %+v, want %+v", got, tt.want)
			}
			if got := r.Limit(); got != tt.wantLimit {
				t.Fatalf("Limit() = %d, want %d", got, tt.wantLimit)
			}
		})
	}
}

func TestRestoreContinuesStep(t *testing.T) {
	clk := newClock()
	r := New(seed(), clk)
	clk.Advance(time.Minute)
	r.Advance()
	snap := r.Snapshot()

	// The manager restarts 40 s into step 1: 20 s of it remain.
	clk.Advance(40 * time.Second)
	r2 := Restore(seed(), clk, snap)
	if r2.Advance() {
		t.Fatal("restored ramp advanced early")
	}
	clk.Advance(20 * time.Second)
	if !r2.Advance() || r2.Limit() != 20 {
		t.Fatalf("restored ramp Limit() = %d, want 20", r2.Limit())
	}
}

func TestNewCopiesSteps(t *testing.T) {
	s := seed()
	r := New(s, newClock())
	s.Steps[0] = 99
	if r.Limit() != 5 {
		t.Fatalf("Limit() = %d after caller mutated Steps, want 5", r.Limit())
	}
}

func TestEmptySchedule(t *testing.T) {
	clk := newClock()
	r := New(Schedule{StepDuration: time.Minute}, clk)
	clk.Advance(time.Hour)
	if r.Advance() || r.Limit() != 0 || !r.Done() || r.Step() != 0 {
		t.Fatalf("empty ramp: Advance moved or Limit() = %d, Done() = %v, Step() = %d", r.Limit(), r.Done(), r.Step())
	}
}

func TestConcurrentUse(t *testing.T) {
	clk := newClock()
	clk.Advance(time.Hour)
	r := Restore(seed(), clk, Snapshot{Step: 0, StepStarted: t0})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				r.Advance()
				_ = r.Limit()
				_ = r.Done()
				_ = r.Snapshot()
			}
		})
	}
	wg.Wait()
	// The clock never moved after the first Advance, so only one step.
	if r.Step() != 1 {
		t.Fatalf("Step() = %d, want 1", r.Step())
	}
}
