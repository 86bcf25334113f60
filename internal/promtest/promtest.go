// Package promtest runs a real Prometheus server for tests, and a loopback
// target for it to scrape.
//
// [Start] starts prometheus on 127.0.0.1 on a free port, with a temporary
// configuration that scrapes the given targets every second (rules are
// evaluated every second too) and a temporary TSDB, and stops it when the
// test ends; [StartScraping] takes the scrape configuration itself.
// [NewDependency] is a target: an HTTP server on loopback that
// exposes a dependency's request and error counters, in the metric names
// RequestsMetric and ErrorsMetric, with the official Go client.
//
// The prometheus binary is taken from the PROMETHEUS environment variable,
// else from PATH, else /usr/bin/prometheus. Run hack/setup-prometheus.sh to
// install Debian's package (Prometheus 2.42).
package promtest

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spillway-dev/spillway/internal/proctest"
)

// ScrapeInterval is how often the server scrapes its targets.
const ScrapeInterval = time.Second

// startTimeout bounds how long the server may take to be ready.
const startTimeout = 30 * time.Second

const setupHint = "run hack/setup-prometheus.sh to install prometheus"

// Server is one prometheus process listening on 127.0.0.1.
type Server struct {
	dir     string
	logPath string
	port    int

	mu     sync.Mutex
	proc   *proctest.Proc // nil while stopped
	closed bool
}

// Start starts a prometheus server scraping targets (host:port each) and
// waits until it is ready. It fails tb if the server cannot start, and stops
// it when the test ends; if the test failed, the end of its log is added to
// the test output.
func Start(tb testing.TB, targets ...string) *Server {
	tb.Helper()
	return startTB(tb, config(targets))
}

// StartServer is Start for callers without a testing.TB: they must call
// Close.
func StartServer(targets ...string) (*Server, error) {
	return startServer(config(targets))
}

// StartScraping is Start with the scrape configs given: scrapeConfigs is
// the YAML list under scrape_configs (each item "- job_name: ..."), scraped
// and evaluated every ScrapeInterval unless an item says otherwise. Tests
// use it to scrape as another tool configures Prometheus (the Prometheus
// Operator's relabelling, test/monitoring).
func StartScraping(tb testing.TB, scrapeConfigs string) *Server {
	tb.Helper()
	return startTB(tb, globalConfig()+"scrape_configs:\n"+scrapeConfigs)
}

// startTB starts a server with the configuration cfg for tb.
func startTB(tb testing.TB, cfg string) *Server {
	tb.Helper()
	s, err := startServer(cfg)
	if err != nil {
		tb.Fatalf("promtest: %v", err)
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("promtest: last lines of the log of prometheus %s:\n%s", s.URL(), proctest.Tail(s.logPath, 30))
		}
		if err := s.Close(); err != nil {
			tb.Errorf("promtest: %v", err)
		}
	})
	return s
}

func startServer(cfg string) (*Server, error) {
	bin, err := lookupBinary()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "promtest-")
	if err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	s := &Server{dir: dir, logPath: filepath.Join(dir, "prometheus.log")}
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("write prometheus config: %w", err)
	}
	const attempts = 5
	for i := 1; ; i++ {
		err = s.start(bin)
		if err == nil {
			return s, nil
		}
		if !errors.Is(err, errPortTaken) || i == attempts {
			os.RemoveAll(dir)
			return nil, err
		}
	}
}

// config is the server's configuration: every target in one job,
// "dependency", scraped every ScrapeInterval.
func config(targets []string) string {
	var b strings.Builder
	b.WriteString(globalConfig())
	b.WriteString("scrape_configs:\n- job_name: dependency\n  static_configs:\n  - targets: [")
	for i, t := range targets {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Quote(t))
	}
	b.WriteString("]\n")
	return b.String()
}

// globalConfig is the configuration's global section: scrapes and rule
// evaluations every ScrapeInterval.
func globalConfig() string {
	return fmt.Sprintf("global:\n  scrape_interval: %s\n  scrape_timeout: %s\n  evaluation_interval: %s\n", ScrapeInterval, ScrapeInterval, ScrapeInterval)
}

// URL is the server's base URL, http://127.0.0.1:port.
func (s *Server) URL() string { return "http://127.0.0.1:" + strconv.Itoa(s.port) }

// Stop kills the server (SIGKILL) and waits for it to exit: queries then
// fail to connect. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop()
}

// Close stops the server and removes its directory. It is safe to call more
// than once.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	s.stop()
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("remove prometheus dir: %w", err)
	}
	return nil
}

var errPortTaken = errors.New("port already in use")

