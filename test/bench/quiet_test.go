package bench

// BenchmarkFailureToQuiet: how long a fleet keeps calling a dependency that
// has just fallen over. A fleet of fqProcs guards (one Redis client each, as
// processes have) calls one dependency through pkg/guard at a steady rate
// against a real redis-server, under the plan the controller publishes for a
// healthy dependency (control.Plan: Closed, the in-path trip on). At a random
// instant every call starts failing. The figure is the time from the first
// failing call until the last call any guard admitted: the workers' releases
// trip the breaker in the fleet's path (docs/protocol.md) as soon as the
// window the controller reads crosses the breaker's rule, and every
// acquisition after that is refused. Helpers are prefixed fq.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

const (
	// fqModesEnv selects the guard modes measured, comma separated
	// (fqModeOptions); default fqDefaultModes. The same variable as the
	// throughput benchmark's: a mode that means nothing here (bare) is
	// skipped.
	fqModesEnv = "SPILLWAY_BENCH_MODES"
	// fqTrialsEnv is the number of trials per mode and rate.
	fqTrialsEnv = "SPILLWAY_BENCH_TRIALS"
	// fqRuleEnv is the breaker's rule, "<failureRatio>,<window>", e.g.
	// "0.5,30s"; default fqDefaultRule.
	fqRuleEnv = "SPILLWAY_BENCH_TRIP_RULE"
	// fqRatesEnv selects the call rates, comma separated calls/s; default
	// fqRates.
	fqRatesEnv = "SPILLWAY_BENCH_RATES"
	// fqProcs is the number of guards, each with its own Redis client.
	fqProcs = 4
	// fqMinCalls is the breaker's minCalls.
	fqMinCalls = 20
)

// fqDefaultModes are the modes measured when fqModesEnv is unset.
var fqDefaultModes = []string{"percall", "batch"}

// fqDefaultRule is the breaker's rule when fqRuleEnv is unset.
const fqDefaultRule = "0.05,1s"

// fqRates are the fleet's call rates, calls/s.
var fqRates = []int{1000, 10000}

// fqModeOptions are the guard's options in each mode the benchmark knows: a
// mode is one more entry.
var fqModeOptions = map[string]func() guard.Options{
	"percall": func() guard.Options { return guard.Options{} },
	"batch":   func() guard.Options { return guard.Options{Batch: guard.BatchOptions{Enabled: true}} },
}

// errDown is the dependency's answer once it has fallen over.
var errDown = errors.New("connection refused")

// fqTrial is what one trial measured.
type fqTrial struct {
	// quiet is from the first failing call to the last call admitted.
	quiet time.Duration
	// trip is from the first failing call to the trip (tripped_at_ms,
	// Redis's clock, the same machine's).
	trip time.Duration
	// failing counts the calls that failed; rate is the calls/s the fleet
	// attempted before the dependency fell over.
	failing int64
	rate    float64
	// phase is how far into its second the first failure fell.
	phase time.Duration
}

