"""A Python worker of the mixed fleet (mixedfleet_test.go): THREADS threads
call the dependency at URL through one spillway Guard, act on the guard's
decisions like a job framework would (with the delays capped so the test
stays short), and print their counts as a JSON line every 200 ms and once
more when stdin closes."""

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

import redis

import spillway

URL = os.environ["SPILLWAY_MIXED_URL"]
host, port = os.environ["SPILLWAY_MIXED_REDIS"].rsplit(":", 1)
guard = spillway.Guard(redis.Redis(host=host, port=int(port), socket_timeout=2), os.environ["SPILLWAY_MIXED_DEP"],
                       registry=None)
stop = threading.Event()
lock = threading.Lock()
stats = {"lang": "python", "pid": os.getpid(), "ok": 0, "failed": 0, "retry": 0, "park": 0,
         "refused": {}, "drop": 0}


def add(key, sub=None):
    with lock:
        if sub is None:
            stats[key] += 1
        else:
            stats[key][sub] = stats[key].get(sub, 0) + 1


def fetch():
    req = urllib.request.Request(URL, headers={"X-Lang": "python", "X-PID": str(os.getpid())})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
    except urllib.error.HTTPError as e:
        add("failed")
        raise RuntimeError(f"dependency answered {e.code}") from None
    except Exception:
        add("failed")  # the guard reports it as a failure too
        raise
    add("ok")


REASONS = {spillway.Throttled: "slots", spillway.RateLimited: "rate", spillway.BreakerOpen: "open",
           spillway.RedisUnavailable: "redis_unavailable", spillway.NoPolicy: "no_policy"}


def work():
    attempt = 1
    while not stop.is_set():
        try:
            guard.call(fetch, spillway.Job(attempt=attempt))
            attempt = 1
            continue
        except spillway.SpillwayError as e:
            action, after = spillway.decide(e)
            if action == spillway.DEFER:
                add("refused", REASONS.get(type(e), type(e).__name__))
                stop.wait(min(after, 0.05))
            elif action == spillway.RETRY:
                add("retry")
                attempt += 1
                stop.wait(min(after, 0.05))
            elif action == spillway.PARK:
                add("park")
                attempt = 1
                stop.wait(min(after, 0.1))
            else:
                add("drop")


def report():
    with lock:
        line = json.dumps(stats)
    sys.stdout.write("mixed-stats: " + line + "\n")
    sys.stdout.flush()


threads = [threading.Thread(target=work, daemon=True) for _ in range(int(os.environ.get("SPILLWAY_MIXED_THREADS", "8")))]
for t in threads:
    t.start()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.wait(0.2):
    report()
for t in threads:
    t.join(10)
guard.close()
report()
