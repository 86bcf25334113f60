"""The guard's Prometheus series, with the names and labels of pkg/guard's
(spillway_worker_*), when prometheus_client is installed; nothing otherwise.
Several guards (one per dependency) share the collectors of one registry."""

from __future__ import annotations

import threading

try:  # optional
    import prometheus_client as _prom
except ImportError:  # pragma: no cover - exercised where it is missing
    _prom = None

DEFAULT = object()  # the default registry when prometheus_client is installed

_OUTCOME_NAMES = {"s": "success", "f": "failure", "t": "timeout", "c": "cancelled"}
_ATTEMPTS = ("1", "2", "3", "4+")
_lock = threading.Lock()
_shared = {}  # id(registry) -> (registry, collectors)


def _collectors(registry):
    with _lock:
        got = _shared.get(id(registry))
        if got is not None and got[0] is registry:
            return got[1]
        c = lambda name, doc, *labels: _prom.Counter(  # noqa: E731
            name, doc, ("dependency",) + labels, namespace="spillway", subsystem="worker", registry=registry)
        cols = {
            "calls": c("calls", "Calls made to the dependency, by outcome (success, failure, timeout, cancelled) and attempt number.", "outcome", "attempt"),
            "throttled": c("throttled", "Calls not made because the fleet refused them, by reason (slots, rate, open, redis_unavailable, no_policy, version).", "reason"),
            "stale": c("stale_dropped", "Jobs dropped before any call because they were past their deadline."),
            "superseded": c("superseded", "Jobs dropped before any call because a newer version exists."),
            "budget": c("budget_refusals", "Failed calls parked because the fleet's retry budget was spent."),
            "retries": c("retries_scheduled", "Failed calls the retry budget allowed to retry."),
            "redis_errors": c("redis_errors", "Redis round trips that failed or timed out."),
            "lease_lost": c("lease_lost", "Calls whose lease expired before it was renewed."),
            "fail_open": c("fail_open_calls", "Calls admitted by the local cap while Redis was unavailable."),
            "unread": c("unread_leases", "Leases whose acquire or release reply was never read, by what became of them (queued for forgetting, forgotten, expired first, dropped).", "result"),
            "evicting": _prom.Gauge(
                "redis_evicting", "1 when the guard started (allow_eviction) on a Redis whose maxmemory-policy evicts keys: "
                "leases and the published state may disappear, and the fleet's limits no longer hold.",
                ("dependency",), namespace="spillway", subsystem="worker", registry=registry),
            "slot_wait": _prom.Histogram(
                "slot_wait_seconds", "Time spent waiting for a fleet-wide slot before a call was admitted.",
                ("dependency",), namespace="spillway", subsystem="worker", registry=registry,
                buckets=[0.001 * 4 ** i for i in range(10)]),
        }
        _shared[id(registry)] = (registry, cols)
        return cols


class _Nop:
    def inc(self, *a):
        pass

    def observe(self, *a):
        pass

    def set(self, *a):
        pass


_NOP = _Nop()


class Metrics:
    """The series of one dependency, or no-ops."""

    def __init__(self, dependency: str, registry=DEFAULT):
        if registry is DEFAULT:
            registry = _prom.REGISTRY if _prom is not None else None
        self.enabled = registry is not None and _prom is not None
        if not self.enabled:
            self.stale = self.superseded = self.budget_refusals = self.retries = _NOP
            self.redis_errors = self.lease_lost = self.fail_open = self.slot_wait = self.evicting = _NOP
            self._calls = {}
            self._throttled = {}
            self._unread = {}
            return
        cols = _collectors(registry)
        d = dependency
        self.stale = cols["stale"].labels(d)
        self.superseded = cols["superseded"].labels(d)
        self.budget_refusals = cols["budget"].labels(d)
        self.retries = cols["retries"].labels(d)
        self.redis_errors = cols["redis_errors"].labels(d)
        self.lease_lost = cols["lease_lost"].labels(d)
        self.fail_open = cols["fail_open"].labels(d)
        self.slot_wait = cols["slot_wait"].labels(d)
        self.evicting = cols["evicting"].labels(d)
        self._calls = {(o, a): cols["calls"].labels(d, name, a) for o, name in _OUTCOME_NAMES.items() for a in _ATTEMPTS}
        self._throttled = {r: cols["throttled"].labels(d, r) for r in ("slots", "rate", "open", "redis_unavailable", "no_policy", "version")}
        self._unread = {r: cols["unread"].labels(d, r) for r in ("queued", "forgotten", "expired", "dropped")}

    def call(self, outcome: str, attempt: int) -> None:
        c = self._calls.get((outcome, _ATTEMPTS[min(max(attempt, 1), 4) - 1]))
        if c is not None:
            c.inc()

    def throttled(self, reason: str) -> None:
        c = self._throttled.get(reason)
        if c is not None:
            c.inc()

    def unread(self, result: str) -> None:
        c = self._unread.get(result)
        if c is not None:
            c.inc()
