package controllers

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestDeadManOpenAdmitsProbes stops the only manager while the breaker is
// Open. Workers keep refusing until the dead-man bound has passed since the
// last publication (the bound runs from open_until_ms for an Open state);
// then they admit calls as if HalfOpen, at most halfOpenProbes in flight at a
// time, until a manager publishes again.
func TestDeadManOpenAdmitsProbes(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	opts := testOptions
	opts.StaleAfter = 2 * time.Second
	m := startManager(t, ns, managerRedis(srv), opts)
	w := newWorker(t, srv, ns, "inventory")
	spec := testSpec()
	spec.Breaker.OpenDuration = metav1.Duration{Duration: 3 * time.Second}
	createPolicy(t, ns, "inventory", spec)
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))

	g.Expect(w.report(g, minCalls, protocol.Failure)).To(Equal(minCalls))
	g.Eventually(w.stateLimit()).WithPolling(5 * time.Millisecond).Should(Equal("Open/0"))
	// The workers may have tripped the breaker in their path: the Open under
	// test is the manager's own, so wait for it to take the trip over (a
	// trip no manager takes over ends by the workers' probes instead,
	// pkg/protocol TestOrphanTripEndsByItself).
	g.Eventually(func(g Gomega) bool { return w.published(g).TripPending() }).Should(BeFalse())
	m.stop(t)
	last := w.published(g)
	g.Expect(last.State).To(Equal(wire.Open), "the manager stopped while Open")
	g.Expect(last.HalfOpenProbes).To(Equal(int64(3)))
	// The plan's time is the window read's, a moment before the write's.
	g.Expect(last.StaleAfter).To(BeNumerically("~", 2*time.Second+last.OpenUntil.Sub(last.UpdatedAt), 50*time.Millisecond),
		"the bound runs from open_until_ms")
	stale := last.UpdatedAt.Add(last.StaleAfter)

	acquire := func() protocol.Admission {
		adm, err := w.c.Acquire(ctx, protocol.AcquireArgs{LeaseID: leaseID(), TTL: time.Minute})
		g.Expect(err).NotTo(HaveOccurred())
		return adm
	}
	g.Expect(acquire().Code).To(Equal(protocol.RefusedOpen), "refused before the bound")

	// Redis runs on this host: its clock is the test's.
	var first protocol.Admission
	g.Eventually(func() protocol.Code {
		first = acquire()
		return first.Code
	}).WithTimeout(15 * time.Second).WithPolling(20 * time.Millisecond).Should(Equal(protocol.Admitted))
	g.Expect(time.Now()).To(BeTemporally(">=", stale.Add(-50*time.Millisecond)), "admitted before the bound")

	// At most halfOpenProbes in flight at a time, not per epoch.
	held := []protocol.Admission{first, acquire(), acquire()}
	for _, a := range held {
		g.Expect(a.Code).To(Equal(protocol.Admitted))
	}
	g.Expect(acquire().Code).NotTo(Equal(protocol.Admitted), "a fourth call while three are in flight")
	_, err := w.c.Release(ctx, held[0].Member, 0, protocol.Success, 1)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(acquire().Code).To(Equal(protocol.Admitted), "a released probe makes room for the next")

	// A manager that runs again takes over from the published state.
	startManager(t, ns, managerRedis(srv), opts)
	g.Eventually(func(g Gomega) bool { return w.published(g).UpdatedAt.After(last.UpdatedAt) }).Should(BeTrue())
	g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"))
}
