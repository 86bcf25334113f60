// Learning (protocol 6, docs/protocol.md §4 "Learning"), against a real
// redis-server per test: after a failover to a replica that missed a
// lease's write (a new replication id with the data kept, then the lease
// removed) or a restart without data (FLUSHALL), nothing new is admitted for
// LEARN_FOR while the holders put back what they hold: hold, renew, and the
// guard's own hold every HOLD_EVERY while it holds leases. The protocol
// tests mirror pkg/protocol/learning_test.go.
import { test, beforeEach, afterEach } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { Guard, Throttled, NoPolicy, LeaseLost, protocol as P, VERSION } from "../dist/index.js";
import { RedisServer, dep, publish, stateFields } from "./helpers.js";

let srv, rdb;
beforeEach(async () => {
  srv = await RedisServer.start();
  rdb = srv.client();
});
afterEach(async () => {
  rdb.disconnect();
  await srv.close();
});

async function replId() {
  const m = /master_replid:(\w+)/.exec(await rdb.info("replication"));
  assert.ok(m, "no master_replid in INFO replication");
  return m[1];
}

/**
 * Gives the server a new replication id with its data kept, as a replica
 * promoted by a failover gets one: REPLICAOF an address nobody listens on,
 * then REPLICAOF NO ONE. A failover follows a crash that takes a second or
 * more to detect: it first waits out the scripts' replication-id check
 * period (100 ms, lib.lua replid_every_ms), so that nothing they recorded is
 * more recent.
 */
async function promote() {
  await new Promise((r) => setTimeout(r, 150));
  const before = await replId();
  await rdb.call("REPLICAOF", "127.0.0.1", "1");
  await rdb.call("REPLICAOF", "NO", "ONE");
  assert.notEqual(await replId(), before, "the replication id did not change");
}

async function acquire(c, id) {
  return await c.acquire(id, 30_000);
}

async function admit(c, id) {
  const a = await acquire(c, id);
  assert.equal(a.code, P.ADMITTED, `acquisition of ${id} = ${JSON.stringify(a)}, want admitted`);
  return a;
}

/** The live leases' members, without the encoding member. */
async function members(c) {
  return (await rdb.zrange(c.keys.leases, 0, -1)).filter((m) => !m.startsWith("encoding:"));
}

/** Polls until member is in the leases set; the ms it took, or -1 after within ms. */
async function backWithin(c, member, within) {
  const start = performance.now();
  for (;;) {
    if ((await rdb.zscore(c.keys.leases, member)) !== null) return performance.now() - start;
    if (performance.now() - start > within) return -1;
    await sleep(5);
  }
}

// -- the protocol (pkg/protocol/learning_test.go) ------------------------

test("a version-6 manager's publish writes state version 5 and manager version 6", async () => {
  const d = dep();
  await publish(rdb, d);
  const c = new P.Client(rdb, d);
  assert.deepEqual(await rdb.hmget(c.keys.state, "version", "manager_version"), [String(VERSION - 1), String(VERSION)]);
});

test("failover: the first admission is refused while learning, hold puts the lease back, after learning the cap counts it", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 2 });
  const c = new P.Client(rdb, d);
  const a = await admit(c, "a");
  const b = await admit(c, "b");
  assert.equal(await rdb.hget(c.keys.state, "replid"), await replId(), "the state records the server's replication id at the first admission");

  await promote();
  await rdb.zrem(c.keys.leases, b.member); // the write the replica missed

  const x = await acquire(c, "x");
  assert.equal(x.code, P.REFUSED_THROTTLED, `the first acquisition after the failover = ${JSON.stringify(x)}, want refused while learning`);
  assert.ok(x.waitMs > 0 && x.waitMs <= P.LEARN_FOR, `wait ${x.waitMs}ms, want the learning left, at most ${P.LEARN_FOR}`);
  assert.ok(Number(await rdb.hget(c.keys.state, "learn_until_ms")) > 0, "the state does not say until when the dependency learns");
  const h = await c.hold([a.member, b.member], 30_000);
  assert.ok(h.learningMs > 0 && !h.noState && h.putBack === 1, `hold = ${JSON.stringify(h)}, want learning, one lease put back`);

  await sleep(P.LEARN_FOR + 50);
  const after = await acquire(c, "y");
  assert.ok(after.code === P.REFUSED_THROTTLED && after.held === 2, `after learning = ${JSON.stringify(after)}, want throttled with the 2 leases held`);

  // Outside learning hold writes nothing, and a lease the fleet stopped
  // counting is not put back.
  await rdb.zrem(c.keys.leases, b.member);
  assert.deepEqual(await c.hold([a.member, b.member], 30_000), { learningMs: 0, noState: false, putBack: 0, lost: [b.member] },
    "outside learning hold puts nothing back, and names the lease the fleet no longer counts");
  assert.equal(await c.renew(b.member, 30_000), false, "a renewal of a missing lease outside learning is lost");
  await admit(c, "z");
});

