"""A Python worker of the fault campaign (faults_test.go): THREADS threads
take jobs from the queue at URL and run each through one spillway Guard
until it is done, as a job framework does (a refusal or a failure puts the
job back after the guard's delay, capped at 200 ms), and print their counts
as a JSON line every 200 ms and once more when stdin closes."""

import json
import os
import sys
import threading
import urllib.error
import urllib.request

import redis

import spillway

URL = os.environ["SPILLWAY_FAULTS_URL"]
if os.environ.get("SPILLWAY_FAULTS_SENTINELS"):
    from redis.sentinel import Sentinel
    sentinels = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1]))
                 for a in os.environ["SPILLWAY_FAULTS_SENTINELS"].split(",")]
    client = Sentinel(sentinels, socket_timeout=0.5, socket_connect_timeout=0.5).master_for(
        os.environ["SPILLWAY_FAULTS_MASTER"], socket_timeout=0.5, socket_connect_timeout=0.5)
else:
    host, port = os.environ["SPILLWAY_FAULTS_REDIS"].rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port), socket_timeout=2, socket_connect_timeout=1)
guard = spillway.Guard(
    client,
    os.environ["SPILLWAY_FAULTS_DEP"],
    lease_ttl=float(os.environ["SPILLWAY_FAULTS_LEASE_TTL"]),
    registry=None)
stop = threading.Event()
lock = threading.Lock()
stats = {"lang": "python", "pid": os.getpid(), "ok": 0, "failed": 0, "drop": 0, "untyped": 0,
         "refused": {}}

REASONS = {spillway.Throttled: "slots", spillway.RateLimited: "rate", spillway.BreakerOpen: "open",
           spillway.RedisUnavailable: "redis_unavailable", spillway.NoPolicy: "no_policy"}


def add(key, sub=None):
    with lock:
        if sub is None:
            stats[key] += 1
        else:
            stats[key][sub] = stats[key].get(sub, 0) + 1


def next_job():
    try:
        with urllib.request.urlopen(URL + "/job", timeout=30) as r:
            if r.status != 200:
                return None
            return json.loads(r.read())["id"]
    except Exception:
        return None


def call(job):
    def run():
        req = urllib.request.Request(f"{URL}/call?job={job}", headers={"X-Lang": "python"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except urllib.error.HTTPError as e:
            add("failed")
            raise RuntimeError(f"dependency answered {e.code}") from None
        except Exception:
            add("failed")
            raise
        add("ok")
    return run


def work():
    while not stop.is_set():
        job = next_job()
        if job is None:
            stop.wait(0.05)
            continue
        attempt = 1
        while not stop.is_set():
            try:
                guard.call(call(job), spillway.Job(attempt=attempt))
                break
            except spillway.SpillwayError as e:
                action, after = spillway.decide(e)
                if action == spillway.DEFER:
                    add("refused", REASONS.get(type(e), type(e).__name__))
                elif action == spillway.RETRY:
                    attempt += 1
                elif action == spillway.PARK:
                    attempt = 1
                else:
                    add("drop")
                    break
                stop.wait(min(max(after, 0.001), 0.2))
            except Exception as e:  # a failure the guard did not type
                with lock:
                    stats["untyped"] += 1
                    stats.setdefault("example", repr(e))
                stop.wait(0.05)


def report():
    with lock:
        line = json.dumps(stats)
    sys.stdout.write("faults-stats: " + line + "\n")
    sys.stdout.flush()


threads = [threading.Thread(target=work, daemon=True)
           for _ in range(int(os.environ.get("SPILLWAY_FAULTS_THREADS", "4")))]
for t in threads:
    t.start()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.wait(0.2):
    report()
for t in threads:
    t.join(10)
guard.close()
report()