func BenchmarkFailureToQuiet(b *testing.B) {
	modes := fqModes(b)
	trials := 40
	if v := os.Getenv(fqTrialsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			b.Fatalf("%s=%q: want a number of trials", fqTrialsEnv, v)
		}
		trials = n
	}
	params := fqParams(b)
	rates := fqRates
	if v := os.Getenv(fqRatesEnv); v != "" {
		rates = nil
		for _, f := range strings.Split(v, ",") {
			r, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || r < 1 {
				b.Fatalf("%s=%q: want calls/s, comma separated", fqRatesEnv, v)
			}
			rates = append(rates, r)
		}
	}
	srv := redistest.Start(b)
	clients := make([]*redis.Client, fqProcs)
	for i := range clients {
		clients[i] = srv.Client(func(o *redis.Options) {
			o.ContextTimeoutEnabled = true
			o.PoolSize = 64
		})
	}
	admin := srv.Client()
	for _, mode := range modes {
		for _, rate := range rates {
			b.Run(fmt.Sprintf("%s/%d", mode, rate), func(b *testing.B) {
				var quiet, trip, after []time.Duration
				var all []fqTrial
				var failing int64
				var attempted float64
				for i := range trials {
					tr := fqRun(b, admin, clients, params, fqModeOptions[mode](), fmt.Sprintf("bench/quiet-%s-%d-%d", mode, rate, i), rate)
					quiet, trip, after = append(quiet, tr.quiet), append(trip, tr.trip), append(after, tr.quiet-tr.trip)
					failing += tr.failing
					all = append(all, tr)
					attempted += tr.rate
				}
				q50, q99, qmax := measureQuantiles(quiet)
				t50, t99, _ := measureQuantiles(trip)
				a50, a99, _ := measureQuantiles(after)
				b.ReportMetric(q50.Seconds()*1e3, "quiet-p50-ms")
				b.ReportMetric(q99.Seconds()*1e3, "quiet-p99-ms")
				b.ReportMetric(qmax.Seconds()*1e3, "quiet-max-ms")
				b.ReportMetric(t99.Seconds()*1e3, "trip-p99-ms")
				b.ReportMetric(a99.Seconds()*1e3, "after-trip-p99-ms")
				b.Logf("%s at %d calls/s (attempted %.0f/s), rule %.3g over %v (minCalls %d), %d trials: first failure to the last admitted call p50 %v, p99 %v, max %v; to the trip p50 %v, p99 %v; from the trip to the last admitted call p50 %v, p99 %v; %.1f failing calls a trial",
					mode, rate, attempted/float64(trials), params.Breaker.FailureRatio, params.Breaker.Window, fqMinCalls, trials,
					q50.Round(100*time.Microsecond), q99.Round(100*time.Microsecond), qmax.Round(100*time.Microsecond),
					t50.Round(100*time.Microsecond), t99.Round(100*time.Microsecond), a50.Round(100*time.Microsecond), a99.Round(100*time.Microsecond),
					float64(failing)/float64(trials))
				slices.SortFunc(all, func(x, y fqTrial) int { return cmp.Compare(y.quiet, x.quiet) })
				for _, tr := range all[:min(3, len(all))] {
					b.Logf("A slow trial: quiet after %v, tripped after %v, %d calls failed, the first %v into its second",
						tr.quiet.Round(100*time.Microsecond), tr.trip.Round(100*time.Microsecond), tr.failing, tr.phase.Round(time.Millisecond))
				}
				if q99 > 100*time.Millisecond {
					b.Logf("p99 %v is over the bar of 100ms", q99)
				}
			})
		}
	}
}

// fqModes are the modes of fqModesEnv that this benchmark knows.
func fqModes(b *testing.B) []string {
	modes := fqDefaultModes
	if v := os.Getenv(fqModesEnv); v != "" {
		modes = nil
		for _, m := range strings.Split(v, ",") {
			m = strings.TrimSpace(m)
			switch {
			case m == "bare":
				b.Logf("Mode bare has no guard to trip: skipped")
			case fqModeOptions[m] == nil:
				b.Fatalf("%s: unknown mode %q (known: percall, batch)", fqModesEnv, m)
			default:
				modes = append(modes, m)
			}
		}
	}
	return modes
}

// fqParams is the policy: a capacity the fleet never reaches, the breaker
// rule of fqRuleEnv over fqMinCalls calls, open for a minute.
func fqParams(b *testing.B) policy.Params {
	rule := fqDefaultRule
	if v := os.Getenv(fqRuleEnv); v != "" {
		rule = v
	}
	ratioS, windowS, ok := strings.Cut(rule, ",")
	ratio, err1 := strconv.ParseFloat(ratioS, 64)
	window, err2 := time.ParseDuration(windowS)
	if !ok || err1 != nil || err2 != nil {
		b.Fatalf("%s=%q: want \"<failureRatio>,<window>\"", fqRuleEnv, rule)
	}
	spec := spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: 10000},
		Ramp:     spillwayv1alpha1.Ramp{StepDuration: metav1.Duration{Duration: time.Minute}},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio:   ratio,
			MinCalls:       fqMinCalls,
			Window:         metav1.Duration{Duration: window},
			OpenDuration:   metav1.Duration{Duration: time.Minute},
			HalfOpenProbes: 3,
		},
		RetryBudget: spillwayv1alpha1.RetryBudget{Ratio: 0.2, MinRetries: ptr.To[int32](10), Window: metav1.Duration{Duration: time.Minute}},
		Backoff:     spillwayv1alpha1.Backoff{Base: metav1.Duration{Duration: time.Second}, Max: metav1.Duration{Duration: time.Minute}, Jitter: spillwayv1alpha1.JitterFull},
	}
	p, err := policy.FromSpec(spec)
	if err != nil {
		b.Fatalf("policy: %v", err)
	}
	return p
}

