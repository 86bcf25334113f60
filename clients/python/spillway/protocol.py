"""Spillway's Redis protocol, version 6, for Python (docs/protocol.md).

The keys of one dependency and typed calls for the scripts a worker runs:
acquire, renew, hold, release, forget, budget, supersede and register (and publish and
window, the controller's, which the tests use). The scripts are the files of
pkg/protocol/lua, byte for byte (a copy in spillway/lua that
tests/test_lua_sync.py compares with the Go tree), composed as the Go client
composes them: lib.lua followed by the script, so both languages run the same
SHA1 on a server.

Every script runs with EVALSHA, and EVAL's text is loaded with SCRIPT LOAD on
a NOSCRIPT error (redis-py's Script does the same). A round trip runs on a
connection taken from the client's pool with its own socket timeout, so that
the guard bounds each round trip separately, and a failure says whether the
request may have reached Redis (RedisUnread) or certainly did not
(RedisUnsent): only the first can leave a lease behind.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import redis
from redis.exceptions import NoScriptError, ResponseError

VERSION = 6
# The state versions these scripts act on (docs/protocol.md §10): a worker
# at N acts on what a manager one version older (N - 2), its own (N - 1) and
# one version newer (N) write: a manager at 5 writes 4, one at 6 writes 5.
MIN_STATE_VERSION, MAX_STATE_VERSION = 4, 6
# "v4" names the key space that versions 4 to 6 share, not the version.
KEY_PREFIX = "spillway:v4:"
# How often a process registers its client and version (register.lua).
REGISTER_EVERY_S = 15.0
# How often a process that holds leases of its own (per-call permits) runs
# hold (protocol.HoldEvery in Go): a fraction of LEARN_FOR_S, so that the
# leases Redis lost are back before it admits anything new.
HOLD_EVERY_S = 0.25
# How soon a holder tries again after a hold that failed (holdRetryEvery in
# Go): the learning second counts from the first script on the new server,
# and a holder that waited a whole HOLD_EVERY_S after it could reach Redis
# again may miss it.
HOLD_RETRY_EVERY_S = 0.05
# How long a dependency learns once Redis lost leases (lib.lua learning):
# nothing new is admitted while holders put back what they hold.
LEARN_FOR_S = 1.0

# States the controller publishes.
CLOSED, OPEN, HALF_OPEN, RAMPING = "Closed", "Open", "HalfOpen", "Ramping"

# Outcomes reported on release.
SUCCESS, FAILURE, TIMEOUT, CANCELLED = "s", "f", "t", "c"
OUTCOMES = (SUCCESS, FAILURE, TIMEOUT, CANCELLED)

# Acquire reply codes.
ADMITTED, REFUSED_OPEN, REFUSED_THROTTLED, REFUSED_RATE = 0, 1, 2, 3
REFUSED_SUPERSEDED, NO_POLICY, OTHER_VERSION, REFUSED_LATE = 4, 5, 6, 7

MAX_JOB_VERSION = (1 << 53) - 1

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

LUA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lua")


class ProtocolError(Exception):
    """A reply the protocol does not allow, or an invalid argument."""


class NoPolicyError(Exception):
    """No policy is published for the dependency (acquire {5}, budget {-5})."""


class VersionError(Exception):
    """The state hash was published for a protocol version this client does
    not act on (acquire {6, ...}, budget {-6, ...}): state_version is the
    oldest version the publishing manager serves, manager_version that
    manager's own (-1 when unknown). The message names both and what to
    upgrade (docs/operations.md, Upgrading)."""

    def __init__(self, dep, state_version: int = -1, manager_version: int = -1):
        self.state_version, self.manager_version = state_version, manager_version
        manager = (f"a manager at protocol version {manager_version}" if manager_version > 0
                   else "a manager of an unknown protocol version")
        what = ("upgrade the Spillway manager" if 0 <= state_version < MIN_STATE_VERSION
                else "upgrade this worker's Spillway client")
        super().__init__(
            f"{dep}: the state was published by {manager} for workers at protocol version "
            f"{state_version} or later; this worker speaks version {VERSION}, which acts on "
            f"state versions {MIN_STATE_VERSION} to {MAX_STATE_VERSION}: {what} "
            f"(docs/operations.md, Upgrading)")


class RedisUnsent(Exception):
    """The request never left the client: nothing ran in Redis."""


class RedisUnread(Exception):
    """The request may have run in Redis, but its reply was not read."""


@dataclass(frozen=True)
class Dependency:
    namespace: str
    name: str

    @classmethod
    def parse(cls, s: str) -> "Dependency":
        ns, sep, name = s.partition("/")
        if not sep:
            raise ValueError(f"dependency {s!r} must be namespace/name")
        d = cls(ns, name)
        d.validate()
        return d

    def validate(self) -> None:
        if not (0 < len(self.namespace) <= 63 and _LABEL.match(self.namespace)):
            raise ValueError(
                f"dependency namespace {self.namespace!r} must be a DNS label "
                "(lower-case alphanumerics and '-', at most 63)")
        if not (0 < len(self.name) <= 253 and _SUBDOMAIN.match(self.name)):
            raise ValueError(
                f"dependency name {self.name!r} must be a DNS subdomain "
                "(lower-case alphanumerics, '-' and '.', at most 253)")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Keys:
    prefix: str

    @classmethod
    def of(cls, d: Dependency) -> "Keys":
        return cls(f"{KEY_PREFIX}{{{d.namespace}/{d.name}}}:")

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def leases(self) -> str:
        return self.prefix + "leases"

    @property
    def gcra(self) -> str:
        return self.prefix + "gcra"

    @property
    def stats(self) -> str:
        return self.prefix + "stats"

    @property
    def probes(self) -> str:
        return self.prefix + "probes"

    @property
    def pools(self) -> str:
        """Batching pools' records (request ids, replies, member counters)."""
        return self.prefix + "pools"

    @property
    def wants(self) -> str:
        """Live demand for slots: batching pools' wants and anonymous per-call refusals."""
        return self.prefix + "wants"

    @property
    def callers(self) -> str:
        """Per-call callers refused for want of a slot in the last second, by time (ms)."""
        return self.prefix + "callers"

    @property
    def clients(self) -> str:
        """The worker processes registered in the last 5 minutes (register.lua)."""
        return self.prefix + "clients"

    @property
    def calls(self) -> str:
        """Calls by protocol version (5 on) per 10 s bucket (lib.lua count_version)."""
        return self.prefix + "calls"

    @property
    def released(self) -> str:
        """Leases released while the dependency learned (lib.lua remember_released)."""
        return self.prefix + "released"

    @property
    def changes(self) -> str:
        """The pub/sub channel that announces changes of the published state."""
        return self.prefix + "changes"

    def job(self, job_key: str) -> str:
        return self.prefix + "job:" + job_key


