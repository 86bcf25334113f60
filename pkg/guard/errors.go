package guard

import (
	"errors"
	"fmt"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// Action is what a job framework should do with a job after a refusal or a
// failed call.
type Action int

const (
	// ActionDefer: the call was not made, or was cut short by a
	// cancellation that counted nothing, and no attempt was consumed; run
	// the job again after After (throttled, rate limited, breaker open,
	// Redis unavailable, cancelled, lease lost, lifetime exceeded).
	ActionDefer Action = iota + 1
	// ActionRetry: the call failed and the retry budget allows a retry after
	// After; the next run is attempt + 1.
	ActionRetry
	// ActionPark: the call failed and the fleet's retry budget is spent; run
	// the job again only after the long delay After.
	ActionPark
	// ActionDrop: the job no longer matters (past its deadline, or superseded
	// by a newer version); acknowledge it without running it.
	ActionDrop
)

// String names the action.
func (a Action) String() string {
	switch a {
	case ActionDefer:
		return "defer"
	case ActionRetry:
		return "retry"
	case ActionPark:
		return "park"
	case ActionDrop:
		return "drop"
	}
	return fmt.Sprintf("action(%d)", int(a))
}

// Reasons, matched with errors.Is against an *Error.
var (
	// ErrThrottled: every fleet-wide slot is held ("throttled by us").
	ErrThrottled = errors.New("throttled: every fleet-wide slot is held")
	// ErrRateLimited: the fleet-wide rate limit is reached.
	ErrRateLimited = errors.New("rate limited: the fleet-wide rate is reached")
	// ErrOpen: the fleet's breaker is open; calls fail fast.
	ErrOpen = errors.New("breaker open: the dependency is failing")
	// ErrStale: the job is past its deadline and was dropped before any call.
	ErrStale = errors.New("stale: the job is past its deadline")
	// ErrSuperseded: a newer version of the job exists.
	ErrSuperseded = errors.New("superseded: a newer version of the job exists")
	// ErrFailed: the call failed and may be retried.
	ErrFailed = errors.New("call failed")
	// ErrBudgetExhausted: the call failed and the fleet's retry budget is spent.
	ErrBudgetExhausted = errors.New("retry budget exhausted")
	// ErrRedisUnavailable: Redis did not answer in time; the guard fails closed.
	ErrRedisUnavailable = errors.New("redis unavailable")
	// ErrNoPolicy: no DependencyPolicy is published for the dependency.
	ErrNoPolicy = protocol.ErrNoPolicy
	// ErrVersion: the dependency's state was published by a manager whose
	// protocol version this library does not act on (outside the version
	// skew docs/operations.md states); the Error's Cause is a
	// *protocol.VersionError that names both versions and what to upgrade.
	ErrVersion = protocol.ErrVersion
	// ErrLeaseLost: a long call's lease expired before it could be renewed
	// (Redis unreachable for the lease TTL, by the worker's own clock); the
	// fleet no longer counts the call, so its context is cancelled.
	ErrLeaseLost = errors.New("lease lost: the slot expired before it was renewed")
	// ErrCancelled: the call was cut short by its caller's cancellation (a
	// shutdown, say); it counted nothing against the dependency.
	ErrCancelled = errors.New("cancelled: the caller cancelled the call")
	// ErrLifetimeExceeded: a call on a Permit from Acquire ran past
	// Options.MaxCallLifetime; its Permit stopped renewing the lease and
	// cancelled its context. The cut counted nothing against the dependency.
	ErrLifetimeExceeded = errors.New("call lifetime exceeded: the permit stopped renewing its lease")
)

// Error is the guard's answer when a call was not made or failed: what to do
// with the job, why, and when.
type Error struct {
	Action Action
	// Reason is one of the Err* values of this package.
	Reason error
	// After is how long to wait before running the job again.
	After time.Duration
	// Cause is the call's own error, for ActionRetry and ActionPark, or the
	// Redis error for ErrRedisUnavailable.
	Cause error
}

func (e *Error) Error() string {
	msg := e.Action.String() + ": " + e.Reason.Error()
	if e.After > 0 {
		msg += fmt.Sprintf(" (after %v)", e.After.Round(time.Millisecond))
	}
	if e.Cause != nil {
		msg += ": " + e.Cause.Error()
	}
	return msg
}

// Unwrap lets errors.Is and errors.As see both the reason and the cause.
func (e *Error) Unwrap() []error {
	if e.Cause == nil {
		return []error{e.Reason}
	}
	return []error{e.Reason, e.Cause}
}

// Decide extracts the action and delay from an error returned by Do or
// Permit.Done. ok is false for nil and for errors the guard did not decide on
// (a Permanent error, say): those are the job's own outcome.
func Decide(err error) (action Action, after time.Duration, ok bool) {
	var e *Error
	if !errors.As(err, &e) {
		return 0, 0, false
	}
	return e.Action, e.After, true
}

// Permanent marks err as final: the dependency answered, the job cannot
// succeed by retrying (a validation error, say). The call counts as a success
// for the breaker and Done returns err unchanged.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

// permanentOf is the Permanent error in err's chain, or nil. Its variable
// escapes to the heap (errors.As takes a pointer), so it is declared only
// for a non-nil err: a call that succeeded allocates nothing here.
func permanentOf(err error) *permanentError {
	if err == nil {
		return nil
	}
	var p *permanentError
	if errors.As(err, &p) {
		return p
	}
	return nil
}

func (p *permanentError) Error() string { return p.err.Error() }
func (p *permanentError) Unwrap() error { return p.err }

// RetryAfter marks err as a refusal that carried a server's Retry-After (an
// HTTP 429 or 503, say): the retry happens no earlier than after, jittered
// upward, and never earlier than the backoff would have it.
func RetryAfter(err error, after time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, after: after}
}

type retryAfterError struct {
	err   error
	after time.Duration
}

func (r *retryAfterError) Error() string { return r.err.Error() }
func (r *retryAfterError) Unwrap() error { return r.err }
