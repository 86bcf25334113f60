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
	"slices"
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
	coordinationv1 "k8s.io/api/coordination/v1"
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
	// calmNamespace holds a policy of the same name, livePolicy, whose
	// dependency stays healthy: every series and alert must tell the two
	// apart by their namespace label.
	calmNamespace = "bank"
	// rateWindow replaces $__rate_interval in the panels' queries.
	rateWindow = "15s"
	// leaseName is the manager's leader-election Lease (cmd/manager), which
	// the SpillwayNoLeader alert names.
	leaseName = "spillway.dev"
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
// an HPA that does not exist yet. The calm policy has the same spec, with
// only an HPA that exists from the start.
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

// labels are the labels a firing alert's series must carry.
type labels map[string]string

// TestLiveDashboardAndAlerts runs the controller and two fleets of workers
// (the worker library, in this process) against the real API server and
// Redis, with a real Prometheus scraping the manager's metrics as the
// Prometheus Operator scrapes the Helm chart's ServiceMonitor
// (operator_test.go), and the workers' metrics, through: a manager that
// cannot take its leader-election Lease, a dependency outage and its ramp, a
// ramp that steps back, an HPA consumer that does not exist until the middle
// of the run, a hung Redis, and a manager whose metrics endpoint goes away.
// The two policies have one name in two namespaces: shop/pay goes through
// the incidents, bank/pay stays healthy. Then every query of every dashboard
// panel must return series for each policy, and each alert's expression,
// with its ranges and "for" scaled down (shortRanges, shortFor), must fire
// while its incident lasts, for the policies it concerns and no other, and
// not once it is over.
func TestLiveDashboardAndAlerts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts kube-apiserver, etcd, redis-server and prometheus, and runs for minutes")
	}
	ctx := t.Context()
	chart := renderChart(t, "serviceMonitor.enabled=true", "metrics.secure=false",
		"serviceMonitor.interval=1s", "serviceMonitor.scrapeTimeout=1s")
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

	// The Lease is held by a process that is not the manager: it runs, is
	// scraped, and publishes nothing.
	create(t, env.Client, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: releaseNamespace}})
	releaseLease := holdLease(t, env.Client)
	startManager(t, env, rdb)
	manager := serveMetrics(t, promhttp.HandlerFor(metrics.Registry, promhttp.HandlerOpts{}))
	fleets := map[string]*prometheus.Registry{liveNamespace: prometheus.NewRegistry(), calmNamespace: prometheus.NewRegistry()}
	workers := map[string]*metricsTarget{}
	for ns, reg := range fleets {
		workers[ns] = serveMetrics(t, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	}
	scrape, err := yaml.Marshal([]scrapeConfig{
		operatorScrapeConfig(t, chart, manager.addr),
		// Each fleet as its own PodMonitor or scrape config would label it:
		// with the namespace its pods run in. The workers' series carry no
		// namespace of their own.
		{JobName: "workers", StaticConfigs: []staticConfig{
			{Targets: []string{workers[liveNamespace].addr}, Labels: map[string]string{"namespace": liveNamespace}},
			{Targets: []string{workers[calmNamespace].addr}, Labels: map[string]string{"namespace": calmNamespace}},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	prom := promtest.StartScraping(t, string(scrape))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("Prometheus scraped with:\n%s", scrape)
		}
	})

	// The run begins once Prometheus has scraped the manager, standing by.
	waitSeries(t, prom.URL(), `leader_election_master_status{name="`+leaseName+`"} == 0`, 30*time.Second)
	begin := time.Now()
	time.Sleep(10 * time.Second)
	releaseLease()
	leaseReleased := time.Now()

	install(t, env.Client)
	var mode, calmMode atomic.Int32
	var stops []func()
	for ns, n := range map[string]int{liveNamespace: 6, calmNamespace: 2} {
		gd, err := guard.New(rdb, ns+"/"+livePolicy, guard.Options{
			// Redis hung for seconds is an outage; a round trip of a second or
			// two is not, on 2 cores shared with other tests (the default 250 ms
			// would count such stalls as Redis errors, and admit fail-open calls).
			Registerer: fleets[ns], RedisTimeout: 3 * time.Second, FailOpenLimit: 2,
		})
		if err != nil {
			t.Fatal(err)
		}
		m := &mode
		if ns == calmNamespace {
			m = &calmMode
		}
		stop := runWorkers(ctx, gd, m, n)
		t.Cleanup(stop)
		stops = append(stops, stop)
	}
	pc, err := protocol.NewClient(rdb, protocol.Dependency{Namespace: liveNamespace, Name: livePolicy})
	if err != nil {
		t.Fatal(err)
	}
	tl := &timeline{t: t, pc: pc}
	go tl.watch(ctx)

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
	hpaCreated := time.Now()
	create(t, env.Client, hpa(liveNamespace, "pay-api"))
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
	for _, stop := range stops {
		stop()
	}
	off := func(at time.Time) time.Duration { return at.Sub(begin).Round(100 * time.Millisecond) }
	t.Logf("run: Lease released at %v, Open at %v, healed at %v, third step back at %v, healed at %v, HPA at %v, Closed at %v, Redis hung %v-%v, manager unscraped %v-%v, end %v",
		off(leaseReleased), off(openAt), off(outageOver), off(thirdStepBack), off(stepBacksOver), off(hpaCreated), off(closedAt), off(pausedAt), off(resumedAt), off(managerDownAt), off(managerUpAt), off(end))

	sec := time.Second
	shop := labels{"namespace": liveNamespace, "name": livePolicy}
	bank := labels{"namespace": calmNamespace, "name": livePolicy}
	shopWorkers := labels{"namespace": liveNamespace, "dependency": liveNamespace + "/" + livePolicy}
	bankWorkers := labels{"namespace": calmNamespace, "dependency": calmNamespace + "/" + livePolicy}
	managerJob := labels{"namespace": releaseNamespace, "job": release + "-metrics"}
	alerts := map[string]struct {
		fire, silent [][2]time.Time
		// who are the label sets the alert fires with in each fire
		// window, and the only ones it may fire with; nil: not checked.
		who []labels
	}{
		"SpillwayNoLeader": {
			fire:   [][2]time.Time{{begin.Add(5 * sec), leaseReleased}},
			silent: [][2]time.Time{{leaseReleased.Add(5 * sec), end}},
			who:    []labels{managerJob},
		},
		"SpillwayDependencyOpen": {
			fire:   [][2]time.Time{{openAt.Add(2 * sec), outageOver}},
			silent: [][2]time.Time{{begin.Add(3 * sec), openAt.Add(-3 * sec)}, {closedAt.Add(2 * sec), end}},
			who:    []labels{shop},
		},
		"SpillwayEvaluationLagging": {
			fire:   [][2]time.Time{{resumedAt, resumedAt.Add(12 * sec)}},
			silent: [][2]time.Time{{closedAt.Add(16 * sec), quietUntil}, {resumedAt.Add(21 * sec), managerDownAt}},
			who:    []labels{{"job": release + "-metrics"}},
		},
		"SpillwayDeadManRuleInEffect": {
			fire:   [][2]time.Time{{pausedAt.Add(5 * sec), resumedAt}},
			silent: [][2]time.Time{{closedAt, quietUntil}, {resumedAt.Add(5 * sec), managerDownAt}},
			who:    []labels{shop, bank},
		},
		"SpillwayManagerDown": {
			fire:   [][2]time.Time{{managerDownAt.Add(3 * sec), managerUpAt}},
			silent: [][2]time.Time{{begin.Add(3 * sec), managerDownAt}, {managerUpAt.Add(3 * sec), end}},
		},
		"SpillwayWorkersCannotReachRedis": {
			fire:   [][2]time.Time{{pausedAt.Add(3 * sec), resumedAt}},
			silent: [][2]time.Time{{begin.Add(3 * sec), pausedAt}, {resumedAt.Add(17 * sec), end}},
			who:    []labels{shopWorkers, bankWorkers},
		},
		"SpillwayFailOpenAdmissions": {
			fire:   [][2]time.Time{{pausedAt.Add(3 * sec), resumedAt}},
			silent: [][2]time.Time{{begin.Add(3 * sec), pausedAt}, {resumedAt.Add(17 * sec), end}},
			who:    []labels{shopWorkers, bankWorkers},
		},
		"SpillwayConsumersNotBounded": {
			fire:   [][2]time.Time{{begin, hpaCreated}},
			silent: [][2]time.Time{{hpaCreated.Add(5 * sec), end}},
			who:    []labels{shop},
		},
		"SpillwayRampSteppingBack": {
			fire:   [][2]time.Time{{thirdStepBack.Add(-sec), thirdStepBack.Add(10 * sec)}},
			silent: [][2]time.Time{{begin, outageOver}, {stepBacksOver.Add(62 * sec), end}},
			who:    []labels{shop},
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
				for _, l := range want.who {
					if len(overlapping(firing(matching(got, l), hold), w[0], w[1], begin)) == 0 {
						t.Errorf("%s did not fire for %v between %s and %s of the run (fired for %v): %s",
							r.Alert, l, w[0].Sub(begin), w[1].Sub(begin), firedFor(got, hold), expr)
					}
				}
			}
			for _, w := range want.silent {
				if at := overlapping(fired, w[0], w[1], begin); len(at) > 0 {
					t.Errorf("%s fired between %s and %s of the run, when nothing was wrong (for %v: fired %v for %v): %s",
						r.Alert, w[0].Sub(begin), w[1].Sub(begin), hold, at, firedFor(got, hold), expr)
				}
			}
			if want.who != nil {
				for _, s := range got {
					if len(firing([]series{s}, hold)) > 0 && !slices.ContainsFunc(want.who, func(l labels) bool { return l.match(s.Metric) }) {
						t.Errorf("%s fired for %v, which none of its incidents concerns (want %v): %s", r.Alert, s.Metric, want.who, expr)
					}
				}
			}
		})
	}

	// The dashboard's variables list both namespaces, and the policy in
	// each; every panel's queries return series for both policies.
	d := loadDashboard(t)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		t.Run("variable/"+v.Name, func(t *testing.T) {
			m := labelValuesCall.FindStringSubmatch(v.Definition)
			if m == nil {
				t.Fatalf("variable %s: %q is not label_values(selector, label)", v.Name, v.Definition)
			}
			for _, ns := range []string{liveNamespace, calmNamespace} {
				got, err := labelValues(prom.URL(), m[2], substituteVariables(m[1], ns), begin, end)
				if err != nil {
					t.Fatal(err)
				}
				want := map[string]string{"namespace": ns, "policy": livePolicy}[v.Name]
				if !slices.Contains(got, want) {
					t.Errorf("variable %s with namespace %s lists %v, not %s", v.Name, ns, got, want)
				}
			}
		})
	}
	for _, p := range d.allPanels() {
		for _, tg := range p.Targets {
			for _, ns := range []string{liveNamespace, calmNamespace} {
				t.Run("panel/"+p.Title+"/"+tg.RefID+"/"+ns, func(t *testing.T) {
					expr := substituteVariables(tg.Expr, ns)
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
}

// waitSeries waits until query, run at the present, returns a series.
func waitSeries(t *testing.T, base, query string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got, err := queryRange(base, query, time.Now().Add(-time.Second), time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if len(got) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no series for %s within %v", query, timeout)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// labelValuesCall is a query variable's definition: label_values(selector,
// label).
var labelValuesCall = regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`)

// match says whether a series' labels include l.
func (l labels) match(metric map[string]string) bool {
	for k, v := range l {
		if metric[k] != v {
			return false
		}
	}
	return true
}

// matching are the series of ss whose labels include l.
func matching(ss []series, l labels) []series {
	var out []series
	for _, s := range ss {
		if l.match(s.Metric) {
			out = append(out, s)
		}
	}
	return out
}

// firedFor lists the labels of the series of ss that fire, for messages.
func firedFor(ss []series, hold time.Duration) []map[string]string {
	var out []map[string]string
	for _, s := range ss {
		if len(firing([]series{s}, hold)) > 0 {
			out = append(out, s.Metric)
		}
	}
	return out
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
// the live policy in namespace.
func substituteVariables(expr, namespace string) string {
	return strings.NewReplacer(
		"$namespace", namespace, "$policy", livePolicy, "$__rate_interval", rateWindow,
	).Replace(expr)
}

// startManager runs the evaluator and the policy reconciler, evaluating every
// 200 ms with a 3 s dead-man bound and retrying failed evaluations within
// 2 s, until the test ends. It elects a leader as cmd/manager does (its
// Lease in releaseNamespace, with cmd/manager's default timings).
func startManager(t *testing.T, env *testenv.Env, rdb *redis.Client) {
	t.Helper()
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                        env.Scheme,
		Metrics:                       metricsserver.Options{BindAddress: "0"}, // served by serveMetrics
		HealthProbeBindAddress:        "0",
		Controller:                    config.Controller{SkipNameValidation: ptr.To(true)},
		LeaderElection:                true,
		LeaderElectionID:              leaseName,
		LeaderElectionNamespace:       releaseNamespace,
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 ptr.To(15 * time.Second),
		RenewDeadline:                 ptr.To(10 * time.Second),
		RetryPeriod:                   ptr.To(500 * time.Millisecond),
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

// holdLease takes the manager's Lease for another holder, renews it every
// second, and returns a func that deletes it (once).
func holdLease(t *testing.T, c client.Client) func() {
	t.Helper()
	lease := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Namespace: releaseNamespace, Name: leaseName},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity:       ptr.To("a-manager-run-by-hand"),
			LeaseDurationSeconds: ptr.To[int32](15),
			AcquireTime:          &metav1.MicroTime{Time: time.Now()},
			RenewTime:            &metav1.MicroTime{Time: time.Now()},
		},
	}
	create(t, c, lease)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			lease.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
			_ = c.Update(ctx, lease)
		}
	}()
	var once sync.Once
	release := func() {
		once.Do(func() {
			cancel()
			<-done
			if err := c.Delete(context.Background(), lease); err != nil {
				t.Errorf("delete the Lease: %v", err)
			}
		})
	}
	t.Cleanup(release)
	return release
}

// install creates, in the live namespace, the two workloads, the
// ScaledObject and the policy, whose HPA comes later (hpa); and in the calm
// namespace the policy of the same name, with an HPA consumer that exists.
func install(t *testing.T, c client.Client) {
	t.Helper()
	var spec spillwayv1alpha1.DependencyPolicySpec
	if err := yaml.UnmarshalStrict([]byte(livePolicySpec), &spec); err != nil {
		t.Fatalf("policy spec: %v", err)
	}
	calm := *spec.DeepCopy()
	calm.Consumers = []spillwayv1alpha1.Consumer{{HorizontalPodAutoscalerName: "pay-api", SlotsPerReplica: 1}}
	objs := []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: liveNamespace}},
		workload(liveNamespace, "pay-workers"),
		workload(liveNamespace, "pay-api"),
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
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: calmNamespace}},
		workload(calmNamespace, "pay-api"),
		hpa(calmNamespace, "pay-api"),
		&spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: calmNamespace, Name: livePolicy}, Spec: calm},
	}
	for _, o := range objs {
		create(t, c, o)
	}
}

func create(t *testing.T, c client.Client, o client.Object) {
	t.Helper()
	if err := c.Create(context.Background(), o); err != nil {
		t.Fatalf("create %T %s/%s: %v", o, o.GetNamespace(), o.GetName(), err)
	}
}

func workload(namespace, name string) *appsv1.Deployment {
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
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

// hpa is an HPA of the Deployment of its name.
func hpa(namespace, name string) *autoscalingv2.HorizontalPodAutoscaler {
	return &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: name},
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
