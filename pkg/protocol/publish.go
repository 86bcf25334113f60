package protocol

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Published is what the controller writes for a dependency: what workers
// enforce, and the controller's own breaker and ramp state, kept in Redis so
// that it survives a manager restart.
type Published struct {
	State wire.State
	// Limit is the fleet-wide concurrency limit in force.
	Limit int64
	// Capacity is capacity.concurrency.
	Capacity int64
	// RatePerSecond is the fleet-wide rate limit; 0 means none.
	RatePerSecond int64
	// Epoch increases by one at every state transition.
	Epoch int64
	// OpenUntil is when an Open breaker lets probes through.
	OpenUntil time.Time

	Backoff       retry.Backoff
	Budget        retry.Budget
	BreakerWindow time.Duration

	// BreakerSince is when the breaker entered its state.
	BreakerSince time.Time
	// RampStep and RampStepStarted are the ramp's position.
	RampStep        int
	RampStepStarted time.Time
	// RampLimit, RampCeiling, RampBackoffs and RampSettling are what the
	// ramp's step-back rule remembers: the limit below the first step that
	// a step back reached (0: none), the lowest limit that failed and was
	// not held clean since (0: none), the step backs since that ceiling was
	// last cleared, and whether the current step was entered by a step back.
	// Workers do not read them.
	RampLimit    int64
	RampCeiling  int64
	RampBackoffs int
	RampSettling bool

	// HalfOpenProbes is the policy's breaker.halfOpenProbes: how many calls
	// workers admit at a time under the dead-man rule (StaleAfter).
	HalfOpenProbes int64
	// StaleAfter is the dead-man bound: when no controller has published for
	// StaleAfter since UpdatedAt, workers treat an Open state as HalfOpen
	// with at most HalfOpenProbes calls in flight, until a controller
	// publishes again; Ramping and Closed keep their limit. 0 turns the rule
	// off. It is stored in whole milliseconds.
	StaleAfter time.Duration

	// Seq fences publications: ReadPublished returns the sequence number
	// stored with the state, and Publish(p) stores p.Seq+1, refused with
	// ErrStaleSequence when Redis already holds a sequence above p.Seq, that
	// is when anyone published after the state p was planned from was read.
	// A zero Seq is not fenced: Publish stores the stored sequence plus one
	// (a first publication, or a tool that read nothing).
	Seq int64

	// OutageSince is when the breaker last opened from Closed or Ramping:
	// the start of the outage it is in, kept through Open and HalfOpen, for
	// the ramp's warmFor. Workers do not read it.
	OutageSince time.Time
	// SuccessLatency is the dependency's mean success latency as the workers
	// last reported it (Window.MeanSuccessLatency), kept between windows
	// that time too few successes; 0 is unknown. The controller bounds the
	// call rate of a ramp step with it (control.RateBound). Workers do not
	// read it.
	SuccessLatency time.Duration

	// Trip is what the workers' release needs to trip the breaker in the
	// fleet's path (release.lua, lib.lua trip): whether it may, the
	// breaker's rule and where its window starts. The controller's plan
	// computes it (control.Plan).
	Trip Trip
	// TrippedAt is when workers last tripped the breaker in the fleet's
	// path (Redis time), zero if never; read only. A TrippedAt after
	// Trip.Acknowledged is a trip the controller has not taken over yet.
	TrippedAt time.Time
	// TrippedFrom is the state that trip replaced with Open: Closed or
	// Ramping; read only.
	TrippedFrom wire.State
	// TripCount counts the trips workers of version 5 or later made
	// (trip_count); read only. A TripCount above Trip.AcknowledgedCount is
	// a trip the controller has not taken over yet, whatever the clocks
	// said (a failover to a replica whose clock is behind).
	TripCount int64
	// TrippedLimit and TrippedEpoch are the limit the last trip replaced
	// and the epoch it kept (version 5 and later), which end a trip that no
	// controller takes over (docs/protocol.md §4); read only.
	TrippedLimit int64
	TrippedEpoch int64

	// Restored says the manager publishes over a state it had published
	// before and Redis no longer holds: Redis lost its data. When Redis
	// indeed holds no state, the dependency then learns for LearnFor
	// before anything new is admitted (docs/protocol.md §4 "Learning").
	// Write only.
	Restored bool
	// LearningUntil is when the dependency stops learning (lib.lua
	// learning), zero if it never did; read only.
	LearningUntil time.Time

	// ManagerVersion is the protocol version of the manager that last
	// published; 0 when unknown (a manager of version 4, which does not
	// write it); read only.
	ManagerVersion int

	// UpdatedAt is when Redis stored this state (Redis time); read only.
	UpdatedAt time.Time
}

