package guard_test

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// A holder that never calls Done stops renewing after MaxCallLifetime: its
// context is cancelled then and its slot comes back within the lease TTL.
func TestAbandonedPermitStopsRenewingAfterItsLifetime(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	const lifetime, ttl = 400 * time.Millisecond, 150 * time.Millisecond
	gd := newGuard(t, rdb, guard.Options{LeaseTTL: ttl, MaxCallLifetime: lifetime})

	start := time.Now()
	p, err := gd.Acquire(t.Context(), guard.Job{})
	g.Expect(err).NotTo(HaveOccurred())
	time.Sleep(lifetime / 2)
	_, err = gd.Acquire(t.Context(), guard.Job{})
	wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)

	g.Eventually(p.Context().Done()).Within(lifetime + time.Second).Should(BeClosed())
	g.Expect(time.Since(start)).To(BeNumerically(">=", lifetime))
	g.Expect(context.Cause(p.Context())).To(MatchError(guard.ErrLifetimeExceeded))
	g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, ok) }).
		WithTimeout(ttl + time.Second).WithPolling(10 * time.Millisecond).Should(Succeed())
	g.Expect(time.Since(start)).To(BeNumerically("<", lifetime+ttl+time.Second))
}
