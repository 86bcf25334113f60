package retry

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// fixedRand always returns the same value.
type fixedRand float64

func (f fixedRand) Float64() float64 { return float64(f) }

// seeded returns a deterministic generator.
func seeded() *rand.Rand { return rand.New(rand.NewPCG(20250301, 42)) }

const maxDuration = time.Duration(math.MaxInt64)

func TestBackoffValidate(t *testing.T) {
	tests := []struct {
		name    string
		b       Backoff
		wantErr string
	}{
		{name: "full", b: Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: JitterFull}},
		{name: "equal", b: Backoff{Base: time.Second, Max: time.Second, Jitter: JitterEqual}},
		{name: "none", b: Backoff{Base: time.Second, Max: time.Minute, Jitter: JitterNone}},
		{name: "empty jitter means full", b: Backoff{Base: time.Second, Max: time.Minute}},
		{name: "zero base", b: Backoff{Base: 0, Max: time.Minute}, wantErr: "base"},
		{name: "negative base", b: Backoff{Base: -time.Second, Max: time.Minute}, wantErr: "base"},
		{name: "max below base", b: Backoff{Base: time.Minute, Max: time.Second}, wantErr: "max"},
		{name: "unknown jitter", b: Backoff{Base: time.Second, Max: time.Minute, Jitter: "full"}, wantErr: "jitter"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.b.Validate()
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

func TestCeiling(t *testing.T) {
	seedPolicy := Backoff{Base: 5 * time.Second, Max: time.Hour}
	tests := []struct {
		name    string
		b       Backoff
		attempt int
		want    time.Duration
	}{
		{name: "first attempt is base", b: seedPolicy, attempt: 1, want: 5 * time.Second},
		{name: "second attempt doubles", b: seedPolicy, attempt: 2, want: 10 * time.Second},
		{name: "fifth attempt", b: seedPolicy, attempt: 5, want: 80 * time.Second},
		{name: "last uncapped", b: seedPolicy, attempt: 10, want: 2560 * time.Second},
		{name: "first capped", b: seedPolicy, attempt: 11, want: time.Hour},
		{name: "zero attempt counts as one", b: seedPolicy, attempt: 0, want: 5 * time.Second},
		{name: "negative attempt counts as one", b: seedPolicy, attempt: -7, want: 5 * time.Second},
		{name: "attempt 200 is capped", b: seedPolicy, attempt: 200, want: time.Hour},
		{name: "max int attempt is capped", b: seedPolicy, attempt: math.MaxInt, want: time.Hour},
		{name: "exactly reaching max", b: Backoff{Base: time.Second, Max: 8 * time.Second}, attempt: 4, want: 8 * time.Second},
		{name: "base equals max", b: Backoff{Base: time.Minute, Max: time.Minute}, attempt: 3, want: time.Minute},
		{name: "1ns base, shift 62 fits", b: Backoff{Base: 1, Max: maxDuration}, attempt: 63, want: 1 << 62},
		{name: "1ns base, shift 63 overflows to max", b: Backoff{Base: 1, Max: maxDuration}, attempt: 64, want: maxDuration},
		{name: "huge base and max", b: Backoff{Base: maxDuration / 2, Max: maxDuration}, attempt: 3, want: maxDuration},
		{name: "invalid zero base", b: Backoff{Base: 0, Max: time.Hour}, attempt: 3, want: 0},
		{name: "invalid negative max", b: Backoff{Base: time.Second, Max: -time.Hour}, attempt: 3, want: 0},
		{name: "invalid max below base", b: Backoff{Base: time.Minute, Max: time.Second}, attempt: 1, want: time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.b.Ceiling(tt.attempt); got != tt.want {
				t.Fatalf("Ceiling(%d) = %v, want %v", tt.attempt, got, tt.want)
			}
		})
	}
}

func TestCeilingMonotonic(t *testing.T) {
	b := Backoff{Base: 3 * time.Millisecond, Max: 17 * time.Minute}
	prev := time.Duration(0)
	for attempt := 1; attempt <= 300; attempt++ {
		c := b.Ceiling(attempt)
		if c < prev || c > b.Max || c < b.Base {
			t.Fatalf("Ceiling(%d) = %v after %v, outside [Base, Max] or decreasing", attempt, c, prev)
		}
		prev = c
	}
}

func TestDelayFixedDraws(t *testing.T) {
	b := Backoff{Base: 5 * time.Second, Max: time.Hour}
	const attempt = 3 // ceiling 20s
	tests := []struct {
		name   string
		jitter Jitter
		draw   float64
		want   time.Duration
	}{
		{name: "full low", jitter: JitterFull, draw: 0, want: 0},
		{name: "full mid", jitter: JitterFull, draw: 0.25, want: 5 * time.Second},
		{name: "full high", jitter: JitterFull, draw: 0.75, want: 15 * time.Second},
		{name: "empty jitter is full", jitter: "", draw: 0.5, want: 10 * time.Second},
		{name: "unknown jitter is full", jitter: "Bogus", draw: 0.5, want: 10 * time.Second},
		{name: "equal low", jitter: JitterEqual, draw: 0, want: 10 * time.Second},
		{name: "equal mid", jitter: JitterEqual, draw: 0.5, want: 15 * time.Second},
		{name: "none ignores draw", jitter: JitterNone, draw: 0.3, want: 20 * time.Second},
		{name: "draw one gives ceiling", jitter: JitterFull, draw: 1, want: 20 * time.Second},
		{name: "draw above one clamped", jitter: JitterFull, draw: 7, want: 20 * time.Second},
		{name: "negative draw clamped", jitter: JitterEqual, draw: -3, want: 10 * time.Second},
		{name: "NaN draw is zero", jitter: JitterFull, draw: math.NaN(), want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := b
			b.Jitter = tt.jitter
			if got := b.Delay(attempt, fixedRand(tt.draw)); got != tt.want {
				t.Fatalf("Delay(%d) = %v, want %v", attempt, got, tt.want)
			}
		})
	}
}

