"""The guard against a real redis-server: decisions, and the failure-mode
rules of pkg/guard (deadlines, forgetting unread acquisitions, cancellation
counted as nothing, lease renewal that stops with the call, fail closed)."""

import os
import random
import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

import spillway
from spillway import DEFER, DROP, PARK, RETRY, Guard, Job, decide
from spillway import protocol as P
from spillway.guard import RedisClock
from conftest import publish


def eventually(cond, timeout=5.0, every=0.02):
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within %.1fs" % timeout)
        time.sleep(every)


@pytest.fixture
def make_guard(rdb):
    guards = []

    def make(dep, client=None, **kw):
        kw.setdefault("registry", None)
        kw.setdefault("rand", random.Random(1))
        g = Guard(client or rdb, dep, **kw)
        guards.append(g)
        return g

    yield make
    for g in guards:
        g.close()


def test_a_successful_call_returns_its_result_and_is_counted(rdb, dep, make_guard):
    publish(rdb, dep, limit=2)
    g = make_guard(dep)
    assert g.call(lambda: 42) == 42
    with g.slot(Job(attempt=3)) as p:
        assert p.limit == 2 and p.state == "Closed"
        assert g.proto.live_leases() == 1
    w = g.proto.window(60)
    assert (w["calls"], w["successes"], w["a1"], w["a3"]) == (2, 2, 1, 1)
    assert g.proto.live_leases() == 0