// Trip is the in-path trip's part of a publication: the breaker's rule
// (breaker.Config.Trips) as release.lua applies it to the counts the
// controller's window read would see, and the fence that keeps a plan made
// before a trip from undoing it.
type Trip struct {
	// On lets a failure or timeout reported through release trip the
	// breaker: only while the published state is Closed or Ramping, and
	// the controller's decision is the breaker's rule alone.
	On bool
	// FailureRatio and MinCalls are the breaker's failureRatio and
	// minCalls. The ratio is written as the shortest decimal that parses
	// back to the same float64, which Lua's tonumber reads to that float64
	// too.
	FailureRatio float64
	MinCalls     int64
	// Since is where the window starts: only the seconds after Since's
	// second count (the from the evaluator passes ReadWindow), and at most
	// BreakerWindow of them.
	Since time.Time
	// OpenDuration is the breaker's openDuration: a trip publishes
	// open_until_ms = now + OpenDuration.
	OpenDuration time.Duration
	// Acknowledged is the last trip (TrippedAt) the plan has taken over,
	// and AcknowledgedCount the trips (TripCount) it has seen. Publish
	// refuses, with ErrTripped, a plan whose Acknowledged is before the
	// TrippedAt stored or whose AcknowledgedCount is below the TripCount
	// stored.
	Acknowledged      time.Time
	AcknowledgedCount int64
}

// TripSeen is the last trip a plan made from p has seen, and so acknowledges
// (Trip.Acknowledged): p's TrippedAt, or the trip acknowledged before when
// it is later (a trip is never unacknowledged again).
func (p Published) TripSeen() time.Time {
	if p.TrippedAt.After(p.Trip.Acknowledged) {
		return p.TrippedAt
	}
	return p.Trip.Acknowledged
}

// TripsSeen is the trip count a plan made from p has seen, and so
// acknowledges (Trip.AcknowledgedCount): the larger of p's TripCount and the
// count acknowledged before.
func (p Published) TripsSeen() int64 {
	return max(p.TripCount, p.Trip.AcknowledgedCount)
}

// TripPending reports whether p holds a trip that no plan has acknowledged:
// a TrippedAt after Trip.Acknowledged, or, when a manager of version 5 or
// later published p, a TripCount above Trip.AcknowledgedCount. A manager of
// version 4 takes trips over by their time alone and leaves
// trip_acked_count behind: the trips workers of version 5 counted under it
// are acknowledged when their time is (the version skew, docs/protocol.md
// §10).
func (p Published) TripPending() bool {
	return p.TrippedAt.After(p.Trip.Acknowledged) || p.ManagerVersion >= 5 && p.TripCount > p.Trip.AcknowledgedCount
}

// RateBurst is the rate limiter's burst for a rate: a tenth of a second's
// worth of calls, at least 1.
func RateBurst(ratePerSecond int64) int64 {
	return max(1, ratePerSecond/10)
}

// RateInterval is the GCRA emission interval in microseconds for a rate,
// rounded up so the fleet never runs faster than the rate.
func RateInterval(ratePerSecond int64) int64 {
	if ratePerSecond <= 0 {
		return 0
	}
	return (1_000_000 + ratePerSecond - 1) / ratePerSecond
}

// StatsRetention is how long per-second counters are kept: the longer of the
// two windows, plus a minute.
func StatsRetention(p Published) time.Duration {
	return max(p.BreakerWindow, p.Budget.Window) + time.Minute
}

// ErrStaleEpoch means Redis holds a newer epoch than the one being published:
// another controller wrote after this one decided.
var ErrStaleEpoch = errors.New("redis holds a newer epoch")

// ErrStaleSequence means Redis holds a publication newer than the state the
// one being published was planned from: another controller (a deposed leader
// still inside its lease, or the new one) published after this one read.
var ErrStaleSequence = errors.New("redis holds a newer publication")

// ErrTripped means the workers tripped the breaker in the fleet's path after
// the state the publication was planned from was read: it does not
// acknowledge the trip (Trip.Acknowledged), so it would undo it. Plan again
// from the state stored now.
var ErrTripped = errors.New("the workers tripped the breaker after the plan's state was read")

