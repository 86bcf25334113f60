package controllers

import (
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/types"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// skewedClock is the wall clock moved by offset: the clock of a manager whose
// node is offset ahead of Redis's (behind when negative).
type skewedClock struct{ offset time.Duration }

func (c skewedClock) Now() time.Time { return time.Now().Add(c.offset) }

// TestEvaluatorDecidesByRedisTime runs the manager on a node whose clock is
// 40 s ahead of Redis's, then 40 s behind. Workers count outcomes by Redis
// seconds, so the evaluator must decide by Redis time too: minCalls
// failures trip the breaker in the fleet's path, the controller takes the
// trip over with open_until_ms openDuration after it in Redis time, and once probes close the breaker the failures that opened
// it are not counted again (they would reopen it).
func TestEvaluatorDecidesByRedisTime(t *testing.T) {
	t.Parallel()
	for _, skew := range []time.Duration{40 * time.Second, -40 * time.Second} {
		t.Run(fmt.Sprintf("manager clock %+v", skew), func(t *testing.T) {
			t.Parallel()
			g := NewWithT(t)
			ns := newNamespace(t)
			srv := redistest.Start(t)
			rdb := managerRedis(srv)
			r := &Evaluator{Redis: rdb, Options: testOptions, Clock: skewedClock{skew}}
			startReconciler(t, env.Config, ns, r, &PolicyReconciler{Redis: rdb, Options: testOptions, Clock: skewedClock{skew}})
			w := newWorker(t, srv, ns, "billing")
			spec := testSpec()
			createPolicy(t, ns, "billing", spec)
			g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))

			// The minCalls-th failure trips the breaker in the fleet's path;
			// the next minCalls are refused.
			g.Expect(w.report(g, 2*minCalls, protocol.Failure)).To(Equal(minCalls))
			g.Expect(w.stateLimit()(g)).To(Equal("Open/0"))
			// The controller takes the trip over, by Redis time whatever the
			// manager's clock says.
			var open protocol.Published
			g.Eventually(func(g Gomega) time.Time {
				open = w.published(g)
				return open.Trip.Acknowledged
			}).WithTimeout(5 * time.Second).WithPolling(5 * time.Millisecond).ShouldNot(BeZero())
			g.Expect(open.State).To(Equal(wire.Open))
			g.Expect(open.Trip.Acknowledged).To(Equal(open.TrippedAt))
			g.Expect(open.OpenUntil).To(Equal(open.TrippedAt.Add(spec.Breaker.OpenDuration.Duration)), "openDuration counts from the trip, in Redis time")
			g.Expect(open.OpenUntil.Sub(open.UpdatedAt)).To(BeNumerically("<=", spec.Breaker.OpenDuration.Duration),
				"open_until_ms is at most openDuration after the publication, in Redis time")

			g.Eventually(w.stateLimit()).Should(Equal("HalfOpen/3"))
			g.Expect(w.report(g, 3, protocol.Success)).To(Equal(3))
			var seen []string
			g.Eventually(func(g Gomega) string {
				s := w.stateLimit()(g)
				if len(seen) == 0 || seen[len(seen)-1] != s {
					seen = append(seen, s)
				}
				return s
			}).WithPolling(10*time.Millisecond).Should(Equal("Closed/40"), func() string { return fmt.Sprintf("states seen: %v", seen) })
			g.Expect(seen).NotTo(ContainElement("Open/0"), "the failures that opened the breaker reopened it: %v", seen)

			ev, ok := r.Evaluations.lastEvaluation(types.NamespacedName{Namespace: ns, Name: "billing"})
			g.Expect(ok).To(BeTrue())
			g.Expect(ev.Window.Failures).To(BeZero(), "failures counted in the window after the breaker closed")
		})
	}
}
