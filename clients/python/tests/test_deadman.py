"""Calls the dead-man rule admits (docs/protocol.md §7) against a real
redis-server: in a stale HalfOpen they are not probes, as in pkg/guard
(TestDeadManCallsInHalfOpenAreNotProbes)."""

import random
import time

import pytest

import spillway
from spillway import Guard
from spillway import protocol as P
from conftest import publish


def test_dead_man_calls_in_half_open_are_not_probes(rdb, dep):
    """A HalfOpen that no controller refreshed for its dead-man bound admits
    calls by the dead-man rule. They are not probes: a cancelled one gives
    back no probe (probes.admitted keeps counting the epoch's one real
    probe), and their outcomes go to the stats, never toward closing the
    breaker. The real probe, admitted before the state went stale, counts."""
    publish(rdb, dep, epoch=5, state="HalfOpen", limit=3, capacity=40, half_open_probes=3, stale_after_ms=300)
    g = Guard(rdb, dep, registry=None, rand=random.Random(1))
    try:
        def admitted():
            return int(rdb.hget(g.proto.keys.probes, "admitted") or 0)

        probe = g.acquire()
        assert probe.state == P.HALF_OPEN
        assert admitted() == 1
        time.sleep(0.4)  # past the dead-man bound: no controller published

        cancelled = g.acquire()
        succeeded = g.acquire()
        assert (cancelled.state, succeeded.state) == (P.OPEN, P.OPEN), "dead-man admissions answer Open"
        assert admitted() == 1, "dead-man admissions take no probe"
        with pytest.raises(spillway.Cancelled):
            cancelled.done(spillway.Cancelled())
        succeeded.done()
        assert admitted() == 1, "a cancelled dead-man call gave back a probe it never took"
        w = g.proto.window(60)
        assert w["probe_successes"] == 0, "a dead-man call counted toward closing the breaker"
        assert w["successes"] == 1, "its outcome goes to the stats like any call's"

        probe.done()
        assert g.proto.window(60)["probe_successes"] == 1, "the epoch's real probe counts"
    finally:
        g.close()
