package controllers

import (
	"context"
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestWorkersTripTheBreaker: real workers (pkg/guard) whose calls fail trip
// the fleet's breaker as they report the failures, while the controller's
// evaluation is held between its read and its publish: the minCalls-th
// failure publishes Open, and the next call is refused without reaching the
// dependency, with no evaluation in between (the epoch is the one the
// controller published). The held publish, planned from the Closed it read,
// is refused instead of undoing the trip; the controller plans again from
// the trip and takes it over: the next epoch, the breaker open as of the
// trip, status Open and a Warning Event Opened that says the workers
// tripped it.
func TestWorkersTripTheBreaker(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	w := newWorker(t, srv, ns, "search")

	hook := newPublishHook()
	rdb := managerRedis(srv)
	rdb.AddHook(hook)
	opts := testOptions
	opts.RedisTimeout = 10 * time.Second // the held publish must not time out
	startReconciler(t, env.Config, ns, &Evaluator{Redis: rdb, Options: opts}, &PolicyReconciler{Redis: rdb, Options: opts})
	spec := testSpec()
	spec.Breaker.OpenDuration = metav1.Duration{Duration: time.Hour} // status stays Open while the test looks
	createPolicy(t, ns, "search", spec)
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	g.Eventually(hook.lastReply).Should(Equal("written"))
	g.Eventually(func(g Gomega) bool { return w.published(g).Trip.On }).Should(BeTrue(), "the controller publishes the rule the workers trip by")

	// The controller reads and plans; its publish is held.
	hook.armed.Store(true)
	g.Eventually(hook.reached).Should(BeClosed())
	hook.mu.Lock()
	heldReply := len(hook.replies)
	hook.mu.Unlock()
	before := w.published(g)

	gd, err := guard.New(srv.Client(func(o *redis.Options) { o.ContextTimeoutEnabled = true }), ns+"/search", guard.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	defer gd.Close()
	calls := 0
	down := errors.New("connection refused")
	call := func(context.Context) error { calls++; return down }
	ctx := context.Background()
	for range minCalls {
		g.Expect(gd.Do(ctx, guard.Job{Attempt: 1}, call)).To(MatchError(down))
	}
	tripped := w.published(g)
	g.Expect(tripped.State).To(Equal(wire.Open), "the %d-th failure trips the breaker", minCalls)
	g.Expect(tripped.Limit).To(BeZero())
	g.Expect(tripped.Epoch).To(Equal(before.Epoch), "no evaluation ran: the workers tripped it")
	g.Expect(tripped.TrippedFrom).To(Equal(wire.Closed))
	g.Expect(tripped.TrippedAt).To(BeTemporally(">", before.UpdatedAt))
	err = gd.Do(ctx, guard.Job{Attempt: 1}, call)
	g.Expect(err).To(HaveOccurred())
	g.Expect(calls).To(Equal(minCalls), "a call after the trip reached the dependency")

	// The held publish, planned from Closed, is refused; the controller
	// plans again from the trip.
	close(hook.release)
	g.Eventually(hook.reply(heldReply)).Should(Equal("refused"), "a plan that did not see the trip undid it")
	g.Eventually(func(g Gomega) int64 { return w.published(g).Epoch }).Should(Equal(before.Epoch + 1))
	taken := w.published(g)
	g.Expect(taken.State).To(Equal(wire.Open))
	g.Expect(taken.Trip.Acknowledged).To(Equal(tripped.TrippedAt))
	g.Expect(taken.BreakerSince).To(Equal(tripped.TrippedAt), "the breaker opened as of the trip")
	g.Expect(taken.OpenUntil).To(Equal(tripped.TrippedAt.Add(time.Hour)), "openDuration counts from the trip")
	g.Expect(taken.Trip.On).To(BeFalse(), "nothing trips an Open breaker")

	g.Eventually(func(g Gomega) spillwayv1alpha1.DependencyState { return getPolicy(g, ns, "search").Status.State }).Should(Equal(spillwayv1alpha1.StateOpen))
	g.Eventually(conditionOf(ns, "search", ConditionBreakerOpen)).Should(HavePrefix("True/"))
	g.Eventually(func(g Gomega) []string {
		var list eventsv1.EventList
		g.Expect(env.Client.List(context.Background(), &list, client.InNamespace(ns))).To(Succeed())
		var notes []string
		for _, e := range list.Items {
			if e.Regarding.Name == "search" && e.Reason == EventOpened && e.Type == corev1.EventTypeWarning {
				notes = append(notes, e.Note)
			}
		}
		return notes
	}).Should(ContainElement(ContainSubstring("tripped the breaker in the fleet's path")))
}
