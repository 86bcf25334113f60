// The guarded BullMQ processor with a real BullMQ Worker and Queue on
// redis-server, against a fake dependency that fails, recovers and counts the
// calls in flight across processes. Every job's calls (at the dependency) and
// runs of the processor (BullMQ's deliveries) are counted.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import { setTimeout as sleep } from "node:timers/promises";
import { Queue, QueueEvents, Worker, UnrecoverableError } from "bullmq";
import { Guard, checkResponse, protocol as P } from "../dist/index.js";
import { guardedProcessor, spillwayBackoff, RetryBudgetDenied } from "../dist/bullmq.js";
import { RedisServer, dep, publish, redisNowMs } from "./helpers.js";
import { startDependency } from "./fixtures/dependency.js";

const HERE = dirname(fileURLToPath(import.meta.url));
// Worker processes still running when this file's process exits (a test cut
// short by the runner's timeout) are killed with it.
const children = new Set();
process.on("exit", () => { for (const c of children) c.kill("SIGKILL"); });
let srv, rdb, fake;
before(async () => {
  srv = await RedisServer.start();
  rdb = srv.client();
  fake = await startDependency({ delayMs: 20 });
});
after(async () => {
  fake.close();
  rdb.disconnect();
  await srv.close();
});

let queues = 0;
/** A queue, a guarded worker on it, and the per-job count of the processor's runs. */
async function setup(d, { concurrency = 4, guardOptions = {}, body } = {}) {
  const name = `q${queues++}`;
  const connection = { host: "127.0.0.1", port: srv.port, maxRetriesPerRequest: null };
  const queue = new Queue(name, { connection });
  const events = new QueueEvents(name, { connection });
  await events.waitUntilReady();
  const guard = new Guard(rdb, d, { registry: null, redisTimeout: 2000, ...guardOptions }); // not about a slow Redis; a busy machine
  const runs = new Map();
  const call = body ?? (async (job, signal) => {
    const res = await fetch(`${fake.url}/call?job=${job.queueName}:${job.id}&attempt=${job.attemptsMade + 1}`, { method: "POST", signal });
    return await checkResponse(res).text();
  });
  const delays = new Map(); // job id -> the delays spillwayBackoff gave BullMQ, in order
  const worker = new Worker(name, guardedProcessor(guard, async (job, signal) => call(job, signal)), {
    connection, concurrency,
    settings: {
      backoffStrategy: (attemptsMade, type, err, job) => {
        const d = spillwayBackoff(attemptsMade, type, err, job);
        delays.set(job.id, [...(delays.get(job.id) ?? []), d]);
        return d;
      },
    },
  });
  const processed = new Map();
  worker.on("active", (job) => runs.set(job.id, (runs.get(job.id) ?? 0) + 1));
  worker.on("completed", (job, value) => processed.set(job.id, { state: "completed", value }));
  worker.on("failed", (job, err) => processed.set(job.id, { state: "failed", err }));
  await worker.waitUntilReady();
  return {
    queue, worker, guard, runs, processed, delays,
    calls: (id) => fake.byJob.get(`${name}:${id}`) ?? [],
    /** Wait until every job is completed or failed for good (the worker's "failed" event fires for retried attempts too). */
    async settled(ids, timeoutMs = 30_000) {
      const deadline = Date.now() + timeoutMs;
      for (const id of ids) {
        for (;;) {
          const state = await (await queue.getJob(id)).getState();
          if ((state === "completed" || state === "failed") && processed.get(id)?.state === state) break;
          assert.ok(Date.now() < deadline, `job ${id} never settled: ${state}`);
          await sleep(20);
        }
      }
    },
    async close() {
      await worker.close();
      await events.close();
      await queue.close();
      await guard.close();
    },
  };
}



test("attempts: 4 and a dependency that always fails: exactly 4 calls per job, each failure counted once", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 10, backoffBaseMs: 20, backoffMaxMs: 80, minRetries: 1000 });
  fake.failing = true;
  const s = await setup(d);
  try {
    const jobs = await Promise.all(Array.from({ length: 5 }, (_, i) => s.queue.add("j", { i }, { attempts: 4, backoff: { type: "spillway" } })));
    await s.settled(jobs.map((j) => j.id));
    for (const j of jobs) {
      assert.equal(s.processed.get(j.id).state, "failed");
      assert.deepEqual(s.calls(j.id).map((c) => c.attempt), [1, 2, 3, 4], `job ${j.id}`);
      const job = await s.queue.getJob(j.id);
      assert.equal(job.attemptsMade, 4);
      assert.match(job.failedReason, /HTTP 500/, "the last attempt's own error");
    }
    const w = await s.guard.proto.window(30);
    assert.equal(w.failures, 20, "every call counted once");
    assert.equal(w.granted, 15, "the budget asked once per retried failure, not for the final attempt");
  } finally {
    fake.failing = false;
    await s.close();
  }
});

