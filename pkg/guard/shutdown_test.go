package guard_test

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// A worker that shuts down (Close, then exit) right after a Redis blip leaves
// no slot held: Close forgets the leases whose replies were never read before
// it stops, instead of leaving them to their lease TTL. Found by the fleet
// test's "0 leases left" assertion (issue 21 item 7).
func TestCloseForgetsTheLeasesStillWaiting(t *testing.T) {
	g := NewWithT(t)
	srv := redistest.Start(t)
	direct := fastClient(srv)
	publish(t, direct, defaultPublished(1))
	proxy := newSlowReplies(t, srv.Addr())
	viaProxy := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = viaProxy.Close() })
	slow, err := guard.New(viaProxy, dep, guard.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(slow.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "clock sampled")

	// The acquisition runs in Redis but its reply comes too late; from then
	// on requests are lost, so the forgetter cannot forget its lease.
	proxy.delay.Store(int64(600 * time.Millisecond))
	go func() {
		time.Sleep(100 * time.Millisecond)
		proxy.drop.Store(true)
	}()
	wantDecision(t, slow.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrRedisUnavailable)
	time.Sleep(300 * time.Millisecond)
	g.Expect(liveLeases(t, direct, slow)).To(Equal(int64(1)), "the unread acquisition holds the slot")

	proxy.drop.Store(false)
	proxy.delay.Store(0)
	start := time.Now()
	slow.Close()
	took := time.Since(start)
	g.Expect(liveLeases(t, direct, slow)).To(BeZero(), "Close left the unread lease held for its TTL")
	g.Expect(took).To(BeNumerically("<", 2*time.Second), "Close's drain is bounded")
	t.Logf("Close took %v", took.Round(time.Millisecond))
}
