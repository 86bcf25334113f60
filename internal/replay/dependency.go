// Package replay replays an outage on loopback with real components: a
// dependency HTTP server with a concurrency capacity that is cold after it
// recovers and collapses under sustained overload, a job queue with a backlog
// and steady arrivals, worker goroutines that call the dependency through the
// worker library, an autoscaler that follows the ScaledObject the controller
// bounds, and the controller itself. test/e2e asserts on it; `spillway demo`
// shows it live.
package replay

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// DependencyConfig is the model of the dependency.
type DependencyConfig struct {
	// Capacity is the number of calls it serves at once when warm.
	Capacity int
	// ServiceTime is how long one call takes within capacity.
	ServiceTime time.Duration
	// ColdFactor scales the capacity for WarmUp after the dependency comes
	// back: its caches are cold.
	ColdFactor float64
	WarmUp     time.Duration
	// CollapseAfter is how long overload (calls beyond the capacity) must go
	// on before the dependency falls over; it then stays down for DownFor.
	CollapseAfter time.Duration
	DownFor       time.Duration
}

// AdmittedLimitHeader carries the limit in force when the worker library
// admitted the call, so the dependency can check it never sees more.
const AdmittedLimitHeader = "X-Spillway-Admitted-Limit"

// Dependency is the modelled dependency, serving HTTP on 127.0.0.1.
type Dependency struct {
	cfg    DependencyConfig
	server *http.Server
	addr   string

	mu          sync.Mutex
	blocked     bool      // the outage the replay injects
	downUntil   time.Time // a collapse
	recoveredAt time.Time // when it last came back, for the cold start
	overSince   time.Time // start of the current overload
	lastOver    time.Time // the last call refused for overload
	collapses   int

	inflight  atomic.Int64
	peak      atomic.Int64
	served    atomic.Int64
	failed    atomic.Int64
	cancelled atomic.Int64 // calls whose caller gave up before they were served
	overLimit atomic.Int64 // calls that arrived while more calls were in flight than any in-flight call's admitted limit

	limitsMu sync.Mutex
	limits   map[int64]int // the admitted limits of the calls in flight, by count
}

// StartDependency starts the dependency on a free loopback port.
func StartDependency(cfg DependencyConfig) (*Dependency, error) {
	if cfg.Capacity < 1 || cfg.ServiceTime <= 0 {
		return nil, errors.New("dependency capacity and service time must be positive")
	}
	if cfg.ColdFactor <= 0 || cfg.ColdFactor > 1 {
		cfg.ColdFactor = 1
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	d := &Dependency{cfg: cfg, addr: ln.Addr().String()}
	d.server = &http.Server{Handler: d, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = d.server.Serve(ln) }()
	return d, nil
}

// URL is the dependency's base URL.
func (d *Dependency) URL() string { return "http://" + d.addr }

// Close stops the server.
func (d *Dependency) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return d.server.Shutdown(ctx)
}

// Block starts the outage: every call fails at once.
func (d *Dependency) Block() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.blocked = true
}

// Unblock ends the outage; the dependency comes back cold.
func (d *Dependency) Unblock() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.blocked = false
	d.recoveredAt = time.Now()
}

// Down reports whether the dependency is failing every call now (blocked or
// collapsed).
func (d *Dependency) Down() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.blocked || time.Now().Before(d.downUntil)
}

// Capacity is the capacity the dependency has now: 0 while down, reduced
// while cold.
func (d *Dependency) Capacity() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.capacityLocked(time.Now())
}

func (d *Dependency) capacityLocked(now time.Time) int {
	if d.blocked || now.Before(d.downUntil) {
		return 0
	}
	if !d.recoveredAt.IsZero() && now.Sub(d.recoveredAt) < d.cfg.WarmUp {
		return max(1, int(float64(d.cfg.Capacity)*d.cfg.ColdFactor))
	}
	return d.cfg.Capacity
}

