"""The protocol client against a real redis-server: every reply of the
worker scripts (docs/protocol.md §4), and one round trip per operation."""

import time

import pytest
import redis

from spillway import protocol as P
from conftest import publish, state_fields


def client(rdb, dep):
    return P.Client(rdb, dep)


def evalsha_calls(rdb):
    return rdb.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def test_keys_carry_the_version_and_the_hash_tag():
    k = P.Keys.of(P.Dependency.parse("shop/payments"))
    assert k.state == "spillway:v4:{shop/payments}:state"
    assert k.leases == "spillway:v4:{shop/payments}:leases"
    assert k.job("order-42") == "spillway:v4:{shop/payments}:job:order-42"
    assert k.pools == "spillway:v4:{shop/payments}:pools"
    assert k.wants == "spillway:v4:{shop/payments}:wants"
    assert k.callers == "spillway:v4:{shop/payments}:callers"


@pytest.mark.parametrize("bad", ["nons", "Shop/x", "shop/", "/x", "shop/x_y", "a{b/c"])
def test_dependency_names_are_validated(bad):
    with pytest.raises(ValueError):
        P.Dependency.parse(bad)


def test_acquire_admits_up_to_the_limit_then_throttles(rdb, dep):
    publish(rdb, dep, limit=2)
    c = client(rdb, dep)
    a = c.acquire("l1", 5000)
    assert (a.code, a.limit, a.state, a.epoch) == (P.ADMITTED, 2, "Closed", 1)
    now = P.redis_now_ms(rdb)
    assert abs(a.now_ms - now) < 1000
    score = rdb.zscore(c.keys.leases, "l1")
    assert a.now_ms + 5000 - 1 <= score <= a.now_ms + 5000
    assert c.acquire("l2", 5000).code == P.ADMITTED
    t = c.acquire("l3", 5000)
    assert (t.code, t.held, t.limit) == (P.REFUSED_THROTTLED, 2, 2)
    assert 0 < t.wait_ms <= 5000
    assert rdb.zscore(c.keys.leases, "l3") is None, "a refusal takes no lease"
    assert c.live_leases() == 2
    # A slot refusal records per-call demand, which batching pools count:
    # the client's caller id scored in the callers set, one contender each.
    assert abs(int(rdb.zscore(c.keys.callers, c.caller_id)) - t.now_ms) <= 1
    assert rdb.hget(c.keys.wants, "percall") is None
    j = c.acquire("l4", 5000, job_key="j", job_version=1, job_ttl_ms=5000)
    assert j.code == P.REFUSED_THROTTLED
    assert rdb.zcard(c.keys.callers) == 1, "the same caller counts once"
    # An anonymous client's refusals count together, in the wants hash.
    anon = P.Client(rdb, dep, caller_id="")
    t = anon.acquire("l5", 5000)
    assert t.code == P.REFUSED_THROTTLED
    assert abs(int(rdb.hget(c.keys.wants, "percall")) - t.now_ms) <= 1
    assert rdb.zcard(c.keys.callers) == 1


def test_open_rate_and_superseded_refusals(rdb, dep):
    c = client(rdb, dep)
    until = P.redis_now_ms(rdb) + 3000
    publish(rdb, dep, state="Open", limit=0, open_until_ms=until)
    o = c.acquire("l1", 1000)
    assert o.code == P.REFUSED_OPEN and 2000 < o.wait_ms <= 3000

    publish(rdb, dep, epoch=2, limit=10, rate=5)  # burst 1, one call per 200ms
    assert c.acquire("l2", 1000).code == P.ADMITTED
    r = c.acquire("l3", 1000)
    assert r.code == P.REFUSED_RATE and 1 <= r.wait_ms <= 200

    publish(rdb, dep, epoch=3, limit=10)
    assert c.supersede("order-1", 7, 60000) == 7
    s = c.acquire("l4", 1000, job_key="order-1", job_version=6, job_ttl_ms=60000)
    assert (s.code, s.newest) == (P.REFUSED_SUPERSEDED, 7)
    ok = c.acquire("l5", 1000, job_key="order-1", job_version=7, job_ttl_ms=60000)
    assert ok.code == P.ADMITTED, "an equal version runs"


