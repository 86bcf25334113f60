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
	// CollapseAfter: on a starved machine the callers may take a while to
	// overload it for 100 ms in a row, so they go on until it falls over or
	// 10 s have passed.
	var wg sync.WaitGroup
	stop := time.Now().Add(10 * time.Second)
	for range 8 {
		wg.Go(func() {
			for time.Now().Before(stop) && !d.Down() {
				get()
			}
		})
	}
	wg.Wait()
	if st := d.Stats(); st.Collapses == 0 || !d.Down() {
		t.Fatalf("no collapse under sustained overload: %+v", st)
	}
}

// TestDependencyCountsCallsOverTheLimitInForce: a call that arrives while
// more calls are in flight than any in-flight call's admitted limit is over
// the limit; a call admitted under a lower limit that arrives after the ramp
// stepped up, among calls admitted under the new limit, is not.
func TestDependencyCountsCallsOverTheLimitInForce(t *testing.T) {
	d, err := StartDependency(DependencyConfig{Capacity: 100, ServiceTime: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = d.Close() }()
	call := func(wg *sync.WaitGroup, limit string) {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, d.URL(), nil)
			req.Header.Set(AdmittedLimitHeader, limit)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			_ = resp.Body.Close()
		})
	}
	// Three calls admitted at limit 5, then a late one admitted at 2.
	var wg sync.WaitGroup
	for range 3 {
		call(&wg, "5")
	}
	time.Sleep(100 * time.Millisecond)
	call(&wg, "2")
	wg.Wait()
	if n := d.Stats().OverLimit; n != 0 {
		t.Fatalf("a late call from a lower step counted %d over the limit, want 0", n)
	}
	// Three calls admitted at limit 2 at once: the third is over.
	for range 3 {
		call(&wg, "2")
	}
	wg.Wait()
	if n := d.Stats().OverLimit; n != 1 {
		t.Fatalf("three calls at limit 2 counted %d over the limit, want 1", n)
	}
}

// A caller that gives up on a call (a worker scaled in, a job cancelled) is not
// a failure of the dependency: the demo's "failed/s" and its plot count only
// the calls the dependency refused.
func TestDependencyCountsCancelledCallsApartFromFailures(t *testing.T) {
	d, err := StartDependency(DependencyConfig{Capacity: 10, ServiceTime: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = d.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, d.URL(), nil)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		_ = resp.Body.Close()
		t.Fatal("the call outlived its caller's deadline")
	}
	deadline := time.Now().Add(5 * time.Second)
	for d.Stats().Cancelled == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st := d.Stats(); st.Cancelled != 1 || st.Failed != 0 || st.Served != 0 {
		t.Fatalf("a call its caller gave up on: cancelled %d, failed %d, served %d; want 1, 0, 0", st.Cancelled, st.Failed, st.Served)
	}
}
