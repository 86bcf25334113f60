// Test helpers: real redis-server processes on free 127.0.0.1 ports, started
// by the tests (never a system service), a Redis Cluster and a Sentinel set
// formed as internal/redistest forms them, and publishing a dependency's
// state as the controller does (publish.lua, the fields of
// docs/protocol.md §2).

import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { Redis } from "ioredis";
import { protocol as P } from "../dist/index.js";

export function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function binary(name) {
  try {
    return execFileSync("sh", ["-c", `command -v ${name}`]).toString().trim();
  } catch {
    throw new Error(`${name} not found: run hack/setup-redis.sh (make redis)`);
  }
}

/** One redis-server process on 127.0.0.1, with no persistence. */
export class RedisServer {
  static async start(...args) {
    const s = new RedisServer(args);
    await s.start();
    return s;
  }

  constructor(args = [], password = undefined) {
    this.dir = mkdtempSync(join(tmpdir(), "spillway-node-redis-"));
    this.args = args;
    this.password = password;
    this.port = 0;
  }

  async start() {
    if (!this.port) this.port = await freePort();
    const extra = this.password ? ["--requirepass", this.password] : [];
    this.proc = spawn(binary("redis-server"), ["--port", String(this.port), "--bind", "127.0.0.1", "--save", "",
      "--appendonly", "no", "--dir", this.dir, "--logfile", join(this.dir, "redis.log"), ...this.args, ...extra], { stdio: "ignore" });
    this.exited = new Promise((r) => this.proc.once("exit", r));
    const deadline = Date.now() + 10_000;
    for (;;) {
      const c = new Redis({ port: this.port, host: "127.0.0.1", password: this.password, lazyConnect: true, retryStrategy: () => null, maxRetriesPerRequest: 0 });
      c.on("error", () => {});
      try {
        await c.connect();
        await c.ping();
        c.disconnect();
        return;
      } catch {
        c.disconnect();
        if (Date.now() > deadline || this.proc.exitCode !== null) throw new Error(`redis-server on port ${this.port} did not start`);
        await sleep(20);
      }
    }
  }

  client(opts = {}) {
    const c = new Redis({ host: "127.0.0.1", port: this.port, password: this.password, ...opts });
    c.on("error", () => {});
    return c;
  }

  pause() { this.proc.kill("SIGSTOP"); }
  resume() { this.proc.kill("SIGCONT"); }

  async stop() {
    if (this.proc && this.proc.exitCode === null && this.proc.signalCode === null) {
      this.proc.kill("SIGCONT");
      this.proc.kill("SIGTERM");
      await this.exited;
    }
  }

  async close() {
    await this.stop();
    rmSync(this.dir, { recursive: true, force: true });
  }
}

let deps = 0;
/** A dependency name no other test uses. */
export function dep() {
  return `nodetest/dep-${process.pid}-${deps++}`;
}

export function stateFields({ state = "Closed", limit = 4, rate = 0, openUntilMs = 0, backoffBaseMs = 100,
  backoffMaxMs = 1000, jitter = "Full", ratioPPM = 200000, minRetries = 10, budgetWindowS = 60,
  breakerWindowS = 30, halfOpenProbes = 3, staleAfterMs = 0, capacity = undefined } = {}) {
  const interval = rate ? Math.ceil(1_000_000 / rate) : 0;
  return {
    state, limit, capacity: capacity ?? limit, rate, rate_interval_us: interval, rate_burst: Math.max(1, Math.floor(rate / 10)),
    open_until_ms: openUntilMs, backoff_base_ms: backoffBaseMs, backoff_max_ms: backoffMaxMs, jitter,
    budget_ratio_ppm: ratioPPM, budget_min_retries: minRetries, budget_window_s: budgetWindowS,
    breaker_window_s: breakerWindowS, stats_retention_s: Math.max(breakerWindowS, budgetWindowS) + 60,
    half_open_probes: halfOpenProbes, stale_after_ms: staleAfterMs,
  };
}

/** Publish a state as the controller would; returns the reply. */
export async function publish(rdb, dependency, { epoch = 1, ...fields } = {}) {
  const res = await new P.Client(rdb, dependency).publish(epoch, stateFields(fields));
  if (res[0] !== 1) throw new Error(`publish refused: ${res}`);
  return res;
}