def test_no_policy_and_another_version(rdb, dep):
    c = client(rdb, dep)
    with pytest.raises(P.NoPolicyError):
        c.acquire("l1", 1000)
    with pytest.raises(P.NoPolicyError):
        c.budget()
    rdb.hset(c.keys.state, mapping={"version": "2", "state": "Closed", "limit": 5})
    with pytest.raises(P.VersionError):
        c.acquire("l1", 1000)
    with pytest.raises(P.VersionError):
        c.budget()
    # A manager two versions newer: the error names both versions and what to do.
    rdb.hset(c.keys.state, mapping={"version": str(P.MAX_STATE_VERSION + 1), "seq": 3, "epoch": 1,
                                    "manager_version": str(P.VERSION + 2), "manager_seq": 3})
    with pytest.raises(P.VersionError) as e:
        c.acquire("l1", 1000)
    assert (e.value.state_version, e.value.manager_version) == (P.MAX_STATE_VERSION + 1, P.VERSION + 2)
    assert f"manager at protocol version {P.VERSION + 2}" in str(e.value)
    assert f"speaks version {P.VERSION}" in str(e.value) and "upgrade this worker" in str(e.value)
    # Both state versions of the skew are acted on.
    for v in range(P.MIN_STATE_VERSION, P.MAX_STATE_VERSION + 1):
        rdb.hset(c.keys.state, "version", str(v))
        assert c.acquire(f"v{v}", 1000).code == P.ADMITTED


def test_register_records_client_and_version(rdb, dep):
    c = client(rdb, dep)
    c.register("python", "proc-1")
    members = rdb.zrange(c.keys.clients, 0, -1)
    assert members == [f"python {P.VERSION} proc-1".encode()] or members == [f"python {P.VERSION} proc-1"]
    with pytest.raises(ValueError):
        c.register("python", "with space")


def test_a_late_acquisition_takes_nothing(rdb, dep):
    publish(rdb, dep, limit=5)
    c = client(rdb, dep)
    past = P.redis_now_ms(rdb) - 10
    a = c.acquire("late", 5000, deadline_ms=past)
    assert a.code == P.REFUSED_LATE and a.now_ms > past
    assert rdb.zscore(c.keys.leases, "late") is None
    future = P.redis_now_ms(rdb) + 5000
    assert c.acquire("ontime", 5000, deadline_ms=future).code == P.ADMITTED


def test_release_counts_outcomes_and_a_cancellation_counts_nothing(rdb, dep):
    publish(rdb, dep, limit=5)
    c = client(rdb, dep)
    for lease, outcome, attempt in (("a", "s", 1), ("b", "f", 2), ("c", "t", 7), ("d", "c", 1)):
        assert c.acquire(lease, 5000).code == P.ADMITTED
        assert c.release(lease, outcome, attempt) is True
    w = c.window(60)
    assert (w["calls"], w["successes"], w["failures"], w["timeouts"]) == (3, 1, 1, 1)
    assert (w["a1"], w["a2"], w["a3"], w["a4"]) == (1, 1, 0, 1)
    assert c.live_leases() == 0
    assert c.release("never-held", "s", 1) is False  # counts nothing (docs/protocol.md §4a)
    assert c.window(60)["calls"] == 3
    with pytest.raises(ValueError):
        c.release("x", "z", 1)


def test_a_cancelled_probe_gives_its_probe_back(rdb, dep):
    publish(rdb, dep, state="HalfOpen", limit=1, epoch=4)
    c = client(rdb, dep)
    a = c.acquire("p1", 5000)
    assert (a.code, a.state, a.epoch) == (P.ADMITTED, "HalfOpen", 4)
    assert c.acquire("p2", 5000).code == P.REFUSED_THROTTLED, "one probe per epoch"
    c.release("p1", "c", 1, epoch=4)
    assert c.acquire("p3", 5000).code == P.ADMITTED, "the cancelled probe was given back"
    c.release("p3", "s", 1, epoch=4)
    assert rdb.hget(c.keys.probes, "s") == b"1"


def test_renew_extends_a_held_lease_and_never_revives_a_lost_one(rdb, dep):
    publish(rdb, dep, limit=5)
    c = client(rdb, dep)
    c.acquire("l1", 50)
    assert c.renew("l1", 10000) is True
    assert rdb.zscore(c.keys.leases, "l1") > P.redis_now_ms(rdb) + 9000
    c.acquire("l2", 20)
    time.sleep(0.05)
    assert c.renew("l2", 10000) is False
    assert rdb.zscore(c.keys.leases, "l2") is None


def test_forget_before_the_acquisition_runs_keeps_the_lease_expired(rdb, dep):
    publish(rdb, dep, limit=5)
    c = client(rdb, dep)
    c.forget("ghost")
    a = c.acquire("ghost", 30000)  # ran after the forget: ZADD NX leaves it expired
    assert a.code == P.ADMITTED
    assert c.live_leases() == 0
    c.acquire("held", 30000)
    c.forget("held")
    assert c.live_leases() == 0


def test_budget_grants_min_retries_then_refuses(rdb, dep):
    publish(rdb, dep, ratio_ppm=0, min_retries=2, backoff_base_ms=250, backoff_max_ms=4000, jitter="Equal")
    c = client(rdb, dep)
    d1, d2, d3 = c.budget(), c.budget(), c.budget()
    assert (d1.allowed, d2.allowed, d3.allowed) == (True, True, False)
    assert (d3.granted, d3.backoff_base_ms, d3.backoff_max_ms, d3.jitter) == (2, 250, 4000, "Equal")


