package shed_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/spillway-dev/spillway/pkg/shed"
)

// admit calls Admit and returns the ticket, failing the test on rejection.
func admit(t *testing.T, s *shed.Shedder, req shed.Request) shed.Ticket {
	t.Helper()
	tk, err := s.Admit(t.Context(), req)
	if err != nil {
		t.Fatalf("Admit(%+v) = %v, want admitted", req, err)
	}
	return tk
}

// rejection calls Admit with ctx and returns the rejection, failing the test
// if the request was admitted.
func rejection(t *testing.T, ctx context.Context, s *shed.Shedder, req shed.Request) *shed.Rejection {
	t.Helper()
	tk, err := s.Admit(ctx, req)
	if err == nil {
		tk.Release()
		t.Fatalf("Admit(%+v) admitted, want a rejection", req)
	}
	var rej *shed.Rejection
	if !errors.As(err, &rej) {
		t.Fatalf("Admit error %v is not a *Rejection", err)
	}
	return rej
}

func TestRetryAfterStaysInCustomRange(t *testing.T) {
	s, _ := newShedder(t, shed.Options{
		MaxInFlight: 1, RetryAfterMin: 3 * time.Second, RetryAfterMax: 5 * time.Second,
		Rand: rand.New(rand.NewPCG(7, 7)),
	})
	defer admit(t, s, shed.Request{}).Release()
	seen := map[time.Duration]int{}
	for range 300 {
		seen[rejection(t, t.Context(), s, shed.Request{}).RetryAfter]++
	}
	if len(seen) != 3 || seen[3*time.Second] == 0 || seen[4*time.Second] == 0 || seen[5*time.Second] == 0 {
		t.Fatalf("Retry-After values %v, want each of 3s, 4s and 5s and nothing else", seen)
	}
}

func TestRetryAfterWithDefaultRandIsNotConstant(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 1})
	defer admit(t, s, shed.Request{}).Release()
	seen := map[time.Duration]bool{}
	for range 200 {
		ra := rejection(t, t.Context(), s, shed.Request{}).RetryAfter
		if ra < time.Second || ra > 10*time.Second || ra%time.Second != 0 {
			t.Fatalf("Retry-After %v outside whole seconds in [1s, 10s]", ra)
		}
		seen[ra] = true
	}
	if len(seen) < 5 {
		t.Fatalf("only %d distinct Retry-After values in 200 rejections", len(seen))
	}
}

func TestQuotaIsCheckedPerCaller(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 10, DefaultQuota: 2, Quotas: map[string]int64{"big": 3}})
	var held []shed.Ticket
	held = append(held, admit(t, s, shed.Request{Caller: "a"}), admit(t, s, shed.Request{Caller: "a"}))
	rej := rejection(t, t.Context(), s, shed.Request{Caller: "a"})
	if rej.Reason != shed.ReasonQuota || rej.HTTPStatus() != http.StatusTooManyRequests || rej.RetryAfter == 0 {
		t.Fatalf("third request of a: %+v, want quota with 429 and a Retry-After", rej)
	}
	for range 3 {
		held = append(held, admit(t, s, shed.Request{Caller: "big"}))
	}
	if rej := rejection(t, t.Context(), s, shed.Request{Caller: "big"}); rej.Reason != shed.ReasonQuota {
		t.Fatalf("fourth request of big: %v, want quota", rej)
	}
	held = append(held, admit(t, s, shed.Request{Caller: "b"}))
	if got := s.Stats().Callers; got != 3 {
		t.Fatalf("Stats().Callers = %d, want 3", got)
	}
	for _, tk := range held {
		tk.Release()
	}
	if st := s.Stats(); st.Callers != 0 || st.InFlight != 0 {
		t.Fatalf("after release Stats() = %+v, want no callers and nothing in flight", st)
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "quota"}); got != 2 {
		t.Fatalf("shed_total{reason=quota} = %v, want 2", got)
	}
}

