package shed_test

import (
	"context"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/shed"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestHTTPFloodingCallerLeavesOthersServed sends 2,000 concurrent requests
// from one caller over its quota while a well-behaved caller, within its
// quota, keeps calling. At least 99% of the well-behaved caller's requests
// must succeed; the flooder must get 429s with a Retry-After and never have
// more than its quota in the handler.
func TestHTTPFloodingCallerLeavesOthersServed(t *testing.T) {
	const (
		floodRequests = 2000
		quota         = 8
		goodWorkers   = 4
		goodPerWorker = 50
		minGoodShare  = 0.99
	)
	s, _ := newShedder(t, shed.Options{MaxInFlight: 64, DefaultQuota: quota})
	var mu sync.Mutex
	inHandler := map[string]int{}
	peak := map[string]int{}
	srv := newServer(t, s.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(wire.DefaultCallerHeader)
		mu.Lock()
		inHandler[key]++
		peak[key] = max(peak[key], inHandler[key])
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		inHandler[key]--
		mu.Unlock()
	})))

	start := make(chan struct{})
	var flood sync.WaitGroup
	var flood200, flood429, floodOther, floodErr atomic.Int64
	floodClient := newClient(t, floodRequests)
	for range floodRequests {
		flood.Go(func() {
			<-start
			resp, err := get(t, floodClient, srv.URL, map[string]string{wire.DefaultCallerHeader: "flooder"})
			switch {
			case err != nil:
				floodErr.Add(1) // the flooder's own connection trouble; not asserted
			case resp.StatusCode == http.StatusOK:
				flood200.Add(1)
			case resp.StatusCode == http.StatusTooManyRequests && validRetryAfter(resp):
				flood429.Add(1)
			default:
				floodOther.Add(1)
			}
		})
	}

	var good sync.WaitGroup
	var goodOK, goodFailed atomic.Int64
	goodClient := newClient(t, goodWorkers)
	close(start)
	for range goodWorkers {
		good.Go(func() {
			for range goodPerWorker {
				resp, err := get(t, goodClient, srv.URL, map[string]string{wire.DefaultCallerHeader: "good"})
				if err == nil && resp.StatusCode == http.StatusOK {
					goodOK.Add(1)
				} else {
					goodFailed.Add(1)
				}
			}
		})
	}
	good.Wait()
	flood.Wait()

	share := float64(goodOK.Load()) / float64(goodWorkers*goodPerWorker)
	t.Logf("good caller: %d ok, %d failed (%.1f%%); flooder: %d ok, %d 429, %d other, %d errors",
		goodOK.Load(), goodFailed.Load(), 100*share, flood200.Load(), flood429.Load(), floodOther.Load(), floodErr.Load())
	if share < minGoodShare {
		t.Errorf("good caller success %.3f, want >= %.2f", share, minGoodShare)
	}
	if flood429.Load() == 0 {
		t.Errorf("flooder got no 429 with a Retry-After")
	}
	if floodOther.Load() != 0 {
		t.Errorf("flooder got %d responses other than 200 or 429 with a valid Retry-After", floodOther.Load())
	}
	if peak["flooder"] > quota {
		t.Errorf("flooder had %d requests in the handler at once, quota %d", peak["flooder"], quota)
	}
	if got := s.Stats().Callers; got != 0 {
		t.Errorf("Stats().Callers = %d after the flood, want 0", got)
	}
}

// validRetryAfter reports whether resp carries Retry-After as whole seconds
// in the default range [1, 10].
func validRetryAfter(resp *http.Response) bool {
	n, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	return err == nil && n >= 1 && n <= 10
}

