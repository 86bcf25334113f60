package protocol_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/breaker"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// tripPolicy is policy(limit) in state with the in-path trip on: the rule
// ratio over at least minCalls in the window of length seconds, counting only
// the seconds after since's.
func tripPolicy(state wire.State, limit int64, ratio float64, minCalls int64, length time.Duration, since time.Time) protocol.Published {
	p := policy(limit)
	p.State = state
	p.BreakerWindow = length
	p.Trip = protocol.Trip{On: true, FailureRatio: ratio, MinCalls: minCalls, Since: since, OpenDuration: 7 * time.Second}
	return p
}

// releaseN releases n calls admitted without a lease with outcome o.
func releaseN(t testing.TB, c *protocol.Client, n int, o protocol.Outcome) {
	t.Helper()
	for range n {
		if _, err := c.Release(ctxT(t), "", 0, o, 1); err != nil {
			t.Fatalf("Release: %v", err)
		}
	}
}

func mustRead(t testing.TB, c *protocol.Client) protocol.Published {
	t.Helper()
	p, ok, err := c.ReadPublished(ctxT(t))
	if err != nil || !ok {
		t.Fatalf("ReadPublished = ok %v, err %v", ok, err)
	}
	return p
}

// TestReleaseTripsTheBreaker: the failure that brings the window to the rule
// (here the 10th failure of 10 calls at ratio 0.5, minCalls 10) opens the
// breaker in the same script: state Open, limit 0, open_until_ms from the
// trip, the trip recorded, the epoch and sequence kept, the dead-man bound
// counted from open_until, the change announced on the changes channel, and
// acquisitions refused at once.
func TestReleaseTripsTheBreaker(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		sub := rdb.Subscribe(ctx, c.Keys().Changes)
		defer sub.Close()
		if _, err := sub.Receive(ctx); err != nil {
			t.Fatalf("Subscribe: %v", err)
		}
		p := tripPolicy(wire.Ramping, 8, 0.5, 10, 30*time.Second, redisNow(t, rdb).Add(-time.Minute))
		p.Epoch, p.StaleAfter = 4, 30*time.Second
		published := mustPublish(t, c, p)
		// The publication announces itself first (publish.lua); the trip's
		// announcement follows in the same format.
		if msg, err := sub.ReceiveMessage(ctx); err != nil || msg.Payload != "4 Ramping 8" {
			t.Fatalf("the publication's announcement = %v, %v; want \"4 Ramping 8\"", msg, err)
		}

		releaseN(t, c, 9, protocol.Failure)
		if got := mustRead(t, c); got.State != wire.Ramping || !got.TrippedAt.IsZero() {
			t.Fatalf("after 9 failures (below minCalls) state %s, tripped at %v; want Ramping, never", got.State, got.TrippedAt)
		}
		before := redisNow(t, rdb)
		releaseN(t, c, 1, protocol.Failure)
		after := redisNow(t, rdb)

		got := mustRead(t, c)
		if got.State != wire.Open || got.Limit != 0 || got.TrippedFrom != wire.Ramping {
			t.Fatalf("after the 10th failure: state %s, limit %d, tripped from %q; want Open, 0, Ramping", got.State, got.Limit, got.TrippedFrom)
		}
		if got.TrippedAt.Before(before.Truncate(time.Millisecond)) || got.TrippedAt.After(after) {
			t.Errorf("TrippedAt %v, want between %v and %v", got.TrippedAt, before, after)
		}
		if want := got.TrippedAt.Add(p.Trip.OpenDuration); !got.OpenUntil.Equal(want) {
			t.Errorf("OpenUntil %v, want the trip plus openDuration %v", got.OpenUntil, want)
		}
		if got.Epoch != 4 || got.Seq != 1 {
			t.Errorf("epoch %d, seq %d: the trip keeps both (want 4, 1)", got.Epoch, got.Seq)
		}
		// Stale once now > updated_at + stale_after: the bound now runs from
		// open_until, as for an Open the controller publishes.
		if stale := got.UpdatedAt.Add(got.StaleAfter); !stale.Equal(got.OpenUntil.Add(30 * time.Second)) {
			t.Errorf("the dead-man bound ends at %v, want open_until + 30s = %v (published at %v)", stale, got.OpenUntil.Add(30*time.Second), published)
		}
		msg, err := sub.ReceiveMessage(ctx)
		if err != nil {
			t.Fatalf("ReceiveMessage: %v", err)
		}
		change, err := protocol.ParseChange(msg.Payload)
		if err != nil || change != (protocol.Change{Epoch: 4, State: wire.Open, Limit: 0}) {
			t.Errorf("announced %q: ParseChange = %+v, %v; want epoch 4, Open, limit 0", msg.Payload, change, err)
		}
		if a := mustAcquire(t, c, time.Minute); a.Code != protocol.RefusedOpen {
			t.Errorf("acquire after the trip = %v, want refused open", a.Code)
		}
		// Open: further failures change nothing.
		releaseN(t, c, 5, protocol.Timeout)
		if again := mustRead(t, c); !again.TrippedAt.Equal(got.TrippedAt) || !again.OpenUntil.Equal(got.OpenUntil) {
			t.Errorf("a failure while Open tripped again: %v / %v", again.TrippedAt, again.OpenUntil)
		}
	})
}

