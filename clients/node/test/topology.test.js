// Redis Cluster and Sentinel through ioredis, on real servers: a 3-master
// cluster formed as internal/redistest/cluster.go forms one, and a master, a
// replica and three sentinels as internal/redistest/sentinel.go starts them.
// Every key of one dependency shares a hash slot; two guards share one
// fleet-wide limit, and the failure and retry-budget path works; through
// Sentinel the guard follows a failover, after the new master learned.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { Redis, Cluster } from "ioredis";
import { Guard, CallFailed, Throttled, RedisUnavailable, protocol as P } from "../dist/index.js";
import { dep, publish, startCluster, startSentinel } from "./helpers.js";

let cluster;
before(async () => { cluster = await startCluster(3); });
after(async () => { await cluster?.close(); });

function clusterClient() {
  const c = new Cluster(cluster.nodes.map((n) => ({ host: "127.0.0.1", port: n.port })));
  c.on("error", () => {});
  return c;
}

test("cluster: a dependency's keys share a slot, dependencies spread over the masters", async () => {
  const c = clusterClient();
  const { default: calculateSlot } = await import("cluster-key-slot");
  const masters = new Set();
  for (let i = 0; i < 12; i++) {
    const k = new P.Keys(P.parseDependency(`team-${i}/api`));
    const slots = new Set([k.state, k.leases, k.gcra, k.stats, k.probes, k.wants, k.callers, k.job("vin-1")].map(calculateSlot));
    assert.equal(slots.size, 1);
    masters.add(Math.floor([...slots][0] / Math.floor(16384 / 3)));
  }
  assert.equal(masters.size, 3);
  c.disconnect();
});

test("cluster: two guards share one limit; failures, the budget and probes work", async () => {
  const c = clusterClient();
  const d = dep();
  await publish(c, d, { limit: 3, backoffBaseMs: 100, backoffMaxMs: 400 });
  const g1 = new Guard(c, d, { registry: null, redisTimeout: 2000 }); // not about a slow Redis; a busy machine
  const g2 = new Guard(c, d, { registry: null, redisTimeout: 2000 });
  let running = 0, most = 0;
  const holders = [];
  let started = 0;
  for (let i = 0; i < 3; i++) {
    holders.push((i % 2 ? g1 : g2).do({}, async () => { started++; running++; most = Math.max(most, running); await sleep(300); running--; }));
  }
  while (started < 3) await sleep(5); // all three hold their slots (a busy machine connects slowly)
  const refused = await g1.do({}, () => assert.fail()).catch((e) => e);
  assert.ok(refused instanceof Throttled, String(refused));
  await Promise.all(holders);
  assert.equal(most, 3);
  const failed = await g2.do({ attempt: 2 }, async () => { throw new Error("down"); }).catch((e) => e);
  assert.ok(failed instanceof CallFailed, String(failed));
  assert.ok(failed.after <= 200);
  const w = await g1.proto.window(30);
  assert.deepEqual([w.successes, w.failures, w.granted], [3, 1, 1]);
  await g1.close();
  await g2.close();
  c.disconnect();
});

test("sentinel: the guard works through the master ioredis finds, and after a failover", { timeout: 60_000 }, async () => {
  const s = await startSentinel();
  try {
    const c = new Redis({ sentinels: s.sentinels, name: s.masterName });
    c.on("error", () => {});
    const d = dep();
    await publish(c, d, { limit: 2 });
    const g = new Guard(c, d, { registry: null, redisTimeout: 1000 });
    assert.equal(await g.do({}, () => "via sentinel"), "via sentinel");
    await s.master.stop(); // the sentinels promote the replica
    const deadline = Date.now() + 30_000;
    let refusals = 0, learning = 0;
    for (;;) {
      const got = await g.do({}, () => "after failover").catch((e) => e);
      if (got === "after failover") break;
      // The promoted replica has a new replication id: it admits nothing
      // for LEARN_FOR (docs/protocol.md §4 "Learning").
      if (got instanceof Throttled && /learns/.test(got.detail)) learning++;
      else assert.ok(got instanceof RedisUnavailable, String(got));
      refusals++;
      assert.ok(Date.now() < deadline, "the guard never reached the new master");
      await sleep(100);
    }
    assert.ok(refusals > 0);
    assert.ok(learning > 0, "the new master admitted at once: it did not learn");
    assert.equal((await g.proto.window(30)).successes, 2, "the replica had the first call's outcome");
    await g.close();
    c.disconnect();
  } finally {
    await s.close();
  }
});
