"""Redis Cluster, like the Go guard: a real 3-master cluster of redis-server
processes on 127.0.0.1, formed by the test as internal/redistest/cluster.go
forms one (CLUSTER ADDSLOTSRANGE, CLUSTER MEET), and redis-py's
RedisCluster. Every key of one dependency shares a hash slot (its hash tag);
dependencies spread over the masters; two guards share one fleet-wide limit
and the failure and retry-budget path works across the cluster."""

import random
import time

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

import spillway
from spillway import Guard
from spillway import protocol as P
from conftest import RedisServer, free_port, publish

MASTERS = 3
SLOTS = 16384


@pytest.fixture(scope="module")
def cluster():
    buses = [free_port() for _ in range(MASTERS)]  # cluster-port: the bus port need not be port + 10000
    nodes = []
    try:
        for i in range(MASTERS):
            nodes.append(RedisServer("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf",
                                     "--cluster-port", str(buses[i])))
        clients = [n.client() for n in nodes]
        per = SLOTS // MASTERS
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, SLOTS - 1 if i == MASTERS - 1 else (i + 1) * per - 1)
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port, buses[0])
        deadline = time.monotonic() + 30
        while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients):
            assert time.monotonic() < deadline, "the cluster never agreed"
            time.sleep(0.05)
        rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in nodes], socket_timeout=1)
        yield rc, nodes
        rc.close()
    finally:
        for n in nodes:
            n.close()


def test_a_dependencys_keys_share_a_slot_and_dependencies_spread(cluster):
    rc, nodes = cluster
    masters = set()
    for i in range(12):
        k = P.Keys.of(P.Dependency.parse(f"team-{i}/api"))
        slots = {rc.keyslot(key) for key in (k.state, k.leases, k.gcra, k.stats, k.probes, k.job("vin-1"))}
        assert len(slots) == 1, f"the keys of one dependency span slots {slots}"
        masters.add(rc.get_node_from_key(k.state).port)
    assert len(masters) == MASTERS, f"12 dependencies landed on {len(masters)} of {MASTERS} masters"


def test_guards_on_a_cluster_share_the_limit_and_the_budget(cluster, dep):
    rc, _ = cluster
    publish(rc, dep, limit=2, backoff_base_ms=100, backoff_max_ms=100, jitter="None", min_retries=1, ratio_ppm=0)
    a = Guard(rc, dep, registry=None, rand=random.Random(1))
    b = Guard(rc, dep, registry=None, rand=random.Random(2))
    try:
        with a.slot(), b.slot():
            with pytest.raises(spillway.Throttled):
                a.call(lambda: "over the limit")
            with pytest.raises(spillway.Throttled):
                b.call(lambda: "over the limit")
            assert a.proto.live_leases() == 2
        assert b.call(lambda: "free again") == "free again"

        def failing():
            raise RuntimeError("503")

        with pytest.raises(spillway.CallFailed) as e:
            a.call(failing)
        assert e.value.after == pytest.approx(0.1), "the published backoff, read from the dependency's master"
        with pytest.raises(spillway.BudgetExhausted):
            b.call(failing)  # the fleet's budget (1 retry) is spent
        w = a.proto.window(60)
        assert (w["calls"], w["successes"], w["failures"], w["granted"], w["refused"]) == (5, 3, 2, 1, 1), w
        assert a.proto.live_leases() == 0
    finally:
        a.close()
        b.close()
