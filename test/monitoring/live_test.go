package monitoring

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
	"github.com/spillway-dev/spillway/internal/promtest"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestMain sends the manager's logs to stderr with SPILLWAY_TEST_LOGS=1,
// else nowhere.
func TestMain(m *testing.M) {
	out := io.Discard
	if os.Getenv("SPILLWAY_TEST_LOGS") != "" {
		out = os.Stderr
	}
	ctrl.SetLogger(zap.New(zap.WriteTo(out), zap.UseDevMode(true)))
	os.Exit(m.Run())
}

const (
	liveNamespace = "shop"
	livePolicy    = "pay"
	// rateWindow replaces $__rate_interval in the panels' queries.
	rateWindow = "15s"
)

// shortRanges replace the ranges of the alerts' expressions, and shortFor
// their "for": the run is minutes long and scraped every second, where the
// rules' windows are for a cluster's hours. A short "for" still lets one
// failed scrape (a 1 s timeout on a loaded machine) pass, as the rules' own
// do.
var (
	shortRanges = map[string]string{"[5m]": "[15s]", "[30m]": "[60s]"}
	shortFor    = map[string]time.Duration{"": 0, "1m": 2 * time.Second, "5m": 3 * time.Second, "10m": 5 * time.Second, "15m": 5 * time.Second}
)

// livePolicySpec is a policy scaled down to the test's seconds: it opens
// after 10 calls at half of them failing, probes after 2 s, and ramps 2, 4,
// 8 by 1 s steps, stepping back at 5% failures. It names a ScaledObject and
// an HPA that does not exist yet.
const livePolicySpec = `
capacity: {concurrency: 8}
ramp:
  steps: [2, 4, 8]
  stepDuration: 1s
  stepBack: {when: Ramping, failureRatio: 0.05, minFailures: 3}
breaker: {failureRatio: 0.5, minCalls: 10, window: 3s, openDuration: 2s, halfOpenProbes: 3}
retryBudget: {ratio: 0.2, minRetries: 5, window: 10s}
backoff: {base: 50ms, max: 200ms, jitter: Full}
consumers:
- scaledObjectName: pay-workers
  slotsPerReplica: 1
- horizontalPodAutoscalerName: pay-api
  slotsPerReplica: 1
`

// dependency modes: what the workers' calls meet.
const (
	healthy int32 = iota
	down
	partial // it serves one call at a time: half of the calls beside another fail
)

