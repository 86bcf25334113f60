package guard_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// A custom Classify that returns an outcome the protocol does not know is an
// error of the call, not a panic, and the slot is still freed.
func TestUnknownOutcomeFromClassifyIsAnError(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	gd := newGuard(t, rdb, guard.Options{Classify: func(error) protocol.Outcome { return "x" }})

	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("Do panicked: %v", r)
			}
		}()
		err = gd.Do(t.Context(), guard.Job{}, ok)
	}()
	g.Expect(err).To(MatchError(ContainSubstring("outcome")))
	g.Expect(rdb.ZCount(t.Context(), protocol.KeysFor(gd.Dependency()).Leases, "(0", "+inf").Val()).To(BeZero(), "the slot is freed")
}

// An HTTP-date Retry-After far in the future is ignored like a seconds value
// over 24 h: the fleet's backoff applies, not a two-day wait.
func TestFarRetryAfterDateIsIgnoredLikeFarSeconds(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(5)
	p.Budget.MinRetries = 1000
	publish(t, rdb, p)
	gd := newGuard(t, rdb, guard.Options{})

	for _, retryAfter := range []string{
		"172800", // 48 h in seconds
		time.Now().Add(48 * time.Hour).UTC().Format(http.TimeFormat),
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set(wire.RetryAfterHeader, retryAfter)
			w.WriteHeader(http.StatusServiceUnavailable)
		}))
		err := gd.Do(t.Context(), guard.Job{Attempt: 1}, func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			defer func() { _ = resp.Body.Close() }()
			return guard.CheckResponse(resp)
		})
		srv.Close()
		after := wantDecision(t, err, guard.ActionRetry, guard.ErrFailed)
		g.Expect(after).To(BeNumerically("<=", time.Second), "Retry-After %q: the published backoff (max 1s) applies", retryAfter)
	}
}

// fixedRand always draws the same number.
type fixedRand float64

func (f fixedRand) Float64() float64 { return float64(f) }

// Rate-limit refusals are jittered upward like the other refusals, never
// earlier than the next token.
func TestRateLimitRefusalsAreJittered(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	p := defaultPublished(50)
	p.RatePerSecond = 1
	publish(t, rdb, p)

	low := newGuard(t, rdb, guard.Options{Rand: fixedRand(0)})
	high := newGuard(t, rdb, guard.Options{Rand: fixedRand(0.999)})
	g.Expect(low.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	lowAfter := wantDecision(t, low.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrRateLimited)
	highAfter := wantDecision(t, high.Do(t.Context(), guard.Job{}, ok), guard.ActionDefer, guard.ErrRateLimited)
	t.Logf("rate refusal after: lowest draw %v, highest draw %v", lowAfter, highAfter)
	g.Expect(lowAfter).To(BeNumerically(">", 800*time.Millisecond), "no earlier than the next token (1/s)")
	g.Expect(highAfter).To(BeNumerically(">", 1300*time.Millisecond), "spread upward by up to half")
}

var _ = errors.Is
