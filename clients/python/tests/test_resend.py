"""A command Redis ran whose reply was lost, resent by the client, is counted
once (docs/protocol.md §4a). redis-py given retry and
retry_on_error=[ConnectionError] resends the same EVALSHA on a new connection
when the connection closes before the reply: every script must be idempotent
per lease id. A proxy on 127.0.0.1 forwards each command to a real
redis-server and, for the commands it is armed for, closes the client's
connection instead of passing the reply back."""

import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import spillway
from spillway import Guard, Job
from spillway import protocol as P
from conftest import publish


class LostReplyProxy:
    """Forwards to Redis; the first run of each distinct request carrying the
    armed script's SHA (up to a count) loses its reply and its connection."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.lost = 0
        self._mu = threading.Lock()
        self._sha = b""
        self._budget = 0
        self._seen = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, script: str, n: int):
        with self._mu:
            self._sha, self._budget = P.SCRIPTS[script].sha.encode(), n

    def close(self):
        self._closed = True
        self.listener.close()

    def _doomed(self, req: bytes) -> bool:
        with self._mu:
            if self._budget == 0 or self._sha not in req or req in self._seen:
                return False
            self._seen.add(req)
            self._budget -= 1
            return True

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            doomed = threading.Event()
            threading.Thread(target=self._up, args=(client, server, doomed), daemon=True).start()
            threading.Thread(target=self._down, args=(client, server, doomed), daemon=True).start()

    def _up(self, client, server, doomed):
        try:
            while True:
                req = client.recv(65536)
                if not req:
                    break
                if self._doomed(req):
                    doomed.set()
                server.sendall(req)
        except OSError:
            pass
        finally:
            _close(server)

    def _down(self, client, server, doomed):
        try:
            while True:
                reply = server.recv(65536)
                if not reply:
                    break
                if doomed.is_set():
                    # Redis ran the command: drop its reply and the connection.
                    with self._mu:
                        self.lost += 1
                    break
                client.sendall(reply)
        except OSError:
            pass
        finally:
            _close(client)
            _close(server)


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@pytest.fixture
def proxy(redis_server):
    p = LostReplyProxy(redis_server.port)
    yield p
    p.close()


def retrying_client(port: int) -> redis.Redis:
    """A client that resends after a lost reply, as redis-py's retry
    settings make it."""
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2,
                       retry=Retry(NoBackoff(), 3), retry_on_error=[redis.ConnectionError])


def load_scripts(rdb):
    for s in P.SCRIPTS.values():
        rdb.script_load(s.text)


def test_redis_py_resends_are_counted_once(rdb, dep, proxy):
    """The scripts under redis-py's own resend: at limit 1 the resent acquire
    is admitted on its own lease (not throttled by it), and five failing
    calls whose release replies were lost add exactly five failures."""
    publish(rdb, dep, limit=1)
    load_scripts(rdb)
    direct = P.Client(rdb, dep)
    k = direct.keys
    r = retrying_client(proxy.port)
    try:
        proxy.arm("acquire", 1)
        lease = P.new_lease_id()
        res = r.evalsha(P.SCRIPTS["acquire"].sha, 4, k.state, k.leases, k.gcra, k.probes, lease, 30000, 0)
        assert proxy.lost == 1, "the proxy lost no acquire reply"
        assert P._int(res[0]) == P.ADMITTED, f"the resent acquire answered {res}, not admitted"
        assert direct.live_leases() == 1
        r.evalsha(P.SCRIPTS["release"].sha, 2, k.leases, k.stats, lease, "s", 1)
        assert direct.live_leases() == 0

        proxy.arm("release", 5)
        for _ in range(5):
            lease = P.new_lease_id()
            res = r.evalsha(P.SCRIPTS["acquire"].sha, 4, k.state, k.leases, k.gcra, k.probes, lease, 30000, 0)
            assert P._int(res[0]) == P.ADMITTED, res
            r.evalsha(P.SCRIPTS["release"].sha, 2, k.leases, k.stats, lease, "f", 1)
        assert proxy.lost == 6, "the proxy did not lose five release replies"
        w = direct.window(60)
        assert (w["calls"], w["failures"], w["a1"]) == (6, 5, 6), w
    finally:
        r.close()


class NoPool:
    """A client whose sockets the guard cannot reach (no connection_pool, as
    with a wrapper or a cluster client): the guard calls its evalsha, so
    redis-py's own retries resend the script."""

    def __init__(self, r: redis.Redis):
        self._r = r

    def __getattr__(self, name):
        if name == "connection_pool":
            raise AttributeError(name)
        return getattr(self._r, name)


@pytest.mark.parametrize("wrap", [lambda r: r, NoPool], ids=["redis.Redis", "no pool: redis-py resends"])
def test_the_guard_on_a_retrying_client_holds_no_ghost_and_counts_once(rdb, dep, proxy, wrap):
    """The guard given a client with retry settings: a lost acquire reply
    leaves no lease held by nobody 1 s later, and five failing calls whose
    release replies were lost add exactly five failures, however the client
    handles the loss (redis-py's resend, or an unread reply the guard
    forgets)."""
    publish(rdb, dep, limit=1)
    load_scripts(rdb)
    direct = P.Client(rdb, dep)
    r = retrying_client(proxy.port)
    g = Guard(wrap(r), dep, registry=None)
    try:
        proxy.arm("acquire", 1)
        try:
            g.call(lambda: None)
        except spillway.RedisUnavailable:
            pass  # the reply was not read; the guard forgets the lease
        assert proxy.lost == 1, "the proxy lost no acquire reply"
        time.sleep(1.0)
        assert direct.live_leases() == 0, "a lease is held by no call 1 s after the lost reply"
        before = direct.window(60)

        proxy.arm("release", 5)

        def failing():
            raise RuntimeError("dependency failed")

        for _ in range(5):
            with pytest.raises(spillway.SpillwayError):
                g.call(failing, Job(attempt=1))
        assert proxy.lost == 6, "the proxy did not lose five release replies"
        time.sleep(1.0)
        w = direct.window(60)
        assert (w["failures"] - before["failures"], w["a1"] - before["a1"]) == (5, 5), (before, w)
        assert direct.live_leases() == 0
    finally:
        g.close()
        r.close()