// TestTripOnlyWhereTheRuleDecides: nothing trips with trip_on 0 (the
// controller's decision is not the breaker's rule alone), in HalfOpen (a
// probe's failure is the controller's to read), on successes (the rule is
// checked at failures and timeouts: 9 failures then a success reach minCalls
// but the script does not look), nor on cancelled calls, which count
// nothing; the next failure after the success trips.
func TestTripOnlyWhereTheRuleDecides(t *testing.T) {
	t.Parallel()
	_, rdb := sharedStandalone(t)
	since := redisNow(t, rdb).Add(-time.Minute)

	off := newClient(t, rdb)
	p := tripPolicy(wire.Closed, 8, 0.5, 5, 30*time.Second, since)
	p.Trip.On = false
	mustPublish(t, off, p)
	releaseN(t, off, 20, protocol.Failure)
	if got := mustRead(t, off); got.State != wire.Closed {
		t.Errorf("trip off: state %s after 20 failures, want Closed", got.State)
	}

	half := newClient(t, rdb)
	mustPublish(t, half, tripPolicy(wire.HalfOpen, 3, 0.5, 1, 30*time.Second, since))
	a := mustAdmit(t, half, time.Minute)
	mustRelease(t, half, a, protocol.Failure, 1)
	releaseN(t, half, 5, protocol.Failure)
	if got := mustRead(t, half); got.State != wire.HalfOpen {
		t.Errorf("HalfOpen: state %s after failures, want HalfOpen", got.State)
	}

	succ := newClient(t, rdb)
	mustPublish(t, succ, tripPolicy(wire.Closed, 8, 0.5, 10, 30*time.Second, since))
	releaseN(t, succ, 9, protocol.Failure)
	releaseN(t, succ, 4, protocol.Cancelled)
	releaseN(t, succ, 1, protocol.Success)
	if got := mustRead(t, succ); got.State != wire.Closed {
		t.Fatalf("9 failures, 4 cancelled, 1 success: state %s, want Closed (not decided at a success)", got.State)
	}
	releaseN(t, succ, 1, protocol.Timeout)
	if got := mustRead(t, succ); got.State != wire.Open || got.TrippedFrom != wire.Closed {
		t.Errorf("then a timeout: state %s from %q, want Open from Closed", got.State, got.TrippedFrom)
	}
}