// Publish writes p in one script. A write whose epoch is lower than the one
// stored is refused with ErrStaleEpoch; one planned from a state older than
// the one stored (see Published.Seq) with ErrStaleSequence. It returns Redis's
// time of the write.
func (c *Client) Publish(ctx context.Context, p Published) (time.Time, error) {
	if p.State == "" {
		return time.Time{}, errors.New("state must not be empty")
	}
	if p.Limit < 0 || p.Capacity < 1 {
		return time.Time{}, fmt.Errorf("limit must be >= 0 and capacity >= 1, got %d and %d", p.Limit, p.Capacity)
	}
	if p.Seq < 0 || p.HalfOpenProbes < 0 || p.StaleAfter < 0 {
		return time.Time{}, fmt.Errorf("seq, half-open probes and stale-after must be >= 0, got %d, %d and %v", p.Seq, p.HalfOpenProbes, p.StaleAfter)
	}
	if p.Trip.On && (!(p.Trip.FailureRatio > 0 && p.Trip.FailureRatio <= 1) || p.Trip.MinCalls < 1 || p.Trip.OpenDuration < time.Millisecond) {
		return time.Time{}, fmt.Errorf("a trip needs a failure ratio in (0, 1], min calls >= 1 and an open duration >= 1ms, got %v, %d and %v", p.Trip.FailureRatio, p.Trip.MinCalls, p.Trip.OpenDuration)
	}
	var seq int64
	if p.Seq > 0 {
		seq = p.Seq + 1
	}
	args := []any{
		p.Epoch,
		seq,
		"state", string(p.State),
		"limit", p.Limit,
		"capacity", p.Capacity,
		"rate", p.RatePerSecond,
		"rate_interval_us", RateInterval(p.RatePerSecond),
		"rate_burst", RateBurst(p.RatePerSecond),
		"open_until_ms", millis(p.OpenUntil),
		"backoff_base_ms", p.Backoff.Base.Milliseconds(),
		"backoff_max_ms", p.Backoff.Max.Milliseconds(),
		"jitter", string(p.Backoff.Jitter),
		"budget_ratio_ppm", retry.RatioPPM(p.Budget.Ratio),
		"budget_min_retries", p.Budget.MinRetries,
		"budget_window_s", seconds(p.Budget.Window),
		"breaker_window_s", seconds(p.BreakerWindow),
		"stats_retention_s", seconds(StatsRetention(p)),
		"ctrl_breaker_since_ms", millis(p.BreakerSince),
		"ctrl_ramp_step", p.RampStep,
		"ctrl_ramp_step_started_ms", millis(p.RampStepStarted),
		"ctrl_ramp_limit", p.RampLimit,
		"ctrl_ramp_ceiling", p.RampCeiling,
		"ctrl_ramp_backoffs", p.RampBackoffs,
		"ctrl_ramp_settling", boolInt(p.RampSettling),
		"half_open_probes", p.HalfOpenProbes,
		"stale_after_ms", p.StaleAfter.Milliseconds(),
		"ctrl_outage_since_ms", millis(p.OutageSince),
		"ctrl_success_latency_us", p.SuccessLatency.Microseconds(),
		"trip_on", boolInt(p.Trip.On),
		"trip_failure_ratio", strconv.FormatFloat(p.Trip.FailureRatio, 'g', -1, 64),
		"trip_min_calls", p.Trip.MinCalls,
		"trip_since_ms", millis(p.Trip.Since),
		"trip_open_ms", p.Trip.OpenDuration.Milliseconds(),
		"trip_acked_ms", millis(p.Trip.Acknowledged),
		"trip_acked_count", p.Trip.AcknowledgedCount,
		"restored", boolInt(p.Restored),
	}
	res, err := publishScript.Run(ctx, c.rdb, c.publishKeys, args...).Slice()
	if err != nil {
		return time.Time{}, fmt.Errorf("failed to publish the state of %s: %w", c.dep, err)
	}
	ok, err := intAt(res, 0)
	if err != nil {
		return time.Time{}, err
	}
	v, err := intAt(res, 1)
	if err != nil {
		return time.Time{}, err
	}
	switch ok {
	case 1:
		return time.UnixMilli(v), nil
	case 0:
		return time.Time{}, fmt.Errorf("%s at epoch %d, publishing %d: %w", c.dep, v, p.Epoch, ErrStaleEpoch)
	case 2:
		return time.Time{}, fmt.Errorf("%s at sequence %d, publishing a plan made at %d: %w", c.dep, v, p.Seq, ErrStaleSequence)
	case 3:
		return time.Time{}, fmt.Errorf("%s tripped at %d ms, publishing a plan that acknowledged %d (trip %d): %w", c.dep, v, millis(p.Trip.Acknowledged), p.Trip.AcknowledgedCount, ErrTripped)
	}
	return time.Time{}, fmt.Errorf("unexpected publish reply %v", res)
}

