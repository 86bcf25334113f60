"""The skew tests' Python worker program (internal/skewtest): THREADS threads
call the dependency at URL through one spillway Guard, per call, acting on
the guard's decisions as a job framework would, with the delays capped so
the tests stay short. The spillway package is whichever clients/python is on
PYTHONPATH: this tree's, or an older commit's.

It writes the same lines as worker/main.go on stdout: "skew: " and a JSON
object, {"seen": ...} whenever what the guard tells it changes ("open" for
a refusal because the breaker is open, "limit=N" for an admission at the
fleet-wide limit N), and {"stats": ...} every 200 ms and once more when it
stops. It stops, ending its calls and closing the guard, when stdin closes.

Usage: worker.py REDIS_ADDR DEPENDENCY URL THREADS NAME"""

import json
import sys
import threading
import time
import urllib.error
import urllib.request

import redis

import spillway
from spillway import protocol

addr, dep, url, nthreads, name = sys.argv[1:6]
host, port = addr.rsplit(":", 1)
guard = spillway.Guard(redis.Redis(host=host, port=int(port), socket_timeout=2), dep, registry=None)
stop = threading.Event()
lock = threading.Lock()
stats = {"ok": 0, "failed": 0, "retry": 0, "park": 0, "drop": 0, "refused": {}}
seen = [""]


def emit(obj):
    sys.stdout.write("skew: " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def observe(what):
    with lock:
        if what != seen[0]:
            seen[0] = what
            emit({"seen": what, "at_ms": int(time.time() * 1000)})


def add(key, sub=None):
    with lock:
        if sub is None:
            stats[key] += 1
        else:
            stats[key][sub] = stats[key].get(sub, 0) + 1


def fetch(limit):
    req = urllib.request.Request(url, headers={"X-Worker": name, "X-Limit": str(limit)})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
    except urllib.error.HTTPError as e:
        add("failed")
        raise RuntimeError(f"the dependency answered {e.code}") from None
    except Exception:
        add("failed")
        raise
    add("ok")


REASONS = ((spillway.Throttled, "slots"), (spillway.RateLimited, "rate"), (spillway.BreakerOpen, "open"),
           (spillway.RedisUnavailable, "redis_unavailable"), (spillway.NoPolicy, "no_policy"))


VERSION_ERROR = getattr(protocol, "VersionError", ())


def reason(e):
    if isinstance(e, spillway.NoPolicy) and isinstance(getattr(e, "cause", None), VERSION_ERROR):
        return "version"
    for cls, r in REASONS:
        if isinstance(e, cls):
            return r
    return type(e).__name__


def work():
    attempt = 1
    while not stop.is_set():
        try:
            permit = guard.acquire(spillway.Job(attempt=attempt))
            observe(f"limit={permit.limit}")
            exc = None
            try:
                fetch(permit.limit)
            except Exception as e:
                exc = e
            permit.done(exc)
            attempt = 1
            continue
        except spillway.SpillwayError as e:
            action, after = spillway.decide(e)
            if action == spillway.DEFER:
                r = reason(e)
                if r == "open":
                    observe("open")
                add("refused", r)
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
        emit({"stats": stats})


threads = [threading.Thread(target=work, daemon=True) for _ in range(int(nthreads))]
for t in threads:
    t.start()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.wait(0.2):
    report()
for t in threads:
    t.join(10)
guard.close()
report()
