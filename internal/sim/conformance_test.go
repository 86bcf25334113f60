package sim

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// conformanceParams are a policy small and fast enough to walk through every
// state in a few seconds of real time: a 3 s window, 4 calls to open, Open
// for 2 s, 2 probes, the ramp 2 then 4 with 2 s steps, a budget of half the
// calls (at least 1 retry) over 3 s.
func conformanceParams() policy.Params {
	return policy.Params{
		Capacity: 4,
		Breaker: breaker.Config{
			FailureRatio:   0.5,
			MinCalls:       4,
			Window:         3 * time.Second,
			OpenDuration:   2 * time.Second,
			HalfOpenProbes: 2,
		},
		Ramp:    ramp.Schedule{Steps: []int64{2, 4}, StepDuration: 2 * time.Second},
		Backoff: retry.Backoff{Base: time.Second, Max: 5 * time.Second, Jitter: retry.JitterFull},
		Budget:  retry.Budget{Ratio: 0.5, MinRetries: 1, Window: 3 * time.Second},
	}
}

// conformanceStep is one second: what is expected to be published at its
// start (the evaluation), then what workers do in it. Ops: 's' and 'f' make
// a call that succeeds or fails at once, 'x' a call that must be refused, 'h'
// a call that stays in flight (successful when it ends), 'e' ends every call
// in flight, 'b' asks the retry budget.
type conformanceStep struct {
	state wire.State
	limit int64
	ops   string
}

// published is what the two sides publish that the test compares: the
// times as seconds since the start.
type published struct {
	State        wire.State
	Limit, Epoch int64
	RampStep     int
	BreakerSince time.Duration
}