// ReadPublished reads the state the controller last wrote. The boolean is
// false when there is none.
func (c *Client) ReadPublished(ctx context.Context) (Published, bool, error) {
	p, ok, _, err := c.ReadPublishedAt(ctx)
	return p, ok, err
}

// ReadPublishedAt is ReadPublished that also returns Redis's time of the
// read, from the node that holds the state: the time a controller must plan
// by, since workers count outcomes and the scripts compare in Redis time.
func (c *Client) ReadPublishedAt(ctx context.Context) (Published, bool, time.Time, error) {
	res, err := readScript.Run(ctx, c.rdb, []string{c.keys.State}).Slice()
	if err != nil {
		return Published{}, false, time.Time{}, fmt.Errorf("failed to read the state of %s: %w", c.dep, err)
	}
	nowMS, err := intAt(res, 0)
	if err != nil {
		return Published{}, false, time.Time{}, err
	}
	now := time.UnixMilli(nowMS)
	fields, _ := res[1].([]any)
	if len(fields)%2 != 0 {
		return Published{}, false, time.Time{}, fmt.Errorf("unexpected state reply %v", res)
	}
	m := make(map[string]string, len(fields)/2)
	for i := 0; i < len(fields); i += 2 {
		k, _ := fields[i].(string)
		v, _ := fields[i+1].(string)
		m[k] = v
	}
	p, ok, err := c.parsePublished(m)
	return p, ok, now, err
}

// parsePublished decodes the state hash m.
func (c *Client) parsePublished(m map[string]string) (Published, bool, error) {
	if len(m) == 0 {
		return Published{}, false, nil
	}
	if v, err := strconv.Atoi(m["version"]); err != nil || v < MinStateVersion || v > MaxStateVersion {
		e := &VersionError{Dependency: c.dep, State: -1, Manager: -1}
		if err == nil {
			e.State = v
		}
		if mv, err := strconv.Atoi(m["manager_version"]); err == nil && m["manager_seq"] == m["seq"] {
			e.Manager = mv
		}
		return Published{}, false, e
	}
	num := func(f string) int64 {
		n, _ := strconv.ParseInt(m[f], 10, 64)
		return n
	}
	ms := func(f string) time.Duration { return time.Duration(num(f)) * time.Millisecond }
	s := func(f string) time.Duration { return time.Duration(num(f)) * time.Second }
	ratio, _ := strconv.ParseFloat(m["trip_failure_ratio"], 64)
	return Published{
		State:         wire.State(m["state"]),
		Limit:         num("limit"),
		Capacity:      num("capacity"),
		RatePerSecond: num("rate"),
		Epoch:         num("epoch"),
		OpenUntil:     fromMillis(num("open_until_ms")),
		Backoff: retry.Backoff{
			Base:   ms("backoff_base_ms"),
			Max:    ms("backoff_max_ms"),
			Jitter: retry.Jitter(m["jitter"]),
		},
		Budget: retry.Budget{
			Ratio:      float64(num("budget_ratio_ppm")) / 1e6,
			MinRetries: num("budget_min_retries"),
			Window:     s("budget_window_s"),
		},
		BreakerWindow:   s("breaker_window_s"),
		BreakerSince:    fromMillis(num("ctrl_breaker_since_ms")),
		RampStep:        int(num("ctrl_ramp_step")),
		RampStepStarted: fromMillis(num("ctrl_ramp_step_started_ms")),
		RampLimit:       num("ctrl_ramp_limit"),
		RampCeiling:     num("ctrl_ramp_ceiling"),
		RampBackoffs:    int(num("ctrl_ramp_backoffs")),
		RampSettling:    num("ctrl_ramp_settling") == 1,
		HalfOpenProbes:  num("half_open_probes"),
		StaleAfter:      ms("stale_after_ms"),
		OutageSince:     fromMillis(num("ctrl_outage_since_ms")),
		SuccessLatency:  time.Duration(num("ctrl_success_latency_us")) * time.Microsecond,
		Seq:             num("seq"),
		Trip: Trip{
			On:                num("trip_on") == 1,
			FailureRatio:      ratio,
			MinCalls:          num("trip_min_calls"),
			Since:             fromMillis(num("trip_since_ms")),
			OpenDuration:      ms("trip_open_ms"),
			Acknowledged:      fromMillis(num("trip_acked_ms")),
			AcknowledgedCount: num("trip_acked_count"),
		},
		TrippedAt:      fromMillis(num("tripped_at_ms")),
		TrippedFrom:    wire.State(m["tripped_from"]),
		TripCount:      num("trip_count"),
		TrippedLimit:   num("tripped_limit"),
		TrippedEpoch:   num("tripped_epoch"),
		LearningUntil:  fromMillis(num("learn_until_ms")),
		ManagerVersion: managerVersion(m),
		UpdatedAt:      fromMillis(num("updated_at_ms")),
	}, true, nil
}

