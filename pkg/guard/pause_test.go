package guard_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// pauseAfterAcquire stops the client for d once an acquisition's reply came
// back, as a SIGSTOP or a frozen VM between the admission and the call
// would.
type pauseAfterAcquire struct {
	d     time.Duration
	armed *atomic.Bool
}

func (h pauseAfterAcquire) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h pauseAfterAcquire) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		for _, a := range cmd.Args() {
			if s, ok := a.(string); ok && strings.HasSuffix(s, ":callers") && h.armed.CompareAndSwap(true, false) {
				time.Sleep(h.d)
			}
		}
		return err
	}
}
func (h pauseAfterAcquire) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A process stopped between its admission and its call for longer than the
// lease may live does not make the call: another call may hold the slot by
// now (the fault campaign's sigstop/go-batch breach, seen 2 runs in 20). The
// job comes back as a lost lease.
func TestCallNotStartedAfterItsLeaseMayHaveExpired(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	gd := newGuard(t, rdb, guard.Options{LeaseTTL: 20 * time.Millisecond})
	g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "clock sampled")
	var armed atomic.Bool
	armed.Store(true)
	rdb.AddHook(pauseAfterAcquire{d: 40 * time.Millisecond, armed: &armed})
	called := false
	err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error { called = true; return nil })
	g.Expect(armed.Load()).To(BeFalse(), "the pause happened")
	g.Expect(called).To(BeFalse(), "the call started after its lease may have expired")
	wantDecision(t, err, guard.ActionDefer, guard.ErrLeaseLost)
	g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "the slot was released")
}
