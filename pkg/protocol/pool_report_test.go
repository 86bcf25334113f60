package protocol_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// TestPoolReportEqualsPerCallReleases: the same outcomes, released one by one
// on one dependency and reported aggregated by pool calls on another, give
// the same window, exactly; and the reported stats hash is kept (expiry)
// as release keeps it.
func TestPoolReportEqualsPerCallReleases(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		perCall, pooled := newClient(t, rdb), newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, perCall, policy(1000))
		mustPublish(t, pooled, policy(1000))
		rng := rand.New(rand.NewPCG(7, 23))
		outcomes := []protocol.Outcome{protocol.Success, protocol.Success, protocol.Failure, protocol.Timeout, protocol.Cancelled}
		var rep protocol.Report
		for i := range 300 {
			o := outcomes[rng.IntN(len(outcomes))]
			attempt := 1 + rng.IntN(6)
			took := time.Duration(-1)
			if rng.IntN(3) > 0 {
				took = time.Duration(rng.Int64N(int64(2 * time.Second)))
			}
			a := mustAdmit(t, perCall, 10*time.Second)
			if _, err := perCall.ReleaseTimed(ctx, a.Member, 0, o, attempt, took); err != nil {
				t.Fatal(err)
			}
			rep.Add(o, attempt, took)
			if i%37 == 36 { // a report every few calls, as a pool refreshes
				if _, err := pooled.Pool(ctx, protocol.PoolArgs{PoolID: "p", RequestID: fmt.Sprint(i), TTL: time.Second, Report: rep}); err != nil {
					t.Fatal(err)
				}
				rep = protocol.Report{}
			}
		}
		if _, err := pooled.Pool(ctx, protocol.PoolArgs{PoolID: "p", RequestID: "last", TTL: time.Second, Report: rep}); err != nil {
			t.Fatal(err)
		}
		want, _ := mustWindow(t, perCall, time.Minute, time.Time{})
		got, _ := mustWindow(t, pooled, time.Minute, time.Time{})
		if want.Calls == 0 || want.TimedSuccesses == 0 {
			t.Fatalf("per-call window %+v counts nothing", want)
		}
		if got != want {
			t.Errorf("window after aggregated reports = %+v, want the per-call window %+v", got, want)
		}
		if ttl, err := rdb.TTL(ctx, pooled.Keys().Stats).Result(); err != nil || ttl <= 0 {
			t.Errorf("reported stats hash TTL = %v (%v), want the expiry release sets", ttl, err)
		}
	})
}

// TestPoolReportAdd: Add counts as release does.
func TestPoolReportAdd(t *testing.T) {
	t.Parallel()
	var r protocol.Report
	r.Add(protocol.Success, 0, 1500*time.Nanosecond)
	r.Add(protocol.Success, 9, -1)
	r.Add(protocol.Timeout, 3, time.Second)
	r.Add(protocol.Cancelled, 1, time.Second)
	want := protocol.Report{Successes: 2, Timeouts: 1, ByAttempt: [4]int64{1, 0, 1, 1}, SuccessMicros: 1, TimedSuccesses: 1}
	if r != want {
		t.Errorf("Report = %+v, want %+v", r, want)
	}
	var m protocol.Report
	m.Merge(r)
	m.Merge(r)
	if m.Calls() != 6 || m.ByAttempt[3] != 2 || m.IsZero() || !(protocol.Report{}).IsZero() {
		t.Errorf("merged twice = %+v, want every count doubled", m)
	}
}