test("refusals consume no attempt: 40 jobs with attempts: 1 through a limit of 2 all complete, one call each", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 2 });
  const s = await setup(d, { concurrency: 10, guardOptions: { throttleDelay: 50 } });
  try {
    const jobs = await s.queue.addBulk(Array.from({ length: 40 }, (_, i) => ({ name: "j", data: { i }, opts: { attempts: 1 } })));
    await s.settled(jobs.map((j) => j.id));
    let refusals = 0;
    for (const j of jobs) {
      assert.equal(s.processed.get(j.id).state, "completed", `job ${j.id}: ${s.processed.get(j.id).err}`);
      assert.equal(s.calls(j.id).length, 1);
      refusals += s.runs.get(j.id) - 1;
      assert.equal((await s.queue.getJob(j.id)).attemptsMade, 1);
    }
    assert.ok(refusals > 40, `only ${refusals} refusals: the test did not contend`);
    console.log(`# 40 jobs, limit 2, concurrency 10: ${refusals} refusals, none consumed an attempt`);
  } finally {
    await s.close();
  }
});

test("delays: an Open refusal waits for open_until; a retry follows the published backoff with full jitter", async () => {
  const d = dep();
  const now = await redisNowMs(rdb);
  await publish(rdb, d, { state: "Open", limit: 0, openUntilMs: now + 1000, backoffBaseMs: 300, backoffMaxMs: 600, minRetries: 100 });
  const s = await setup(d);
  try {
    const job = await s.queue.add("open", {}, { attempts: 3, backoff: { type: "spillway" } });
    await sleep(300);
    assert.equal(s.calls(job.id).length, 0);
    await publish(rdb, d, { epoch: 2, limit: 4, backoffBaseMs: 300, backoffMaxMs: 600, minRetries: 100 });
    await s.settled([job.id]);
    const first = s.calls(job.id)[0];
    assert.ok(first.at >= now + 1000 - 5, `ran ${first.at - now - 1000}ms before open_until`);
    assert.equal(first.attempt, 1, "the refusal consumed an attempt");

    fake.failing = true;
    const all = [];
    for (let i = 0; i < 6; i++) {
      const j = await s.queue.add("retry", {}, { attempts: 3, backoff: { type: "spillway" } });
      await s.settled([j.id]);
      const cs = s.calls(j.id);
      assert.equal(cs.length, 3);
      // The delays BullMQ was given: the published backoff with full jitter,
      // uniform below 300 ms after attempt 1 and 600 ms after attempt 2 ...
      const [d1, d2] = s.delays.get(j.id);
      assert.ok(d1 >= 0 && d1 <= 300, `after attempt 1: ${d1}ms`);
      assert.ok(d2 >= 0 && d2 <= 600, `after attempt 2: ${d2}ms`);
      // ... and BullMQ waited them out before the retry reached the dependency.
      assert.ok(cs[1].at - cs[0].at >= d1 - 5, `retry 1 came ${cs[1].at - cs[0].at}ms after, before its ${d1}ms`);
      assert.ok(cs[2].at - cs[1].at >= d2 - 5, `retry 2 came ${cs[2].at - cs[1].at}ms after, before its ${d2}ms`);
      all.push(d1, d2);
    }
    assert.ok(new Set(all).size > 6, `no jitter: ${all}`);
  } finally {
    fake.failing = false;
    await s.close();
  }
});

test("a denied budget fails the job at once, told apart from an ordinary failure", async () => {
  const d = dep();
  await publish(rdb, d, { minRetries: 0, ratioPPM: 0 });
  fake.failing = true;
  const s = await setup(d);
  try {
    const job = await s.queue.add("j", {}, { attempts: 5, backoff: { type: "spillway" } });
    await s.settled([job.id]);
    const { state, err } = s.processed.get(job.id);
    assert.equal(state, "failed");
    assert.ok(err instanceof RetryBudgetDenied, String(err));
    assert.ok(err.parked.after > 0);
    const stored = await s.queue.getJob(job.id);
    assert.match(stored.failedReason, /^park: retry budget exhausted/);
    assert.equal(stored.attemptsMade, 1);
    assert.equal(s.calls(job.id).length, 1);
    assert.equal(s.runs.get(job.id), 1);
  } finally {
    fake.failing = false;
    await s.close();
  }
});

