package protocol_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// BenchmarkScriptDurations measures how long single script runs hold Redis
// in the cases that used to grow with the hash or the window (docs/protocol.md
// §4 "prune", "Cached totals" and "Minute totals"): each case runs on a
// server of its own with every command logged by SLOWLOG, and reports the
// longest and the median EVALSHA it logged, in µs of wall-clock time inside
// Redis (max-µs, median-µs), and the longest and the median CPU time Redis
// used around each one (max-cpu-µs, median-cpu-µs: the difference of
// used_cpu_user + used_cpu_sys, which adds the INFO commands that read it
// but not the time Redis waited for a core on a loaded machine). One
// iteration is the whole case:
//
//	go test -run '^$' -bench ScriptDurations -benchtime 1x -count 3 ./pkg/protocol/
func BenchmarkScriptDurations(b *testing.B) {
	for _, bc := range []struct {
		name string
		run  func(b *testing.B, s *slowlog, rdb *redis.Client)
	}{
		{"window-1h-3000s-after-transition", benchWindowAfterTransition},
		{"window-1h-cold", benchColdRead(false, false)},
		{"budget-1h-cold", benchColdRead(true, false)},
		{"window-1h-cold-second-by-second", benchColdRead(false, true)},
		{"budget-1h-cold-second-by-second", benchColdRead(true, true)},
		{"release-writing-minute-totals", benchMinuteTotals},
		{"sweep-2h-behind-by-window", benchSweep(false)},
		{"sweep-2h-behind-by-release", benchSweep(true)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var all, cpu []time.Duration
			for range b.N {
				srv := redistest.Start(b, redistest.WithArgs("--slowlog-log-slower-than", "0", "--slowlog-max-len", "100000"))
				rdb := srv.Client()
				s := &slowlog{rdb: rdb}
				bc.run(b, s, rdb)
				all = append(all, s.durations...)
				cpu = append(cpu, s.cpu...)
			}
			if len(all) == 0 {
				b.Fatal("no script run measured")
			}
			slices.Sort(all)
			slices.Sort(cpu)
			b.ReportMetric(float64(all[len(all)-1].Microseconds()), "max-µs")
			b.ReportMetric(float64(all[len(all)/2].Microseconds()), "median-µs")
			b.ReportMetric(float64(cpu[len(cpu)-1].Microseconds()), "max-cpu-µs")
			b.ReportMetric(float64(cpu[len(cpu)/2].Microseconds()), "median-cpu-µs")
			b.ReportMetric(float64(len(all))/float64(b.N), "runs/op")
		})
	}
}

// slowlog collects the durations of the EVALSHAs that measured logs, and the
// server's CPU time around each measured call.
type slowlog struct {
	rdb       *redis.Client
	durations []time.Duration
	cpu       []time.Duration
}

// measured runs f, which must run one script.
func (s *slowlog) measured(b *testing.B, f func()) {
	ctx := context.Background()
	if err := s.rdb.Do(ctx, "SLOWLOG", "RESET").Err(); err != nil {
		b.Fatal(err)
	}
	cpu0 := redisCPU(b, s.rdb)
	f()
	s.cpu = append(s.cpu, redisCPU(b, s.rdb)-cpu0)
	entries, err := s.rdb.SlowLogGet(ctx, -1).Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, e := range entries {
		if len(e.Args) > 0 && e.Args[0] == "evalsha" {
			s.durations = append(s.durations, e.Duration)
		}
	}
}

// benchWindowAfterTransition: a 1 h window over an hour of counters, 3,000 s
// after a transition, read once in each of five seconds.
func benchWindowAfterTransition(b *testing.B, s *slowlog, rdb *redis.Client) {
	c := newClient(b, rdb)
	p := policy(10)
	p.BreakerWindow = time.Hour
	mustPublish(b, c, p)
	now := redisNow(b, rdb).Unix()
	fillSeconds(b, rdb, c.Keys().Stats, now-3650, now-1, allSuffixes, 3)
	from := time.Unix(now-3000, 0)
	mustWindow(b, c, time.Hour, from)
	sec := now
	for range 5 {
		sec = nextSecond(b, rdb, sec)
		s.measured(b, func() { mustWindow(b, c, time.Hour, from) })
	}
}

