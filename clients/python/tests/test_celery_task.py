"""GuardedTask's decisions, run eagerly with Task.apply (no worker, no
broker): what each guard decision does to the task, against a real
redis-server. test_celery.py runs a real worker through an outage."""

import logging
import random
import time

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from prometheus_client import CollectorRegistry

from spillway import DEFER, RETRY
from spillway.celery import DEADLINE_HEADER, GuardedTask
from conftest import publish


@pytest.fixture
def app(redis_server):
    a = Celery("guarded", broker="memory://", backend="cache+memory://")
    a.conf.spillway_redis_url = f"redis://127.0.0.1:{redis_server.port}/0"
    return a


def make_task(app, dep, body, **opts):
    reg = CollectorRegistry()

    @app.task(bind=True, base=GuardedTask, spillway_dependency=dep, name=f"t-{dep}",
              spillway_guard_options={"registry": reg, "rand": random.Random(3)}, **opts)
    def task(self, vehicle_id, **kwargs):
        return body(self, vehicle_id, **kwargs)

    return task, reg


def test_a_stale_task_is_dropped_with_a_log_line_and_a_metric(app, rdb, dep, caplog):
    publish(rdb, dep, limit=1)
    calls = []
    task, reg = make_task(app, dep, lambda self, v: calls.append(v))
    with caplog.at_level(logging.WARNING, logger="spillway.celery"):
        r = task.apply(("v1",), headers={DEADLINE_HEADER: time.time() - 1})
    assert r.state == "IGNORED" and calls == []
    assert "Dropped task" in caplog.text and "stale" in caplog.text
    assert reg.get_sample_value("spillway_worker_stale_dropped_total", {"dependency": dep}) == 1


def test_a_superseded_task_is_dropped(app, rdb, dep, caplog):
    publish(rdb, dep, limit=1)
    calls = []
    task, reg = make_task(app, dep, lambda self, v, version: calls.append(v),
                          spillway_job=lambda args, kwargs: (f"vehicle-{args[0]}", kwargs.get("version", 0)))
    task.guard.supersede("vehicle-v1", 2)
    assert task.apply(("v1",), {"version": 2}).state == "SUCCESS", "the newest version runs"
    with caplog.at_level(logging.WARNING, logger="spillway.celery"):
        r = task.apply(("v1",), {"version": 1})
    assert r.state == "IGNORED" and calls == ["v1"]
    assert "superseded" in caplog.text
    assert reg.get_sample_value("spillway_worker_superseded_total", {"dependency": dep}) == 1


def as_worker(task, args, retries, deadline=None):
    """Run the task as a worker would (not eagerly): the Retry it raises
    carries the signature it sent to the (in-memory) broker."""
    task.push_request(id="task-1", args=args, kwargs={}, retries=retries, called_directly=False,
                      is_eager=False, delivery_info={}, **({DEADLINE_HEADER: deadline} if deadline else {}))
    try:
        return task(*args)
    finally:
        task.pop_request()


def test_a_refusal_defers_without_consuming_an_attempt(app, rdb, dep):
    publish(rdb, dep, limit=1)
    task, _ = make_task(app, dep, lambda self, v: v)
    deadline = time.time() + 600
    with task.guard.slot():  # the fleet's only slot is held
        with pytest.raises(Retry) as r:
            as_worker(task, ("v1",), retries=2, deadline=deadline)
    assert 0.1 <= r.value.when <= 0.2
    assert r.value.sig.options["retries"] == 2, "a deferral keeps the retry count"
    assert r.value.sig.options["headers"][DEADLINE_HEADER] == deadline, "and the deadline"
    assert r.value.sig.options["countdown"] == r.value.when
    with task.guard.slot():
        assert task.apply(("v1",)).state == "FAILURE", "run eagerly, the caller gets the refusal"


def test_a_failure_retries_with_the_published_backoff_then_parks(app, rdb, dep):
    publish(rdb, dep, limit=1, backoff_base_ms=300, backoff_max_ms=300, jitter="None", min_retries=1, ratio_ppm=0)

    def failing(self, v):
        raise RuntimeError("vehicle api answered 503")

    task, reg = make_task(app, dep, failing, max_retries=None)
    with pytest.raises(Retry) as r:
        as_worker(task, ("v1",), retries=0)
    assert r.value.when == pytest.approx(0.3)
    assert r.value.sig.options["retries"] == 1, "a failed call is an attempt"
    with pytest.raises(Retry) as r:
        as_worker(task, ("v1",), retries=1)  # the budget (1 retry) is spent: park
    assert 0.3 <= r.value.when <= 0.6
    assert reg.get_sample_value("spillway_worker_budget_refusals_total", {"dependency": dep}) == 1


