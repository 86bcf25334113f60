// The scripts through the Node client's typed calls, against a real
// redis-server: replies, the {6, ...} version reply as a typed error naming
// both versions, probes of a HalfOpen epoch, and the dead-man rule.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { protocol as P, VERSION } from "../dist/index.js";
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

test("acquire admits up to the limit, then refuses throttled; release frees and counts", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 2 });
  const c = new P.Client(rdb, d);
  const a = await c.acquire("l1", 5000);
  assert.equal(a.code, P.ADMITTED);
  assert.equal(a.limit, 2);
  assert.equal(a.state, "Closed");
  assert.ok(Math.abs(a.nowMs - Date.now()) < 5000);
  assert.equal((await c.acquire("l2", 5000)).code, P.ADMITTED);
  const r = await c.acquire("l3", 5000);
  assert.equal(r.code, P.REFUSED_THROTTLED);
  assert.equal(r.held, 2);
  assert.equal(r.limit, 2);
  assert.ok(r.waitMs > 0 && r.waitMs <= 5000);
  assert.equal(await c.liveLeases(), 2);
  assert.equal(await c.release("l1", "f", 1, 0, 0, 12), true);
  assert.equal(await c.release("l1", "f", 1), false, "a second release of the same lease counts nothing");
  assert.equal(await c.release("l2", "s", 2, 0, 0, 5), true);
  const w = await c.window(30);
  assert.equal(w.calls, 2);
  assert.equal(w.failures, 1);
  assert.equal(w.successes, 1);
  assert.equal(w.a1, 1);
  assert.equal(w.a2, 1);
  assert.equal(w.timedSuccesses, 1);
  assert.equal(w.successMicros, 5000);
});

test("no policy and a state version these scripts do not act on are typed errors; the version error names the versions", async () => {
  const d = dep();
  const c = new P.Client(rdb, d);
  await assert.rejects(c.acquire("x", 1000), P.NoPolicyError);
  await assert.rejects(c.budget(), P.NoPolicyError);
  await publish(rdb, d);
  for (const v of [P.MIN_STATE_VERSION, P.MAX_STATE_VERSION]) {
    await rdb.hset(c.keys.state, "version", String(v));
    assert.equal((await c.acquire(`in-${v}`, 1000)).code, P.ADMITTED, `state version ${v} is in the skew`);
  }
  await rdb.hset(c.keys.state, "version", "7");
  await rdb.hset(c.keys.state, "manager_version", "8", "manager_seq", await rdb.hget(c.keys.state, "seq"));
  const err = await c.acquire("y", 1000).then(() => null, (e) => e);
  assert.ok(err instanceof P.VersionError, String(err));
  assert.equal(err.stateVersion, 7);
  assert.equal(err.managerVersion, 8);
  assert.equal(err.clientVersion, VERSION);
  assert.match(err.message, new RegExp(`manager at protocol version 8 for workers at protocol version 7 or later; this worker speaks version ${VERSION}, which acts on state versions ${P.MIN_STATE_VERSION} to ${P.MAX_STATE_VERSION}: upgrade this worker's Spillway client`));
  await assert.rejects(c.budget(), P.VersionError);
  await rdb.hset(c.keys.state, "version", "3");
  const old = await c.acquire("z", 1000).then(() => null, (e) => e);
  assert.match(old.message, /upgrade the Spillway manager/);
});

test("register records the client and this version for the process; a release counts this version's calls", async () => {
  const d = dep();
  await publish(rdb, d);
  const c = new P.Client(rdb, d);
  const now = await c.register("node", "proc-1");
  assert.ok(Math.abs(now - Date.now()) < 5000);
  assert.deepEqual(await rdb.zrange(c.keys.clients, 0, -1), [`node ${VERSION} proc-1`]);
  assert.ok((await rdb.pttl(c.keys.clients)) > 500_000);
  await assert.rejects(c.register("no de", "p"), TypeError);
  await c.acquire("v1", 1000);
  await c.release("v1", "s", 1);
  const calls = await rdb.hgetall(c.keys.calls);
  assert.deepEqual(Object.values(calls), ["1"]);
  assert.match(Object.keys(calls)[0], new RegExp(`^\\d+0:${VERSION}$`));
});

