package skewtest

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/proctest"
)

// Managers is where manager processes run: an API server (its kubeconfig),
// a Redis, a directory for their logs, and the flags every replica gets.
// Redis is used by Start only.
type Managers struct {
	Kubeconfig string
	Redis      string
	Dir        string
	// Flags are added to every replica's: the lease timings, say.
	Flags []string
}

// Manager is a manager process: one replica of the Deployment.
type Manager struct {
	Name    string
	Version string
	proc    *proctest.Proc
	log     string
}

// Start starts a replica of version b named name, with leader election on
// (the Lease in the namespace default).
func (m Managers) Start(t testing.TB, b Binaries, name string) *Manager {
	t.Helper()
	return m.StartWith(t, b, name, []string{
		"--leader-elect=true",
		"--leader-election-namespace=default",
		"--redis-addr=" + m.Redis,
		"--metrics-bind-address=0",
		"--health-probe-bind-address=0",
	})
}

// StartWith starts a replica of version b named name with args (those of
// a Deployment's container, say), then --kubeconfig and m.Flags, which
// override them.
func (m Managers) StartWith(t testing.TB, b Binaries, name string, args []string) *Manager {
	t.Helper()
	logPath := filepath.Join(m.Dir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	args = append(append(append([]string(nil), args...), "--kubeconfig="+m.Kubeconfig), m.Flags...)
	p, err := proctest.Start(b.Manager, args, m.Dir, f)
	if err != nil {
		t.Fatal(err)
	}
	r := &Manager{Name: name, Version: b.Version, proc: p, log: logPath}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("%s (%s)'s log ends:\n%s", name, b.Version, proctest.Tail(logPath, 15))
		}
	})
	return r
}

func (r *Manager) String() string { return r.Name + "@" + r.Version }

// Leads reports whether the replica logged that it acquired the Lease.
func (r *Manager) Leads() bool {
	return strings.Contains(strings.ToLower(proctest.ReadFrom(r.log, 0)), "successfully acquired lease")
}

// Up reports whether the replica is running and competes for the Lease: a
// replica a Deployment would count ready.
func (r *Manager) Up() bool {
	return strings.Contains(strings.ToLower(proctest.ReadFrom(r.log, 0)), "attempting to acquire leader lease")
}

// Exited is closed once the replica has exited.
func (r *Manager) Exited() <-chan struct{} { return r.proc.Exited() }

// Stop sends SIGTERM, as the kubelet does to a pod a rollout replaces, and
// waits for the replica to exit; it kills it after 15s.
func (r *Manager) Stop(t testing.TB) {
	t.Helper()
	if err := r.proc.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("failed to stop %s: %v", r, err)
	}
	select {
	case <-r.proc.Exited():
	case <-time.After(15 * time.Second):
		t.Errorf("%s did not exit within 15s of SIGTERM", r)
		r.proc.Kill()
	}
}

// Log is the replica's log so far.
func (r *Manager) Log() string { return proctest.ReadFrom(r.log, 0) }

// Roll replaces the replicas by replicas of b, as a Deployment's rolling
// update with the default strategy (maxSurge 25%, maxUnavailable 25% of 2
// replicas: one more, none fewer) does: a new replica starts and is up,
// then an old one stops, the standby first, then again for the leader. It
// returns the new replicas; names are theirs.
func (m Managers) Roll(t testing.TB, replicas []*Manager, b Binaries, names ...string) []*Manager {
	t.Helper()
	if len(names) != len(replicas) {
		t.Fatalf("Roll: %d names for %d replicas", len(names), len(replicas))
	}
	// The standbys go first, the leader last.
	var old, leaders []*Manager
	for _, r := range replicas {
		if r.Leads() {
			leaders = append(leaders, r)
		} else {
			old = append(old, r)
		}
	}
	old = append(old, leaders...)
	var rolled []*Manager
	for i, r := range old {
		n := m.Start(t, b, names[i])
		deadline := time.Now().Add(60 * time.Second)
		for !n.Up() {
			if time.Now().After(deadline) {
				t.Fatalf("the new replica %s did not start within 60s:\n%s", n, proctest.Tail(n.log, 20))
			}
			time.Sleep(20 * time.Millisecond)
		}
		rolled = append(rolled, n)
		r.Stop(t)
	}
	return rolled
}
