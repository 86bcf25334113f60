package guard_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/shed"
)

// A worker calling a service that sheds load waits at least the Retry-After
// the service sent, and the service counts the worker's attempts.
func TestWorkerHonoursASheddingService(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(10)
	p.Backoff.Base = time.Millisecond
	p.Budget.MinRetries = 1000
	publish(t, rdb, p)
	gd := newGuard(t, rdb, guard.Options{})

	reg := prometheus.NewRegistry()
	shedder, err := shed.New(shed.Options{MaxInFlight: 1, RetryAfterMin: 2 * time.Second, RetryAfterMax: 4 * time.Second, Registerer: reg})
	g.Expect(err).NotTo(HaveOccurred())
	block := make(chan struct{})
	entered := make(chan struct{}, 1)
	srv := httptest.NewServer(shedder.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-block
		}
	})))
	defer srv.Close()
	client := &http.Client{Transport: &guard.Transport{}}

	call := func(path string) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			defer func() { _ = resp.Body.Close() }()
			return guard.CheckResponse(resp)
		}
	}

	done := make(chan error, 1)
	go func() { done <- gd.Do(context.Background(), guard.Job{Attempt: 1}, call("/slow")) }()
	<-entered

	// The service is full: it sheds this call with 503 and a Retry-After in
	// [2s, 4s]; the worker schedules the retry no earlier than that.
	for attempt := 2; attempt <= 4; attempt++ {
		err := gd.Do(t.Context(), guard.Job{Attempt: attempt, Deadline: time.Now().Add(time.Minute)}, call("/"))
		after := wantDecision(t, err, guard.ActionRetry, guard.ErrFailed)
		g.Expect(after).To(BeNumerically(">=", 2*time.Second), "never earlier than the service's Retry-After")
		g.Expect(after).To(BeNumerically("<=", 6*time.Second))
	}
	close(block)
	g.Expect(<-done).To(Succeed())

	// The service saw one first attempt and three retries: amplification 4.
	requests := func(attempt string) float64 {
		return testutil.ToFloat64(metricVec(t, reg, "spillway_service_requests_total", "attempt", attempt))
	}
	g.Expect(requests("1")).To(Equal(1.0))
	g.Expect(requests("2") + requests("3") + requests("4+")).To(Equal(3.0))
}

// A client error is final: the worker does not retry a 400.
func TestClientErrorsArePermanent(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(10))
	gd := newGuard(t, rdb, guard.Options{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no such template", http.StatusBadRequest)
	}))
	defer srv.Close()
	err := gd.Do(t.Context(), guard.Job{}, func(ctx context.Context) error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer func() { _ = resp.Body.Close() }()
		return guard.CheckResponse(resp)
	})
	g.Expect(err).To(MatchError(ContainSubstring("400")))
	_, _, decided := guard.Decide(err)
	g.Expect(decided).To(BeFalse())
	g.Expect(errors.Is(err, guard.ErrFailed)).To(BeFalse())
}

// metricVec finds one series of a metric in reg by its labels.
func metricVec(t *testing.T, reg *prometheus.Registry, name string, labels ...string) prometheus.Collector {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue series
				}
			}
			v := m.GetCounter().GetValue()
			return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x", Help: "x"}, func() float64 { return v })
		}
	}
	return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x", Help: "x"}, func() float64 { return 0 })
}