// TestHTTPRetryAfterIsUniform checks that the Retry-After headers of 2,000
// rejections spread uniformly over 1..10 s: Pearson's chi-square with 9
// degrees of freedom must stay below 27.877, the critical value at
// significance 0.001. The seed is fixed, so the test is deterministic.
func TestHTTPRetryAfterIsUniform(t *testing.T) {
	const (
		samples  = 2000
		critical = 27.877 // chi-square, 9 degrees of freedom, p = 0.001
	)
	s, _ := newShedder(t, shed.Options{MaxInFlight: 1, Rand: rand.New(rand.NewPCG(2026, 5))})
	h := newBlockingHandler()
	defer close(h.release)
	srv := newServer(t, s.Middleware(h))
	c := newClient(t, 2)
	go func() { _, _ = get(t, c, srv.URL, nil) }()
	waitFor(t, "the slot taken", func() bool { return h.entered.Load() == 1 })

	var counts [11]int
	for range samples {
		resp, err := get(t, c, srv.URL, nil)
		if err != nil {
			t.Fatalf("GET: %v", err)
		}
		if resp.StatusCode != http.StatusServiceUnavailable || !validRetryAfter(resp) {
			t.Fatalf("got %d Retry-After %q, want 503 with whole seconds in [1, 10]", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		n, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		counts[n]++
	}
	expected := float64(samples) / 10
	chi2 := 0.0
	for sec := 1; sec <= 10; sec++ {
		d := float64(counts[sec]) - expected
		chi2 += d * d / expected
	}
	t.Logf("Retry-After counts 1..10: %v, chi-square %.2f", counts[1:], chi2)
	if chi2 >= critical {
		t.Fatalf("chi-square %.2f >= %.3f: Retry-After is not uniform over 1..10 s", chi2, critical)
	}
}

func TestHTTPPastDeadlineNeverReachesHandler(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 1, QueueSize: 4, QueueTimeout: 10 * time.Second})
	h := newBlockingHandler()
	srv := newServer(t, s.Middleware(h))
	c := newClient(t, 4)

	past := time.Now().Add(-time.Second)
	for _, deadline := range []string{
		past.UTC().Format(time.RFC3339Nano),
		past.In(time.FixedZone("", 2*3600)).Format(time.RFC3339Nano),
		past.UTC().Format(time.RFC3339),
	} {
		resp, err := get(t, c, srv.URL, map[string]string{wire.DeadlineHeader: deadline})
		if err != nil {
			t.Fatalf("GET: %v", err)
		}
		if resp.StatusCode != http.StatusGatewayTimeout || resp.Header.Get("Retry-After") != "" {
			t.Fatalf("deadline %s: got %d Retry-After %q, want 504 without Retry-After", deadline, resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	}
	if n := h.entered.Load(); n != 0 {
		t.Fatalf("handler reached %d times by past-deadline requests, want 0", n)
	}

	// A queued request whose deadline passes while it waits is dropped too.
	go func() { _, _ = get(t, c, srv.URL, nil) }()
	waitFor(t, "the slot taken", func() bool { return h.entered.Load() == 1 })
	soon := time.Now().Add(100 * time.Millisecond).UTC().Format(time.RFC3339Nano)
	resp, err := get(t, c, srv.URL, map[string]string{wire.DeadlineHeader: soon})
	if err != nil {
		t.Fatalf("GET: %v", err)
	}
	close(h.release)
	if resp.StatusCode != http.StatusGatewayTimeout || h.entered.Load() != 1 {
		t.Fatalf("queued request: got %d, handler entered %d times; want 504 and 1", resp.StatusCode, h.entered.Load())
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "deadline"}); got != 4 {
		t.Fatalf("shed_total{reason=deadline} = %v, want 4", got)
	}
}

func TestHTTPFutureDeadlineAppliedToContext(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 1})
	got := make(chan time.Time, 1)
	srv := newServer(t, s.Middleware(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		d, _ := r.Context().Deadline()
		got <- d
	})))
	want := time.Now().Add(time.Minute).Round(0).UTC()
	resp, err := get(t, newClient(t, 1), srv.URL, map[string]string{wire.DeadlineHeader: want.Format(time.RFC3339Nano)})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET: %v %v, want 200", resp, err)
	}
	if d := <-got; !d.Equal(want) {
		t.Fatalf("handler context deadline %v, want %v", d, want)
	}
}