func TestDelayNoneWithNilRand(t *testing.T) {
	b := Backoff{Base: time.Second, Max: time.Minute, Jitter: JitterNone}
	if got := b.Delay(2, nil); got != 2*time.Second {
		t.Fatalf("Delay(2, nil) = %v, want 2s", got)
	}
}

func TestDelayBounds(t *testing.T) {
	tests := []struct {
		jitter Jitter
		lower  func(c time.Duration) time.Duration
	}{
		{jitter: JitterFull, lower: func(time.Duration) time.Duration { return 0 }},
		{jitter: JitterEqual, lower: func(c time.Duration) time.Duration { return c / 2 }},
		{jitter: JitterNone, lower: func(c time.Duration) time.Duration { return c }},
	}
	for _, tt := range tests {
		t.Run(string(tt.jitter), func(t *testing.T) {
			b := Backoff{Base: 7 * time.Millisecond, Max: 90 * time.Second, Jitter: tt.jitter}
			rnd := seeded()
			for attempt := -1; attempt <= 70; attempt++ {
				c := b.Ceiling(attempt)
				for range 200 {
					d := b.Delay(attempt, rnd)
					if d < tt.lower(c) || d > c {
						t.Fatalf("Delay(%d) = %v outside [%v, %v]", attempt, d, tt.lower(c), c)
					}
				}
			}
		})
	}
}

func TestDelayHugeCeiling(t *testing.T) {
	for _, j := range []Jitter{JitterFull, JitterEqual, JitterNone} {
		b := Backoff{Base: time.Hour, Max: maxDuration, Jitter: j}
		for _, draw := range []float64{0, 0.5, math.Nextafter(1, 0), 1} {
			d := b.Delay(200, fixedRand(draw))
			if d < 0 || d > maxDuration {
				t.Fatalf("%s: Delay(200) with draw %v = %v", j, draw, d)
			}
		}
	}
}

// cohort returns the delays of n jobs that all failed their attempt-th call
// together, normalised by the ceiling and sorted.
func cohort(t *testing.T, b Backoff, attempt, n int) []float64 {
	t.Helper()
	rnd := seeded()
	c := b.Ceiling(attempt)
	xs := make([]float64, n)
	for i := range xs {
		xs[i] = float64(b.Delay(attempt, rnd)) / float64(c)
	}
	slices.Sort(xs)
	return xs
}

// ksUniform returns the Kolmogorov–Smirnov statistic of sorted samples
// against the uniform distribution on [0, 1].
func ksUniform(xs []float64) float64 {
	n := float64(len(xs))
	var d float64
	for i, x := range xs {
		d = max(d, float64(i+1)/n-x, x-float64(i)/n)
	}
	return d
}

func TestFullJitterSpreadsCohortUniformly(t *testing.T) {
	const n = 10_000
	b := Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: JitterFull}
	for _, attempt := range []int{1, 4, 12} {
		xs := cohort(t, b, attempt, n)
		crit := 1.63 / math.Sqrt(n)
		d := ksUniform(xs)
		t.Logf("attempt %d: KS statistic %.5f, 1%% critical value %.5f", attempt, d, crit)
		if d >= crit {
			t.Errorf("attempt %d: KS statistic %.5f >= 1%% critical value %.5f", attempt, d, crit)
		}
		if xs[0] < 0 || xs[n-1] > 1 {
			t.Errorf("attempt %d: delays outside [0, ceiling]: min %v max %v", attempt, xs[0], xs[n-1])
		}
	}
}

func TestKSDetectsNonUniform(t *testing.T) {
	const n = 10_000
	crit := 1.63 / math.Sqrt(n)
	equal := cohort(t, Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: JitterEqual}, 4, n)
	if d := ksUniform(equal); d < crit {
		t.Fatalf("KS statistic %.5f of Equal jitter below %.5f: the test cannot tell spread from clustering", d, crit)
	}
}

func TestNoJitterKeepsCohortSynchronised(t *testing.T) {
	b := Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: JitterNone}
	rnd := seeded()
	for range 10_000 {
		if d := b.Delay(4, rnd); d != 40*time.Second {
			t.Fatalf("Delay(4) = %v, want every job at 40s", d)
		}
	}
}