test("failover: a renewal, the first script on the new server, puts its lease back", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const c = new P.Client(rdb, d);
  const a = await admit(c, "a");
  await promote();
  await rdb.zrem(c.keys.leases, a.member);
  assert.equal(await c.renew(a.member, 30_000), true, "renewal of a lease the failover lost");
  await sleep(P.LEARN_FOR + 50);
  const x = await acquire(c, "x");
  assert.ok(x.code === P.REFUSED_THROTTLED && x.held === 1, `after learning = ${JSON.stringify(x)}, want throttled with the lease held`);
});

test("restart without data: hold puts the lease back with no state; a restored publication learns", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 2 });
  const c = new P.Client(rdb, d);
  const a = await admit(c, "a");
  await rdb.flushall();
  const h = await c.hold([a.member], 30_000);
  assert.deepEqual(h, { learningMs: 0, noState: true, putBack: 1, lost: [] }, "hold with no state puts the lease back");
  assert.deepEqual(await members(c), [a.member]);
  await assert.rejects(c.acquire("n", 30_000), P.NoPolicyError, "nobody admits without a state");

  const fields = { ...stateFields({ limit: 2 }), restored: 1 };
  assert.equal((await c.publish(1, fields))[0], 1);
  const x = await acquire(c, "x");
  assert.ok(x.code === P.REFUSED_THROTTLED && x.waitMs > 0, `the first acquisition after a restored publication = ${JSON.stringify(x)}, want refused while learning`);
  await sleep(P.LEARN_FOR + 50);
  await admit(c, "y");
  const z = await acquire(c, "z");
  assert.ok(z.code === P.REFUSED_THROTTLED && z.held === 2, `acquisition = ${JSON.stringify(z)}, want throttled: the put-back lease and the new one`);

  // A publication over a state that is there does not learn, restored or not.
  assert.equal((await c.publish(2, fields))[0], 1);
  assert.ok(Number(await rdb.hget(c.keys.state, "learn_until_ms")) < Date.now() + 5, "learning after publishing over a stored state");
});

for (const loss of ["failover, lease kept", "failover, lease lost", "restart without data"]) {
  test(`${loss}: a released lease stays released; a hold or renewal that arrives after the release does not put it back`, async () => {
    // As TestReleasedLeaseStaysReleasedWhileLearning in Go: a hold sent
    // before a call ended can reach Redis after its release, on another
    // connection (release.lua records the lease in `released`).
    const d = dep();
    await publish(rdb, d, { limit: 1 });
    const c = new P.Client(rdb, d);
    const a = await admit(c, "a");
    if (loss === "restart without data") {
      await rdb.flushall();
    } else {
      await promote();
      if (loss === "failover, lease lost") await rdb.zrem(c.keys.leases, a.member);
    }
    await c.release(a.member, "s", 1);
    const h = await c.hold([a.member], 30_000);
    assert.equal(h.putBack, 0, `a hold after the release put the lease back: ${JSON.stringify(h)}`);
    assert.equal(await c.renew(a.member, 30_000), false, "a renewal after the release put the lease back");
    assert.deepEqual(await members(c), []);
    if (h.noState) assert.equal((await c.publish(1, { ...stateFields({ limit: 1 }), restored: 1 }))[0], 1);
    await sleep(P.LEARN_FOR + 50);
    await admit(c, "b");
  });
}

// -- the guard: its running calls' leases put back by itself -------------