// TestHTTPQueueNeverExceedsBound sends 50 concurrent requests to a service
// with 2 slots and a queue of 3: the queue depth never exceeds 3, 2 requests
// are served and the other 48 are shed as overload or queue_timeout.
func TestHTTPQueueNeverExceedsBound(t *testing.T) {
	const (
		requests  = 50
		slots     = 2
		queueSize = 3
	)
	s, reg := newShedder(t, shed.Options{MaxInFlight: slots, QueueSize: queueSize, QueueTimeout: 2 * time.Second})
	h := newBlockingHandler()
	srv := newServer(t, s.Middleware(h))
	c := newClient(t, requests)

	var observedMax atomic.Int64
	stop := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() {
		for {
			observedMax.Store(max(observedMax.Load(), s.Stats().Queued))
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Microsecond):
			}
		}
	})

	var wg sync.WaitGroup
	var ok, shed503, other, returned atomic.Int64
	for range requests {
		wg.Go(func() {
			resp, err := get(t, c, srv.URL, nil)
			returned.Add(1)
			switch {
			case err != nil:
				other.Add(1)
			case resp.StatusCode == http.StatusOK:
				ok.Add(1)
			case resp.StatusCode == http.StatusServiceUnavailable && validRetryAfter(resp):
				shed503.Add(1)
			default:
				other.Add(1)
			}
		})
	}
	waitFor(t, "all but the admitted requests answered", func() bool { return returned.Load() == requests-slots })
	close(h.release)
	wg.Wait()
	close(stop)
	sampler.Wait()

	st := s.Stats()
	if ok.Load() != slots || shed503.Load() != requests-slots || other.Load() != 0 {
		t.Fatalf("got %d ok, %d 503, %d other; want %d ok and %d 503", ok.Load(), shed503.Load(), other.Load(), slots, requests-slots)
	}
	if st.PeakQueued > queueSize || observedMax.Load() > queueSize {
		t.Fatalf("queue depth reached %d (sampled %d), bound %d", st.PeakQueued, observedMax.Load(), queueSize)
	}
	if st.PeakInFlight != slots || h.peak.Load() != slots {
		t.Fatalf("peak in flight %d (handler saw %d), want %d", st.PeakInFlight, h.peak.Load(), slots)
	}
	overload := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "overload"})
	timeout := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "queue_timeout"})
	if overload+timeout != requests-slots || timeout < 1 {
		t.Fatalf("shed overload %v + queue_timeout %v, want %d with at least one timeout", overload, timeout, requests-slots)
	}
	if got := metricValue(t, reg, "spillway_service_queue_depth", nil); got != 0 {
		t.Fatalf("queue_depth = %v after the test, want 0", got)
	}
}

// TestHTTPRampFollowsSchedule drives a ramp of 2, 4, 8 slots with a fake
// clock: each minute, 10 more held requests arrive and the handler's
// concurrency must match the step; the rest are shed with reason ramp while
// the ramp holds the limit below MaxInFlight, and overload from the last step
// on.
func TestHTTPRampFollowsSchedule(t *testing.T) {
	clk := newFakeClock()
	s, reg := newShedder(t, shed.Options{
		MaxInFlight: 8, Clock: clk,
		Ramp: &shed.Ramp{Steps: []int64{2, 4, 8}, StepDuration: time.Minute},
	})
	h := newBlockingHandler()
	defer close(h.release)
	srv := newServer(t, s.Middleware(h))
	c := newClient(t, 64)

	var returned atomic.Int64
	sent := int64(0)
	for i, want := range []int64{2, 4, 8, 8} {
		for range 10 {
			go func() {
				_, _ = get(t, c, srv.URL, nil)
				returned.Add(1)
			}()
		}
		sent += 10
		waitFor(t, "shed requests answered", func() bool { return returned.Load() == sent-want })
		if got := h.current.Load(); got != want {
			t.Fatalf("minute %d: %d requests in the handler, want %d", i, got, want)
		}
		clk.Add(time.Minute)
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "ramp"}); got != 8+8 {
		t.Fatalf("shed_total{reason=ramp} = %v, want 16", got)
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "overload"}); got != 6+10 {
		t.Fatalf("shed_total{reason=overload} = %v, want 16", got)
	}
}

