// The guard against a real redis-server: the fleet-wide cap, refusals and
// their delays, failures and the retry budget, Retry-After, stale and
// superseded jobs, probes, a lost lease and cancellation delivered to the
// call's AbortSignal, close() returning the slots, and the metrics' names.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer } from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { Registry } from "prom-client";
import {
  Guard, decide, Throttled, BreakerOpen, NoPolicy, VersionMismatch, CallFailed, BudgetExhausted, Stale, Superseded,
  Cancelled, LeaseLost, Permanent, EvictionPolicyError, checkResponse, protocol as P, VERSION,
} from "../dist/index.js";
import { RedisServer, dep, publish, redisNowMs } from "./helpers.js";

let srv, rdb;
before(async () => {
  srv = await RedisServer.start();
  rdb = srv.client();
});
after(async () => {
  rdb.disconnect();
  await srv.close();
});

/** A seeded generator in [0, 1), so that delays can be checked exactly. */
function seeded(seed = 1) {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

// redisTimeout 2 s: these tests are not about a slow Redis, and this machine is busy.
const guard = (d, opts = {}) => new Guard(rdb, d, { registry: null, redisTimeout: 2000, ...opts });

test("do runs the call with a signal, returns its result and frees the slot", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const g = guard(d);
  const got = await g.do({ attempt: 1 }, async (signal) => {
    assert.ok(signal instanceof AbortSignal);
    assert.equal(signal.aborted, false);
    assert.equal(await g.proto.liveLeases(), 1);
    return 42;
  });
  assert.equal(got, 42);
  assert.equal(await g.proto.liveLeases(), 0);
  assert.equal((await g.proto.window(30)).successes, 1);
  await g.close();
});

test("the fleet-wide cap holds across guards; a refusal defers with the throttle delay", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 5 });
  const guards = [guard(d, { waitForSlot: true }), guard(d, { waitForSlot: true }), guard(d, { waitForSlot: true })];
  let running = 0, most = 0;
  const call = async () => {
    running++;
    most = Math.max(most, running);
    await sleep(15);
    running--;
  };
  await Promise.all(Array.from({ length: 60 }, (_, i) => guards[i % 3].do({}, call)));
  assert.equal(most, 5);
  assert.equal((await guards[0].proto.window(30)).successes, 60);

  const holders = guards.map((g) => g.do({}, () => sleep(300)));
  const held = Array.from({ length: 3 }, () => guards[0].do({}, () => sleep(300)));
  await sleep(100);
  const g = guard(d, { throttleDelay: 200 });
  const err = await g.do({}, () => assert.fail("never runs")).catch((e) => e);
  assert.ok(err instanceof Throttled, String(err));
  const { action, after } = decide(err);
  assert.equal(action, "defer");
  assert.ok(after >= 100 && after <= 200, String(after));
  await Promise.all([...holders, ...held]);
  for (const x of [...guards, g]) await x.close();
});

test("a failure asks the budget once and retries after the published backoff (full jitter)", async () => {
  const d = dep();
  await publish(rdb, d, { backoffBaseMs: 400, backoffMaxMs: 3000, jitter: "Full" });
  const rand = seeded(7);
  const expect = seeded(7);
  const g = guard(d, { random: rand });
  for (const attempt of [1, 2, 3, 4]) {
    const err = await g.do({ attempt }, async () => { throw new Error("boom"); }).catch((e) => e);
    assert.ok(err instanceof CallFailed, String(err));
    assert.equal(err.cause.message, "boom");
    const ceiling = Math.min(3000, 400 * 2 ** (attempt - 1));
    assert.equal(decide(err).action, "retry");
    assert.ok(Math.abs(err.after - expect() * ceiling) < 1e-6, `attempt ${attempt}: ${err.after}`);
  }
  const w = await g.proto.window(30);
  assert.equal(w.failures, 4);
  assert.equal(w.granted, 4);
  await g.close();
});

test("a spent budget parks the job for max..2×max; a final job's failure is thrown as is, the budget not asked", async () => {
  const d = dep();
  await publish(rdb, d, { minRetries: 1, ratioPPM: 0, backoffBaseMs: 100, backoffMaxMs: 2000 });
  const g = guard(d);
  const fail = async () => { throw new Error("down"); };
  assert.ok((await g.do({}, fail).catch((e) => e)) instanceof CallFailed);
  const parked = await g.do({}, fail).catch((e) => e);
  assert.ok(parked instanceof BudgetExhausted, String(parked));
  assert.equal(decide(parked).action, "park");
  assert.ok(parked.after >= 2000 && parked.after <= 4000, String(parked.after));
  const final = await g.do({ final: true }, fail).catch((e) => e);
  assert.equal(final.message, "down");
  const w = await g.proto.window(30);
  assert.equal(w.failures, 3);
  assert.equal(w.granted + w.refused, 2, "the final job asked nothing");
  await g.close();
});