test("BullMQ's own errors pass through uncounted", async () => {
  const d = dep();
  await publish(rdb, d);
  const s = await setup(d, { body: async () => { throw new UnrecoverableError("bad input"); } });
  try {
    const job = await s.queue.add("j", {}, { attempts: 3, backoff: { type: "spillway" } });
    await s.settled([job.id]);
    assert.equal(s.processed.get(job.id).state, "failed");
    assert.equal(s.processed.get(job.id).err.name, "UnrecoverableError");
    assert.equal(s.runs.get(job.id), 1);
    const w = await s.guard.proto.window(30);
    assert.equal(w.calls, 0);
    assert.equal(w.granted + w.refused, 0);
  } finally {
    await s.close();
  }
});

test("stale and superseded jobs complete unrun", async () => {
  const d = dep();
  await publish(rdb, d);
  const s = await setup(d);
  try {
    const stale = await s.queue.add("j", { spillway: { maxAge: 100 } }, { delay: 300 });
    await s.guard.supersede("vin-9", 2);
    const old = await s.queue.add("j", { spillway: { key: "vin-9", version: 1 } });
    const current = await s.queue.add("j", { spillway: { key: "vin-9", version: 2 } });
    await s.settled([stale.id, old.id, current.id]);
    assert.deepEqual(s.processed.get(stale.id).value, { dropped: "stale" });
    assert.deepEqual(s.processed.get(old.id).value, { dropped: "superseded" });
    assert.equal(s.processed.get(current.id).value, "ok");
    assert.equal(s.calls(stale.id).length + s.calls(old.id).length, 0);
  } finally {
    await s.close();
  }
});

test("the cap: 4 worker processes at concurrency 50 against a limit of 20: at most 20 calls in flight", { timeout: 90_000 }, async () => {
  const d = dep();
  await publish(rdb, d, { limit: 20 });
  const name = `cap${queues++}`;
  const connection = { host: "127.0.0.1", port: srv.port, maxRetriesPerRequest: null };
  const queue = new Queue(name, { connection });
  fake.reset();
  fake.delayMs = 200;
  const calls = (id) => fake.byJob.get(`${name}:${id}`) ?? [];
  const procs = [];
  try {
    for (let i = 0; i < 4; i++) {
      procs.push(spawn(process.execPath, [join(HERE, "fixtures", "bullmq_worker.js")], {
        env: { ...process.env, REDIS_PORT: String(srv.port), QUEUE: name, DEPENDENCY: d, DEP_URL: fake.url, CONCURRENCY: "50" },
        stdio: ["ignore", "pipe", "pipe"], // not the runner's stderr: a worker left behind must not hold it open
      }));
      procs.at(-1).stderr.on("data", (b) => process.stderr.write(b));
      children.add(procs.at(-1));
      procs.at(-1).once("exit", function () { children.delete(this); });
    }
    await Promise.all(procs.map((p) => new Promise((resolve, reject) => {
      createInterface({ input: p.stdout }).once("line", resolve);
      p.once("exit", (code) => reject(new Error(`worker exited ${code}`)));
    })));
    const started = performance.now();
    const jobs = await queue.addBulk(Array.from({ length: 120 }, (_, i) => ({ name: "j", data: { i }, opts: { attempts: 2, backoff: { type: "spillway" } } })));
    const deadline = Date.now() + 60_000;
    for (;;) {
      const counts = await queue.getJobCounts("completed", "failed");
      if (counts.completed + counts.failed === jobs.length) {
        assert.equal(counts.failed, 0);
        break;
      }
      assert.ok(Date.now() < deadline, `jobs never finished: ${JSON.stringify(await queue.getJobCounts())}`);
      await sleep(100);
    }
    console.log(`# 4 processes × concurrency 50, limit 20: at most ${fake.most} calls in flight at the dependency, ${fake.calls} calls for ${jobs.length} jobs in ${((performance.now() - started) / 1000).toFixed(1)}s`);
    assert.ok(fake.most <= 20, `${fake.most} calls in flight at once, over the limit of 20`);
    assert.ok(fake.most >= 15, `only ${fake.most} calls at once: the fleet never reached the cap`);
    for (const j of jobs) assert.equal(calls(j.id).length, 1, `job ${j.id}`);
  } finally {
    fake.delayMs = 20;
    for (const p of procs) p.kill("SIGTERM");
    await Promise.all(procs.map((p) => (p.exitCode !== null || p.signalCode !== null ? null : new Promise((r) => {
      const kill = setTimeout(() => p.kill("SIGKILL"), 10_000);
      p.once("exit", () => { clearTimeout(kill); r(); });
    }))));
    await queue.close();
  }
});
