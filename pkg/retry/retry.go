// Package retry computes when a failed call to a dependency may be retried:
// capped exponential backoff with jitter, honouring a server's Retry-After,
// parking work when the retry budget is spent, and the retry-budget rule
// itself.
//
// Everything here is pure arithmetic. Randomness comes from a caller-supplied
// Rand (for example a seeded *math/rand/v2.Rand), so the Spillway simulator
// reproduces exactly the delays the worker library computes in production.
//
// Full jitter is the default and the recommended mode: it spreads a cohort of
// jobs that failed together evenly over [0, ceiling] instead of retrying them
// in synchronised waves.
package retry

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// Jitter selects how a backoff delay is randomised. The string values are the
// enum values of the Spillway resources.
type Jitter string

const (
	// JitterFull draws the delay uniformly from [0, ceiling].
	JitterFull Jitter = "Full"
	// JitterEqual draws the delay uniformly from [ceiling/2, ceiling].
	JitterEqual Jitter = "Equal"
	// JitterNone uses the ceiling itself, which keeps a cohort synchronised;
	// it exists for comparison and tests, not for production.
	JitterNone Jitter = "None"
)

// Rand is a source of uniform floats in [0, 1). *math/rand/v2.Rand and
// *math/rand.Rand satisfy it; the caller seeds it. Values outside [0, 1] are
// clamped and NaN counts as 0. Where a Rand may be nil, nil means
// math/rand/v2's global source.
type Rand interface {
	Float64() float64
}

// Backoff is a capped exponential backoff policy.
type Backoff struct {
	// Base is the ceiling after the first failed attempt; > 0.
	Base time.Duration
	// Max caps the ceiling; >= Base.
	Max time.Duration
	// Jitter is the randomisation; the empty value means JitterFull.
	Jitter Jitter
}

// Validate returns an error naming the first invalid field, or nil.
func (b Backoff) Validate() error {
	switch {
	case b.Base <= 0:
		return fmt.Errorf("base must be > 0, got %v", b.Base)
	case b.Max < b.Base:
		return fmt.Errorf("max must be >= base (%v), got %v", b.Base, b.Max)
	case !b.Jitter.valid():
		return fmt.Errorf("jitter must be one of %s, %s, %s, got %q", JitterFull, JitterEqual, JitterNone, b.Jitter)
	}
	return nil
}

func (j Jitter) valid() bool {
	return j == "" || j == JitterFull || j == JitterEqual || j == JitterNone
}

// Ceiling returns min(Max, Base × 2^(attempt−1)), where attempt is the number
// of the attempt that just failed (1 for the first call). An attempt below 1
// counts as 1. It never overflows, however large attempt is, and it is never
// negative.
func (b Backoff) Ceiling(attempt int) time.Duration {
	if b.Base <= 0 || b.Max <= 0 {
		return 0
	}
	shift := max(attempt, 1) - 1
	// For shift >= 63, Base × 2^shift >= 2^63 exceeds every Duration.
	if shift >= 63 || b.Base > b.Max>>shift {
		return b.Max
	}
	return b.Base << shift
}

// Delay returns how long to wait before retrying after the given attempt
// failed, with c = Ceiling(attempt):
//
//   - JitterFull (and the empty Jitter, or any unknown value): uniform in
//     [0, c].
//   - JitterEqual: c/2 + uniform in [0, c − c/2], i.e. within [c/2, c].
//   - JitterNone: c; rnd is not used and may be nil.
func (b Backoff) Delay(attempt int, rnd Rand) time.Duration {
	c := b.Ceiling(attempt)
	switch b.Jitter {
	case JitterNone:
		return c
	case JitterEqual:
		half := c / 2
		return half + FullJitter(c-half, rnd)
	default:
		return FullJitter(c, rnd)
	}
}

// RetryAfter honours a server's Retry-After (HTTP 429/503): the delay is never
// earlier than server and is jittered upwards so that clients told the same
// value do not return together: server + uniform in [0, server/2]. A server
// value <= 0 returns 0. The sum saturates at the largest Duration.
func RetryAfter(server time.Duration, rnd Rand) time.Duration {
	if server <= 0 {
		return 0
	}
	return addSat(server, FullJitter(server/2, rnd))
}

// Park returns the delay for work that may not retry now because the retry
// budget is spent ("park, don't pile on"): b.Max + uniform in [0, b.Max];
// with a Max of 300 s that is 300 s + uniform(0, 300 s). A Max <= 0 returns
// 0. The sum saturates at the largest Duration.
func Park(b Backoff, rnd Rand) time.Duration {
	if b.Max <= 0 {
		return 0
	}
	return addSat(b.Max, FullJitter(b.Max, rnd))
}

// FullJitter returns a duration drawn uniformly from [0, d]: full jitter,
// Spillway's one jitter helper. Every randomised delay is built from it, an
// offset plus FullJitter of a width: the backoff modes here, the worker
// library's waits and refusal hints, the service middleware's Retry-After,
// the controller's requeues and the simulator's policies.
//
// d <= 0 returns 0 without drawing. A nil rnd draws from math/rand/v2's
// global source, which is safe for concurrent use. Values of rnd outside
// [0, 1] are clamped and NaN counts as 0.
func FullJitter(d time.Duration, rnd Rand) time.Duration {
	if d <= 0 {
		return 0
	}
	var f float64
	if rnd == nil {
		f = rand.Float64()
	} else {
		f = rnd.Float64()
	}
	switch {
	case !(f > 0): // also NaN
		return 0
	case f >= 1:
		return d
	}
	x := f * float64(d)
	if x >= float64(d) { // rounding; also keeps the conversion in range
		return d
	}
	return min(time.Duration(x), d)
}

// addSat returns a + b for non-negative a and b, saturating at the largest
// Duration.
func addSat(a, b time.Duration) time.Duration {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
