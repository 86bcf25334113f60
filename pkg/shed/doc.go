// Package shed is the service side of Spillway: middleware that a dependency
// puts in front of its own handlers so that it protects itself from retry
// storms, whoever its callers are.
//
// A Shedder admits a request only when there is room for it, and rejects the
// rest early and cheaply, before any work:
//
//   - Global overload. At most Options.MaxInFlight requests run at once. An
//     optional bounded queue (Options.QueueSize) holds a few more for at most
//     Options.QueueTimeout. Beyond that the request gets HTTP 503 (gRPC
//     UNAVAILABLE).
//   - Per-caller quota. Each caller, named by an API key, may have at most its
//     quota of requests admitted or queued at once (Options.DefaultQuota and
//     Options.Quotas); the excess gets HTTP 429 (gRPC RESOURCE_EXHAUSTED), so
//     a caller stuck in a retry loop is refused before it starves the others.
//     Requests without a key are not held to DefaultQuota (they may be any
//     number of clients): only MaxInFlight bounds them, unless Quotas[""]
//     sets one bucket that all keyless requests share.
//   - Expired deadline. A request whose caller's deadline has already passed
//     is dropped with HTTP 504 (gRPC DEADLINE_EXCEEDED): nobody is waiting for
//     the answer. A future deadline is applied to the request's context.
//   - Slow start. With Options.Ramp (a Ramp: Steps and StepDuration) the
//     effective limit is min(MaxInFlight, ramp limit), climbing step by step
//     after a (re)start, for a service that comes back with cold caches.
//
// Every 503 and 429 carries a Retry-After drawn uniformly from
// [Options.RetryAfterMin, Options.RetryAfterMax] (default 1–10 s, whole
// seconds; an unset RetryAfterMax is at least twice RetryAfterMin), never a
// constant by default: a fixed value would make every client that honours it
// retry in the same second.
//
// # Wire contract
//
// Every name below is declared once, in pkg/wire, and imported by both the
// worker library (pkg/guard) and this package. Over HTTP a caller sends:
//
//   - wire.AttemptHeader (Spillway-Attempt): the attempt number of this request,
//     a decimal integer: 1 for the first attempt, 2 for the first retry, and
//     so on.
//   - wire.DeadlineHeader (Spillway-Deadline): the absolute time after which the
//     caller no longer wants the answer, in RFC 3339 with sub-second precision
//     (wire.DeadlineLayout, time.RFC3339Nano), normally in UTC, for example
//     2026-05-01T12:00:03.250Z. An absolute deadline assumes the two
//     clocks agree (NTP): a caller whose clock runs seconds behind the
//     service's sees its requests dropped as expired.
//   - The caller key header (Options.CallerHeader, default
//     wire.DefaultCallerHeader, X-Api-Key).
//
// The service answers a shed request with:
//
//   - 503 Service Unavailable: the service is over capacity (or ramping up).
//   - 429 Too Many Requests: this caller is over its quota.
//   - 504 Gateway Timeout: the request's deadline had already passed.
//
// 503 and 429 carry the standard header wire.RetryAfterHeader
// ("Retry-After: <seconds>"), so any
// client that honours Retry-After spreads its retries.
//
// Over gRPC the attempt number is the standard grpc-previous-rpc-attempts
// metadata (wire.PreviousAttemptsMetadata) (set by gRPC's own retry support; attempt = value + 1), the
// deadline is the standard grpc-timeout (the server context's deadline) and
// the caller key is the metadata key Options.CallerHeader in lower case
// (default x-api-key). Rejections use the codes UNAVAILABLE,
// RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED; UNAVAILABLE and
// RESOURCE_EXHAUSTED carry the trailer metadata wire.RetryAfterMetadata
// (retry-after, whole seconds) and gRPC's standard server pushback
// wire.PushbackMetadata (grpc-retry-pushback-ms, the same delay in milliseconds),
// which grpc-go's built-in retry policy honours.
//
// For another transport (a queue consumer, a custom protocol), call
// Shedder.Admit with a Request and release the returned Ticket when the work
// is done.
//
// Malformed headers are never trusted: an attempt that is not a positive
// decimal integer of at most nine digits counts as attempt 1, and a deadline
// that does not parse counts as no deadline. Both are counted as malformed
// and the request goes through admission like any other.
//
// # Metrics
//
// With Options.Registerer set, a Shedder exports (all prefixed
// spillway_service_):
//
//   - requests_total{attempt="1"|"2"|"3"|"4+"}: requests seen, by attempt.
//   - amplification_ratio: requests / first attempts over the last minute;
//     1 means no retries, 3 means three requests per first attempt; 0 while
//     the minute saw no request. A minute of retries only reads as the
//     request count, as if one first attempt had been seen.
//   - admitted_total: requests admitted to the handler.
//   - shed_total{reason}: requests rejected, reason one of overload,
//     queue_timeout, quota, deadline, ramp, canceled (the caller went away
//     before the request was admitted).
//   - malformed_headers_total{header="attempt"|"deadline"}.
//   - in_flight, queue_depth and limit (the effective limit, ramp applied).
//
// To run two Shedders on one registry, wrap it with
// prometheus.WrapRegistererWith and a distinguishing label.
//
// A Shedder does not authenticate the caller key: it trusts whatever key the
// request carries. Put it behind authentication if callers could forge keys.
package shed