export async function redisNowMs(rdb) {
  const [s, us] = await rdb.time();
  return Number(s) * 1000 + Math.floor(Number(us) / 1000);
}

/** A Redis Cluster of n masters on 127.0.0.1, formed as internal/redistest/cluster.go forms one. */
export async function startCluster(n = 3) {
  const SLOTS = 16384;
  const nodes = [];
  const buses = [];
  for (let i = 0; i < n; i++) buses.push(await freePort());
  for (let i = 0; i < n; i++) {
    nodes.push(await RedisServer.start("--cluster-enabled", "yes", "--cluster-config-file", `nodes-${i}.conf`, "--cluster-port", String(buses[i])));
  }
  const admins = nodes.map((s) => s.client());
  const per = Math.floor(SLOTS / n);
  for (let i = 0; i < n; i++) {
    await admins[i].call("CLUSTER", "ADDSLOTSRANGE", i * per, i === n - 1 ? SLOTS - 1 : (i + 1) * per - 1);
  }
  for (const a of admins.slice(1)) await a.call("CLUSTER", "MEET", "127.0.0.1", nodes[0].port, buses[0]);
  const deadline = Date.now() + 30_000;
  for (;;) {
    const infos = await Promise.all(admins.map((a) => a.call("CLUSTER", "INFO")));
    const views = await Promise.all(admins.map((a) => a.call("CLUSTER", "NODES")));
    if (infos.every((i) => i.includes("cluster_state:ok")) && views.every((v) => v.trim().split("\n").length === n)) break;
    if (Date.now() > deadline) throw new Error("the cluster never agreed");
    await sleep(50);
  }
  for (const a of admins) a.disconnect();
  return {
    nodes,
    async close() { for (const s of nodes) await s.close(); },
  };
}

/** A master, a replica and three sentinels on 127.0.0.1, as internal/redistest/sentinel.go starts them. */
export async function startSentinel(masterName = "spillway") {
  const master = await RedisServer.start();
  const replica = await RedisServer.start("--replicaof", "127.0.0.1", String(master.port));
  const rc = replica.client();
  for (let deadline = Date.now() + 30_000; ;) {
    const info = await rc.info("replication");
    if (info.includes("master_link_status:up")) break;
    if (Date.now() > deadline) throw new Error("the replica never synced");
    await sleep(50);
  }
  rc.disconnect();
  const sentinels = [];
  for (let i = 0; i < 3; i++) {
    const dir = mkdtempSync(join(tmpdir(), "spillway-node-sentinel-"));
    const port = await freePort();
    const conf = join(dir, "sentinel.conf");
    writeFileSync(conf, [
      `port ${port}`, "bind 127.0.0.1", "protected-mode no", "daemonize no", `dir ${dir}`, `logfile ${join(dir, "sentinel.log")}`,
      `sentinel monitor ${masterName} 127.0.0.1 ${master.port} 2`,
      `sentinel down-after-milliseconds ${masterName} 1000`,
      `sentinel failover-timeout ${masterName} 5000`,
      `sentinel parallel-syncs ${masterName} 1`, "",
    ].join("\n"));
    const proc = spawn(binary("redis-server"), [conf, "--sentinel"], { stdio: "ignore" });
    const exited = new Promise((r) => proc.once("exit", r));
    sentinels.push({ port, dir, proc, exited });
  }
  for (const s of sentinels) {
    const c = new Redis({ port: s.port, host: "127.0.0.1", retryStrategy: () => 50 });
    c.on("error", () => {});
    for (let deadline = Date.now() + 30_000; ;) {
      try {
        const reply = await c.call("SENTINEL", "MASTER", masterName);
        const m = {};
        for (let i = 0; i < reply.length; i += 2) m[reply[i]] = reply[i + 1];
        if (Number(m["num-slaves"]) >= 1 && Number(m["num-other-sentinels"]) >= 2) break;
      } catch { /* starting */ }
      if (Date.now() > deadline) throw new Error("the sentinels never found each other");
      await sleep(100);
    }
    c.disconnect();
  }
  return {
    master, replica, masterName,
    sentinels: sentinels.map((s) => ({ host: "127.0.0.1", port: s.port })),
    async close() {
      for (const s of sentinels) {
        s.proc.kill("SIGTERM");
        await s.exited;
        rmSync(s.dir, { recursive: true, force: true });
      }
      await replica.close();
      await master.close();
    },
  };
}
