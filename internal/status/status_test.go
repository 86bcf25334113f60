package status

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/replay"
	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// These tests run the real controller (internal/replay's control plane:
// kube-apiserver and etcd, a redis-server, the manager) and read what it
// writes with the command itself.

var (
	cp         *replay.ControlPlane
	kubeconfig string
)

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	var err error
	cp, err = replay.StartControlPlane(context.Background(), 100*time.Millisecond)
	if err != nil {
		fmt.Fprintf(os.Stderr, "failed to start the control plane: %v\n", err)
		return 1
	}
	defer cp.Stop()
	user, err := cp.Env.Environment.AddUser(envtest.User{Name: "operator", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		fmt.Fprintf(os.Stderr, "failed to add a user: %v\n", err)
		return 1
	}
	b, err := user.KubeConfig()
	if err != nil {
		fmt.Fprintf(os.Stderr, "failed to write a kubeconfig: %v\n", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "spillway-status-*")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, b, 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}

// run runs the command with the test kubeconfig and Redis, and returns its
// exit code, stdout and stderr.
func run(ctx context.Context, args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	args = append([]string{"--kubeconfig", kubeconfig, "--redis-addr", cp.Redis.Addr()}, args...)
	code := Run(ctx, "spillway status", args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// line is the table line of policy name in out, split into its cells (on
// runs of 3 spaces or more, the table's padding).
func line(g Gomega, out, name string) []string {
	for _, l := range strings.Split(out, "\n") {
		cells := splitCells(l)
		if len(cells) > 1 && (cells[0] == name || cells[1] == name) {
			return cells
		}
	}
	g.Expect(out).To(ContainSubstring(name), "no line for %s", name)
	return nil
}

func splitCells(l string) []string {
	var cells []string
	for _, c := range strings.Split(l, "   ") {
		if c = strings.TrimSpace(c); c != "" {
			cells = append(cells, c)
		}
	}
	return cells
}

// closedPort is a loopback port nothing listens on.
func closedPort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// testSpec: capacity 8, ramp 2, 4, 8 one step per minute (so Ramping
// lasts), a breaker that opens on 5 calls at 50% and half-opens after 3s.
func testSpec() spillwayv1alpha1.DependencyPolicySpec {
	return spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: 8},
		Ramp: spillwayv1alpha1.Ramp{
			Steps:        []int32{2, 4, 8},
			StepDuration: metav1.Duration{Duration: time.Minute},
			StepBack:     spillwayv1alpha1.RampStepBack{When: spillwayv1alpha1.StepBackRamping, FailureRatio: 0.01, MinFailures: 3},
		},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio: 0.5, MinCalls: 5, HalfOpenProbes: 1,
			Window:       metav1.Duration{Duration: 10 * time.Second},
			OpenDuration: metav1.Duration{Duration: 3 * time.Second},
		},
		Consumers: []spillwayv1alpha1.Consumer{{ScaledObjectName: "render-workers", SlotsPerReplica: 2}},
	}
}

