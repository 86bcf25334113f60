package faults

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/proctest"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// The campaign's fleet. Small on purpose: it runs on two shared cores.
const (
	policyName = "vehicle-api"
	limit      = 6               // capacity.concurrency: the cap the dependency checks
	threads    = 4               // goroutines or threads per worker process
	leaseTTL   = 3 * time.Second // the workers' LeaseTTL (Go and Python)
	// redisTimeout is the guards' RedisTimeout (the default).
	redisTimeout = 250 * time.Millisecond
	// visibility is how long a job handed out stays invisible to the other
	// workers: a job whose worker died comes back after it.
	visibility = 2 * leaseTTL

	// The policy's breaker and ramp, short so that a trip and its
	// recovery fit in seconds.
	openDuration   = 2 * time.Second
	stepDuration   = 1 * time.Second
	halfOpenProbes = 2
	evalInterval   = 500 * time.Millisecond
	// Leader election: the timings of cmd/manager's HA tests.
	haLease, haRenew, haRetry = 4 * time.Second, 3 * time.Second, 250 * time.Millisecond
)

// rampSteps are the policy's ramp steps, rampLen of them.
var rampSteps = []int32{2, 4, 6}

const rampLen = 3

// workerKind is a worker's language and mode.
type workerKind string

const (
	goPerCall workerKind = "go"
	goBatch   workerKind = "go-batch"
	python    workerKind = "python"
)

const pythonBin = "/usr/bin/python3"

// fleet is everything the campaign runs: an API server with the policy, a
// redis-server, manager processes, the dependency and the worker processes,
// each worker and manager talking to Redis through its own fault proxy.
type fleet struct {
	t    *testing.T
	kube *testenv.Env
	ns   string
	dir  string
	kcfg string

	redis  *redistest.Server
	rdb    *redis.Client // the test's own, direct
	proto  *protocol.Client
	dep    *dependency
	depURL string

	toxi *toxiproxy.ApiServer
	// sentinel, when set, is the Redis every process reaches through the
	// sentinels, with no proxy in between (TestFaultSoakSentinel).
	sentinel *redistest.Sentinel

	mu       sync.Mutex
	managers []*managerProc
	workers  []*workerProc
	nextName int
	// deadStats are the last stats of the workers that are gone.
	deadStats []workerStats
}

// managerBin is the manager binary TestMain builds.
var managerBin string

func startFleet(t *testing.T, withKube, withSentinel bool) *fleet {
	t.Helper()
	f := &fleet{t: t, dir: t.TempDir()}
	f.toxi = toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())

	if withKube {
		f.startKube()
	} else {
		f.ns = "faults"
	}
	if withSentinel {
		f.sentinel = redistest.StartSentinel(t)
		f.rdb = f.sentinel.Client(func(o *redis.FailoverOptions) { o.ContextTimeoutEnabled = true })
	} else {
		f.redis = redistest.Start(t)
		f.rdb = f.redis.Client(func(o *redis.Options) { o.ContextTimeoutEnabled = true; o.MaxRetries = -1 })
	}
	var err error
	f.proto, err = protocol.NewClient(f.rdb, protocol.Dependency{Namespace: f.ns, Name: policyName})
	if err != nil {
		t.Fatal(err)
	}

	f.dep = newDependency(limit, visibility)
	srv := httptest.NewServer(f.dep)
	t.Cleanup(srv.Close)
	f.depURL = srv.URL
	return f
}

// startKube starts a kube-apiserver and etcd with the CRDs, a user for
// the managers and a namespace for the policy.
func (f *fleet) startKube() {
	kube, err := testenv.Start()
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { _ = kube.Stop() })
	f.kube = kube
	user, err := kube.Environment.ControlPlane.AddUser(envtest.User{Name: "spillway-manager", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		f.t.Fatal(err)
	}
	f.kcfg = filepath.Join(f.dir, "kubeconfig")
	if err := os.WriteFile(f.kcfg, kc, 0o600); err != nil {
		f.t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "faults-"}}
	if err := kube.Client.Create(context.Background(), ns); err != nil {
		f.t.Fatal(err)
	}
	f.ns = ns.Name

}

// createPolicy creates the policy the fleet calls under.
func (f *fleet) createPolicy() {
	f.t.Helper()
	pol := &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: policyName},
		Spec: spillwayv1alpha1.DependencyPolicySpec{
			Capacity: spillwayv1alpha1.Capacity{Concurrency: limit},
			Ramp: spillwayv1alpha1.Ramp{
				Steps:        rampSteps,
				StepDuration: metav1.Duration{Duration: stepDuration},
			},
			Breaker: spillwayv1alpha1.Breaker{
				FailureRatio: 0.5, MinCalls: 10, HalfOpenProbes: halfOpenProbes,
				Window:       metav1.Duration{Duration: 5 * time.Second},
				OpenDuration: metav1.Duration{Duration: openDuration},
			},
			Backoff: spillwayv1alpha1.Backoff{
				Base: metav1.Duration{Duration: 20 * time.Millisecond},
				Max:  metav1.Duration{Duration: 200 * time.Millisecond},
			},
		},
	}
	if err := f.kube.Client.Create(context.Background(), pol); err != nil {
		f.t.Fatal(err)
	}
}

