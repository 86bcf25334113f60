package e2e

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
	"github.com/spillway-dev/spillway/internal/promtest"
	"github.com/spillway-dev/spillway/internal/replay"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// plainDependency is a dependency with a concurrency capacity, down while
// down is set, exporting its request and error counters for Prometheus.
// Above its capacity it answers 503 (an overload: a second outage in the
// making).
type plainDependency struct {
	capacity int64
	down     atomic.Bool
	inFlight atomic.Int64
	// peak is the most calls in flight since the last takePeak.
	peak       atomic.Int64
	overloads  atomic.Int64
	requests   prometheus.Counter
	errs       prometheus.Counter
	registry   *prometheus.Registry
	httpServer *httptest.Server
}

func newPlainDependency(t *testing.T, capacity int64) *plainDependency {
	d := &plainDependency{
		capacity: capacity,
		requests: prometheus.NewCounter(prometheus.CounterOpts{Name: promtest.RequestsMetric, Help: "Requests served."}),
		errs:     prometheus.NewCounter(prometheus.CounterOpts{Name: promtest.ErrorsMetric, Help: "Requests failed."}),
		registry: prometheus.NewRegistry(),
	}
	d.registry.MustRegister(d.requests, d.errs)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(d.registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/render", d.serve)
	d.httpServer = httptest.NewServer(mux)
	t.Cleanup(d.httpServer.Close)
	return d
}

func (d *plainDependency) serve(w http.ResponseWriter, r *http.Request) {
	n := d.inFlight.Add(1)
	defer d.inFlight.Add(-1)
	for {
		p := d.peak.Load()
		if n <= p || d.peak.CompareAndSwap(p, n) {
			break
		}
	}
	d.requests.Inc()
	switch {
	case d.down.Load():
		d.errs.Inc()
		time.Sleep(20 * time.Millisecond)
		http.Error(w, "down", http.StatusInternalServerError)
	case n > d.capacity:
		d.errs.Inc()
		d.overloads.Add(1)
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
	default:
		time.Sleep(30 * time.Millisecond)
		fmt.Fprintln(w, "ok")
	}
}

// takePeak returns the most calls in flight since the last call, and starts
// over from those in flight now.
func (d *plainDependency) takePeak() int64 {
	return d.peak.Swap(d.inFlight.Load())
}

// plainFleet is a workload that does not use the Spillway library: each of
// its replicas makes one call at a time to the dependency, in a loop, and
// retries a failure after 50ms. Its concurrency is its replica count.
type plainFleet struct {
	replicas atomic.Int64
	stop     chan struct{}
	wg       sync.WaitGroup
}

func startPlainFleet(t *testing.T, url string, maxReplicas int) *plainFleet {
	f := &plainFleet{stop: make(chan struct{})}
	c := &http.Client{Timeout: 2 * time.Second}
	for i := range maxReplicas {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			for {
				select {
				case <-f.stop:
					return
				default:
				}
				if int64(i) >= f.replicas.Load() {
					time.Sleep(20 * time.Millisecond)
					continue
				}
				resp, err := c.Get(url)
				if err == nil {
					resp.Body.Close()
				}
				if err != nil || resp.StatusCode != http.StatusOK {
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	t.Cleanup(func() { close(f.stop); f.wg.Wait() })
	return f
}

// TestBoundingWithoutTheLibrary is a fleet that does not use the library at
// all, protected by a policy alone: Prometheus's error ratio of the
// dependency's own counters opens the breaker; the ScaledObject is bounded,
// held at the first ramp step's size with its minimum pinned during the
// outage, and its maxReplicaCount follows the ramp steps after it, so the
// fleet's concurrency (its replica count) follows the ramp and the
// recovering dependency is never overloaded.
func TestBoundingWithoutTheLibrary(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	const (
		ns        = "mail"
		capacity  = 8
		userMax   = 20
		stepEvery = 3 * time.Second
		window    = 3 * time.Second
	)
	dep := newPlainDependency(t, capacity)
	prom := promtest.Start(t, strings.TrimPrefix(dep.httpServer.URL, "http://"))
	cp, err := replay.StartControlPlane(ctx, 200*time.Millisecond)
	g.Expect(err).NotTo(HaveOccurred())
	defer cp.Stop()
	c := cp.Env.Client

	spec := spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: capacity},
		Ramp:     spillwayv1alpha1.Ramp{Steps: []int32{2, 4}, StepDuration: metav1.Duration{Duration: stepEvery}},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio: 0.5, MinCalls: 10, HalfOpenProbes: 3,
			Window:       metav1.Duration{Duration: window},
			OpenDuration: metav1.Duration{Duration: 3 * time.Second},
		},
		Signals: &spillwayv1alpha1.Signals{Prometheus: &spillwayv1alpha1.PrometheusSignal{
			Address:         prom.URL(),
			ErrorRatioQuery: promtest.ErrorRatioQuery(window),
			RateQuery:       promtest.RateQuery(window),
			Interval:        metav1.Duration{Duration: time.Second},
			Timeout:         metav1.Duration{Duration: time.Second},
		}},
		Consumers: []spillwayv1alpha1.Consumer{{
			ScaledObjectName: "render", SlotsPerReplica: 1, Weight: 1,
			LimitedBy: spillwayv1alpha1.LimitedByReplicas,
		}},
	}
	labels := map[string]string{"app": "render"}
	for _, o := range []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}},
		&appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "render"},
			Spec: appsv1.DeploymentSpec{
				Replicas: ptrTo[int32](1),
				Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: labels},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "render", Image: "render:latest"}}},
				},
			},
		},
		&kedav1alpha1.ScaledObject{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "render"},
			Spec: kedav1alpha1.ScaledObjectSpec{
				ScaleTargetRef:  &kedav1alpha1.ScaleTarget{Name: "render"},
				MinReplicaCount: ptrTo[int32](1),
				MaxReplicaCount: ptrTo[int32](userMax),
				Triggers:        []kedav1alpha1.ScaleTriggers{{Type: "redis", Metadata: map[string]string{"listName": "jobs", "listLength": "10"}}},
			},
		},
		&spillwayv1alpha1.DependencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "template-api"}, Spec: spec},
	} {
		g.Expect(c.Create(ctx, o)).To(Succeed())
	}
	proto, err := protocol.NewClient(cp.RDB, protocol.Dependency{Namespace: ns, Name: "template-api"})
	g.Expect(err).NotTo(HaveOccurred())

	// The autoscaler: the backlog always asks for more, so the workload runs
	// at the ScaledObject's maximum (and at least its minimum), as KEDA would
	// scale it, every 200ms.
	fleet := startPlainFleet(t, dep.httpServer.URL+"/render", userMax)
	bounds := func() (lo, hi int32) {
		var so kedav1alpha1.ScaledObject
		if err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "render"}, &so); err != nil {
			return 0, 0
		}
		lo, hi = 0, 100
		if so.Spec.MinReplicaCount != nil {
			lo = *so.Spec.MinReplicaCount
		}
		if so.Spec.MaxReplicaCount != nil {
			hi = *so.Spec.MaxReplicaCount
		}
		return lo, hi
	}
	scalerDone := make(chan struct{})
	stopScaler := make(chan struct{})
	go func() {
		defer close(scalerDone)
		for {
			select {
			case <-stopScaler:
				return
			case <-time.After(200 * time.Millisecond):
			}
			lo, hi := bounds()
			if hi == 0 {
				continue
			}
			replicas := max(hi, lo)
			patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, replicas))
			d := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "render"}}
			if err := c.SubResource("scale").Patch(ctx, d, patch); err == nil {
				fleet.replicas.Store(int64(replicas))
			}
		}
	}()
	defer func() { close(stopScaler); <-scalerDone }()

	stateLimit := func() (wire.State, int64) {
		p, ok, err := proto.ReadPublished(ctx)
		if err != nil || !ok {
			return "", 0
		}
		return p.State, p.Limit
	}
	replicasOf := func() string {
		lo, hi := bounds()
		return fmt.Sprintf("min=%d max=%d", lo, hi)
	}

	// Steady: bounded to the capacity (8 replicas of 1 call each), and the
	// fleet runs there without overloading the dependency.
	g.Eventually(replicasOf).WithTimeout(30 * time.Second).Should(Equal("min=1 max=8"))
	g.Eventually(fleet.replicas.Load).WithTimeout(10 * time.Second).Should(Equal(int64(capacity)))
	g.Eventually(func() string { s, l := stateLimit(); return fmt.Sprintf("%s/%d", s, l) }).Should(Equal("Closed/8"))

	// The outage: the dependency fails every call. Prometheus's ratio opens
	// the breaker; the workload is held at the first step's size (2), its
	// minimum pinned at what it ran at the outage (8), capped at that.
	dep.down.Store(true)
	down := time.Now()
	g.Eventually(func() wire.State { s, _ := stateLimit(); return s }).WithTimeout(20 * time.Second).Should(Equal(wire.Open))
	t.Logf("Open %v after the dependency went down", time.Since(down).Round(100*time.Millisecond))
	g.Eventually(replicasOf).Should(Equal("min=2 max=2"))
	var so kedav1alpha1.ScaledObject
	g.Expect(c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "render"}, &so)).To(Succeed())
	g.Expect(so.Annotations).To(HaveKeyWithValue(controllers.AnnotationPinnedMinReplicas, "8"))
	g.Eventually(fleet.replicas.Load).Should(Equal(int64(2)))
	time.Sleep(2 * time.Second)

	// Recovery: the dependency serves again. Sample the state, the bound, the
	// fleet and the dependency's peak concurrency until the ramp completes.
	dep.down.Store(false)
	up := time.Now()
	overloadsBefore := dep.overloads.Load()
	type sample struct {
		state    wire.State
		limit    int64
		max      int32
		replicas int64
		peak     int64
	}
	var samples []sample
	dep.takePeak()
	g.Eventually(func() wire.State {
		time.Sleep(100 * time.Millisecond)
		s, l := stateLimit()
		_, hi := bounds()
		samples = append(samples, sample{state: s, limit: l, max: hi, replicas: fleet.replicas.Load(), peak: dep.takePeak()})
		return s
	}).WithTimeout(60 * time.Second).WithPolling(time.Millisecond).Should(Equal(wire.Closed))

	var seen []string
	for _, s := range samples {
		step := fmt.Sprintf("%s/%d max=%d", s.state, s.limit, s.max)
		if len(seen) == 0 || seen[len(seen)-1] != step {
			seen = append(seen, step)
		}
	}
	t.Logf("Recovery: %v, Closed %v after the dependency came back", seen, time.Since(up).Round(100*time.Millisecond))
	rampMax := map[int64]bool{}
	for _, s := range samples {
		if s.state != wire.Ramping {
			continue
		}
		// The bound follows the ramp: one replica per slot of the step.
		if s.max != int32(s.limit) {
			// The reconciler applies a new step's bound right after the
			// evaluator publishes it; a sample may fall between the two.
			continue
		}
		rampMax[s.limit] = true
		g.Expect(s.peak).To(BeNumerically("<=", s.limit), "the fleet's concurrency stays within the ramp step: %+v", s)
		g.Expect(s.replicas).To(BeNumerically("<=", s.limit), "%+v", s)
	}
	g.Expect(rampMax).To(HaveKey(int64(2)), "maxReplicaCount followed ramp step 2: %v", seen)
	g.Expect(rampMax).To(HaveKey(int64(4)), "maxReplicaCount followed ramp step 4: %v", seen)
	g.Expect(dep.overloads.Load()-overloadsBefore).To(BeZero(), "the recovering dependency was never overloaded")

	// Closed: the bound is the capacity again and the user's minimum is back.
	g.Eventually(replicasOf).Should(Equal("min=1 max=8"))
	g.Eventually(fleet.replicas.Load).Should(Equal(int64(capacity)))
	g.Expect(c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "render"}, &so)).To(Succeed())
	g.Expect(so.Annotations).NotTo(HaveKey(controllers.AnnotationPinnedMinReplicas))
}

func ptrTo[T any](v T) *T { return &v }
