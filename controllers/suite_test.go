package controllers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// env is the kube-apiserver and etcd every test in this package talks to,
// started once in TestMain with the Spillway and KEDA CRDs installed.
var env *testenv.Env

func TestMain(m *testing.M) {
	// The managers' logs go to stderr with SPILLWAY_TEST_LOGS=1.
	out := io.Discard
	if os.Getenv("SPILLWAY_TEST_LOGS") != "" {
		out = os.Stderr
	}
	ctrl.SetLogger(zap.New(zap.WriteTo(out), zap.UseDevMode(true)))

	testenv.RunTests(m, &env)
}

// interval is the evaluation interval of the integration tests.
const interval = 200 * time.Millisecond

// testOptions evaluate every 200ms and retry a failed evaluation within 2s.
var testOptions = Options{EvaluationInterval: interval, MaxRetryDelay: 2 * time.Second}

// newNamespace creates a namespace of its own for one test.
func newNamespace(t testing.TB) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "spillway-"}}
	if err := env.Client.Create(context.Background(), ns); err != nil {
		t.Fatalf("failed to create namespace: %v", err)
	}
	t.Cleanup(func() { _ = env.Client.Delete(context.Background(), ns) })
	return ns.Name
}

// managerRedis is a Redis client as the manager makes one: every operation
// bounded, failing fast when Redis is down.
func managerRedis(srv *redistest.Server) *redis.Client {
	return srv.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.DialTimeout = 500 * time.Millisecond
		o.ReadTimeout = 500 * time.Millisecond
		o.WriteTimeout = 500 * time.Millisecond
		o.DialerRetries = 1
		o.MaxRetries = 1
	})
}

// testManager is a running manager with the DependencyPolicy controller,
// watching one namespace.
type testManager struct {
	cancel context.CancelFunc
	done   chan error
}

// startManager starts a manager for namespace ns; it stops when the test ends
// or stop is called.
func startManager(t testing.TB, ns string, rdb redis.UniversalClient, opts Options) *testManager {
	t.Helper()
	return startManagerWithConfig(t, env.Config, ns, rdb, opts)
}

// startManagerWithConfig is startManager with a REST config of its own (API
// rate limits, say).
func startManagerWithConfig(t testing.TB, cfg *rest.Config, ns string, rdb redis.UniversalClient, opts Options) *testManager {
	t.Helper()
	return startReconciler(t, cfg, ns, &Evaluator{Redis: rdb, Options: opts}, &PolicyReconciler{Redis: rdb, Options: opts})
}

// setupControllers sets up e and p on mgr sharing one Evaluations, as
// cmd/manager does; SetupWithManager fills their unset fields.
func setupControllers(ctx context.Context, mgr ctrl.Manager, e *Evaluator, p *PolicyReconciler) error {
	if e.Evaluations == nil {
		e.Evaluations = NewEvaluations()
	}
	p.Evaluations = e.Evaluations
	if err := e.SetupWithManager(ctx, mgr); err != nil {
		return err
	}
	return p.SetupWithManager(ctx, mgr)
}

// startReconciler starts a manager running e and p, whose unset fields
// SetupWithManager fills (a clock of their own, say).
func startReconciler(t testing.TB, cfg *rest.Config, ns string, e *Evaluator, p *PolicyReconciler) *testManager {
	t.Helper()
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatalf("failed to create the manager: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := setupControllers(ctx, mgr, e, p); err != nil {
		cancel()
		t.Fatalf("failed to set up the controller: %v", err)
	}
	m := &testManager{cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- mgr.Start(ctx) }()
	t.Cleanup(func() { m.stop(t) })
	return m
}

// stop stops the manager and waits for it to exit.
func (m *testManager) stop(t testing.TB) {
	t.Helper()
	if m.cancel == nil {
		return
	}
	m.cancel()
	m.cancel = nil
	select {
	case err := <-m.done:
		if err != nil {
			t.Errorf("manager exited with an error: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("manager did not stop within 30s")
	}
}

// minCalls is the breaker's minCalls in testSpec. A burst of exactly
// minCalls failures opens the breaker, and cannot open it before the burst
// is complete: evaluations between the calls see fewer than minCalls calls.
const minCalls = 5

// testSpec is a policy that moves in seconds: 40 slots, the ramp 5, 10, 20,
// 40 one step per second, open for a second, opened by 5 calls at half
// failures, 3 probes.
func testSpec(consumers ...string) spillwayv1alpha1.DependencyPolicySpec {
	spec := seedSpec()
	spec.Ramp.StepDuration = metav1.Duration{Duration: time.Second}
	spec.Breaker.MinCalls = minCalls
	spec.Breaker.Window = metav1.Duration{Duration: 10 * time.Second}
	spec.Breaker.OpenDuration = metav1.Duration{Duration: time.Second}
	for _, c := range consumers {
		spec.Consumers = append(spec.Consumers, spillwayv1alpha1.Consumer{ScaledObjectName: c})
	}
	return spec
}

func createPolicy(t testing.TB, ns, name string, spec spillwayv1alpha1.DependencyPolicySpec) *spillwayv1alpha1.DependencyPolicy {
	t.Helper()
	pol := &spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec}
	if err := env.Client.Create(context.Background(), pol); err != nil {
		t.Fatalf("failed to create DependencyPolicy %s: %v", name, err)
	}
	return pol
}

func createDeployment(t testing.TB, ns, name string, replicas int32) {
	t.Helper()
	if err := env.Client.Create(context.Background(), deploymentObj(ns, name, replicas)); err != nil {
		t.Fatalf("failed to create Deployment %s: %v", name, err)
	}
}

func deploymentObj(ns, name string, replicas int32) *appsv1.Deployment {
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "worker:latest"}}},
			},
		},
	}
}