// benchColdRead: the first read of a 1 h window (budget: the first decision
// over a 1 h budget window, or one after 50 s without any) over an hour of
// counters, when no cached totals can be moved forward; with the minute
// totals that live reports keep, or (secondBySecond) without them, as a hash
// written before they existed is read.
func benchColdRead(budget, secondBySecond bool) func(b *testing.B, s *slowlog, rdb *redis.Client) {
	return func(b *testing.B, s *slowlog, rdb *redis.Client) {
		c := newClient(b, rdb)
		p := policy(10)
		p.BreakerWindow, p.Budget.Window = time.Hour, time.Hour
		mustPublish(b, c, p)
		now := redisNow(b, rdb).Unix()
		fillSeconds(b, rdb, c.Keys().Stats, now-3650, now-1, allSuffixes, 3)
		if !secondBySecond {
			rollUp(b, rdb, c.Keys().Stats, now-now%60-3720, now-now%60) // as live reports leave it
		}
		if budget {
			if _, err := c.RetryBudget(context.Background()); err != nil {
				b.Fatal(err)
			}
		} else {
			mustWindow(b, c, time.Hour, time.Time{}) // loads the script
		}
		for range 3 {
			if err := rdb.HDel(context.Background(), c.Keys().Stats, "budget_upto", "window_upto").Err(); err != nil {
				b.Fatal(err)
			}
			s.measured(b, func() {
				if budget {
					if _, err := c.RetryBudget(context.Background()); err != nil {
						b.Fatal(err)
					}
				} else {
					mustWindow(b, c, time.Hour, time.Time{})
				}
			})
		}
	}
}

// benchSweep: two hours of counters (nine a second) behind a cursor that
// lags two hours, pruned by window reads, or by releases alone (three a
// round, one per outcome, each the first of its second and so pruning).
func benchSweep(byRelease bool) func(b *testing.B, s *slowlog, rdb *redis.Client) {
	return func(b *testing.B, s *slowlog, rdb *redis.Client) {
		ctx := context.Background()
		c := newClient(b, rdb)
		p := policy(1_000_000)
		mustPublish(b, c, p)
		mustWindow(b, c, p.BreakerWindow, time.Time{})
		key := c.Keys().Stats
		now := redisNow(b, rdb).Unix()
		fillSeconds(b, rdb, key, now-7200, now-1, allSuffixes, 1)
		if err := rdb.HSet(ctx, key, "pruned", now-7300).Err(); err != nil {
			b.Fatal(err)
		}
		for deadline := time.Now().Add(3 * time.Minute); ; {
			if n, err := rdb.HLen(ctx, key).Result(); err != nil {
				b.Fatal(err)
			} else if n < 2000 {
				return
			}
			if time.Now().After(deadline) {
				b.Fatal("the sweep did not finish in 3 minutes")
			}
			if !byRelease {
				s.measured(b, func() { mustWindow(b, c, p.BreakerWindow, time.Time{}) })
				continue
			}
			for _, o := range []protocol.Outcome{protocol.Success, protocol.Failure, protocol.Timeout} {
				s.measured(b, func() {
					if _, err := c.Release(ctx, "", 0, o, 1); err != nil {
						b.Fatal(err)
					}
				})
			}
			if byRelease {
				time.Sleep(time.Duration(1e9 - time.Now().UnixNano()%1e9)) // the next second's first counts prune
			}
		}
	}
}

// benchMinuteTotals: the first release of a minute, which writes the totals
// of the previous minute (every counter in each of its seconds), five times.
func benchMinuteTotals(b *testing.B, s *slowlog, rdb *redis.Client) {
	ctx := context.Background()
	c := newClient(b, rdb)
	mustPublish(b, c, policy(1_000_000))
	key := c.Keys().Stats
	if _, err := c.Release(ctx, "", 0, protocol.Success, 1); err != nil { // loads the script
		b.Fatal(err)
	}
	for i := range int64(5) {
		now := redisNow(b, rdb).Unix()
		past := now - now%60 - 600 - 60*i
		fillSeconds(b, rdb, key, past, past+59, allSuffixes, 2)
		if err := rdb.HSet(ctx, key, "seen", past).Err(); err != nil {
			b.Fatal(err)
		}
		if err := rdb.HDel(ctx, key, fmt.Sprintf("%d:f", now), fmt.Sprintf("%d:f", now+1)).Err(); err != nil {
			b.Fatal(err)
		}
		s.measured(b, func() {
			if _, err := c.Release(ctx, "", 0, protocol.Failure, 1); err != nil {
				b.Fatal(err)
			}
		})
		if n, err := rdb.HLen(ctx, key).Result(); err != nil || n == 0 {
			b.Fatal(err)
		}
		if v, err := rdb.HGet(ctx, key, fmt.Sprintf("%d:ms", past)).Int64(); err != nil || v != 120 {
			b.Fatalf("minute total of s = %d (%v), want 120", v, err)
		}
	}
}
