"""The worker side of Spillway for Python: every protection the fleet puts on
calls to one dependency, enforced through Redis at each call (protocol v6),
with the failure-mode rules of the Go guard (pkg/guard):

- every acquisition carries a deadline in Redis time, from an estimate of
  Redis's clock, past which Redis refuses it and writes nothing;
- an acquisition (or a release) whose reply was not read is handed to a
  background forgetter that makes its lease stop counting (no ghost leases);
- a call cut short by its caller (KeyboardInterrupt, SystemExit, a raised
  Cancelled, a lost lease) is released with the outcome ``c``: it counts
  nothing against the dependency and is deferred, never retried as a failure;
- a long call's lease is renewed every third of its TTL by a background
  thread, which stops renewing it when the call ends, exceptions included;
- while calls run, the same thread puts back every HOLD_EVERY_S the leases
  Redis lost (hold.lua: after a failover or a restart without data Redis
  admits nothing new for a second while holders do);
- Redis unavailable fails closed unless fail_open_limit admits the call
  locally.

    guard = Guard(redis.Redis(socket_timeout=1), "mail/template-api")
    try:
        guard.call(lambda: render(template), Job(attempt=attempt, deadline=enqueued + 300))
    except SpillwayError as e:
        action, after = decide(e)   # defer / retry / park -> run again after `after` s; drop -> ack
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import logging
import queue
import random as _random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import redis

from . import errors as E
from . import metrics as M
from . import protocol as P
from . import retry as R
from .classify import default_classify

log = logging.getLogger("spillway")

_current: "contextvars.ContextVar[Optional[Permit]]" = contextvars.ContextVar("spillway_permit", default=None)


def current_permit() -> "Optional[Permit]":
    """The Permit of the call running in this context (inside Guard.call's
    function or a slot's with block), or None: a long call reads its
    permit.lost, or calls permit.raise_if_lost(), to stop once the fleet no
    longer counts it."""
    return _current.get()

# Redis clock estimate (pkg/guard/redisclock.go).
OFFSET_PERIOD = 30.0
DEADLINE_SLACK = 0.002
BOOTSTRAP_SKEW = 1.0

# Forgetter (pkg/guard/forget.go).
FORGET_QUEUE = 8192
FORGET_BACKOFF_MIN = 0.02
FORGET_BACKOFF_MAX = 0.5
FORGET_TIMEOUT_MIN = 0.25
# Spaces the successes whose release reports the call's duration (_time_due).
TIME_EVERY_S = 0.01


@dataclass
class Job:
    """One run of a job.

    attempt: 1 for the first call, 2 for the first retry; deferred runs keep
    their attempt number. deadline: Unix time (seconds) after which the job is
    dropped as stale; None for work that never expires. key and version, when
    key is set, drop the run if a newer version of key has run or been
    announced with Guard.supersede (versions are integers in [0, 2^53)).
    final: no retry follows a failure of this run (its framework's retry
    limit is reached): the failure is counted, the retry budget is not
    asked, and the call's own exception is raised as is."""

    attempt: int = 1
    deadline: Optional[float] = None
    key: str = ""
    version: int = 0
    final: bool = False


# What parsing a reply outside the protocol raises (protocol.py reads
# replies by position and converts them with int()).
# Names this process in the registry of worker processes (register.lua).
_PROCESS_ID = P.new_lease_id()

_BAD_REPLY = (P.ProtocolError, ValueError, TypeError, IndexError, KeyError, AttributeError, UnicodeDecodeError)


def _passes_through(exc: BaseException) -> bool:
    """A task framework's control flow, not a dependency's answer: Celery's
    Retry (a message already sent), Ignore and Reject. Looked up in
    sys.modules: a process that never imported Celery cannot raise them."""
    m = sys.modules.get("celery.exceptions")
    if m is None:
        return False
    types = tuple(t for t in (getattr(m, n, None) for n in ("Retry", "Ignore", "Reject")) if isinstance(t, type))
    return bool(types) and isinstance(exc, types)


class RedisClock:
    """Estimates Redis's time from the local monotonic clock (redisclock.go).

    Each reply gives a sample: Redis's time when the script ran minus the
    local time the request was sent; the script ran after the send, so every
    sample is at least the true offset and the smallest recent one is the
    closest. A deadline built from it is never earlier than the true one."""

    def __init__(self, wall=time.time):
        self._lock = threading.Lock()
        self._wall = wall
        self.known = False
        self.cur = self.prev = 0.0
        self.has_prev = False
        self.cur_start = 0.0

    def observe(self, sent: float, redis_now_ms: int) -> None:
        if not redis_now_ms:
            return
        s = redis_now_ms / 1000.0 - sent
        with self._lock:
            if not self.known:
                self.known, self.cur, self.has_prev, self.cur_start = True, s, False, sent
            elif sent - self.cur_start >= OFFSET_PERIOD:
                self.prev, self.has_prev = self.cur, True
                self.cur, self.cur_start = s, sent
            else:
                self.cur = min(self.cur, s)

    def reset(self, sent: float, redis_now_ms: int) -> None:
        """A reply that came in time was refused as late: Redis's clock moved."""
        with self._lock:
            self.known = False
        self.observe(sent, redis_now_ms)

    def deadline(self, sent: float, wait: float):
        """(deadline in Unix ms of Redis time, seconds after sent it lies)."""
        with self._lock:
            if not self.known:
                late = wait + BOOTSTRAP_SKEW
                return int((self._wall() + late) * 1000), late
            off = min(self.cur, self.prev) if self.has_prev else self.cur
        return int((off + sent + wait + DEADLINE_SLACK) * 1000), wait + DEADLINE_SLACK


class _Forgetter:
    """Makes unread leases stop counting, in one background thread per guard,
    started by the first lease it is handed; retries with a capped backoff
    while Redis does not answer and gives a lease up once it has expired by
    itself. It never blocks a caller: when its queue is full the lease is left
    to expire."""

    def __init__(self, proto: P.Client, timeout: float, metrics: M.Metrics):
        self.proto, self.timeout, self.metrics = proto, max(timeout, FORGET_TIMEOUT_MIN), metrics
        self.queue: "queue.Queue" = queue.Queue(FORGET_QUEUE)
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.lock = threading.Lock()
        self.closed = False
        self.forgotten = 0  # for tests

    def add(self, member: str, expires: float) -> None:
        with self.lock:
            if self.closed:
                self.metrics.unread("dropped")
                return
            if self.thread is None or not self.thread.is_alive():  # also after a fork
                self.thread = threading.Thread(target=self._run, name="spillway-forget", daemon=True)
                self.thread.start()
        try:
            self.queue.put_nowait((member, expires))
            self.metrics.unread("queued")
        except queue.Full:
            self.metrics.unread("dropped")

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.stop.set()
            t = self.thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(2 * self.timeout + 1.0)  # bounded: a close never hangs

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                member, expires = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if not self._forget(member, expires):
                return

    def _forget(self, member: str, expires: float) -> bool:
        pause = FORGET_BACKOFF_MIN
        while True:
            if time.monotonic() >= expires:
                self.metrics.unread("expired")
                return True
            try:
                self.proto.forget(member, timeout=self.timeout)
                self.metrics.unread("forgotten")
                self.forgotten += 1
                return True
            except Exception:  # Redis away: try again, sooner than the lease expires
                self.metrics.redis_errors.inc()
            if self.stop.wait(pause):
                return False
            pause = min(2 * pause, FORGET_BACKOFF_MAX)


class _Renewer:
    """Renews the leases of the guard's running calls, and holds them while
    Redis learns: one background thread that sleeps until the next renewal
    or hold is due. A Permit is scheduled when it is admitted and
    unscheduled when it is done, so a call's renewals stop when it ends,
    whatever it raised. While a call is scheduled, hold(permits) runs every
    hold_every seconds with the scheduled permits (docs/protocol.md §4
    "Learning": the leases Redis lost are put back within a fraction of
    the second it admits nothing new), hold_retry seconds after one that
    failed (hold returned False); it stops once none is. The thread
    itself exits once no call has been scheduled for idle seconds."""

    def __init__(self, idle: float = 5.0, hold: Optional[Callable[[list], Optional[bool]]] = None,
                 hold_every: float = P.HOLD_EVERY_S, hold_retry: float = P.HOLD_RETRY_EVERY_S):
        self.cond = threading.Condition()
        self.heap = []
        self.seq = itertools.count()
        self.thread: Optional[threading.Thread] = None
        self.idle = idle
        self.closed = False
        self.hold, self.hold_every, self.hold_retry = hold, hold_every, hold_retry
        self.hold_at: Optional[float] = None  # the next hold, while calls are scheduled

    def schedule(self, when: float, permit: "Permit") -> None:
        with self.cond:
            if self.closed:
                return
            # Wake the thread only when this renewal comes before every
            # other: calls admitted one after another all renew later than
            # the first, so the call path rarely switches threads.
            wake = not self.heap or when < self.heap[0][0]
            heapq.heappush(self.heap, (when, next(self.seq), permit))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="spillway-renew", daemon=True)
                self.thread.start()
            elif wake:
                self.cond.notify()

    def running(self) -> bool:
        with self.cond:
            return self.thread is not None and self.thread.is_alive()

    def scheduled(self) -> int:
        with self.cond:
            return sum(1 for _, _, p in self.heap if not p._done)

    def close(self) -> None:
        """Stop renewing: the running calls' leases will expire, so their
        permits are marked lost now, and their calls can stop."""
        with self.cond:
            self.closed = True
            running = [p for _, _, p in self.heap]
            self.heap.clear()
            self.cond.notify()
            t = self.thread
        for p in running:
            p._close()
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(5.0)  # bounded: a close never hangs on a renewer an interrupt left asleep

    def _run(self) -> None:
        idle_since = None
        while True:
            held = None
            with self.cond:
                while self.heap and self.heap[0][2]._done:
                    heapq.heappop(self.heap)  # done: never renewed again
                if self.closed:
                    self.thread = None
                    return
                now = time.monotonic()
                if not self.heap:
                    self.hold_at = None  # no lease held: nothing to hold
                    if idle_since is None:
                        idle_since = now
                    if now - idle_since >= self.idle:
                        self.thread = None
                        return
                    self.cond.wait(self.idle - (now - idle_since))
                    continue
                idle_since = None
                if self.hold_at is None:
                    self.hold_at = now + self.hold_every
                when, _, permit = self.heap[0]
                if self.hold is not None and self.hold_at <= when:
                    if self.hold_at > now:
                        self.cond.wait(self.hold_at - now)
                        continue
                    self.hold_at = now + self.hold_every
                    held = [p for _, _, p in self.heap if not p._done]
                elif when > now:
                    self.cond.wait(when - now)
                    continue
                else:
                    heapq.heappop(self.heap)
            if held is not None:
                if self.hold(held) is False:  # outside the lock: one round trip
                    with self.cond:  # failed: again soon, not a whole hold_every later
                        if self.hold_at is not None:
                            self.hold_at = min(self.hold_at, time.monotonic() + self.hold_retry)
                continue
            nxt = permit._renew()  # outside the lock: one round trip
            if nxt is not None:
                self.schedule(time.monotonic() + nxt, permit)


