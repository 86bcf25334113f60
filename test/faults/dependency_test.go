package faults

import (
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// dependency is the service every worker process calls, on loopback, and
// the job queue they take their work from. It is where the campaign checks
// the cap: it counts the calls in flight across every process and language
// itself, with no help from Spillway's counters.
//
// GET /job hands out a job id (a new one, or one handed out before and not
// done within visibility: a queue with late acknowledgement, as Celery's
// acks_late or SQS). GET /call?job=N is the call a worker guards: it holds
// the call for a random time between minHold and maxHold and answers 200,
// which marks the job done, or 503 while the dependency is failing.
type dependency struct {
	cap        int64
	visibility time.Duration

	mu               sync.Mutex
	minHold, maxHold time.Duration
	failing          bool
	inFlight         int64
	overSince        time.Time // when inFlight went above cap; zero while at or below
	ph               *phase    // the phase the calls are attributed to
	watchFrom        time.Time // the first arrival at cap after watchFrom is recorded in watchHit
	watchHit         time.Time
	lastArrival      time.Time
	calls            int64

	nextJob     int64
	outstanding map[int64]time.Time // handed out, not done: visible again at
	done        map[int64]bool
	draining    bool // hand out no new job, only the ones visible again
}

func newDependency(limit int64, visibility time.Duration) *dependency {
	return &dependency{
		cap: limit, visibility: visibility,
		minHold: 20 * time.Millisecond, maxHold: 200 * time.Millisecond,
		outstanding: map[int64]time.Time{}, done: map[int64]bool{},
	}
}

// phase is one fault, from its injection to the end of its checks: what the
// dependency saw meanwhile.
type phase struct {
	name  string
	peak  int64
	over  time.Duration // time spent with more calls in flight than the cap
	calls int64
}

func (d *dependency) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/job":
		d.serveJob(w)
	case "/call":
		d.serveCall(w, r)
	default:
		http.NotFound(w, r)
	}
}

func (d *dependency) serveJob(w http.ResponseWriter) {
	now := time.Now()
	d.mu.Lock()
	id := int64(-1)
	for j, visible := range d.outstanding {
		if now.After(visible) {
			id = j
			break
		}
	}
	if id < 0 && !d.draining {
		d.nextJob++
		id = d.nextJob
	}
	if id >= 0 {
		d.outstanding[id] = now.Add(d.visibility)
	}
	d.mu.Unlock()
	if id < 0 {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	_ = json.NewEncoder(w).Encode(map[string]int64{"id": id})
}

func (d *dependency) serveCall(w http.ResponseWriter, r *http.Request) {
	job, _ := strconv.ParseInt(r.URL.Query().Get("job"), 10, 64)
	now := time.Now()
	d.mu.Lock()
	d.inFlight++
	d.calls++
	d.lastArrival = now
	n := d.inFlight
	if ph := d.ph; ph != nil {
		ph.peak = max(ph.peak, n)
		ph.calls++
	}
	if n > d.cap && d.overSince.IsZero() {
		d.overSince = now
	}
	if n >= d.cap && d.watchHit.IsZero() && !d.watchFrom.IsZero() && now.After(d.watchFrom) {
		d.watchHit = now
	}
	hold := d.minHold
	if d.maxHold > d.minHold {
		hold += rand.N(d.maxHold - d.minHold)
	}
	d.mu.Unlock()

	// A caller that goes away (its guard cancelled the call) ends the call:
	// the dependency counts connections with a request outstanding.
	select {
	case <-time.After(hold):
	case <-r.Context().Done():
	}

	gone := r.Context().Err() != nil
	d.mu.Lock()
	failing := d.failing
	if d.inFlight == d.cap+1 && !d.overSince.IsZero() {
		if d.ph != nil {
			d.ph.over += time.Since(d.overSince)
		}
		d.overSince = time.Time{}
	}
	d.inFlight--
	if !failing && !gone {
		delete(d.outstanding, job)
		d.done[job] = true
	}
	d.mu.Unlock()
	if failing {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// begin attributes what the dependency sees from now on to a new phase.
func (d *dependency) begin(name string) *phase {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closeOver()
	d.ph = &phase{name: name, peak: d.inFlight}
	return d.ph
}

// closeOver books the time over the cap so far to the current phase.
// d.mu must be held.
func (d *dependency) closeOver() {
	if !d.overSince.IsZero() {
		now := time.Now()
		if d.ph != nil {
			d.ph.over += now.Sub(d.overSince)
		}
		d.overSince = now
	}
}

// snapshot is the current phase's figures so far.
func (d *dependency) snapshot() phase {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closeOver()
	if d.ph == nil {
		return phase{}
	}
	return *d.ph
}

// watch starts looking for the first arrival that finds the fleet at its
// cap; reached returns when it happened, zero until then.
func (d *dependency) watch() {
	d.mu.Lock()
	d.watchFrom, d.watchHit = time.Now(), time.Time{}
	d.mu.Unlock()
}

func (d *dependency) reached() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.watchHit
}

func (d *dependency) setFailing(v bool) {
	d.mu.Lock()
	d.failing = v
	d.mu.Unlock()
}

func (d *dependency) setHold(lo, hi time.Duration) {
	d.mu.Lock()
	d.minHold, d.maxHold = lo, hi
	d.mu.Unlock()
}

func (d *dependency) setDraining(v bool) {
	d.mu.Lock()
	d.draining = v
	d.mu.Unlock()
}

// pending is the number of jobs handed out and not done.
func (d *dependency) pending() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.outstanding)
}

func (d *dependency) now() (inFlight int64, last time.Time, calls int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.inFlight, d.lastArrival, d.calls
}

// jobs is the number of jobs handed out and done.
func (d *dependency) jobs() (issued int64, done int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.nextJob, len(d.done)
}
