package skewtest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/proctest"
)

const (
	// python is Debian's python3, where hack/setup-python.sh installs the
	// Python client's modules.
	python = "/usr/bin/python3"
	// requirePythonEnv, when set (make test sets it), turns a missing
	// python3 or module into a failure instead of a skip.
	requirePythonEnv = "SPILLWAY_REQUIRE_PYTHON"
)

// RequirePython skips the test when Debian's python3 or its redis module is
// missing, unless SPILLWAY_REQUIRE_PYTHON is set: then it fails.
func RequirePython(t testing.TB) {
	t.Helper()
	missing := func(why string) {
		msg := why + ": run hack/setup-python.sh (make test does)"
		if os.Getenv(requirePythonEnv) != "" {
			t.Fatalf("%s (%s is set, so this is not skipped)", msg, requirePythonEnv)
		}
		t.Skipf("%s; set %s=1 to make this a failure", msg, requirePythonEnv)
	}
	if _, err := os.Stat(python); err != nil {
		missing(python + " not found")
	}
	if out, err := exec.Command(python, "-c", "import redis").CombinedOutput(); err != nil {
		missing(fmt.Sprintf("%s cannot import redis (%s)", python, strings.TrimSpace(string(out))))
	}
}

// Fleet is where workers run: the Redis, the dependency's name and URL, and
// a directory for their logs.
type Fleet struct {
	Redis      string
	Dependency string // namespace/name
	URL        string
	Dir        string
}

// WorkerSpec is one worker process.
type WorkerSpec struct {
	// Name is unique in the fleet; the process calls the dependency as
	// Name@version.
	Name    string
	Python  bool
	Batch   bool // Go only
	Threads int
}

// Seen is something a worker's guard told it: "open" (a refusal because
// the breaker is open) or "limit=N" (an admission at the fleet-wide limit
// N), and when.
type Seen struct {
	What string
	At   time.Time
}

// Limit is the limit of an admission, false for "open".
func (s Seen) Limit() (int64, bool) {
	v, ok := strings.CutPrefix(s.What, "limit=")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	return n, err == nil
}

// Stats are a worker's counts (worker/main.go).
type Stats struct {
	OK      int64            `json:"ok"`
	Failed  int64            `json:"failed"`
	Retry   int64            `json:"retry"`
	Park    int64            `json:"park"`
	Drop    int64            `json:"drop"`
	Refused map[string]int64 `json:"refused"`
}

// Worker is a running worker process.
type Worker struct {
	Spec    WorkerSpec
	Version string
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	log     string
	done    chan struct{}

	mu    sync.Mutex
	seen  []Seen
	stats Stats
}

// ID is how the worker calls the dependency and appears in messages.
func (w *Worker) ID() string { return w.Spec.Name + "@" + w.Version }

// StartWorker starts a worker of version b in the fleet.
func (f Fleet) StartWorker(t testing.TB, b Binaries, spec WorkerSpec) *Worker {
	t.Helper()
	w := &Worker{Spec: spec, Version: b.Version, done: make(chan struct{})}
	threads := strconv.Itoa(max(spec.Threads, 1))
	if spec.Python {
		w.cmd = exec.Command(python, WorkerScript(), f.Redis, f.Dependency, f.URL, threads, w.ID())
		w.cmd.Env = append(os.Environ(), "PYTHONPATH="+b.Python, "PYTHONDONTWRITEBYTECODE=1")
	} else {
		w.cmd = exec.Command(b.Worker, "-redis="+f.Redis, "-dependency="+f.Dependency, "-url="+f.URL,
			"-threads="+threads, "-batch="+strconv.FormatBool(spec.Batch), "-name="+w.ID())
	}
	w.log = filepath.Join(f.Dir, strings.ReplaceAll(w.ID(), "/", "_")+".log")
	logf, err := os.Create(w.log)
	if err != nil {
		t.Fatal(err)
	}
	w.cmd.Stderr = logf
	if w.stdin, err = w.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := w.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.cmd.Start(); err != nil {
		t.Fatalf("failed to start the worker %s: %v", w.ID(), err)
	}
	go func() {
		defer close(w.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			w.parse(sc.Text())
		}
		_ = w.cmd.Wait()
		_ = logf.Close()
	}()
	t.Cleanup(func() {
		_ = w.stdin.Close()
		select {
		case <-w.done:
		case <-time.After(20 * time.Second):
			_ = w.cmd.Process.Kill()
			<-w.done
		}
		if t.Failed() {
			t.Logf("%s's log ends:\n%s", w.ID(), proctest.Tail(w.log, 20))
		}
	})
	return w
}

func (w *Worker) parse(line string) {
	body, ok := strings.CutPrefix(line, "skew: ")
	if !ok {
		return
	}
	var l struct {
		Seen  string `json:"seen"`
		AtMS  int64  `json:"at_ms"`
		Stats *Stats `json:"stats"`
	}
	if json.Unmarshal([]byte(body), &l) != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if l.Seen != "" {
		w.seen = append(w.seen, Seen{What: l.Seen, At: time.UnixMilli(l.AtMS)})
	}
	if l.Stats != nil {
		w.stats = *l.Stats
	}
}

// Stop closes the worker's stdin, which ends its calls and closes its
// guard, and waits for it to exit; it returns its last counts.
func (w *Worker) Stop(t testing.TB) Stats {
	t.Helper()
	_ = w.stdin.Close()
	select {
	case <-w.done:
	case <-time.After(20 * time.Second):
		t.Errorf("the worker %s did not stop within 20s", w.ID())
	}
	if ps := w.cmd.ProcessState; ps != nil && ps.ExitCode() != 0 {
		t.Errorf("the worker %s exited with status %d:\n%s", w.ID(), ps.ExitCode(), proctest.Tail(w.log, 20))
	}
	return w.Stats()
}

// Stats are the worker's last reported counts.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stats
}

// Seen is everything the worker's guard told it, in order.
func (w *Worker) Seen() []Seen {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]Seen(nil), w.seen...)
}

// Saw reports whether the worker saw what matches since.
func (w *Worker) Saw(since time.Time, match func(Seen) bool) bool {
	for _, s := range w.Seen() {
		if !s.At.Before(since) && match(s) {
			return true
		}
	}
	return false
}