// published is the state in Redis, read directly (not through a proxy).
func (f *fleet) published() (protocol.Published, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	p, ok, err := f.proto.ReadPublished(ctx)
	if err != nil {
		return protocol.Published{}, false
	}
	return p, ok
}

// stalled reports whether the manager has seen the policy's current spec
// and found it unusable: its Stalled condition is True for this generation.
func (f *fleet) stalled() bool {
	pol := &spillwayv1alpha1.DependencyPolicy{}
	if err := f.kube.Client.Get(context.Background(), types.NamespacedName{Namespace: f.ns, Name: policyName}, pol); err != nil {
		return false
	}
	for _, c := range pol.Status.Conditions {
		if c.Type == "Stalled" {
			return c.Status == metav1.ConditionTrue && c.ObservedGeneration == pol.Generation
		}
	}
	return false
}

// stateHash is the state hash in Redis, for a breach's message.
func (f *fleet) stateHash() map[string]string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	h, _ := f.rdb.HGetAll(ctx, protocol.KeysFor(protocol.Dependency{Namespace: f.ns, Name: policyName}).State).Result()
	return h
}

// stateLimit is "State/limit" as published, "" when nothing is.
func (f *fleet) stateLimit() string {
	p, ok := f.published()
	if !ok {
		return ""
	}
	return fmt.Sprintf("%s/%d", p.State, p.Limit)
}

// liveLeases counts the leases that hold a slot now, by Redis time: those of
// calls (per call) and those of batch pools (members "<pool id>:<n>",
// docs/protocol.md §4 pool). A pool keeps idle slots, renewed, until another
// process wants them; a call's lease is held only while its call runs.
func (f *fleet) liveLeases() (calls, pooled int64, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	now, err := f.rdb.Time(ctx).Result()
	if err != nil {
		return 0, 0, err
	}
	members, err := f.rdb.ZRangeByScore(ctx, protocol.KeysFor(protocol.Dependency{Namespace: f.ns, Name: policyName}).Leases,
		&redis.ZRangeBy{Min: "(" + strconv.FormatInt(now.UnixMilli(), 10), Max: "+inf"}).Result()
	if err != nil {
		return 0, 0, err
	}
	for _, m := range members {
		if strings.Contains(m, ":") {
			pooled++
		} else {
			calls++
		}
	}
	return calls, pooled, nil
}

// leaseMembers lists the live leases: each member and how long until it
// expires, for a breach's message.
func (f *fleet) leaseMembers() string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	now, err := f.rdb.Time(ctx).Result()
	if err != nil {
		return err.Error()
	}
	zs, err := f.rdb.ZRangeByScoreWithScores(ctx, protocol.KeysFor(protocol.Dependency{Namespace: f.ns, Name: policyName}).Leases,
		&redis.ZRangeBy{Min: "(" + strconv.FormatInt(now.UnixMilli(), 10), Max: "+inf"}).Result()
	if err != nil {
		return err.Error()
	}
	var parts []string
	for _, z := range zs {
		parts = append(parts, fmt.Sprintf("%v expires in %dms", z.Member, int64(z.Score)-now.UnixMilli()))
	}
	return strings.Join(parts, ", ")
}

// proxy is a fault proxy in front of Redis for one process.
type proxy struct {
	p *toxiproxy.Proxy
}

func (f *fleet) newProxy(name string) *proxy {
	f.t.Helper()
	p := toxiproxy.NewProxy(f.toxi, name, "127.0.0.1:0", f.redis.Addr())
	if err := p.Start(); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(p.Stop)
	return &proxy{p: p}
}

func (p *proxy) addr() string { return p.p.Listen }

// add adds a toxic: typ on stream ("upstream": towards Redis, "downstream":
// the replies) with the attributes given.
func (p *proxy) add(name, typ, stream string, attrs map[string]any) error {
	b, _ := json.Marshal(map[string]any{"name": name, "type": typ, "stream": stream, "attributes": attrs})
	_, err := p.p.Toxics.AddToxicJson(strings.NewReader(string(b)))
	if err != nil {
		return fmt.Errorf("add toxic %s to %s: %w", name, p.p.Name, err)
	}
	return nil
}

// heal removes every toxic.
func (p *proxy) heal() { p.p.Toxics.ResetToxics(context.Background()) }

