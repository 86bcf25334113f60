package guard

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/spillway-dev/spillway/pkg/wire"
)

type attemptKey struct{}

// WithAttempt returns ctx carrying the attempt number, for calls made outside
// a Permit (a Permit's context already carries it).
func WithAttempt(ctx context.Context, attempt int) context.Context {
	return context.WithValue(ctx, attemptKey{}, attempt)
}

// AttemptFromContext returns the attempt number of the call running under
// ctx (a Permit's context), or 1 outside one.
func AttemptFromContext(ctx context.Context) int {
	if n, ok := ctx.Value(attemptKey{}).(int); ok && n > 0 {
		return n
	}
	return 1
}

// Transport is an http.RoundTripper that sets wire.AttemptHeader and, when
// the request's context has a deadline, wire.DeadlineHeader, so the
// dependency's middleware (pkg/shed) can count requests by attempt and drop
// work whose caller has given up. Over gRPC, guardgrpc's interceptors send
// the attempt and gRPC's own grpc-timeout the deadline.
type Transport struct {
	// Base is the transport that sends the request; nil means
	// http.DefaultTransport.
	Base http.RoundTripper
}

// RoundTrip sets the headers on a clone of req and sends it.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	r := req.Clone(req.Context())
	r.Header.Set(wire.AttemptHeader, strconv.Itoa(AttemptFromContext(req.Context())))
	if d, ok := req.Context().Deadline(); ok {
		r.Header.Set(wire.DeadlineHeader, d.UTC().Format(wire.DeadlineLayout))
	}
	return base.RoundTrip(r)
}

// CheckResponse maps an HTTP response to the error a guarded call returns:
// nil below 400; for 429 and 503 an error carrying the server's Retry-After
// (see RetryAfter); for other 5xx a plain failure; for other 4xx a Permanent
// error, since retrying cannot fix the request.
func CheckResponse(resp *http.Response) error {
	if resp.StatusCode < 400 {
		return nil
	}
	err := fmt.Errorf("%s %s: %s", resp.Request.Method, resp.Request.URL.Redacted(), resp.Status)
	switch {
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable:
		if d, ok := parseRetryAfter(resp.Header.Get(wire.RetryAfterHeader), time.Now()); ok {
			return RetryAfter(err, d)
		}
		return err
	case resp.StatusCode >= 500:
		return err
	}
	return Permanent(err)
}

// parseRetryAfter reads a Retry-After value: delay seconds or an HTTP date,
// at most maxRetryAfter ahead.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	var d time.Duration
	if s, err := strconv.ParseInt(v, 10, 64); err == nil {
		if s < 0 || s > int64(maxRetryAfter/time.Second) {
			return 0, false
		}
		d = time.Duration(s) * time.Second
	} else if t, err := http.ParseTime(v); err == nil {
		d = max(t.Sub(now), 0)
	} else {
		return 0, false
	}
	if d > maxRetryAfter {
		return 0, false
	}
	return d, true
}

// maxRetryAfter is the longest Retry-After honoured, in either form: a
// longer one is more likely a misconfigured server than a plan, and the
// fleet's own backoff applies instead.
const maxRetryAfter = 24 * time.Hour
