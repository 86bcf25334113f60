"""Spillway for Python: a client of the Spillway Redis protocol, version 6
(docs/protocol.md), and the worker guard that enforces a dependency's
fleet-wide slots, rate, breaker and retry budget at every call, beside the
Go guard (pkg/guard) of the same fleet. spillway.celery integrates it with
Celery tasks."""

from .errors import (ACTIONS, DEFER, DROP, PARK, RETRY, BadReply, BreakerOpen, BudgetExhausted, CallFailed,
                     Cancelled, Decision, LeaseLost, NoPolicy, OtherVersion, Permanent, RateLimited, RedisUnavailable,
                     RetryAfter, RetryRequest, SpillwayError, Stale, Superseded, Throttled, decide)
from .guard import Guard, Job, Permit, current_permit, default_classify
from .protocol import KEY_PREFIX, VERSION, Dependency, Keys

__all__ = [
    "ACTIONS", "DEFER", "DROP", "PARK", "RETRY", "BadReply", "BreakerOpen", "BudgetExhausted", "CallFailed",
    "Cancelled", "Decision", "LeaseLost", "NoPolicy", "OtherVersion", "Permanent", "RateLimited", "RedisUnavailable",
    "RetryAfter", "RetryRequest", "SpillwayError", "Stale", "Superseded", "Throttled", "decide",
    "Guard", "Job", "Permit", "current_permit", "default_classify", "KEY_PREFIX", "VERSION", "Dependency", "Keys",
]
