package replay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// Config is one replay: the dependency, the traffic, the outage and the
// worker fleet.
type Config struct {
	Dependency DependencyConfig
	// ArrivalRate is the steady rate of new jobs per second.
	ArrivalRate float64
	// Warm is the normal operation before the outage; Outage how long the
	// dependency is blocked; MaxRecovery how long the replay waits after the
	// recovery for the backlog to drain.
	Warm, Outage, MaxRecovery time.Duration

	// DeadlineShare of jobs expire Deadline after they are created.
	DeadlineShare float64
	Deadline      time.Duration
	// SupersedeShare of jobs carry one of Keys keys with increasing versions.
	SupersedeShare float64
	Keys           int

	// Workers: replicas of SlotsPerReplica workers each, scaled on queue
	// depth (JobsPerReplica waiting jobs per replica) between the
	// ScaledObject's min and max, every ScaleInterval, as KEDA does.
	SlotsPerReplica            int
	MinReplicas, MaxReplicas   int
	JobsPerReplica             int
	ScaleInterval, SampleEvery time.Duration

	// NaiveRetryDelay is how soon the unprotected fleet retries a failure.
	NaiveRetryDelay time.Duration

	// Capacity and Ramp are the policy's, for the predicted drain time.
	Capacity int64
	Ramp     ramp.Schedule

	Seed uint64
}

// Fleet connects the replay to the control plane.
type Fleet struct {
	// Guard is the worker library; nil runs the fleet without Spillway.
	Guard *guard.Guard
	// Bounds reads the ScaledObject's min and max replicas, which the
	// controller bounds and pins; nil uses the Config's.
	Bounds func(ctx context.Context) (minReplicas, maxReplicas int, err error)
	// Scale writes the workload's replicas (the Deployment's scale), as the
	// autoscaler does; nil writes nothing.
	Scale func(ctx context.Context, replicas int) error
	// Status reads the breaker state and limit the controller published;
	// nil reports none.
	Status func(ctx context.Context) (state string, limit int64)
}

// Sample is the replay's state at one instant.
type Sample struct {
	At           time.Duration
	Phase        string
	Backlog      int64
	Queue        int
	InFlight     int64
	Capacity     int
	ServedPerSec float64
	FailedPerSec float64
	Replicas     int
	MinReplicas  int
	MaxReplicas  int
	State        string
	Limit        int64
}

// Result is what a replay measured.
type Result struct {
	Protected bool
	// SecondOutages counts collapses of the dependency after it recovered.
	SecondOutages int
	// PeakInFlight is the most calls the dependency saw at once after it
	// recovered; OverLimit the calls that arrived while more were in flight
	// than the highest limit that admitted any of them.
	PeakInFlight int64
	OverLimit    int64
	// Backlog is the number of jobs pending at the recovery.
	Backlog int64
	// DrainSeconds is the time from the recovery until every backlog job
	// ended; -1 if it did not within MaxRecovery.
	DrainSeconds float64
	// AdmittedAfter is when, after the recovery, the first call succeeded.
	AdmittedAfter float64
	// PredictedDrainSeconds is AdmittedAfter + (useful backlog + what the
	// ramp withholds) / (throughput at the cap − new arrivals).
	PredictedDrainSeconds float64

	Created, Completed, Stale, Superseded, Parked, Pending, Lost int64
	Calls                                                        int64
	Samples                                                      []Sample
}

// Run replays the outage and reports what happened. observe, if not nil, is
// called with every sample as it is taken.
func Run(ctx context.Context, cfg Config, fleet Fleet, observe func(Sample)) (Result, error) {
	if cfg.ArrivalRate <= 0 || cfg.SlotsPerReplica < 1 || cfg.MaxReplicas < 1 || cfg.JobsPerReplica < 1 {
		return Result{}, errors.New("arrival rate, slots per replica, max replicas and jobs per replica must be positive")
	}
	dep, err := StartDependency(cfg.Dependency)
	if err != nil {
		return Result{}, err
	}
	defer func() { _ = dep.Close() }()

	r := &run{cfg: cfg, fleet: fleet, dep: dep, start: time.Now(), observe: observe}
	r.rnd = rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x5eed))
	client := &http.Client{Transport: &guard.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 256}}, Timeout: 10 * time.Second}
	workCtx, stopWork := context.WithCancel(ctx)
	r.pool = newPool(workCtx, func() *worker {
		return &worker{queue: &r.queue, ledger: &r.ledger, guard: fleet.Guard, client: client, url: dep.URL(), naiveWait: cfg.NaiveRetryDelay}
	})
	r.pool.scale(cfg.MinReplicas * cfg.SlotsPerReplica)

	var bg sync.WaitGroup
	arrivalsCtx, stopArrivals := context.WithCancel(workCtx)
	bg.Go(func() { r.arrive(arrivalsCtx) })
	bg.Go(func() { r.autoscale(workCtx) })
	bg.Go(func() { r.sample(workCtx) })

	res, err := r.timeline(ctx)
	stopArrivals()
	stopWork()
	r.pool.stop()
	bg.Wait()
	r.finish(&res)
	return res, err
}