// TestPublishRefusesAPlanThatDidNotSeeTheTrip: the controller read the
// state, workers tripped, and the controller publishes the Closed it planned
// from what it read: the publish is refused (ErrTripped) and the trip stands.
// A plan that acknowledges the trip is written; a later trip is fenced again.
func TestPublishRefusesAPlanThatDidNotSeeTheTrip(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, tripPolicy(wire.Closed, 8, 0.5, 4, 30*time.Second, redisNow(t, rdb).Add(-time.Minute)))
		read := mustRead(t, c) // the controller's read, before the trip
		releaseN(t, c, 4, protocol.Failure)
		tripped := mustRead(t, c)
		if tripped.State != wire.Open {
			t.Fatalf("state %s after 4 failures, want Open", tripped.State)
		}

		stale := tripPolicy(wire.Closed, 8, 0.5, 4, 30*time.Second, read.Trip.Since)
		stale.Seq, stale.Trip.Acknowledged, stale.Trip.AcknowledgedCount = read.Seq, read.TrippedAt, read.TripsSeen()
		if _, err := c.Publish(ctxT(t), stale); !errors.Is(err, protocol.ErrTripped) {
			t.Fatalf("Publish of a plan made before the trip = %v, want ErrTripped", err)
		}
		if got := mustRead(t, c); got.State != wire.Open || !got.TrippedAt.Equal(tripped.TrippedAt) {
			t.Fatalf("after the refused publish: state %s, tripped at %v; want the trip kept", got.State, got.TrippedAt)
		}

		// The controller plans again from the tripped state and takes it over.
		over := tripPolicy(wire.Open, 0, 0.5, 4, 30*time.Second, read.Trip.Since)
		over.Trip.On, over.Epoch = false, tripped.Epoch+1
		over.Seq, over.Trip.Acknowledged, over.Trip.AcknowledgedCount = tripped.Seq, tripped.TrippedAt, tripped.TripsSeen()
		mustPublish(t, c, over)
		closed := tripPolicy(wire.Closed, 8, 0.5, 4, 30*time.Second, redisNow(t, rdb))
		closed.Epoch, closed.Trip.Acknowledged, closed.Trip.AcknowledgedCount = over.Epoch+1, tripped.TrippedAt, tripped.TripsSeen()
		mustPublish(t, c, closed)
		if got := mustRead(t, c); got.State != wire.Closed {
			t.Fatalf("after the take-over and a close: state %s, want Closed", got.State)
		}

		// A second trip, not acknowledged, is fenced again. The window
		// starts at the close, so the failures before it do not count.
		time.Sleep(time.Until(redisNow(t, rdb).Truncate(time.Second).Add(time.Second + 10*time.Millisecond)))
		releaseN(t, c, 3, protocol.Failure)
		if got := mustRead(t, c); got.State != wire.Closed {
			t.Fatalf("3 failures after the close: state %s, want Closed (minCalls 4 counted from the close)", got.State)
		}
		releaseN(t, c, 1, protocol.Failure)
		second := mustRead(t, c)
		if second.State != wire.Open || !second.TrippedAt.After(tripped.TrippedAt) {
			t.Fatalf("4th failure after the close: state %s, tripped at %v; want a new trip", second.State, second.TrippedAt)
		}
		closed.Epoch++
		if _, err := c.Publish(ctxT(t), closed); !errors.Is(err, protocol.ErrTripped) {
			t.Errorf("Publish acknowledging only the first trip = %v, want ErrTripped", err)
		}
	})
}