def test_refusals_defer_and_drops(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    g = make_guard(dep)
    with g.slot():
        with pytest.raises(spillway.Throttled) as e:
            g.call(lambda: None)
        action, after = decide(e.value)
        assert action == DEFER and 0.1 <= after <= 0.2
    with pytest.raises(spillway.Stale) as e:
        g.call(lambda: None, Job(deadline=time.time() - 1))
    assert decide(e.value) == (DROP, 0.0)
    g.supersede("vin-1", 5)
    with pytest.raises(spillway.Superseded) as e:
        g.call(lambda: None, Job(key="vin-1", version=4))
    assert decide(e.value).action == DROP
    assert g.call(lambda: "ran", Job(key="vin-1", version=5)) == "ran"
    publish(rdb, dep, epoch=2, state="Open", limit=0, open_until_ms=P.redis_now_ms(rdb) + 10000)
    with pytest.raises(spillway.BreakerOpen) as e:
        g.call(lambda: None)
    action, after = decide(e.value)
    assert action == DEFER and 5.0 <= after <= 15.0, "the hint is the time until open_until"
    assert decide(ValueError("not ours")) == (None, 0.0)


def test_no_policy_defers(rdb, dep, make_guard):
    g = make_guard(dep)
    with pytest.raises(spillway.NoPolicy) as e:
        g.call(lambda: None)
    assert decide(e.value).action == DEFER and e.value.after >= 1.0
    assert not isinstance(e.value, spillway.OtherVersion)


def test_another_version_defers_and_says_which(rdb, dep, make_guard):
    publish(rdb, dep)
    rdb.hset(f"spillway:v4:{{{dep}}}:state", "version", "9")
    g = make_guard(dep)
    with pytest.raises(spillway.OtherVersion) as e:
        g.call(lambda: None)
    assert decide(e.value).action == DEFER
    assert f"this worker speaks version {spillway.VERSION}" in str(e.value.__cause__ or e.value.cause)


def test_a_failed_call_under_another_version_says_so(rdb, dep, make_guard):
    # The state turns to a version this worker does not act on while a call
    # runs, and the call fails: the budget script refuses on version. The
    # job defers with OtherVersion, as an admission would, not parked as a
    # spent budget counted as a Redis error (Redis answered).
    # As TestFailedCallUnderAnUnservedVersionSaysSo in Go.
    publish(rdb, dep)
    g = make_guard(dep)

    def boom():
        rdb.hset(f"spillway:v4:{{{dep}}}:state", "version", "9")
        raise ConnectionResetError("vehicle api reset the connection")

    with pytest.raises(spillway.OtherVersion) as e:
        g.call(boom, Job(attempt=1))
    assert decide(e.value).action == DEFER
    assert f"this worker speaks version {spillway.VERSION}" in str(e.value.cause)
    assert "vehicle api reset the connection" in str(e.value)


def test_the_guard_registers_its_process(rdb, dep, make_guard):
    publish(rdb, dep)
    g = make_guard(dep)
    g.call(lambda: None)
    members = [m.decode() if isinstance(m, bytes) else m for m in rdb.zrange(f"spillway:v4:{{{dep}}}:clients", 0, -1)]
    assert len(members) == 1 and members[0].startswith(f"python {spillway.VERSION} ")


def test_failures_retry_with_the_published_backoff_then_park(rdb, dep, make_guard):
    publish(rdb, dep, ratio_ppm=0, min_retries=2, backoff_base_ms=400, backoff_max_ms=1000, jitter="None")
    g = make_guard(dep)

    def boom():
        raise ConnectionResetError("vehicle api reset the connection")

    with pytest.raises(spillway.CallFailed) as e:
        g.call(boom, Job(attempt=1))
    assert decide(e.value) == (RETRY, 0.4)
    assert isinstance(e.value.__cause__, ConnectionResetError)
    with pytest.raises(spillway.CallFailed) as e:
        g.call(boom, Job(attempt=2))
    assert decide(e.value) == (RETRY, 0.8)
    with pytest.raises(spillway.BudgetExhausted) as e:
        g.call(boom, Job(attempt=3))
    action, after = decide(e.value)
    assert action == PARK and 1.0 <= after <= 2.0
    w = g.proto.window(60)
    assert (w["failures"], w["granted"], w["refused"]) == (3, 2, 1)


def test_retry_after_and_permanent_and_timeouts(rdb, dep, make_guard):
    publish(rdb, dep, backoff_base_ms=100, backoff_max_ms=100)
    g = make_guard(dep)

    def throttled_by_server():
        raise spillway.RetryAfter(5.0, RuntimeError("429"))

    with pytest.raises(spillway.CallFailed) as e:
        g.call(throttled_by_server)
    assert 5.0 <= e.value.after <= 7.5

    def invalid():
        raise spillway.Permanent(KeyError("no such vehicle"))

    with pytest.raises(KeyError):
        g.call(invalid)

    def slow():
        raise TimeoutError("read timed out")

    with pytest.raises(spillway.CallFailed):
        g.call(slow)
    w = g.proto.window(60)
    assert (w["successes"], w["failures"], w["timeouts"]) == (1, 1, 1)


def test_cancellations_free_the_slot_and_count_nothing(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    g = make_guard(dep)

    def shutting_down():
        raise spillway.Cancelled()

    with pytest.raises(spillway.Cancelled) as e:
        g.call(shutting_down)
    assert decide(e.value).action == DEFER

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        g.call(interrupted)
    with pytest.raises(SystemExit):
        with g.slot():
            raise SystemExit(1)
    w = g.proto.window(60)
    assert w["calls"] == 0, "cancelled calls count nothing against the dependency"
    assert g.proto.live_leases() == 0
    assert g.call(lambda: "slot free") == "slot free"


def test_lease_renewal_runs_while_the_call_runs_and_stops_when_it_raises(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    g = make_guard(dep, lease_ttl=1.0)
    g._renewer.idle = 0.2
    seen = {}

    def long_call():
        time.sleep(2.5)  # more than two TTLs: renewed or lost
        seen["live"] = g.proto.live_leases()
        raise RuntimeError("failed after a long time")

    with pytest.raises(spillway.CallFailed):
        g.call(long_call)
    assert seen["live"] == 1, "the lease outlived its TTL: it was renewed"
    assert g.renewals >= 2
    assert g.proto.live_leases() == 0
    assert g._renewer.scheduled() == 0
    renewals = g.renewals
    time.sleep(0.8)  # more than two renewal periods
    assert g.renewals == renewals, "no renewal after the call ended"
    eventually(lambda: not g._renewer.running(), timeout=3)


def test_a_lost_lease_is_released_as_cancelled_and_deferred(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    g = make_guard(dep, lease_ttl=0.3)

    def long_call():
        with_permit = permits[0]
        rdb.zrem(g.proto.keys.leases, with_permit.member)  # swept: the slot is gone
        assert with_permit.lost.wait(2.0), "renew must notice the lost lease"
        raise RuntimeError("gave up: lease lost")

    permits = []
    p = g.acquire()
    permits.append(p)
    with pytest.raises(spillway.LeaseLost) as e:
        with p:
            long_call()
    assert decide(e.value).action == DEFER
    assert g.proto.window(60)["calls"] == 0


def test_redis_unavailable_fails_closed_unless_a_local_cap_admits(own_redis, dep, make_guard):
    r = own_redis.client(socket_timeout=0.5)
    publish(r, dep, limit=5)
    closed = make_guard(dep, client=r, redis_timeout=0.1)
    fail_open = make_guard(dep, client=r, redis_timeout=0.1, fail_open_limit=1)
    own_redis.stop()
    with pytest.raises(spillway.RedisUnavailable) as e:
        closed.call(lambda: None)
    assert decide(e.value).action == DEFER
    with fail_open.slot() as p:
        assert p.local
        with pytest.raises(spillway.RedisUnavailable):
            fail_open.call(lambda: None)
    assert fail_open.call(lambda: "local again") == "local again"


def test_a_guard_refuses_a_client_that_may_wait_forever():
    with pytest.raises(ValueError, match="socket_timeout"):
        Guard(redis.Redis(port=1), "ns/dep", registry=None)


def test_an_unread_acquisition_is_forgotten(own_redis, dep, make_guard):
    r = own_redis.client(socket_timeout=1)
    publish(r, dep, limit=5)
    g = make_guard(dep, client=r, redis_timeout=0.1, lease_ttl=60)
    far = P.redis_now_ms(r) + 60000
    g.clock.deadline = lambda sent, wait: (far, 60.0)  # Redis would run it however late
    own_redis.pause()
    try:
        with pytest.raises(spillway.RedisUnavailable):
            g.call(lambda: None)
    finally:
        own_redis.resume()
    # The queued acquisition ran and took a lease; the forgetter made it stop counting.
    eventually(lambda: g._forget.forgotten == 1)
    assert g.proto.live_leases() == 0
    members = r.zrange(g.proto.keys.leases, 0, -1, withscores=True)
    assert [s for m, s in members if not m.startswith(b"encoding")] == [0.0]


def test_an_acquisition_that_runs_past_its_deadline_takes_nothing(own_redis, dep, make_guard):
    r = own_redis.client(socket_timeout=1)
    publish(r, dep, limit=5)
    g = make_guard(dep, client=r, redis_timeout=0.1, lease_ttl=60)
    g.call(lambda: None)  # one reply: the clock estimate is known
    handed = []
    g._forget.add = lambda member, expires: handed.append(member)
    own_redis.pause()
    try:
        with pytest.raises(spillway.RedisUnavailable):
            g.call(lambda: None)
        time.sleep(0.3)  # well past the request's deadline
    finally:
        own_redis.resume()
    assert len(handed) == 1
    eventually(lambda: r.ping())
    assert r.zscore(g.proto.keys.leases, handed[0]) is None, "refused as late: nothing written"
    assert g.proto.live_leases() == 0


def test_wait_for_slot_waits_for_a_release(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    g = make_guard(dep, wait_for_slot=True, max_wait=5)
    p = g.acquire()
    threading.Timer(0.2, p.done).start()
    t0 = time.monotonic()
    assert g.call(lambda: "after the release") == "after the release"
    assert time.monotonic() - t0 >= 0.15
    bounded = make_guard(dep, wait_for_slot=True, max_wait=0.2)
    with g.slot():
        with pytest.raises(spillway.Throttled):
            bounded.call(lambda: None)


def test_metrics_have_the_go_guards_names(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    reg = CollectorRegistry()
    g = make_guard(dep, registry=reg)
    g2 = make_guard(dep, registry=reg)  # a second guard shares the collectors
    g.call(lambda: None, Job(attempt=5))
    with g.slot():
        with pytest.raises(spillway.Throttled):
            g2.call(lambda: None)
    assert reg.get_sample_value("spillway_worker_calls_total",
                                {"dependency": dep, "outcome": "success", "attempt": "4+"}) == 2 - 1
    assert reg.get_sample_value("spillway_worker_throttled_total", {"dependency": dep, "reason": "slots"}) == 1
    with pytest.raises(spillway.Stale):
        g.call(lambda: None, Job(deadline=0.5))
    assert reg.get_sample_value("spillway_worker_stale_dropped_total", {"dependency": dep}) == 1


def test_redis_clock_takes_the_smallest_recent_offset():
    c = RedisClock(wall=lambda: 1000.0)
    assert c.deadline(5.0, 0.25) == (int((1000.0 + 1.25) * 1000), 1.25)  # before any reply
    c.observe(10.0, 2_000_010_500)  # offset 2e6 + 0.5 s
    c.observe(10.5, 2_000_010_700)  # offset 2e6 + 0.2 s: closer
    ms, late = c.deadline(11.0, 0.25)
    assert ms == int((2_000_000.2 + 11.0 + 0.25 + 0.002) * 1000)
    assert late == pytest.approx(0.252)
    c.reset(12.0, 2_000_020_000)  # refused as late: Redis's clock moved ahead
    assert c.deadline(12.0, 0.0)[0] == int((2_000_008.0 + 12.0 + 0.002) * 1000)


def test_errors_pickle_with_their_decision():
    import pickle
    e = spillway.CallFailed(1.5, cause=OSError("reset"))
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is spillway.CallFailed and decide(back) == (RETRY, 1.5) and "reset" in str(back)
    r = pickle.loads(pickle.dumps(spillway.RetryAfter(3.0, ValueError("429"))))
    assert r.after == 3.0 and isinstance(r.error, ValueError)


def test_past_max_call_lifetime_renewal_stops_and_a_failure_is_a_timeout(rdb, dep, make_guard):
    publish(rdb, dep, limit=1)
    g = make_guard(dep, lease_ttl=0.3, max_call_lifetime=0.4)

    def leaked():
        p = g.acquire()
        assert p.lost.wait(2.0), "the permit must give up at its lifetime"
        assert p.lifetime_exceeded
        return p

    p = leaked()
    with pytest.raises(spillway.CallFailed):
        p.done(RuntimeError("still running"))
    w = g.proto.window(60)
    assert (w["timeouts"], w["failures"]) == (1, 0)


def test_the_guard_needs_no_prometheus_client(redis_server, dep):
    import subprocess
    import sys
    code = f"""
import sys
sys.modules["prometheus_client"] = None  # as if it were not installed
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import redis, spillway
from conftest import publish
r = redis.Redis(port={redis_server.port}, socket_timeout=2)
publish(r, {dep!r}, limit=1)
g = spillway.Guard(r, {dep!r})
assert not g.metrics.enabled
print(g.call(lambda: "called"))
g.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "called"


def test_a_classify_that_raises_still_releases_the_slot(rdb, dep, make_guard):
    """A bug in a custom classify (it raises) must not leak the slot: the
    call is released as cancelled, and the classify's error reaches the
    caller (issue 21, item 4; TestPanicInClassifyReleasesTheSlot in Go)."""
    publish(rdb, dep, limit=1)

    def broken(exc):
        raise LookupError("classify bug")

    g = make_guard(dep, classify=broken)

    def fails():
        raise ValueError("the dependency failed")

    with pytest.raises(LookupError):
        g.call(fails)
    assert g.proto.live_leases() == 0, "the slot was freed"
    assert g.call(lambda: 7) == 7, "the next call is admitted at limit 1"
    w = g.proto.window(60)
    assert (w["failures"], w["timeouts"]) == (0, 0), "the broken classification counted no failure"
