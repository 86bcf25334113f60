// The README's "In a BullMQ worker" block, compiled with tsc as a module that
// imports the package by its name (as a user's code does) and run against a
// real redis-server, BullMQ Worker and Queue, and a loopback vehicle API: a
// job enqueued with the README's enqueue() is processed under the guard.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { Queue } from "bullmq";
import { protocol as P } from "../dist/index.js";
import { RedisServer, publish } from "./helpers.js";

const PKG = join(dirname(fileURLToPath(import.meta.url)), "..");
const README = join(PKG, "..", "..", "README.md");

function bullmqBlock() {
  const text = readFileSync(README, "utf8");
  const section = text.split(/^## In a BullMQ worker$/m)[1]?.split(/^## /m)[0];
  assert.ok(section, "README.md has no section \"In a BullMQ worker\"");
  const blocks = [...section.matchAll(/^```ts\n([\s\S]*?)^```$/gm)].map((m) => m[1]);
  assert.equal(blocks.length, 1, "the section has one ts block");
  return blocks[0];
}

test("the README's BullMQ example compiles against the published types and runs", { timeout: 170_000 }, async (t) => { // tsc takes 3 s here when quiet, over a minute when the machine is busy
  const dir = join(PKG, ".readme"); // inside the package, so that "@spillway/client" resolves to it by name
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "example.ts"), bullmqBlock());
  writeFileSync(join(dir, "tsconfig.json"), JSON.stringify({
    compilerOptions: { target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true, rootDir: ".", outDir: "out", types: ["node"], skipLibCheck: true },
    files: ["example.ts"],
  }));
  try {
    execFileSync(process.execPath, [join(PKG, "node_modules", "typescript", "bin", "tsc"), "-p", join(dir, "tsconfig.json")], { stdio: "pipe" });
  } catch (e) {
    assert.fail(`tsc failed on the README's block:\n${e.stdout}${e.stderr}`);
  }
  const example = await import(pathToFileURL(join(dir, "out", "example.js")).href);

  const srv = await RedisServer.start();
  const api = createServer((req, res) => {
    const vin = req.url.split("/").pop();
    res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ vin, make: "Volvo" }));
  });
  await new Promise((r) => api.listen(0, "127.0.0.1", r));
  t.after(async () => {
    api.closeAllConnections();
    api.close();
    await srv.close();
  });
  const admin = srv.client();
  await publish(admin, "fleet/vehicle-api", { limit: 5 });
  const connection = { host: "127.0.0.1", port: srv.port };
  const app = example.startEnrichment(connection, `http://127.0.0.1:${api.address().port}`);
  const queue = new Queue("enrich-vehicle", { connection });
  try {
    await example.enqueue(queue, "YV1AB");
    const [job] = await queue.getJobs(["waiting", "active", "delayed", "completed"]);
    for (let deadline = Date.now() + 20_000; (await job.getState()) !== "completed";) {
      assert.ok(Date.now() < deadline, `the job never completed: ${await job.getState()}`);
      await sleep(50);
    }
    const done = await queue.getJob(job.id);
    assert.deepEqual(done.returnvalue, { vin: "YV1AB", make: "Volvo" });
    assert.deepEqual(done.opts.backoff, { type: "spillway" });
    assert.equal(done.opts.attempts, 5);
    const w = await new P.Client(admin, "fleet/vehicle-api").window(30);
    assert.equal(w.successes, 1, "the call went through the guard");
  } finally {
    await app.close();
    await queue.close();
    admin.disconnect();
    rmSync(dir, { recursive: true, force: true });
  }
});