func (s *Server) start(bin string) error {
	port, err := proctest.FreePort()
	if err != nil {
		return err
	}
	logFile, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("open prometheus log: %w", err)
	}
	defer logFile.Close()
	proc, err := proctest.Start(bin, []string{
		"--config.file=" + filepath.Join(s.dir, "prometheus.yml"),
		"--storage.tsdb.path=" + filepath.Join(s.dir, "data"),
		"--web.listen-address=127.0.0.1:" + strconv.Itoa(port),
		"--log.level=warn",
	}, s.dir, logFile)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.proc, s.port = proc, port
	if err := waitReady(s.URL(), proc.Exited()); err != nil {
		s.stop()
		if strings.Contains(proctest.Tail(s.logPath, 20), "address already in use") {
			return fmt.Errorf("prometheus on port %d: %w", port, errPortTaken)
		}
		return fmt.Errorf("prometheus on port %d did not start: %w\nend of its log:\n%s", port, err, proctest.Tail(s.logPath, 20))
	}
	return nil
}

// stop kills the process group and waits for it to exit. s.mu must be held.
func (s *Server) stop() {
	if s.proc == nil {
		return
	}
	s.proc.Kill()
	s.proc = nil
}

// waitReady polls url's /-/ready until it answers 200, the process exits or
// startTimeout passes.
func waitReady(url string, exited <-chan struct{}) error {
	deadline := time.Now().Add(startTimeout)
	c := &http.Client{Timeout: time.Second}
	for {
		select {
		case <-exited:
			return errors.New("prometheus exited")
		default:
		}
		resp, err := c.Get(url + "/-/ready")
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("/-/ready answered %s", resp.Status)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready within %v: %w", startTimeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lookupBinary finds prometheus: $PROMETHEUS, then PATH, then
// /usr/bin/prometheus.
func lookupBinary() (string, error) {
	return proctest.LookPath("prometheus", "PROMETHEUS", setupHint)
}

// Metric names the Dependency target exposes.
const (
	// RequestsMetric counts every request the dependency served.
	RequestsMetric = "dependency_requests_total"
	// ErrorsMetric counts the requests that failed.
	ErrorsMetric = "dependency_errors_total"
)

// ErrorRatioQuery is the PromQL error ratio of a Dependency over window,
// as a policy would write it for its breaker window.
func ErrorRatioQuery(window time.Duration) string {
	w := promDuration(window)
	return fmt.Sprintf("sum(rate(%s[%s])) / sum(rate(%s[%s]))", ErrorsMetric, w, RequestsMetric, w)
}

// RateQuery is the PromQL request rate of a Dependency over window.
func RateQuery(window time.Duration) string {
	return fmt.Sprintf("sum(rate(%s[%s]))", RequestsMetric, promDuration(window))
}

func promDuration(d time.Duration) string {
	return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// Dependency is a scrape target on loopback standing for a dependency's own
// metrics: its request and error counters, moved by Serve or by a steady
// load from Load.
type Dependency struct {
	srv      *httptest.Server
	requests prometheus.Counter
	errs     prometheus.Counter

	mu         sync.Mutex
	perSecond  float64
	errorRatio float64
	stop       chan struct{}
	done       chan struct{}
}

// NewDependency starts the target; it is closed when the test ends.
func NewDependency(tb testing.TB) *Dependency {
	tb.Helper()
	reg := prometheus.NewRegistry()
	d := &Dependency{
		requests: prometheus.NewCounter(prometheus.CounterOpts{Name: RequestsMetric, Help: "Requests the dependency served."}),
		errs:     prometheus.NewCounter(prometheus.CounterOpts{Name: ErrorsMetric, Help: "Requests the dependency failed."}),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
	}
	reg.MustRegister(d.requests, d.errs)
	d.srv = httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	go d.run()
	tb.Cleanup(func() {
		close(d.stop)
		<-d.done
		d.srv.Close()
	})
	return d
}

// Target is the host:port for a scrape config.
func (d *Dependency) Target() string { return strings.TrimPrefix(d.srv.URL, "http://") }

// Serve counts requests served, errors of them failed.
func (d *Dependency) Serve(requests, errors int) {
	d.requests.Add(float64(requests))
	d.errs.Add(float64(errors))
}

// Load sets a steady load: perSecond requests a second, errorRatio of them
// failing, counted every 100ms until the next Load.
func (d *Dependency) Load(perSecond, errorRatio float64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.perSecond, d.errorRatio = perSecond, errorRatio
}

func (d *Dependency) run() {
	defer close(d.done)
	const tick = 100 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	var owedReq, owedErr float64
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		}
		d.mu.Lock()
		owedReq += d.perSecond * tick.Seconds()
		owedErr += d.perSecond * d.errorRatio * tick.Seconds()
		d.mu.Unlock()
		req, errs := int(owedReq), int(min(owedErr, float64(int(owedReq))))
		owedReq -= float64(req)
		owedErr -= float64(errs)
		if req > 0 {
			d.Serve(req, errs)
		}
	}
}
