package replay

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"
)

func TestQueueRunsReadyJobsInOrderAndDelayedOnesWhenDue(t *testing.T) {
	var q Queue
	now := time.Now()
	q.Push(&Job{ID: 1}, now)
	q.Push(&Job{ID: 2}, now.Add(150*time.Millisecond))
	q.Push(&Job{ID: 3}, now)
	if q.Len() != 3 {
		t.Fatalf("Len() = %d, want 3", q.Len())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var got []int64
	for range 3 {
		j, ok := q.Pop(ctx)
		if !ok {
			t.Fatal("Pop ended early")
		}
		got = append(got, j.ID)
	}
	if got[0] != 1 || got[1] != 3 || got[2] != 2 {
		t.Errorf("order = %v, want [1 3 2]", got)
	}
	if time.Since(now) < 150*time.Millisecond {
		t.Errorf("the delayed job ran before it was due")
	}
	cancel()
	if _, ok := q.Pop(ctx); ok {
		t.Error("Pop returned a job after its context ended")
	}
}

// The dependency model: within capacity calls succeed; sustained overload
// takes it down (a collapse), and it comes back cold.
func TestDependencyCollapsesUnderSustainedOverload(t *testing.T) {
	d, err := StartDependency(DependencyConfig{
		Capacity: 2, ServiceTime: 30 * time.Millisecond, ColdFactor: 0.5, WarmUp: time.Hour,
		CollapseAfter: 100 * time.Millisecond, DownFor: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = d.Close() }()
	get := func() int {
		resp, err := http.Get(d.URL())
		if err != nil {
			t.Error(err)
			return 0
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(); code != http.StatusOK {
		t.Fatalf("a call within capacity got %d", code)
	}
	d.Block()
	if code := get(); code != http.StatusServiceUnavailable || !d.Down() {
		t.Fatalf("a call during the outage got %d", code)
	}
	d.Unblock()
	if d.Capacity() != 1 {
		t.Fatalf("capacity after recovery = %d, want 1 (cold)", d.Capacity())
	}
	// Eight callers against a cold capacity of one, for longer than
	// CollapseAfter.
	var wg sync.WaitGroup
	stop := time.Now().Add(300 * time.Millisecond)
	for range 8 {
		wg.Go(func() {
			for time.Now().Before(stop) {
				get()
			}
		})
	}
	wg.Wait()
	if st := d.Stats(); st.Collapses == 0 || !d.Down() {
		t.Fatalf("no collapse under sustained overload: %+v", st)
	}
}
