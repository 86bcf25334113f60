"""Acquire+release pairs per second from Python, beside a pair of no-op
EVALSHAs from redis-py, measured in the same run (docs/benchmarks.md).

    /usr/bin/python3 clients/python/bench/bench_pairs.py [--seconds 2] [--rounds 5] [--threads 1,8]

Starts its own redis-server on a free loopback port. Each round runs, for
`seconds` each and one after the other (interleaved, since back-to-back
seconds on a busy machine differ): redis-py's own evalsha of noop.lua twice;
the protocol client's acquire then release (two EVALSHAs on a pool
connection with a per-call socket timeout); and Guard.call of a function
that does nothing (acquire, release, and the guard's bookkeeping). It prints
pairs/s per variant (median, min, max over the rounds), the median ratio to
the no-op pair, and Redis's CPU per pair."""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import redis  # noqa: E402

import spillway  # noqa: E402
from spillway import protocol as P  # noqa: E402

DEP = "bench/vehicle-api"


def start_redis():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="spillway-bench-")
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", d],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return proc, port, d
        except redis.ConnectionError:
            time.sleep(0.01)
    raise RuntimeError("redis-server did not start")


def redis_cpu(r):
    info = r.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def run(fn, threads, seconds):
    """Pairs per second of fn (one call = one pair) over `threads` threads."""
    counts = [0] * threads
    stop = threading.Event()

    def loop(i):
        n = 0
        while not stop.is_set():
            fn()
            n += 1
        counts[i] = n

    ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0), sum(counts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,8")
    a = ap.parse_args()
    proc, port, d = start_redis()
    try:
        pool_size = 64
        rdb = redis.Redis(port=port, socket_timeout=2, max_connections=pool_size)
        admin = redis.Redis(port=port, socket_timeout=2)
        proto = P.Client(rdb, DEP)
        fields = {"state": "Closed", "limit": 1000, "capacity": 1000, "rate": 0, "rate_interval_us": 0,
                  "rate_burst": 1, "open_until_ms": 0, "backoff_base_ms": 1000, "backoff_max_ms": 300000,
                  "jitter": "Full", "budget_ratio_ppm": 200000, "budget_min_retries": 10, "budget_window_s": 60,
                  "breaker_window_s": 30, "stats_retention_s": 120, "half_open_probes": 3, "stale_after_ms": 0}
        proto.publish(1, fields)
        guard = spillway.Guard(rdb, DEP, registry=None)
        noop = rdb.register_script(P.SCRIPTS["noop"].text)
        leases = [proto.keys.leases]

        def noop_pair():
            noop(keys=leases)
            noop(keys=leases)

        def protocol_pair():
            lease = P.new_lease_id()
            proto.acquire(lease, 30000, 0)
            proto.release(lease, "s", 1)

        def guard_pair():
            guard.call(lambda: None)

        variants = [("redis-py noop EVALSHA pair", noop_pair), ("protocol acquire+release", protocol_pair),
                    ("Guard.call (acquire+release)", guard_pair)]
        for f in (noop_pair, protocol_pair, guard_pair):  # load the scripts
            f()
        print(f"python {sys.version.split()[0]}, redis-py {redis.__version__}, "
              f"redis-server {admin.info('server')['redis_version']}, nproc {os.cpu_count()}, "
              f"loadavg {os.getloadavg()[0]:.2f}, {a.rounds} rounds x {a.seconds}s per variant")
        for threads in [int(x) for x in a.threads.split(",")]:
            rates = {name: [] for name, _ in variants}
            cpu = {name: [] for name, _ in variants}
            ratios = {name: [] for name, _ in variants[1:]}
            for _ in range(a.rounds):
                base = None
                for name, f in variants:
                    c0 = redis_cpu(admin)
                    rate, n = run(f, threads, a.seconds)
                    cpu[name].append((redis_cpu(admin) - c0) / max(n, 1) * 1e6)
                    rates[name].append(rate)
                    if base is None:
                        base = rate
                    else:
                        ratios[name].append(rate / base)
            print(f"\n{threads} thread(s):")
            print(f"  {'variant':32} {'pairs/s median (min-max)':>28} {'Redis CPU/pair':>15} {'ratio to noop':>14}")
            for name, _ in variants:
                r = rates[name]
                ratio = f"{statistics.median(ratios[name]):.2f}" if name in ratios else "1"
                print(f"  {name:32} {statistics.median(r):>10.0f} ({min(r):.0f}-{max(r):.0f}) "
                      f"{statistics.median(cpu[name]):>11.1f} us {ratio:>14}")
        guard.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