// TestLiveDashboardAndAlerts runs the controller and a fleet of workers (the
// worker library, in this process) against the real API server and Redis,
// with a real Prometheus scraping the manager's and the workers' metrics,
// through: a dependency outage and its ramp, a ramp that steps back, an HPA
// consumer that does not exist until the middle of the run, a hung Redis,
// and a manager whose metrics endpoint goes away. Then every query of every
// dashboard panel must return series, and each alert's expression, with its
// ranges and "for" scaled down (shortRanges, shortFor), must fire while its
// incident lasts and not once it is over.
func TestLiveDashboardAndAlerts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts kube-apiserver, etcd, redis-server and prometheus, and runs for minutes")
	}
	ctx := t.Context()
	env, err := testenv.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	rsrv := redistest.Start(t)
	rdb := rsrv.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
		o.PoolSize = 64
	})

	startManager(t, env, rdb)
	manager := serveMetrics(t, promhttp.HandlerFor(metrics.Registry, promhttp.HandlerOpts{}))
	workerReg := prometheus.NewRegistry()
	workers := serveMetrics(t, promhttp.HandlerFor(workerReg, promhttp.HandlerOpts{}))
	prom := promtest.Start(t, manager.addr, workers.addr)

	install(t, env.Client)
	gd, err := guard.New(rdb, liveNamespace+"/"+livePolicy, guard.Options{
		// Redis hung for seconds is an outage; a round trip of a second or
		// two is not, on 2 cores shared with other tests (the default 250 ms
		// would count such stalls as Redis errors, and admit fail-open calls).
		Registerer: workerReg, RedisTimeout: 3 * time.Second, FailOpenLimit: 2,
	})
	if err != nil {
		t.Fatal(err)
	}
	pc, err := protocol.NewClient(rdb, protocol.Dependency{Namespace: liveNamespace, Name: livePolicy})
	if err != nil {
		t.Fatal(err)
	}
	tl := &timeline{t: t, pc: pc}
	go tl.watch(ctx)
	var mode atomic.Int32
	stopWorkers := runWorkers(ctx, gd, &mode, 6)
	t.Cleanup(stopWorkers)

	begin := time.Now()
	tl.waitState(wire.Closed, 30*time.Second)
	time.Sleep(5 * time.Second) // warm

	// The dependency goes down: Open, HalfOpen, Open... for 8 s.
	mode.Store(down)
	tl.waitState(wire.Open, 20*time.Second)
	openAt := time.Now()
	time.Sleep(8 * time.Second)

	// It comes back able to serve one call at a time: the ramp's first step
	// (2) fails, it steps back to 1, holds it clean and tries 2 again, until
	// it has stepped back three times; then the dependency heals.
	mode.Store(healthy)
	outageOver := time.Now()
	tl.waitState(wire.Ramping, 30*time.Second)
	mode.Store(partial)
	thirdStepBack := tl.waitStepBacks(3, 120*time.Second)
	mode.Store(healthy)
	stepBacksOver := time.Now()

	// The HPA consumer appears: every consumer is bounded.
	hpaCreated := createHPA(t, env.Client)
	tl.waitState(wire.Closed, 90*time.Second)
	closedAt := time.Now()
	time.Sleep(20 * time.Second) // quiet: every shortened window forgets the incidents

	// Redis hangs for 10 s: workers fail to reach it and admit fail-open
	// calls, the manager cannot publish (the dead-man bound is 3 s), and its
	// first evaluation afterwards comes 10 s late.
	quietUntil := time.Now()
	if err := rsrv.Pause(); err != nil {
		t.Fatal(err)
	}
	pausedAt := time.Now()
	time.Sleep(10 * time.Second)
	if err := rsrv.Resume(); err != nil {
		t.Fatal(err)
	}
	resumedAt := time.Now()
	time.Sleep(25 * time.Second)

	// The manager's metrics endpoint goes away for 8 s, then comes back.
	manager.stop()
	managerDownAt := time.Now()
	time.Sleep(8 * time.Second)
	manager.start(t)
	managerUpAt := time.Now()
	time.Sleep(8 * time.Second)
	end := time.Now()
	stopWorkers()
	off := func(at time.Time) time.Duration { return at.Sub(begin).Round(100 * time.Millisecond) }
	t.Logf("run: Open at %v, healed at %v, third step back at %v, healed at %v, HPA at %v, Closed at %v, Redis hung %v-%v, manager unscraped %v-%v, end %v",
		off(openAt), off(outageOver), off(thirdStepBack), off(stepBacksOver), off(hpaCreated), off(closedAt), off(pausedAt), off(resumedAt), off(managerDownAt), off(managerUpAt), off(end))

	sec := time.Second
	alerts := map[string]struct{ fire, silent [][2]time.Time }{
		"SpillwayDependencyOpen": {
			fire:   [][2]time.Time{{openAt.Add(2 * sec), outageOver}},
			silent: [][2]time.Time{{begin.Add(3 * sec), openAt.Add(-3 * sec)}, {closedAt.Add(2 * sec), end}},
		},
		"SpillwayEvaluationLagging": {
			fire:   [][2]time.Time{{resumedAt, resumedAt.Add(12 * sec)}},
			silent: [][2]time.Time{{closedAt.Add(16 * sec), quietUntil}, {resumedAt.Add(21 * sec), managerDownAt}},
		},
		"SpillwayDeadManRuleInEffect": {
			fire:   [][2]time.Time{{pausedAt.Add(5 * sec), resumedAt}},
			silent: [][2]time.Time{{closedAt, quietUntil}, {resumedAt.Add(5 * sec), managerDownAt}},
		},
		"SpillwayManagerDown": {
			fire:   [][2]time.Time{{managerDownAt.Add(3 * sec), managerUpAt}},
			silent: [][2]time.Time{{begin.Add(3 * sec), managerDownAt}, {managerUpAt.Add(3 * sec), end}},
		},
		"SpillwayWorkersCannotReachRedis": {
			fire:   [][2]time.Time{{pausedAt.Add(3 * sec), resumedAt}},
			silent: [][2]time.Time{{begin.Add(3 * sec), pausedAt}, {resumedAt.Add(17 * sec), end}},
		},
		"SpillwayFailOpenAdmissions": {
			fire:   [][2]time.Time{{pausedAt.Add(3 * sec), resumedAt}},
			silent: [][2]time.Time{{begin.Add(3 * sec), pausedAt}, {resumedAt.Add(17 * sec), end}},
		},
		"SpillwayConsumersNotBounded": {
			fire:   [][2]time.Time{{begin, hpaCreated}},
			silent: [][2]time.Time{{hpaCreated.Add(5 * sec), end}},
		},
		"SpillwayRampSteppingBack": {
			fire:   [][2]time.Time{{thirdStepBack.Add(-sec), thirdStepBack.Add(10 * sec)}},
			silent: [][2]time.Time{{begin, outageOver}, {stepBacksOver.Add(62 * sec), end}},
		},
		// No incident of this run makes a controller return an error
		// (promtool's tests make it fire): its expression must run and stay
		// silent.
		"SpillwayReconcileErrors": {
			silent: [][2]time.Time{{begin, end}},
		},
		// Every worker of the run speaks this protocol version (promtool's
		// tests make it fire), and the panel "Workers by protocol version"
		// shows them.
		"SpillwayWorkersUnserved": {
			silent: [][2]time.Time{{begin, end}},
		},
	}
	for _, r := range loadRules(t) {
		t.Run("alert/"+r.Alert, func(t *testing.T) {
			want, ok := alerts[r.Alert]
			if !ok {
				t.Fatalf("the live test has no incident for alert %s", r.Alert)
			}
			expr := shortenRanges(t, r.Expr)
			hold, ok := shortFor[r.For]
			if !ok {
				t.Fatalf("no short for %q", r.For)
			}
			got, err := queryRange(prom.URL(), expr, begin, end)
			if err != nil {
				t.Fatal(err)
			}
			fired := firing(got, hold)
			for _, w := range want.fire {
				if len(overlapping(fired, w[0], w[1], begin)) == 0 {
					t.Errorf("%s did not fire between %s and %s of the run (for %v: fired %v): %s",
						r.Alert, w[0].Sub(begin), w[1].Sub(begin), hold, overlapping(fired, begin, end, begin), expr)
				}
			}
			for _, w := range want.silent {
				if at := overlapping(fired, w[0], w[1], begin); len(at) > 0 {
					t.Errorf("%s fired between %s and %s of the run, when nothing was wrong (for %v: fired %v): %s",
						r.Alert, w[0].Sub(begin), w[1].Sub(begin), hold, at, expr)
				}
			}
		})
	}

	for _, p := range loadDashboard(t).allPanels() {
		for _, tg := range p.Targets {
			t.Run("panel/"+p.Title+"/"+tg.RefID, func(t *testing.T) {
				expr := substituteVariables(tg.Expr)
				got, err := queryRange(prom.URL(), expr, begin, end)
				if err != nil {
					t.Fatal(err)
				}
				if len(got) == 0 {
					t.Errorf("no series for %s", expr)
				}
			})
		}
	}
}

