// Acquire+release pairs per second from one Node process, beside a pair of
// no-op EVALSHAs (noop.lua) on the same ioredis connection, measured in the
// same run (docs/benchmarks.md).
//
//   node clients/node/bench/pairs.js [--seconds 2] [--rounds 5] [--loops 1,8]
//
// Run `make node-test` (or npx tsc in clients/node) first: it imports dist/.
// Starts its own redis-server on a free loopback port. Each round runs, for
// `seconds` each and one after the other (interleaved, since back-to-back
// seconds on a busy machine differ): ioredis's own evalsha of noop.lua twice;
// the protocol client's acquire then release (two EVALSHAs, each an ioredis
// Command with its own timeout); and guard.do of a function that does
// nothing (acquire, release, the guard's deadline, lease id, AbortSignal,
// renewal timer and bookkeeping). `loops` concurrent async loops share the
// connection. It prints pairs/s per variant (median, min, max over the
// rounds), the median ratio to the no-op pair, and Redis's CPU per pair.
import { parseArgs } from "node:util";
import { Guard, protocol as P } from "../dist/index.js";
import { RedisServer, publish } from "../test/helpers.js";

const { values } = parseArgs({ options: { seconds: { type: "string", default: "2" }, rounds: { type: "string", default: "5" }, loops: { type: "string", default: "1,8" } } });
const seconds = Number(values.seconds), rounds = Number(values.rounds);
const DEP = "bench/vehicle-api";

const srv = await RedisServer.start();
const rdb = srv.client();
await publish(rdb, DEP, { limit: 1_000_000 });
const proto = new P.Client(rdb, DEP);
const guard = new Guard(rdb, DEP, { registry: null });
const noop = P.SCRIPTS.noop;
await rdb.script("LOAD", noop.text);
let lease = 0;

const variants = {
  "ioredis no-op EVALSHA pair": async () => {
    await rdb.evalsha(noop.sha, 1, proto.keys.leases);
    await rdb.evalsha(noop.sha, 1, proto.keys.leases);
  },
  "protocol acquire+release": async () => {
    const id = `bench-${process.pid}-${lease++}`;
    await proto.acquire(id, 30_000, 0, undefined, 1000);
    await proto.release(id, "s", 1, 0, 1000);
  },
  "guard.do": async () => { await guard.do({}, async () => {}); },
};

async function redisCPU() {
  const info = await rdb.info("cpu");
  const f = (k) => Number(info.match(new RegExp(`${k}:([0-9.]+)`))[1]);
  return f("used_cpu_sys") + f("used_cpu_user");
}

async function run(fn, loops) {
  const end = performance.now() + seconds * 1000;
  let n = 0;
  await Promise.all(Array.from({ length: loops }, async () => {
    while (performance.now() < end) {
      await fn();
      n++;
    }
  }));
  return n / seconds;
}

const median = (a) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)];
for (const loops of values.loops.split(",").map(Number)) {
  const got = Object.fromEntries(Object.keys(variants).map((k) => [k, { rate: [], ratio: [], cpu: [] }]));
  for (let r = 0; r < rounds; r++) {
    let base = 0;
    for (const [name, fn] of Object.entries(variants)) {
      await run(fn, loops); // warm
      const c0 = await redisCPU();
      const rate = await run(fn, loops);
      const c1 = await redisCPU();
      if (!base) base = rate;
      got[name].rate.push(rate);
      got[name].ratio.push(rate / base);
      got[name].cpu.push(((c1 - c0) / (rate * seconds)) * 1e6);
    }
  }
  for (const [name, g] of Object.entries(got)) {
    console.log(`loops ${loops} | ${name} | ${median(g.rate).toFixed(0)} (${Math.min(...g.rate).toFixed(0)}–${Math.max(...g.rate).toFixed(0)}) pairs/s | ` +
      `Redis CPU ${median(g.cpu).toFixed(0)} µs/pair | ratio ${median(g.ratio).toFixed(2)} (${Math.min(...g.ratio).toFixed(2)}–${Math.max(...g.ratio).toFixed(2)})`);
  }
}
await guard.close();
rdb.disconnect();
await srv.close();
