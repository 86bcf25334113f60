package shed

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/spillway-dev/spillway/internal/ramp"
	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// Reason says why a request was shed; the values are the reason label of
// spillway_service_shed_total.
type Reason string

const (
	// ReasonOverload: MaxInFlight requests were running and the queue was
	// full or absent. HTTP 503, gRPC UNAVAILABLE.
	ReasonOverload Reason = "overload"
	// ReasonQueueTimeout: the request waited QueueTimeout without a slot.
	// HTTP 503, gRPC UNAVAILABLE.
	ReasonQueueTimeout Reason = "queue_timeout"
	// ReasonQuota: the caller had its whole quota in flight. HTTP 429, gRPC
	// RESOURCE_EXHAUSTED.
	ReasonQuota Reason = "quota"
	// ReasonDeadline: the caller's deadline passed before the request was
	// admitted. HTTP 504, gRPC DEADLINE_EXCEEDED.
	ReasonDeadline Reason = "deadline"
	// ReasonRamp: the ramp held the limit below MaxInFlight and it was
	// reached. HTTP 503, gRPC UNAVAILABLE.
	ReasonRamp Reason = "ramp"
	// ReasonCanceled: the request's context was canceled (the caller went
	// away) before it was admitted. HTTP 503 with a Retry-After like every
	// 503 (a proxy in between may relay it), gRPC CANCELLED.
	ReasonCanceled Reason = "canceled"
)

// Rejection is the error Admit returns for a shed request.
type Rejection struct {
	// Reason says why the request was shed.
	Reason Reason
	// RetryAfter is the randomized delay to send the caller, a whole number
	// of seconds; zero only for ReasonDeadline (HTTP 504), which is not worth
	// retrying. Every rejection answered with 503 or 429 has one.
	RetryAfter time.Duration
}

// Error implements error.
func (r *Rejection) Error() string {
	if r.RetryAfter == 0 {
		return fmt.Sprintf("request shed (%s)", r.Reason)
	}
	return fmt.Sprintf("request shed (%s), retry after %v", r.Reason, r.RetryAfter)
}

// HTTPStatus returns the HTTP status code for the rejection.
func (r *Rejection) HTTPStatus() int {
	switch r.Reason {
	case ReasonQuota:
		return http.StatusTooManyRequests
	case ReasonDeadline:
		return http.StatusGatewayTimeout
	default:
		return http.StatusServiceUnavailable
	}
}

// GRPCStatus returns the gRPC status for the rejection, so that
// status.FromError understands a *Rejection returned by a handler.
func (r *Rejection) GRPCStatus() *status.Status {
	code := codes.Unavailable
	switch r.Reason {
	case ReasonQuota:
		code = codes.ResourceExhausted
	case ReasonDeadline:
		code = codes.DeadlineExceeded
	case ReasonCanceled:
		code = codes.Canceled
	}
	return status.New(code, r.Error())
}

// Request describes one request to Admit.
type Request struct {
	// Caller is the caller's API key; "" (no key) is subject to no quota
	// unless Options.Quotas[""] is set, see Options.DefaultQuota.
	Caller string
	// Attempt is 1 for a first attempt, 2 for the first retry, and so on;
	// values below 1 count as 1.
	Attempt int
	// Deadline is when the caller stops waiting; zero means none.
	Deadline time.Time
}

// Ticket is an admitted request's slot. Call Release exactly once when the
// request is done. The zero Ticket, returned with a rejection, holds nothing.
type Ticket struct {
	s       *Shedder
	caller  string
	tracked bool
}

// Release frees the slot (and the caller's quota) for the next request.
// Releasing the zero Ticket does nothing.
func (t Ticket) Release() {
	if t.s == nil {
		return
	}
	t.s.gate.release()
	if t.tracked {
		t.s.callers.release(t.caller)
	}
}

// Shedder admits or sheds requests. It is safe for concurrent use; one
// Shedder is normally shared by all the transports of a service.
type Shedder struct {
	opts    Options
	clock   clock.Clock
	gate    gate
	callers *callers
	metrics *metrics
	ratio   *ratioWindow

	ramp      *ramp.Ramp
	rampDone  atomic.Bool
	rampFinal int64 // the limit once the ramp is done

	randMu sync.Mutex
	rand   retry.Rand

	callerMD string // CallerHeader in lower case, the gRPC metadata key
	callerH  string // CallerHeader in canonical form, the http.Header key
}

// New returns a Shedder for opts, or an error naming the first invalid field.
// With opts.Registerer set it registers the spillway_service_ metrics.
func New(opts Options) (*Shedder, error) {
	if err := opts.Validate(); err != nil {
		return nil, fmt.Errorf("invalid shed options: %w", err)
	}
	opts = opts.withDefaults()
	s := &Shedder{
		opts:     opts,
		clock:    opts.Clock,
		callers:  newCallers(opts.DefaultQuota, opts.Quotas),
		ratio:    newRatioWindow(),
		rand:     opts.Rand,
		callerMD: strings.ToLower(opts.CallerHeader),
		callerH:  http.CanonicalHeaderKey(opts.CallerHeader),
	}
	if s.clock == nil {
		s.clock = clock.System{}
	}
	s.gate = gate{
		maxInFlight:  opts.MaxInFlight,
		queueSize:    opts.QueueSize,
		queueTimeout: opts.QueueTimeout,
		limit:        s.limit,
	}
	s.startRamp()
	s.metrics = newMetrics(s)
	if opts.Registerer != nil {
		if err := s.metrics.register(opts.Registerer); err != nil {
			return nil, err
		}
	}
	return s, nil
}

