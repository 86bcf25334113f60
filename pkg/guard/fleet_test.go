package guard_test

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
)

// The fleet tests run workers in child processes: the test binary re-executes
// itself with childEnv set, and TestMain hands over to runChild.
const childEnv = "SPILLWAY_GUARD_CHILD"

type fleet struct {
	addrs   []string
	cluster bool
}

func (f fleet) env() []string {
	return []string{
		"SPILLWAY_REDIS_ADDRS=" + strings.Join(f.addrs, ","),
		"SPILLWAY_REDIS_CLUSTER=" + strconv.FormatBool(f.cluster),
	}
}

func childClient() redis.UniversalClient {
	addrs := strings.Split(os.Getenv("SPILLWAY_REDIS_ADDRS"), ",")
	if os.Getenv("SPILLWAY_REDIS_CLUSTER") == "true" {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true, PoolSize: 256})
	}
	return redis.NewClient(&redis.Options{Addr: addrs[0], ContextTimeoutEnabled: true, PoolSize: 256})
}

func runChild(mode string) int {
	rdb := childClient()
	defer func() { _ = rdb.Close() }()
	var err error
	switch mode {
	case "contend":
		err = contend(rdb)
	case "hold":
		err = hold(rdb)
	default:
		err = fmt.Errorf("unknown child mode %q", mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// batchEnv turns a child's batch mode on.
const batchEnv = "SPILLWAY_BATCH=true"

// childBatch is a child's batch mode, from its environment.
func childBatch() guard.BatchOptions {
	return guard.BatchOptions{Enabled: os.Getenv("SPILLWAY_BATCH") == "true"}
}

// contend runs goroutines that call the dependency in a loop until the
// deadline, each call tagged with the limit that admitted it.
func contend(rdb redis.UniversalClient) error {
	n, _ := strconv.Atoi(os.Getenv("SPILLWAY_GOROUTINES"))
	until, _ := time.Parse(time.RFC3339Nano, os.Getenv("SPILLWAY_UNTIL"))
	url := os.Getenv("SPILLWAY_DEPENDENCY_URL")
	g, err := guard.New(rdb, dep, guard.Options{WaitForSlot: true, MaxWait: 200 * time.Millisecond, RedisTimeout: time.Second, Batch: childBatch()})
	if err != nil {
		return err
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	var admitted, refused atomic.Int64
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for time.Now().Before(until) {
				p, err := g.Acquire(context.Background(), guard.Job{})
				if err != nil {
					refused.Add(1)
					continue
				}
				admitted.Add(1)
				req, _ := http.NewRequestWithContext(p.Context(), http.MethodGet, url, nil)
				req.Header.Set("X-Admitted-Limit", strconv.FormatInt(p.Limit(), 10))
				resp, err := client.Do(req)
				if err == nil {
					_ = resp.Body.Close()
				}
				_ = p.Done(err)
			}
		})
	}
	wg.Wait()
	fmt.Printf("admitted=%d refused=%d\n", admitted.Load(), refused.Load())
	return nil
}

// hold takes the number of slots asked for, says so, and waits to be killed.
func hold(rdb redis.UniversalClient) error {
	n, _ := strconv.Atoi(os.Getenv("SPILLWAY_HOLD"))
	ttl, _ := time.ParseDuration(os.Getenv("SPILLWAY_LEASE_TTL"))
	g, err := guard.New(rdb, dep, guard.Options{LeaseTTL: ttl, RedisTimeout: time.Second, Batch: childBatch()})
	if err != nil {
		return err
	}
	for range n {
		if _, err := g.Acquire(context.Background(), guard.Job{}); err != nil {
			return err
		}
	}
	fmt.Println("held")
	select {}
}

func child(t *testing.T, mode string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append(env, childEnv+"="+mode)...)
	cmd.Stderr = os.Stderr
	return cmd
}

func topologies(t *testing.T, run func(t *testing.T, f fleet, rdb redis.UniversalClient)) {
	t.Run("standalone", func(t *testing.T) {
		srv := redistest.Start(t)
		run(t, fleet{addrs: []string{srv.Addr()}}, fastClient(srv))
	})
	t.Run("cluster", func(t *testing.T) {
		c := redistest.StartCluster(t, 3)
		run(t, fleet{addrs: c.Addrs(), cluster: true}, c.Client(func(o *redis.ClusterOptions) { o.ContextTimeoutEnabled = true }))
	})
}

// inflightServer is the dependency: it measures the concurrency it sees.
type inflightServer struct {
	inflight, peak    atomic.Int64
	calls, underLower atomic.Int64
	violations        atomic.Int64
	lowered           int64
}

func (s *inflightServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := s.inflight.Add(1)
	defer s.inflight.Add(-1)
	for {
		p := s.peak.Load()
		if n <= p || s.peak.CompareAndSwap(p, n) {
			break
		}
	}
	s.calls.Add(1)
	if limit, _ := strconv.ParseInt(r.Header.Get("X-Admitted-Limit"), 10, 64); limit == s.lowered {
		s.underLower.Add(1)
		if n > s.lowered {
			s.violations.Add(1)
		}
	}
	// Long enough that a holder spends most of its lease here even when the
	// machine is slow (-race, a busy CI runner), so that 20 slots show up as
	// about 20 calls in flight.
	time.Sleep(30 * time.Millisecond)
}

