// Timeouts of the HTTP clients Node services use are classified as timeouts
// ("t"), each raised by the real library against a loopback server that
// never answers; refused and reset connections are failures ("f"), as in the
// Go and Python clients.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { get } from "node:http";
import { request as undiciRequest, Agent } from "undici";
import axios from "axios";
import got from "got";
import { defaultClassify } from "../dist/index.js";
import { freePort } from "./helpers.js";

let silent, reset, base, resetBase;
before(async () => {
  silent = createServer(() => { /* never answers */ });
  reset = createServer((req) => req.socket.destroy());
  await new Promise((r) => silent.listen(0, "127.0.0.1", r));
  await new Promise((r) => reset.listen(0, "127.0.0.1", r));
  base = `http://127.0.0.1:${silent.address().port}`;
  resetBase = `http://127.0.0.1:${reset.address().port}`;
});
after(() => {
  for (const s of [silent, reset]) { s.closeAllConnections(); s.close(); }
});

async function thrown(p) {
  try {
    await p;
  } catch (e) {
    return e;
  }
  assert.fail("no error");
}

test("fetch with AbortSignal.timeout: TimeoutError", async () => {
  const e = await thrown(fetch(base, { signal: AbortSignal.timeout(50) }));
  assert.equal(e.name, "TimeoutError");
  assert.equal(defaultClassify(e), "t");
});

test("undici: UND_ERR_HEADERS_TIMEOUT and UND_ERR_BODY_TIMEOUT, and fetch's TypeError wrapping them", async () => {
  const agent = new Agent({ headersTimeout: 50, bodyTimeout: 50 });
  const e = await thrown(undiciRequest(base, { dispatcher: agent }));
  assert.equal(e.code, "UND_ERR_HEADERS_TIMEOUT");
  assert.equal(defaultClassify(e), "t");
  const { fetch: undiciFetch } = await import("undici");
  const f = await thrown(undiciFetch(base, { dispatcher: agent }));
  assert.equal(f.name, "TypeError");
  assert.equal(f.cause.code, "UND_ERR_HEADERS_TIMEOUT");
  assert.equal(defaultClassify(f), "t");
  const body = createServer((req, res) => { res.writeHead(200); res.write("partial"); });
  await new Promise((r) => body.listen(0, "127.0.0.1", r));
  const res = await undiciRequest(`http://127.0.0.1:${body.address().port}`, { dispatcher: agent });
  const b = await thrown(res.body.text());
  assert.equal(b.code, "UND_ERR_BODY_TIMEOUT");
  assert.equal(defaultClassify(b), "t");
  body.closeAllConnections();
  body.close();
  await agent.close();
});

test("axios: ECONNABORTED, and ETIMEDOUT with clarifyTimeoutError", async () => {
  const e = await thrown(axios.get(base, { timeout: 50 }));
  assert.equal(e.code, "ECONNABORTED");
  assert.equal(defaultClassify(e), "t");
  const c = await thrown(axios.get(base, { timeout: 50, transitional: { clarifyTimeoutError: true } }));
  assert.equal(c.code, "ETIMEDOUT");
  assert.equal(defaultClassify(c), "t");
});

test("got: TimeoutError (ETIMEDOUT)", async () => {
  const e = await thrown(got(base, { timeout: { request: 50 }, retry: { limit: 0 } }));
  assert.equal(e.name, "TimeoutError");
  assert.equal(e.code, "ETIMEDOUT");
  assert.equal(defaultClassify(e), "t");
});

test("sockets: a refused or reset connection is a failure, not a timeout", async () => {
  const closed = `http://127.0.0.1:${await freePort()}`;
  const refused = await thrown(new Promise((resolve, reject) => get(closed, resolve).on("error", reject)));
  assert.equal(refused.code, "ECONNREFUSED");
  assert.equal(defaultClassify(refused), "f");
  const r = await thrown(new Promise((resolve, reject) => get(resetBase, resolve).on("error", reject)));
  assert.equal(r.code, "ECONNRESET");
  assert.equal(defaultClassify(r), "f");
  const viaFetch = await thrown(fetch(closed));
  assert.equal(defaultClassify(viaFetch), "f");
  const viaAxios = await thrown(axios.get(closed));
  assert.equal(viaAxios.code, "ECONNREFUSED");
  assert.equal(defaultClassify(viaAxios), "f");
});

test("a socket's own ETIMEDOUT (and an error raised from one, as its cause) is a timeout", () => {
  const sock = Object.assign(new Error("connect ETIMEDOUT 10.0.0.1:443"), { code: "ETIMEDOUT", syscall: "connect" });
  assert.equal(defaultClassify(sock), "t");
  assert.equal(defaultClassify(new Error("vehicle API", { cause: sock })), "t");
  assert.equal(defaultClassify(new AggregateError([new Error("x"), sock])), "t");
  assert.equal(defaultClassify(new Error("plain")), "f");
  assert.equal(defaultClassify("not an error"), "f");
});
