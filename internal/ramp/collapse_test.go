package ramp

import (
	"testing"
	"time"
)

func TestCollapse(t *testing.T) {
	sched := Schedule{Steps: []int64{5, 10, 20, 40}, StepDuration: time.Minute}
	for _, tc := range []struct {
		name     string
		snap     Snapshot
		limit    int64
		ceiling  int64
		backoffs int
	}{
		{name: "at full capacity", snap: Snapshot{Step: 3}, limit: 5, ceiling: 40, backoffs: 1},
		{name: "mid ramp", snap: Snapshot{Step: 2}, limit: 5, ceiling: 20, backoffs: 1},
		{name: "again at the same limit doubles", snap: Snapshot{Step: 3, Ceiling: 40, Backoffs: 1}, limit: 5, ceiling: 40, backoffs: 2},
		{name: "at most MaxBackoffs", snap: Snapshot{Step: 3, Ceiling: 40, Backoffs: MaxBackoffs}, limit: 5, ceiling: 40, backoffs: MaxBackoffs},
		{name: "settling after a step back keeps the ceiling it fell from", snap: Snapshot{Step: 2, Ceiling: 40, Backoffs: 1, Settling: true}, limit: 5, ceiling: 40, backoffs: 2},
		{name: "at the first step: below it", snap: Snapshot{Step: 0}, limit: 4, ceiling: 5, backoffs: 1},
		{name: "below the first step: below the limit", snap: Snapshot{Step: 0, Limit: 2}, limit: 1, ceiling: 2, backoffs: 1},
		{name: "at 1: nothing to remember", snap: Snapshot{Step: 0, Limit: 1}, limit: 5, ceiling: 0, backoffs: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newClock()
			r := Restore(sched, clk, tc.snap)
			r.Collapse()
			if r.Limit() != tc.limit || r.Ceiling() != tc.ceiling || r.Snapshot().Backoffs != tc.backoffs {
				t.Errorf("after Collapse: limit %d ceiling %d backoffs %d, want %d %d %d", r.Limit(), r.Ceiling(), r.Snapshot().Backoffs, tc.limit, tc.ceiling, tc.backoffs)
			}
			clk.Advance(time.Hour)
			r.Rewind()
			if r.Started() != clk.Now() || r.Settling() || r.Limit() != tc.limit || r.Ceiling() != tc.ceiling {
				t.Errorf("after Rewind: started %v settling %v limit %d ceiling %d; want now, false, %d, %d", r.Started(), r.Settling(), r.Limit(), r.Ceiling(), tc.limit, tc.ceiling)
			}
			// Survives the published form, as it must across Open and HalfOpen.
			back := Restore(sched, clk, r.Snapshot())
			if back.Limit() != tc.limit || back.Ceiling() != tc.ceiling {
				t.Errorf("restored: limit %d ceiling %d, want %d %d", back.Limit(), back.Ceiling(), tc.limit, tc.ceiling)
			}
		})
	}
}

func TestSkip(t *testing.T) {
	clk := newClock()
	r := Restore(Schedule{Steps: []int64{5, 10, 20, 40}, StepDuration: time.Minute}, clk, Snapshot{Step: 0, Limit: 2, Ceiling: 4, Backoffs: 2})
	r.Skip()
	if !r.Done() || r.Limit() != 40 || r.Ceiling() != 0 || r.Started() != clk.Now() {
		t.Errorf("after Skip: done %v limit %d ceiling %d started %v; want done at 40, no ceiling, now", r.Done(), r.Limit(), r.Ceiling(), r.Started())
	}
}
