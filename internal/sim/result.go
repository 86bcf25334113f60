package sim

import (
	"math"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
)

// Result is one policy's outcome. The JSON names are those of
// `spillway simulate --json`; the other fields are for the table and for
// programs.
type Result struct {
	// Policy is the policy's name.
	Policy Policy `json:"name"`
	// PeakOverCapacity is the highest load on the dependency in any one
	// second, divided by its warm capacity Concurrency × 1 s. The load of a
	// second is the slot-time that calls wanted in it: the time its slots
	// spent serving calls, plus CallDuration from the start of every call
	// it turned away (for lack of a slot, cold or down), split over the
	// seconds that span covers. It is the average over the second of the
	// number of calls that wanted a slot, over Concurrency: at most 1 while
	// no more than Concurrency calls want a slot at once, whatever the call
	// time; above 1 the fleet offered more than the dependency can serve
	// even when warm. Unlike the collapse rule it counts while the
	// dependency is down, against its warm concurrency.
	PeakOverCapacity float64 `json:"peak_over_capacity"`
	// SecondOutages counts the collapses after the recovery.
	SecondOutages int `json:"second_outages"`
	// DrainSeconds is the time from recovery until the pending jobs are
	// back to the steady-state level; nil if that never happened before
	// the horizon.
	DrainSeconds *float64 `json:"drain_seconds"`
	// PredictedDrainSeconds is the forecast of DrainSeconds (see
	// Prediction); nil when the throughput does not exceed the arrivals.
	PredictedDrainSeconds *float64 `json:"predicted_drain_seconds"`
	// Completed counts the jobs whose call succeeded.
	Completed int64 `json:"completed"`
	// Stale counts the jobs dropped, before any call, past their deadline.
	Stale int64 `json:"stale"`
	// Superseded counts the jobs dropped, before any call, because a newer
	// job for the same key arrived.
	Superseded int64 `json:"superseded"`
	// Parked counts the jobs parked over the retry budget at least once.
	Parked int64 `json:"parked"`
	// Lost counts jobs that vanished: generated but neither completed,
	// dropped, given up nor found pending at the horizon. Always 0 unless
	// the simulator is broken.
	Lost int64 `json:"lost"`
	// Calls counts every call made to the dependency before the horizon:
	// the sum of Series.Calls.
	Calls int64 `json:"calls"`
	// Amplification is Calls / Jobs.
	Amplification float64 `json:"amplification"`

	// Jobs counts the jobs generated.
	Jobs int64 `json:"-"`
	// GaveUp counts the jobs abandoned after MaxAttempts failed calls.
	GaveUp int64 `json:"-"`
	// Trips counts the in-path trips: the workers' failures opened the
	// breaker between two of the controller's evaluations (control.Trip).
	Trips int64 `json:"-"`
	// Pending counts the jobs still queued, waiting to retry or in flight
	// at the horizon.
	Pending int64 `json:"-"`
	// DownAfterRecovery is the total time the dependency spent down after
	// the recovery, in collapses.
	DownAfterRecovery time.Duration `json:"-"`
	// Recovery is the backlog at the instant of recovery.
	Recovery Backlog `json:"-"`
	// PeakReplicas is the most worker pods at once.
	PeakReplicas int `json:"-"`
	// Prediction holds the inputs of PredictedDrainSeconds.
	Prediction Prediction `json:"-"`
	// Series is the per-second time series, for plots.
	Series Series `json:"-"`
}

// Backlog is the pending work at recovery, split the way the seed splits
// it: past deadline, superseded by a newer job for the same key, and still
// useful (a job past its deadline counts only as such).
type Backlog struct {
	Pending, PastDeadline, Superseded, Useful int64
}

// Series is a per-second time series of one run; element i covers virtual
// second [i, i+1), the last one ending at the horizon (partial when the
// horizon is not a whole second). The run covers [0, horizon): a call that
// would start at the horizon is not made.
type Series struct {
	// Calls is the number of calls started at the dependency.
	Calls []int32
	// Capacity is the dependency's effective throughput in calls per
	// second: 0 while down, reduced while cold.
	Capacity []float64
}

// Prediction is the drain-time forecast of the seed, "backlog /
// (throughput at the cap − new arrivals)", extended with what the breaker
// and the ramp hold back: Shut, then the ramp's climb step by step
// (ramp.Schedule.Drain, a fluid model in which the backlog can drain before
// the last step), or no climb at all when the breaker closed within
// ramp.warmFor. When the backlog outlasts the climb it is
//
//	Seconds = Shut + (Backlog + Arrivals×Shut + Withheld) / (Throughput − Arrivals)
type Prediction struct {
	// Backlog is the jobs pending at recovery; for a policy that drops
	// stale and superseded jobs, only those still useful at recovery.
	Backlog float64
	// Arrivals is the rate of new jobs per second.
	Arrivals float64
	// Throughput is calls per second at the cap: the policy's
	// capacity.concurrency (or the dependency's concurrency for an uncapped
	// policy) over the call duration, or capacity.ratePerSecond when lower.
	Throughput float64
	// Withheld is the calls the ramp holds back while it climbs:
	// ramp.Schedule.Withheld(capacity) / CallDuration, or with a
	// ratePerSecond the sum over the steps but the last of (Throughput −
	// min(step/CallDuration, ratePerSecond)) × stepDuration; 0 without a
	// ramp.
	Withheld float64
	// Shut is the seconds from recovery until the breaker first closes; 0
	// without a breaker.
	Shut float64
	// Seconds is the forecast; nil when Throughput <= Arrivals or the
	// breaker never closed.
	Seconds *float64
	// AtLeast says that Seconds is a lower bound: after the breaker closed,
	// the ramp stepped back or the breaker reopened, so the dependency
	// served less than the policy's capacity (a cold start the policy does
	// not know about) for a time the forecast cannot know. Seconds assumes
	// it served its capacity from the step where the ramp failed on.
	AtLeast bool `json:"at_least,omitempty"`
	// From, when set, makes the forecast the range [From, Seconds]: with
	// ramp.earlyClimb a step its calls prove clean climbs before its
	// stepDuration, so the drain lies between that of no climb (From) and
	// that of the whole schedule (Seconds).
	From *float64 `json:"from,omitempty"`
}

