"""Celery tasks that take a fleet slot around their body.

    from spillway.celery import GuardedTask

    @app.task(bind=True, base=GuardedTask, spillway_dependency="fleet/vehicle-api",
              spillway_max_age=600, acks_late=True, max_retries=None)
    def enrich_vehicle(self, vehicle_id):
        save(vehicle_id, external_api.get(vehicle_id))

Each run asks the dependency's Guard (one per worker process, over
``app.conf.spillway_redis_url``) for a slot, runs the body, releases the slot
with the outcome and acts on the guard's decision:

- defer (throttled, rate limited, breaker open, Redis unavailable, no policy,
  cancelled): the task is sent again after the guard's delay with the same
  retry count, so a refusal consumes no attempt and max_retries never turns
  an outage into lost tasks;
- retry (the body failed and the fleet's retry budget allows it):
  ``self.retry(countdown=...)`` with the backoff the controller publishes;
  the attempt number the fleet counts is ``request.retries + 1``;
- park (the body failed and the budget is spent): ``self.retry`` after the
  long parking delay;
- the body's own retry (``self.retry(...)`` in the body, or Celery's
  ``autoretry_for``, with or without ``retry_backoff``): the body's retry
  sends nothing itself; it ends the call, counted as the failure of its
  ``exc``, asks the fleet's retry budget once, and the task sends exactly one
  message: after the body's countdown or eta if it gave one (Celery's
  ``retry_backoff`` gives one), else after the fleet's backoff (never
  Celery's default_retry_delay), or parked when the budget is spent. Its
  other options (queue, args, kwargs, max_retries) are kept. Past
  ``max_retries`` the failure is counted and the task fails, with no budget
  asked. ``self.retry(throw=False)`` is not intercepted: Celery sends its
  message at once, uncharged;
- Celery's ``Retry``, ``Ignore`` and ``Reject`` raised by other means pass
  through the guard uncounted (released as cancelled);
- drop (past ``spillway_max_age`` since the first enqueue, or superseded by
  a newer version of its job key): a warning, the guard's
  spillway_worker_stale_dropped_total or spillway_worker_superseded_total,
  the result state ``DROPPED`` and celery's Ignore, never silently.

Task options (set with @app.task(...) or on a subclass):

- ``spillway_dependency``: "namespace/name" of the DependencyPolicy (required).
- ``spillway_max_age``: seconds after the first enqueue past which the job
  is stale (None: never). The deadline travels in the message header
  ``spillway_deadline`` (Unix seconds) and survives retries; a caller may
  set it itself with ``apply_async(headers={"spillway_deadline": t})``.
- ``spillway_job``: a function (args, kwargs) -> (key, version) naming the
  job's key and version, so that superseded versions are dropped unrun
  (announce a new version with ``task.guard.supersede(key, version)``).
- ``spillway_guard_options``: keyword arguments of Guard (lease_ttl, ...).

Run in the caller's thread (``task()``, ``apply``, ``task_always_eager``) a
refusal is raised to the caller as the guard's exception: Celery re-runs an
eager retry at once, which would spin while the fleet refuses.

App configuration: ``spillway_redis_url`` (default: the broker URL when it
is redis://) and ``spillway_guard_options``. Tested with Celery 5.2 (Debian
12's python3-celery 5.2.6) and redis-py 4.3: a real worker on the prefork
pool (each child process builds its own Guard), and the task's decisions
run in-process.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import sys
import threading
import time
from typing import Optional

import celery
import redis
from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded

from . import errors as E
from . import protocol as P
from .guard import Guard, Job, current_permit, default_classify

log = logging.getLogger("spillway.celery")

DEADLINE_HEADER = "spillway_deadline"
DROPPED = "DROPPED"

_guards = {}
_guards_lock = threading.Lock()


def classify(exc: BaseException) -> str:
    """default_classify, and a soft time limit is a timeout."""
    if isinstance(exc, SoftTimeLimitExceeded):
        return P.TIMEOUT
    return default_classify(exc)


class _BodyRetry(E.RetryRequest, Retry):
    """A body's own self.retry(...), not sent: the guard charges it to the
    fleet's budget and on_spillway_decision sends the one message. A Retry
    too, so that Celery's autoretry_for wrapper lets it through."""

    def __init__(self, exc=None, after=None, options=None):
        E.RetryRequest.__init__(self, exc, after)
        self.exc, self.when, self.sig, self.is_eager, self.message = exc, after, None, False, None
        self.excs = repr(exc) if exc is not None else None
        self.options = options or {}

    def __str__(self):
        return f"retry requested: {self.cause!r}"

    def __reduce__(self):
        return (E.RetryRequest, (self.cause, self.after))