test("Retry-After on a 429 from a real server: the retry comes no earlier than it asked", async (t) => {
  const d = dep();
  await publish(rdb, d, { backoffBaseMs: 10, backoffMaxMs: 50 });
  const server = createServer((req, res) => {
    if (req.url === "/busy") res.writeHead(429, { "Retry-After": "3" }).end();
    else if (req.url === "/bad") res.writeHead(400).end();
    else res.writeHead(200).end("ok");
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  t.after(() => { server.closeAllConnections(); server.close(); });
  const base = `http://127.0.0.1:${server.address().port}`;
  const g = guard(d);
  const err = await g.do({}, async (signal) => checkResponse(await fetch(`${base}/busy`, { signal }))).catch((e) => e);
  assert.ok(err instanceof CallFailed, String(err));
  assert.ok(err.after >= 3000 && err.after <= 4500, String(err.after));
  const bad = await g.do({}, async (signal) => checkResponse(await fetch(`${base}/bad`, { signal }))).catch((e) => e);
  assert.equal(bad.name, "HttpStatusError");
  assert.equal(bad.status, 400);
  const ok = await g.do({}, async (signal) => (await checkResponse(await fetch(`${base}/ok`, { signal }))).text());
  assert.equal(ok, "ok");
  const w = await g.proto.window(30);
  assert.deepEqual([w.failures, w.successes], [1, 2], "a 400 is the dependency's answer: a success for the breaker");
  await g.close();
});

test("stale and superseded jobs are dropped unrun", async () => {
  const d = dep();
  await publish(rdb, d);
  const g = guard(d);
  const stale = await g.do({ deadline: Date.now() - 1 }, () => assert.fail("never runs")).catch((e) => e);
  assert.ok(stale instanceof Stale);
  assert.equal(decide(stale).action, "drop");
  await g.supersede("vin-7", 3);
  const old = await g.do({ key: "vin-7", version: 2 }, () => assert.fail("never runs")).catch((e) => e);
  assert.ok(old instanceof Superseded, String(old));
  assert.equal(decide(old).action, "drop");
  assert.equal(await g.do({ key: "vin-7", version: 3 }, () => "runs"), "runs");
  assert.equal(await g.do({ key: "vin-7", version: 4 }, () => "newer"), "newer");
  const older = await g.do({ key: "vin-7", version: 3 }, () => assert.fail("never runs")).catch((e) => e);
  assert.ok(older instanceof Superseded);
  await g.close();
});

test("Open, no policy and another protocol version defer the job", async () => {
  const d = dep();
  const g = guard(d);
  const none = await g.do({}, () => assert.fail()).catch((e) => e);
  assert.ok(none instanceof NoPolicy);
  assert.equal(decide(none).action, "defer");
  const now = await redisNowMs(rdb);
  await publish(rdb, d, { state: "Open", limit: 0, openUntilMs: now + 5000 });
  const open = await g.do({}, () => assert.fail()).catch((e) => e);
  assert.ok(open instanceof BreakerOpen);
  assert.ok(open.after >= 4000 && open.after <= 7500, String(open.after));
  await rdb.hset(g.proto.keys.state, "version", "99");
  const skew = await g.do({}, () => assert.fail()).catch((e) => e);
  assert.ok(skew instanceof VersionMismatch, String(skew));
  assert.ok(skew instanceof NoPolicy);
  assert.equal(skew.stateVersion, 99);
  assert.equal(skew.clientVersion, VERSION);
  assert.match(skew.message, new RegExp(`state version 99, manager version \\d+, this client's version ${VERSION}`));
  assert.match(skew.cause.message, /upgrade this worker's Spillway client/);
  assert.equal(decide(skew).action, "defer");
  await g.close();
});

test("a failed call under a state of another version defers with VersionMismatch, not a spent budget", async () => {
  // The state turns to a version this worker does not act on while a call
  // runs, and the call fails: the budget script refuses on version. As
  // TestFailedCallUnderAnUnservedVersionSaysSo in Go.
  const d = dep();
  await publish(rdb, d);
  const g = guard(d);
  const err = await g.do({ attempt: 1 }, async () => {
    await rdb.hset(g.proto.keys.state, "version", "99");
    throw new Error("vehicle api reset the connection");
  }).catch((e) => e);
  assert.ok(err instanceof VersionMismatch, String(err));
  assert.equal(decide(err).action, "defer");
  assert.match(err.message, /vehicle api reset the connection/);
  assert.match(err.cause.message, /upgrade this worker's Spillway client/);
  await g.close();
});

test("a guard registers its process as a node client of this version, in the background", async () => {
  const d = dep();
  await publish(rdb, d);
  const g = guard(d);
  await g.do({}, () => "ok");
  let members = [];
  for (let deadline = Date.now() + 5000; members.length === 0 && Date.now() < deadline; await sleep(20)) {
    members = await rdb.zrange(g.proto.keys.clients, 0, -1);
  }
  assert.equal(members.length, 1);
  assert.match(members[0], new RegExp(`^node ${VERSION} [0-9a-z]+-[0-9a-z]+$`));
  await g.do({}, () => "again");
  assert.equal((await rdb.zrange(g.proto.keys.clients, 0, -1)).length, 1, "one member per process");
  await g.close();
});

test("a HalfOpen probe's outcome counts in the epoch's probes", async () => {
  const d = dep();
  await publish(rdb, d, { epoch: 9, state: "HalfOpen", limit: 1 });
  const g = guard(d);
  await g.do({}, () => "ok");
  assert.equal((await g.proto.window(30)).probeSuccesses, 1);
  await g.close();
});

test("a lost lease aborts the call's signal, counts nothing, and holds new calls back while it runs", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 3 });
  const g = guard(d, { leaseTtl: 300 });
  let reason;
  const running = g.do({}, async (signal) => {
    const lease = (await rdb.zrange(g.proto.keys.leases, 0, -1)).find((m) => !m.startsWith("encoding"));
    await rdb.zrem(g.proto.keys.leases, lease); // the fleet stops counting the call
    await new Promise((r) => signal.addEventListener("abort", r, { once: true }));
    reason = signal.reason;
    const refused = await g.do({}, () => assert.fail("admitted while a lost call runs")).catch((e) => e);
    assert.ok(refused instanceof Throttled, String(refused));
    throw signal.reason;
  });
  const err = await running.catch((e) => e);
  assert.ok(reason instanceof LeaseLost, String(reason));
  assert.ok(err instanceof LeaseLost, String(err));
  assert.equal(decide(err).action, "defer");
  const w = await g.proto.window(30);
  assert.equal(w.calls, 0, "a call whose lease was lost counts nothing");
  assert.equal(await g.do({}, () => "again"), "again");
  await g.close();
});

test("the job's signal cancels the call: released as cancelled, deferred", async () => {
  const d = dep();
  await publish(rdb, d);
  const g = guard(d);
  const ac = new AbortController();
  const p = g.do({ signal: ac.signal }, (signal) => new Promise((_, reject) => signal.addEventListener("abort", () => reject(signal.reason))));
  await sleep(20);
  ac.abort(new Error("shutting down"));
  const err = await p.catch((e) => e);
  assert.ok(err instanceof Cancelled && !(err instanceof LeaseLost), String(err));
  assert.equal((await g.proto.window(30)).calls, 0);
  assert.equal(await g.proto.liveLeases(), 0);
  const pre = await g.do({ signal: AbortSignal.abort() }, () => assert.fail()).catch((e) => e);
  assert.ok(pre instanceof Cancelled);
  // Aborted while the acquisition is on its way: the call's signal is
  // aborted from the start (its abort event fired before the call existed).
  const late = new AbortController();
  const inFlight = g.do({ signal: late.signal }, async (signal) => signal.aborted);
  late.abort(new Error("shutting down"));
  assert.equal(await inFlight, true, "the call's signal was not aborted");
  await g.close();
});

test("close() aborts running calls and returns their slots, also of a call that ignores its signal", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 4 });
  const g = guard(d, { closeTimeout: 200 });
  let aborted = 0;
  const polite = g.do({}, (signal) => new Promise((_, reject) => signal.addEventListener("abort", () => { aborted++; reject(signal.reason); }))).catch((e) => e);
  const deaf = g.do({}, () => sleep(600));
  await sleep(30);
  assert.equal(await g.proto.liveLeases(), 2);
  const t0 = performance.now();
  await g.close();
  assert.ok(performance.now() - t0 < 500);
  assert.equal(aborted, 1);
  assert.equal(await g.proto.liveLeases(), 0, "close() returned the slots");
  assert.ok((await polite) instanceof Cancelled);
  await deaf;
  assert.equal((await g.proto.window(30)).calls, 0);
  const after = await g.do({}, () => assert.fail()).catch((e) => e);
  assert.ok(after instanceof Cancelled);
});

