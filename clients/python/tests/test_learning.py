"""Learning (protocol 6, docs/protocol.md §4 "Learning") for the Python
guard, against a real redis-server, as pkg/protocol/learning_test.go for Go:
after Redis loses leases whose calls still run (a failover to a replica that
missed the last writes, or a restart without data), nothing new is admitted
for a second while the holders put their leases back. A guard holding a
running call does so by itself: its background hold, every HOLD_EVERY_S."""

import random
import threading
import time

import pytest

from spillway import Guard
from spillway import protocol as P
from conftest import publish, state_fields


def replid(rdb) -> str:
    return rdb.info("replication")["master_replid"]


def promote(rdb) -> None:
    """A new replication id with the data kept, as a replica promoted by a
    failover gets one: REPLICAOF an address nobody listens on, then
    REPLICAOF NO ONE. A failover follows a crash that takes a second or more
    to detect: it first waits out the scripts' replication-id check period
    (100 ms, lib.lua replid_every_ms), so that nothing they recorded is more
    recent."""
    time.sleep(0.15)
    before = replid(rdb)
    rdb.execute_command("REPLICAOF", "127.0.0.1", "1")
    rdb.execute_command("REPLICAOF", "NO", "ONE")
    assert replid(rdb) != before, "the replication id did not change"


@pytest.fixture
def running():
    """Runs a call under a guard in a thread until the test ends it: the
    call's Permit, once admitted."""
    started = []

    def run(g):
        admitted, end = threading.Event(), threading.Event()
        box = {}

        def call(permit):
            box["permit"] = permit
            admitted.set()
            end.wait(30)

        t = threading.Thread(target=lambda: g.call(call, pass_permit=True), daemon=True)
        t.start()
        started.append((t, end))
        assert admitted.wait(5), "the call was not admitted"
        return box["permit"]

    yield run
    for t, end in started:
        end.set()
        t.join(5)


