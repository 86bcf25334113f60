package protocol_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// BenchmarkPoolRefresh: one op = one pool call, made by 8 pools (64 in the
// last case; one a process) refreshing in turn on one standalone Redis, each one's calls
// sequential as a process's are. Each pool holds held slots, gives back
// churn of them and asks for as many again, and reports the outcomes of
// calls calls (a 50 ms refresh at 100,000 calls/s over 8 processes is 625
// calls a report); rate tokens too in the "rate" case. Reports the Redis
// CPU per pool call (INFO's used_cpu of the server: the script and the
// command's I/O), per guarded call those reports cover, and the script's
// own time per call (INFO commandstats).
//
//	go test -run '^$' -bench BenchmarkPoolRefresh -benchtime 20000x ./pkg/protocol/
func BenchmarkPoolRefresh(b *testing.B) {
	for _, tc := range []struct {
		name                string
		held, churn, tokens int64
		rate                int64
	}{
		{"held64-churn4", 64, 4, 0, 0},
		{"held8-churn0", 8, 0, 0, 0},
		{"held64-churn4-rate", 64, 4, 64, 1_000_000},
	} {
		b.Run(tc.name, func(b *testing.B) {
			benchPools(b, 8, tc.held, tc.churn, tc.tokens, tc.rate, 625)
		})
	}
	// A wider fleet: 64 processes of 8 slots, 78 calls a report (100,000
	// calls/s over 64 processes, 50 ms refreshes). The fair split is cached,
	// so a refresh does not read every process's entry.
	b.Run("pools64-held8-churn1", func(b *testing.B) {
		benchPools(b, 64, 8, 1, 0, 0, 78)
	})
}

func benchPools(b *testing.B, pools, held, churn, tokens, rate, calls int64) {
	rdb, owner := benchStandalone(b)
	c := benchDep(b, rdb)
	ctx := context.Background()
	p := policy(pools * held)
	p.RatePerSecond = rate
	if _, err := c.Publish(ctx, p); err != nil {
		b.Fatal(err)
	}
	var report protocol.Report
	for range calls {
		report.Add(protocol.Success, 1, 2*time.Millisecond)
	}
	// Each pool fills up to its slots first.
	members := make([][]string, pools)
	for i := range members {
		r, err := c.Pool(ctx, protocol.PoolArgs{PoolID: fmt.Sprint("bench", i), RequestID: "fill", TTL: time.Minute, Want: held})
		if err != nil || int64(len(r.Granted)) != held {
			b.Fatalf("pool %d filled with %d of %d: %v", i, len(r.Granted), held, err)
		}
		members[i] = r.Granted
	}
	admin := owner(c.Dependency())
	var wg sync.WaitGroup
	errs := make(chan error, pools)
	admin.ConfigResetStat(ctx)
	cpu0 := redisCPU(b, admin)
	b.ResetTimer()
	for i := range pools {
		n := b.N / int(pools)
		if int64(b.N)%pools > i {
			n++
		}
		wg.Go(func() {
			held := members[i]
			for k := range n {
				ret := held[:churn]
				r, err := c.Pool(ctx, protocol.PoolArgs{
					PoolID: fmt.Sprint("bench", i), RequestID: strconv.Itoa(k), TTL: time.Minute,
					Held: held[churn:], Return: ret, Want: int64(len(held)),
					Tokens: tokens, TokenLead: time.Millisecond, Report: report,
				})
				if err != nil {
					errs <- err
					return
				}
				held = append(append([]string(nil), held[churn:]...), r.Granted...)
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	cpu := redisCPU(b, admin) - cpu0
	perCall := cpu.Seconds() / float64(b.N)
	b.ReportMetric(perCall*1e6, "redis-µs/pool-call")
	b.ReportMetric(perCall*1e6/float64(calls), "redis-µs/guarded-call")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pool-calls/s")
	b.ReportMetric(evalshaMicros(b, admin), "script-µs/pool-call")
}

// evalshaMicros is the mean time Redis spent in an EVALSHA since the last
// CONFIG RESETSTAT (INFO commandstats): the script's own work, without the
// reading, parsing and writing of the command that used_cpu counts too.
func evalshaMicros(b *testing.B, admin *redis.Client) float64 {
	info, err := admin.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(info) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:"); ok {
			for _, kv := range strings.Split(rest, ",") {
				if v, ok := strings.CutPrefix(kv, "usec_per_call="); ok {
					f, _ := strconv.ParseFloat(v, 64)
					return f
				}
			}
		}
	}
	return 0
}
