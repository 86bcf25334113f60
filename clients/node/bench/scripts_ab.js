// Redis's CPU per acquire+release pair of this tree's scripts (lua/) beside
// those of another commit, on one redis-server, interleaved
// (docs/benchmarks.md): what a protocol change costs Redis, apart from any
// client.
//
//   node clients/node/bench/scripts_ab.js --from <commit> [--seconds 0.5] [--rounds 12] [--loops 1,8]
//
// Both run acquire then release as the Node client sends them (EVALSHA of
// lib.lua followed by the script, the same keys and arguments) against a
// state published by this tree's publish.lua; the other commit's scripts
// must act on its state version (one protocol version apart do). Each round
// runs `seconds` of each, in alternating order. It prints the median pairs/s
// and Redis CPU (INFO cpu, user + sys) per pair over the rounds.
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { protocol as P } from "../dist/index.js";
import { RedisServer, publish } from "../test/helpers.js";

const { values } = parseArgs({ options: { from: { type: "string" }, seconds: { type: "string", default: "0.5" }, rounds: { type: "string", default: "12" }, loops: { type: "string", default: "1,8" } } });
if (!values.from) throw new Error("--from <commit> is required");
const seconds = Number(values.seconds), rounds = Number(values.rounds);

const git = (path) => execFileSync("git", ["show", `${values.from}:clients/node/lua/${path}`], { cwd: P.LUA_DIR });
const text = {
  [values.from]: (name) => Buffer.concat([git("lib.lua"), git(name + ".lua")]),
  "this tree": (name) => Buffer.concat([readFileSync(join(P.LUA_DIR, "lib.lua")), readFileSync(join(P.LUA_DIR, name + ".lua"))]),
};

const srv = await RedisServer.start();
const rdb = srv.client();
const DEP = "bench/scripts";
await publish(rdb, DEP, { limit: 1_000_000 });
const k = new P.Keys(P.parseDependency(DEP));
const shas = {};
for (const [tree, of] of Object.entries(text)) {
  shas[tree] = {};
  for (const name of ["acquire", "release"]) {
    const t = of(name);
    await rdb.script("LOAD", t);
    shas[tree][name] = createHash("sha1").update(t).digest("hex");
  }
}

let id = 0;
const pair = (tree) => async () => {
  const m = `ab-${id++}`;
  const a = await rdb.evalsha(shas[tree].acquire, 6, k.state, k.leases, k.gcra, k.probes, k.wants, k.callers, m, 30000, 0, "", "", "bench");
  if (a[0] !== 0) throw new Error(`${tree}: acquire answered ${JSON.stringify(a)}`);
  await rdb.evalsha(shas[tree].release, 5, k.leases, k.stats, k.state, k.probes, k.calls, m, "s", 1, 0, 100);
};

async function redisCPU() {
  const info = await rdb.info("cpu");
  const f = (x) => Number(info.match(new RegExp(`${x}:([0-9.]+)`))[1]);
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
  return n;
}

const median = (a) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)];
const trees = Object.keys(text);
for (const loops of values.loops.split(",").map(Number)) {
  const got = Object.fromEntries(trees.map((t) => [t, { rate: [], cpu: [] }]));
  for (const t of trees) await run(pair(t), loops); // warm
  for (let r = 0; r < rounds; r++) {
    for (const t of r % 2 ? trees : [...trees].reverse()) {
      const c0 = await redisCPU();
      const n = await run(pair(t), loops);
      const c1 = await redisCPU();
      got[t].rate.push(n / seconds);
      got[t].cpu.push(((c1 - c0) / n) * 1e6);
    }
  }
  for (const t of trees) {
    console.log(`loops ${loops} | ${t} | ${median(got[t].rate).toFixed(0)} pairs/s | Redis CPU ${median(got[t].cpu).toFixed(1)} µs/pair`);
  }
}
rdb.disconnect();
await srv.close();