// TestConformanceWithScripts drives the same outcomes, second by second,
// through the simulator's controller (control.Plan with the accounting of
// internal/sim) and through the real scripts on redis-server (window, publish,
// acquire, release, budget, with control.Plan as the evaluator runs it), and
// compares what they publish, the window and probes each evaluation reads,
// every admission and every budget decision.
func TestConformanceWithScripts(t *testing.T) {
	if testing.Short() {
		t.Skip("runs in real time: about 18 s")
	}
	steps := []conformanceStep{
		{wire.Closed, 4, "hsssbbb"},   // 0: healthy, one call in flight; the budget grants 2 of 3
		{wire.Closed, 4, "fffxbbb"},   // 1: the 3rd failure (3 of 6) trips in the fleet's path: the 4th call is refused
		{wire.Open, 0, "xb"},          // 2: the controller takes the trip over
		{wire.Open, 0, "eb"},          // 3: open until the trip + 2 s; the call of second 0 ends: the budget counts it now
		{wire.HalfOpen, 2, "hfx"},     // 4: two probes, one in flight; no third
		{wire.Open, 0, ""},            // 5: the failed probe reopened
		{wire.Open, 0, ""},            // 6
		{wire.HalfOpen, 2, "es"},      // 7: the probe of second 4 ends, not this epoch's; one probe succeeds
		{wire.HalfOpen, 2, "sx"},      // 8: one probe is not enough; the second, no third
		{wire.Ramping, 2, "hhxess"},   // 9: closed at 2: two in flight, no third
		{wire.Ramping, 2, "ssb"},      // 10
		{wire.Closed, 4, "hhhhxefff"}, // 11: the ramp is done: 4 in flight
		{wire.Closed, 4, "fb"},        // 12: seconds 10-12, 3 failures of 10
		{wire.Open, 0, "bb"},          // 13: seconds 11-13, 4 of 8: opened again
		{wire.Open, 0, "x"},           // 14
		{wire.HalfOpen, 2, "ffxxx"},   // 15: two probes fail at once: nothing in flight, and still no third
		{wire.Open, 0, "x"},           // 16: reopened
	}

	p := conformanceParams()
	srv := redistest.Start(t)
	rdb := srv.Client()
	pc, err := protocol.NewClient(rdb, protocol.Dependency{Namespace: "sim", Name: "conformance"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// Redis second base is the simulator's second 0. Each step runs at 100 ms
	// into its Redis second, so that it has 900 ms to finish within it.
	offset := redisOffset(ctx, t, rdb)
	base := time.Now().Add(offset).Truncate(time.Second).Add(time.Second)
	sleepUntil(base.Add(100*time.Millisecond), offset)

	clk := &virtualClock{}
	cnt := newCounters(len(steps) + 2)
	ctl := newController(p, clk.Now(), 0)
	scripts := &scriptSide{t: t, ctx: ctx, pc: pc, p: p, base: base}
	var inFlightSim int64
	var inFlightRedis []protocol.Admission
	// The simulator's calls in flight: their jobs, and whether each is a
	// probe.
	var jobs int32
	var inFlightJobs []int32
	var inFlightProbes []bool

	for k, s := range steps {
		at := base.Add(time.Duration(k) * time.Second)
		if k > 0 {
			sleepUntil(at.Add(100*time.Millisecond), offset)
			clk.now = time.Duration(k) * time.Second
			cnt.closeSecond(k)
		}
		// The evaluation: the simulator's (newController made the first) and
		// the evaluator's on the scripts.
		simWindow := cnt.window(clk.Now(), p.Breaker.Window, control.WindowStart(p, ctl.pub, clk.Now()).Add(-time.Second))
		simProbes := ctl.probes
		if k > 0 {
			ctl.evaluate(&cnt, clk.Now())
		}
		redisWindow, redisProbes, redisPub := scripts.evaluate(at)
		simPub := summary(ctl.pub, epoch)
		if k > 0 && (simWindow != redisWindow || simProbes != redisProbes) {
			t.Fatalf("second %d: the simulator read window %+v probes %+v, the scripts %+v and %+v", k, simWindow, simProbes, redisWindow, redisProbes)
		}
		if simPub != redisPub {
			t.Fatalf("second %d: the simulator published %+v, the scripts %+v", k, simPub, redisPub)
		}
		if simPub.State != s.state || simPub.Limit != s.limit {
			t.Fatalf("second %d: both published %s limit %d, the script of the test expects %s limit %d", k, simPub.State, simPub.Limit, s.state, s.limit)
		}

		for i, op := range s.ops {
			where := fmt.Sprintf("second %d op %d (%c)", k, i, op)
			switch op {
			case 's', 'f', 'x', 'h':
				simOK := ctl.allows(inFlightSim)
				adm := scripts.acquire(where, at)
				if simOK != (adm.Code == protocol.Admitted) {
					t.Fatalf("%s: the simulator admits %v, acquire.lua answers %s", where, simOK, adm.Code)
				}
				if op == 'x' {
					if simOK {
						t.Fatalf("%s: admitted, the script of the test expects a refusal", where)
					}
					continue
				}
				if !simOK {
					t.Fatalf("%s: refused (%s), the script of the test expects an admission", where, adm.Code)
				}
				jobs++
				probe := ctl.started(jobs)
				cnt.startCall()
				if op == 'h' {
					inFlightSim++
					inFlightRedis = append(inFlightRedis, adm)
					inFlightJobs = append(inFlightJobs, jobs)
					inFlightProbes = append(inFlightProbes, probe)
					continue
				}
				cnt.outcome(op == 's')
				ctl.released(jobs, probe, op == 's')
				redisAt, redisTripped := scripts.release(where, at, adm, op == 's')
				if op == 'f' && !probe {
					// The in-path trip, at the instant release.lua ran it
					// (the simulator's clock otherwise stands at the whole
					// second): both must trip at the same failure.
					clk.now = redisAt.Sub(base)
					simTripped := ctl.trip(&cnt, clk.Now())
					clk.now = time.Duration(k) * time.Second
					if simTripped != redisTripped {
						t.Fatalf("%s: the simulator trips %v, release.lua %v", where, simTripped, redisTripped)
					}
				}
			case 'e':
				for j, adm := range inFlightRedis {
					cnt.outcome(true)
					ctl.released(inFlightJobs[j], inFlightProbes[j], true)
					scripts.release(where, at, adm, true)
				}
				inFlightSim, inFlightRedis, inFlightJobs, inFlightProbes = 0, nil, nil, nil
			case 'b':
				calls, granted := cnt.budgetWindow(clk.now, p.Budget.Window)
				simOK := p.Budget.Allows(granted, calls)
				if simOK {
					cnt.retryGranted()
				}
				d := scripts.budget(where, at)
				if d.Allowed != simOK || d.Calls != calls || d.Granted != granted {
					t.Fatalf("%s: the simulator counts %d calls, %d granted, allows %v; budget.lua %d, %d, %v", where, calls, granted, simOK, d.Calls, d.Granted, d.Allowed)
				}
			default:
				t.Fatalf("%s: unknown op", where)
			}
		}
	}
}

// summary is what the test compares of a published state, its times as
// offsets from origin.
func summary(p protocol.Published, origin time.Time) published {
	return published{State: p.State, Limit: p.Limit, Epoch: p.Epoch, RampStep: p.RampStep, BreakerSince: p.BreakerSince.Sub(origin)}
}

// scriptSide is the evaluator and a worker on the real scripts.
type scriptSide struct {
	t    *testing.T
	ctx  context.Context
	pc   *protocol.Client
	p    policy.Params
	base time.Time
	// lastTrip is the last in-path trip seen (TrippedAt).
	lastTrip time.Time
}

// inSecond fails the test when Redis's time now is not in the second at: the
// step overran its second, and the two sides would count different seconds.
func (s *scriptSide) inSecond(where string, at, now time.Time) {
	s.t.Helper()
	if now.Truncate(time.Second) != at {
		s.t.Fatalf("%s ran at Redis time %v, outside its second %v: the machine is too slow for this test", where, now, at)
	}
}

// evaluate runs the evaluator's steps (controllers.evaluate) at the second
// at: read the state (or restore it), read the window from WindowStart - 1 s,
// Plan, publish. Plan runs at the whole second, as the simulator's ticks do.
func (s *scriptSide) evaluate(at time.Time) (protocol.Window, protocol.Probes, published) {
	s.t.Helper()
	prev, found, now, err := s.pc.ReadPublishedAt(s.ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	s.inSecond("read", at, now)
	if !found {
		prev = control.Restore(s.p, "", 0, time.Time{}, at)
	}
	w, probes, now, err := s.pc.ReadWindow(s.ctx, s.p.Breaker.Window, control.WindowStart(s.p, prev, at).Add(-time.Second))
	if err != nil {
		s.t.Fatal(err)
	}
	s.inSecond("window", at, now)
	out := control.Plan(control.Input{Params: s.p, Previous: prev, Window: w, Probes: probes, Now: at})
	if _, err := s.pc.Publish(s.ctx, out.Next); err != nil {
		s.t.Fatal(err)
	}
	got, _, err := s.pc.ReadPublished(s.ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	// The simulator counts no attempts and no budget decisions in the
	// window: compare what the breaker reads.
	w = protocol.Window{Calls: w.Calls, Successes: w.Successes, Failures: w.Failures, Timeouts: w.Timeouts}
	return w, probes, summary(got, s.base)
}

func (s *scriptSide) acquire(where string, at time.Time) protocol.Admission {
	s.t.Helper()
	adm, err := s.pc.Acquire(s.ctx, protocol.AcquireArgs{LeaseID: protocol.NewLeaseID(), TTL: 30 * time.Second})
	if err != nil {
		s.t.Fatalf("%s: %v", where, err)
	}
	s.inSecond(where, at, adm.Now)
	return adm
}

// release reports the outcome of an admitted call as a worker does: with the
// epoch that admitted it when that was HalfOpen. It returns whether the
// release tripped the breaker in the fleet's path and when (TrippedAt), or
// else Redis's time just after it.
func (s *scriptSide) release(where string, at time.Time, adm protocol.Admission, ok bool) (time.Time, bool) {
	s.t.Helper()
	var epoch int64
	if adm.State == wire.HalfOpen {
		epoch = adm.Epoch
	}
	outcome := protocol.Failure
	if ok {
		outcome = protocol.Success
	}
	if _, err := s.pc.Release(s.ctx, adm.Member, epoch, outcome, 1); err != nil {
		s.t.Fatalf("%s: %v", where, err)
	}
	pub, _, now, err := s.pc.ReadPublishedAt(s.ctx)
	if err != nil {
		s.t.Fatalf("%s: %v", where, err)
	}
	s.inSecond(where, at, now)
	if !pub.TrippedAt.Equal(s.lastTrip) {
		s.lastTrip = pub.TrippedAt
		return pub.TrippedAt, true
	}
	return now, false
}

func (s *scriptSide) budget(where string, at time.Time) protocol.BudgetDecision {
	s.t.Helper()
	d, err := s.pc.RetryBudget(s.ctx)
	if err != nil {
		s.t.Fatalf("%s: %v", where, err)
	}
	_, _, now, err := s.pc.ReadPublishedAt(s.ctx)
	if err != nil {
		s.t.Fatalf("%s: %v", where, err)
	}
	s.inSecond(where, at, now)
	return d
}

// redisOffset estimates Redis's clock minus the local clock.
func redisOffset(ctx context.Context, t *testing.T, rdb *redis.Client) time.Duration {
	t.Helper()
	before := time.Now()
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now.Sub(before.Add(time.Since(before) / 2))
}

// sleepUntil sleeps until Redis's clock, the local one plus offset, reads at.
func sleepUntil(at time.Time, offset time.Duration) {
	time.Sleep(time.Until(at.Add(-offset)))
}