test("rate, open, superseded and late refusals", async () => {
  const d = dep();
  const c = new P.Client(rdb, d);
  await publish(rdb, d, { limit: 100, rate: 1 }); // one call a second, burst 1: the second within it is refused
  assert.equal((await c.acquire("r1", 1000)).code, P.ADMITTED);
  const rate = await c.acquire("r2", 1000);
  assert.equal(rate.code, P.REFUSED_RATE);
  assert.ok(rate.waitMs >= 1 && rate.waitMs <= 1000, String(rate.waitMs));

  const now = await redisNowMs(rdb);
  await publish(rdb, d, { epoch: 2, state: "Open", limit: 0, openUntilMs: now + 4000 });
  const open = await c.acquire("o1", 1000);
  assert.equal(open.code, P.REFUSED_OPEN);
  assert.ok(open.waitMs > 3000 && open.waitMs <= 4000);

  await publish(rdb, d, { epoch: 3, limit: 100 });
  assert.equal(await c.supersede("job-1", 5, 60000), 5);
  const sup = await c.acquire("s1", 1000, 0, { key: "job-1", version: 4, ttlMs: 60000 });
  assert.equal(sup.code, P.REFUSED_SUPERSEDED);
  assert.equal(sup.newest, 5);
  assert.equal((await c.acquire("s2", 1000, 0, { key: "job-1", version: 5, ttlMs: 60000 })).code, P.ADMITTED);

  const late = await c.acquire("late", 1000, now - 10_000);
  assert.equal(late.code, P.REFUSED_LATE);
});

test("budget: the rule of docs/protocol.md §6 and the published backoff", async () => {
  const d = dep();
  const c = new P.Client(rdb, d);
  await publish(rdb, d, { minRetries: 2, ratioPPM: 0, backoffBaseMs: 150, backoffMaxMs: 900, jitter: "Equal" });
  const a = await c.budget();
  assert.deepEqual([a.allowed, a.backoffBaseMs, a.backoffMaxMs, a.jitter, a.granted], [true, 150, 900, "Equal", 0]);
  assert.equal((await c.budget()).allowed, true);
  const third = await c.budget();
  assert.equal(third.allowed, false);
  assert.equal(third.granted, 2);
});

test("HalfOpen admits the epoch's probes; a probe's outcome counts in probes only with its epoch", async () => {
  const d = dep();
  const c = new P.Client(rdb, d);
  await publish(rdb, d, { epoch: 5, state: "HalfOpen", limit: 2 });
  const p1 = await c.acquire("p1", 5000);
  assert.equal(p1.code, P.ADMITTED);
  assert.equal(p1.state, "HalfOpen");
  assert.equal(p1.epoch, 5);
  assert.equal((await c.acquire("p2", 5000)).code, P.ADMITTED);
  assert.equal((await c.acquire("p3", 5000)).code, P.REFUSED_THROTTLED);
  await c.release("p1", "s", 1, 5);
  assert.equal((await c.acquire("p4", 5000)).code, P.REFUSED_THROTTLED, "an epoch admits its probes in all, not at a time");
  await c.release("p2", "c", 1, 5);
  assert.equal((await c.acquire("p5", 5000)).code, P.ADMITTED, "a cancelled probe gives its probe back");
  const w = await c.window(30);
  assert.equal(w.probeSuccesses, 1);
});

test("the dead-man rule: a stale Open admits half_open_probes calls at a time, answered Open", async () => {
  const d = dep();
  const c = new P.Client(rdb, d);
  const now = await redisNowMs(rdb);
  await publish(rdb, d, { state: "Open", limit: 0, openUntilMs: now + 60_000, staleAfterMs: 1, halfOpenProbes: 2 });
  await new Promise((r) => setTimeout(r, 20));
  const a = await c.acquire("d1", 5000);
  assert.equal(a.code, P.ADMITTED);
  assert.equal(a.state, "Open");
  assert.equal((await c.acquire("d2", 5000)).code, P.ADMITTED);
  assert.equal((await c.acquire("d3", 5000)).code, P.REFUSED_THROTTLED);
  await c.release("d1", "s", 1);
  assert.equal((await c.acquire("d4", 5000)).code, P.ADMITTED, "at a time, not per epoch");
});

test("EVALSHA falls back to the script's text after SCRIPT FLUSH", async () => {
  const d = dep();
  await publish(rdb, d);
  await rdb.script("FLUSH");
  const c = new P.Client(rdb, d);
  assert.equal((await c.acquire("f1", 1000)).code, P.ADMITTED);
  const stats = await rdb.info("commandstats");
  assert.match(stats, /cmdstat_eval:/);
});

test("dependency names are validated", () => {
  assert.throws(() => new P.Client(rdb, "no-slash"), TypeError);
  assert.throws(() => new P.Client(rdb, "Upper/case"), TypeError);
  assert.throws(() => new P.Client(rdb, "ns/{tag}"), TypeError);
  assert.equal(new P.Client(rdb, "shop/payments").keys.state, `${P.KEY_PREFIX}{shop/payments}:state`);
});
