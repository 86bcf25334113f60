"""A real Celery worker (prefork, two processes; Redis broker and result
backend on loopback) runs the seed's vehicle-API task through an outage of
the API: no task is lost, the guard's decisions defer the retries (a
refusal consumes no attempt), nothing reaches the API while the breaker is
Open, the API never sees more calls at once than the limit, and tasks past
their deadline are dropped with a log line and the DROPPED state."""

import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import publish

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 1  # below the worker's two processes: the limit, not the pool, bounds the calls


class VehicleAPI:
    """A loopback HTTP dependency that counts calls in flight and can be down."""

    def __init__(self):
        self.lock = threading.Lock()
        self.up = True
        self.in_flight = 0
        self.peak = 0
        self.calls = []  # (time, vehicle, attempt, status)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                vehicle = self.path.split("/")[2].split("?")[0]
                attempt = int(self.path.split("attempt=")[1])
                with api.lock:
                    api.in_flight += 1
                    api.peak = max(api.peak, api.in_flight)
                    up = api.up
                time.sleep(0.02)
                status = 200 if up else 503
                body = json.dumps({"vin": vehicle, "make": "Volvo"}).encode()
                with api.lock:
                    api.in_flight -= 1
                    api.calls.append((time.time(), vehicle, attempt, status))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def wait_states(results, states, timeout):
    deadline = time.monotonic() + timeout
    while True:
        got = {r.id: r.state for r in results}
        if all(s in states for s in got.values()):
            return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_celery_worker_rides_out_an_outage(redis_server, dep, tmp_path):
    celery_app_env = {
        "SPILLWAY_TEST_BROKER": f"redis://127.0.0.1:{redis_server.port}/1",
        "SPILLWAY_TEST_BACKEND": f"redis://127.0.0.1:{redis_server.port}/2",
        "SPILLWAY_TEST_REDIS": f"redis://127.0.0.1:{redis_server.port}/0",
        "SPILLWAY_TEST_DEPENDENCY": dep,
    }
    api = VehicleAPI()
    celery_app_env["SPILLWAY_TEST_API"] = api.url
    os.environ.update(celery_app_env)
    rdb = redis_server.client()
    publish(rdb, dep, limit=LIMIT, backoff_base_ms=200, backoff_max_ms=1000, min_retries=10, ratio_ppm=200000)

    import celery_app  # noqa: E402  (configured from the environment above)
    app = celery_app.app
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]))
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "--pool=prefork", "--concurrency=2",
         "--loglevel=INFO", f"--logfile={log_path}", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-n", f"spillway-{uuid.uuid4().hex[:8]}@%h"],
        cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        # Healthy: the first tasks go straight through.
        first = [celery_app.enrich_vehicle.delay(f"before-{i}") for i in range(6)]
        for r in first:
            assert r.get(timeout=60)["attempt"] == 1

        # The API goes down; tasks fail, retry within the budget, then park.
        api.up = False
        outage = [celery_app.enrich_vehicle.delay(f"during-{i}") for i in range(12)]
        stale = [celery_app.enrich_vehicle.apply_async((f"stale-{i}",), headers={"spillway_deadline": time.time() + 1.5})
                 for i in range(4)]
        deadline = time.monotonic() + 30
        while sum(1 for c in api.calls if c[3] == 503) < 8:
            assert time.monotonic() < deadline, "the outage's failures never reached the API"
            time.sleep(0.05)

        # The controller opens the breaker (here the test publishes it).
        open_at = time.time()
        publish(rdb, dep, epoch=2, state="Open", limit=0, open_until_ms=int((open_at + 2.5) * 1000),
                backoff_base_ms=200, backoff_max_ms=1000)
        time.sleep(3.0)
        api.up = True
        close_at = time.time()
        publish(rdb, dep, epoch=3, limit=LIMIT, backoff_base_ms=200, backoff_max_ms=1000)

        # No task lost: every outage task succeeds; every stale one is dropped.
        for r in outage:
            assert r.get(timeout=90)["vehicle"].startswith("during-")
        states = wait_states(stale, {"DROPPED"}, timeout=30)
        assert set(states.values()) == {"DROPPED"}, states
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        api.close()
    log = log_path.read_text()

    # Nothing reached the API while Open (a call admitted just before the
    # publish may still arrive, from a worker starved by a busy machine:
    # allow a second).
    during_open = [c for c in api.calls if open_at + 1.0 < c[0] < close_at]
    assert during_open == [], during_open
    assert api.peak <= LIMIT, f"{api.peak} calls in flight, limit {LIMIT}"

    # Deferred by the guard, keeping the attempt number: each task's final
    # attempt is one more than the failures the API saw for it.
    deferred = re.findall(r"Deferred task \S+\[([0-9a-f-]+)\] by ([0-9.]+)s, attempt (\d+) kept: breaker open", log)
    assert deferred, "no task was deferred while Open:\n" + log[-3000:]
    # The delay is the breaker's hint (open_until), never below the throttle
    # delay once open_until has passed and the controller has not moved yet.
    assert all(float(after) >= 0.2 for _, after, _ in deferred)
    assert max(float(after) for _, after, _ in deferred) >= 1.0
    failures = defaultdict(int)
    for _, vehicle, _, status in api.calls:
        if status == 503:
            failures[vehicle] += 1
    by_id = {r.id: r for r in outage}
    checked = 0
    for task_id, _, _ in deferred:
        if task_id in by_id:
            res = by_id[task_id].result
            assert res["attempt"] == failures[res["vehicle"]] + 1, (res, failures[res["vehicle"]])
            checked += 1
    assert checked > 0
    assert "Retrying task" in log, "no retry granted by the budget"

    # Dropped with a log line, never silently; never called after the deadline.
    assert len(re.findall(r"Dropped task \S+\[[0-9a-f-]+\]: stale", log)) == len(stale)
    for r in stale:
        assert r.info["reason"] == "stale"
    assert not [c for c in api.calls if c[1].startswith("stale-") and c[3] == 200]
    print(f"celery outage: {len(api.calls)} calls, {sum(1 for c in api.calls if c[3] == 503)} failed, "
          f"{len(deferred)} deferrals, {log.count('Retrying task')} retries, {log.count('Parking task')} parks, "
          f"peak {api.peak} in flight")

    # The results' finalizers talk to the backend: run them while Redis is up.
    del r, first, outage, stale, by_id
    gc.collect()
