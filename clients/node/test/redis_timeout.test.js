// Refusals are bounded by redisTimeout when Redis does not answer, connecting
// included: a real redis-server with a password, paused (SIGSTOP) or stopped,
// behind an ioredis client with its default settings (connectTimeout 10 s,
// reconnection on, an offline queue). Each refusal is measured; the bound
// asserted is generous (1 s against a 0.1 s redisTimeout): without the
// guard's own bound, the AUTH alone waits ioredis's connectTimeout.
import { test } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { Redis } from "ioredis";
import { Guard, RedisUnavailable } from "../dist/index.js";
import { RedisServer, dep, publish } from "./helpers.js";

const REDIS_TIMEOUT = 100;
const BOUND = 1000;

async function refusalTimes(g, before) {
  const took = [];
  for (let i = 0; i < 5; i++) {
    await before?.();
    const t0 = performance.now();
    const err = await g.do({}, () => assert.fail("never runs")).catch((e) => e);
    took.push(performance.now() - t0);
    assert.ok(err instanceof RedisUnavailable, String(err));
  }
  return took;
}

test("refusals with Redis paused, reconnecting and handshaking (AUTH), or stopped, are bounded by redisTimeout", async () => {
  const srv = new RedisServer([], "s3cret");
  await srv.start();
  const d = dep();
  const admin = srv.client();
  await publish(admin, d, { limit: 4 });
  admin.disconnect();
  const c = new Redis({ host: "127.0.0.1", port: srv.port, password: "s3cret" });
  c.on("error", () => {});
  const g = new Guard(c, d, { registry: null, redisTimeout: REDIS_TIMEOUT });
  const fresh = new Redis({ host: "127.0.0.1", port: srv.port, password: "s3cret", lazyConnect: true });
  fresh.on("error", () => {});
  const g2 = new Guard(fresh, d, { registry: null, redisTimeout: REDIS_TIMEOUT });
  try {
    // Up first (a busy machine may refuse the very first call at 100 ms).
    for (let deadline = Date.now() + 10_000; (await g.do({}, () => "up").catch((e) => e)) !== "up";) {
      assert.ok(Date.now() < deadline, "the guard never admitted a call");
      await sleep(50);
    }
    srv.pause();
    const paused = await refusalTimes(g, () => { c.disconnect(true); }); // the next call connects and sends AUTH
    fresh.connect().catch(() => {}); // a new client: its first connection is on the call path
    const connecting = await refusalTimes(g2);
    srv.resume();
    await srv.stop();
    const stopped = await refusalTimes(g);
    const fmt = (a) => a.map((t) => `${t.toFixed(0)}ms`).join(", ");
    console.log(`# refusals, redisTimeout ${REDIS_TIMEOUT}ms: paused+reconnect ${fmt(paused)}; new client ${fmt(connecting)}; stopped ${fmt(stopped)}`);
    for (const t of [...paused, ...connecting, ...stopped]) assert.ok(t < BOUND, `a refusal took ${t}ms: not bounded by redisTimeout`);
    await srv.start(); // the same port, no data: the controller publishes again
    const admin2 = srv.client();
    await publish(admin2, d, { limit: 4 });
    admin2.disconnect();
    const deadline = Date.now() + 10_000;
    for (;;) {
      const got = await g.do({}, () => "back").catch((e) => e);
      if (got === "back") break;
      assert.ok(got instanceof RedisUnavailable, String(got));
      assert.ok(Date.now() < deadline, "the guard never came back");
      await sleep(50);
    }
  } finally {
    srv.resume();
    await g.close();
    await g2.close();
    c.disconnect();
    fresh.disconnect();
    await srv.close();
  }
});