// fqRun is one trial on a fresh dependency: the controller's first plan
// published, the fleet calling at rate for a random 0.3-1.3 s (so that the
// failures start at any phase of Redis's second, with a healthy window
// behind them), then failing until the fleet is quiet.
func fqRun(b *testing.B, admin *redis.Client, clients []*redis.Client, params policy.Params, opts guard.Options, dep string, rate int) fqTrial {
	ctx := context.Background()
	d, err := protocol.ParseDependency(dep)
	if err != nil {
		b.Fatal(err)
	}
	pc, err := protocol.NewClient(admin, d)
	if err != nil {
		b.Fatal(err)
	}
	now, err := admin.Time(ctx).Result()
	if err != nil {
		b.Fatal(err)
	}
	plan := control.Plan(control.Input{Params: params, Previous: control.Restore(params, "", 0, time.Time{}, now), Now: now}).Next
	if plan.State != wire.Closed || !plan.Trip.On {
		b.Fatalf("the controller's first plan is %s with the trip on %v; want Closed, on", plan.State, plan.Trip.On)
	}
	if _, err := pc.Publish(ctx, plan); err != nil {
		b.Fatal(err)
	}

	guards := make([]*guard.Guard, len(clients))
	for i, c := range clients {
		if guards[i], err = guard.New(c, dep, opts); err != nil {
			b.Fatal(err)
		}
	}
	var (
		down      atomic.Bool
		admitted  measureLatest
		firstFail measureFirst
		failing   atomic.Int64
		attempts  atomic.Int64
	)
	call := func(context.Context) error {
		now := time.Now()
		admitted.store(now)
		if down.Load() {
			firstFail.store(now)
			failing.Add(1)
			return errDown
		}
		return nil
	}
	// Each goroutine calls at its share of the rate, on a fixed schedule
	// (late calls are made at once, up to 50 ms behind).
	goroutines := max(8, rate/250)
	interval := time.Duration(int64(time.Second) * int64(goroutines) / int64(rate))
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range goroutines {
		g := guards[i%len(guards)]
		wg.Go(func() {
			next := time.Now().Add(time.Duration(rand.Int64N(int64(interval))))
			for runCtx.Err() == nil {
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				} else if d < -50*time.Millisecond {
					next = time.Now()
				}
				next = next.Add(interval)
				attempts.Add(1)
				_ = g.Do(runCtx, guard.Job{Attempt: 1}, call)
			}
		})
	}

	healthy := 300*time.Millisecond + rand.N(time.Second)
	time.Sleep(healthy)
	achieved := float64(attempts.Load()) / healthy.Seconds()
	down.Store(true)
	// Wait for the trip, then watch a while longer for late admissions.
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := admin.HGet(ctx, pc.Keys().State, "state").Result()
		if err != nil {
			b.Fatal(err)
		}
		if st == string(wire.Open) {
			break
		}
		if time.Now().After(deadline) {
			stop()
			wg.Wait()
			b.Fatalf("%s: no trip within 5s of the dependency falling over (%d calls failed)", dep, failing.Load())
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	stop()
	wg.Wait()
	for _, g := range guards {
		g.Close()
	}
	tripped, _, err := pc.ReadPublished(ctx)
	if err != nil {
		b.Fatal(err)
	}
	first := firstFail.load()
	quiet := admitted.load().Sub(first)
	return fqTrial{quiet: max(quiet, 0), trip: tripped.TrippedAt.Sub(first), failing: failing.Load(), rate: achieved,
		phase: time.Duration(first.UnixNano() % int64(time.Second))}
}
