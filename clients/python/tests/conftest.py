"""Fixtures: a real redis-server on a free loopback port, started by the
tests (never a system service), and a way to publish a dependency's state as
the controller does (publish.lua, with the fields of docs/protocol.md §2)."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import redis

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the spillway package, unbuilt

from spillway import protocol as P  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1, with no persistence."""

    def __init__(self, *args, password=None):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not found: run hack/setup-redis.sh (make redis)")
        self.dir = tempfile.mkdtemp(prefix="spillway-py-redis-")
        self.port = free_port()
        self.binary = binary
        self.password = password
        self.args = list(args) + (["--requirepass", password] if password else [])
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log")] + self.args,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1, password=self.password).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.02)

    def client(self, **kw) -> redis.Redis:
        kw.setdefault("socket_timeout", 2)
        kw.setdefault("password", self.password)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)

    def close(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    s = RedisServer()
    yield s
    s.close()


@pytest.fixture
def own_redis():
    """A server of the test's own, which it may pause or stop."""
    s = RedisServer()
    yield s
    s.close()


@pytest.fixture
def rdb(redis_server):
    c = redis_server.client()
    yield c
    c.close()


_deps = itertools.count()


@pytest.fixture
def dep():
    """A dependency name no other test uses."""
    return f"pytest/dep-{os.getpid()}-{next(_deps)}"


def state_fields(state="Closed", limit=4, rate=0, open_until_ms=0, backoff_base_ms=100,
                 backoff_max_ms=1000, jitter="Full", ratio_ppm=200000, min_retries=10,
                 budget_window_s=60, breaker_window_s=30, half_open_probes=3, stale_after_ms=0,
                 capacity=None):
    interval = -(-1_000_000 // rate) if rate else 0
    return {
        "state": state, "limit": limit, "capacity": capacity if capacity is not None else limit,
        "rate": rate, "rate_interval_us": interval, "rate_burst": max(1, rate // 10),
        "open_until_ms": open_until_ms, "backoff_base_ms": backoff_base_ms,
        "backoff_max_ms": backoff_max_ms, "jitter": jitter, "budget_ratio_ppm": ratio_ppm,
        "budget_min_retries": min_retries, "budget_window_s": budget_window_s,
        "breaker_window_s": breaker_window_s,
        "stats_retention_s": max(breaker_window_s, budget_window_s) + 60,
        "half_open_probes": half_open_probes, "stale_after_ms": stale_after_ms,
    }


def publish(rdb, dependency, epoch=1, **kw):
    """Publish a state as the controller would; returns the reply."""
    res = P.Client(rdb, dependency).publish(epoch, state_fields(**kw))
    assert res[0] == 1, res
    return res
