package retry

import (
	"fmt"
	"math"
	"time"
)

// ppm is the fixed-point scale of a budget ratio: parts per million.
const ppm = 1_000_000

// Budget caps retries at a share of recent calls to a dependency: a retry is
// allowed while retries < max(MinRetries, Ratio × calls), both counted over
// the last Window. The seed policy is Ratio 0.2, MinRetries 10, Window 1m.
type Budget struct {
	// Ratio is the share of calls that may be retries; in [0, 1].
	Ratio float64
	// MinRetries is the number of retries always allowed per Window, so a
	// quiet dependency can still be retried; >= 0.
	MinRetries int64
	// Window is the period over which retries and calls are counted; > 0.
	Window time.Duration
}

// Validate returns an error naming the first invalid field, or nil.
func (b Budget) Validate() error {
	switch {
	case !(b.Ratio >= 0 && b.Ratio <= 1):
		return fmt.Errorf("ratio must be in [0, 1], got %v", b.Ratio)
	case b.MinRetries < 0:
		return fmt.Errorf("minRetries must be >= 0, got %d", b.MinRetries)
	case b.Window <= 0:
		return fmt.Errorf("window must be > 0, got %v", b.Window)
	}
	return nil
}

// Allows reports whether one more retry fits the budget, given the retries
// and calls counted over the last Window. It is
// AllowsPPM(retries, calls, RatioPPM(b.Ratio), b.MinRetries).
func (b Budget) Allows(retries, calls int64) bool {
	return AllowsPPM(retries, calls, RatioPPM(b.Ratio), b.MinRetries)
}

// RatioPPM returns round(ratio × 1e6), rounding halves away from zero: the
// integer form of a budget ratio that is stored in Redis, so that Lua scripts
// use integer-only arithmetic. NaN returns 0; results saturate at the int64
// range.
func RatioPPM(ratio float64) int64 {
	v := math.Round(ratio * ppm)
	switch {
	case math.IsNaN(v):
		return 0
	case v >= math.MaxInt64:
		return math.MaxInt64
	case v <= math.MinInt64:
		return math.MinInt64
	}
	return int64(v)
}

// AllowsPPM is the retry-budget rule. It reports whether
//
//	retries × 1e6 < max(minRetries × 1e6, ratioPPM × calls)
//
// in exact integer arithmetic, so a retry count exactly at the budget is
// refused. The Redis Lua script of the limiter protocol evaluates the same
// formula and is cross-checked against this function.
//
// Overflow bound: the result is exact while every product fits in an int64,
// i.e. for non-negative retries, calls and minRetries up to
// math.MaxInt64/1e6 (about 9.2e12) with ratioPPM <= 1e6. Beyond that the
// products saturate instead of wrapping, which refuses the retry rather than
// allowing it. Lua numbers in Redis are float64, exact only up to 2^53, so
// the script agrees with this function for counts up to about 9e9.
func AllowsPPM(retries, calls, ratioPPM, minRetries int64) bool {
	limit := max(mulSat(minRetries, ppm), mulSat(ratioPPM, calls))
	return mulSat(retries, ppm) < limit
}

// mulSat returns a × b, saturating at the int64 range instead of wrapping.
func mulSat(a, b int64) int64 {
	if a == 0 || b == 0 {
		return 0
	}
	p := a * b
	wrapped := p/b != a || (a == -1 && b == math.MinInt64) || (b == -1 && a == math.MinInt64)
	if !wrapped {
		return p
	}
	if (a > 0) == (b > 0) {
		return math.MaxInt64
	}
	return math.MinInt64
}