// TestClosedOpenRamping follows one policy through an outage with the real
// controller, reading it with the command at each state: Closed with a call
// in flight, Open with the consumer's minimum pinned, then Ramping.
func TestClosedOpenRamping(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w := replay.Workload{Namespace: "mail", Policy: "template-api", ScaledObject: "render-workers", Deployment: "render"}
	fleet, err := cp.Install(ctx, w, testSpec(), 3, 10)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(cp.WaitBounded(ctx, w, fleet, 4)).To(Succeed())

	// Closed: one call held in flight, 4 calls done, one of them a retry.
	for i := range 4 {
		g.Expect(fleet.Guard.Do(ctx, guard.Job{Attempt: 1 + i/3}, func(context.Context) error { return nil })).To(Succeed())
	}
	held, err := fleet.Guard.Acquire(ctx, guard.Job{Attempt: 1})
	g.Expect(err).NotTo(HaveOccurred())
	// The controller writes status after it bounds the consumer: wait for it.
	var closedOut string
	g.Eventually(func(g Gomega) {
		code, out, stderr := run(ctx, "-n", "mail")
		g.Expect(code).To(Equal(ExitOK), stderr)
		g.Expect(stderr).To(BeEmpty())
		closedOut = out
		g.Expect(out).To(HavePrefix("NAME "))
		cells := line(g, out, "template-api")
		g.Expect(cells[:10]).To(Equal([]string{"template-api", "Closed", "8/8", "-", "1", "0.4", "0.0%", "25.0%", strconv.Itoa(protocol.Version), "max 4"}))
		g.Expect(cells[11]).To(Equal("-"))
	}).WithTimeout(5 * time.Second).WithPolling(100 * time.Millisecond).Should(Succeed())
	t.Logf("Closed:\n%s", closedOut)
	g.Expect(held.Done(nil)).To(Succeed())

	// Open: failures past the ratio; the consumer's minimum is pinned at the
	// Deployment's 3 replicas, and the reason is Ready's.
	for range 6 {
		_ = fleet.Guard.Do(ctx, guard.Job{Attempt: 1}, func(context.Context) error { return errors.New("down") })
	}
	var openOut string
	g.Eventually(func(g Gomega) {
		code, out, stderr := run(ctx, "-n", "mail", "template-api", "-o", "wide")
		g.Expect(code).To(Equal(ExitOK), stderr)
		openOut = out
		cells := line(g, out, "template-api")
		g.Expect(cells[1:3]).To(Equal([]string{"Open", "0/8"}))
		g.Expect(cells[9]).To(Equal("so/render-workers max 4 min 3"))
		g.Expect(cells[11]).To(Equal(controllers.ReasonFailureRatioExceeded))
		g.Expect(cells[12]).To(HavePrefix("Open 0 epoch "))
		g.Expect(cells[14]).To(HavePrefix("The breaker is open: workers make no calls until "))
	}).WithTimeout(20 * time.Second).WithPolling(200 * time.Millisecond).Should(Succeed())
	t.Logf("Open:\n%s", openOut)

	// Ramping: a probe succeeds once the breaker half-opens; the ramp then
	// holds its first step for a minute.
	g.Eventually(func(g Gomega) {
		_ = fleet.Guard.Do(ctx, guard.Job{Attempt: 1}, func(context.Context) error { return nil })
		code, out, stderr := run(ctx, "-n", "mail", "-o", "json")
		g.Expect(code).To(Equal(ExitOK), stderr)
		var rep Report
		g.Expect(json.Unmarshal([]byte(out), &rep)).To(Succeed())
		g.Expect(rep.Items).To(HaveLen(1))
		row := rep.Items[0]
		g.Expect(row.State).To(Equal("Ramping"))
		g.Expect(row.Ramp).To(Equal(&Ramp{Step: 1, Steps: 3}))
		g.Expect(row.Limit).To(Equal(int32(2)))
		g.Expect(row.Redis).NotTo(BeNil())
		g.Expect(row.Redis.State).To(Equal("Ramping"))
		g.Expect(row.Redis.Limit).To(Equal(int64(2)))
		g.Expect(row.Ready.Reason).To(Equal(controllers.ReasonEvaluated))
		g.Expect(row.Ramping.Reason).To(Equal(controllers.ReasonRampInProgress))
	}).WithTimeout(20 * time.Second).WithPolling(300 * time.Millisecond).Should(Succeed())
	code, out, stderr := run(ctx, "-n", "mail", "-o", "wide")
	g.Expect(code).To(Equal(ExitOK), stderr)
	t.Logf("Ramping:\n%s", out)
	cells := line(g, out, "template-api")
	g.Expect(cells[1:4]).To(Equal([]string{"Ramping", "2/8", "1/3"}))
	g.Expect(cells[11]).To(Equal(controllers.ReasonRampInProgress))
	g.Expect(cells[14]).To(Equal("Ramp step 1 of 3: limit 2"))

	// Redis unreachable: the cluster's columns, and a note; exit 0.
	code, out, stderr = run(ctx, "-n", "mail", "--redis-addr", closedPort(t))
	g.Expect(code).To(Equal(ExitOK), stderr)
	t.Logf("Redis unreachable:\n%s", out)
	cells = line(g, out, "template-api")
	g.Expect(cells).To(HaveLen(12))
	g.Expect(cells[1:4]).To(Equal([]string{"Ramping", "2/8", "1/3"}))
	g.Expect(cells[4:8]).To(Equal([]string{"?", "?", "?", "?"}))
	g.Expect(cells[9]).To(Equal("max 4 min 3"))
	g.Expect(cells[11]).To(Equal(controllers.ReasonRampInProgress))
	g.Expect(stderr).To(BeEmpty())
	g.Expect(out).To(ContainSubstring("Redis was unreachable, so IN FLIGHT, CALLS/s, FAIL% and RETRY% are unknown (?): Redis at 127.0.0.1:"))
	g.Expect(out).To(ContainSubstring("connection refused"))
}