/** A call that runs until released; resolves started once it runs. */
function holdCall(g) {
  let release;
  const gate = new Promise((r) => { release = r; });
  let started;
  const running = new Promise((r) => { started = r; });
  const done = g.do({}, async () => {
    started();
    await gate;
    return "done";
  });
  return { running, done, release: () => release() };
}

// leaseTtl 30 s: the renewal tick (every sixth of it) does not run within
// these tests, so only the guard's hold puts a lease back.
const guard = (d) => new Guard(rdb, d, { registry: null, redisTimeout: 2000, leaseTtl: 30_000 });

// HOLD_EVERY, plus one hold round trip and the event loop on a busy 2-core
// machine: the guard's hold runs at most HOLD_EVERY after the loss.
const PUT_BACK_WITHIN = P.HOLD_EVERY + 150;

test("guard: after a failover its running call's lease is back within HOLD_EVERY; nothing is admitted while learning, nor after into its slot", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const g = guard(d), other = guard(d);
  const call = holdCall(g);
  await call.running;
  const [member] = await members(g.proto);
  assert.ok(member, "the running call holds no lease");

  await promote();
  await rdb.zrem(g.proto.keys.leases, member); // the write the replica missed
  const learnFrom = performance.now();

  const during = await other.do({}, () => assert.fail("admitted while learning")).catch((e) => e);
  assert.ok(during instanceof Throttled, `an acquisition while learning = ${during}, want throttled`);
  assert.match(during.detail, /learn/, "the refusal says the dependency learns");

  const took = await backWithin(g.proto, member, PUT_BACK_WITHIN);
  assert.ok(took >= 0, `the guard did not put its lease back within ${PUT_BACK_WITHIN}ms`);

  await sleep(Math.max(0, learnFrom + P.LEARN_FOR + 50 - performance.now()));
  assert.equal(g.heldBack, 1, "the guard's hold put the lease back");
  const after = await other.do({}, () => assert.fail("admitted into the running call's slot")).catch((e) => e);
  assert.ok(after instanceof Throttled, `an acquisition after learning, at limit 1 with the first call running = ${after}, want throttled`);
  assert.match(after.detail, /1 held, limit 1/);

  call.release();
  assert.equal(await call.done, "done");
  assert.equal(await g.proto.liveLeases(), 0);
  await g.close();
  await other.close();
});

test("guard: after a restart without data (FLUSHALL) its running call's lease is back, with no state", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const g = guard(d);
  const call = holdCall(g);
  await call.running;
  const [member] = await members(g.proto);
  await rdb.flushall();
  const took = await backWithin(g.proto, member, PUT_BACK_WITHIN);
  assert.ok(took >= 0, `the guard did not put its lease back within ${PUT_BACK_WITHIN}ms`);
  assert.equal(await rdb.exists(g.proto.keys.state), 0, "hold wrote a state");
  const refused = await g.do({}, () => assert.fail("admitted without a state")).catch((e) => e);
  assert.ok(refused instanceof NoPolicy, String(refused));
  call.release();
  assert.equal(await call.done, "done");
  await g.close();
});

test("guard: a failed hold is tried again after HOLD_RETRY_EVERY, not a whole HOLD_EVERY later", async (t) => {
  // As TestHolderTriesAgainSoonAfterAFailedHold in Go: the learning second
  // counts from the first script on the new server, so a holder must not
  // wait a whole HOLD_EVERY after a hold that failed: 4 attempts a second
  // with HOLD_EVERY alone. The client fails at once while Redis is down.
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const fast = srv.client({ enableOfflineQueue: false, maxRetriesPerRequest: 0 });
  if (fast.status !== "ready") await new Promise((r) => fast.once("ready", r));
  const g = new Guard(fast, d, { registry: null, redisTimeout: 100, leaseTtl: 30_000 });
  const attempts = [];
  // Holds go on the user's client, or on the guard's own connection while
  // the user's is not ready: every hold of this dependency is counted.
  const real = P.Client.prototype.hold;
  P.Client.prototype.hold = function (...args) {
    if (this.dependency === d) attempts.push(performance.now());
    return real.apply(this, args);
  };
  t.after(() => { P.Client.prototype.hold = real; });
  const call = holdCall(g);
  await call.running;
  await srv.stop();
  const start = performance.now();
  await sleep(1000);
  const n = attempts.filter((t) => t >= start && t < start + 1000).length;
  await srv.start();
  call.release();
  assert.equal(await call.done, "done");
  await g.close();
  fast.disconnect();
  assert.ok(n >= 10, `${n} holds in the second Redis was down`);
});

