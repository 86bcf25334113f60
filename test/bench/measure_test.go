package bench

import (
	"slices"
	"sync/atomic"
	"time"
)

// Measuring helpers any benchmark of this package may use.

// measureQuantiles sorts d in place and returns its p50, p99 and maximum
// (nearest rank).
func measureQuantiles(d []time.Duration) (p50, p99, worst time.Duration) {
	if len(d) == 0 {
		return 0, 0, 0
	}
	slices.Sort(d)
	return measureRank(d, 0.5), measureRank(d, 0.99), d[len(d)-1]
}

// measureRank is the p-quantile of sorted by nearest rank.
func measureRank(sorted []time.Duration, p float64) time.Duration {
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// measureLatest keeps the latest of the instants stored, safe for concurrent
// use: every goroutine stores, one reads. Zero means none yet.
type measureLatest struct{ ns atomic.Int64 }

func (m *measureLatest) store(t time.Time) {
	n := t.UnixNano()
	for {
		cur := m.ns.Load()
		if n <= cur || m.ns.CompareAndSwap(cur, n) {
			return
		}
	}
}

func (m *measureLatest) load() time.Time {
	if n := m.ns.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// measureFirst keeps the first instant stored, safe for concurrent use.
type measureFirst struct{ ns atomic.Int64 }

func (m *measureFirst) store(t time.Time) { m.ns.CompareAndSwap(0, t.UnixNano()) }

func (m *measureFirst) load() time.Time {
	if n := m.ns.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}
