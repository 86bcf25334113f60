"""A Redis that evicts keys (maxmemory-policy other than noeviction) may drop
leases and the published state under memory pressure: the guard refuses to
start on it, unless allow_eviction=True, which sets the
spillway_worker_redis_evicting gauge (as pkg/guard's AllowEviction)."""

import pytest
from prometheus_client import CollectorRegistry

from spillway import Guard
from conftest import RedisServer, publish


@pytest.fixture
def evicting_redis():
    s = RedisServer("--maxmemory-policy", "allkeys-lru")
    yield s
    s.close()


def test_guard_refuses_a_redis_that_evicts_keys(evicting_redis, dep):
    rdb = evicting_redis.client()
    publish(rdb, dep)
    with pytest.raises(ValueError, match=r"allkeys-lru.*noeviction.*allow_eviction"):
        Guard(rdb, dep, registry=None)

    reg = CollectorRegistry()
    with Guard(rdb, dep, registry=reg, allow_eviction=True) as g:
        assert g.call(lambda: "ok") == "ok"
    assert reg.get_sample_value("spillway_worker_redis_evicting", {"dependency": dep}) == 1.0


def test_evicting_gauge_is_zero_on_noeviction(rdb, dep):
    reg = CollectorRegistry()
    with Guard(rdb, dep, registry=reg):
        pass
    assert reg.get_sample_value("spillway_worker_redis_evicting", {"dependency": dep}) == 0.0