def test_max_retries_counts_failed_calls_only(app, rdb, dep):
    publish(rdb, dep, limit=1, min_retries=100)

    def failing(self, v):
        raise RuntimeError("vehicle api answered 503")

    task, _ = make_task(app, dep, failing, max_retries=2)
    with task.guard.slot():
        with pytest.raises(Retry):
            as_worker(task, ("v1",), retries=5)  # a refusal is deferred past max_retries
    with pytest.raises(RuntimeError, match="503"):
        as_worker(task, ("v1",), retries=2)


def granted(rdb, dep):
    from spillway import protocol as P
    return P.Client(rdb, dep).window(600)["granted"]


def test_a_bodys_own_retry_is_one_message_with_the_fleets_backoff(app, rdb, dep):
    publish(rdb, dep, limit=1, backoff_base_ms=300, backoff_max_ms=300, jitter="None", min_retries=100)
    sent = []

    def body(self, v, countdown=None):
        try:
            raise RuntimeError("vehicle api answered 503")
        except RuntimeError as e:
            raise self.retry(exc=e, countdown=countdown)

    task, reg = make_task(app, dep, body, max_retries=None)
    real = task.signature_from_request

    def counting(*a, **kw):
        sig = real(*a, **kw)
        orig = sig.apply_async
        sig.apply_async = lambda *x, **y: sent.append(sig) or orig(*x, **y)
        return sig

    task.signature_from_request = counting
    with pytest.raises(Retry) as r:
        as_worker(task, ("v1",), retries=0)
    assert len(sent) == 1, f"{len(sent)} messages for one failure"
    assert r.value.when == pytest.approx(0.3), "no countdown of its own: the fleet's backoff"
    assert r.value.sig.options["retries"] == 1
    assert granted(rdb, dep) == 1, "charged to the fleet's budget once"
    assert reg.get_sample_value("spillway_worker_calls_total", {"dependency": dep, "outcome": "failure", "attempt": "1"}) == 1

    sent.clear()
    task.push_request(id="task-2", args=("v1",), kwargs={"countdown": 7}, retries=0, called_directly=False,
                      is_eager=False, delivery_info={})
    try:
        with pytest.raises(Retry) as r:
            task("v1", countdown=7)
    finally:
        task.pop_request()
    assert len(sent) == 1 and r.value.when == 7, "the body's own countdown is kept"
    assert granted(rdb, dep) == 2


def test_autoretry_for_is_one_message_per_failure_and_parks_when_the_budget_is_spent(app, rdb, dep):
    publish(rdb, dep, limit=1, backoff_base_ms=300, backoff_max_ms=300, jitter="None", min_retries=1, ratio_ppm=0)
    sent = []

    def body(self, v):
        raise RuntimeError("vehicle api answered 503")

    task, reg = make_task(app, dep, body, max_retries=5, autoretry_for=(RuntimeError,))
    real = task.signature_from_request

    def counting(*a, **kw):
        sig = real(*a, **kw)
        orig = sig.apply_async
        sig.apply_async = lambda *x, **y: sent.append(sig) or orig(*x, **y)
        return sig

    task.signature_from_request = counting
    with pytest.raises(Retry) as r:
        as_worker(task, ("v1",), retries=0)
    assert len(sent) == 1 and r.value.when == pytest.approx(0.3)
    with pytest.raises(Retry) as r:
        as_worker(task, ("v1",), retries=1)  # the budget (1 retry) is spent: park
    assert len(sent) == 2 and 0.3 <= r.value.when <= 0.6
    assert r.value.sig.options["retries"] == 2
    assert reg.get_sample_value("spillway_worker_budget_refusals_total", {"dependency": dep}) == 1
    with pytest.raises(RuntimeError, match="503"):
        as_worker(task, ("v1",), retries=5)  # the last attempt: no retry, no budget asked
    assert len(sent) == 2 and granted(rdb, dep) == 1


@pytest.mark.parametrize("raised", [Ignore(), Reject("no", requeue=False)])
def test_ignore_and_reject_pass_through_uncounted(app, rdb, dep, raised):
    publish(rdb, dep, limit=1, min_retries=100)

    def body(self, v):
        raise raised

    task, reg = make_task(app, dep, body)
    with pytest.raises(type(raised)):
        as_worker(task, ("v1",), retries=0)
    from spillway import protocol as P
    w = P.Client(rdb, dep).window(600)
    assert (w["failures"], w["granted"], w["refused"]) == (0, 0, 0), w
    assert task.guard.proto.live_leases() == 0