func TestEqualJitterStaysInUpperHalf(t *testing.T) {
	const n = 10_000
	xs := cohort(t, Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: JitterEqual}, 4, n)
	if xs[0] < 0.5 || xs[n-1] > 1 {
		t.Fatalf("Equal jitter delays span [%v, %v] of the ceiling, want within [0.5, 1]", xs[0], xs[n-1])
	}
	// Within the upper half the spread is uniform.
	for i := range xs {
		xs[i] = 2 * (xs[i] - 0.5)
	}
	if d, crit := ksUniform(xs), 1.63/math.Sqrt(n); d >= crit {
		t.Fatalf("Equal jitter not uniform over the upper half: KS %.5f >= %.5f", d, crit)
	}
}

func TestDelayDeterministicForSeed(t *testing.T) {
	b := Backoff{Base: time.Second, Max: time.Minute, Jitter: JitterFull}
	r1, r2 := seeded(), seeded()
	for attempt := 1; attempt < 50; attempt++ {
		if d1, d2 := b.Delay(attempt, r1), b.Delay(attempt, r2); d1 != d2 {
			t.Fatalf("attempt %d: same seed gave %v and %v", attempt, d1, d2)
		}
	}
}

func TestRetryAfter(t *testing.T) {
	tests := []struct {
		name   string
		server time.Duration
		draw   float64
		want   time.Duration
	}{
		{name: "zero", server: 0, draw: 0.5, want: 0},
		{name: "negative", server: -time.Second, draw: 0.5, want: 0},
		{name: "lowest draw is the server value", server: 30 * time.Second, draw: 0, want: 30 * time.Second},
		{name: "mid draw", server: 30 * time.Second, draw: 0.5, want: 37*time.Second + 500*time.Millisecond},
		{name: "highest draw is one and a half", server: 30 * time.Second, draw: 1, want: 45 * time.Second},
		{name: "one nanosecond", server: 1, draw: 0.9, want: 1},
		{name: "saturates", server: maxDuration, draw: 1, want: maxDuration},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := RetryAfter(tt.server, fixedRand(tt.draw)); got != tt.want {
				t.Fatalf("RetryAfter(%v) = %v, want %v", tt.server, got, tt.want)
			}
		})
	}
}

func TestRetryAfterNeverBelowServer(t *testing.T) {
	rnd := seeded()
	for _, server := range []time.Duration{1, time.Millisecond, time.Second, 120 * time.Second, 24 * time.Hour} {
		for range 2_000 {
			got := RetryAfter(server, rnd)
			if got < server || got > server+server/2 {
				t.Fatalf("RetryAfter(%v) = %v outside [server, 1.5×server]", server, got)
			}
		}
	}
}

func TestPark(t *testing.T) {
	seedPolicy := Backoff{Base: 5 * time.Second, Max: 300 * time.Second}
	tests := []struct {
		name string
		b    Backoff
		draw float64
		want time.Duration
	}{
		{name: "seed low", b: seedPolicy, draw: 0, want: 300 * time.Second},
		{name: "seed mid", b: seedPolicy, draw: 0.5, want: 450 * time.Second},
		{name: "seed high", b: seedPolicy, draw: 1, want: 600 * time.Second},
		{name: "jitter mode irrelevant", b: Backoff{Base: time.Second, Max: 10 * time.Second, Jitter: JitterNone}, draw: 0.5, want: 15 * time.Second},
		{name: "zero max", b: Backoff{}, draw: 0.5, want: 0},
		{name: "saturates", b: Backoff{Base: 1, Max: maxDuration}, draw: 0.5, want: maxDuration},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Park(tt.b, fixedRand(tt.draw)); got != tt.want {
				t.Fatalf("Park(%+v) = %v, want %v", tt.b, got, tt.want)
			}
		})
	}
}

func TestParkBounds(t *testing.T) {
	b := Backoff{Base: 5 * time.Second, Max: 300 * time.Second, Jitter: JitterFull}
	rnd := seeded()
	for range 10_000 {
		if d := Park(b, rnd); d < 300*time.Second || d > 600*time.Second {
			t.Fatalf("Park() = %v outside [300s, 600s]", d)
		}
	}
}

func TestFullJitter(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		f    float64
		want time.Duration
	}{
		{10 * time.Second, 0, 0},
		{10 * time.Second, 0.25, 2500 * time.Millisecond},
		{10 * time.Second, 1, 10 * time.Second},
		{10 * time.Second, 2, 10 * time.Second},
		{10 * time.Second, -1, 0},
		{10 * time.Second, math.NaN(), 0},
		{0, 0.5, 0},
		{-time.Second, 0.5, 0},
		{maxDuration, 0.9999999999999999, maxDuration - 1023},
	} {
		if got := FullJitter(tc.d, fixedRand(tc.f)); got != tc.want {
			t.Errorf("FullJitter(%v, %v) = %v, want %v", tc.d, tc.f, got, tc.want)
		}
	}
	// A nil Rand draws from the global source, within [0, d].
	for range 1000 {
		if got := FullJitter(time.Second, nil); got < 0 || got > time.Second {
			t.Fatalf("FullJitter(1s, nil) = %v, want within [0, 1s]", got)
		}
	}
}
