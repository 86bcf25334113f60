package skewtest

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Dependency is the fleet's dependency, a fake on loopback: it counts the
// calls in flight from every worker process, whichever its version or
// language, and checks at every arrival that they are no more than the
// fleet-wide limit: the capacity, and the highest limit that admitted one
// of the calls in flight (the X-Limit header the worker programs send: the
// limit of their permit). That is a bound the cap must keep at every
// moment: the call admitted last among those in flight was admitted while
// all the others held their leases, so there were at most that many under
// its limit, whichever version's script counted them. It answers 503 while
// down.
type Dependency struct {
	capacity int64
	hold     time.Duration
	down     atomic.Bool
	srv      *httptest.Server

	mu         sync.Mutex
	inFlight   int64
	limits     map[int64]int // the limits of the calls in flight
	peak       int64
	calls      map[string]int64 // by worker
	total      int64
	violations []string
}

// StartDependency starts the dependency on loopback: each call takes hold.
func StartDependency(t testing.TB, capacity int64, hold time.Duration) *Dependency {
	d := &Dependency{capacity: capacity, hold: hold, limits: map[int64]int{}, calls: map[string]int64{}}
	d.srv = httptest.NewServer(d)
	t.Cleanup(d.srv.Close)
	return d
}

// URL is where the workers call it.
func (d *Dependency) URL() string { return d.srv.URL }

// SetDown makes every call fail (503) or succeed.
func (d *Dependency) SetDown(down bool) { d.down.Store(down) }

func (d *Dependency) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	worker := r.Header.Get("X-Worker")
	limit, err := strconv.ParseInt(r.Header.Get("X-Limit"), 10, 64)
	if err != nil {
		limit = -1
	}
	d.arrive(worker, limit)
	time.Sleep(d.hold)
	d.leave(limit)
	if d.down.Load() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	_, _ = io.WriteString(w, "ok")
}

func (d *Dependency) arrive(worker string, limit int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.inFlight++
	d.limits[limit]++
	d.calls[worker]++
	d.total++
	d.peak = max(d.peak, d.inFlight)
	var highest int64 = -1
	for l := range d.limits {
		highest = max(highest, l)
	}
	switch {
	case limit <= 0:
		d.violate("%s: a call of %s arrived with limit %d", time.Now().Format("15:04:05.000"), worker, limit)
	case d.inFlight > d.capacity:
		d.violate("%s: %d calls in flight, above the capacity %d (the last of %s)", time.Now().Format("15:04:05.000"), d.inFlight, d.capacity, worker)
	case d.inFlight > highest:
		d.violate("%s: %d calls in flight, above every limit that admitted them (the highest %d; the last of %s at limit %d)",
			time.Now().Format("15:04:05.000"), d.inFlight, highest, worker, limit)
	}
}

func (d *Dependency) violate(format string, args ...any) {
	if len(d.violations) < 20 {
		d.violations = append(d.violations, fmt.Sprintf(format, args...))
	}
}

func (d *Dependency) leave(limit int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.inFlight--
	if d.limits[limit]--; d.limits[limit] == 0 {
		delete(d.limits, limit)
	}
}

// Violations are the first arrivals that broke the cap (at most 20).
func (d *Dependency) Violations() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.violations...)
}

// Peak is the most calls that were in flight at once.
func (d *Dependency) Peak() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.peak
}

// Calls is the number of calls worker made; Total every worker's.
func (d *Dependency) Calls(worker string) int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.calls[worker]
}

// Total is the number of calls every worker made.
func (d *Dependency) Total() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.total
}
