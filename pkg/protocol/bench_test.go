package protocol_test

import (
	"context"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// The benchmarks run 64 goroutines over one client (b.SetParallelism makes
// parallelism × GOMAXPROCS goroutines: 32 × 2 on a 2-core machine) against
// one dependency, so every script runs on the one Redis core that owns the
// dependency's hash slot.
//
// Compare per round trip: one op of BenchmarkAcquireRelease is an Acquire and
// a Release (two EVALSHAs that do the work), one op of BenchmarkNoopEvalSha is
// two EVALSHAs of a script that returns at once, over a client built the same
// way. Both report pairs/s (ops/s); their ratio is the share of the plain
// round-trip rate that the protocol's work leaves.
//
//	go test -run '^$' -bench . -benchmem -count=1 ./pkg/protocol/
const benchGoroutines = 64

const benchPoolSize = 2 * benchGoroutines

func benchParallelism() int { return max(1, benchGoroutines/runtime.GOMAXPROCS(0)) }

// benchStandalone returns a client of the shared standalone server, and an
// admin client of the server that owns dep (the same server).
func benchStandalone(b *testing.B) (rdb redis.UniversalClient, owner func(protocol.Dependency) *redis.Client) {
	srv, _ := sharedStandalone(b)
	admin := srv.Client()
	return srv.Client(func(o *redis.Options) { o.PoolSize = benchPoolSize }),
		func(protocol.Dependency) *redis.Client { return admin }
}

// benchCluster returns a client of the shared cluster, and an admin client of
// the master that owns dep's slot.
func benchCluster(b *testing.B) (rdb redis.UniversalClient, owner func(protocol.Dependency) *redis.Client) {
	cl, _ := sharedCluster(b)
	return cl.Client(func(o *redis.ClusterOptions) { o.PoolSize = benchPoolSize }),
		func(d protocol.Dependency) *redis.Client {
			nodes := cl.Nodes()
			return nodes[keySlot(protocol.KeysFor(d).State)*len(nodes)/16384].Client()
		}
}

// redisCPU is the CPU time the server has used, user plus system.
func redisCPU(b *testing.B, admin *redis.Client) time.Duration {
	info, err := admin.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// reportThroughput reports pairs/s, the server's CPU per pair and the share
// of one core it used, and the pairs/s one fully busy core would serve at that
// cost: the ceiling of one dependency (one slot, one core).
func reportThroughput(b *testing.B, cpu time.Duration) {
	secs := b.Elapsed().Seconds()
	b.ReportMetric(float64(b.N)/secs, "pairs/s")
	perPair := cpu.Seconds() / float64(b.N)
	b.ReportMetric(perPair*1e6, "redis-µs/pair")
	b.ReportMetric(100*cpu.Seconds()/secs, "redis-cpu%")
	if perPair > 0 {
		b.ReportMetric(1/perPair, "ceiling-pairs/s")
	}
}

// benchDep publishes a policy whose limit no run reaches, and loads the
// scripts.
func benchDep(b *testing.B, rdb redis.UniversalClient) *protocol.Client {
	c := newClient(b, rdb)
	ctx := context.Background()
	if _, err := c.Publish(ctx, policy(1_000_000_000)); err != nil {
		b.Fatal(err)
	}
	a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: "warm-up", TTL: time.Minute})
	if err != nil || a.Code != protocol.Admitted {
		b.Fatalf("warm-up acquire: %+v, %v", a, err)
	}
	if _, err := c.Release(ctx, a.Member, a.Epoch, protocol.Success, 1); err != nil {
		b.Fatal(err)
	}
	if err := c.Noop(ctx); err != nil {
		b.Fatal(err)
	}
	return c
}

var benchWorker atomic.Int64

func runAcquireRelease(b *testing.B, rdb redis.UniversalClient, owner func(protocol.Dependency) *redis.Client) {
	c := benchDep(b, rdb)
	admin := owner(c.Dependency())
	b.SetParallelism(benchParallelism())
	cpu0 := redisCPU(b, admin)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		prefix := "bench-" + strconv.FormatInt(benchWorker.Add(1), 10) + "-"
		for i := 0; pb.Next(); i++ {
			a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: prefix + strconv.Itoa(i), TTL: time.Minute})
			if err != nil || a.Code != protocol.Admitted {
				b.Errorf("Acquire = %+v, %v", a, err)
				return
			}
			if _, err := c.Release(ctx, a.Member, a.Epoch, protocol.Success, 1); err != nil {
				b.Errorf("Release: %v", err)
				return
			}
		}
	})
	b.StopTimer()
	reportThroughput(b, redisCPU(b, admin)-cpu0)
}

// BenchmarkAcquireRelease: one op = Acquire + Release on one standalone Redis.
func BenchmarkAcquireRelease(b *testing.B) {
	rdb, owner := benchStandalone(b)
	runAcquireRelease(b, rdb, owner)
}

// BenchmarkNoopEvalSha: one op = two EVALSHAs of the no-op script, the
// round-trip baseline of BenchmarkAcquireRelease.
func BenchmarkNoopEvalSha(b *testing.B) {
	rdb, owner := benchStandalone(b)
	c := benchDep(b, rdb)
	admin := owner(c.Dependency())
	b.SetParallelism(benchParallelism())
	cpu0 := redisCPU(b, admin)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			if err := c.Noop(ctx); err != nil {
				b.Errorf("Noop: %v", err)
				return
			}
			if err := c.Noop(ctx); err != nil {
				b.Errorf("Noop: %v", err)
				return
			}
		}
	})
	b.StopTimer()
	reportThroughput(b, redisCPU(b, admin)-cpu0)
}

// BenchmarkAcquireReleaseCluster: one op = Acquire + Release for one
// dependency on a 3-master cluster. One dependency is one hash slot, so only
// one master works: the single-slot ceiling.
func BenchmarkAcquireReleaseCluster(b *testing.B) {
	rdb, owner := benchCluster(b)
	runAcquireRelease(b, rdb, owner)
}
