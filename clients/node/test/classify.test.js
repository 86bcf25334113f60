// Timeouts of the HTTP clients Node services use are classified as timeouts
// ("t"), each raised by the real library against a loopback server that
// never answers; so are refused and reset connections (ECONNREFUSED,
// ECONNRESET: issue 33), raised by each library against a closed port and a
// server that resets the connection (an RST).
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
  reset = createServer((req) => req.socket.resetAndDestroy()); // an RST, not a FIN
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

/** The code of err or of the first error in its cause chain that has one. */
function codeOf(err) {
  for (let e = err, i = 0; e && i < 8; e = e.cause, i++) if (e.code) return e.code;
  return undefined;
}

test("sockets: a refused or reset connection is a timeout, from node:http, fetch, undici, axios and got", async () => {
  const closed = `http://127.0.0.1:${await freePort()}`;
  const { fetch: undiciFetch } = await import("undici");
  const clients = {
    "node:http": (url) => new Promise((resolve, reject) => get(url, resolve).on("error", reject)),
    fetch: (url) => fetch(url),
    undici: (url) => undiciFetch(url),
    axios: (url) => axios.get(url),
    got: (url) => got(url, { retry: { limit: 0 } }),
  };
  for (const [name, call] of Object.entries(clients)) {
    for (const [url, code] of [[closed, "ECONNREFUSED"], [resetBase, "ECONNRESET"]]) {
      const e = await thrown(call(url));
      assert.equal(codeOf(e), code, `${name}: ${e}`);
      assert.equal(defaultClassify(e), "t", `${name}: ${code} is a timeout`);
    }
  }
});

test("other errors, a server that answers 5xx among them, are failures", async () => {
  const failing = createServer((req, res) => { res.writeHead(503); res.end(); });
  await new Promise((r) => failing.listen(0, "127.0.0.1", r));
  const e = await thrown(axios.get(`http://127.0.0.1:${failing.address().port}`));
  assert.equal(e.response.status, 503);
  assert.equal(defaultClassify(e), "f");
  failing.close();
  for (const code of ["EPIPE", "ENOTFOUND", "EAI_AGAIN", "UND_ERR_SOCKET", "ERR_BAD_RESPONSE"]) {
    assert.equal(defaultClassify(Object.assign(new Error(code), { code })), "f", code);
  }
});

test("a socket's own ETIMEDOUT (and an error raised from one, as its cause) is a timeout", () => {
  const sock = Object.assign(new Error("connect ETIMEDOUT 10.0.0.1:443"), { code: "ETIMEDOUT", syscall: "connect" });
  assert.equal(defaultClassify(sock), "t");
  assert.equal(defaultClassify(new Error("vehicle API", { cause: sock })), "t");
  assert.equal(defaultClassify(new AggregateError([new Error("x"), sock])), "t");
  assert.equal(defaultClassify(new Error("plain")), "f");
  assert.equal(defaultClassify("not an error"), "f");
});