type run struct {
	cfg     Config
	fleet   Fleet
	dep     *Dependency
	start   time.Time
	observe func(Sample)
	queue   Queue
	ledger  ledger
	pool    *pool

	rndMu    sync.Mutex
	rnd      *rand.Rand
	nextID   atomic.Int64
	versions sync.Map // key -> *atomic.Int64

	phase    atomic.Value // string
	replicas atomic.Int64

	boundsMu   sync.Mutex
	lastBounds *[2]int // the autoscaler's last bounds read

	samplesMu sync.Mutex
	samples   []Sample
}

// timeline: warm, outage, recovery until the backlog drains.
func (r *run) timeline(ctx context.Context) (Result, error) {
	res := Result{Protected: r.fleet.Guard != nil, DrainSeconds: -1}
	r.phase.Store("warm")
	if !sleep(ctx, r.cfg.Warm) {
		return res, ctx.Err()
	}
	r.phase.Store("outage")
	r.dep.Block()
	if !sleep(ctx, r.cfg.Outage) {
		return res, ctx.Err()
	}
	r.dep.Unblock()
	r.ledger.recovered.Store(true)
	recovered := time.Now()
	r.phase.Store("recovery")
	res.Backlog = r.ledger.backlog.Load()
	r.dep.ResetPeak()
	served := r.dep.Stats().Served

	deadline := recovered.Add(r.cfg.MaxRecovery)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-tick.C:
		}
		if res.AdmittedAfter == 0 && r.dep.Stats().Served > served {
			res.AdmittedAfter = time.Since(recovered).Seconds()
		}
		if r.ledger.backlog.Load() == 0 {
			res.DrainSeconds = time.Since(recovered).Seconds()
			break
		}
	}
	if res.DrainSeconds >= 0 {
		r.phase.Store("drained")
	}
	// Let the fleet run at steady state a moment longer, to see that the
	// dependency stays up.
	sleep(ctx, time.Second)
	return res, nil
}

func (r *run) finish(res *Result) {
	st := r.dep.Stats()
	res.SecondOutages = st.Collapses
	res.PeakInFlight = st.Peak
	res.OverLimit = st.OverLimit
	l := &r.ledger
	res.Created, res.Completed, res.Stale, res.Superseded = l.created.Load(), l.completed.Load(), l.stale.Load(), l.superseded.Load()
	res.Parked, res.Calls = l.parked.Load(), l.calls.Load()
	res.Pending = int64(r.queue.Len())
	res.Lost = res.Created - res.Completed - res.Stale - res.Superseded - res.Pending
	res.PredictedDrainSeconds = r.predict(res)
	r.samplesMu.Lock()
	res.Samples = r.samples
	r.samplesMu.Unlock()
}

// predict is the seeds' backlog / (cap − new arrivals), with the backlog in
// calls at the dependency's throughput, climbing the ramp's steps one per
// stepDuration from the moment admission resumed (ramp.Schedule.Drain, the
// forecast the simulator makes too).
func (r *run) predict(res *Result) float64 {
	d := r.cfg.Dependency.ServiceTime.Seconds()
	if res.DrainSeconds < 0 {
		return math.Inf(1)
	}
	useful := float64(r.ledger.backlogDone.Load())
	drain, ok := r.cfg.Ramp.Drain(useful, r.cfg.ArrivalRate, false, r.cfg.Capacity, func(limit int64) float64 { return float64(limit) / d })
	if !ok {
		return math.Inf(1)
	}
	return res.AdmittedAfter + drain
}

// arrive creates jobs at the steady rate, some with deadlines, some with
// versions that supersede older ones.
func (r *run) arrive(ctx context.Context) {
	interval := time.Duration(float64(time.Second) / r.cfg.ArrivalRate)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.queue.Push(r.newJob(ctx), time.Now())
	}
}

