// Acquire+release pairs per second from one Node process, beside a pair of
// no-op EVALSHAs (noop.lua) on the same ioredis connection, measured in the
// same run (docs/benchmarks.md).
//
//   node clients/node/bench/pairs.js [--seconds 0.5] [--rounds 20] [--loops 1,8]
//
// Run `make node-test` (or npx tsc in clients/node) first: it imports dist/.
// Starts its own redis-server on a free loopback port. Each round runs, for
// `seconds` each and one after the other (interleaved, since back-to-back
// seconds on a busy machine differ; the no-op pair again at the end, each
// variant's ratio being to the mean of the two no-op slices around it):
// ioredis's own evalsha of noop.lua twice;
// the protocol client's acquire then release (two EVALSHAs, each an ioredis
// Command with its own timeout); and guard.do of a function that does
// nothing (acquire, release, the guard's deadline, lease id and
// bookkeeping), and of one that takes its AbortSignal (which the guard then
// makes). `loops` concurrent async loops share the
// connection. It prints pairs/s per variant (median, min, max over the
// rounds), the ratio to the no-op pair (median and quartiles over the
// rounds), and Redis's and the client's CPU per pair.
import { parseArgs } from "node:util";
import { Guard, protocol as P } from "../dist/index.js";
import { RedisServer, publish } from "../test/helpers.js";

const { values } = parseArgs({ options: { seconds: { type: "string", default: "0.5" }, rounds: { type: "string", default: "20" }, loops: { type: "string", default: "1,8" } } });
const seconds = Number(values.seconds), rounds = Number(values.rounds);
const DEP = "bench/vehicle-api";

const srv = await RedisServer.start();
const rdb = srv.client();
await publish(rdb, DEP, { limit: 1_000_000 });
const proto = new P.Client(rdb, DEP);
const guard = new Guard(rdb, DEP, { registry: null, redisTimeout: 1000 }); // the protocol variant's bound too
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
  "guard.do, the call taking its AbortSignal": async () => { await guard.do({}, async (signal) => signal); },
};

async function redisCPU() {
  const info = await rdb.info("cpu");
  const f = (k) => Number(info.match(new RegExp(`${k}:([0-9.]+)`))[1]);
  return f("used_cpu_sys") + f("used_cpu_user");
}

let clientCPU = 0; // µs of this process's CPU in the last run
async function run(fn, loops) {
  const end = performance.now() + seconds * 1000;
  const u0 = process.cpuUsage();
  let n = 0;
  await Promise.all(Array.from({ length: loops }, async () => {
    while (performance.now() < end) {
      await fn();
      n++;
    }
  }));
  const u = process.cpuUsage(u0);
  clientCPU = (u.user + u.system) / n;
  return n / seconds;
}

const median = (a) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)];
const names = Object.keys(variants);
for (const loops of values.loops.split(",").map(Number)) {
  const got = Object.fromEntries(names.map((k) => [k, { rate: [], ratio: [], cpu: [], client: [] }]));
  for (const fn of Object.values(variants)) await run(fn, loops); // warm
  for (let r = 0; r < rounds; r++) {
    // noop, the others, noop again: each variant's ratio is to the mean of
    // the two no-op slices around it, so that the machine's load drifting
    // within a round cancels out.
    const slice = {};
    for (const name of [...names, names[0]]) {
      const c0 = await redisCPU();
      const rate = await run(variants[name], loops);
      const c1 = await redisCPU();
      const cpu = ((c1 - c0) / (rate * seconds)) * 1e6;
      const client = clientCPU;
      if (name === names[0] && slice[name]) {
        const a = slice[name];
        slice[name] = { rate: (a.rate + rate) / 2, cpu: (a.cpu + cpu) / 2, client: (a.client + client) / 2 };
      } else {
        slice[name] = { rate, cpu, client };
      }
    }
    for (const name of names) {
      got[name].rate.push(slice[name].rate);
      got[name].ratio.push(slice[name].rate / slice[names[0]].rate);
      got[name].cpu.push(slice[name].cpu);
      got[name].client.push(slice[name].client);
    }
  }
  for (const [name, g] of Object.entries(got)) {
    const q = [...g.ratio].sort((x, y) => x - y);
    console.log(`loops ${loops} | ${name} | ${median(g.rate).toFixed(0)} (${Math.min(...g.rate).toFixed(0)}–${Math.max(...g.rate).toFixed(0)}) pairs/s | ` +
      `Redis CPU ${median(g.cpu).toFixed(0)} µs/pair | client CPU ${median(g.client).toFixed(0)} µs/pair | ratio median ${median(g.ratio).toFixed(2)}, quartiles ${q[Math.floor(q.length / 4)].toFixed(2)}–${q[Math.floor((3 * q.length) / 4)].toFixed(2)}`);
  }
}
await guard.close();
rdb.disconnect();
await srv.close();