def lua_source(name: str) -> bytes:
    """The text of a script as it runs: lib.lua then the script, except noop."""
    with open(os.path.join(LUA_DIR, name + ".lua"), "rb") as f:
        body = f.read()
    if name == "noop":
        return body
    with open(os.path.join(LUA_DIR, "lib.lua"), "rb") as f:
        return f.read() + body


class Script:
    """One protocol script: its text and SHA1."""

    def __init__(self, name: str):
        self.name = name
        self.text = lua_source(name)
        self.sha = hashlib.sha1(self.text).hexdigest()


SCRIPTS = {n: Script(n) for n in (
    "acquire", "renew", "hold", "release", "forget", "budget", "supersede",
    "publish", "window", "read", "noop", "register", "versions")}


def new_lease_id() -> str:
    """128 random bits in base 36, like protocol.NewLeaseID."""
    return _b36(random.getrandbits(64)) + "-" + _b36(random.getrandbits(64))


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _int(v) -> int:
    if isinstance(v, int):
        return v
    return int(_text(v))


@dataclass
class Admission:
    code: int
    now_ms: int = 0  # Redis time when the script ran (0 with no policy/version)
    epoch: int = 0
    limit: int = 0
    held: int = 0
    state: str = ""
    wait_ms: int = 0
    newest: int = 0
    member: str = ""