// TestKeylessRequestsEscapeDefaultQuota checks that DefaultQuota is a quota
// per API key: requests without a key are not all one caller squeezed into
// DefaultQuota (DefaultQuota 1 would refuse all but one keyless request at a
// time), they are bounded only by MaxInFlight unless Quotas[""] gives them
// one shared bucket on purpose.
func TestKeylessRequestsEscapeDefaultQuota(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 10, DefaultQuota: 1})
	for range 10 {
		defer admit(t, s, shed.Request{}).Release()
	}
	if st := s.Stats(); st.InFlight != 10 || st.Callers != 0 {
		t.Fatalf("Stats() = %+v, want 10 keyless requests in flight and no per-caller state", st)
	}
	if rej := rejection(t, t.Context(), s, shed.Request{}); rej.Reason != shed.ReasonOverload {
		t.Fatalf("eleventh keyless request: %v, want overload (MaxInFlight), not quota", rej)
	}

	s, _ = newShedder(t, shed.Options{MaxInFlight: 10, DefaultQuota: 1})
	defer admit(t, s, shed.Request{Caller: "a"}).Release()
	if rej := rejection(t, t.Context(), s, shed.Request{Caller: "a"}); rej.Reason != shed.ReasonQuota {
		t.Fatalf("second request of key a: %v, want quota", rej)
	}
}

func TestQuotasEmptyKeyIsOneKeylessBucket(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 10, DefaultQuota: 5, Quotas: map[string]int64{"": 2}})
	defer admit(t, s, shed.Request{}).Release()
	defer admit(t, s, shed.Request{}).Release()
	if rej := rejection(t, t.Context(), s, shed.Request{}); rej.Reason != shed.ReasonQuota {
		t.Fatalf("third keyless request with Quotas[\"\"]=2: %v, want quota", rej)
	}
	if got := s.Stats().Callers; got != 1 {
		t.Fatalf("Stats().Callers = %d, want 1 (the keyless bucket)", got)
	}
}

func TestCallerStateIsBoundedByConcurrency(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 4, DefaultQuota: 1})
	for i := range 10_000 {
		admit(t, s, shed.Request{Caller: fmt.Sprintf("key-%d", i)}).Release()
	}
	if got := s.Stats().Callers; got != 0 {
		t.Fatalf("after 10000 released callers Stats().Callers = %d, want 0", got)
	}
	var held []shed.Ticket
	for i := range 4 {
		held = append(held, admit(t, s, shed.Request{Caller: fmt.Sprintf("held-%d", i)}))
	}
	for i := range 1000 {
		if rej := rejection(t, t.Context(), s, shed.Request{Caller: fmt.Sprintf("new-%d", i)}); rej.Reason != shed.ReasonOverload {
			t.Fatalf("request over MaxInFlight: %v, want overload", rej)
		}
	}
	if got := s.Stats().Callers; got != 4 {
		t.Fatalf("Stats().Callers = %d with 4 held and 1000 rejected callers, want 4", got)
	}
	for _, tk := range held {
		tk.Release()
	}
}

func TestNoQuotaKeepsNoCallerState(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 10})
	a, b := admit(t, s, shed.Request{Caller: "x"}), admit(t, s, shed.Request{Caller: "x"})
	defer a.Release()
	defer b.Release()
	if got := s.Stats().Callers; got != 0 {
		t.Fatalf("Stats().Callers = %d without quotas, want 0", got)
	}
}