func (s *Shedder) startRamp() {
	s.rampDone.Store(true)
	if s.opts.Ramp == nil {
		return
	}
	s.ramp = ramp.New(ramp.Schedule{Steps: s.opts.Ramp.Steps, StepDuration: s.opts.Ramp.StepDuration}, s.clock)
	steps := s.opts.Ramp.Steps
	s.rampFinal = min(s.opts.MaxInFlight, steps[len(steps)-1])
	s.rampDone.Store(s.ramp.Done())
}

// RestartRamp starts the ramp again from its first step, for a service that
// knows it has gone cold again (caches flushed, a dependency of its own
// restarted). Without Options.Ramp it does nothing.
func (s *Shedder) RestartRamp() {
	if s.ramp == nil {
		return
	}
	s.ramp.Restart()
	s.rampDone.Store(s.ramp.Done())
}

// limit returns the effective concurrency limit, advancing the ramp.
func (s *Shedder) limit() int64 {
	if s.rampDone.Load() {
		if s.ramp == nil {
			return s.opts.MaxInFlight
		}
		return s.rampFinal
	}
	s.ramp.Advance()
	if s.ramp.Done() {
		s.rampDone.Store(true)
	}
	return min(s.opts.MaxInFlight, s.ramp.Limit())
}

// Admit decides on one request: it counts the attempt, drops a request whose
// deadline has passed (or whose ctx is done), applies the caller's quota and
// then the global limit, waiting in the queue if one is configured (until
// QueueTimeout or ctx is done). It returns a Ticket to release when the
// request is done, or a *Rejection.
//
// Admit does not apply req.Deadline to ctx; the HTTP and gRPC adapters do.
func (s *Shedder) Admit(ctx context.Context, req Request) (Ticket, error) {
	s.countAttempt(req.Attempt)
	if reason := expiry(ctx, req.Deadline); reason != "" {
		return Ticket{}, s.reject(reason)
	}
	t := Ticket{s: s, caller: req.Caller}
	if quota := s.callers.quota(req.Caller); quota > 0 {
		if !s.callers.acquire(req.Caller, quota) {
			return Ticket{}, s.reject(ReasonQuota)
		}
		t.tracked = true
	}
	if reason := s.gate.acquire(ctx); reason != "" {
		if t.tracked {
			s.callers.release(req.Caller)
		}
		return Ticket{}, s.reject(reason)
	}
	s.metrics.admitted.Inc()
	return t, nil
}

// expiry returns ReasonDeadline if the request's deadline has passed (or ctx
// hit its own), ReasonCanceled if ctx was canceled, or "".
func expiry(ctx context.Context, deadline time.Time) Reason {
	switch err := ctx.Err(); {
	case errors.Is(err, context.DeadlineExceeded):
		return ReasonDeadline
	case err != nil:
		return ReasonCanceled
	case !deadline.IsZero() && !time.Now().Before(deadline):
		return ReasonDeadline
	}
	return ""
}

func (s *Shedder) countAttempt(attempt int) {
	i := attemptIndex(attempt)
	s.metrics.requests[i].Inc()
	s.ratio.add(s.clock.Now(), i == 0)
}

// reject counts a shed request and returns its Rejection.
func (s *Shedder) reject(reason Reason) *Rejection {
	s.metrics.shed[reason].Inc()
	r := &Rejection{Reason: reason}
	if reason != ReasonDeadline {
		r.RetryAfter = s.retryAfter()
	}
	return r
}

// retryAfter draws a whole number of seconds uniformly from
// [RetryAfterMin, RetryAfterMax]: RetryAfterMin plus the whole seconds of a
// full jitter over the n = max − min + 1 seconds of the range.
func (s *Shedder) retryAfter() time.Duration {
	lo := s.opts.RetryAfterMin.Truncate(time.Second)
	hi := s.opts.RetryAfterMax.Truncate(time.Second)
	width := hi - lo + time.Second
	var d time.Duration
	if s.rand == nil {
		d = retry.FullJitter(width, nil)
	} else {
		s.randMu.Lock()
		d = retry.FullJitter(width, s.rand)
		s.randMu.Unlock()
	}
	return min(lo+d.Truncate(time.Second), hi) // a Rand returning 1 lands on hi
}

// Stats is a snapshot of a Shedder's state.
type Stats struct {
	// InFlight is the number of admitted requests not yet released.
	InFlight int64
	// Queued is the number of requests waiting for a slot.
	Queued int64
	// Limit is the effective concurrency limit (the ramp applied).
	Limit int64
	// Callers is the number of callers with a quota and requests in flight:
	// the size of the per-caller state.
	Callers int
	// PeakInFlight and PeakQueued are the highest InFlight and Queued seen
	// since New.
	PeakInFlight int64
	PeakQueued   int64
}

// Stats returns a snapshot of the Shedder's state.
func (s *Shedder) Stats() Stats {
	g := s.gate.stats()
	return Stats{
		InFlight:     g.inFlight,
		Queued:       g.queued,
		Limit:        s.limit(),
		Callers:      s.callers.size(),
		PeakInFlight: g.peakInFlight,
		PeakQueued:   g.peakQueued,
	}
}
