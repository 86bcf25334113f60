package retry

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestBudgetValidate(t *testing.T) {
	tests := []struct {
		name    string
		b       Budget
		wantErr string
	}{
		{name: "seed", b: Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute}},
		{name: "retries disabled", b: Budget{Ratio: 0, MinRetries: 0, Window: time.Minute}},
		{name: "ratio one", b: Budget{Ratio: 1, Window: time.Second}},
		{name: "negative ratio", b: Budget{Ratio: -0.1, Window: time.Minute}, wantErr: "ratio"},
		{name: "ratio above one", b: Budget{Ratio: 1.5, Window: time.Minute}, wantErr: "ratio"},
		{name: "NaN ratio", b: Budget{Ratio: math.NaN(), Window: time.Minute}, wantErr: "ratio"},
		{name: "negative minRetries", b: Budget{Ratio: 0.2, MinRetries: -1, Window: time.Minute}, wantErr: "minRetries"},
		{name: "zero window", b: Budget{Ratio: 0.2, MinRetries: 10}, wantErr: "window"},
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

func TestRatioPPM(t *testing.T) {
	tests := []struct {
		ratio float64
		want  int64
	}{
		{ratio: 0, want: 0},
		{ratio: 0.2, want: 200_000},
		{ratio: 0.1, want: 100_000},
		{ratio: 0.3, want: 300_000},
		{ratio: 1, want: 1_000_000},
		{ratio: 1.0 / 3, want: 333_333},
		{ratio: 2.0 / 3, want: 666_667},
		{ratio: 0.0000005, want: 1},         // exactly half a ppm rounds up
		{ratio: 0.0000015, want: 2},         // halves round away from zero
		{ratio: 0.0000025, want: 3},         // not to even
		{ratio: 0.0000004, want: 0},         // below half a ppm
		{ratio: 0.9999995, want: 1_000_000}, // rounds up to one
		{ratio: 0.1234565, want: 123_457},
		{ratio: math.NaN(), want: 0},
		{ratio: math.Inf(1), want: math.MaxInt64},
		{ratio: math.Inf(-1), want: math.MinInt64},
		{ratio: 1e300, want: math.MaxInt64},
	}
	for _, tt := range tests {
		if got := RatioPPM(tt.ratio); got != tt.want {
			t.Errorf("RatioPPM(%v) = %d, want %d", tt.ratio, got, tt.want)
		}
	}
}

// TestBudgetSeed checks the article's rule: retries < max(10, 0.2 × calls).
func TestBudgetSeed(t *testing.T) {
	seed := Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute}
	tests := []struct {
		name    string
		retries int64
		calls   int64
		want    bool
	}{
		{name: "idle", retries: 0, calls: 0, want: true},
		{name: "floor below", retries: 9, calls: 0, want: true},
		{name: "floor exactly refused", retries: 10, calls: 0, want: false},
		{name: "floor dominates small traffic", retries: 9, calls: 40, want: true},
		{name: "floor exactly refused at 40 calls", retries: 10, calls: 40, want: false},
		{name: "ratio equals floor at 50 calls", retries: 10, calls: 50, want: false},
		{name: "ratio just above floor", retries: 10, calls: 51, want: true},
		{name: "ratio fraction refuses next whole retry", retries: 11, calls: 51, want: false},
		{name: "ratio below budget", retries: 19, calls: 100, want: true},
		{name: "ratio exactly at budget refused", retries: 20, calls: 100, want: false},
		{name: "ratio above budget", retries: 21, calls: 100, want: false},
		{name: "large traffic", retries: 199_999, calls: 1_000_000, want: true},
		{name: "large traffic at budget", retries: 200_000, calls: 1_000_000, want: false},
		{name: "outage: mostly retries", retries: 5_000, calls: 6_000, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := seed.Allows(tt.retries, tt.calls); got != tt.want {
				t.Fatalf("Allows(%d, %d) = %v, want %v", tt.retries, tt.calls, got, tt.want)
			}
		})
	}
}

