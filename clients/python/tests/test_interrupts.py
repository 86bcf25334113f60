"""Interrupts leak nothing: a KeyboardInterrupt, or Celery's
SoftTimeLimitExceeded (an Exception, raised by a signal handler between two
bytecodes), that lands between the admission and the call's try, or on the
way into done(), leaves no lease held in a real redis-server, no renewal
scheduled, no call counted in flight and no current permit. The interrupt
is injected at each of those points by wrapping the guard's own step there,
so each case is exact (a signal at a random instant hits them rarely)."""

import random
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded

import spillway
from spillway import Guard, Permit
from conftest import publish


def interrupt_in_admitted_before_the_permit(g, exc, monkeypatch):
    monkeypatch.setattr(g, "_admitted", lambda *a: (_ for _ in ()).throw(exc()))


def interrupt_as_admitted_returns(g, exc, monkeypatch):
    orig = g._admitted

    def admitted(*a):
        orig(*a)
        raise exc()
    monkeypatch.setattr(g, "_admitted", admitted)


def interrupt_as_acquire_returns(g, exc, monkeypatch):
    orig = g.acquire

    def acquire(*a, **kw):
        orig(*a, **kw)
        raise exc()
    monkeypatch.setattr(g, "acquire", acquire)


def interrupt_on_the_way_into_done(g, exc, monkeypatch):
    orig = Permit.done
    hit = []

    def done(self, *a, **kw):
        if not hit:
            hit.append(1)
            raise exc()
        return orig(self, *a, **kw)
    monkeypatch.setattr(Permit, "done", done)


POINTS = [interrupt_in_admitted_before_the_permit, interrupt_as_admitted_returns,
          interrupt_as_acquire_returns, interrupt_on_the_way_into_done]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SoftTimeLimitExceeded])
@pytest.mark.parametrize("point", POINTS, ids=lambda f: f.__name__)
def test_an_interrupt_between_admission_and_the_call_leaks_nothing(redis_server, dep, point, exc, monkeypatch):
    rdb = redis_server.client()
    publish(rdb, dep, limit=1, min_retries=1000)
    # A lease that leaked would hold the only slot for the TTL, renewed on.
    g = Guard(redis_server.client(), dep, lease_ttl=30.0, registry=None, rand=random.Random(1))
    try:
        point(g, exc, monkeypatch)
        with pytest.raises((exc, spillway.SpillwayError)):
            g.call(lambda: "ran")
        monkeypatch.undo()
        deadline = time.monotonic() + 3
        while g.proto.live_leases() and time.monotonic() < deadline:
            time.sleep(0.02)  # the forgetter drops a lease whose Permit never existed
        assert g.proto.live_leases() == 0, "the interrupted call's lease is still held"
        assert g._renewer.scheduled() == 0, "the interrupted call's lease is still renewed"
        assert (g.in_flight, g.lost_in_flight) == (0, 0)
        assert spillway.current_permit() is None
        assert g.call(lambda: "the only slot is free") == "the only slot is free"
    finally:
        g.close()