// TestUnboundConsumer: a consumer whose HPA does not exist shows as
// unbound, with the controller's reason, in a row of its own namespace.
func TestUnboundConsumer(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g.Expect(cp.Env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "fleet"}})).To(Succeed())
	g.Expect(cp.Env.Client.Create(ctx, &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "fleet", Name: "vehicle-api"},
		Spec: spillwayv1alpha1.DependencyPolicySpec{
			Capacity:  spillwayv1alpha1.Capacity{Concurrency: 10},
			Consumers: []spillwayv1alpha1.Consumer{{HorizontalPodAutoscalerName: "enrich"}},
		},
	})).To(Succeed())
	g.Eventually(func(g Gomega) {
		code, out, stderr := run(ctx, "-A", "-o", "wide")
		g.Expect(code).To(Equal(ExitOK), stderr)
		g.Expect(out).To(HavePrefix("NAMESPACE "))
		cells := line(g, out, "vehicle-api")
		g.Expect(cells[:5]).To(Equal([]string{"fleet", "vehicle-api", "Closed", "10/10", "-"}))
		g.Expect(cells[10]).To(Equal("hpa/enrich not found"))
		g.Expect(cells[12]).To(Equal(controllers.ReasonHorizontalPodAutoscalerNotFound))
		g.Expect(cells[15]).To(ContainSubstring("consumers not bounded"))
	}).WithTimeout(20 * time.Second).WithPolling(200 * time.Millisecond).Should(Succeed())
	code, out, stderr := run(ctx, "-A")
	g.Expect(code).To(Equal(ExitOK), stderr)
	t.Logf("-A:\n%s", out)
	g.Expect(line(g, out, "vehicle-api")[10]).To(Equal("unbound"))
}

// TestWatch prints the status again until the context ends, and exits 0:
// a policy created after the first print shows in a later one.
func TestWatch(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g.Expect(cp.Env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "watch"}})).To(Succeed())
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		args := []string{"--kubeconfig", kubeconfig, "--redis-addr", cp.Redis.Addr(), "-n", "watch", "--watch", "--watch-interval", "200ms", "-o", "yaml"}
		done <- Run(watchCtx, "spillway status", args, &out, &errOut)
	}()
	g.Eventually(out.String).WithTimeout(20 * time.Second).Should(ContainSubstring("items:"))
	g.Expect(cp.Env.Client.Create(ctx, &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "watch", Name: "late"},
		Spec:       spillwayv1alpha1.DependencyPolicySpec{Capacity: spillwayv1alpha1.Capacity{Concurrency: 3}},
	})).To(Succeed())
	g.Eventually(out.String).WithTimeout(20 * time.Second).Should(ContainSubstring("name: late"))
	stopWatch()
	g.Expect(<-done).To(Equal(ExitOK), errOut.String())
	docs := strings.Split(out.String(), "---\n")
	g.Expect(len(docs)).To(BeNumerically(">=", 2))
	var first, last Report
	g.Expect(yaml.Unmarshal([]byte(docs[0]), &first)).To(Succeed())
	g.Expect(yaml.Unmarshal([]byte(docs[len(docs)-1]), &last)).To(Succeed())
	g.Expect(first.Items).To(BeEmpty())
	g.Expect(last.Items).To(HaveLen(1))
	g.Expect(last.Items[0].Name).To(Equal("late"))
	g.Expect(last.Items[0].Capacity).To(Equal(int32(3)))
}

