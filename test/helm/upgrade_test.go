package helm

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/skewtest"
)

// TestUpgradeFromThePinnedChartWithWorkersCalling upgrades a release of
// the chart at the pinned commit (pkg/protocol/pins/v<N-1>.sum, the last of the previous
// protocol version, extracted from git) to this tree's chart while workers
// call a dependency, then rolls it back. Pods do not run on envtest, so the
// test runs the manager process the Deployment stands for, with the
// Deployment's own arguments, and replaces it as the rollout would: the
// old chart's release runs the old manager, the upgraded one this tree's.
// At each step: the CRD is the chart's, every policy is kept (same UID and
// spec), the ramp in progress continues from its step (a reset would start
// it again, or lose it to a fresh Closed), the policy that was Closed keeps
// its epoch, and the workers keep calling under the cap, none deferred for
// a version reason.
func TestUpgradeFromThePinnedChartWithWorkersCalling(t *testing.T) {
	setup(t)
	g := NewWithT(t)
	ctx := context.Background()
	commit, err := skewtest.Pinned()
	g.Expect(err).NotTo(HaveOccurred())
	old, err := skewtest.Old(commit)
	g.Expect(err).NotTo(HaveOccurred())
	manager, err := managerBinary()
	g.Expect(err).NotTo(HaveOccurred())
	cur := skewtest.Binaries{Version: "new", Manager: manager, Chart: chartDir()}

	srv := redistest.Start(t)
	rdb := srv.Client()
	dir := t.TempDir()
	managers := skewtest.Managers{Kubeconfig: kubeconfig, Dir: dir,
		// Out of a pod: the namespace the pod would run in, and no
		// listeners.
		Flags: []string{"--leader-election-namespace=" + namespace, "--health-probe-bind-address=0", "--metrics-bind-address=0"}}
	values := []string{"--namespace", namespace, "--set", "redis.addresses={" + srv.Addr() + "}", "--set", "evaluationInterval=500ms"}

	// The old chart, its manager and two policies.
	mustHelm(t, append([]string{"install", "spillway", old.Chart}, values...)...)
	running := managers.StartWith(t, old, "manager-old-1", podArgs(deployment(t, "spillway").Spec.Template.Spec.Containers[0].Args))
	g.Eventually(running.Leads).WithTimeout(60 * time.Second).Should(BeTrue())
	ramping, steady := upgradePolicy("ramping-api"), upgradePolicy("steady-api")
	g.Eventually(func() error { return k8s.Create(ctx, ramping) }).WithTimeout(30*time.Second).Should(Succeed(), "the old chart's CRD serves DependencyPolicies")
	g.Expect(k8s.Create(ctx, steady)).To(Succeed())
	rampingDep, steadyDep := namespace+"/ramping-api", namespace+"/steady-api"
	state := func(dep string) skewtest.State {
		s, _, err := skewtest.ReadState(ctx, rdb, dep)
		g.Expect(err).NotTo(HaveOccurred())
		return s
	}
	for _, dep := range []string{rampingDep, steadyDep} {
		g.Eventually(func() string { return state(dep).State }).WithTimeout(30*time.Second).Should(Equal("Closed"), "the old manager publishes %s", dep)
	}
	steadyBefore := state(steadyDep)

	// Workers call ramping-api; an outage opens it, and it ramps.
	dependency := skewtest.StartDependency(t, upgradeCapacity, 15*time.Millisecond)
	fleet := skewtest.Fleet{Redis: srv.Addr(), Dependency: rampingDep, URL: dependency.URL(), Dir: dir}
	workers := []*skewtest.Worker{
		fleet.StartWorker(t, old, skewtest.WorkerSpec{Name: "go-call", Threads: 4}),
		fleet.StartWorker(t, old, skewtest.WorkerSpec{Name: "go-batch", Batch: true, Threads: 4}),
	}
	calling := func(what string) {
		t.Helper()
		from := dependency.Total()
		g.Eventually(dependency.Total).WithTimeout(30*time.Second).Should(BeNumerically(">=", from+20), "the workers keep calling %s", what)
	}
	calling("under the old chart")
	dependency.SetDown(true)
	g.Eventually(func() string { return state(rampingDep).State }).WithTimeout(30 * time.Second).Should(Equal("Open"))
	dependency.SetDown(false)
	g.Eventually(func() bool {
		s := state(rampingDep)
		return s.State == "Ramping" && s.RampStep >= 2
	}).WithTimeout(60*time.Second).WithPolling(10*time.Millisecond).Should(BeTrue(), "ramping-api ramps to its third step")
	t.Logf("Before the upgrade: %s", state(rampingDep))

	// policiesKept checks that both policies are there with their UID and
	// spec.
	policiesKept := func(when string) {
		t.Helper()
		for _, want := range []*spillwayv1alpha1.DependencyPolicy{ramping, steady} {
			got := &spillwayv1alpha1.DependencyPolicy{}
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(want), got)).To(Succeed(), "%s: the policy %s is kept", when, want.Name)
			g.Expect(got.UID).To(Equal(want.UID), "%s: the policy %s is the same object", when, want.Name)
			g.Expect(got.Spec).To(Equal(want.Spec), "%s: the policy %s keeps its spec", when, want.Name)
		}
	}
	// replace runs the manager of version b with the Deployment's new
	// arguments and stops the one running, as the Deployment's rollout
	// replaces its pod; it returns the state of ramping-api before, and
	// the new manager's first publication of it.
	replace := func(b skewtest.Binaries, name string) (before, after skewtest.State) {
		t.Helper()
		next := managers.StartWith(t, b, name, podArgs(deployment(t, "spillway").Spec.Template.Spec.Containers[0].Args))
		g.Eventually(next.Up).WithTimeout(60 * time.Second).Should(BeTrue())
		running.Stop(t)
		running = next
		before = state(rampingDep)
		g.Eventually(running.Leads).WithTimeout(60 * time.Second).Should(BeTrue())
		g.Eventually(func() int64 { after = state(rampingDep); return after.Seq }).WithTimeout(30*time.Second).
			Should(BeNumerically(">", before.Seq), "the %s manager publishes", b.Version)
		t.Logf("The %s manager took over: %s, then %s", b.Version, before, after)
		return before, after
	}
	// continues checks that the ramp went on from where it was.
	continues := func(when string, before, after skewtest.State) {
		t.Helper()
		g.Expect(before.State).To(Equal("Ramping"), "%s: the ramp ended before the manager was replaced: lengthen its steps", when)
		g.Expect(after.State).To(Equal("Ramping"), "%s: the ramp continues", when)
		g.Expect(after.RampStep).To(BeNumerically(">=", before.RampStep), "%s: the ramp continues from its step", when)
		g.Expect(after.RampStep).To(BeNumerically(">=", 2), "%s: the ramp did not start again", when)
		g.Expect(after.Epoch).To(Equal(before.Epoch), "%s: the breaker keeps its epoch", when)
		s := state(steadyDep)
		g.Expect(s.State).To(Equal("Closed"), "%s: steady-api stays Closed", when)
		g.Expect(s.Epoch).To(Equal(steadyBefore.Epoch), "%s: steady-api keeps its epoch", when)
	}

	// Upgrade to this tree's chart, then replace the manager.
	mustHelm(t, append([]string{"upgrade", "spillway", chartDir()}, values...)...)
	g.Expect(crdSchemas(t)).To(Equal(chartCRDSchemas(t, chartDir())), "the upgrade installs the new chart's CRD")
	policiesKept("after the upgrade")
	before, after := replace(cur, "manager-new-1")
	continues("after the upgrade", before, after)
	calling("under the new chart")

	// Roll back to the old chart, and its manager.
	mustHelm(t, "rollback", "spillway", "1", "--namespace", namespace)
	g.Expect(crdSchemas(t)).To(Equal(chartCRDSchemas(t, old.Chart)), "the rollback installs the old chart's CRD")
	policiesKept("after the rollback")
	before, after = replace(old, "manager-old-2")
	continues("after the rollback", before, after)
	calling("after the rollback")

	for _, w := range workers {
		s := w.Stop(t)
		t.Logf("Worker %s: ok %d failed %d refused %v", w.ID(), s.OK, s.Failed, s.Refused)
		g.Expect(s.Refused["version"]+s.Refused["no_policy"]).To(BeZero(), "%s deferred jobs for a version reason", w.ID())
	}
	g.Expect(dependency.Violations()).To(BeEmpty(), "calls in flight above the limit")
	leases, err := skewtest.LiveLeases(ctx, rdb, rampingDep)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(leases).To(BeZero(), "leases left behind")
	running.Stop(t)
	mustHelm(t, "uninstall", "spillway", "--namespace", namespace)
	for _, p := range []*spillwayv1alpha1.DependencyPolicy{ramping, steady} {
		g.Expect(k8s.Delete(ctx, p)).To(Succeed())
	}
}

