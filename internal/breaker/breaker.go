// Package breaker is the fleet-wide circuit-breaker state machine of
// Spillway.
//
// It is pure: it performs no I/O, starts no goroutines and reads time only
// from an injected clock.Clock, so the controller (wall clock), the worker
// library, the service middleware and the discrete-event simulator (virtual
// clock) all drive exactly the same arithmetic.
//
// Its states are wire.Closed, wire.Open and wire.HalfOpen, the fleet's state
// type (pkg/wire) that the controller publishes; a breaker never takes
// wire.Ramping, which internal/control derives from a Closed breaker and the
// ramp.
//
// The Breaker does not count calls itself. The caller counts calls and
// failures from WindowStart onwards (and, while HalfOpen, the probe calls made
// since the breaker entered HalfOpen, i.e. since Snapshot().Since), and hands
// the counts to Evaluate, which performs at most one state transition. A
// Closed breaker whose window crossed the rule between evaluations (the
// workers tripped it in the fleet's path) opens as of then with Tripped.
//
//	Closed   --(calls >= MinCalls and failures >= FailureRatio*calls)--> Open
//	Open     --(OpenDuration elapsed since entering Open)-------------> HalfOpen
//	HalfOpen --(any probe failure)------------------------------------> Open
//	HalfOpen --(HalfOpenProbes successful probes, no failure)---------> Closed
//	HalfOpen --(OpenDuration elapsed without enough probe successes)--> Open
//
// The last rule keeps a breaker from waiting forever on probes that never
// report (a worker that died holding one): it reopens, and the next HalfOpen
// admits fresh probes.
package breaker

import (
	"fmt"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Config is the breaker policy.
type Config struct {
	// FailureRatio is the share of failed calls in the window at which a
	// Closed breaker opens; 0 < FailureRatio <= 1.
	FailureRatio float64
	// MinCalls is the number of calls the window must hold before the
	// breaker may open; >= 1.
	MinCalls int64
	// Window is the length of the counting window the caller reads
	// (see WindowStart); > 0.
	Window time.Duration
	// OpenDuration is how long the breaker stays Open before it lets
	// probes through; > 0.
	OpenDuration time.Duration
	// HalfOpenProbes is the number of successful probes, with no failure,
	// that close a HalfOpen breaker; >= 1.
	HalfOpenProbes int64
}

// Validate returns an error naming the first invalid field, or nil.
func (c Config) Validate() error {
	switch {
	case !(c.FailureRatio > 0 && c.FailureRatio <= 1):
		return fmt.Errorf("failureRatio must be in (0, 1], got %v", c.FailureRatio)
	case c.MinCalls < 1:
		return fmt.Errorf("minCalls must be >= 1, got %d", c.MinCalls)
	case c.Window <= 0:
		return fmt.Errorf("window must be > 0, got %v", c.Window)
	case c.OpenDuration <= 0:
		return fmt.Errorf("openDuration must be > 0, got %v", c.OpenDuration)
	case c.HalfOpenProbes < 1:
		return fmt.Errorf("halfOpenProbes must be >= 1, got %d", c.HalfOpenProbes)
	}
	return nil
}

// Counts are the calls the caller observed. Failures includes timeouts and is
// part of Calls, so successes are Calls - Failures.
type Counts struct {
	// Calls is the number of calls made, successful or not.
	Calls int64
	// Failures is the number of those calls that failed or timed out.
	Failures int64
}

// Snapshot is the persistent form of a Breaker: the controller stores it (in
// Redis and in the resource status) so the state survives restarts, and
// Restore continues from it.
type Snapshot struct {
	// State is the current state.
	State wire.State
	// Since is the time of the last transition (or of creation).
	Since time.Time
}

// Transition records one state change made by Evaluate.
type Transition struct {
	// From is the state before the transition.
	From wire.State
	// To is the state after the transition.
	To wire.State
	// At is when it happened: the clock's time during Evaluate, which is
	// also the new Since.
	At time.Time
}

// Breaker is the circuit-breaker state machine. It is safe for concurrent
// use; all times come from its Clock.
type Breaker struct {
	mu    sync.Mutex
	cfg   Config
	clk   clock.Clock
	state wire.State
	since time.Time
}

// New returns a Closed breaker whose Since is clk.Now().
//
// New does not validate cfg; callers validate policy with Config.Validate
// first. Evaluate nevertheless never opens on fewer than one call and never
// closes on fewer than one successful probe.
func New(cfg Config, clk clock.Clock) *Breaker {
	return &Breaker{cfg: cfg, clk: clk, state: wire.Closed, since: clk.Now()}
}

// Restore returns a breaker that continues from a persisted Snapshot.
//
// A snapshot with an unrecognised State (including the zero Snapshot) restores
// as New would: Closed since clk.Now(). A Since later than clk.Now() (clock
// skew between controller replicas) is clamped to clk.Now(), so the counting
// window never starts in the future.
func Restore(cfg Config, clk clock.Clock, s Snapshot) *Breaker {
	now := clk.Now()
	if !s.State.IsBreakerState() {
		return &Breaker{cfg: cfg, clk: clk, state: wire.Closed, since: now}
	}
	since := s.Since
	if since.After(now) {
		since = now
	}
	return &Breaker{cfg: cfg, clk: clk, state: s.State, since: since}
}

// Snapshot returns the state to persist.
func (b *Breaker) Snapshot() Snapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Snapshot{State: b.state, Since: b.since}
}