// DependencyStats are the dependency's counters.
type DependencyStats struct {
	InFlight int64
	Peak     int64
	Served   int64
	Failed   int64
	// Cancelled counts calls whose caller gave up before they were served: not
	// failures of the dependency.
	Cancelled int64
	// Collapses counts the times sustained overload took it down: second
	// outages.
	Collapses int
	// OverLimit counts calls that arrived while more calls were in flight
	// than the highest limit that admitted any of them (see arrive).
	OverLimit int64
}

// Stats returns the counters.
func (d *Dependency) Stats() DependencyStats {
	d.mu.Lock()
	collapses := d.collapses
	d.mu.Unlock()
	return DependencyStats{
		InFlight:  d.inflight.Load(),
		Peak:      d.peak.Load(),
		Served:    d.served.Load(),
		Failed:    d.failed.Load(),
		Cancelled: d.cancelled.Load(),
		Collapses: collapses,
		OverLimit: d.overLimit.Load(),
	}
}

// ResetPeak starts a new peak measurement.
func (d *Dependency) ResetPeak() { d.peak.Store(d.inflight.Load()) }

func (d *Dependency) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := d.inflight.Add(1)
	defer d.inflight.Add(-1)
	storeMax(&d.peak, n)
	if limit, err := strconv.ParseInt(r.Header.Get(AdmittedLimitHeader), 10, 64); err == nil {
		if n > d.arrive(limit) {
			d.overLimit.Add(1)
		}
		defer d.leave(limit)
	}

	if !d.admit(n) {
		d.failed.Add(1)
		http.Error(w, "dependency unavailable", http.StatusServiceUnavailable)
		return
	}
	select {
	case <-time.After(d.cfg.ServiceTime):
	case <-r.Context().Done():
		d.cancelled.Add(1)
		return
	}
	d.served.Add(1)
	w.WriteHeader(http.StatusOK)
}

// arrive records the admitted limit of a call that arrived and returns the
// highest limit among the calls in flight, itself included. The scripts admit
// a call only while fewer leases than the limit are held, so the calls in
// flight never outnumber the highest limit that admitted one of them. A call
// admitted under a lower limit may arrive after the limit rose and calls
// admitted under the new one arrived (the ramp stepped up meanwhile): that is
// not over the limit in force.
func (d *Dependency) arrive(limit int64) int64 {
	d.limitsMu.Lock()
	defer d.limitsMu.Unlock()
	if d.limits == nil {
		d.limits = map[int64]int{}
	}
	d.limits[limit]++
	highest := limit
	for l := range d.limits {
		highest = max(highest, l)
	}
	return highest
}

// leave forgets the admitted limit of a call that ended.
func (d *Dependency) leave(limit int64) {
	d.limitsMu.Lock()
	defer d.limitsMu.Unlock()
	if d.limits[limit]--; d.limits[limit] <= 0 {
		delete(d.limits, limit)
	}
}

// admit decides whether a call with n in flight (itself included) is served.
// Calls beyond the capacity fail. Overload that goes on for CollapseAfter
// (refusals with no quiet gap longer than a quarter of it) takes the
// dependency down for DownFor: the metastable failure.
func (d *Dependency) admit(n int64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	capacity := d.capacityLocked(now)
	if capacity == 0 {
		return false
	}
	if n <= int64(capacity) {
		return true
	}
	if d.lastOver.IsZero() || now.Sub(d.lastOver) > d.cfg.CollapseAfter/4 {
		d.overSince = now
	}
	d.lastOver = now
	if now.Sub(d.overSince) >= d.cfg.CollapseAfter {
		d.collapses++
		d.downUntil = now.Add(d.cfg.DownFor)
		d.recoveredAt = d.downUntil
		d.lastOver = time.Time{}
	}
	return false
}

func storeMax(v *atomic.Int64, n int64) {
	for {
		cur := v.Load()
		if n <= cur || v.CompareAndSwap(cur, n) {
			return
		}
	}
}