// podArgs are a Deployment's manager arguments, with what a pod would know
// of itself added for a process outside one: the namespace its webhook's
// certificate goes to, when the arguments have a webhook.
func podArgs(args []string) []string {
	for _, a := range args {
		if strings.HasPrefix(a, "--webhook-cert-rotation") {
			return append(append([]string(nil), args...), "--webhook-namespace="+namespace)
		}
	}
	return args
}

// upgradeCapacity is the capacity of the upgrade test's policies.
const upgradeCapacity = 12

// upgradePolicy is a policy of the upgrade test: a ramp of ten 4s steps,
// long enough to span an upgrade and a rollback, opened by 10 calls at half
// failures.
func upgradePolicy(name string) *spillwayv1alpha1.DependencyPolicy {
	return &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: spillwayv1alpha1.DependencyPolicySpec{
			Capacity: spillwayv1alpha1.Capacity{Concurrency: upgradeCapacity},
			Ramp: spillwayv1alpha1.Ramp{
				Steps:        []int32{2, 3, 4, 5, 6, 7, 8, 9, 10, 11},
				StepDuration: metav1.Duration{Duration: 4 * time.Second},
				StepBack:     spillwayv1alpha1.RampStepBack{When: spillwayv1alpha1.StepBackNever},
			},
			Breaker: spillwayv1alpha1.Breaker{
				FailureRatio: 0.5, MinCalls: 10, HalfOpenProbes: 1,
				Window:       metav1.Duration{Duration: 3 * time.Second},
				OpenDuration: metav1.Duration{Duration: time.Second},
			},
		},
	}
}