// State returns the current state.
func (b *Breaker) State() wire.State {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state
}

// WindowStart returns max(now - Window, Since): the caller counts calls and
// failures only from this instant. Because Since is the time of the last
// transition, failures from before the breaker last closed never re-open it.
func (b *Breaker) WindowStart() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	start := b.clk.Now().Add(-b.cfg.Window)
	if b.since.After(start) {
		return b.since
	}
	return start
}

// SetConfig replaces the policy (the policy was edited). The state and Since
// are kept; the new policy applies from the next Evaluate, so shortening
// OpenDuration can half-open an Open breaker on the next call.
func (b *Breaker) SetConfig(cfg Config) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cfg = cfg
}

// Evaluate applies at most one transition, at clk.Now(), and reports it.
//
//   - Closed: window holds the calls counted since WindowStart; probes is
//     ignored. The breaker opens when Config.Trips(window): window.Calls >=
//     MinCalls and float64(window.Failures) >= FailureRatio*float64(window.Calls).
//     The comparison is exact float64 arithmetic with no epsilon: with ratio
//     0.5, 5 failures in 10 calls open the breaker.
//   - Open: both counts are ignored. The breaker half-opens once
//     now - Since >= OpenDuration.
//   - HalfOpen: probes holds the probe calls made since the breaker entered
//     HalfOpen; window is ignored. Any probe failure re-opens the breaker;
//     otherwise it closes once probes.Calls - probes.Failures >= HalfOpenProbes.
//
// Every transition sets Since to now. When nothing changes Evaluate returns
// the zero Transition and false.
func (b *Breaker) Evaluate(window Counts, probes Counts) (Transition, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.clk.Now()
	to, ok := b.next(now, window, probes)
	if !ok {
		return Transition{}, false
	}
	t := Transition{From: b.state, To: to, At: now}
	b.state, b.since = to, now
	return t, true
}

// Tripped opens a Closed breaker as of at: the instant its window crossed
// Config.Trips, as the workers reported the failures (release.lua's in-path
// trip), before anyone called Evaluate. The transition's At and the new
// Since are at, clamped to [Since, now], so OpenDuration counts from the
// trip. A breaker that is not Closed does not move: it returns the zero
// Transition and false.
func (b *Breaker) Tripped(at time.Time) (Transition, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state != wire.Closed {
		return Transition{}, false
	}
	if now := b.clk.Now(); at.After(now) {
		at = now
	}
	if at.Before(b.since) {
		at = b.since
	}
	t := Transition{From: wire.Closed, To: wire.Open, At: at}
	b.state, b.since = wire.Open, at
	return t, true
}

// next returns the state the breaker moves to at now, if any.
func (b *Breaker) next(now time.Time, window, probes Counts) (wire.State, bool) {
	switch b.state {
	case wire.Closed:
		return wire.Open, b.cfg.Trips(window)
	case wire.Open:
		return wire.HalfOpen, now.Sub(b.since) >= b.cfg.OpenDuration
	case wire.HalfOpen:
		if probes.Failures > 0 {
			return wire.Open, true
		}
		if probes.Calls-probes.Failures >= max(b.cfg.HalfOpenProbes, 1) {
			return wire.Closed, true
		}
		return wire.Open, now.Sub(b.since) >= b.cfg.OpenDuration
	}
	return "", false
}

// Trips reports whether a Closed breaker's window opens it: the window holds
// at least MinCalls calls (at least one, whatever MinCalls says) and
// float64(Failures) >= FailureRatio*float64(Calls), exact float64 arithmetic
// with no epsilon. It is the one rule: the breaker's own Evaluate, the
// workers' in-path trip (release.lua's trip, which a differential test holds
// to this function) and the simulator's model of that trip all decide by it.
func (c Config) Trips(window Counts) bool {
	if window.Calls < max(c.MinCalls, 1) {
		return false
	}
	return float64(window.Failures) >= c.FailureRatio*float64(window.Calls)
}