// TestHTTPMalformedHeaders sends garbage attempt and deadline headers: each is
// counted as malformed, the request counts as a first attempt without a
// deadline, and it still goes through admission (here, the caller's quota).
func TestHTTPMalformedHeaders(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 4, DefaultQuota: 1})
	h := newBlockingHandler()
	srv := newServer(t, s.Middleware(h))
	c := newClient(t, 4)

	go func() { _, _ = get(t, c, srv.URL, map[string]string{wire.DefaultCallerHeader: "k"}) }()
	waitFor(t, "k's slot taken", func() bool { return h.entered.Load() == 1 })

	badAttempts := []string{"-5", "abc", "0", "99999999999999999999", "1234567890", "1e3", "+2", "0x10", "3.0"}
	badDeadlines := []string{"garbage", "2026-13-01T00:00:00Z", "1714560000", "tomorrow", "9999-99-99T99:99:99Z"}
	send := func(headers map[string]string) {
		headers[wire.DefaultCallerHeader] = "k"
		resp, err := get(t, c, srv.URL, headers)
		if err != nil {
			t.Fatalf("GET: %v", err)
		}
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("malformed %v got %d, want 429: a malformed header must not bypass the quota", headers, resp.StatusCode)
		}
	}
	for _, v := range badAttempts {
		send(map[string]string{wire.AttemptHeader: v})
	}
	for _, v := range badDeadlines {
		send(map[string]string{wire.DeadlineHeader: v})
	}
	close(h.release)

	checks := []struct {
		name   string
		labels map[string]string
		want   int
	}{
		{"spillway_service_malformed_headers_total", map[string]string{"header": "attempt"}, len(badAttempts)},
		{"spillway_service_malformed_headers_total", map[string]string{"header": "deadline"}, len(badDeadlines)},
		{"spillway_service_requests_total", map[string]string{"attempt": "1"}, 1 + len(badAttempts) + len(badDeadlines)},
		{"spillway_service_shed_total", map[string]string{"reason": "quota"}, len(badAttempts) + len(badDeadlines)},
	}
	for _, chk := range checks {
		if got := metricValue(t, reg, chk.name, chk.labels); got != float64(chk.want) {
			t.Errorf("%s%v = %v, want %d", chk.name, chk.labels, got, chk.want)
		}
	}
	if n := h.entered.Load(); n != 1 {
		t.Fatalf("handler reached %d times, want only the first request", n)
	}
}

func TestHTTPMalformedDeadlineMeansNoDeadline(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 1})
	hasDeadline := make(chan bool, 1)
	srv := newServer(t, s.Middleware(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		_, ok := r.Context().Deadline()
		hasDeadline <- ok
	})))
	resp, err := get(t, newClient(t, 1), srv.URL, map[string]string{wire.DeadlineHeader: "garbage", wire.AttemptHeader: "abc"})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET: %v %v, want 200", resp, err)
	}
	if <-hasDeadline {
		t.Fatalf("handler context has a deadline from a malformed header")
	}
}

func TestHTTPAttemptsCounted(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 10, Clock: newFakeClock()})
	srv := newServer(t, s.Middleware(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})))
	c := newClient(t, 1)
	for _, attempt := range []string{"", "1", "1", "2", "2", "3", "4", "17"} {
		headers := map[string]string{}
		if attempt != "" {
			headers[wire.AttemptHeader] = attempt
		}
		if resp, err := get(t, c, srv.URL, headers); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET attempt %q: %v %v", attempt, resp, err)
		}
	}
	for label, want := range map[string]float64{"1": 3, "2": 2, "3": 1, "4+": 2} {
		if got := metricValue(t, reg, "spillway_service_requests_total", map[string]string{"attempt": label}); got != want {
			t.Errorf("requests_total{attempt=%q} = %v, want %v", label, got, want)
		}
	}
	if got := metricValue(t, reg, "spillway_service_amplification_ratio", nil); got != 8.0/3 {
		t.Errorf("amplification_ratio = %v, want 8/3", got)
	}
	if got := metricValue(t, reg, "spillway_service_admitted_total", nil); got != 8 {
		t.Errorf("admitted_total = %v, want 8", got)
	}
}

// TestHTTPCanceledWhileQueuedCarriesRetryAfter checks the package promise
// that every 503 carries a Retry-After, also for a request whose context is
// canceled (an upstream proxy or timeout handler gave up) while it waits in
// the queue: whoever relays the 503 must still be told when to come back.
func TestHTTPCanceledWhileQueuedCarriesRetryAfter(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 1, QueueSize: 1, QueueTimeout: time.Minute})
	held := admit(t, s, shed.Request{})
	defer held.Release()
	handler := s.Middleware(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		t.Error("a canceled request reached the handler")
	}))

	ctx, cancel := context.WithCancel(t.Context())
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	w := httptest.NewRecorder()
	done := make(chan struct{})
	go func() { handler.ServeHTTP(w, r); close(done) }()
	waitFor(t, "one queued", func() bool { return s.Stats().Queued == 1 })
	cancel()
	<-done

	resp := w.Result()
	if resp.StatusCode != http.StatusServiceUnavailable || !validRetryAfter(resp) {
		t.Fatalf("canceled while queued: got %d Retry-After %q, want 503 with whole seconds in [1, 10]",
			resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}
