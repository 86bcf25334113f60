"""Refusals are bounded by redis_timeout when Redis does not answer, connect
and AUTH included: a real redis-server with a password, paused (SIGSTOP),
behind a client built as GuardedTask builds it (socket_timeout 5 s,
socket_connect_timeout 1 s). Each call opens a new connection (the pool is
emptied first), so the handshake is on the call path. The bound asserted is
generous (1 s against a 0.1 s redis_timeout): without it, the AUTH alone
waits the client's socket_timeout (5 s)."""

import random
import time

import pytest

import spillway
from spillway import Guard
from conftest import RedisServer, publish

REDIS_TIMEOUT = 0.1
BOUND = 1.0


@pytest.fixture
def redis_with_password():
    s = RedisServer(password="s3cret")
    yield s
    s.close()


def test_refusals_with_redis_paused_are_bounded_by_redis_timeout_handshake_included(redis_with_password, dep):
    srv = redis_with_password
    publish(srv.client(), dep, limit=4)
    client = srv.client(socket_timeout=5, socket_connect_timeout=1)  # GuardedTask's client
    g = Guard(client, dep, redis_timeout=REDIS_TIMEOUT, registry=None, rand=random.Random(1))
    try:
        assert g.call(lambda: "up") == "up"
        srv.pause()
        took = []
        for _ in range(5):
            g.proto.rdb.connection_pool.disconnect()  # the next call connects and sends AUTH
            t0 = time.monotonic()
            with pytest.raises(spillway.RedisUnavailable):
                g.call(lambda: "never runs")
            took.append(time.monotonic() - t0)
        print(f"refusals with a paused, password-protected Redis, new connections, redis_timeout "
              f"{REDIS_TIMEOUT}s: {', '.join(f'{t * 1e3:.0f}ms' for t in took)}")
        assert max(took) < BOUND, f"refusals took {took}: not bounded by redis_timeout"
        srv.resume()
        deadline = time.monotonic() + 5
        while True:
            try:
                assert g.call(lambda: "back") == "back"
                break
            except spillway.RedisUnavailable:
                assert time.monotonic() < deadline, "the guard never came back"
                time.sleep(0.05)
    finally:
        srv.resume()
        g.close()