@pytest.fixture
def guard():
    made = []

    def make(rdb, dep):
        g = Guard(rdb, dep, registry=None, rand=random.Random(1))
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def back_within(rdb, key, member, seconds):
    """How long the lease member took to be back in the set (Redis's own
    clock is not needed: it is polled), or None if it was not within seconds."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if rdb.zscore(key, member) is not None:
            return time.monotonic() - start
        time.sleep(0.005)
    return None


def test_a_running_calls_lease_is_put_back_after_a_failover(own_redis, dep, guard, running):
    rdb = own_redis.client()
    publish(rdb, dep, limit=2)
    g = guard(rdb, dep)
    permit = running(g)
    k = g.proto.keys
    # The state recorded the server's replication id at the admission.
    assert rdb.hget(k.state, "replid").decode() == replid(rdb)

    promote(rdb)
    rdb.zrem(k.leases, permit.member)  # the write the replica missed
    took = back_within(rdb, k.leases, permit.member, 2.0)
    assert took is not None, "the guard did not put its running call's lease back"
    # Every HOLD_EVERY_S, plus a round trip on a shared, noisy machine.
    assert took <= P.HOLD_EVERY_S + 0.1, f"the lease was put back after {took:.3f}s"
    learn_until = int(rdb.hget(k.state, "learn_until_ms"))
    assert learn_until > P.redis_now_ms(rdb), "the hold found the failover out: the dependency learns"

    # While learning, nothing new is admitted, though a slot is free.
    other = P.Client(rdb, dep)
    x = other.acquire("during", 30000)
    assert x.code == P.REFUSED_THROTTLED and (x.held, x.limit) == (1, 2), x
    assert 0 < x.wait_ms <= P.LEARN_FOR_S * 1000, x

    # After learning, the cap counts the running call: one slot is left.
    time.sleep(max(0, learn_until - P.redis_now_ms(rdb)) / 1000 + 0.05)
    assert other.acquire("after-1", 30000).code == P.ADMITTED
    y = other.acquire("after-2", 30000)
    assert y.code == P.REFUSED_THROTTLED and y.held == 2, y
    assert g.last_held is not None and not g.last_held.no_state


def test_a_running_calls_lease_is_put_back_after_a_restart_without_data(own_redis, dep, guard, running):
    rdb = own_redis.client()
    publish(rdb, dep, limit=2)
    g = guard(rdb, dep)
    permit = running(g)
    k = g.proto.keys

    rdb.flushall()  # Redis restarted without its data: no state, no lease
    took = back_within(rdb, k.leases, permit.member, 2.0)
    assert took is not None, "the guard did not put its running call's lease back"
    assert took <= P.HOLD_EVERY_S + 0.1, f"the lease was put back after {took:.3f}s"
    # The guard reads the reply of the hold that put it back.
    deadline = time.monotonic() + 1
    while g.last_held is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert g.last_held is not None and g.last_held.no_state and g.last_held.put_back == 1, g.last_held
    assert rdb.exists(k.state) == 0, "hold writes no state"

    # The manager publishes over the state it had published (restored):
    # the dependency learns, then the cap counts the running call.
    res = P.Client(rdb, dep).publish(2, {**state_fields(limit=2), "restored": 1})
    assert res[0] == 1, res
    other = P.Client(rdb, dep)
    x = other.acquire("during", 30000)
    assert x.code == P.REFUSED_THROTTLED and (x.held, x.limit) == (1, 2), x
    assert 0 < x.wait_ms <= P.LEARN_FOR_S * 1000, x
    learn_until = int(rdb.hget(k.state, "learn_until_ms"))
    time.sleep(max(0, learn_until - P.redis_now_ms(rdb)) / 1000 + 0.05)
    assert other.acquire("after-1", 30000).code == P.ADMITTED
    y = other.acquire("after-2", 30000)
    assert y.code == P.REFUSED_THROTTLED and y.held == 2, y


def test_no_hold_while_no_lease_is_held(own_redis, dep, guard, running):
    rdb = own_redis.client()
    publish(rdb, dep, limit=1)
    g = guard(rdb, dep)
    g.call(lambda: None)
    calls = lambda: rdb.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    before = calls()
    time.sleep(3 * P.HOLD_EVERY_S)
    assert calls() == before, "a guard that holds no lease runs no script"
    assert g.last_held is None



def test_hold_puts_back_only_while_learning(own_redis, dep):
    # The protocol calls, as TestFailoverLearnsBeforeAdmitting in Go.
    rdb = own_redis.client()
    publish(rdb, dep, limit=2)
    c = P.Client(rdb, dep)
    assert c.acquire("a", 30000).code == P.ADMITTED
    assert c.acquire("b", 30000).code == P.ADMITTED
    promote(rdb)
    rdb.zrem(c.keys.leases, "b")  # the write the replica missed

    x = c.acquire("x", 30000)
    assert x.code == P.REFUSED_THROTTLED and 0 < x.wait_ms <= P.LEARN_FOR_S * 1000, x
    h = c.hold(["a", "b"], 30000)
    assert h.learning_ms > 0 and not h.no_state and h.put_back == 1, h
    assert rdb.zscore(c.keys.leases, "b") > P.redis_now_ms(rdb) + 29000
    time.sleep(P.LEARN_FOR_S + 0.05)
    x = c.acquire("x", 30000)
    assert x.code == P.REFUSED_THROTTLED and x.held == 2, x

    # Outside learning hold writes nothing, and a lease the fleet stopped
    # counting is not put back, by hold or by renew.
    rdb.zrem(c.keys.leases, "b")
    assert c.hold(["a", "b"], 30000) == P.Held(lost=("b",)), "b is named lost: the fleet no longer counts it"
    assert c.renew("b", 30000) is False
    assert c.acquire("y", 30000).code == P.ADMITTED


def test_renew_puts_back_while_learning(own_redis, dep):
    # A renewal, the first script on the new server, finds the failover out
    # itself and puts its lease back (renew.lua reads the state key).
    rdb = own_redis.client()
    publish(rdb, dep, limit=1)
    c = P.Client(rdb, dep)
    assert c.acquire("a", 30000).code == P.ADMITTED
    promote(rdb)
    rdb.zrem(c.keys.leases, "a")
    assert c.renew("a", 30000) is True
    time.sleep(P.LEARN_FOR_S + 0.05)
    x = c.acquire("x", 30000)
    assert x.code == P.REFUSED_THROTTLED and x.held == 1, x


def test_hold_and_renew_put_back_with_no_state(own_redis, dep):
    # Redis lost everything: nobody admits without a state, so a holder's
    # lease is put back as while learning.
    rdb = own_redis.client()
    publish(rdb, dep, limit=2)
    c = P.Client(rdb, dep)
    c.acquire("a", 30000)
    c.acquire("b", 30000)
    rdb.flushall()
    assert c.hold(["a"], 30000) == P.Held(learning_ms=0, no_state=True, put_back=1)
    assert c.renew("b", 30000) is True
    assert c.live_leases() == 2


@pytest.mark.parametrize("loss", ["failover, lease kept", "failover, lease lost", "restart without data"])
def test_a_released_lease_stays_released_while_learning(own_redis, dep, loss):
    # A hold or renewal sent before a call ended can reach Redis after its
    # release, on another connection: it must not put the released lease
    # back (release.lua records it in `released`), as
    # TestReleasedLeaseStaysReleasedWhileLearning in Go.
    rdb = own_redis.client()
    publish(rdb, dep, limit=1)
    c = P.Client(rdb, dep)
    assert c.acquire("a", 30000).code == P.ADMITTED
    if loss == "restart without data":
        rdb.flushall()
    else:
        promote(rdb)
        if loss == "failover, lease lost":
            rdb.zrem(c.keys.leases, "a")

    c.release("a", "s", 1)
    h = c.hold(["a"], 30000)
    assert h.put_back == 0, f"a hold after the release put the lease back: {h}"
    assert c.renew("a", 30000) is False, "a renewal after the release put the lease back"
    assert rdb.zscore(c.keys.leases, "a") is None
    if h.no_state:
        assert P.Client(rdb, dep).publish(2, {**state_fields(limit=1), "restored": 1})[0] == 1
    time.sleep(P.LEARN_FOR_S + 0.05)
    assert c.acquire("b", 30000).code == P.ADMITTED


def test_a_failed_hold_is_tried_again_soon(own_redis, dep, guard, running):
    # As TestHolderTriesAgainSoonAfterAFailedHold in Go: the learning second
    # counts from the first script on the new server, so a holder must not
    # wait a whole HOLD_EVERY_S after a hold that failed. 4 attempts a
    # second with HOLD_EVERY_S alone.
    rdb = own_redis.client()
    publish(rdb, dep, limit=1)
    g = guard(rdb, dep)
    attempts, real = [], g.proto.hold

    def counting(*args, **kwargs):
        attempts.append(time.monotonic())
        return real(*args, **kwargs)

    g.proto.hold = counting
    permit = running(g)
    own_redis.stop()
    start = time.monotonic()
    time.sleep(1.0)
    n = sum(1 for t in attempts if start <= t < start + 1.0)
    assert n >= 10, f"{n} holds in the second Redis refused connections"
    own_redis.start()  # empty: no state, hold puts the lease back
    back = time.monotonic()
    took = back_within(rdb, g.proto.keys.leases, permit.member, 2.0)
    assert took is not None, "the guard did not put its running call's lease back"


def test_a_hold_outside_learning_cuts_a_call_whose_lease_the_fleet_lost(own_redis, dep, guard, running):
    # As TestHoldCutsACallWhoseLeaseTheFleetLost in Go: a holder back after
    # the learning second finds its lease gone; its call is cut at that
    # hold, not at its next renewal (lease_ttl / 3).
    rdb = own_redis.client()
    publish(rdb, dep, limit=1)
    g = guard(rdb, dep)
    permit = running(g)
    rdb.delete(g.proto.keys.leases)
    assert permit.lost.wait(P.HOLD_EVERY_S + 1.0), "the call was not cut at the next hold"
    assert g.last_held is not None and g.last_held.lost == (permit.member,), g.last_held
