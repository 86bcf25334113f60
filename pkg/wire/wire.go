// Package wire declares, once, the names and values that cross a process
// boundary between Spillway's parts, so both sides of each wire import the
// same declaration:
//
//   - the HTTP headers and gRPC metadata keys a worker (pkg/guard) sends and
//     a service's middleware (pkg/shed) reads, and those the middleware
//     answers with;
//   - State, the fleet's state for a dependency, which the controller
//     decides (internal/control, internal/breaker), publishes to Redis
//     (pkg/protocol) and to the DependencyPolicy status, and which workers
//     enforce and the simulator reproduces.
//
// The deadline of a gRPC call needs no name here: it travels as gRPC's own
// grpc-timeout, which grpc-go sets from the context's deadline.
//
// The package imports only the standard library's time, so pure packages and
// lean worker binaries can use it.
package wire

import "time"

// HTTP headers.
const (
	// AttemptHeader carries the attempt number of a request as a decimal
	// integer: 1 for the first attempt, 2 for the first retry, and so on. A
	// missing header means attempt 1.
	AttemptHeader = "Spillway-Attempt"
	// DeadlineHeader carries the caller's absolute deadline in
	// DeadlineLayout, normally in UTC. A missing header means no deadline.
	DeadlineHeader = "Spillway-Deadline"
	// DefaultCallerHeader is the default header naming the caller (its API
	// key); over gRPC its lower-case form, x-api-key, is the metadata key.
	DefaultCallerHeader = "X-Api-Key"
	// RetryAfterHeader is the standard HTTP header carrying how long to wait
	// before retrying a 429 or 503: whole seconds, or an HTTP date.
	RetryAfterHeader = "Retry-After"
)

// DeadlineLayout is the layout of DeadlineHeader's value: RFC 3339 with
// sub-second precision, for example 2026-05-01T12:00:03.25Z.
const DeadlineLayout = time.RFC3339Nano

// gRPC metadata keys.
const (
	// PreviousAttemptsMetadata is gRPC's standard metadata key counting the
	// attempts made before this one; the attempt number is its value + 1, and
	// a first attempt sends none.
	PreviousAttemptsMetadata = "grpc-previous-rpc-attempts"
	// RetryAfterMetadata is the trailer key carrying the retry delay in whole
	// seconds, the gRPC counterpart of RetryAfterHeader.
	RetryAfterMetadata = "retry-after"
	// PushbackMetadata is gRPC's standard server pushback trailer key: the
	// same retry delay in milliseconds, honoured by grpc-go's retry policy.
	PushbackMetadata = "grpc-retry-pushback-ms"
)