// syncBuffer is a bytes.Buffer safe for one writer and concurrent readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestKubectlPlugin builds bin/kubectl-spillway and runs it as kubectl
// would, `kubectl-spillway status ...`, and through kubectl itself when one
// is on the PATH.
func TestKubectlPlugin(t *testing.T) {
	g := NewWithT(t)
	dir := t.TempDir()
	build := exec.Command("go", "build", "-o", filepath.Join(dir, "kubectl-spillway"), "./cmd/kubectl-spillway")
	build.Dir = testenv.RepoRoot()
	out, err := build.CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), string(out))
	args := []string{"spillway", "status", "-A", "--kubeconfig", kubeconfig, "--redis-addr", cp.Redis.Addr(), "-o", "json"}
	cmds := []*exec.Cmd{exec.Command(filepath.Join(dir, "kubectl-spillway"), args[1:]...)}
	if kubectl, err := exec.LookPath("kubectl"); err == nil {
		c := exec.Command(kubectl, args...)
		c.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"))
		cmds = append(cmds, c)
	} else {
		t.Log("No kubectl on the PATH: the plugin is run directly only")
	}
	for _, c := range cmds {
		var stdout, stderr bytes.Buffer
		c.Stdout, c.Stderr = &stdout, &stderr
		g.Expect(c.Run()).To(Succeed(), "%s: %s", c.Args, stderr.String())
		var rep Report
		g.Expect(json.Unmarshal(stdout.Bytes(), &rep)).To(Succeed(), stdout.String())
		g.Expect(rep.RedisUnreachable).To(BeEmpty())
		names := make([]string, 0, len(rep.Items))
		for _, it := range rep.Items {
			names = append(names, it.Namespace+"/"+it.Name)
		}
		g.Expect(names).To(ContainElement("mail/template-api"), "%s", c.Args)
	}
}

// TestErrors: a policy that does not exist and an API server that cannot be
// reached fail the command; bad flags are usage errors.
func TestErrors(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	code, _, stderr := run(ctx, "-n", "mail", "no-such-policy")
	g.Expect(code).To(Equal(ExitFailure))
	g.Expect(stderr).To(ContainSubstring(`DependencyPolicy "no-such-policy" not found`))
	code, _, stderr = run(ctx, "-o", "xml")
	g.Expect(code).To(Equal(ExitUsage))
	g.Expect(stderr).To(ContainSubstring(`unknown output format "xml"`))
	var out, errOut bytes.Buffer
	code = Run(ctx, "spillway status", []string{"--kubeconfig", filepath.Join(t.TempDir(), "none")}, &out, &errOut)
	g.Expect(code).To(Equal(ExitFailure))
	g.Expect(errOut.String()).To(ContainSubstring("failed to read the kubeconfig"))
}

// TestRedisNotAnswering: a Redis that accepts connections but does not
// answer (SIGSTOP) is asked once, not once per policy (each would wait out
// --redis-timeout); the command still prints the cluster's columns and
// exits 0.
func TestRedisNotAnswering(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g.Expect(cp.Env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "paused"}})).To(Succeed())
	names := []string{"a", "b", "c"}
	for _, name := range names {
		g.Expect(cp.Env.Client.Create(ctx, &spillwayv1alpha1.DependencyPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: "paused", Name: name},
			Spec:       spillwayv1alpha1.DependencyPolicySpec{Capacity: spillwayv1alpha1.Capacity{Concurrency: 4}},
		})).To(Succeed())
	}
	g.Eventually(func(g Gomega) {
		_, out, _ := run(ctx, "-n", "paused")
		for _, name := range names {
			g.Expect(line(g, out, name)[1]).To(Equal("Closed"))
		}
	}).WithTimeout(20 * time.Second).WithPolling(200 * time.Millisecond).Should(Succeed())

	paused := redistest.Start(t)
	g.Expect(paused.Pause()).To(Succeed())
	defer func() { _ = paused.Resume() }()
	args := []string{"-n", "paused", "--redis-addr", paused.Addr(), "--redis-timeout", "500ms"}
	start := time.Now()
	code, out, stderr := run(ctx, args...)
	t.Logf("Redis paused, %v:\n%s", time.Since(start), out)
	g.Expect(code).To(Equal(ExitOK), stderr)
	for _, name := range names {
		cells := line(g, out, name)
		g.Expect(cells[1:3]).To(Equal([]string{"Closed", "4/4"}))
		g.Expect(cells[4:8]).To(Equal([]string{"?", "?", "?", "?"}))
	}
	g.Expect(out).To(ContainSubstring("Redis was unreachable"))
	g.Expect(out).To(ContainSubstring("i/o timeout"))

	code, out, stderr = run(ctx, append(args, "-o", "json")...)
	g.Expect(code).To(Equal(ExitOK), stderr)
	var rep Report
	g.Expect(json.Unmarshal([]byte(out), &rep)).To(Succeed())
	g.Expect(rep.RedisUnreachable).To(ContainSubstring("failed to read the state of paused/a: i/o timeout"))
	g.Expect(rep.Items).To(HaveLen(len(names)))
	for _, it := range rep.Items {
		g.Expect(it.Redis).To(BeNil())
		// b and c were not asked: their error is a's.
		g.Expect(it.RedisError).To(ContainSubstring("paused/a"))
	}
}

