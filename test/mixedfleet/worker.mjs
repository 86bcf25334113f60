// A Node.js worker of the mixed fleet (node_test.go): SPILLWAY_MIXED_THREADS
// loops call the dependency at SPILLWAY_MIXED_URL through one Guard of the
// Node client (clients/node, built by make node-test), act on the guard's
// decisions like a job framework would (with the delays capped so the test
// stays short), and print their counts as a JSON line every 200 ms and once
// more when stdin closes.
import { Agent, get } from "node:http";
import { createRequire } from "node:module";
import { setTimeout as sleep } from "node:timers/promises";

const client = new URL("../../clients/node/", import.meta.url);
const { Redis } = createRequire(new URL("package.json", client))("ioredis");
const { Guard, decide, Throttled, RateLimited, BreakerOpen, RedisUnavailable, NoPolicy } = await import(new URL("dist/index.js", client).href);

const url = process.env.SPILLWAY_MIXED_URL;
const [host, port] = process.env.SPILLWAY_MIXED_REDIS.split(/:(?=\d+$)/);
const redis = new Redis({ host, port: Number(port) });
redis.on("error", () => {});
const guard = new Guard(redis, process.env.SPILLWAY_MIXED_DEP, { registry: null });
const stats = { lang: "node", pid: process.pid, ok: 0, failed: 0, retry: 0, park: 0, drop: 0, refused: {} };
let stopping = false;

const reasons = [[Throttled, "slots"], [RateLimited, "rate"], [BreakerOpen, "open"], [RedisUnavailable, "redis_unavailable"], [NoPolicy, "no_policy"]];
const reasonOf = (e) => reasons.find(([cls]) => e instanceof cls)?.[1] ?? e.constructor.name;

// node:http with a keep-alive agent: lighter per call than fetch, as the
// Go and Python workers keep their connections too.
const agent = new Agent({ keepAlive: true });
const headers = { "X-Lang": "node", "X-PID": String(process.pid) };

function request(signal) {
  return new Promise((resolve, reject) => {
    get(url, { agent, headers, signal }, (res) => {
      res.resume();
      res.on("end", () => resolve(res.statusCode)).on("error", reject);
    }).on("error", reject);
  });
}

async function call(signal) {
  let status;
  try {
    status = await request(signal);
  } catch (e) {
    stats.failed++; // the guard reports it as a failure too
    throw e;
  }
  if (status !== 200) {
    stats.failed++;
    throw new Error(`dependency answered ${status}`);
  }
  stats.ok++;
}

async function work() {
  let attempt = 1;
  while (!stopping) {
    try {
      await guard.do({ attempt }, call);
      attempt = 1;
      continue;
    } catch (e) {
      const { action, after } = decide(e);
      if (action === "defer") {
        stats.refused[reasonOf(e)] = (stats.refused[reasonOf(e)] ?? 0) + 1;
        await sleep(Math.min(after, 50));
      } else if (action === "retry") {
        stats.retry++;
        attempt++;
        await sleep(Math.min(after, 50));
      } else if (action === "park") {
        stats.park++;
        attempt = 1;
        await sleep(Math.min(after, 100));
      } else if (action === "drop") {
        stats.drop++;
      }
    }
  }
}

const report = () => process.stdout.write("mixed-stats: " + JSON.stringify(stats) + "\n");
const loops = Array.from({ length: Number(process.env.SPILLWAY_MIXED_THREADS ?? "8") }, work);
const ticker = setInterval(report, 200);
process.stdin.resume();
process.stdin.on("end", async () => {
  stopping = true;
  clearInterval(ticker);
  await Promise.all(loops);
  await guard.close();
  redis.disconnect();
  agent.destroy();
  report();
});