class GuardedTask(celery.Task):
    """A Celery task whose body runs inside a fleet slot; see the module."""

    spillway_dependency: Optional[str] = None
    spillway_max_age: Optional[float] = None
    spillway_job = None
    spillway_guard_options: dict = {}

    # -- the guard, one per worker process and dependency -------------------

    @property
    def guard(self) -> Guard:
        key = (os.getpid(), self.spillway_dependency)
        g = _guards.get(key)
        if g is None:
            with _guards_lock:
                g = _guards.get(key)
                if g is None:
                    g = self.make_guard()
                    _guards[key] = g
        return g

    def make_guard(self) -> Guard:
        """The Guard of this task's dependency; override to build your own."""
        if not self.spillway_dependency:
            raise ValueError(f"task {self.name} must set spillway_dependency")
        conf = self.app.conf
        url = conf.get("spillway_redis_url")
        if not url:
            broker = conf.broker_url or ""
            if not broker.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError("set app.conf.spillway_redis_url: the broker is not Redis")
            url = broker
        opts = {"classify": classify}
        opts.update(conf.get("spillway_guard_options") or {})
        opts.update(self.spillway_guard_options or {})
        rdb = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=1)
        return Guard(rdb, self.spillway_dependency, **opts)

    @property
    def spillway_permit(self):
        """The Permit of the running body (None outside it): a long body
        checks ``self.spillway_permit.lost`` or calls
        ``self.spillway_permit.raise_if_lost()`` and stops once the fleet no
        longer counts it; it is deferred, never retried as a failure."""
        return current_permit()

    # -- sending: the deadline header -------------------------------------

    def apply_async(self, args=None, kwargs=None, task_id=None, producer=None,
                    link=None, link_error=None, shadow=None, **options):
        headers = dict(options.get("headers") or {})
        if DEADLINE_HEADER not in headers:
            dl = None
            req = self.request
            if task_id is not None and req is not None and req.id == task_id:
                dl = _deadline_of(req)  # a retry of the running task keeps its deadline
            elif self.spillway_max_age is not None:
                dl = time.time() + float(self.spillway_max_age)
            if dl is not None:
                headers[DEADLINE_HEADER] = dl
                options["headers"] = headers
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

    # -- running ------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        req = self.request
        job = Job(attempt=(req.retries or 0) + 1, deadline=_deadline_of(req))
        job_of = inspect.getattr_static(self, "spillway_job", None)  # a plain function, not a method
        if isinstance(job_of, (staticmethod, classmethod)):
            job_of = job_of.__get__(None, type(self))
        if job_of is not None:
            job.key, job.version = job_of(args, kwargs)
        # At max_retries a failure is the task's last: no budget is asked.
        job.final = self.max_retries is not None and (req.retries or 0) >= self.max_retries

        def body():
            req._spillway_in_body = True  # self.retry raises _BodyRetry
            try:
                return self.run(*args, **kwargs)
            finally:
                req._spillway_in_body = False

        try:
            return self.guard.call(body, job)
        except E.SpillwayError as e:
            return self.on_spillway_decision(e, job, args, kwargs)

    def retry(self, args=None, kwargs=None, exc=None, throw=True, eta=None, countdown=None,
              max_retries=None, **options):
        """Celery's Task.retry; called from the body (directly or through
        autoretry_for) it raises the body's retry to the guard instead of
        sending it, so that the guard charges it to the fleet's budget and
        the task sends one message (see the module)."""
        req = self.request
        if not getattr(req, "_spillway_in_body", False) or req.called_directly or not throw:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        limit = self.max_retries if max_retries is None else max_retries
        if limit is not None and (req.retries or 0) + 1 > limit:
            # Past max_retries Celery raises exc (or MaxRetriesExceededError)
            # and sends nothing: the guard counts it, the task fails.
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        after = None
        if countdown is not None:
            after = float(countdown)
        elif eta is not None:
            after = max(0.0, (eta - _now_like(eta)).total_seconds())
        if exc is None:
            exc = sys.exc_info()[1]
        opts = dict(options, args=args, kwargs=kwargs, max_retries=max_retries)
        raise _BodyRetry(exc if isinstance(exc, BaseException) else None, after, opts)

    def on_spillway_decision(self, e: E.SpillwayError, job: Job, args, kwargs):
        """Act on the guard's decision; raises Retry or Ignore."""
        req = self.request
        action, after = E.decide(e)
        headers = {}
        if job.deadline is not None:
            headers[DEADLINE_HEADER] = job.deadline
        if action == E.DROP:
            log.warning("Dropped task %s[%s]: %s", self.name, req.id, e.reason)
            try:
                self.update_state(state=DROPPED, meta={"reason": type(e).__name__.lower(), "attempt": job.attempt})
            except Exception:  # no result backend: the log line and the metric remain
                pass
            raise Ignore()
        if action == E.DEFER:
            log.info("Deferred task %s[%s] by %.3fs, attempt %d kept: %s",
                     self.name, req.id, after, job.attempt, e.reason)
            return self._defer(e, after, args, kwargs, headers)
        # RETRY or PARK: the call was made and failed; it counts as an attempt.
        log.info("%s task %s[%s] in %.3fs after attempt %d: %s", "Retrying" if action == E.RETRY else "Parking",
                 self.name, req.id, after, job.attempt, e.reason)
        cause = e.cause if isinstance(e.cause, Exception) else e
        opts = {}
        if isinstance(cause, _BodyRetry):  # the body's own retry, with its options
            opts = dict(cause.options)
            headers = dict(opts.pop("headers", None) or {}, **headers)
            cause = cause.cause if isinstance(cause.cause, Exception) else None
        raise celery.Task.retry(self, exc=cause, countdown=after, headers=headers, **opts)

    def _defer(self, e, after, args, kwargs, headers):
        """Send the task again after `after` seconds with the same retry count:
        Task.retry without the +1 and without max_retries."""
        req = self.request
        if req.called_directly or req.is_eager:
            # Run in the caller's thread (task(), apply, task_always_eager),
            # where Celery would re-run a retry at once: the caller gets the
            # refusal instead of a spin.
            raise e
        sig = self.signature_from_request(req, args, kwargs, countdown=after,
                                          retries=req.retries or 0, headers=headers)
        sig.apply_async()
        raise Retry(exc=e, when=after, sig=sig)


def _now_like(eta: datetime.datetime) -> datetime.datetime:
    """Now, naive or aware as the eta is (Celery accepts both)."""
    if eta.tzinfo is None:
        return datetime.datetime.now()
    return datetime.datetime.now(datetime.timezone.utc)


def _deadline_of(req) -> Optional[float]:
    v = getattr(req, DEADLINE_HEADER, None)
    if v is None and isinstance(getattr(req, "headers", None), dict):
        v = req.headers.get(DEADLINE_HEADER)
    return float(v) if v is not None else None
