"""A real Celery worker (prefork, two processes; Redis broker and result
backend on loopback) runs tasks that retry by themselves, with self.retry
and with autoretry_for (with and without Celery's retry_backoff), against an
API that always fails. Each failure must end in exactly one new message:
the task messages and the API calls of every task equal its attempts
(max_retries + 1), and the fleet's retry budget is charged once per retry."""

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import publish
from spillway import protocol as P

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = ("with_self_retry", "with_autoretry", "with_retry_backoff")
PER_TASK = 3


class FailingAPI:
    """A loopback HTTP dependency that always answers 503 and counts calls."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = Counter()  # "kind/item" -> calls
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                with api.lock:
                    api.calls[self.path.lstrip("/").split("?")[0]] += 1
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()

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


def test_a_tasks_own_retries_are_one_message_per_failure(redis_server, dep, tmp_path):
    api = FailingAPI()
    os.environ.update({
        "SPILLWAY_RETRY_BROKER": f"redis://127.0.0.1:{redis_server.port}/3",
        "SPILLWAY_RETRY_BACKEND": f"redis://127.0.0.1:{redis_server.port}/4",
        "SPILLWAY_RETRY_REDIS": f"redis://127.0.0.1:{redis_server.port}/0",
        "SPILLWAY_RETRY_DEPENDENCY": dep,
        "SPILLWAY_RETRY_API": api.url,
    })
    rdb = redis_server.client()
    # A generous budget: every retry the tasks ask for is granted, with a
    # short fleet backoff (the tasks without a countdown get it).
    publish(rdb, dep, limit=2, backoff_base_ms=100, backoff_max_ms=200, min_retries=1000)

    import celery_retry_app as m  # noqa: E402  (configured from the environment above)
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]))
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_retry_app", "worker", "--pool=prefork", "--concurrency=2",
         "--loglevel=INFO", f"--logfile={log_path}", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-n", f"spillway-retry-{uuid.uuid4().hex[:8]}@%h"],
        cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    results = {}
    try:
        for name in TASKS:
            for i in range(PER_TASK):
                results[(name, i)] = getattr(m, name).delay(str(i))
        deadline = time.monotonic() + 90
        while not all(r.ready() for r in results.values()):
            assert time.monotonic() < deadline, {k: r.state for k, r in results.items()}
            time.sleep(0.2)
        time.sleep(1.0)  # a duplicate message, if any, would run meanwhile
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        api.close()
    log = log_path.read_text()

    attempts = m.MAX_RETRIES + 1
    received = Counter(re.findall(r"Task celery_retry_app\.\w+\[([0-9a-f-]+)\] received", log))
    kinds = {"with_self_retry": "self-retry", "with_autoretry": "autoretry", "with_retry_backoff": "backoff"}
    for (name, i), r in results.items():
        assert r.state == "FAILURE", (name, i, r.state, r.result)
        assert "api answered 503" in str(r.result), (name, r.result)
        assert received[r.id] == attempts, f"{name}[{i}]: {received[r.id]} task messages for {attempts} attempts"
        assert api.calls[f"{kinds[name]}/{i}"] == attempts, \
            f"{name}[{i}]: {api.calls[kinds[name] + '/' + str(i)]} API calls for {attempts} attempts"
    w = P.Client(rdb, dep).window(600)
    retries = len(results) * m.MAX_RETRIES
    assert w["failures"] == len(results) * attempts, w
    assert w["granted"] == retries, f"the budget granted {w['granted']} retries, {retries} were sent"
    # Without a countdown of their own the retries came after the fleet's
    # backoff (<= 0.2s), not Celery's default_retry_delay (180s); with
    # retry_backoff after Celery's (1s, then 2s).
    backoff_runs = sorted(float(t) for t in re.findall(
        r"Task celery_retry_app\.with_retry_backoff\[[0-9a-f-]+\] retry: Retry in (\d+(?:\.\d+)?)s", log))
    assert backoff_runs and min(backoff_runs) >= 1.0, backoff_runs
    print(f"celery retries: {sum(received.values())} messages, {sum(api.calls.values())} API calls, "
          f"{w['granted']} retries granted for {len(results)} tasks of {attempts} attempts")
    del r, results
    gc.collect()
