"""A reply outside the protocol is a typed refusal (BadReply, a
RedisUnavailable: fail closed, defer), never an untyped exception. A unit
test: a loopback server that speaks RESP answers every command with the
reply under test (no redis-server could send these for our scripts)."""

import random
import socket
import threading

import pytest
import redis

import spillway
from spillway import Guard


class OddRedis:
    """Answers every RESP command on 127.0.0.1 with `reply`."""

    def __init__(self, reply: bytes):
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            buf = b""
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                # One reply per complete command (an array of bulk strings).
                while buf.startswith(b"*"):
                    n, rest = buf[1:].split(b"\r\n", 1)
                    parts = rest.split(b"\r\n")
                    need = 2 * int(n)
                    if len(parts) <= need:
                        break
                    buf = b"\r\n".join(parts[need:])
                    conn.sendall(self.reply)

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("reply", [
    b"+OK\r\n",                    # a status where an array belongs
    b"*1\r\n$1\r\nx\r\n",          # not a number
    b"*2\r\n:42\r\n:0\r\n",        # an admission code the protocol does not have
    b"*0\r\n",                     # empty
])
def test_a_reply_outside_the_protocol_is_a_typed_refusal(reply):
    odd = OddRedis(reply)
    g = Guard(redis.Redis(host="127.0.0.1", port=odd.port, socket_timeout=1), "pytest/odd",
              registry=None, rand=random.Random(1), lease_ttl=1.0)
    try:
        with pytest.raises(spillway.BadReply) as e:
            g.call(lambda: None)
        assert isinstance(e.value, spillway.RedisUnavailable)
        assert spillway.decide(e.value).action == spillway.DEFER
        with pytest.raises(spillway.BadReply):
            g.supersede("vin-1", 3)
    finally:
        g.close()
        odd.close()
