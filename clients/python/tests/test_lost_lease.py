"""A lost lease reaches the call (pass_permit, current_permit, a Celery
task's self.spillway_permit), a call that ends after it is counted nowhere
('c'), a process admits no new call while it runs more calls than the
leases it holds, and Guard.close() marks the running calls' leases lost.
The fleet test pauses a real redis-server (SIGSTOP) for longer than the
lease TTL under a fleet of three guards and measures the calls in flight
above the limit once Redis resumes."""

import random
import threading
import time

import pytest

import spillway
from spillway import Guard, Job, current_permit
from conftest import publish


@pytest.fixture
def guards():
    made = []

    def make(client, dep, **kw):
        kw.setdefault("registry", None)
        kw.setdefault("rand", random.Random(len(made)))
        g = Guard(client, dep, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def drop_lease(rdb, g, permit):
    rdb.zrem(g.proto.keys.leases, permit.member)  # swept: the slot is gone


def test_the_call_gets_its_permit_and_a_success_after_the_loss_counts_nothing(rdb, dep, guards):
    publish(rdb, dep, limit=2)
    g = guards(rdb, dep, lease_ttl=0.3)
    assert current_permit() is None

    def long_call(permit):
        assert current_permit() is permit
        drop_lease(rdb, g, permit)
        assert permit.lost.wait(2.0), "renew must notice the lost lease"
        return "finished anyway"

    assert g.call(long_call, pass_permit=True) == "finished anyway", "a success is still returned"
    assert current_permit() is None
    w = g.proto.window(60)
    assert (w["calls"], w["successes"]) == (0, 0), "a call that ended after its lease was lost is counted 'c'"
    assert (g.in_flight, g.lost_in_flight) == (0, 0)

    def checking(permit):
        drop_lease(rdb, g, permit)
        while True:
            permit.raise_if_lost()
            time.sleep(0.01)

    with pytest.raises(spillway.LeaseLost) as e:
        g.call(checking, pass_permit=True)
    assert spillway.decide(e.value).action == spillway.DEFER
    with g.slot() as p:
        assert current_permit() is p
    assert g.proto.window(60)["calls"] == 1


def test_a_process_with_a_lost_call_running_admits_nothing_until_it_ends(rdb, dep, guards):
    publish(rdb, dep, limit=4)
    g = guards(rdb, dep, lease_ttl=0.3)
    other = guards(rdb, dep, lease_ttl=0.3)
    p = g.acquire()
    drop_lease(rdb, g, p)
    assert p.lost.wait(2.0)
    with pytest.raises(spillway.Throttled, match="lease was lost"):
        g.call(lambda: None)
    assert other.call(lambda: "another process") == "another process"
    p.done(None)
    assert g.call(lambda: "admitted again") == "admitted again"


def test_close_marks_the_running_calls_lost(rdb, dep, guards):
    publish(rdb, dep, limit=2)
    g = guards(rdb, dep, lease_ttl=5.0)
    started, seen = threading.Event(), {}

    def long_call(permit):
        started.set()
        seen["lost"] = permit.lost.wait(5.0)
        permit.raise_if_lost()

    t = threading.Thread(target=lambda: seen.setdefault("err", _raised(g.call, long_call, pass_permit=True)))
    t.start()
    assert started.wait(5.0)
    g.close()
    t.join(5.0)
    assert seen["lost"], "close() must tell the running call its lease will not be renewed"
    assert isinstance(seen["err"], spillway.LeaseLost)
    assert g.proto.window(60)["calls"] == 0 and g.proto.live_leases() == 0


def _raised(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except BaseException as e:  # noqa: B902
        return e
    return None


LIMIT = 3
TTL = 1.0
PAUSE = 2.5  # longer than the lease TTL


def test_a_paused_redis_longer_than_the_ttl_leaves_no_call_above_the_limit(own_redis, dep, guards):
    """Three guards (processes) of three workers each, limit 3, calls of
    3 s that watch permit.lost; one more call in guard 0 ignores it. Redis
    is paused for 2.5 s (> lease_ttl 1 s) while the limit's calls run.
    Bound (clients/python/README.md): after Redis resumes the fleet runs at
    most limit + the calls that ignore a lost lease, and a process with
    such a call admits nothing until it ends."""
    rdb = own_redis.client(socket_timeout=1)
    publish(rdb, dep, limit=LIMIT + 1, min_retries=1000)  # + 1: the stubborn call's slot
    fleet = [guards(own_redis.client(socket_timeout=1), dep, lease_ttl=TTL, redis_timeout=0.1)
             for _ in range(3)]
    lock = threading.Lock()
    state = {"in_flight": 0, "resumed": None, "peak_after": 0, "starts": [], "stop": False}

    def work(gi):
        def fn(permit):
            with lock:
                state["in_flight"] += 1
                state["starts"].append((time.monotonic(), gi))
                if state["resumed"] is not None:
                    state["peak_after"] = max(state["peak_after"], state["in_flight"])
            try:
                end = time.monotonic() + 3.0
                while time.monotonic() < end and not state["stop"]:
                    permit.raise_if_lost()
                    time.sleep(0.01)
            finally:
                with lock:
                    state["in_flight"] -= 1
        return fn

    def worker(gi):
        g = fleet[gi]
        while not state["stop"]:
            try:
                g.call(work(gi), Job(), pass_permit=True)
            except spillway.SpillwayError as e:
                time.sleep(min(e.after, 0.05) or 0.01)

    stubborn_stop = threading.Event()
    stubborn_lost = {}

    def stubborn(permit):
        with lock:
            state["in_flight"] += 1
        try:
            stubborn_stop.wait(30)  # never looks at permit.lost
            stubborn_lost["lost"] = permit.lost.is_set()
        finally:
            with lock:
                state["in_flight"] -= 1

    st = threading.Thread(target=lambda: fleet[0].call(stubborn, pass_permit=True))
    st.start()
    time.sleep(0.2)
    # The stubborn call holds one slot of LIMIT + 1: the workers share LIMIT.
    threads = [threading.Thread(target=worker, args=(gi,)) for gi in range(3) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while state["in_flight"] < LIMIT + 1:
            assert time.monotonic() < deadline, "the fleet never filled its slots"
            time.sleep(0.01)
        own_redis.pause()
        time.sleep(PAUSE)
        own_redis.resume()
        with lock:
            state["resumed"] = time.monotonic()
            state["peak_after"] = state["in_flight"]
        time.sleep(1.5)
        stubborn_ended = time.monotonic()
        stubborn_stop.set()
        st.join(10)
        time.sleep(1.5)
        with lock:
            peak_after_stubborn = 0
        # From here on only the workers run: sample until they stop.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            with lock:
                peak_after_stubborn = max(peak_after_stubborn, state["in_flight"])
            time.sleep(0.005)
    finally:
        state["stop"] = True
        stubborn_stop.set()
        for t in threads:
            t.join(10)
        own_redis.resume()

    resumed = state["resumed"]
    assert stubborn_lost.get("lost"), "the stubborn call's lease was lost during the pause"
    admitted_by_0 = [t for t, gi in state["starts"] if gi == 0 and resumed <= t < stubborn_ended]
    assert admitted_by_0 == [], "a process running a lost call admitted a new one"
    assert [t for t, _ in state["starts"] if t >= resumed], "the fleet admitted nothing after Redis resumed"
    excess = state["peak_after"] - (LIMIT + 1)
    print(f"paused redis {PAUSE}s, lease_ttl {TTL}s, limit {LIMIT + 1}: peak {state['peak_after']} calls in flight "
          f"after resume ({excess} above the limit, 1 stubborn), {peak_after_stubborn} once it ended")
    assert excess <= 1, f"{state['peak_after']} calls in flight after Redis resumed, limit {LIMIT + 1} + 1 stubborn"
    assert peak_after_stubborn <= LIMIT + 1
