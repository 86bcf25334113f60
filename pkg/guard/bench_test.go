package guard_test

import (
	"context"
	"math/rand/v2"
	"runtime"
	"strconv"
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