test("Permanent counts as a success and throws the wrapped error", async () => {
  const d = dep();
  await publish(rdb, d);
  const g = guard(d);
  const inner = new Error("invalid VIN");
  const err = await g.do({}, async () => { throw new Permanent(inner); }).catch((e) => e);
  assert.equal(err, inner);
  assert.equal(decide(err).action, null);
  assert.equal((await g.proto.window(30)).successes, 1);
  await g.close();
});

test("fail open: the local cap admits while Redis is unreachable", async () => {
  const own = await RedisServer.start();
  const c = own.client({ maxRetriesPerRequest: null });
  const d = dep();
  await publish(c, d);
  const g = new Guard(c, d, { registry: null, redisTimeout: 100, failOpenLimit: 1 });
  await own.stop();
  let inside;
  const first = g.do({}, async () => { inside = true; await sleep(200); return "local"; });
  await sleep(150);
  assert.equal(inside, true);
  const second = await g.do({}, () => assert.fail()).catch((e) => e);
  assert.equal(second.constructor.name, "RedisUnavailable");
  assert.equal(await first, "local");
  c.disconnect();
  await g.close();
  await own.close();
});

test("the metrics have the names and labels of pkg/guard/metrics.go", async () => {
  const here = dirname(fileURLToPath(import.meta.url));
  const goSrc = readFileSync(join(here, "..", "..", "..", "pkg", "guard", "metrics.go"), "utf8");
  const goNames = new Set([...goSrc.matchAll(/c\("([a-z_]+)",/g)].map((m) => `spillway_worker_${m[1]}`));
  goNames.add("spillway_worker_slot_wait_seconds");
  goNames.add("spillway_worker_in_flight");
  for (const m of goSrc.matchAll(/Subsystem: "worker", Name: "([a-z_]+)"/g)) goNames.add(`spillway_worker_${m[1]}`);
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const registry = new Registry();
  const g = new Guard(rdb, d, { registry });
  await g.do({ attempt: 5 }, () => "ok");
  await g.do({}, async () => { throw Object.assign(new Error("slow"), { code: "ETIMEDOUT" }); }).catch(() => {});
  const names = new Set((await registry.getMetricsAsJSON()).map((m) => m.name));
  for (const n of names) assert.ok(goNames.has(n), `${n} is not a series of the Go guard`);
  for (const n of goNames) if (!n.includes("batch")) assert.ok(names.has(n), `${n} is missing`);
  const text = await registry.metrics();
  assert.match(text, new RegExp(`spillway_worker_calls_total\\{dependency="${d}",outcome="success",attempt="4\\+"\\} 1`));
  assert.match(text, new RegExp(`spillway_worker_calls_total\\{dependency="${d}",outcome="timeout",attempt="1"\\} 1`));
  assert.match(text, new RegExp(`spillway_worker_retries_scheduled_total\\{dependency="${d}"\\} 1`));
  // a second guard on the same registry shares the collectors
  const g2 = new Guard(rdb, dep(), { registry });
  await g.close();
  await g2.close();
});

test("a Redis that evicts keys is refused unless allowEviction, which sets spillway_worker_redis_evicting", async () => {
  const own = await RedisServer.start("--maxmemory-policy", "allkeys-lru");
  const c = own.client();
  try {
    const d = dep();
    await publish(c, d);
    const refused = new Guard(c, d, { registry: null, redisTimeout: 2000 });
    const err = await refused.do({}, () => assert.fail("never runs")).catch((e) => e);
    assert.ok(err instanceof EvictionPolicyError, String(err));
    assert.match(err.message, /maxmemory-policy allkeys-lru/);
    assert.equal(decide(err).action, null, "a configuration error, not a refusal");
    await refused.close();
    const registry = new Registry();
    const allowed = new Guard(c, d, { registry, redisTimeout: 2000, allowEviction: true });
    assert.equal(await allowed.do({}, () => "runs"), "runs");
    assert.match(await registry.metrics(), new RegExp(`spillway_worker_redis_evicting\\{dependency="${d}"\\} 1`));
    await allowed.close();
  } finally {
    c.disconnect();
    await own.close();
  }
});