// managerVersion is the state hash's manager_version, 0 unless it was written
// with the stored seq (a manager of version 4 published since, or none did).
func managerVersion(m map[string]string) int {
	if m["manager_seq"] != m["seq"] {
		return 0
	}
	v, _ := strconv.Atoi(m["manager_version"])
	return v
}

// Window is what workers reported over a window.
type Window struct {
	Calls     int64
	Successes int64
	Failures  int64
	Timeouts  int64
	// ByAttempt counts calls by attempt number: 1, 2, 3, and 4 or more.
	ByAttempt [4]int64
	// RetriesGranted and BudgetRefused are the retry budget's decisions.
	RetriesGranted int64
	BudgetRefused  int64
	// TimedSuccesses are the successes whose release said how long they
	// took, and SuccessMicros the sum of those durations in microseconds.
	TimedSuccesses int64
	SuccessMicros  int64
}

// MinTimedSuccesses is the fewest timed successes MeanSuccessLatency
// measures from.
const MinTimedSuccesses = 10

// MeanSuccessLatency is the mean duration of the timed successes, at least
// a microsecond; 0 when fewer than MinTimedSuccesses were timed.
func (w Window) MeanSuccessLatency() time.Duration {
	if w.TimedSuccesses < MinTimedSuccesses {
		return 0
	}
	return max(time.Microsecond, time.Duration(w.SuccessMicros/w.TimedSuccesses)*time.Microsecond)
}

// Retries is the number of calls that were retries (attempt 2 or more).
func (w Window) Retries() int64 { return w.Calls - w.ByAttempt[0] }

// Probes are the outcomes of the current HalfOpen epoch's probe calls.
type Probes struct {
	Successes, Failures, Timeouts int64
}

// ReadWindow sums the per-second counters over the last length (whole seconds),
// counting only seconds after from when from is set, and reads the probe
// outcomes. It also returns Redis's time.
func (c *Client) ReadWindow(ctx context.Context, length time.Duration, from time.Time) (Window, Probes, time.Time, error) {
	var fromS int64
	if !from.IsZero() {
		fromS = from.Unix()
	}
	res, err := windowScript.Run(ctx, c.rdb, c.windowKeys, seconds(length), fromS).Int64Slice()
	if err != nil {
		return Window{}, Probes{}, time.Time{}, fmt.Errorf("failed to read the window of %s: %w", c.dep, err)
	}
	if len(res) != 16 {
		return Window{}, Probes{}, time.Time{}, fmt.Errorf("unexpected window reply %v", res)
	}
	w := Window{
		Calls:          res[1],
		Successes:      res[2],
		Failures:       res[3],
		Timeouts:       res[4],
		ByAttempt:      [4]int64{res[5], res[6], res[7], res[8]},
		RetriesGranted: res[9],
		BudgetRefused:  res[10],
		SuccessMicros:  res[11],
		TimedSuccesses: res[12],
	}
	p := Probes{Successes: res[13], Failures: res[14], Timeouts: res[15]}
	return w, p, time.UnixMilli(res[0]), nil
}

// boolInt is 1 for true and 0 for false, as the state hash stores flags.
func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