// 500 goroutines in four processes, two per call and two batching (a mixed
// fleet), contend for 20 slots; halfway through the limit drops to 5. The
// dependency never sees more calls than the limit in force, and no call
// admitted under the lower limit arrives while 5 or more are in flight.
func TestCapHoldsAcrossProcesses(t *testing.T) {
	topologies(t, func(t *testing.T, f fleet, rdb redis.UniversalClient) {
		g := NewWithT(t)
		const limit, lowered, processes, goroutines = 20, 5, 4, 125
		publish(t, rdb, defaultPublished(limit))
		dependency := &inflightServer{lowered: lowered}
		srv := httptest.NewServer(dependency)
		defer srv.Close()

		start := time.Now()
		until := start.Add(6 * time.Second)
		var cmds []*exec.Cmd
		var outs []*strings.Builder
		for i := range processes {
			env := f.env()
			if i%2 == 1 {
				env = append(env, batchEnv)
			}
			cmd := child(t, "contend", append(env,
				"SPILLWAY_GOROUTINES="+strconv.Itoa(goroutines),
				"SPILLWAY_UNTIL="+until.Format(time.RFC3339Nano),
				"SPILLWAY_DEPENDENCY_URL="+srv.URL)...)
			out := &strings.Builder{}
			cmd.Stdout = out
			g.Expect(cmd.Start()).To(Succeed())
			cmds, outs = append(cmds, cmd), append(outs, out)
		}
		// Lower the limit once the slots are contended: the children start
		// in well under a second on an idle machine, in seconds on a busy
		// one. Lowered after 4.5 s at the latest, so calls still run under it.
		for time.Since(start) < 1500*time.Millisecond ||
			(dependency.peak.Load() < limit/2 && time.Since(start) < 4500*time.Millisecond) {
			time.Sleep(50 * time.Millisecond)
		}
		peakBefore := dependency.peak.Load()
		p := defaultPublished(lowered)
		p.Capacity = limit
		publish(t, rdb, p)
		for _, cmd := range cmds {
			g.Expect(cmd.Wait()).To(Succeed())
		}
		t.Logf("calls=%d peak=%d (before lowering %d) underLowered=%d children=%v",
			dependency.calls.Load(), dependency.peak.Load(), peakBefore, dependency.underLower.Load(), outs)

		g.Expect(dependency.peak.Load()).To(BeNumerically("<=", limit), "never more concurrent calls than the limit")
		g.Expect(peakBefore).To(BeNumerically(">=", limit/2), "the slots were contended")
		g.Expect(dependency.underLower.Load()).To(BeNumerically(">", 0), "calls ran under the lowered limit")
		g.Expect(dependency.violations.Load()).To(BeZero(), "no call admitted under the lower limit while the holders were at or above it")
	})
}

// A worker killed with SIGKILL while holding slots gives them back when their
// leases run out: within the lease TTL of its last renewal, not later.
func TestKilledHolderSlotsReturnWithinTheLeaseTTL(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		topologies(t, func(t *testing.T, f fleet, rdb redis.UniversalClient) {
			g := NewWithT(t)
			const slots = 3
			const ttl = 900 * time.Millisecond
			publish(t, rdb, defaultPublished(slots))
			env := append(f.env(), "SPILLWAY_HOLD="+strconv.Itoa(slots), "SPILLWAY_LEASE_TTL="+ttl.String())
			if batch.Enabled {
				env = append(env, batchEnv)
			}
			cmd := child(t, "hold", env...)
			stdout, err := cmd.StdoutPipe()
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(cmd.Start()).To(Succeed())
			line, err := bufio.NewReader(stdout).ReadString('\n')
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(line).To(Equal("held\n"))

			gd := newGuard(t, rdb, guard.Options{})
			time.Sleep(ttl) // past one TTL: the holder is renewing
			_, err = gd.Acquire(t.Context(), guard.Job{})
			wantDecision(t, err, guard.ActionDefer, guard.ErrThrottled)

			g.Expect(cmd.Process.Signal(syscall.SIGKILL)).To(Succeed())
			_ = cmd.Wait()
			killed := time.Now()
			got := 0
			for got < slots && time.Since(killed) < 3*ttl {
				if p, err := gd.Acquire(t.Context(), guard.Job{}); err == nil {
					defer func() { _ = p.Done(nil) }()
					got++
					continue
				}
				time.Sleep(5 * time.Millisecond)
			}
			elapsed := time.Since(killed)
			t.Logf("all %d slots back %v after SIGKILL (lease TTL %v, renewed every %v)", slots, elapsed, ttl, ttl/3)
			g.Expect(got).To(Equal(slots))
			g.Expect(elapsed).To(BeNumerically("<=", ttl+300*time.Millisecond), "not later than the lease TTL (and the polling that sees it)")
			// A per-call lease is renewed every TTL/3, a pool's member once
			// less than TTL/2 is left: it expires at least that long after
			// the kill.
			least := ttl * 2 / 3
			if batch.Enabled {
				least = ttl / 2
			}
			g.Expect(elapsed).To(BeNumerically(">=", least-100*time.Millisecond), "not before the leases expire")
		})
	})
}
