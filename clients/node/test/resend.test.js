// A command Redis ran whose reply was lost, resent by ioredis, is counted once
// (docs/protocol.md §4a). ioredis resends the commands that were in flight
// when a connection closed (autoResendUnfulfilledCommands, on by default):
// the same EVALSHA, with the same lease id, on the new connection. A proxy
// on 127.0.0.1 forwards each command to a real redis-server and, for the
// first request carrying the armed script's SHA, closes the client's
// connection instead of passing the reply back, after Redis ran it.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer, connect } from "node:net";
import { Redis } from "ioredis";
import { Guard, protocol as P } from "../dist/index.js";
import { RedisServer, dep, publish } from "./helpers.js";

class LostReplyProxy {
  constructor(targetPort) {
    this.lost = 0;
    this.armed = null;
    this.server = createServer((client) => {
      const upstream = connect(targetPort, "127.0.0.1");
      let doomed = false;
      client.on("data", (req) => {
        if (this.armed && req.includes(this.armed)) {
          this.armed = null; // only the first run: the resend goes through
          doomed = true;
        }
        upstream.write(req);
      });
      upstream.on("data", (reply) => {
        if (doomed) {
          this.lost++; // Redis ran the command: drop its reply and the connection
          client.destroy();
          upstream.destroy();
          return;
        }
        client.write(reply);
      });
      const close = () => { client.destroy(); upstream.destroy(); };
      client.on("error", close).on("close", close);
      upstream.on("error", close).on("close", close);
    });
  }
  listen() { return new Promise((r) => this.server.listen(0, "127.0.0.1", () => r(this.server.address().port))); }
  arm(script) { this.armed = Buffer.from(P.SCRIPTS[script].sha); }
  close() { this.server.close(); }
}

let srv, rdb, proxy, port;
before(async () => {
  srv = await RedisServer.start();
  rdb = srv.client();
  proxy = new LostReplyProxy(srv.port);
  port = await proxy.listen();
});
after(async () => {
  proxy.close();
  rdb.disconnect();
  await srv.close();
});

function resendingClient() {
  // ioredis's defaults: autoResendUnfulfilledCommands and reconnection on.
  const c = new Redis({ host: "127.0.0.1", port, retryStrategy: () => 10 });
  c.on("error", () => {});
  return c;
}

test("an acquisition whose reply was lost is admitted on the resend: one slot, counted once", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 3 });
  const c = resendingClient();
  const g = new Guard(c, d, { registry: null, redisTimeout: 2000 });
  await g.do({}, () => "warm"); // the scripts are loaded: the next run is an EVALSHA
  proxy.arm("acquire");
  const lostBefore = proxy.lost;
  const got = await g.do({}, async () => {
    assert.equal(proxy.lost, lostBefore + 1, "the acquire reply was not lost");
    assert.equal(await g.proto.liveLeases(), 1, "the resent acquisition took a second slot");
    return "ran";
  });
  assert.equal(got, "ran");
  assert.equal(await g.proto.liveLeases(), 0);
  const w = await g.proto.window(30);
  assert.equal(w.calls, 2);
  assert.equal(g.forgotten, 0);
  await g.close();
  c.disconnect();
});

test("a release whose reply was lost counts its outcome once", async () => {
  const d = dep();
  await publish(rdb, d, { limit: 3 });
  const c = resendingClient();
  const g = new Guard(c, d, { registry: null, redisTimeout: 2000 });
  await g.do({}, () => "warm");
  proxy.arm("release");
  const lostBefore = proxy.lost;
  await assert.rejects(g.do({}, async () => { throw new Error("dependency failed"); }));
  assert.equal(proxy.lost, lostBefore + 1, "the release reply was not lost");
  const w = await g.proto.window(30);
  assert.equal(w.failures, 1, "the resent release counted the failure twice");
  assert.equal(w.successes, 1);
  assert.equal(await g.proto.liveLeases(), 0);
  await g.close();
  c.disconnect();
});