// TestTripFenceCountsTripsNotClocks: the fence between a trip and a plan made
// before it is a count, not a wall-clock comparison. After a failover to a
// replica whose clock is behind the old master's, a new trip is stamped
// earlier than the trip the last plan acknowledged; compared by time alone
// it would look acknowledged already and a plan made before it would undo
// it. Here the acknowledged time stands for the old master's clock, a minute
// ahead of the trip that follows.
func TestTripFenceCountsTripsNotClocks(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ahead := redisNow(t, rdb).Add(time.Minute) // what the old master's clock said
		p := tripPolicy(wire.Closed, 8, 0.5, 4, 30*time.Second, redisNow(t, rdb).Add(-time.Minute))
		p.Trip.Acknowledged = ahead
		mustPublish(t, c, p)
		read := mustRead(t, c) // the controller's read, before the trip
		releaseN(t, c, 4, protocol.Failure)
		tripped := mustRead(t, c)
		if tripped.State != wire.Open || !tripped.TrippedAt.Before(ahead) || tripped.TripCount != read.TripCount+1 {
			t.Fatalf("after 4 failures: state %s, tripped at %v (acknowledged %v), trips %d; want Open, earlier than the acknowledged time, one more trip",
				tripped.State, tripped.TrippedAt, ahead, tripped.TripCount)
		}
		stale := tripPolicy(wire.Closed, 8, 0.5, 4, 30*time.Second, read.Trip.Since)
		stale.Epoch, stale.Seq = read.Epoch, read.Seq
		stale.Trip.Acknowledged, stale.Trip.AcknowledgedCount = read.TripSeen(), read.TripsSeen()
		if _, err := c.Publish(ctxT(t), stale); !errors.Is(err, protocol.ErrTripped) {
			t.Fatalf("Publish of a plan made before the trip, its acknowledged time ahead of the trip's = %v, want ErrTripped", err)
		}
		if got := mustRead(t, c); got.State != wire.Open {
			t.Fatalf("after the refused publish: state %s, want the trip kept", got.State)
		}
	})
}

// tripModel is the differential test's Go side: every outcome counted per
// Redis second, as release.lua counts it, and the rule applied with
// breaker.Config.Trips over the seconds window.lua reads.
type tripModel struct {
	cfg    breaker.Config
	since  int64 // count only the seconds after this one
	length int64
	sec    map[int64]*[3]int64 // s, f, t by second
}

func (m *tripModel) add(s int64, o protocol.Outcome, n int64) {
	c := m.sec[s]
	if c == nil {
		c = new([3]int64)
		m.sec[s] = c
	}
	switch o {
	case protocol.Success:
		c[0] += n
	case protocol.Failure:
		c[1] += n
	case protocol.Timeout:
		c[2] += n
	}
}

func (m *tripModel) trips(nowS int64) bool {
	from := max(nowS-m.length, m.since)
	var w breaker.Counts
	for s, c := range m.sec {
		if s > from && s <= nowS {
			w.Calls += c[0] + c[1] + c[2]
			w.Failures += c[1] + c[2]
		}
	}
	return m.cfg.Trips(w)
}

// tripRatios are failure ratios whose products with call counts fall on
// either side of an integer in float64 (0.07 × 100 > 7, 0.57 × 100 < 57),
// with random hundredths and thousandths added per trial.
var tripRatios = []float64{0.07, 0.1, 0.2, 0.29, 0.3, 0.33, 0.5, 0.57, 0.6, 0.7, 0.9, 1}

// TestTripDifferential runs random outcome sequences through release.lua on a
// real redis-server and through breaker.Config.Trips, and requires the same
// decision at every failure or timeout: the script trips exactly when the Go
// rule says the window the controller reads crosses it. Each trial is a
// fresh dependency with a random ratio, minCalls, window length (1 s to 60 s,
// so short windows slide during the trial) and window start (since), and a
// random history of per-second counters before and around the window's
// start, written before the first release; it ends at the trip or after 150
// outcomes. The Redis second of each release is read around it: when the two
// readings differ (a second boundary fell during the call) the step is
// compared only if both seconds give the same decision, and the model takes
// the counters of both seconds from Redis.
func TestTripDifferential(t *testing.T) {
	t.Parallel()
	tripDifferential(t, 23, 5000, func(t *testing.T, c *protocol.Client, rng *rand.Rand, pf float64) [3]int64 {
		var n [3]int64
		o := protocol.Success
		switch r := rng.Float64(); {
		case r < 0.05:
			o = protocol.Cancelled
		case r < 0.05+pf*0.95*0.7:
			o, n[1] = protocol.Failure, 1
		case r < 0.05+pf*0.95:
			o, n[2] = protocol.Timeout, 1
		default:
			n[0] = 1
		}
		if _, err := c.Release(ctxT(t), "", 0, o, 1); err != nil {
			t.Fatalf("Release: %v", err)
		}
		return n
	})
}