var rangeSelector = regexp.MustCompile(`\[[0-9]+[smhdwy]\]`)

// shortenRanges replaces every range of expr by its shortRanges; a range
// it has none for is left, and fails the test that uses it.
func shortenRanges(t *testing.T, expr string) string {
	return rangeSelector.ReplaceAllStringFunc(expr, func(r string) string {
		short, ok := shortRanges[r]
		if !ok {
			t.Errorf("no short range for %s in %s", r, expr)
			return r
		}
		return short
	})
}

// substituteVariables fills a panel query's variables as Grafana would for
// the live policy.
func substituteVariables(expr string) string {
	return strings.NewReplacer(
		"$namespace", liveNamespace, "$policy", livePolicy, "$__rate_interval", rateWindow,
	).Replace(expr)
}

// startManager runs the evaluator and the policy reconciler, evaluating every
// 200 ms with a 3 s dead-man bound and retrying failed evaluations within
// 2 s, until the test ends.
func startManager(t *testing.T, env *testenv.Env, rdb *redis.Client) {
	t.Helper()
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"}, // served by serveMetrics
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	opts := controllers.Options{
		EvaluationInterval: 200 * time.Millisecond, StatusInterval: time.Second,
		StaleAfter: 3 * time.Second, MaxRetryDelay: 2 * time.Second,
	}
	evaluations := controllers.NewEvaluations()
	if err := (&controllers.Evaluator{Redis: rdb, Evaluations: evaluations, Options: opts}).SetupWithManager(ctx, mgr); err != nil {
		t.Fatal(err)
	}
	if err := (&controllers.PolicyReconciler{Redis: rdb, Evaluations: evaluations, Options: opts}).SetupWithManager(ctx, mgr); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
}