def test_every_operation_is_one_round_trip(rdb, dep):
    publish(rdb, dep, limit=5)
    c = client(rdb, dep)
    c.acquire("warm", 1000)
    c.release("warm", "s", 1)  # scripts loaded
    before = evalsha_calls(rdb)
    stats_before = rdb.info("commandstats")
    c.acquire("l1", 1000)
    c.release("l1", "s", 1)
    assert evalsha_calls(rdb) - before == 2
    stats = rdb.info("commandstats")
    for cmd in ("cmdstat_eval", "cmdstat_script|load", "cmdstat_script"):
        assert stats.get(cmd, {}).get("calls", 0) == stats_before.get(cmd, {}).get("calls", 0), cmd


def test_scripts_load_on_noscript_and_work_with_decoded_replies(redis_server, dep):
    r = redis_server.client(decode_responses=True)
    publish(r, dep, limit=1)
    r.script_flush()
    c = client(r, dep)
    a = c.acquire("l1", 1000)
    assert (a.code, a.state) == (P.ADMITTED, "Closed")
    assert c.release("l1", "s", 1)
    assert r.script_exists(P.SCRIPTS["acquire"].sha) == [True]


def test_unsent_and_unread_are_told_apart(own_redis, dep):
    r = own_redis.client(socket_timeout=0.2)
    publish(r, dep, limit=1)
    c = client(r, dep)
    own_redis.pause()
    try:
        with pytest.raises(P.RedisUnread):
            c.acquire("l1", 1000, timeout=0.1)
    finally:
        own_redis.resume()
    own_redis.stop()
    with pytest.raises(P.RedisUnsent):
        c.acquire("l2", 1000, timeout=0.1)


def test_release_reports_how_long_a_success_took(rdb, dep):
    """A release given the call's duration adds it to the window's success
    latency (ds/dn, docs/protocol.md); failures and untimed releases do not."""
    publish(rdb, dep, limit=10)
    c = client(rdb, dep)
    for outcome, took in (("s", 0.1), ("s", 0.3), ("f", 0.01), ("s", None)):
        adm = c.acquire("lease-%s-%s" % (outcome, took), 10_000)
        c.release(adm.member, outcome, 1, took=took)
    w = c.window(60)
    assert (w["successes"], w["timed_successes"], w["success_micros"]) == (3, 2, 400_000)


def test_failures_trip_the_breaker_in_the_fleets_path(rdb, dep):
    """A Python worker's releases trip the breaker as Go's do (lib.lua trip):
    the minCalls-th failure at ratio 0.5 writes Open, limit 0, the trip's
    time and the state it replaced, announces it, and acquisitions are then
    refused; a success never trips, a probe's failure is not counted here."""
    now = P.redis_now_ms(rdb)
    fields = state_fields(limit=8)
    fields.update({"trip_on": 1, "trip_failure_ratio": "0.5", "trip_min_calls": 10,
                   "trip_since_ms": now - 60000, "trip_open_ms": 7000, "trip_acked_ms": 0})
    c = client(rdb, dep)
    assert c.publish(1, fields)[0] == 1
    sub = rdb.pubsub()
    sub.subscribe(c.keys.state[: -len("state")] + "changes")
    assert sub.get_message(timeout=1)["type"] == "subscribe"
    for _ in range(9):
        c.release("", P.FAILURE, 1)
    assert rdb.hget(c.keys.state, "state") == b"Closed", "below minCalls"
    c.release("", P.SUCCESS, 1)
    assert rdb.hget(c.keys.state, "state") == b"Closed", "a success never trips"
    c.release("", P.FAILURE, 1)
    st = {k.decode(): v.decode() for k, v in rdb.hgetall(c.keys.state).items()}
    assert (st["state"], st["limit"], st["tripped_from"], st["epoch"]) == ("Open", "0", "Closed", "1")
    assert int(st["open_until_ms"]) == int(st["tripped_at_ms"]) + 7000
    msg = sub.get_message(timeout=1)
    assert msg and msg["data"] == b"1 Open 0"
    sub.close()
    assert c.acquire("l1", 1000).code == P.REFUSED_OPEN


def test_publish_writes_the_state_version_its_workers_and_the_previous_ones_act_on(rdb, dep):
    # A manager at N writes state version N - 1 and names itself: workers at
    # N - 1 and N both act on it (lib.lua version_refusal).
    publish(rdb, dep)
    st = rdb.hgetall(P.Keys.of(P.Dependency.parse(dep)).state)
    assert (st[b"version"], st[b"manager_version"]) == (str(P.VERSION - 1).encode(), str(P.VERSION).encode())
    assert (st[b"version"], st[b"manager_version"]) == (b"5", b"6")