// TestTripDifferentialPool is TestTripDifferential with the outcomes
// reported aggregated, as batch mode reports them (pool.lua): each refresh
// reports up to 6 successes, failures and timeouts at once, and the script
// decides once per report that holds a failure or a timeout, as
// breaker.Config.Trips decides over the window with the whole report
// counted.
func TestTripDifferentialPool(t *testing.T) {
	t.Parallel()
	var req int
	tripDifferential(t, 24, 2000, func(t *testing.T, c *protocol.Client, rng *rand.Rand, pf float64) [3]int64 {
		var r protocol.Report
		for range 1 + rng.IntN(6) {
			switch x := rng.Float64(); {
			case x < pf*0.7:
				r.Add(protocol.Failure, 1, -1)
			case x < pf:
				r.Add(protocol.Timeout, 1, -1)
			default:
				r.Add(protocol.Success, 1, -1)
			}
		}
		req++
		if _, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: strconv.Itoa(req), TTL: time.Minute, Report: r}); err != nil {
			t.Fatalf("Pool: %v", err)
		}
		return [3]int64{r.Successes, r.Failures, r.Timeouts}
	})
}

// tripDifferential runs trials of up to 150 steps until it has compared
// decisions decisions. A step is report's: it reports outcomes for a fresh
// dependency's client, pf being the trial's failure share, and returns the
// successes, failures and timeouts it reported; after a step that reported
// none of the last two the script must not have tripped, after the others it
// must have tripped exactly when breaker.Config.Trips says so.
func tripDifferential(t *testing.T, seed uint64, want int, report func(t *testing.T, c *protocol.Client, rng *rand.Rand, pf float64) [3]int64) {
	_, rdb := sharedStandalone(t)
	ctx := ctxT(t)
	rng := rand.New(rand.NewPCG(seed, 2))
	var decisions, trips, skipped int
	for trial := 0; decisions < want; trial++ {
		c := newClient(t, rdb)
		k := c.Keys()
		ratio := tripRatios[rng.IntN(len(tripRatios))]
		switch rng.IntN(3) {
		case 0:
			ratio = float64(1+rng.IntN(100)) / 100
		case 1:
			ratio = float64(1+rng.IntN(1000)) / 1000
		}
		m := &tripModel{
			cfg:    breaker.Config{FailureRatio: ratio, MinCalls: int64(1 + rng.IntN(40))},
			length: []int64{1, 2, 3, 5, 10, 30, 60}[rng.IntN(7)],
			sec:    map[int64]*[3]int64{},
		}
		now := redisNow(t, rdb)
		nowS := now.Unix()
		sinceMS := now.UnixMilli() - rng.Int64N((m.length+3)*1000)
		m.since = sinceMS / 1000
		// History: random counters in the seconds before now, around both
		// bounds of the window.
		var hist []any
		for s := nowS - m.length - 3; s < nowS; s++ {
			for _, o := range []protocol.Outcome{protocol.Success, protocol.Failure, protocol.Timeout} {
				if n := rng.Int64N(4); n > 0 && rng.IntN(2) == 0 {
					hist = append(hist, fmt.Sprintf("%d:%s", s, o), n)
					m.add(s, o, n)
				}
			}
		}
		if len(hist) > 0 {
			if err := rdb.HSet(ctx, k.Stats, hist...).Err(); err != nil {
				t.Fatal(err)
			}
		}
		p := tripPolicy(wire.Closed, 100, ratio, m.cfg.MinCalls, time.Duration(m.length)*time.Second, time.UnixMilli(sinceMS))
		mustPublish(t, c, p)
		// The failure share of this trial's outcomes, near the ratio.
		pf := min(max(ratio+rng.Float64()*0.3-0.15, 0.02), 1)
		beforeS := redisNow(t, rdb).Unix()
		for step := 0; step < 150; step++ {
			n := report(t, c, rng, pf)
			var st *redis.SliceCmd
			var tm *redis.TimeCmd
			if _, err := rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
				st = pipe.HMGet(ctx, k.State, "state", "tripped_at_ms")
				tm = pipe.Time(ctx)
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			afterS := tm.Val().Unix()
			tripped := st.Val()[0] == string(wire.Open)
			add := func() {
				for i, o := range []protocol.Outcome{protocol.Success, protocol.Failure, protocol.Timeout} {
					if n[i] > 0 {
						m.add(afterS, o, n[i])
					}
				}
			}
			if n[1]+n[2] == 0 {
				add() // a success's second matters only for later windows; fixed below when ambiguous
				if afterS != beforeS {
					m.fromRedis(t, rdb, k.Stats, beforeS, afterS)
				}
				if tripped {
					t.Fatalf("trial %d step %d: tripped on %d successes; the rule is checked at failures and timeouts only", trial, step, n[0])
				}
				beforeS = afterS
				continue
			}
			var want bool
			if afterS == beforeS {
				add()
				want = m.trips(afterS)
			} else {
				m.fromRedis(t, rdb, k.Stats, beforeS, afterS)
				if tripped {
					at, _ := strconv.ParseInt(st.Val()[1].(string), 10, 64)
					want = m.trips(at / 1000)
				} else if a, b := m.trips(beforeS), m.trips(afterS); a != b {
					skipped++
					beforeS = afterS
					continue
				} else {
					want = a
				}
			}
			decisions++
			if tripped != want {
				t.Fatalf("trial %d step %d (ratio %v, minCalls %d, window %d s, since second %d, now second %d, reported %v): script tripped %v, breaker.Config.Trips %v",
					trial, step, ratio, m.cfg.MinCalls, m.length, m.since, afterS, n, tripped, want)
			}
			beforeS = afterS
			if tripped {
				trips++
				break
			}
		}
	}
	t.Logf("%d decisions (%d trips), %d steps at a second boundary not compared", decisions, trips, skipped)
	if trips < 20 || decisions-trips < want/5 {
		t.Errorf("%d trips in %d decisions: the trials do not cover both decisions", trips, decisions)
	}
}

