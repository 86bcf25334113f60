package shed_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/spillway-dev/spillway/pkg/shed"
)

// fakeClock is a clock.Clock moved by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// newShedder returns a Shedder for opts registered on a fresh registry.
func newShedder(t *testing.T, opts shed.Options) (*shed.Shedder, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	opts.Registerer = reg
	s, err := shed.New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return s, reg
}

// metricValue returns the value of the counter or gauge name whose labels
// include labels, or 0 when there is no such series.
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if !hasLabels(m.GetLabel(), labels) {
				continue
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

func hasLabels(got []*dto.LabelPair, want map[string]string) bool {
	n := 0
	for _, l := range got {
		if v, ok := want[l.GetName()]; ok && v == l.GetValue() {
			n++
		}
	}
	return n == len(want)
}

// blockingHandler counts requests that reach it and holds each one until
// release is closed, tracking the highest concurrency seen.
type blockingHandler struct {
	release chan struct{}
	entered atomic.Int64
	current atomic.Int64
	peak    atomic.Int64
}

func newBlockingHandler() *blockingHandler {
	return &blockingHandler{release: make(chan struct{})}
}

func (h *blockingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.enter()
	defer h.current.Add(-1)
	select {
	case <-h.release:
	case <-r.Context().Done():
	}
	w.WriteHeader(http.StatusOK)
}

func (h *blockingHandler) enter() {
	h.entered.Add(1)
	n := h.current.Add(1)
	for {
		p := h.peak.Load()
		if n <= p || h.peak.CompareAndSwap(p, n) {
			return
		}
	}
}

// newServer starts a real HTTP server on 127.0.0.1 for handler.
func newServer(t *testing.T, handler http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	return srv
}

// newClient returns an HTTP client that keeps up to conns connections open
// to one host.
func newClient(t *testing.T, conns int) *http.Client {
	t.Helper()
	tr := &http.Transport{MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// get sends a GET with the given headers and returns the response with its
// body drained and closed.
func get(t *testing.T, c *http.Client, url string, headers map[string]string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	drain(resp)
	return resp, nil
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
}
