// The JavaScript a pair costs the client alone: the protocol client's
// acquire then release, and guard.do of a call that does nothing, over a
// stub that answers every command at once (no socket, no Redis), so that
// what is left is this package's code, ioredis's Command (its promise and
// its timeout timer) and Node's (docs/benchmarks.md).
//
//   node clients/node/bench/js_cost.js [--pairs 200000] [--rounds 3]
//
// Run `make node-test` (or npx tsc in clients/node) first: it imports dist/.
// Prints µs per pair, wall and CPU, per round and variant.
import { parseArgs } from "node:util";
import { Guard, protocol as P } from "../dist/index.js";

const { values } = parseArgs({ options: { pairs: { type: "string", default: "200000" }, rounds: { type: "string", default: "3" } } });
const N = Number(values.pairs), rounds = Number(values.rounds);

const stub = {
  sendCommand(cmd) {
    let reply = 1; // release, register
    if (cmd.name === "info") reply = "maxmemory_policy:noeviction";
    else if (cmd.args[0] === P.SCRIPTS.acquire.sha) reply = [0, 1, 1_000_000, "Closed", Date.now()];
    cmd.resolve(reply);
    return cmd.promise;
  },
};
const proto = new P.Client(stub, "bench/stub");
const guard = new Guard(stub, "bench/stub", { registry: null, redisTimeout: 1000 });
let id = 0;
const variants = {
  "protocol acquire+release": async () => {
    const m = `b-${id++}`;
    await proto.acquire(m, 30_000, 0, undefined, 1000);
    await proto.release(m, "s", 1, 0, 1000);
  },
  "guard.do": async () => { await guard.do({}, async () => {}); },
};
for (let r = 0; r < rounds; r++) {
  for (const [name, fn] of Object.entries(variants)) {
    const t0 = performance.now();
    const u0 = process.cpuUsage();
    for (let i = 0; i < N; i++) await fn();
    const u = process.cpuUsage(u0);
    console.log(`round ${r + 1} | ${name} | ${(((performance.now() - t0) * 1000) / N).toFixed(2)} µs/pair wall | ${((u.user + u.system) / N).toFixed(2)} µs/pair CPU`);
  }
}
await guard.close();