// createScaledObject creates a ScaledObject scaling target (an apps/v1
// Deployment unless ref says otherwise) with the user's min and max.
func createScaledObject(t testing.TB, ns, name string, ref kedav1alpha1.ScaleTarget, min, max *int32) {
	t.Helper()
	if err := env.Client.Create(context.Background(), scaledObjectObj(ns, name, ref, min, max), client.FieldOwner("kubectl-client-side-apply")); err != nil {
		t.Fatalf("failed to create ScaledObject %s: %v", name, err)
	}
}

func scaledObjectObj(ns, name string, ref kedav1alpha1.ScaleTarget, min, max *int32) *kedav1alpha1.ScaledObject {
	return &kedav1alpha1.ScaledObject{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: kedav1alpha1.ScaledObjectSpec{
			ScaleTargetRef:  &ref,
			MinReplicaCount: min,
			MaxReplicaCount: max,
			Triggers:        []kedav1alpha1.ScaleTriggers{{Type: "cpu", Metadata: map[string]string{"value": "50"}}},
		},
	}
}

func getScaledObject(g Gomega, ns, name string) *kedav1alpha1.ScaledObject {
	so := &kedav1alpha1.ScaledObject{}
	g.Expect(env.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, so)).To(Succeed())
	return so
}

// replicasOf polls a ScaledObject's min and max, as a string for readable
// failures.
func replicasOf(ns, name string) func(Gomega) string {
	return func(g Gomega) string {
		so := getScaledObject(g, ns, name)
		return Replicas{Min: so.Spec.MinReplicaCount, Max: so.Spec.MaxReplicaCount}.String()
	}
}

func getPolicy(g Gomega, ns, name string) *spillwayv1alpha1.DependencyPolicy {
	pol := &spillwayv1alpha1.DependencyPolicy{}
	g.Expect(env.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, pol)).To(Succeed())
	return pol
}

// conditionOf polls a policy's condition as "Status/Reason".
func conditionOf(ns, name, condType string) func(Gomega) string {
	return func(g Gomega) string {
		pol := getPolicy(g, ns, name)
		for _, c := range pol.Status.Conditions {
			if c.Type == condType {
				return string(c.Status) + "/" + c.Reason
			}
		}
		return "absent"
	}
}

// worker reports outcomes through the protocol calls the worker library
// (pkg/guard) makes: Acquire, then Release with the outcome, passing the
// admitting epoch only for a call admitted HalfOpen (a probe).
type worker struct {
	c *protocol.Client
}

func newWorker(t testing.TB, srv *redistest.Server, ns, name string) *worker {
	t.Helper()
	c, err := protocol.NewClient(srv.Client(), protocol.Dependency{Namespace: ns, Name: name})
	if err != nil {
		t.Fatalf("failed to create a protocol client: %v", err)
	}
	return &worker{c: c}
}

// report makes n calls that end with outcome, one at a time, and returns how
// many were admitted.
func (w *worker) report(g Gomega, n int, outcome protocol.Outcome) int {
	ctx := context.Background()
	admitted := 0
	for range n {
		adm, err := w.c.Acquire(ctx, protocol.AcquireArgs{LeaseID: leaseID(), TTL: 10 * time.Second})
		g.Expect(err).NotTo(HaveOccurred())
		if adm.Code != protocol.Admitted {
			continue
		}
		admitted++
		var probeEpoch int64
		if adm.State == wire.HalfOpen {
			probeEpoch = adm.Epoch
		}
		_, err = w.c.Release(ctx, adm.Member, probeEpoch, outcome, 1)
		g.Expect(err).NotTo(HaveOccurred())
	}
	return admitted
}

// published is what the controller last published, or the zero value.
func (w *worker) published(g Gomega) protocol.Published {
	p, _, err := w.c.ReadPublished(context.Background())
	g.Expect(err).NotTo(HaveOccurred())
	return p
}

// stateLimit polls the published state and limit as "State/limit".
func (w *worker) stateLimit() func(Gomega) string {
	return func(g Gomega) string {
		p := w.published(g)
		return fmt.Sprintf("%s/%d", p.State, p.Limit)
	}
}

func leaseID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// eventReasons lists the reasons of the Events about a policy.
func eventReasons(ns, name string) func(Gomega) []string {
	return func(g Gomega) []string {
		var list eventsv1.EventList
		g.Expect(env.Client.List(context.Background(), &list, client.InNamespace(ns))).To(Succeed())
		var reasons []string
		for _, e := range list.Items {
			if e.Regarding.Kind == spillwayv1alpha1.DependencyPolicyKind && e.Regarding.Name == name {
				reasons = append(reasons, e.Reason)
			}
		}
		return reasons
	}
}