// install creates the namespace, the two workloads, the ScaledObject and the
// policy; the HPA it names comes later (createHPA).
func install(t *testing.T, c client.Client) {
	t.Helper()
	var spec spillwayv1alpha1.DependencyPolicySpec
	if err := yaml.UnmarshalStrict([]byte(livePolicySpec), &spec); err != nil {
		t.Fatalf("policy spec: %v", err)
	}
	objs := []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: liveNamespace}},
		deployment("pay-workers"),
		deployment("pay-api"),
		&kedav1alpha1.ScaledObject{
			ObjectMeta: metav1.ObjectMeta{Namespace: liveNamespace, Name: "pay-workers"},
			Spec: kedav1alpha1.ScaledObjectSpec{
				ScaleTargetRef:  &kedav1alpha1.ScaleTarget{Name: "pay-workers"},
				MinReplicaCount: ptr.To[int32](1),
				MaxReplicaCount: ptr.To[int32](20),
				Triggers:        []kedav1alpha1.ScaleTriggers{{Type: "redis", Metadata: map[string]string{"listName": "jobs", "listLength": "10"}}},
			},
		},
		&spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: liveNamespace, Name: livePolicy}, Spec: spec},
	}
	for _, o := range objs {
		if err := c.Create(context.Background(), o); err != nil {
			t.Fatalf("create %T %s: %v", o, o.GetName(), err)
		}
	}
}

func deployment(name string) *appsv1.Deployment {
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: liveNamespace, Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "worker"}}},
			},
		},
	}
}

// createHPA creates the HPA the policy names, and returns when.
func createHPA(t *testing.T, c client.Client) time.Time {
	t.Helper()
	hpa := &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Namespace: liveNamespace, Name: "pay-api"},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: "pay-api"},
			MinReplicas:    ptr.To[int32](1),
			MaxReplicas:    20,
			Metrics: []autoscalingv2.MetricSpec{{
				Type: autoscalingv2.ResourceMetricSourceType,
				Resource: &autoscalingv2.ResourceMetricSource{
					Name:   corev1.ResourceCPU,
					Target: autoscalingv2.MetricTarget{Type: autoscalingv2.UtilizationMetricType, AverageUtilization: ptr.To[int32](80)},
				},
			}},
		},
	}
	if err := c.Create(context.Background(), hpa); err != nil {
		t.Fatalf("create the HPA: %v", err)
	}
	return time.Now()
}