func TestQueueHandsSlotsOverInOrder(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 1, QueueSize: 2, QueueTimeout: 10 * time.Second})
	first := admit(t, s, shed.Request{})
	order := make(chan string, 2)
	tickets := make(chan shed.Ticket, 2)
	var wg sync.WaitGroup
	for i, name := range []string{"A", "B"} {
		wg.Go(func() {
			tk := admit(t, s, shed.Request{})
			order <- name
			tickets <- tk
		})
		waitFor(t, fmt.Sprintf("%d queued", i+1), func() bool { return s.Stats().Queued == int64(i+1) })
	}
	if rej := rejection(t, t.Context(), s, shed.Request{}); rej.Reason != shed.ReasonOverload || rej.HTTPStatus() != http.StatusServiceUnavailable {
		t.Fatalf("request with a full queue: %+v, want overload with 503", rej)
	}
	first.Release()
	if got := <-order; got != "A" {
		t.Fatalf("first slot went to %s, want A", got)
	}
	(<-tickets).Release()
	if got := <-order; got != "B" {
		t.Fatalf("second slot went to %s, want B", got)
	}
	(<-tickets).Release()
	wg.Wait()
	if st := s.Stats(); st.InFlight != 0 || st.Queued != 0 || st.PeakQueued != 2 || st.PeakInFlight != 1 {
		t.Fatalf("Stats() = %+v, want empty with peaks 1 in flight and 2 queued", st)
	}
}

func TestQueueWaitEnds(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 1, QueueSize: 4, QueueTimeout: 50 * time.Millisecond})
	defer admit(t, s, shed.Request{}).Release()

	start := time.Now()
	rej := rejection(t, t.Context(), s, shed.Request{})
	if rej.Reason != shed.ReasonQueueTimeout || rej.RetryAfter == 0 || time.Since(start) < 50*time.Millisecond {
		t.Fatalf("queued request: %+v after %v, want queue_timeout with a Retry-After after >= 50ms", rej, time.Since(start))
	}

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	s2, _ := newShedder(t, shed.Options{MaxInFlight: 1, QueueSize: 4, QueueTimeout: time.Minute})
	defer admit(t, s2, shed.Request{}).Release()
	if rej := rejection(t, ctx, s2, shed.Request{}); rej.Reason != shed.ReasonDeadline || rej.RetryAfter != 0 {
		t.Fatalf("request whose deadline passed while queued: %+v, want deadline without Retry-After", rej)
	}

	ctx, cancel = context.WithCancel(t.Context())
	time.AfterFunc(10*time.Millisecond, cancel)
	if rej := rejection(t, ctx, s2, shed.Request{}); rej.Reason != shed.ReasonCanceled || rej.RetryAfter == 0 {
		t.Fatalf("request canceled while queued: %+v, want canceled with a Retry-After (its 503 needs one)", rej)
	}
	if st := s2.Stats(); st.Queued != 0 || st.InFlight != 1 {
		t.Fatalf("Stats() = %+v, want nothing queued and one in flight", st)
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "queue_timeout"}); got != 1 {
		t.Fatalf("shed_total{reason=queue_timeout} = %v, want 1", got)
	}
}

func TestPastDeadlineIsDroppedBeforeAdmission(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 1, DefaultQuota: 1})
	rej := rejection(t, t.Context(), s, shed.Request{Caller: "a", Deadline: time.Now().Add(-time.Second)})
	if rej.Reason != shed.ReasonDeadline || rej.HTTPStatus() != http.StatusGatewayTimeout || rej.RetryAfter != 0 {
		t.Fatalf("past deadline: %+v, want deadline with 504 and no Retry-After", rej)
	}
	if st := s.Stats(); st.InFlight != 0 || st.Callers != 0 {
		t.Fatalf("Stats() = %+v, want the dropped request to hold nothing", st)
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "deadline"}); got != 1 {
		t.Fatalf("shed_total{reason=deadline} = %v, want 1", got)
	}
	admit(t, s, shed.Request{Caller: "a", Deadline: time.Now().Add(time.Minute)}).Release()
}

func TestRampRaisesTheLimitStepByStep(t *testing.T) {
	clk := newFakeClock()
	s, reg := newShedder(t, shed.Options{
		MaxInFlight: 8, Clock: clk,
		Ramp: &shed.Ramp{Steps: []int64{2, 4, 8}, StepDuration: time.Minute},
	})
	for _, want := range []int64{2, 4, 8, 8} {
		if got := s.Stats().Limit; got != want {
			t.Fatalf("Limit = %d, want %d", got, want)
		}
		if got := metricValue(t, reg, "spillway_service_limit", nil); got != float64(want) {
			t.Fatalf("limit gauge = %v, want %d", got, want)
		}
		clk.Add(time.Minute)
	}
	s.RestartRamp()
	if got := s.Stats().Limit; got != 2 {
		t.Fatalf("Limit after RestartRamp = %d, want 2", got)
	}
}

