// Package e2e replays an outage end to end on loopback: kube-apiserver and
// etcd (envtest) with the KEDA CRD, a real redis-server, the manager running
// the controller, a dependency HTTP server with a concurrency capacity that is
// cold after recovery and collapses under sustained overload, and worker
// goroutines that drain a backlog through the worker library while new jobs
// keep arriving.
package e2e

import (
	"context"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/types"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/replay"
)

// drainMargin is how much longer than predicted the backlog may take to
// drain: the prediction assumes calls start the instant a slot frees, while
// the replay's workers poll their queue and share two cores with the control
// plane.
const drainMargin = 1.5

func TestOutageReplay(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	start := time.Now()
	cp, err := replay.StartControlPlane(ctx, 200*time.Millisecond)
	g.Expect(err).NotTo(HaveOccurred())
	defer cp.Stop()

	w := replay.DefaultWorkload
	spec := replay.DefaultPolicy()
	fleet, err := cp.Install(ctx, w, spec, replay.DefaultMinReplicas, replay.DefaultMaxReplicas)
	g.Expect(err).NotTo(HaveOccurred())
	bound := int(spec.Capacity.Concurrency / spec.Consumers[0].SlotsPerReplica)
	g.Expect(cp.WaitBounded(ctx, w, fleet, bound)).To(Succeed())

	cfg := replay.DefaultConfig()
	res, err := replay.Run(ctx, cfg, fleet, func(s replay.Sample) { t.Log(s) })
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("with Spillway: backlog %d, drained in %.1fs (predicted %.1fs), second outages %d, peak %d in flight, %d over the limit; %d created = %d done + %d stale + %d superseded + %d pending (%d parked), lost %d",
		res.Backlog, res.DrainSeconds, res.PredictedDrainSeconds, res.SecondOutages, res.PeakInFlight, res.OverLimit,
		res.Created, res.Completed, res.Stale, res.Superseded, res.Pending, res.Parked, res.Lost)

	g.Expect(res.Backlog).To(BeNumerically(">", 100), "the outage left a backlog")
	g.Expect(res.SecondOutages).To(BeZero(), "no second outage")
	g.Expect(res.OverLimit).To(BeZero(), "the dependency never saw more calls than the limit in force")
	g.Expect(res.PeakInFlight).To(BeNumerically("<=", spec.Capacity.Concurrency))
	g.Expect(res.DrainSeconds).To(BeNumerically(">", 0), "the backlog drained")
	g.Expect(res.DrainSeconds).To(BeNumerically("<=", res.PredictedDrainSeconds*drainMargin), "within the predicted drain time and its margin")
	g.Expect(res.Lost).To(BeZero(), "every job is accounted for")
	g.Expect(res.Stale).To(BeNumerically(">", 0), "past-deadline jobs were dropped")
	g.Expect(res.Superseded).To(BeNumerically(">", 0), "superseded jobs were dropped")

	// While the breaker is Open or HalfOpen (and through the ramp after it) the
	// ScaledObject's minimum stays pinned at what the workload had when the
	// outage began; the test checks the Open and HalfOpen samples. The
	// evaluator publishes Open to Redis first and the policy reconciler pins
	// the ScaledObject after it, so a sample may catch Open with the user's
	// minimum still in place: the pin must be there within pinWithin of the
	// first Open sample, and then hold.
	const pinWithin = time.Second
	pinned, opened := -1, time.Duration(-1)
	for _, s := range res.Samples {
		g.Expect(s.MaxReplicas).To(BeNumerically("<=", bound), "the ScaledObject stays bounded to the capacity")
		if s.State != string(spillwayv1alpha1.StateOpen) && s.State != string(spillwayv1alpha1.StateHalfOpen) {
			continue
		}
		if opened < 0 {
			opened = s.At
		}
		if s.At-opened < pinWithin {
			if pinned < 0 && s.MinReplicas != replay.DefaultMinReplicas {
				pinned = s.MinReplicas
			}
			if pinned >= 0 {
				g.Expect(s.MinReplicas).To(Equal(pinned), "the minimum stays pinned through the outage (at %v)", s.At)
			}
			continue
		}
		if pinned < 0 {
			pinned = s.MinReplicas
		}
		g.Expect(s.MinReplicas).To(Equal(pinned), "the minimum stays pinned through the outage (at %v)", s.At)
	}
	g.Expect(pinned).To(BeNumerically(">=", replay.DefaultMinReplicas), "the breaker opened during the outage")
	t.Logf("minReplicaCount pinned at %d during the outage (user's minimum %d)", pinned, replay.DefaultMinReplicas)
	last := res.Samples[len(res.Samples)-1]
	g.Expect(last.State).To(Equal(string(spillwayv1alpha1.StateClosed)), "the ramp completed")
	g.Expect(last.MinReplicas).To(Equal(replay.DefaultMinReplicas), "the user's minimum came back")

	// Deleting the policy gives the user's ScaledObject back.
	var pol spillwayv1alpha1.DependencyPolicy
	g.Expect(cp.Env.Client.Get(ctx, types.NamespacedName{Namespace: w.Namespace, Name: w.Policy}, &pol)).To(Succeed())
	g.Expect(cp.Env.Client.Delete(ctx, &pol)).To(Succeed())
	g.Eventually(func(g Gomega) {
		var so kedav1alpha1.ScaledObject
		g.Expect(cp.Env.Client.Get(ctx, types.NamespacedName{Namespace: w.Namespace, Name: w.ScaledObject}, &so)).To(Succeed())
		g.Expect(so.Spec.MinReplicaCount).To(HaveValue(Equal(int32(replay.DefaultMinReplicas))))
		g.Expect(so.Spec.MaxReplicaCount).To(HaveValue(Equal(int32(replay.DefaultMaxReplicas))))
	}).WithTimeout(10 * time.Second).Should(Succeed())

	// The same run without Spillway falls over again: the test can fail.
	cfg.MaxRecovery = 12 * time.Second // it will not drain; long enough to see it fall over again
	naive, err := replay.Run(context.Background(), cfg, replay.Fleet{}, nil)
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("without Spillway: backlog %d, drained in %.1fs, second outages %d, peak %d in flight, lost %d",
		naive.Backlog, naive.DrainSeconds, naive.SecondOutages, naive.PeakInFlight, naive.Lost)
	g.Expect(naive.SecondOutages).To(BeNumerically(">=", 1), "without Spillway the dependency falls over again")
	g.Expect(naive.Lost).To(BeZero())
	t.Logf("replay took %v", time.Since(start).Round(time.Second))
}
