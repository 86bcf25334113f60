// The Node client runs the Go tree's scripts byte for byte: lua/ is a copy of
// pkg/protocol/lua, and this test fails when the two differ. To refresh the
// copy: cp pkg/protocol/lua/*.lua clients/node/lua/
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { protocol as P, VERSION, KEY_PREFIX } from "../dist/index.js";

const GO_LUA = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "pkg", "protocol", "lua");
const HINT = "cp pkg/protocol/lua/*.lua clients/node/lua/";

test("the node copy matches pkg/protocol/lua", () => {
  const go = readdirSync(GO_LUA).filter((f) => f.endsWith(".lua")).sort();
  const node = readdirSync(P.LUA_DIR).filter((f) => f.endsWith(".lua")).sort();
  assert.deepEqual(node, go, `clients/node/lua and pkg/protocol/lua hold different files: ${HINT}`);
  for (const name of go) {
    assert.ok(readFileSync(join(GO_LUA, name)).equals(readFileSync(join(P.LUA_DIR, name))), `${name} differs from pkg/protocol/lua/${name}: ${HINT}`);
  }
});

test("every script file but lib.lua is in the script list, composed like the Go client", () => {
  const lib = readFileSync(join(GO_LUA, "lib.lua"));
  const files = readdirSync(GO_LUA).filter((f) => f.endsWith(".lua") && f !== "lib.lua" && f !== "pool.lua").map((f) => f.slice(0, -4)).sort();
  assert.deepEqual([...P.SCRIPT_NAMES].sort(), files, "a script of pkg/protocol/lua is missing from SCRIPT_NAMES (pool.lua is Go's batching alone)");
  for (const name of P.SCRIPT_NAMES) {
    const body = readFileSync(join(GO_LUA, name + ".lua"));
    const want = name === "noop" ? body : Buffer.concat([lib, body]);
    assert.ok(P.SCRIPTS[name].text.equals(want), name);
    assert.equal(P.SCRIPTS[name].sha, createHash("sha1").update(want).digest("hex"));
  }
});

test("the protocol version is the scripts' version and the key prefix's", () => {
  const acquire = readFileSync(join(GO_LUA, "acquire.lua"), "utf8");
  assert.ok(acquire.includes(`st[1] ~= '${VERSION}'`), `acquire.lua does not check version ${VERSION}`);
  assert.equal(KEY_PREFIX, `spillway:v${VERSION}:`);
});
