package shed

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/spillway-dev/spillway/pkg/wire"
)

// maxAttemptDigits bounds an attempt number: longer values are malformed,
// which also keeps parsing free of overflow.
const maxAttemptDigits = 9

// Middleware returns next behind the Shedder: each request is admitted or
// rejected (503, 429 or 504, see the package documentation) before next sees
// it, and a valid future wire.DeadlineHeader becomes the deadline of the request's
// context.
func (s *Shedder) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.serveHTTP(w, r, next)
	})
}

func (s *Shedder) serveHTTP(w http.ResponseWriter, r *http.Request, next http.Handler) {
	req := s.httpRequest(r.Header)
	if !req.Deadline.IsZero() && time.Now().Before(req.Deadline) {
		ctx, cancel := context.WithDeadline(r.Context(), req.Deadline)
		defer cancel()
		r = r.WithContext(ctx)
	}
	t, err := s.Admit(r.Context(), req)
	if err != nil {
		writeRejection(w, err)
		return
	}
	defer t.Release()
	next.ServeHTTP(w, r)
}

// httpRequest reads the caller, attempt and deadline headers, counting the
// malformed ones.
func (s *Shedder) httpRequest(h http.Header) Request {
	req := Request{Caller: first(h[s.callerH]), Attempt: 1}
	if v := first(h[wire.AttemptHeader]); v != "" {
		if n, ok := parseAttempt(v); ok {
			req.Attempt = n
		} else {
			s.metrics.malformedAttempt.Inc()
		}
	}
	if v := first(h[wire.DeadlineHeader]); v != "" {
		if d, err := time.Parse(wire.DeadlineLayout, v); err == nil {
			req.Deadline = d
		} else {
			s.metrics.malformedDeadline.Inc()
		}
	}
	return req
}

// first returns the first value of a header, or "".
func first(values []string) string {
	if len(values) == 0 {
		return ""
	}
	return values[0]
}

// parseAttempt parses a positive decimal integer of at most
// maxAttemptDigits digits, without signs, spaces or allocation.
func parseAttempt(v string) (int, bool) {
	if len(v) == 0 || len(v) > maxAttemptDigits {
		return 0, false
	}
	n := 0
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, n >= 1
}

// writeRejection answers a shed request: status, Retry-After when there is
// one, and a one-line plain-text body.
func writeRejection(w http.ResponseWriter, err error) {
	var rej *Rejection
	if !errors.As(err, &rej) {
		rej = &Rejection{Reason: ReasonOverload}
	}
	if rej.RetryAfter > 0 {
		w.Header().Set(wire.RetryAfterHeader, strconv.FormatInt(int64(rej.RetryAfter/time.Second), 10))
	}
	http.Error(w, rej.Error(), rej.HTTPStatus())
}