// runWorkers runs n workers calling the dependency through the guard, each
// working one job at a time: a failed call is retried with the next attempt
// number (or parked, when the budget says so), a refused one deferred.
// mode says what the calls meet. The returned func stops them and waits.
func runWorkers(ctx context.Context, gd *guard.Guard, mode *atomic.Int32, n int) func() {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var inFlight atomic.Int32
	call := func(ctx context.Context) error {
		switch mode.Load() {
		case down:
			time.Sleep(2 * time.Millisecond)
			return errors.New("503 service unavailable")
		case partial:
			n := inFlight.Add(1)
			defer inFlight.Add(-1)
			time.Sleep(10 * time.Millisecond)
			if n > 1 && rand.Float64() < 0.5 {
				return errors.New("500 internal error")
			}
			return nil
		}
		time.Sleep(10 * time.Millisecond)
		return nil
	}
	for range n {
		wg.Go(func() {
			attempt := 1
			for ctx.Err() == nil {
				err := gd.Do(ctx, guard.Job{Attempt: attempt}, call)
				action, after, _ := guard.Decide(err)
				switch {
				case err == nil:
					attempt = 1
					continue
				case action == guard.ActionRetry, action == guard.ActionPark:
					attempt++
				case action == guard.ActionDrop:
					attempt = 1
				}
				select {
				case <-ctx.Done():
				case <-time.After(min(after, 50*time.Millisecond)):
				}
			}
		})
	}
	var once sync.Once
	return func() { once.Do(func() { cancel(); wg.Wait() }) }
}

// timeline follows the state the manager publishes, and waits for the
// states the run goes through.
type timeline struct {
	t    *testing.T
	pc   *protocol.Client
	last atomic.Value // wire.State
}

// watch reads the published state every 50 ms until ctx ends.
func (tl *timeline) watch(ctx context.Context) {
	for ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		p, found, err := tl.pc.ReadPublished(rctx)
		cancel()
		if err == nil && found {
			tl.last.Store(p.State)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// state is the state last read.
func (tl *timeline) state() wire.State {
	s, _ := tl.last.Load().(wire.State)
	return s
}

// waitState waits until the published state is s.
func (tl *timeline) waitState(s wire.State, timeout time.Duration) {
	tl.t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if tl.state() == s {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	tl.t.Fatalf("the policy was not %s within %v (last published: %q)", s, timeout, tl.state())
}

// waitStepBacks waits until the ramp has stepped back n times, as the
// manager's metrics count them, and returns when.
func (tl *timeline) waitStepBacks(n float64, timeout time.Duration) time.Time {
	tl.t.Helper()
	deadline := time.Now().Add(timeout)
	var got float64
	for time.Now().Before(deadline) {
		if got = stepBacks(tl.t); got >= n {
			return time.Now()
		}
		time.Sleep(50 * time.Millisecond)
	}
	tl.t.Fatalf("the ramp stepped back %v times within %v, want %v", got, timeout, n)
	return time.Time{}
}

// stepBacks reads spillway_policy_ramp_step_backs_total of the live policy
// from the manager's registry.
func stepBacks(t *testing.T) float64 {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "spillway_policy_ramp_step_backs_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["namespace"] == liveNamespace && labels["name"] == livePolicy {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// metricsTarget is a scrape target on a fixed loopback address that can be
// stopped and started again.
type metricsTarget struct {
	addr    string
	handler http.Handler
	srv     *http.Server
}

func serveMetrics(t *testing.T, h http.Handler) *metricsTarget {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := &metricsTarget{addr: ln.Addr().String(), handler: h}
	m.serve(ln)
	t.Cleanup(m.stop)
	return m
}

func (m *metricsTarget) serve(ln net.Listener) {
	m.srv = &http.Server{Handler: m.handler, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = m.srv.Serve(ln) }()
}

func (m *metricsTarget) stop() {
	if m.srv != nil {
		_ = m.srv.Close()
		m.srv = nil
	}
}

// start listens again on the same address.
func (m *metricsTarget) start(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("tcp", m.addr)
	if err != nil {
		t.Fatalf("listen again on %s: %v", m.addr, err)
	}
	m.serve(ln)
}
