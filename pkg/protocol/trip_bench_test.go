package protocol_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// BenchmarkAcquireReleaseFailing: one op = Acquire + Release of a failed
// call with the in-path trip on and a rule that never decides (minCalls out
// of reach), so every release runs lib.lua trip to the end: what a failure
// costs the hot path beside BenchmarkAcquireRelease's successes, which never
// look. Compare redis-µs/pair with it in the same run.
func BenchmarkAcquireReleaseFailing(b *testing.B) {
	rdb, owner := benchStandalone(b)
	runParallel(b, "pair", rdb, owner, acquireReleaseFailing, func(c *protocol.Client) {
		p := tripPolicy(wire.Closed, 1_000_000_000, 0.5, 1<<50, 30*time.Second, redisNow(b, rdb).Add(-time.Minute))
		if _, err := c.Publish(context.Background(), p); err != nil {
			b.Fatal(err)
		}
	})
}

func acquireReleaseFailing(ctx context.Context, c *protocol.Client) error {
	a, err := c.Acquire(ctx, protocol.AcquireArgs{LeaseID: protocol.NewLeaseID(), TTL: time.Minute})
	if err != nil || a.Code != protocol.Admitted {
		return fmt.Errorf("acquire = %+v, %w", a, err)
	}
	if _, err := c.Release(ctx, a.Member, 0, protocol.Failure, 1); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}
