"""The Celery app of test_celery_retry.py: tasks that retry by themselves,
with self.retry and with autoretry_for, around an API that always fails.
Configured from the environment by the test that starts the worker."""

import os
import urllib.error
import urllib.request

from celery import Celery

from spillway.celery import GuardedTask

app = Celery("spillway_retry_test", broker=os.environ["SPILLWAY_RETRY_BROKER"],
             backend=os.environ["SPILLWAY_RETRY_BACKEND"])
app.conf.update(
    spillway_redis_url=os.environ["SPILLWAY_RETRY_REDIS"],
    spillway_guard_options={"redis_timeout": 1.0, "lease_ttl": 10.0},
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
API = os.environ["SPILLWAY_RETRY_API"]
DEP = os.environ["SPILLWAY_RETRY_DEPENDENCY"]
MAX_RETRIES = 2


class APIError(Exception):
    pass


def get(path, task):
    try:
        with urllib.request.urlopen(f"{API}/{path}?attempt={task.request.retries + 1}", timeout=5) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:  # holds its socket: not picklable
        raise APIError(f"api answered {e.code}") from None


@app.task(bind=True, base=GuardedTask, spillway_dependency=DEP, max_retries=MAX_RETRIES)
def with_self_retry(self, item):
    """The body catches the failure and asks for a retry, without a countdown."""
    try:
        return get(f"self-retry/{item}", self)
    except APIError as e:
        raise self.retry(exc=e)


@app.task(bind=True, base=GuardedTask, spillway_dependency=DEP, max_retries=MAX_RETRIES,
          autoretry_for=(APIError,))
def with_autoretry(self, item):
    """Celery retries the failure itself (autoretry_for), without a countdown."""
    return get(f"autoretry/{item}", self)


@app.task(bind=True, base=GuardedTask, spillway_dependency=DEP, max_retries=MAX_RETRIES,
          autoretry_for=(APIError,), retry_backoff=1, retry_backoff_max=2, retry_jitter=False)
def with_retry_backoff(self, item):
    """autoretry_for with Celery's own backoff (the vehicle-API seed's style)."""
    return get(f"backoff/{item}", self)