// block stops the bytes going one way (a partition in that direction).
func (p *proxy) block(stream string) error {
	return p.add("block-"+stream, "timeout", stream, map[string]any{"timeout": 0})
}

// managerProc is a manager process.
type managerProc struct {
	name  string
	proc  *proctest.Proc
	log   string
	proxy *proxy
}

// startManager starts a manager process with leader election, its Redis
// connection through its own proxy.
func (f *fleet) startManager() *managerProc {
	f.t.Helper()
	f.mu.Lock()
	f.nextName++
	name := fmt.Sprintf("manager-%d", f.nextName)
	f.mu.Unlock()
	px := f.newProxy(name)
	logPath := filepath.Join(f.dir, name+".log")
	lf, err := os.Create(logPath)
	if err != nil {
		f.t.Fatal(err)
	}
	defer lf.Close()
	args := []string{
		"--kubeconfig=" + f.kcfg,
		"--leader-election-namespace=default",
		"--redis-addr=" + px.addr(),
		"--metrics-bind-address=0",
		"--health-probe-bind-address=0",
		"--evaluation-interval=" + evalInterval.String(),
		"--leader-election-lease-duration=" + haLease.String(),
		"--leader-election-renew-deadline=" + haRenew.String(),
		"--leader-election-retry-period=" + haRetry.String(),
	}
	p, err := proctest.Start(managerBin, args, f.dir, lf)
	if err != nil {
		f.t.Fatal(err)
	}
	m := &managerProc{name: name, proc: p, log: logPath, proxy: px}
	f.t.Cleanup(func() {
		p.Kill()
		if f.t.Failed() {
			f.t.Logf("%s's log ends:\n%s", name, proctest.Tail(logPath, 20))
		}
	})
	f.mu.Lock()
	f.managers = append(f.managers, m)
	f.mu.Unlock()
	return m
}

func (m *managerProc) alive() bool {
	select {
	case <-m.proc.Exited():
		return false
	default:
		return true
	}
}

// leader is the manager that holds the Lease, nil when none does or the
// holder is not one of ours that runs.
func (f *fleet) leader() *managerProc {
	var lease coordinationv1.Lease
	if err := f.kube.Client.Get(context.Background(), types.NamespacedName{Namespace: "default", Name: "spillway.dev"}, &lease); err != nil {
		return nil
	}
	holder := ptr.Deref(lease.Spec.HolderIdentity, "")
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, m := range f.managers {
		if !m.alive() {
			continue
		}
		// The identity is the hostname and a random suffix; the leader
		// logs that it acquired the Lease.
		if holder != "" && strings.Contains(strings.ToLower(proctest.ReadFrom(m.log, 0)), "successfully acquired lease") {
			return m
		}
	}
	return nil
}

// liveManagers are the managers that run.
func (f *fleet) liveManagers() []*managerProc {
	f.mu.Lock()
	defer f.mu.Unlock()
	var live []*managerProc
	for _, m := range f.managers {
		if m.alive() {
			live = append(live, m)
		}
	}
	return live
}

// workerProc is one worker process.
type workerProc struct {
	kind  workerKind
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	proxy *proxy
	done  chan struct{}

	mu   sync.Mutex
	last workerStats
}

func (w *workerProc) stats() workerStats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.last
}

func (w *workerProc) alive() bool {
	select {
	case <-w.done:
		return false
	default:
		return true
	}
}

func (w *workerProc) signal(sig syscall.Signal) error { return w.cmd.Process.Signal(sig) }

// startWorker starts a worker of kind, its Redis connection through a new
// proxy.
func (f *fleet) startWorker(kind workerKind) *workerProc {
	f.t.Helper()
	f.mu.Lock()
	f.nextName++
	name := fmt.Sprintf("%s-%d", kind, f.nextName)
	f.mu.Unlock()
	var px *proxy
	redisAt := ""
	if f.sentinel != nil {
		redisAt = sentinelEnv + "=" + strings.Join(f.sentinel.SentinelAddrs(), ",")
	} else {
		px = f.newProxy(name)
		redisAt = redisEnv + "=" + px.addr()
	}
	repo, _ := filepath.Abs(filepath.Join("..", ".."))
	env := append(os.Environ(), redisAt, masterEnv+"="+redistest.SentinelMasterName,
		depEnv+"="+f.ns+"/"+policyName, urlEnv+"="+f.depURL,
		threadsEnv+"="+strconv.Itoa(threads), leaseTTLEnv+"="+strconv.FormatFloat(leaseTTL.Seconds(), 'f', -1, 64),
		"PYTHONPATH="+filepath.Join(repo, "clients", "python"))
	var cmd *exec.Cmd
	switch kind {
	case python:
		cmd = exec.Command(pythonBin, "worker.py")
	default:
		self, err := os.Executable()
		if err != nil {
			f.t.Fatal(err)
		}
		cmd = exec.Command(self, "-test.run=^$")
		env = append(env, roleEnv+"=go-worker", batchEnv+"="+strconv.FormatBool(kind == goBatch))
	}
	cmd.Env = env
	stdin, err := cmd.StdinPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	cmd.Stderr = &logWriter{t: f.t, prefix: name}
	if err := cmd.Start(); err != nil {
		f.t.Fatalf("failed to start %s: %v", name, err)
	}
	w := &workerProc{kind: kind, name: name, cmd: cmd, stdin: stdin, proxy: px, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), statsPrefix)
			if !ok {
				continue
			}
			var s workerStats
			if err := json.Unmarshal([]byte(line), &s); err == nil {
				w.mu.Lock()
				w.last = s
				w.mu.Unlock()
			}
		}
		_ = cmd.Wait()
		close(w.done)
	}()
	f.t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Signal(syscall.SIGCONT)
		select {
		case <-w.done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-w.done
		}
	})
	f.mu.Lock()
	f.workers = append(f.workers, w)
	f.mu.Unlock()
	return w
}