class Permit:
    """One admitted call; a context manager. Call done() exactly once with
    the call's exception (None on success), or use it in a with block.

    lost is an Event set when the lease expired before it could be renewed,
    when max_call_lifetime ended its renewals, or when the guard was closed:
    the fleet no longer counts the call, and a long call should check it (or
    call raise_if_lost()) and stop; it is released as cancelled however it
    ends. The call gets its permit with guard.call(fn, job,
    pass_permit=True), from current_permit(), or as the with block's
    target. While a call whose lease is lost still runs, its guard admits no
    new call: the process never runs more calls than the leases it holds."""

    def __init__(self, guard: "Guard", job: Job, adm: Optional[P.Admission], sent: float, local: bool = False):
        self._g = guard
        self.job = job
        self.local = local
        self.member = adm.member if adm else ""
        self.epoch = adm.epoch if adm else 0
        self.limit = adm.limit if adm else 0
        self.state = adm.state if adm else ""
        self._probe_epoch = self.epoch if (adm and adm.state == P.HALF_OPEN) else 0
        self.lost = threading.Event()
        self.lifetime_exceeded = False
        self._lock = threading.Lock()
        self._done = False
        self._token = None
        self._settled = False  # released, or handed to the forgetter
        self._sent = sent
        self._expires = sent + guard.lease_ttl
        self._end_of_life = sent + guard.max_call_lifetime
        self._admitted = time.monotonic()  # release reports the time since as the call's duration

    def _start(self) -> None:
        """Count the call in flight and schedule its renewals (Guard._admitted)."""
        if self.local:
            return
        self._g._track(self._g._running, self)
        self._g._renewer.schedule(min(self._sent + self._g.lease_ttl / 3, self._end_of_life), self)

    @property
    def attempt(self) -> int:
        return max(self.job.attempt, 1)

    # -- renewal (renewer thread) ----------------------------------------

    def _renew(self) -> Optional[float]:
        """One renewal; the delay to the next, or None to stop."""
        g = self._g
        with self._lock:
            if self._done or self.lost.is_set():
                return None  # a lost lease is not renewed (hold may have found it lost)
            now = time.monotonic()
            if now >= self._end_of_life:
                self.lifetime_exceeded = True
                self._mark_lost()
                return None
            if now >= self._expires:
                self._lose()
                return None
            sent = time.monotonic()
            try:
                held = g.proto.renew(self.member, g._ttl_ms, timeout=g.redis_timeout)
            except Exception:
                g.metrics.redis_errors.inc()
                return self._next(min(g.lease_ttl / 6, max(self._expires - time.monotonic(), 0)))
            if not held:
                self._lose()
                return None
            self._expires = sent + g.lease_ttl
            g.renewals += 1
            return self._next(g.lease_ttl / 3)

    def _next(self, d: float) -> float:
        return max(min(d, self._end_of_life - time.monotonic()), 0)

    def _lose(self) -> None:
        self._g.metrics.lease_lost.inc()
        self._mark_lost()

    def _mark_lost(self) -> None:
        """The call runs on without a lease the fleet counts. self._lock held."""
        if not self._done:
            self._g._track(self._g._lost, self)
        self.lost.set()

    def _close(self) -> None:
        with self._lock:
            self._mark_lost()

    def raise_if_lost(self) -> None:
        """Raise LeaseLost if the fleet no longer counts this call (see lost):
        the call is released as cancelled and the job deferred."""
        if self.lost.is_set():
            raise E.LeaseLost(self._g._jitter_up(self._g.defer_delay))

    def _finish(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
        self._g._untrack(self)
        return True

    # -- the end of the call ---------------------------------------------

    def __enter__(self) -> "Permit":
        self._token = _current.set(self)
        return self

    def __exit__(self, et, exc, tb) -> bool:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self._done:
            return False  # the block called done() itself
        try:
            if exc is None:
                self.done(None)
            elif isinstance(exc, Exception):
                self.done(exc)  # raises the guard's decision, from exc
        finally:
            self.abandon()  # KeyboardInterrupt, SystemExit: re-raised as is; else nothing once done
        return False

    def abandon(self) -> None:
        """Release the slot of a call that ended without done() (interrupted),
        counting nothing against the dependency. Nothing after done()."""
        try:
            if self._finish():
                self._release_once(lambda: P.CANCELLED)
        finally:
            if self._done:
                self._settle_if_interrupted()

    def done(self, exc: Optional[BaseException] = None) -> None:
        """Release the slot and report the outcome in one round trip, then
        decide: return on success, on a task framework's control flow
        (Celery's Retry, Ignore, Reject: released as cancelled, the caller
        raises it on) and on the failure of a final job (counted; the caller
        raises it on); raise the wrapped error of a Permanent;
        raise Cancelled or LeaseLost (DEFER) for a call cut short by its
        caller or a lost lease (released as cancelled: no budget spent); or
        raise CallFailed (RETRY, after a jittered backoff, no earlier than a
        RetryAfter) or BudgetExhausted (PARK) from exc."""
        try:
            return self._end(exc)
        finally:
            self._settle_if_interrupted()

    def _settle_if_interrupted(self) -> None:
        """A Permit whose release never ran (an interrupt landed before it)
        is released now, as cancelled."""
        if not self._settled:
            self._finish()
            self._release_once(lambda: P.CANCELLED)

    def _end(self, exc: Optional[BaseException]) -> None:
        if not self._finish():
            raise RuntimeError("permit is already done")
        g = self._g
        outcome = self._release_once(lambda: self._outcome(exc))
        if outcome not in P.OUTCOMES:
            raise ValueError(f"classify returned the unknown outcome {outcome!r} (want s, f, t or c): the call counted nothing") from exc
        if exc is None:
            return None  # done, even if the lease was lost meanwhile
        if _passes_through(exc) and not isinstance(exc, E.RetryRequest):
            return None
        if isinstance(exc, E.Permanent):
            raise (exc.error if exc.error is not None else exc)
        if outcome == P.CANCELLED:
            cls = E.LeaseLost if (self.lost.is_set() and not self.lifetime_exceeded) else E.Cancelled
            if isinstance(exc, E.Cancelled) and exc.after > 0:
                after = exc.after
            else:
                after = g._jitter_up(g.defer_delay)
            raise cls(after, cause=exc) from exc
        if self.job.final and not isinstance(exc, E.RetryRequest):
            return None  # no retry follows: the budget is not asked
        g._decide_retry(self.job, exc)

    def _outcome(self, exc: Optional[BaseException]) -> str:
        if self.lost.is_set() and not self.lifetime_exceeded:
            # Ended after the fleet stopped counting it: counted nowhere,
            # whatever it returned (a success is still returned).
            return P.CANCELLED
        if exc is None or isinstance(exc, E.Permanent):
            return P.SUCCESS
        if isinstance(exc, E.Cancelled):
            return P.CANCELLED
        if isinstance(exc, E.RetryRequest):
            if self.lifetime_exceeded:
                return P.TIMEOUT
            return self._g.classify(exc.cause) if isinstance(exc.cause, Exception) else P.FAILURE
        if _passes_through(exc):
            return P.CANCELLED
        if self.lifetime_exceeded:
            return P.TIMEOUT
        if self.lost.is_set():
            return P.CANCELLED
        return self._g.classify(exc)

    def _release_once(self, outcome_of: Callable[[], str]) -> str:
        """Release with the outcome outcome_of() gives (cancelled if it
        raises or is unknown) and return it. Whatever interrupts this
        (KeyboardInterrupt, a Celery soft time limit) before the release ran,
        the lease is handed to the forgetter: nothing leaks."""
        try:
            try:
                outcome = outcome_of()
            except BaseException:
                self._release(P.CANCELLED)  # a classify that raised counts nothing
                raise
            self._release(outcome if outcome in P.OUTCOMES else P.CANCELLED)
            return outcome
        except BaseException:
            if not self._settled and not self.local:
                self._settled = True
                self._g._forget.add(self.member, time.monotonic() + self._g.lease_ttl)
            raise

    def _release(self, outcome: str) -> None:
        """One release round trip; _settled is set once the lease is
        released or handed to the forgetter."""
        g = self._g
        if self._settled:
            return
        if self.local:
            g._local.release()
            self._settled = True
            g.metrics.call(outcome, self.attempt)
            return
        try:
            now = time.monotonic()
            took = now - self._admitted if outcome == "s" and g._time_due(now) else None
            g.proto.release(self.member, outcome, self.attempt, self._probe_epoch, timeout=g.redis_timeout,
                            took=took)
            self._settled = True
        except BaseException as e:
            # It may not have run: the lease lasts at most a TTL from now.
            g._forget.add(self.member, time.monotonic() + g.lease_ttl)
            self._settled = True
            if not isinstance(e, Exception):
                raise  # an interrupt goes on, its lease forgotten
            g.metrics.redis_errors.inc()
        g.metrics.call(outcome, self.attempt)


class Guard:
    """Enforces one dependency's fleet-wide limits; safe for use from many
    threads. Create one per dependency and process, and share it.

    redis_client must be a redis.Redis (or a Sentinel master client) with
    socket_timeout or socket_connect_timeout set, so that connecting is
    bounded; each round trip is bounded by redis_timeout on its own.
    Durations are seconds; see pkg/guard.Options for each one's reasoning:
    lease_ttl (30), redis_timeout (0.25), max_call_lifetime (600),
    wait_for_slot (False) and max_wait (0 = unbounded), fail_open_limit (0:
    fail closed), job_ttl (86400), defer_delay (1), throttle_delay (0.2),
    classify (exception -> 's'|'f'|'t'|'c'), registry (prometheus_client's
    default registry when installed; None for no metrics), rand (a
    random.Random), allow_eviction (False: refuse a Redis whose
    maxmemory-policy evicts keys, as pkg/guard's Options.AllowEviction; True
    starts anyway and sets the spillway_worker_redis_evicting gauge)."""

    def __init__(self, redis_client, dependency: str, *, lease_ttl: float = 30.0,
                 redis_timeout: float = 0.25, max_call_lifetime: float = 600.0,
                 wait_for_slot: bool = False, max_wait: float = 0.0, fail_open_limit: int = 0,
                 job_ttl: float = 86400.0, defer_delay: float = 1.0, throttle_delay: float = 0.2,
                 classify: Optional[Callable[[BaseException], str]] = None,
                 registry=M.DEFAULT, rand=None, now: Callable[[], float] = time.time,
                 allow_eviction: bool = False):
        if redis_client is None:
            raise ValueError("redis client must not be None")
        for name, v in (("lease_ttl", lease_ttl), ("redis_timeout", redis_timeout),
                        ("max_call_lifetime", max_call_lifetime), ("max_wait", max_wait),
                        ("job_ttl", job_ttl), ("defer_delay", defer_delay), ("throttle_delay", throttle_delay)):
            if v < 0:
                raise ValueError(f"{name} must not be negative, got {v}")
        if lease_ttl < 0.01:
            raise ValueError(f"lease_ttl must be at least 10ms, got {lease_ttl}")
        if redis_timeout <= 0:
            raise ValueError(f"redis_timeout must be positive, got {redis_timeout}")
        if fail_open_limit < 0:
            raise ValueError(f"fail_open_limit must not be negative, got {fail_open_limit}")
        _check_client(redis_client)
        self.proto = P.Client(_bounded(redis_client, redis_timeout), dependency)
        self.dependency = str(self.proto.dep)
        self.lease_ttl = lease_ttl
        self._ttl_ms = max(int(lease_ttl * 1000), 1)
        self.redis_timeout = redis_timeout
        self._register_at = 0.0
        self._timed_at = 0.0
        self._timed_lock = threading.Lock()
        self._register_lock = threading.Lock()
        self.max_call_lifetime = max_call_lifetime
        self.wait_for_slot = wait_for_slot
        self.max_wait = max_wait
        self.job_ttl = job_ttl
        self.defer_delay = defer_delay
        self.throttle_delay = throttle_delay
        self.classify = classify or default_classify
        self.rnd = rand or _random.Random()
        self._rnd_lock = threading.Lock()
        self.now = now
        self.metrics = M.Metrics(self.dependency, registry)
        _check_eviction(self.proto.rdb, self.dependency, allow_eviction, self.metrics)
        self.clock = RedisClock()
        self._forget = _Forgetter(self.proto, redis_timeout, self.metrics)
        self._renewer = _Renewer(hold=self._hold)
        self._local = threading.BoundedSemaphore(fail_open_limit) if fail_open_limit > 0 else None
        self._backoff_lock = threading.Lock()
        self.last_backoff = R.FALLBACK
        self._flight_lock = threading.Lock()
        # Calls admitted through Redis and not yet done, and those of them
        # whose lease the fleet no longer counts. A Permit done is dropped
        # from both when read, so an interrupt cannot leave one behind.
        self._running = set()
        self._lost = set()
        self._handoff = threading.local()
        self.renewals = 0  # successful lease renewals, for tests
        # The answer of the last hold (learning), None before the first.
        self.last_held: Optional[P.Held] = None

    def close(self) -> None:
        """Stop the background threads (forgetter, renewer). Leases not yet
        forgotten expire with their TTL, and so do the leases of calls still
        running (no more renewals): their permits are marked lost, so that
        those calls can stop, and they are released as cancelled. Close the
        guard once its calls have ended. Safe to call more than once."""
        self._forget.close()
        self._renewer.close()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    # -- the call path ----------------------------------------------------

    def _track(self, permits: set, p: "Permit") -> None:
        with self._flight_lock:
            permits.add(p)

    def _untrack(self, p: "Permit") -> None:
        with self._flight_lock:
            self._running.discard(p)
            self._lost.discard(p)

    def _hold(self, permits: list) -> bool:
        """Put back the leases of running calls that Redis lost (renewer
        thread, every HOLD_EVERY_S while a call is scheduled): hold.lua with
        every lease whose ttl has not passed by this process's clock and
        that the fleet still counts (a lost one is not claimed back). Outside
        learning, with a state, it writes nothing and names the leases the
        fleet no longer counts: their calls are cut now, not at their next
        renewal. False when it failed: the renewer tries again after
        HOLD_RETRY_EVERY_S."""
        now = time.monotonic()
        live = [p for p in permits if not p.lost.is_set() and p._expires > now]
        members = [p.member for p in live]
        if not members:
            return True
        try:
            held = self.proto.hold(members, self._ttl_ms, timeout=self.redis_timeout)
        except Exception:
            self.metrics.redis_errors.inc()
            return False
        self.last_held = held
        if held.lost:
            # Back after the learning second: another call may hold these
            # slots. Stop the calls now, not at their next renewal.
            lost = set(held.lost)
            for p in live:
                if p.member in lost:
                    with p._lock:
                        if not p._done and not p.lost.is_set():
                            p._lose()
        if held.put_back:
            log.info("Put back %d leases of running calls that Redis lost for %s (%s)", held.put_back,
                     self.dependency, "no state stored" if held.no_state else f"learning for {held.learning_ms} ms")
        return True

    def _count_flight(self):
        with self._flight_lock:
            for permits in (self._running, self._lost):
                for p in [p for p in permits if p._done]:
                    permits.discard(p)
            return len(self._running), len(self._lost)

    @property
    def in_flight(self) -> int:
        """Calls admitted through Redis (not fail-open) that have not ended."""
        return self._count_flight()[0]

    @property
    def lost_in_flight(self) -> int:
        """Of those, calls whose lease the fleet no longer counts (Permit.lost)."""
        return self._count_flight()[1]

    def call(self, fn: Callable[..., object], job: Optional[Job] = None, *, pass_permit: bool = False):
        """Run fn() once under the fleet's protections and return its result,
        or raise: a SpillwayError saying what to do with the job (see
        decide()), or a Permanent's wrapped error. An interrupt
        (KeyboardInterrupt, SystemExit) releases the slot, counting nothing,
        and goes on to the caller, and so do Celery's Retry, Ignore and
        Reject; a failure of a final job is counted and raised as is.

        fn gets the Permit as its argument with pass_permit=True, and
        current_permit() returns it while fn runs: a long call watches
        permit.lost (see Permit)."""
        if fn is None:
            raise ValueError("function must not be None")
        permit = None
        self._handoff.permit = None
        outer = _current.get()
        try:
            permit = self.acquire(job)  # inside the try: an interrupt after it leaks nothing
            self._handoff.permit = None
            _current.set(permit)
            result = fn(permit) if pass_permit else fn()
            _current.set(outer)
        except BaseException as exc:
            _current.set(outer)  # set, not reset: an interrupt may have come before a token
            if permit is None:
                # Refused, or interrupted (an interrupt, or a Celery soft
                # time limit, which is an Exception) as acquire returned.
                permit, self._handoff.permit = getattr(self._handoff, "permit", None), None
                if permit is not None:
                    permit.abandon()
                raise
            if isinstance(exc, Exception):
                try:
                    permit.done(exc)  # raises the decision, or returns: raise exc on
                finally:
                    permit.abandon()  # nothing once done; an interrupt on the way in
                raise
            permit.abandon()
            raise
        try:
            permit.done(None)
        finally:
            permit.abandon()  # nothing once done; an interrupt on the way in
        return result

    def slot(self, job: Optional[Job] = None) -> Permit:
        """A fleet slot as a context manager: ``with guard.slot(job) as p:``."""
        return self.acquire(job)

    def supersede(self, key: str, version: int) -> None:
        """Announce that version of the job key exists (call it when the newer
        job is enqueued), so queued older versions are dropped unrun."""
        if not key:
            raise ValueError("job key must not be empty")
        if not 0 <= version <= P.MAX_JOB_VERSION:
            raise ValueError(f"job version must be in [0, 2^53), got {version}")
        try:
            self.proto.supersede(key, version, int(self.job_ttl * 1000), timeout=self.redis_timeout)
        except (P.RedisUnsent, P.RedisUnread):
            self.metrics.redis_errors.inc()
            raise
        except _BAD_REPLY as e:
            raise self._bad_reply(e) from e

    def acquire(self, job: Optional[Job] = None) -> Permit:
        """Admit one call (a Permit: call done() once, or use it in a with
        block) or raise the refusal."""
        job = job or Job()
        if job.attempt < 0:
            raise ValueError(f"job attempt must not be negative, got {job.attempt}")
        if job.deadline is not None and self.now() >= job.deadline:
            self.metrics.stale.inc()
            raise E.Stale()
        if job.key and not 0 <= job.version <= P.MAX_JOB_VERSION:
            raise ValueError(f"job version must be in [0, 2^53), got {job.version}")
        start = time.monotonic()
        self._maybe_register(start)
        stop_waiting = start + self.max_wait if self.max_wait > 0 else None
        pause = 0.0
        while True:
            refusal = self._over_leases()
            if refusal is None:
                try:
                    permit, refusal = self._acquire_once(job, start)
                except (P.NoPolicyError, P.VersionError) as e:
                    cls = E.OtherVersion if isinstance(e, P.VersionError) else E.NoPolicy
                    refusal = cls(self._jitter_up(self.defer_delay), cause=e)
                    self._count(refusal)
                    raise refusal from e
                except (P.RedisUnsent, P.RedisUnread, redis.RedisError) as e:
                    return self._unavailable(job, e)
                except _BAD_REPLY as e:
                    raise self._bad_reply(e) from e
                if permit is not None:
                    return permit
            if not self.wait_for_slot or refusal.action != E.DEFER or isinstance(refusal, E.BreakerOpen):
                self._count(refusal)
                raise refusal
            # Wait without hot polling: capped exponential steps with full
            # jitter, never past the hint the server gave.
            pause = min(max(2 * pause, 0.005), 0.25)
            sleep = self._rand() * pause
            if 0 < refusal.after < sleep:
                sleep = refusal.after
            if stop_waiting is not None and time.monotonic() + sleep >= stop_waiting:
                self._count(refusal)
                raise refusal
            time.sleep(sleep)

    def _admitted(self, job: Job, adm: P.Admission, sent: float, start: float) -> Permit:
        """The Permit of an admitted call. An interrupt (KeyboardInterrupt, a
        Celery SoftTimeLimitExceeded) before the caller holds it releases
        the lease (or hands it to the forgetter), so nothing leaks."""
        permit = None
        try:
            permit = Permit(self, job, adm, sent)
            permit._start()
            self.metrics.slot_wait.observe(time.monotonic() - start)
            self._handoff.permit = permit  # for call(), should an interrupt drop the return value
            return permit
        except BaseException:
            if permit is not None:
                permit.abandon()
            raise

    def _time_due(self, now: float) -> bool:
        """Whether a success ending at now (time.monotonic()) reports its
        duration: at most one every TIME_EVERY_S per guard. The window's mean
        success latency (the controller's rate bound) needs a sample, not
        every call, and timing costs Redis two counters a release; below 100
        successes a second every one is timed. As the Go and Node guards do."""
        with self._timed_lock:
            if now < self._timed_at:
                return False
            self._timed_at = now + TIME_EVERY_S
            return True

    def _maybe_register(self, now: float) -> None:
        """Register this process's client and protocol version
        (docs/protocol.md §4 register) at its first acquisition and every
        REGISTER_EVERY_S after, so that the manager and `spillway status` see
        which versions the fleet speaks. One round trip every 15 s at most;
        a failure is tried again a second later and never fails the call."""
        if now < self._register_at:
            return
        with self._register_lock:
            if now < self._register_at:
                return
            self._register_at = now + 1.0
        try:
            self.proto.register("python", _PROCESS_ID, timeout=self.redis_timeout)
            self._register_at = now + P.REGISTER_EVERY_S
        except (redis.RedisError, P.RedisUnsent, P.RedisUnread):
            pass

    def _bad_reply(self, err: BaseException) -> E.BadReply:
        """A reply outside the protocol: fail closed, as for Redis unavailable."""
        self.metrics.redis_errors.inc()
        refusal = E.BadReply(self._jitter_up(self.defer_delay), cause=err)
        self._count(refusal)
        return refusal

    def _over_leases(self) -> Optional[E.SpillwayError]:
        """Throttled while a call whose lease is lost still runs: the process
        then runs more calls than the leases it holds, and a new lease
        would let the fleet run one call more than its limit."""
        running, lost = self._count_flight()
        if lost <= 0:
            return None
        d = self.throttle_delay
        return E.Throttled(d / 2 + self._rand() * d / 2,
                           detail=f"{lost} of this process's {running} calls run on after their lease was lost")

    def _acquire_once(self, job: Job, start: float):
        """Ask Redis for a slot under a fresh lease id, with the Redis time
        after which the reply would no longer be read: (Permit, None) or
        (None, refusal). A reply not read (a timeout, a broken connection)
        and anything that interrupts the admission before the caller holds
        its Permit (KeyboardInterrupt, a Celery soft time limit) hand the
        lease to the forgetter; a reply that came in time but was refused as
        late means Redis's clock moved: the estimate restarts and the
        request is made once more."""
        for retried in (False, True):
            lease = P.new_lease_id()  # never reuse an id that may be forgotten
            sent = time.monotonic()
            deadline_ms, late = self.clock.deadline(sent, self.redis_timeout)
            try:
                adm = self.proto.acquire(lease, self._ttl_ms, deadline_ms, job.key, job.version,
                                         int(self.job_ttl * 1000), timeout=self.redis_timeout)
                if adm.code == P.REFUSED_LATE:
                    self.clock.reset(sent, adm.now_ms)
                    if not retried:
                        continue
                else:
                    self.clock.observe(sent, adm.now_ms)
                refusal = self._refusal(adm)
                if refusal is not None:
                    return None, refusal
                return self._admitted(job, adm, sent, start), None
            except (P.NoPolicyError, P.VersionError, P.RedisUnsent, redis.ResponseError):
                raise  # Redis answered, or never saw it: nothing written
            except BaseException:
                # If it ran, it ran by its deadline: its lease ends a TTL
                # later. (A Permit already made was released by _admitted.)
                self._forget.add(lease, sent + late + self.lease_ttl)
                raise

    def _refusal(self, adm: P.Admission) -> Optional[E.SpillwayError]:
        if adm.code == P.ADMITTED:
            return None
        if adm.code == P.REFUSED_OPEN:
            # Past open_until the breaker waits for the controller: never hint 0.
            return E.BreakerOpen(self._jitter_up(max(adm.wait_ms / 1000, self.throttle_delay)))
        if adm.code == P.REFUSED_THROTTLED:
            d = self.throttle_delay
            if adm.wait_ms > 0:
                d = min(adm.wait_ms / 1000, d)  # the first lease expires sooner
            return E.Throttled(d / 2 + self._rand() * d / 2, detail=f"{adm.held} held, limit {adm.limit}")
        if adm.code == P.REFUSED_RATE:
            return E.RateLimited(self._jitter_up(adm.wait_ms / 1000))
        if adm.code == P.REFUSED_SUPERSEDED:
            return E.Superseded(detail=f"newest version {adm.newest}")
        if adm.code == P.REFUSED_LATE:
            return E.RedisUnavailable(self._jitter_up(self.defer_delay),
                                      detail="redis refused the acquisition as late twice: its clock is not where the guard estimates it")
        return E.RedisUnavailable(self._jitter_up(self.defer_delay), detail=f"unknown admission code {adm.code}")

    def _count(self, e: E.SpillwayError) -> None:
        if isinstance(e, E.Superseded):
            self.metrics.superseded.inc()
            return
        for cls, reason in ((E.Throttled, "slots"), (E.RateLimited, "rate"), (E.BreakerOpen, "open"),
                            (E.RedisUnavailable, "redis_unavailable"), (E.OtherVersion, "version"),
                            (E.NoPolicy, "no_policy")):
            if isinstance(e, cls):
                self.metrics.throttled(reason)
                return

    def _unavailable(self, job: Job, err: BaseException) -> Permit:
        """Redis did not answer: fail closed, unless the local cap admits."""
        self.metrics.redis_errors.inc()
        if self._local is not None and self._local.acquire(blocking=False):
            self.metrics.fail_open.inc()
            return Permit(self, job, None, time.monotonic(), local=True)
        refusal = E.RedisUnavailable(self._jitter_up(self.defer_delay), cause=err)
        self._count(refusal)
        raise refusal from err

    def _decide_retry(self, job: Job, exc: BaseException) -> None:
        """Ask the fleet's retry budget whether a failed job may retry, and
        when; raise the answer from exc."""
        try:
            d = self.proto.budget(timeout=self.redis_timeout)
        except (P.NoPolicyError, P.VersionError) as e:
            # Redis answered: the policy is gone, or its state is of a
            # version this client does not act on. The job waits as a
            # refusal does, and says why; the call's own error comes with it.
            cls = E.OtherVersion if isinstance(e, P.VersionError) else E.NoPolicy
            refusal = cls(self._jitter_up(self.defer_delay), cause=e, detail=f"the call failed: {exc!r}")
            self._count(refusal)
            raise refusal from exc
        except Exception as e:
            # Without Redis the budget is unknown: park rather than pile on.
            self.metrics.redis_errors.inc()
            self.metrics.budget_refusals.inc()
            with self._backoff_lock:
                b = self.last_backoff
            raise E.BudgetExhausted(self._parked(b, exc), cause=exc,
                                    detail=f"the budget could not be read: {e!r}") from exc
        b = R.Backoff(d.backoff_base_ms / 1000, d.backoff_max_ms / 1000, d.jitter or R.FULL)
        if not b.valid():
            b = R.FALLBACK
        with self._backoff_lock:
            self.last_backoff = b
        if not d.allowed:
            self.metrics.budget_refusals.inc()
            raise E.BudgetExhausted(self._parked(b, exc), cause=exc) from exc
        self.metrics.retries.inc()
        after = self._draw(lambda r: b.delay(max(job.attempt, 1), r))
        if isinstance(exc, E.RetryRequest) and exc.after is not None:
            after = exc.after  # the caller's own delay, charged all the same
        server = exc.cause if isinstance(exc, E.RetryRequest) else exc
        if isinstance(server, E.RetryAfter):
            after = max(after, self._draw(lambda r: R.retry_after(server.after, r)))
        raise E.CallFailed(after, cause=exc) from exc

    def _parked(self, b: R.Backoff, exc: BaseException) -> float:
        """The parking delay, never sooner than a RetryRequest's own."""
        park = self._draw(lambda r: R.park(b, r))
        if isinstance(exc, E.RetryRequest) and exc.after is not None:
            park = max(park, exc.after)
        return park

    # -- randomness ------------------------------------------------------

    def _rand(self) -> float:
        with self._rnd_lock:
            return self.rnd.random()

    def _draw(self, f):
        with self._rnd_lock:
            return f(self.rnd)

    def _jitter_up(self, d: float) -> float:
        return self._draw(lambda r: R.retry_after(d, r))


def _bounded(rdb, timeout: float):
    """The client the guard talks through: for a plain redis.Redis, one with
    its own pool of the same settings (address, password, TLS, retry, ...)
    but whose connect and handshake (AUTH, SELECT, HELLO) are each bounded
    by redis_timeout, so that a refusal when Redis is down takes about
    redis_timeout, not the client's socket_connect_timeout or
    socket_timeout. Any other client (a Sentinel master client, a custom
    pool) is used as given."""
    pool = getattr(rdb, "connection_pool", None)
    if type(pool) is not redis.ConnectionPool or not isinstance(rdb, redis.Redis):
        return rdb
    kw = dict(pool.connection_kwargs)
    for name in ("socket_connect_timeout", "socket_timeout"):
        v = kw.get(name)
        kw[name] = timeout if v is None else min(v, timeout)
    bounded = redis.ConnectionPool(connection_class=pool.connection_class,
                                   max_connections=pool.max_connections, **kw)
    return redis.Redis(connection_pool=bounded)


def _check_eviction(rdb, dependency: str, allow: bool, metrics: M.Metrics) -> None:
    """Refuse a Redis that evicts keys: under memory pressure it may drop
    leases and the published state, and the fleet would then run more calls
    than its limit. INFO memory works where CONFIG is disabled. A Redis that
    does not answer is not waited for: calls fail closed until it does."""
    try:
        if isinstance(rdb, redis.RedisCluster):  # every master
            by_node = rdb.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
            infos = list(by_node.values()) if isinstance(by_node, dict) and "maxmemory_policy" not in by_node else [by_node]
        else:
            infos = [rdb.info("memory")]
    except (redis.RedisError,) + _BAD_REPLY:
        # Not answered, or answered outside the protocol (not Redis, a
        # proxy): checked no further, and every call then fails closed.
        return
    policies = [str(i.get("maxmemory_policy", "noeviction")) for i in infos if isinstance(i, dict)]
    policy = next((p for p in policies if p != "noeviction"), "noeviction")
    if policy == "noeviction":
        metrics.evicting.set(0)
        return
    if not allow:
        raise ValueError(
            f"redis has maxmemory-policy {policy}: it may evict Spillway's leases and state for {dependency} "
            "under memory pressure, and the fleet would then run more calls than its limit; set "
            "maxmemory-policy noeviction (or pass allow_eviction=True, and alert on spillway_worker_redis_evicting)")
    log.warning("Redis evicts keys (maxmemory-policy %s): the fleet's limits for %s no longer hold under memory pressure",
                policy, dependency)
    metrics.evicting.set(1)


def _check_client(rdb) -> None:
    """Refuse a client that could wait forever to connect: the guard bounds
    each round trip itself, but connecting is the pool's."""
    pool = getattr(rdb, "connection_pool", None)
    if pool is None:
        return
    kw = getattr(pool, "connection_kwargs", {}) or {}
    if kw.get("socket_timeout") is None and kw.get("socket_connect_timeout") is None:
        raise ValueError("redis client must set socket_timeout or socket_connect_timeout, "
                         "so that connecting to a Redis that does not answer is bounded")
