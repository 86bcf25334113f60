"""A timeout is a timeout in every client people use: each client library
itself (Debian's python3-requests, python3-urllib3, python3-httpx,
python3-grpcio), timing out against a loopback server that never answers,
is counted as a timeout ('t') by a guard on a real redis-server; its other
errors stay failures ('f')."""

import asyncio
import random
import socket
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
import requests
import urllib3

import spillway
from spillway import Guard
from spillway.guard import default_classify
from conftest import publish


class Silent:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/slow"
        self.held = []
        self.stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.stop = True
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture(scope="module")
def silent():
    s = Silent()
    yield s
    s.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


@pytest.fixture(scope="module")
def grpc_server():
    """A gRPC server on 127.0.0.1 with a method that sleeps past the
    caller's deadline (Slow) and one that fails (Broken)."""

    def slow(request, context):
        time.sleep(1.0)
        return request

    def broken(request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "backend down")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Vehicles", {
        "Slow": grpc.unary_unary_rpc_method_handler(slow),
        "Broken": grpc.unary_unary_rpc_method_handler(broken),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(0)


def socket_timeout(s):
    with socket.create_connection(("127.0.0.1", s.port), timeout=0.05) as c:
        c.recv(1)


def asyncio_timeout(s):
    async def read():
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        try:
            await asyncio.wait_for(reader.read(1), 0.05)
        finally:
            writer.close()
    asyncio.run(read())


def urllib3_pool(retries):
    def call(s):
        with urllib3.PoolManager() as pm:
            pm.request("GET", s.url, timeout=0.05, retries=retries)
    return call


def httpx_get(s):
    httpx.get(s.url, timeout=0.05)


async def _httpx_async(url):
    async with httpx.AsyncClient(timeout=0.05) as c:
        await c.get(url)


TIMEOUTS = {
    "socket.timeout": socket_timeout,
    "asyncio.TimeoutError": asyncio_timeout,
    "requests read timeout": lambda s: requests.get(s.url, timeout=0.05),
    "requests session, retries": lambda s: _session_get(s.url),
    "urllib3 read timeout": urllib3_pool(False),
    "urllib3 MaxRetryError of a timeout": urllib3_pool(urllib3.Retry(1, backoff_factor=0)),
    "httpx read timeout": httpx_get,
    "httpx async read timeout": lambda s: asyncio.run(_httpx_async(s.url)),
}


def _session_get(url):
    with requests.Session() as sess:
        sess.mount("http://", requests.adapters.HTTPAdapter(max_retries=1))
        sess.get(url, timeout=0.05)


FAILURES = {
    "requests connection refused": lambda: requests.get(f"http://127.0.0.1:{closed_port()}/", timeout=1),
    "urllib3 connection refused": lambda: urllib3.PoolManager().request(
        "GET", f"http://127.0.0.1:{closed_port()}/", timeout=1, retries=False),
    "httpx connection refused": lambda: httpx.get(f"http://127.0.0.1:{closed_port()}/", timeout=1),
    "a plain error": lambda: (_ for _ in ()).throw(RuntimeError("503")),
}


def raised(fn, *a):
    try:
        fn(*a)
    except BaseException as e:  # noqa: B902
        return e
    raise AssertionError("the call did not raise")


@pytest.fixture
def guard(rdb, dep):
    publish(rdb, dep, limit=4, min_retries=100)
    g = Guard(rdb, dep, registry=None, rand=random.Random(1))
    yield g
    g.close()


@pytest.mark.parametrize("name", sorted(TIMEOUTS))
def test_a_client_libraries_timeout_is_a_timeout(silent, guard, name):
    exc = raised(TIMEOUTS[name], silent)
    assert default_classify(exc) == "t", f"{name}: {type(exc).__module__}.{type(exc).__qualname__} {exc!r}"
    with pytest.raises(spillway.CallFailed):
        guard.call(lambda: TIMEOUTS[name](silent))
    w = guard.proto.window(600)
    assert (w["timeouts"], w["failures"]) == (1, 0), w


def test_grpc_deadline_exceeded_is_a_timeout_and_unavailable_a_failure(grpc_server, guard):
    slow = grpc_server.unary_unary("/test.Vehicles/Slow")
    broken = grpc_server.unary_unary("/test.Vehicles/Broken")
    exc = raised(slow, b"vin", 0.05)
    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert default_classify(exc) == "t"
    exc = raised(broken, b"vin", 5)
    assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert default_classify(exc) == "f"
    for call in (lambda: slow(b"vin", timeout=0.05), lambda: broken(b"vin", timeout=5)):
        with pytest.raises(spillway.CallFailed):
            guard.call(call)
    w = guard.proto.window(600)
    assert (w["timeouts"], w["failures"]) == (1, 1), w


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_other_client_errors_stay_failures(name):
    assert default_classify(raised(FAILURES[name])) == "f", name


def test_a_timeout_given_as_the_cause_is_a_timeout(silent):
    def wrapped():
        try:
            requests.get(silent.url, timeout=0.05)
        except requests.RequestException as e:
            raise RuntimeError("vehicle api did not answer") from e
    assert default_classify(raised(wrapped)) == "t"