func TestAllowsPPM(t *testing.T) {
	const maxCount = math.MaxInt64 / 1_000_000
	tests := []struct {
		name                                 string
		retries, calls, ratioPPM, minRetries int64
		want                                 bool
	}{
		{name: "no budget at all", retries: 0, calls: 1000, ratioPPM: 0, minRetries: 0, want: false},
		{name: "floor only", retries: 2, calls: 1000, ratioPPM: 0, minRetries: 3, want: true},
		{name: "floor only exhausted", retries: 3, calls: 1000, ratioPPM: 0, minRetries: 3, want: false},
		{name: "one ppm of a million calls allows zero retries only", retries: 0, calls: 1_000_000, ratioPPM: 1, want: true},
		{name: "one ppm of a million calls refuses one", retries: 1, calls: 1_000_000, ratioPPM: 1, want: false},
		{name: "one third just below", retries: 332, calls: 999, ratioPPM: 333_333, want: true},
		// 333 × 1e6 = 333,000,000 vs 333,333 × 999 = 332,999,667: refused.
		{name: "one third rounding down refuses", retries: 333, calls: 999, ratioPPM: 333_333, want: false},
		{name: "ratio one allows retries below calls", retries: 99, calls: 100, ratioPPM: 1_000_000, want: true},
		{name: "ratio one refuses at calls", retries: 100, calls: 100, ratioPPM: 1_000_000, want: false},
		{name: "largest exact counts", retries: maxCount - 1, calls: maxCount, ratioPPM: 1_000_000, want: true},
		{name: "largest exact counts at budget", retries: maxCount, calls: maxCount, ratioPPM: 1_000_000, want: false},
		{name: "overflowing retries refused", retries: math.MaxInt64, calls: 10, ratioPPM: 200_000, minRetries: 10, want: false},
		{name: "overflowing both refused", retries: math.MaxInt64, calls: math.MaxInt64, ratioPPM: 1_000_000, want: false},
		{name: "overflowing budget allows normal retries", retries: 5, calls: math.MaxInt64, ratioPPM: 200_000, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := AllowsPPM(tt.retries, tt.calls, tt.ratioPPM, tt.minRetries); got != tt.want {
				t.Fatalf("AllowsPPM(%d, %d, %d, %d) = %v, want %v", tt.retries, tt.calls, tt.ratioPPM, tt.minRetries, got, tt.want)
			}
		})
	}
}

// TestAllowsPPMMatchesRealArithmetic compares the integer rule with the
// exact rational rule retries < max(minRetries, ratioPPM × calls / 1e6)
// over a grid of small values.
func TestAllowsPPMMatchesRealArithmetic(t *testing.T) {
	for _, ratioPPM := range []int64{0, 1, 200_000, 333_333, 500_000, 1_000_000} {
		for _, minRetries := range []int64{0, 1, 10} {
			for calls := int64(0); calls <= 120; calls++ {
				for retries := int64(0); retries <= 130; retries++ {
					// retries < max(m, r·c/1e6) ⇔ retries·1e6 < m·1e6 or retries·1e6 < r·c.
					want := retries < minRetries || retries*1_000_000 < ratioPPM*calls
					if got := AllowsPPM(retries, calls, ratioPPM, minRetries); got != want {
						t.Fatalf("AllowsPPM(%d, %d, %d, %d) = %v, want %v", retries, calls, ratioPPM, minRetries, got, want)
					}
				}
			}
		}
	}
}

func TestBudgetAllowsUsesRatioPPM(t *testing.T) {
	b := Budget{Ratio: 1.0 / 3, MinRetries: 0, Window: time.Minute}
	for calls := int64(0); calls <= 3000; calls += 7 {
		for _, retries := range []int64{calls/3 - 1, calls / 3, calls/3 + 1} {
			want := AllowsPPM(retries, calls, 333_333, 0)
			if got := b.Allows(retries, calls); got != want {
				t.Fatalf("Allows(%d, %d) = %v, AllowsPPM = %v", retries, calls, got, want)
			}
		}
	}
}

func TestMulSat(t *testing.T) {
	tests := []struct {
		a, b, want int64
	}{
		{a: 0, b: math.MaxInt64, want: 0},
		{a: 3, b: 1_000_000, want: 3_000_000},
		{a: -3, b: 1_000_000, want: -3_000_000},
		{a: math.MaxInt64 / 1_000_000, b: 1_000_000, want: math.MaxInt64 / 1_000_000 * 1_000_000},
		{a: math.MaxInt64/1_000_000 + 1, b: 1_000_000, want: math.MaxInt64},
		{a: math.MinInt64, b: 2, want: math.MinInt64},
		{a: math.MinInt64, b: -1, want: math.MaxInt64},
		{a: -1, b: math.MinInt64, want: math.MaxInt64},
		{a: math.MinInt64, b: 1, want: math.MinInt64},
		{a: math.MaxInt64, b: -2, want: math.MinInt64},
		{a: -math.MaxInt64, b: -2, want: math.MaxInt64},
	}
	for _, tt := range tests {
		if got := mulSat(tt.a, tt.b); got != tt.want {
			t.Errorf("mulSat(%d, %d) = %d, want %d", tt.a, tt.b, got, tt.want)
		}
	}
}
