package sim

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// A cohort of jobs that failed together: plain backoff and the seed's ±10%
// jitter keep it together (a wave), full jitter spreads it over the whole
// interval. The statistic is the largest share of the cohort that lands in any
// window one fifth of the ceiling wide: 1 for a wave, about 0.2 when spread.
func TestJitterModesAndWaves(t *testing.T) {
	params := policy.Params{Backoff: retry.Backoff{Base: 5 * time.Second, Max: time.Hour}}
	const cohort, attempt = 10000, 4
	ceiling := params.Backoff.Base << (attempt - 1)
	for _, tc := range []struct {
		policy       Policy
		atLeast, max float64
	}{
		{PlainBackoff, 1, 1},
		{SmallJitter, 0.999, 1},
		{FullJitter, 0, 0.22},
	} {
		t.Run(string(tc.policy), func(t *testing.T) {
			m := mechanismsFor(tc.policy, params)
			rnd := rand.New(rand.NewPCG(7, 11))
			delays := make([]time.Duration, cohort)
			for i := range delays {
				delays[i] = m.delay(attempt, rnd)
			}
			share := densestWindow(delays, ceiling/5)
			t.Logf("%s: %.3f of the cohort within %v of each other", tc.policy, share, ceiling/5)
			if share < tc.atLeast || share > tc.max {
				t.Errorf("densest window holds %.3f of the cohort, want [%v, %v]", share, tc.atLeast, tc.max)
			}
		})
	}
}

// densestWindow is the largest share of delays within any window of width w.
func densestWindow(delays []time.Duration, w time.Duration) float64 {
	s := slices.Clone(delays)
	slices.Sort(s)
	best, j := 0, 0
	for i := range s {
		for s[i]-s[j] > w {
			j++
		}
		best = max(best, i-j+1)
	}
	return float64(best) / float64(len(s))
}
