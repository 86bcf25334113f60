package controllers

import (
	"context"
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/skewtest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// previousRegister is the register script of the previous protocol version,
// as the commit its pin names shipped it (skewtest.PreviousScript).
func previousRegister(t testing.TB) *redis.Script {
	t.Helper()
	s, err := skewtest.PreviousScript("register")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// workerProcesses reads the spillway_policy_worker_processes series of the
// policy ns/name from the manager's registry, as "client protocol served" →
// value.
func workerProcessSeries(g Gomega, ns, name string) map[string]float64 {
	families, err := metrics.Registry.Gather()
	g.Expect(err).NotTo(HaveOccurred())
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "spillway_policy_worker_processes" {
			continue
		}
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["namespace"] == ns && l["name"] == name {
				out[l["client"]+" "+l["protocol"]+" "+l["served"]] = m.GetGauge().GetValue()
			}
		}
	}
	return out
}

// workersServed polls the policy's WorkersServed condition.
func workersServed(ns, name string) func(Gomega) metav1.Condition {
	return func(g Gomega) metav1.Condition {
		for _, c := range getPolicy(g, ns, name).Status.Conditions {
			if c.Type == ConditionWorkersServed {
				return c
			}
		}
		return metav1.Condition{Status: "absent"}
	}
}

// TestWorkersServedThroughRegistrations: the manager reads the worker
// processes that registered in Redis and says, on the policy and in its
// metrics, which it serves. A worker of this version (its register), one of
// the previous version (that version's real register script, from the
// commit its pin names) are served; a worker two versions older than the
// manager (registered as register.lua records a process, "<client>
// <version> <process id>" scored by Redis time: no real client of such a
// version registers yet, but a worker of this version will be that old for
// a manager two versions on) is not: WorkersServed turns False naming it
// and what to do, and its series is exported with served="false", the
// series the UnservedWorkers alert sums. Once it is gone, both recover.
func TestWorkersServedThroughRegistrations(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	v := protocol.Version
	ns := newNamespace(t)
	srv := redistest.Start(t)
	rdb := srv.Client()
	startManager(t, ns, managerRedis(srv), testOptions)
	createPolicy(t, ns, "dep", testSpec())
	g.Eventually(conditionOf(ns, "dep", ConditionReady)).Should(Equal("True/Evaluated"))
	g.Eventually(conditionOf(ns, "dep", ConditionWorkersServed)).Should(Equal("True/" + ReasonWorkerVersionsServed))

	c, err := protocol.NewClient(rdb, protocol.Dependency{Namespace: ns, Name: "dep"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.Register(ctx, "go", "new-1")).To(Succeed())
	g.Expect(previousRegister(t).Run(ctx, rdb, []string{c.Keys().Clients}, "python", "old-1").Err()).To(Succeed())
	g.Eventually(workerProcessSeries).WithArguments(ns, "dep").Should(Equal(map[string]float64{
		fmt.Sprintf("go %d true", v):       1,
		fmt.Sprintf("python %d true", v-1): 1,
	}))
	g.Eventually(workersServed(ns, "dep")).Should(HaveField("Message", ContainSubstring(fmt.Sprintf("v%d: 1 go; v%d: 1 python", v, v-1))))
	g.Expect(workersServed(ns, "dep")(g)).To(And(HaveField("Status", metav1.ConditionTrue), HaveField("Reason", ReasonWorkerVersionsServed)))

	// A process two versions older than the manager.
	now, err := rdb.Time(ctx).Result()
	g.Expect(err).NotTo(HaveOccurred())
	ancient := fmt.Sprintf("go %d ancient-1", v-2)
	g.Expect(rdb.ZAdd(ctx, c.Keys().Clients, redis.Z{Score: float64(now.UnixMilli()), Member: ancient}).Err()).To(Succeed())
	g.Eventually(workersServed(ns, "dep")).Should(And(
		HaveField("Status", metav1.ConditionFalse),
		HaveField("Reason", ReasonUnservedWorkers),
		HaveField("Message", And(
			ContainSubstring(fmt.Sprintf("1 go process(es) at protocol version %d", v-2)),
			ContainSubstring(fmt.Sprintf("this manager speaks protocol version %d and serves workers at versions %d to %d", v, v-1, v+1)),
			ContainSubstring("upgrade their Spillway library"),
			ContainSubstring(fmt.Sprintf("v%d: 1 go; v%d: 1 python; v%d: 1 go", v, v-1, v-2)),
		)),
	))
	g.Expect(workerProcessSeries(g, ns, "dep")).To(Equal(map[string]float64{
		fmt.Sprintf("go %d true", v):       1,
		fmt.Sprintf("python %d true", v-1): 1,
		fmt.Sprintf("go %d false", v-2):    1,
	}))

	// The old process is gone (it stopped registering and aged out, or,
	// here, its member is removed): served again, its series dropped.
	g.Expect(rdb.ZRem(ctx, c.Keys().Clients, ancient).Err()).To(Succeed())
	g.Eventually(conditionOf(ns, "dep", ConditionWorkersServed)).WithTimeout(5 * time.Second).Should(Equal("True/" + ReasonWorkerVersionsServed))
	g.Eventually(workerProcessSeries).WithArguments(ns, "dep").Should(Equal(map[string]float64{
		fmt.Sprintf("go %d true", v):       1,
		fmt.Sprintf("python %d true", v-1): 1,
	}))
}
