"""The guard's answers when a call was not made or failed: typed exceptions
that mirror pkg/guard's errors, each carrying the action a job framework
should take (defer, retry, park, drop) and the delay before the job runs
again, and decide(), which reads them."""

from __future__ import annotations

from typing import NamedTuple, Optional

DEFER, RETRY, PARK, DROP = "defer", "retry", "park", "drop"
ACTIONS = (DEFER, RETRY, PARK, DROP)


class SpillwayError(Exception):
    """A refusal or a failed call: what to do with the job, and when.

    action is DEFER (no attempt consumed: run the job again after `after`
    seconds with the same attempt number), RETRY (the call failed and the
    fleet's retry budget allows attempt + 1 after `after`), PARK (the call
    failed and the budget is spent, or Redis could not say: run it again only
    after the long delay `after`) or DROP (the job no longer matters: ack it
    without running it). cause is the call's own exception (RETRY, PARK) or
    the Redis error (RedisUnavailable)."""

    action = DEFER
    reason = "refused"

    def __init__(self, after: float = 0.0, cause: Optional[BaseException] = None, detail: str = ""):
        self.after = max(0.0, float(after))
        self.cause = cause
        self.detail = detail
        super().__init__(self._message())

    def __reduce__(self):
        # Picklable (Celery's prefork pool and result backends pickle
        # exceptions); the cause travels as its repr, since it may not be.
        detail = self.detail
        if self.cause is not None:
            detail = f"{detail}: {self.cause!r}" if detail else repr(self.cause)
        return (type(self), (self.after, None, detail))

    def _message(self) -> str:
        msg = f"{self.action}: {self.reason}"
        if self.after > 0:
            msg += f" (after {self.after:.3f}s)"
        if self.detail:
            msg += f": {self.detail}"
        if self.cause is not None:
            msg += f": {self.cause!r}"
        return msg


class Throttled(SpillwayError):
    reason = "throttled: every fleet-wide slot is held"


class RateLimited(SpillwayError):
    reason = "rate limited: the fleet-wide rate is reached"


class BreakerOpen(SpillwayError):
    reason = "breaker open: the dependency is failing"


class RedisUnavailable(SpillwayError):
    reason = "redis unavailable"


class BadReply(RedisUnavailable):
    """Redis answered outside the protocol (a reply the client could not
    parse, a proxy's answer, another script under the name): fail closed,
    like Redis unavailable."""
    reason = "redis unavailable: a reply outside the protocol"


class NoPolicy(SpillwayError):
    reason = "no policy published for this dependency"


class OtherVersion(NoPolicy):
    """The dependency's state was published by a manager whose protocol
    version this client does not act on (outside the version skew of
    docs/operations.md); the cause, a protocol.VersionError, names both
    versions and what to upgrade. Deferred, like NoPolicy."""
    reason = "the state was published for a protocol version this client does not speak"


class Cancelled(SpillwayError):
    """The call was cut short for a reason of the caller's own (raise it from
    the guarded code to say so, e.g. on shutdown): it counted nothing against
    the dependency and is deferred."""
    reason = "cancelled: the caller cancelled the call"


class LeaseLost(Cancelled):
    reason = "lease lost: the slot expired before it was renewed"


class Stale(SpillwayError):
    action = DROP
    reason = "stale: the job is past its deadline"


class Superseded(SpillwayError):
    action = DROP
    reason = "superseded: a newer version of the job exists"


class CallFailed(SpillwayError):
    action = RETRY
    reason = "call failed"


class BudgetExhausted(SpillwayError):
    action = PARK
    reason = "retry budget exhausted"


class Decision(NamedTuple):
    action: Optional[str]  # None: not the guard's decision (success, a Permanent error, another exception)
    after: float  # seconds


def decide(exc: Optional[BaseException]) -> Decision:
    """The action and delay of an exception raised by Guard.call or a slot;
    Decision(None, 0.0) for None and for exceptions the guard did not decide
    on: those are the job's own outcome."""
    if isinstance(exc, SpillwayError):
        return Decision(exc.action, exc.after)
    return Decision(None, 0.0)


class Permanent(Exception):
    """Wrap an error the dependency answered with that retrying cannot fix (a
    validation error, say): the call counts as a success for the breaker and
    the guard raises the wrapped error unchanged."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error

    def __reduce__(self):
        return (type(self), (self.error,))


class RetryRequest(Exception):
    """Raise it from the guarded code to ask for a retry of the job because
    of cause (the dependency's error): the call is counted as classify(cause)
    says ('f' without a cause) and the fleet's retry budget is asked once.
    The guard raises CallFailed after `after` seconds (None: the fleet's
    backoff) or, when the budget is spent, BudgetExhausted after the parking
    delay, never sooner than `after`. GuardedTask raises it for a body's own
    self.retry(...) and for autoretry_for, so that a failure is one message."""

    def __init__(self, cause: Optional[BaseException] = None, after: Optional[float] = None):
        super().__init__(cause if cause is not None else "retry requested")
        self.cause = cause
        self.after = None if after is None else max(0.0, float(after))

    def __reduce__(self):
        return (type(self), (self.cause, self.after))


class RetryAfter(Exception):
    """Wrap a refusal that carried a server's Retry-After (HTTP 429 or 503):
    the retry comes no earlier than `after` seconds, jittered upward, and
    never earlier than the backoff would have it."""

    def __init__(self, after: float, error: Optional[BaseException] = None):
        super().__init__(error if error is not None else f"retry after {after}s")
        self.after = float(after)
        self.error = error

    def __reduce__(self):
        return (type(self), (self.after, self.error))
