package sim

import "time"

// stats are what a run counts as it goes.
type stats struct {
	pending, completed, stale, superseded, gaveUp, parked int64
	// parking counts the jobs waiting out a park delay now.
	parking int64
	// trips counts the in-path trips (controller.trip).
	trips             int64
	secondOutages     int
	downAfterRecovery time.Duration
	// peakLoad is the highest load of a second (see dependency.closeLoad).
	peakLoad time.Duration
	calls    []int32
	capacity []float64
}

// newStats holds a series of seconds seconds.
func newStats(seconds int) stats {
	return stats{calls: make([]int32, seconds), capacity: make([]float64, seconds)}
}

// record stores second sec of the time series and its load.
func (s *stats) record(sec int, starts int64, load time.Duration, throughput float64) {
	s.peakLoad = max(s.peakLoad, load)
	if sec >= 0 && sec < len(s.calls) {
		s.calls[sec] = int32(starts)
		s.capacity[sec] = throughput
	}
}

// drainTracker finds when the backlog has drained: the first tick at or
// after recovery at which the pending jobs, not counting those waiting out a
// park delay, are no more than the most seen at any tick of the warm-up, i.e.
// back to the steady-state level. Parked jobs are left out because the retry
// budget deliberately takes them out of the recovery for Max to 2×Max.
type drainTracker struct {
	baseline  int64
	drainedAt time.Duration
}

func (d *drainTracker) observe(now, t0, t1 time.Duration, pending int64) {
	if now <= t0 {
		d.baseline = max(d.baseline, pending)
		return
	}
	if now >= t1 && d.drainedAt < 0 && pending <= d.baseline {
		d.drainedAt = now
	}
}
