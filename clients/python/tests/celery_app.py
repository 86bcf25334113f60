"""The Celery app of test_celery.py: the seed's vehicle-API task, guarded.
Configured from the environment by the test that starts the worker."""

import json
import os
import urllib.error
import urllib.request

from celery import Celery

from spillway.celery import GuardedTask

app = Celery("spillway_test", broker=os.environ["SPILLWAY_TEST_BROKER"],
             backend=os.environ["SPILLWAY_TEST_BACKEND"])
app.conf.update(
    spillway_redis_url=os.environ["SPILLWAY_TEST_REDIS"],
    spillway_guard_options={"redis_timeout": 1.0, "lease_ttl": 10.0},
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
API = os.environ["SPILLWAY_TEST_API"]


@app.task(bind=True, base=GuardedTask, spillway_dependency=os.environ["SPILLWAY_TEST_DEPENDENCY"],
          max_retries=None)
def enrich_vehicle(self, vehicle_id):
    attempt = self.request.retries + 1
    try:
        with urllib.request.urlopen(f"{API}/vehicles/{vehicle_id}?attempt={attempt}", timeout=5) as r:
            details = json.load(r)
    except urllib.error.HTTPError as e:  # holds its socket: not picklable
        raise RuntimeError(f"vehicle api answered {e.code}") from None
    return {"vehicle": vehicle_id, "attempt": attempt, "details": details}