// replace swaps a dead worker for a new one of its kind, as a Deployment
// replaces a pod.
func (f *fleet) replace(old *workerProc) *workerProc {
	<-old.done
	f.mu.Lock()
	for i, w := range f.workers {
		if w == old {
			f.workers = append(f.workers[:i], f.workers[i+1:]...)
			break
		}
	}
	f.deadStats = append(f.deadStats, old.stats())
	f.mu.Unlock()
	return f.startWorker(old.kind)
}

// worker is the live worker of kind, nil if none.
func (f *fleet) worker(kind workerKind) *workerProc {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, w := range f.workers {
		if w.kind == kind && w.alive() {
			return w
		}
	}
	return nil
}

// allStats are the latest stats of every worker, dead or alive.
func (f *fleet) allStats() []workerStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	all := append([]workerStats(nil), f.deadStats...)
	for _, w := range f.workers {
		all = append(all, w.stats())
	}
	return all
}

type logWriter struct {
	t      *testing.T
	prefix string
}

func (w *logWriter) Write(b []byte) (int, error) {
	for line := range strings.Lines(string(b)) {
		w.t.Logf("%s: %s", w.prefix, strings.TrimRight(line, "\n"))
	}
	return len(b), nil
}

// waitFor polls cond every 20 ms until it holds or d passes; it returns
// whether it held.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// closedAtCapacity reports whether the fleet is published Closed at its
// capacity.
func (f *fleet) closedAtCapacity() bool {
	return f.stateLimit() == fmt.Sprintf("%s/%d", wire.Closed, limit)
}

// loosenCRD removes the spec's cross-field rules (CEL) from the
// DependencyPolicy CRD in the API server, as an older, looser CRD had them:
// a spec the controller cannot use (a ramp step above the capacity) can
// then be stored.
func (f *fleet) loosenCRD() error {
	ctx := context.Background()
	crd := &unstructured.Unstructured{}
	crd.SetGroupVersionKind(schema.GroupVersionKind{Group: "apiextensions.k8s.io", Version: "v1", Kind: "CustomResourceDefinition"})
	if err := f.kube.Client.Get(ctx, types.NamespacedName{Name: "dependencypolicies.spillway.dev"}, crd); err != nil {
		return fmt.Errorf("get the CRD: %w", err)
	}
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	for i := range versions {
		v := versions[i].(map[string]any)
		unstructured.RemoveNestedField(v, "schema", "openAPIV3Schema", "properties", "spec", "x-kubernetes-validations")
		versions[i] = v
	}
	if err := unstructured.SetNestedSlice(crd.Object, versions, "spec", "versions"); err != nil {
		return err
	}
	if err := f.kube.Client.Update(ctx, crd); err != nil {
		return fmt.Errorf("update the CRD: %w", err)
	}
	return nil
}

// setRampSteps sets the policy's ramp steps, retrying while the API server
// refuses them (a loosened CRD takes a moment to apply).
func (f *fleet) setRampSteps(steps []int32, within time.Duration) error {
	var last error
	ok := waitFor(within, func() bool {
		pol := &spillwayv1alpha1.DependencyPolicy{}
		if last = f.kube.Client.Get(context.Background(), types.NamespacedName{Namespace: f.ns, Name: policyName}, pol); last != nil {
			return false
		}
		pol.Spec.Ramp.Steps = steps
		last = f.kube.Client.Update(context.Background(), pol)
		return last == nil
	})
	if !ok {
		return fmt.Errorf("set ramp steps %v: %w", steps, last)
	}
	return nil
}