test("guard: a running call's lease is back at once after Redis restarts, though the user's client reconnects once a second", async (t) => {
  // As TestHolderIsBackAtOnceBehindAClientThatDialsOnceASecond in Go: the
  // learning second counts from the first script on the new server, and a
  // holder behind a client that waits a second before it reconnects
  // (ioredis's default retryStrategy grows to 2 s over a long outage) would
  // miss it. Redis comes back just after that client scheduled its wait.
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const slow = srv.client({ retryStrategy: () => 1000 });
  if (slow.status !== "ready") await new Promise((r) => slow.once("ready", r));
  const g = new Guard(slow, d, { registry: null, redisTimeout: 100, leaseTtl: 30_000 });
  const call = holdCall(g);
  await call.running;
  await srv.stop();
  await sleep(1200);
  await new Promise((r) => slow.once("reconnecting", r));
  await srv.start(); // without its data: hold puts the lease back
  const back = performance.now();
  const check = srv.client();
  let took = -1;
  while (performance.now() - back < 2000) {
    const n = await check.zcount(g.proto.keys.leases, "(" + Date.now(), "+inf").catch(() => 0);
    if (n >= 1) { took = performance.now() - back; break; }
    await sleep(2);
  }
  call.release();
  assert.equal(await call.done, "done");
  await g.close();
  slow.disconnect();
  check.disconnect();
  t.diagnostic(`the lease back ${Math.round(took)} ms after Redis answered again`);
  assert.ok(took >= 0 && took < 500, `the lease back ${Math.round(took)} ms after Redis answered again (-1: not within 2 s)`);
});

test("guard: a hold outside learning cuts a call whose lease the fleet lost, at once, not at its next renewal", async () => {
  // As TestHoldCutsACallWhoseLeaseTheFleetLost in Go: a holder back after
  // the learning second finds its lease gone, and another call may hold
  // the slot already.
  const d = dep();
  await publish(rdb, d, { limit: 1 });
  const g = guard(d);
  let signal;
  const done = g.do({}, async (s) => {
    signal = s;
    await new Promise((r) => signal.addEventListener("abort", r, { once: true }));
    throw signal.reason;
  }).catch((e) => e);
  for (let i = 0; i < 200 && !signal; i++) await sleep(5);
  assert.ok(signal, "the call did not start");
  await rdb.del(g.proto.keys.leases);
  const start = performance.now();
  const err = await Promise.race([done, sleep(P.HOLD_EVERY + 1000).then(() => "still running")]);
  assert.notEqual(err, "still running", "the call was not cut at the next hold");
  assert.ok(signal.reason instanceof LeaseLost, `the call's signal says ${signal.reason}, want LeaseLost`);
  assert.ok(performance.now() - start <= P.HOLD_EVERY + 1000);
  await g.close();
});

test("guard: the hold timer runs only while leases are held, and stops on close()", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 2 });
  const g = guard(d);
  const holds = () => rdb.info("commandstats").then((s) => Number(/cmdstat_evalsha:calls=(\d+)/.exec(s)?.[1] ?? 0));
  await g.do({}, () => "warm"); // the background registration's EVALSHA, the eviction check
  await sleep(2 * P.HOLD_EVERY); // the tick that finds nothing held stops the timer
  const idle = await holds();
  await sleep(3 * P.HOLD_EVERY);
  assert.equal(await holds(), idle, "EVALSHA ran while no lease was held");

  const call = holdCall(g);
  await call.running;
  const running = await holds();
  await sleep(4 * P.HOLD_EVERY + 100);
  const n = (await holds()) - running;
  assert.ok(n >= 3 && n <= 5, `${n} EVALSHA in ${4 * P.HOLD_EVERY + 100}ms with a call running, want a hold every ${P.HOLD_EVERY}ms`);

  const closing = g.close();
  call.release();
  await closing;
  await call.done.catch(() => {});
  const closed = await holds();
  await sleep(3 * P.HOLD_EVERY);
  assert.equal(await holds(), closed, "EVALSHA ran after close()");
});