// crdSchemas are the OpenAPI schemas of the DependencyPolicy CRD in the API
// server, by version.
func crdSchemas(t *testing.T) map[string]string {
	t.Helper()
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := k8s.Get(context.Background(), types.NamespacedName{Name: crdName}, crd); err != nil {
		t.Fatalf("failed to get the CRD: %v", err)
	}
	return schemas(t, crd)
}

// schemas are a CRD's OpenAPI schemas by version, as JSON.
func schemas(t *testing.T, crd *apiextensionsv1.CustomResourceDefinition) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, v := range crd.Spec.Versions {
		if v.Schema == nil {
			continue
		}
		b, err := json.Marshal(v.Schema.OpenAPIV3Schema)
		if err != nil {
			t.Fatal(err)
		}
		m[v.Name] = string(b)
	}
	return m
}

// chartCRDSchemas are the OpenAPI schemas of the DependencyPolicy CRD the
// chart in dir renders, by version.
func chartCRDSchemas(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := mustHelm(t, "template", "spillway", dir, "--namespace", namespace)
	for _, u := range objects(t, out) {
		if u.GetKind() != "CustomResourceDefinition" || u.GetName() != crdName {
			continue
		}
		crd := &apiextensionsv1.CustomResourceDefinition{}
		b, err := u.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, crd); err != nil {
			t.Fatal(err)
		}
		return schemas(t, crd)
	}
	t.Fatalf("the chart in %s renders no CRD %s", filepath.Base(dir), crdName)
	return nil
}