// TestPoolRateTokensKeepTheFleetRate: pools leasing rate tokens in batches
// and a per-call worker share one rate limit. Every start (a per-call
// admission, or a pool's token spent at the worst time its window allows)
// is counted per sliding 1 s window: none holds more than the per-call GCRA
// bound, rate + burst.
func TestPoolRateTokensKeepTheFleetRate(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		const rate = 200 // interval 5 ms, burst 20, spread 95 ms
		c := newClient(t, rdb)
		p := policy(100_000)
		p.RatePerSecond = rate
		mustPublish(t, c, p)
		interval := time.Duration(protocol.RateInterval(rate)) * time.Microsecond
		burst := protocol.RateBurst(rate)

		target := redisNow(t, rdb).Add(150 * time.Millisecond)
		ctx, cancel := context.WithTimeout(ctxT(t), 1300*time.Millisecond)
		defer cancel()
		var mu sync.Mutex
		var starts []time.Time // Redis time
		var pooled, perCall int
		var wg sync.WaitGroup
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for n := 0; ctx.Err() == nil; n++ {
					r, err := c.Pool(ctx, protocol.PoolArgs{PoolID: fmt.Sprint("pool", i), RequestID: fmt.Sprint(n),
						TTL: time.Second, Tokens: 8, TokenLead: 2 * time.Millisecond})
					if err != nil {
						return
					}
					mu.Lock()
					for j := range r.Tokens.Count {
						// The adversary's spending: every token as late as
						// it may be, except those due after the end of the
						// target window, spent as early as they may be, so
						// that as many as possible fall into that window.
						from, until := r.Tokens.Window(j)
						at := until
						if !until.Before(target.Add(time.Second)) {
							at = from
						}
						starts = append(starts, at)
						pooled++
					}
					mu.Unlock()
					time.Sleep(10 * time.Millisecond)
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Second})
				if err != nil {
					return
				}
				switch a.Code {
				case protocol.Admitted:
					mu.Lock()
					starts = append(starts, a.Now)
					perCall++
					mu.Unlock()
					_, _ = c.Release(ctx, a.Member, 0, protocol.Cancelled, 1)
					time.Sleep(8 * time.Millisecond) // leave the pools a part
				case protocol.RefusedRate:
					time.Sleep(a.Wait)
				}
			}
		}()
		wg.Wait()

		slices.SortFunc(starts, func(a, b time.Time) int { return a.Compare(b) })
		// Per-call starts are Redis time truncated to the ms: a window of
		// 1 s of recorded times spans at most 1 s + 1 ms of true times.
		bound := int((time.Second+time.Millisecond)/interval) + int(burst)
		most := 0
		for i, j := 0, 0; i < len(starts); i++ {
			for starts[j].Before(starts[i].Add(-time.Second)) {
				j++
			}
			most = max(most, i-j+1)
		}
		t.Logf("%d pooled and %d per-call starts; at most %d in a 1 s window, bound %d", pooled, perCall, most, bound)
		if most > bound {
			t.Errorf("%d starts in a 1 s window, more than rate + burst = %d", most, bound)
		}
		if pooled < 50 || perCall < 10 {
			t.Errorf("%d pooled and %d per-call starts: the test did not exercise both", pooled, perCall)
		}
		if len(starts) < rate {
			t.Errorf("%d starts in 1.3 s at %d/s: the tokens are wasted", len(starts), rate)
		}
	})
}

// TestPoolRateTokens: a batch takes as many tokens as per-call GCRA would
// admit at once (the burst) less those due within the lead (at 1000/s, a
// 3 ms lead skips 3), each usable from its due time less the spread until
// its due time, and at least the lead after the script ran; low rates
// (burst 1) and no rate limit grant none.
func TestPoolRateTokens(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		ctx := ctxT(t)
		for _, tc := range []struct {
			rate, ask, want int64
		}{{1000, 500, 97}, {1000, 7, 7}, {10, 5, 0}, {0, 5, 0}} {
			c := newClient(t, rdb)
			p := policy(10)
			p.RatePerSecond = tc.rate
			mustPublish(t, c, p)
			lead := 3 * time.Millisecond
			r, err := c.Pool(ctx, protocol.PoolArgs{PoolID: "p", RequestID: "1", TTL: time.Second, Tokens: tc.ask, TokenLead: lead})
			if err != nil {
				t.Fatal(err)
			}
			tok := r.Tokens
			if tok.Count != tc.want {
				t.Errorf("rate %d asking %d: %d tokens, want %d", tc.rate, tc.ask, tok.Count, tc.want)
			}
			if tc.rate == 0 {
				if tok.Interval != 0 {
					t.Errorf("no rate limit: interval %v, want 0", tok.Interval)
				}
				continue
			}
			if tok.Interval != time.Duration(protocol.RateInterval(tc.rate))*time.Microsecond ||
				tok.Spread != time.Duration(protocol.RateBurst(tc.rate)-1)*tok.Interval {
				t.Errorf("rate %d: interval %v spread %v", tc.rate, tok.Interval, tok.Spread)
			}
			if tok.Count == 0 {
				continue
			}
			from, until := tok.Window(0)
			if until.Before(r.Now.Add(lead)) || from.After(r.Now.Add(time.Millisecond)) {
				t.Errorf("rate %d: first token usable [%v, %v], script ran at %v: want usable now and for the lead", tc.rate, from, until, r.Now)
			}
			// The stored arrival time moved past the batch's last token,
			// where per-call admissions continue.
			got, err := rdb.Get(ctx, c.Keys().GCRA).Int64()
			if want := tok.First.Add(time.Duration(tok.Count) * tok.Interval).UnixMicro(); err != nil || got != want {
				t.Errorf("rate %d: gcra = %d (%v) after the batch, want %d", tc.rate, got, err, want)
			}
		}
	})
}