@dataclass(frozen=True)
class Held:
    """hold's answer. learning_ms: the learning left, 0 when the dependency
    is not learning. no_state: Redis holds no state for the dependency (lost
    with its data, or never published): nobody admits, and the leases were
    put back as while learning. put_back: the members that were missing and
    were put back. lost: outside learning, with a state, the members the
    fleet no longer counts (missing, or expired by Redis's clock): their
    holder came back after the learning second and another call may hold
    their slots, so their calls must stop, as after a renewal that found
    them lost."""
    learning_ms: int = 0
    no_state: bool = False
    put_back: int = 0
    lost: Tuple[str, ...] = ()


@dataclass
class BudgetDecision:
    allowed: bool
    backoff_base_ms: int
    backoff_max_ms: int
    jitter: str
    calls: int
    granted: int


class Client:
    """Runs the protocol's scripts for one dependency over a redis.Redis."""

    def __init__(self, rdb: "redis.Redis", dependency: str | Dependency,
                 caller_id: Optional[str] = None):
        """caller_id names this client in acquisitions: refused for want of a
        slot, it is a contender of its own in the batching pools' fair split
        (docs/protocol.md). None draws a random one; "" makes the client
        anonymous (all anonymous callers count as one contender)."""
        if rdb is None:
            raise ValueError("redis client must not be None")
        self.dep = dependency if isinstance(dependency, Dependency) else Dependency.parse(dependency)
        self.dep.validate()
        self.rdb = rdb
        self.keys = Keys.of(self.dep)
        k = self.keys
        self._acquire_keys = [k.state, k.leases, k.gcra, k.probes, k.wants, k.callers]
        self.caller_id = new_lease_id() if caller_id is None else caller_id
        # Every release passes the state and probes keys: a failure or
        # timeout may trip the breaker in the fleet's path (lib.lua trip).
        # and the calls hash counts this version's calls (count_version).
        self._release_keys = [k.leases, k.stats, k.state, k.probes, k.calls, k.released]
        # renew puts back a lease Redis lost while the dependency learns,
        # which it reads in the state (lib.lua learning).
        self._renew_keys = [k.leases, k.state, k.released]
        self._hold_keys = [k.state, k.leases, k.released]

    # -- transport ---------------------------------------------------------

    def run(self, script: Script, keys: Sequence[str], args: Sequence, timeout: Optional[float] = None):
        """EVALSHA (EVAL's text loaded on NOSCRIPT) in one round trip bounded
        by timeout seconds. Raises RedisUnsent when the request never left,
        RedisUnread when it may have run but the reply was not read, and
        redis's ResponseError for a script error."""
        pool = getattr(self.rdb, "connection_pool", None)
        if pool is None:  # not a redis.Redis: no control of the socket
            try:
                return self.rdb.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                self.rdb.script_load(script.text)
                return self.rdb.evalsha(script.sha, len(keys), *keys, *args)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                raise RedisUnread(e) from e
        try:
            conn = pool.get_connection("EVALSHA")
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnsent(e) from e
        try:
            sock = conn._sock
            if timeout is not None and sock is not None:
                sock.settimeout(timeout)
            try:
                return self._exchange(conn, script, keys, args)
            finally:
                if timeout is not None and conn._sock is not None:
                    conn._sock.settimeout(conn.socket_timeout)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            conn.disconnect()  # its reply may still come: never reuse it
            raise RedisUnread(e) from e
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    @staticmethod
    def _exchange(conn, script: Script, keys, args):
        conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            return conn.read_response()
        except NoScriptError:
            # Nothing ran. Load the text and run it by its SHA.
            conn.send_command("SCRIPT", "LOAD", script.text)
            conn.read_response()
            conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
            return conn.read_response()

    # -- worker scripts ----------------------------------------------------

    def acquire(self, lease_id: str, ttl_ms: int, deadline_ms: int = 0,
                job_key: str = "", job_version: int = 0, job_ttl_ms: int = 0,
                timeout: Optional[float] = None) -> Admission:
        if not lease_id:
            raise ValueError("lease id must not be empty")
        if ttl_ms < 1:
            raise ValueError(f"lease ttl must be at least 1ms, got {ttl_ms}")
        keys = self._acquire_keys
        args = [lease_id, int(ttl_ms), int(deadline_ms)]
        if job_key:
            if not 0 <= job_version <= MAX_JOB_VERSION:
                raise ValueError(f"job version must be in [0, 2^53), got {job_version}")
            if job_ttl_ms < 1:
                raise ValueError(f"job ttl must be at least 1ms, got {job_ttl_ms}")
            keys = keys + [self.keys.job(job_key)]
            args += [int(job_version), int(job_ttl_ms)]
        if self.caller_id:
            if not job_key:
                args += ["", ""]
            args.append(self.caller_id)
        res = self.run(SCRIPTS["acquire"], keys, args, timeout)
        code = _int(res[0])
        if code == NO_POLICY:
            raise NoPolicyError(f"{self.dep}: no policy published for this dependency")
        if code == OTHER_VERSION:
            raise _version_error(self.dep, res)
        now = _int(res[-1])
        if code == ADMITTED:
            return Admission(code, now, epoch=_int(res[1]), limit=_int(res[2]),
                             state=_text(res[3]), member=lease_id)
        if code in (REFUSED_OPEN, REFUSED_RATE):
            return Admission(code, now, wait_ms=_int(res[1]))
        if code == REFUSED_THROTTLED:
            return Admission(code, now, wait_ms=_int(res[1]), held=_int(res[2]), limit=_int(res[3]))
        if code == REFUSED_SUPERSEDED:
            return Admission(code, now, newest=_int(res[1]))
        if code == REFUSED_LATE:
            return Admission(code, now)
        raise ProtocolError(f"unexpected acquire reply {res!r}")

    def renew(self, member: str, ttl_ms: int, timeout: Optional[float] = None) -> bool:
        """Extend a lease still held; True when renewed. A lease Redis lost
        (missing, not expired) is put back while the dependency learns or
        when no state is stored (renew.lua), which it reads in the state."""
        if ttl_ms < 1:
            raise ValueError(f"lease ttl must be at least 1ms, got {ttl_ms}")
        return _int(self.run(SCRIPTS["renew"], self._renew_keys, [member, int(ttl_ms)], timeout)) == 1

    def hold(self, members: Sequence[str], ttl_ms: int, timeout: Optional[float] = None) -> Held:
        """Put back the leases this process holds that Redis lost
        (docs/protocol.md §4 "Learning"): members are the leases of its
        running calls whose ttl has not passed by its own clock. Outside
        learning, with a state, it writes nothing. A process that holds
        leases runs it every HOLD_EVERY_S; it also finds a failover out
        when nothing is acquired (hold.lua)."""
        if ttl_ms < 1:
            raise ValueError(f"lease ttl must be at least 1ms, got {ttl_ms}")
        res = self.run(SCRIPTS["hold"], self._hold_keys, [int(ttl_ms), *members], timeout)
        left, n = _int(res[0]), _int(res[1])
        lost = tuple(m.decode() if isinstance(m, bytes) else str(m) for m in (res[2] if len(res) > 2 else ()))
        if left < 0:
            return Held(learning_ms=0, no_state=True, put_back=n, lost=lost)
        return Held(learning_ms=left, no_state=False, put_back=n, lost=lost)

    def release(self, member: str, outcome: str, attempt: int, epoch: int = 0,
                timeout: Optional[float] = None, took: Optional[float] = None) -> bool:
        """Free member ('' for none) and report the outcome; epoch only for a
        call admitted HalfOpen (a probe), 0 otherwise. took, in seconds, is
        how long the call took: a success's goes into the window's success
        latency, from which the controller bounds a ramp step's call rate.
        A failure or timeout of a call that is not a probe may trip the
        breaker in the fleet's path (docs/protocol.md, the in-path trip)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be s, f, t or c, got {outcome!r}")
        if attempt < 1:
            raise ValueError(f"attempt must be at least 1, got {attempt}")
        args = [member, outcome, int(attempt)]
        if epoch or took is not None:
            args.append(int(epoch))
        if took is not None:
            args.append(max(0, int(took * 1_000_000)))
        res = self.run(SCRIPTS["release"], self._release_keys, args, timeout)
        return _int(res) == 1

    def forget(self, member: str, timeout: Optional[float] = None) -> None:
        if not member:
            raise ValueError("lease member must not be empty")
        self.run(SCRIPTS["forget"], [self.keys.leases], [member], timeout)

    def budget(self, timeout: Optional[float] = None) -> BudgetDecision:
        res = self.run(SCRIPTS["budget"], [self.keys.state, self.keys.stats], [], timeout)
        code = _int(res[0])
        if code == -5:
            raise NoPolicyError(f"{self.dep}: no policy published for this dependency")
        if code == -6:
            raise _version_error(self.dep, res)
        if len(res) < 6:
            raise ProtocolError(f"unexpected budget reply {res!r}")
        return BudgetDecision(code == 1, _int(res[1]), _int(res[2]), _text(res[3]) or "",
                              _int(res[4]), _int(res[5]))

    def supersede(self, job_key: str, version: int, ttl_ms: int, timeout: Optional[float] = None) -> int:
        if not job_key:
            raise ValueError("job key must not be empty")
        if not 0 <= version <= MAX_JOB_VERSION:
            raise ValueError(f"job version must be in [0, 2^53), got {version}")
        if ttl_ms < 1:
            raise ValueError(f"job ttl must be at least 1ms, got {ttl_ms}")
        return _int(self.run(SCRIPTS["supersede"], [self.keys.job(job_key)], [int(version), int(ttl_ms)], timeout))

    def register(self, client: str, process_id: str, timeout: Optional[float] = None) -> None:
        """Record that this process runs client (python, ...) at this protocol
        version (register.lua): at first use of the dependency and every
        REGISTER_EVERY_S after."""
        if not client or not process_id or any(c.isspace() for c in client + process_id):
            raise ValueError(f"client {client!r} and process id {process_id!r} must be non-empty, without spaces")
        self.run(SCRIPTS["register"], [self.keys.clients], [client, process_id], timeout)

    def noop(self) -> None:
        """The benchmark baseline: one EVALSHA that does nothing."""
        self.run(SCRIPTS["noop"], [self.keys.leases], [])

    # -- controller scripts (used by tests and tools) ----------------------

    def publish(self, epoch: int, fields: dict, seq: int = 0) -> List:
        args = [int(epoch), int(seq)]
        for k, v in fields.items():
            args += [k, v]
        res = self.run(SCRIPTS["publish"], [self.keys.state, self.keys.probes], args)
        return [_int(x) for x in res]

    def window(self, seconds: int, since_s: int = 0) -> dict:
        res = self.run(SCRIPTS["window"], [self.keys.state, self.keys.stats, self.keys.probes, self.keys.leases],
                       [int(seconds), int(since_s)])
        names = ("now_ms", "calls", "successes", "failures", "timeouts", "a1", "a2", "a3", "a4",
                 "granted", "refused", "success_micros", "timed_successes",
                 "probe_successes", "probe_failures", "probe_timeouts")
        return dict(zip(names, (_int(x) for x in res)))

    def live_leases(self) -> int:
        """Leases that count now (ZCOUNT leases (now_ms +inf), Redis time."""
        secs, micros = self.rdb.time()
        now_ms = secs * 1000 + micros // 1000
        return self.rdb.zcount(self.keys.leases, f"({now_ms}", "+inf")


def _version_error(dep, res) -> VersionError:
    state = _int(res[1]) if len(res) > 1 else -1
    manager = _int(res[2]) if len(res) > 2 else -1
    return VersionError(dep, state, manager)


def redis_now_ms(rdb) -> int:
    secs, micros = rdb.time()
    return secs * 1000 + micros // 1000


def wall_ms() -> int:
    return int(time.time() * 1000)


__all__ = [n for n in dir() if not n.startswith("_")]