func (r *run) newJob(ctx context.Context) *Job {
	r.rndMu.Lock()
	deadline, supersede, key := r.rnd.Float64(), r.rnd.Float64(), r.rnd.IntN(max(r.cfg.Keys, 1))
	r.rndMu.Unlock()
	now := time.Now()
	j := &Job{ID: r.nextID.Add(1), Attempt: 1, Created: now}
	if deadline < r.cfg.DeadlineShare {
		j.Deadline = now.Add(r.cfg.Deadline)
	} else if supersede < r.cfg.SupersedeShare/(1-r.cfg.DeadlineShare) {
		j.Key = "item-" + strconv.Itoa(key)
		v, _ := r.versions.LoadOrStore(j.Key, new(atomic.Int64))
		j.Version = v.(*atomic.Int64).Add(1)
		if r.fleet.Guard != nil {
			// The producer announces the new version, so queued older
			// versions are dropped before they call the dependency.
			_ = r.fleet.Guard.Supersede(ctx, j.Key, j.Version)
		}
	}
	r.ledger.add(j)
	return j
}

// autoscale sizes the fleet on queue depth within the ScaledObject's bounds.
func (r *run) autoscale(ctx context.Context) {
	t := time.NewTicker(r.cfg.ScaleInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		lo, hi, _ := r.bounds(ctx)
		want := int(math.Ceil(float64(r.queue.Len()) / float64(r.cfg.JobsPerReplica)))
		want = min(max(want, lo), hi)
		r.replicas.Store(int64(want))
		r.pool.scale(want * r.cfg.SlotsPerReplica)
		if r.fleet.Scale != nil {
			_ = r.fleet.Scale(ctx, want)
		}
	}
}

// bounds reads the autoscaler's min and max replicas. ok is false when the
// read failed (the API server slow, or the run stopping under it): lo and hi
// are then the last bounds read, or the Config's before the first, as an
// autoscaler keeps acting on the last spec it saw. A sample does not record
// them.
func (r *run) bounds(ctx context.Context) (lo, hi int, ok bool) {
	if r.fleet.Bounds == nil {
		return r.cfg.MinReplicas, r.cfg.MaxReplicas, true
	}
	lo, hi, err := r.fleet.Bounds(ctx)
	r.boundsMu.Lock()
	defer r.boundsMu.Unlock()
	if err != nil {
		if r.lastBounds == nil {
			return r.cfg.MinReplicas, r.cfg.MaxReplicas, false
		}
		return r.lastBounds[0], r.lastBounds[1], false
	}
	r.lastBounds = &[2]int{lo, hi}
	return lo, hi, true
}

// sample records the replay's state every SampleEvery.
func (r *run) sample(ctx context.Context) {
	t := time.NewTicker(r.cfg.SampleEvery)
	defer t.Stop()
	prev := r.dep.Stats()
	prevAt := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		st, now := r.dep.Stats(), time.Now()
		secs := now.Sub(prevAt).Seconds()
		s := Sample{
			At:           now.Sub(r.start),
			Phase:        r.phase.Load().(string),
			Backlog:      r.ledger.backlog.Load(),
			Queue:        r.queue.Len(),
			InFlight:     st.InFlight,
			Capacity:     r.dep.Capacity(),
			ServedPerSec: float64(st.Served-prev.Served) / secs,
			FailedPerSec: float64(st.Failed-prev.Failed) / secs,
			Replicas:     int(r.replicas.Load()),
		}
		var ok bool
		if s.MinReplicas, s.MaxReplicas, ok = r.bounds(ctx); !ok {
			continue // the next sample covers this one's interval too
		}
		if r.fleet.Status != nil {
			s.State, s.Limit = r.fleet.Status(ctx)
		}
		prev, prevAt = st, now
		r.samplesMu.Lock()
		r.samples = append(r.samples, s)
		r.samplesMu.Unlock()
		if r.observe != nil {
			r.observe(s)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// String is one line of progress. A fleet without a published state (no
// Spillway) has no breaker and no limit: both show as "-", not as a limit of 0.
func (s Sample) String() string {
	state, limit := s.State, strconv.FormatInt(s.Limit, 10)
	if state == "" {
		state, limit = "-", "-"
	}
	return fmt.Sprintf("%6.1fs %-8s breaker=%-8s limit=%-3s replicas=%d [min %d max %d] backlog=%-5d queue=%-5d dependency %d/%d in flight, %.0f ok/s %.0f failed/s",
		s.At.Seconds(), s.Phase, state, limit, s.Replicas, s.MinReplicas, s.MaxReplicas, s.Backlog, s.Queue, s.InFlight, s.Capacity, s.ServedPerSec, s.FailedPerSec)
}