func TestRampGrantsQueuedRequestsWhenItSteps(t *testing.T) {
	clk := newFakeClock()
	s, _ := newShedder(t, shed.Options{
		MaxInFlight: 4, QueueSize: 4, QueueTimeout: 10 * time.Second, Clock: clk,
		Ramp: &shed.Ramp{Steps: []int64{1, 4}, StepDuration: time.Minute},
	})
	held := admit(t, s, shed.Request{})
	defer held.Release()
	done := make(chan shed.Ticket)
	go func() { done <- admit(t, s, shed.Request{}) }()
	waitFor(t, "one queued", func() bool { return s.Stats().Queued == 1 })
	clk.Add(time.Minute)
	admit(t, s, shed.Request{}).Release() // an arrival after the step lets the queue in first
	(<-done).Release()
}

func TestAmplificationRatio(t *testing.T) {
	clk := newFakeClock()
	s, reg := newShedder(t, shed.Options{MaxInFlight: 100, Clock: clk})
	ratio := func() float64 { return metricValue(t, reg, "spillway_service_amplification_ratio", nil) }
	if got := ratio(); got != 0 {
		t.Fatalf("ratio without requests = %v, want 0", got)
	}
	for _, attempt := range []int{1, 1, 2, 3, 4, 9, 0, -2} { // 0 and -2 count as first attempts
		admit(t, s, shed.Request{Attempt: attempt}).Release()
	}
	if got := ratio(); got != 8.0/4 {
		t.Fatalf("ratio = %v, want 8/4", got)
	}
	for label, want := range map[string]float64{"1": 4, "2": 1, "3": 1, "4+": 2} {
		if got := metricValue(t, reg, "spillway_service_requests_total", map[string]string{"attempt": label}); got != want {
			t.Errorf("requests_total{attempt=%q} = %v, want %v", label, got, want)
		}
	}
	clk.Add(30 * time.Second)
	for range 4 {
		admit(t, s, shed.Request{Attempt: 2}).Release()
	}
	if got := ratio(); got != 12.0/4 {
		t.Fatalf("ratio 30s later = %v, want 12/4", got)
	}
	clk.Add(45 * time.Second) // the first second has left the window
	if got := ratio(); got != 4 {
		t.Fatalf("ratio with only retries in the window = %v, want 4 (the request count)", got)
	}
	clk.Add(time.Minute)
	if got := ratio(); got != 0 {
		t.Fatalf("ratio after a quiet minute = %v, want 0", got)
	}
}

func TestRejectionStatus(t *testing.T) {
	tests := []struct {
		reason shed.Reason
		http   int
		code   codes.Code
	}{
		{shed.ReasonOverload, http.StatusServiceUnavailable, codes.Unavailable},
		{shed.ReasonQueueTimeout, http.StatusServiceUnavailable, codes.Unavailable},
		{shed.ReasonRamp, http.StatusServiceUnavailable, codes.Unavailable},
		{shed.ReasonQuota, http.StatusTooManyRequests, codes.ResourceExhausted},
		{shed.ReasonDeadline, http.StatusGatewayTimeout, codes.DeadlineExceeded},
		{shed.ReasonCanceled, http.StatusServiceUnavailable, codes.Canceled},
	}
	for _, tt := range tests {
		rej := &shed.Rejection{Reason: tt.reason}
		if got := rej.HTTPStatus(); got != tt.http {
			t.Errorf("%s: HTTPStatus() = %d, want %d", tt.reason, got, tt.http)
		}
		if got := status.Code(rej); got != tt.code {
			t.Errorf("%s: gRPC code = %v, want %v", tt.reason, got, tt.code)
		}
	}
}
