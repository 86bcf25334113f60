package guard_test

import (
	"context"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// BenchmarkAcquireRelease measures acquire+release pairs through the guard
// with 64 goroutines against one local Redis, beside bare EVALSHAs of a no-op
// script over the same client in the same run. Compare "guard-pair" with
// "noop-pair" (two no-op round trips, the floor for two round trips) and with
// "noop" (one).
func BenchmarkAcquireRelease(b *testing.B) {
	srv := redistest.Start(b)
	rdb := srv.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.PoolSize = 64
	})
	d, _ := protocol.ParseDependency(dep)
	proto, _ := protocol.NewClient(rdb, d)
	p := defaultPublished(1 << 20)
	if _, err := proto.Publish(context.Background(), p); err != nil {
		b.Fatal(err)
	}
	g, err := guard.New(rdb, dep, guard.Options{RedisTimeout: 0})
	if err != nil {
		b.Fatal(err)
	}
	parallelism := max(64/runtimeProcs(), 1)

	b.Run("noop", func(b *testing.B) {
		b.SetParallelism(parallelism)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := proto.Noop(context.Background()); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
	b.Run("noop-pair", func(b *testing.B) {
		b.SetParallelism(parallelism)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := proto.Noop(context.Background()); err != nil {
					b.Error(err)
					return
				}
				if err := proto.Noop(context.Background()); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
	b.Run("guard-pair", func(b *testing.B) {
		b.SetParallelism(parallelism)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				permit, err := g.Acquire(context.Background(), guard.Job{})
				if err != nil {
					b.Error(err)
					return
				}
				if err := permit.Done(nil); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}

func runtimeProcs() int { return runtime.GOMAXPROCS(0) }

func BenchmarkProtocolPair(b *testing.B) {
	srv := redistest.Start(b)
	rdb := srv.Client(func(o *redis.Options) { o.ContextTimeoutEnabled = true; o.PoolSize = 64 })
	d, _ := protocol.ParseDependency(dep)
	proto, _ := protocol.NewClient(rdb, d)
	if _, err := proto.Publish(context.Background(), defaultPublished(1<<20)); err != nil {
		b.Fatal(err)
	}
	b.SetParallelism(32)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			a, err := proto.Acquire(context.Background(), protocol.AcquireArgs{LeaseID: "x" + strconv.Itoa(rand.Int()), TTL: time.Second})
			if err != nil {
				b.Error(err)
				return
			}
			if _, err := proto.Release(context.Background(), a.Member, a.Epoch, protocol.Success, 1); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkBatchDo measures what the guard adds to a call: Do in batch mode
// (a local slot, no round trip) beside Do per call (two round trips) and a
// bare call of the same function, in one run against one local Redis. The
// serial cases are one goroutine (the overhead per call); the parallel
// ones 64 goroutines (the throughput of one process), with Redis's CPU per
// call. Every Do is a real guarded call: the batch guard's pool leases its
// slots from Redis and reports their outcomes.
func BenchmarkBatchDo(b *testing.B) {
	srv := redistest.Start(b)
	rdb := srv.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.PoolSize = 64
	})
	admin := srv.Client()
	d, _ := protocol.ParseDependency(dep)
	proto, _ := protocol.NewClient(rdb, d)
	if _, err := proto.Publish(context.Background(), defaultPublished(1<<20)); err != nil {
		b.Fatal(err)
	}
	perCall, err := guard.New(rdb, dep, guard.Options{})
	if err != nil {
		b.Fatal(err)
	}
	batch, err := guard.New(rdb, dep, guard.Options{Batch: guard.BatchOptions{Enabled: true}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(batch.Close)
	fn := ok
	bare := func(ctx context.Context) error { return fn(ctx) }
	cases := []struct {
		name string
		call func(context.Context) error
	}{
		{"bare", bare},
		{"per-call", func(ctx context.Context) error { return perCall.Do(ctx, guard.Job{}, fn) }},
		{"batch", func(ctx context.Context) error { return batch.Do(ctx, guard.Job{}, fn) }},
	}
	for _, c := range cases {
		b.Run(c.name+"/serial", func(b *testing.B) {
			cpu := redisCPUGuard(b, admin)
			for b.Loop() {
				if err := c.call(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
			reportRedisCPU(b, redisCPUGuard(b, admin)-cpu)
		})
		b.Run(c.name+"/64-goroutines", func(b *testing.B) {
			cpu := redisCPUGuard(b, admin)
			b.SetParallelism(max(64/runtimeProcs(), 1))
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := c.call(context.Background()); err != nil {
						b.Error(err)
						return
					}
				}
			})
			reportRedisCPU(b, redisCPUGuard(b, admin)-cpu)
		})
	}
}

// redisCPUGuard is the CPU time the server has used, user plus system.
func redisCPUGuard(b *testing.B, admin *redis.Client) time.Duration {
	info, err := admin.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		k, v, found := strings.Cut(strings.TrimSpace(line), ":")
		if found && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// reportRedisCPU reports calls/s and the server's CPU per call.
func reportRedisCPU(b *testing.B, cpu time.Duration) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
	b.ReportMetric(cpu.Seconds()*1e6/float64(b.N), "redis-µs/call")
}