// TestReadOnlyRedisUser: status writes nothing to Redis. Run as a Redis user
// that may only read (ACL: the read commands, the connection's, TIME, and
// EVAL/EVALSHA, whose commands Redis checks against the same rules), it
// shows a policy's calls from Redis. The controller's window script, which
// caches totals, prunes and sweeps leases, would be refused.
func TestReadOnlyRedisUser(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g.Expect(cp.Env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "readonly"}})).To(Succeed())
	g.Expect(cp.Env.Client.Create(ctx, &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "readonly", Name: "ledger"},
		Spec:       spillwayv1alpha1.DependencyPolicySpec{Capacity: spillwayv1alpha1.Capacity{Concurrency: 4}},
	})).To(Succeed())
	g.Eventually(func(g Gomega) {
		_, out, _ := run(ctx, "-n", "readonly")
		g.Expect(line(g, out, "ledger")[1]).To(Equal("Closed"))
	}).WithTimeout(20 * time.Second).WithPolling(200 * time.Millisecond).Should(Succeed())

	admin := cp.Redis.Client()
	defer admin.Close()
	g.Expect(admin.Do(ctx, "ACL", "SETUSER", "status-reader", "reset", "on", ">reader-secret", "~*", "resetchannels",
		"+@read", "+@connection", "+time", "+eval", "+evalsha").Err()).To(Succeed())
	defer admin.Do(context.Background(), "ACL", "DELUSER", "status-reader")
	// The user is refused a write, also from a script (Redis 7.0 says
	// "can't run this command", later versions NOPERM).
	reader := cp.Redis.Client(func(o *redis.Options) { o.Username, o.Password = "status-reader", "reader-secret" })
	defer reader.Close()
	refused := Or(ContainSubstring("NOPERM"), ContainSubstring("can't run this command"))
	g.Expect(reader.HSet(ctx, "status-test", "f", "1").Err()).To(MatchError(refused))
	g.Expect(reader.Eval(ctx, "return redis.call('HSET', KEYS[1], 'f', '1')", []string{"status-test"}).Err()).To(MatchError(refused))
	pc, err := protocol.NewClient(admin, protocol.Dependency{Namespace: "readonly", Name: "ledger"})
	g.Expect(err).NotTo(HaveOccurred())
	for range 5 {
		_, err := pc.Release(ctx, "", 0, protocol.Success, 1)
		g.Expect(err).NotTo(HaveOccurred())
	}

	password := filepath.Join(t.TempDir(), "password")
	g.Expect(os.WriteFile(password, []byte("reader-secret\n"), 0o600)).To(Succeed())
	code, out, stderr := run(ctx, "-n", "readonly", "-o", "json", "--redis-username", "status-reader", "--redis-password-file", password)
	g.Expect(code).To(Equal(ExitOK), stderr)
	var rep Report
	g.Expect(json.Unmarshal([]byte(out), &rep)).To(Succeed(), out)
	g.Expect(rep.RedisUnreachable).To(BeEmpty())
	g.Expect(rep.Items).To(HaveLen(1))
	g.Expect(rep.Items[0].RedisError).To(BeEmpty())
	g.Expect(rep.Items[0].Redis).NotTo(BeNil())
	g.Expect(rep.Items[0].Redis.Calls).To(BeNumerically(">=", 5))
}
