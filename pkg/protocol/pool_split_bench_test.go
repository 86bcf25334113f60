package protocol_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// BenchmarkPoolSplit: what a refresh costs Redis when the fair split's cache
// cannot serve it (pool.lua pool_split: an HGETALL of every pool's entry in
// wants, then a sort), against the same refresh served by the cache, for
// 10, 100 and 500 batching processes. One op = one pool call; the pools
// refresh in turn from one goroutine (each entry stays live: every pool
// refreshes within the second), each holding 8 slots, asking for none more
// and reporting nothing. In the "uncached" cases the split field is
// deleted before each call (as a pool whose standing changed does); the
// HDEL is outside the script's time (INFO commandstats, EVALSHA) but inside
// the server's CPU (used_cpu). In the "flipping" cases every pool starts or
// stops waiting at each of its refreshes (it asks for one slot more than it
// holds, then for what it holds, with none free), which marks the split
// dirty every time: the worst case for the cache, bounded by recomputing it
// at most every 50 ms (pool.lua split_every_ms).
//
//	go test -run '^$' -bench BenchmarkPoolSplit -benchtime 5000x ./pkg/protocol/
func BenchmarkPoolSplit(b *testing.B) {
	for _, pools := range []int{10, 100, 500} {
		for _, mode := range []string{"cached", "uncached", "flipping"} {
			b.Run(fmt.Sprintf("pools%d-%s", pools, mode), func(b *testing.B) { benchSplit(b, pools, mode) })
		}
	}
}

func benchSplit(b *testing.B, pools int, mode string) {
	rdb, owner := benchStandalone(b)
	c := benchDep(b, rdb)
	ctx := context.Background()
	const held = 8
	if _, err := c.Publish(ctx, policy(int64(pools*held))); err != nil {
		b.Fatal(err)
	}
	members := make([][]string, pools)
	for i := range members {
		r, err := c.Pool(ctx, protocol.PoolArgs{PoolID: fmt.Sprint("split", i), RequestID: "fill", TTL: time.Minute, Want: held})
		if err != nil || len(r.Granted) != held {
			b.Fatalf("pool %d filled with %d of %d: %v", i, len(r.Granted), held, err)
		}
		members[i] = r.Granted
	}
	wants := c.Keys().Wants
	admin := owner(c.Dependency())
	admin.ConfigResetStat(ctx)
	cpu0 := redisCPU(b, admin)
	b.ResetTimer()
	for k := range b.N {
		i := k % pools
		if mode == "uncached" {
			if err := rdb.HDel(ctx, wants, "split").Err(); err != nil {
				b.Fatal(err)
			}
		}
		want := int64(held)
		if mode == "flipping" && (k/pools)%2 == 0 {
			want++
		}
		if _, err := c.Pool(ctx, protocol.PoolArgs{
			PoolID: fmt.Sprint("split", i), RequestID: strconv.Itoa(k), TTL: time.Minute,
			Held: members[i], Want: want,
		}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	cpu := redisCPU(b, admin) - cpu0
	b.ReportMetric(cpu.Seconds()/float64(b.N)*1e6, "redis-µs/pool-call")
	b.ReportMetric(evalshaMicros(b, admin), "script-µs/pool-call")
}