// fromRedis replaces the model's counters of the seconds a and b with those
// in Redis: a release that ran across a second boundary counted in one of
// them, and only Redis knows which.
func (m *tripModel) fromRedis(t *testing.T, rdb redis.UniversalClient, stats string, a, b int64) {
	t.Helper()
	for _, s := range []int64{a, b} {
		v, err := rdb.HMGet(ctxT(t), stats, fmt.Sprintf("%d:s", s), fmt.Sprintf("%d:f", s), fmt.Sprintf("%d:t", s)).Result()
		if err != nil {
			t.Fatal(err)
		}
		c := new([3]int64)
		for i, x := range v {
			if x != nil {
				c[i], _ = strconv.ParseInt(x.(string), 10, 64)
			}
		}
		m.sec[s] = c
	}
}

// TestNoTripOnNoise: a dependency whose failure ratio sits just below the
// breaker's never trips, though the script checks the rule at every failure,
// the moments the ratio peaks. First a steady window: 29 seconds of history
// at 45% failures (100 calls a second) and 4,000 calls failing at random at
// 45% (ratio 0.5, minCalls 20). Then a window that starts empty at a
// transition, where the ratio is noisiest: 2,000 calls whose failures are
// spread as evenly as a ratio just below 0.5 allows (every prefix holds
// fewer failures than successes), from the first call on.
func TestNoTripOnNoise(t *testing.T) {
	t.Parallel()
	_, rdb := sharedStandalone(t)
	ctx := ctxT(t)
	rng := rand.New(rand.NewPCG(45, 55))

	steady := newClient(t, rdb)
	nowS := redisNow(t, rdb).Unix()
	var hist []any
	for s := nowS - 29; s < nowS; s++ {
		hist = append(hist, fmt.Sprintf("%d:s", s), 55, fmt.Sprintf("%d:f", s), 40, fmt.Sprintf("%d:t", s), 5)
	}
	if err := rdb.HSet(ctx, steady.Keys().Stats, hist...).Err(); err != nil {
		t.Fatal(err)
	}
	mustPublish(t, steady, tripPolicy(wire.Closed, 100, 0.5, 20, 30*time.Second, time.Unix(nowS-120, 0)))
	for i := range 4000 {
		o := protocol.Success
		switch r := rng.Float64(); {
		case r < 0.40:
			o = protocol.Failure
		case r < 0.45:
			o = protocol.Timeout
		}
		if _, err := steady.Release(ctx, "", 0, o, 1); err != nil {
			t.Fatal(err)
		}
		if i%100 == 99 {
			if got := mustRead(t, steady); got.State != wire.Closed {
				t.Fatalf("steady 45%% failures: tripped after %d calls", i+1)
			}
		}
	}
	if got := mustRead(t, steady); got.State != wire.Closed {
		t.Fatalf("steady 45%% failures: state %s, want Closed", got.State)
	}

	fresh := newClient(t, rdb)
	mustPublish(t, fresh, tripPolicy(wire.Closed, 100, 0.5, 20, 30*time.Second, redisNow(t, rdb).Add(-time.Second)))
	for i := range 2000 {
		// s s f s f s ... : after n calls, at most (n-1)/2 failures.
		o := protocol.Success
		if i >= 2 && i%2 == 0 {
			o = protocol.Failure
		}
		if _, err := fresh.Release(ctx, "", 0, o, 1); err != nil {
			t.Fatal(err)
		}
	}
	w, _ := mustWindow(t, fresh, 30*time.Second, time.Time{})
	if got := mustRead(t, fresh); got.State != wire.Closed {
		t.Fatalf("failures just below half from the first call: state %s, want Closed", got.State)
	}
	if w.Failures != 999 || w.Calls != 2000 {
		t.Errorf("window %d failures of %d calls, want 999 of 2000", w.Failures, w.Calls)
	}
}