// predict fills in the forecast for the run.
func (e *engine) predict() Prediction {
	pr := Prediction{
		Backlog:  float64(e.recovery.Pending),
		Arrivals: e.rate,
	}
	if e.mech.dropUseless {
		pr.Backlog = float64(e.recovery.Useful)
	}
	concurrency := int64(e.sc.Dependency.Concurrency)
	if e.mech.capped {
		concurrency = e.params.Capacity
	}
	pr.Throughput = float64(concurrency) / e.callDur.Seconds()
	if e.mech.capped && e.params.RatePerSecond > 0 {
		pr.Throughput = min(pr.Throughput, float64(e.params.RatePerSecond))
	}
	if e.ctl != nil {
		pr.Withheld = e.withheld(pr.Throughput)
		if e.closedAfterT1 < 0 {
			return pr
		}
		pr.Shut = (e.closedAfterT1 - e.t1).Seconds()
	}
	if pr.Throughput <= pr.Arrivals {
		return pr
	}
	sched := e.params.Ramp
	skip := e.ctl == nil || e.skippedRamp
	if skip {
		pr.Withheld = 0
	}
	rate := func(limit int64) float64 {
		r := float64(limit) / e.callDur.Seconds()
		if e.mech.capped && e.params.RatePerSecond > 0 {
			r = min(r, float64(e.params.RatePerSecond))
		}
		return r
	}
	drain, ok := sched.Drain(pr.Backlog+pr.Arrivals*pr.Shut, pr.Arrivals, skip, concurrency, rate)
	if !ok {
		return pr
	}
	pr.Seconds = ptr(round(pr.Shut+drain, 1))
	pr.AtLeast = e.rampFailed
	if !skip && sched.EarlyClimb {
		// A step proven clean climbs early: anywhere from no climb at all
		// to the whole schedule, or, once the ramp failed, at least no
		// climb at all.
		low, _ := sched.Drain(pr.Backlog+pr.Arrivals*pr.Shut, pr.Arrivals, true, concurrency, rate)
		if pr.AtLeast {
			pr.Seconds = ptr(round(pr.Shut+low, 1))
		} else {
			pr.From = ptr(round(pr.Shut+low, 1))
		}
	}
	return pr
}

// withheld is the calls the ramp holds back while it climbs, below the
// throughput at the cap. Without a rate limit it is the shipped
// ramp.Schedule.Withheld(capacity) divided by the call duration; with one,
// each step's rate is min(step/CallDuration, ratePerSecond), so the steps
// above the rate limit withhold nothing.
func (e *engine) withheld(throughput float64) float64 {
	s := e.callDur.Seconds()
	if e.params.RatePerSecond == 0 {
		return e.params.Ramp.Withheld(e.params.Capacity) / s
	}
	steps := e.params.Ramp.Steps
	var total float64
	for i := 0; i+1 < len(steps); i++ {
		rate := min(float64(steps[i])/s, float64(e.params.RatePerSecond))
		total += (throughput - rate) * e.params.Ramp.StepDuration.Seconds()
	}
	return total
}

// result collects the run's metrics.
func (e *engine) result(p Policy) Result {
	jobs := int64(e.jobs.len())
	found := e.pendingFound()
	s := e.stats
	r := Result{
		Policy:            p,
		PeakOverCapacity:  round(float64(s.peakLoad)/float64(time.Duration(e.sc.Dependency.Concurrency)*time.Second), 3),
		SecondOutages:     s.secondOutages,
		Completed:         s.completed,
		Stale:             s.stale,
		Superseded:        s.superseded,
		Parked:            s.parked,
		Lost:              jobs - s.completed - s.stale - s.superseded - s.gaveUp - found,
		Calls:             e.counters.calls,
		Jobs:              jobs,
		GaveUp:            s.gaveUp,
		Trips:             s.trips,
		Pending:           found,
		DownAfterRecovery: s.downAfterRecovery,
		PeakReplicas:      e.workers.peak,
		Recovery:          e.recovery,
		Prediction:        e.predict(),
		Series:            Series{Calls: s.calls, Capacity: s.capacity},
	}
	if jobs > 0 {
		r.Amplification = round(float64(r.Calls)/float64(jobs), 3)
	}
	if e.drain.drainedAt >= 0 {
		r.DrainSeconds = ptr(round((e.drain.drainedAt - e.t1).Seconds(), 1))
	}
	r.PredictedDrainSeconds = r.Prediction.Seconds
	return r
}

// simulate runs one policy on a defaulted, valid scenario, with buffers
// from pool, to which it returns them.
func simulate(sc *Scenario, params policy.Params, p Policy, pool *bufferPool) Result {
	e := newEngine(sc, params, p, pool.get())
	e.run()
	r := e.result(p)
	pool.put(e.release())
	return r
}

func round(v float64, digits int) float64 {
	scale := math.Pow(10, float64(digits))
	return math.Round(v*scale) / scale
}

func ptr[T any](v T) *T { return &v }