// TestPoolTripAnswersOpen: a batch-mode refresh whose aggregated report
// crosses the rule trips the breaker (pool.lua, lib.lua trip) and answers
// the Open it wrote in the same round trip: the pool holds nothing more and
// is told to drop what it holds.
func TestPoolTripAnswersOpen(t *testing.T) {
	t.Parallel()
	_, rdb := sharedStandalone(t)
	c := newClient(t, rdb)
	mustPublish(t, c, tripPolicy(wire.Closed, 8, 0.5, 10, 30*time.Second, redisNow(t, rdb).Add(-time.Minute)))
	first, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: "1", TTL: time.Minute, Want: 4})
	if err != nil {
		t.Fatal(err)
	}
	if first.State != wire.Closed || len(first.Granted) == 0 {
		t.Fatalf("first refresh: %s, %d granted; want Closed with slots", first.State, len(first.Granted))
	}
	var r protocol.Report
	for range 6 {
		r.Add(protocol.Failure, 1, -1)
	}
	for range 4 {
		r.Add(protocol.Success, 1, -1)
	}
	got, err := c.Pool(ctxT(t), protocol.PoolArgs{PoolID: "p", RequestID: "2", TTL: time.Minute, Want: 4, Held: first.Granted, Report: r})
	if err != nil {
		t.Fatal(err)
	}
	if got.State != wire.Open || got.Limit != 0 || got.Share != 0 || len(got.Granted) != 0 {
		t.Errorf("the refresh that tripped answered %s, limit %d, share %d, %d granted; want Open, 0, 0, none", got.State, got.Limit, got.Share, len(got.Granted))
	}
	if p := mustRead(t, c); p.State != wire.Open || p.TrippedFrom != wire.Closed || p.TrippedAt.IsZero() {
		t.Errorf("stored %s, tripped from %q at %v; want Open, from Closed", p.State, p.TrippedFrom, p.TrippedAt)
	}
}
