// The Node client runs the Go tree's scripts byte for byte: lua/ is a copy of
// pkg/protocol/lua, and this test fails when the two differ. To refresh the
// copy: cp pkg/protocol/lua/*.lua clients/node/lua/
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { protocol as P, VERSION, MIN_STATE_VERSION, MAX_STATE_VERSION, KEY_PREFIX } from "../dist/index.js";

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

test("the protocol version is the scripts' version, declared as in the Go client", () => {
  // The scripts are the version: register.lua records it, lib.lua's
  // version_refusal accepts the state versions it names.
  assert.ok(readFileSync(join(GO_LUA, "register.lua"), "utf8").includes(`' ${VERSION} '`), `register.lua does not record version ${VERSION}`);
  const accepted = [];
  for (let v = MIN_STATE_VERSION; v <= MAX_STATE_VERSION; v++) accepted.push(`v == '${v}'`);
  assert.ok(readFileSync(join(GO_LUA, "lib.lua"), "utf8").includes(`if ${accepted.join(" or ")} then return nil end`),
    `lib.lua does not act on state versions ${MIN_STATE_VERSION} to ${MAX_STATE_VERSION}`);
  const go = readFileSync(join(GO_LUA, "..", "protocol.go"), "utf8");
  assert.ok(go.includes(`const Version = ${VERSION}\n`), "pkg/protocol's Version differs");
  // Go declares the bounds as a number or relative to Version ("Version - 2").
  const goConst = (name) => {
    const m = new RegExp(`\\b${name} = (?:(\\d+)|Version(?: ([-+]) (\\d+))?)\\n`).exec(go);
    assert.ok(m, `pkg/protocol declares no ${name}`);
    if (m[1] !== undefined) return Number(m[1]);
    return VERSION + (m[2] === "-" ? -Number(m[3]) : Number(m[3] ?? 0));
  };
  assert.equal(goConst("MinStateVersion"), MIN_STATE_VERSION, "pkg/protocol's MinStateVersion differs");
  assert.equal(goConst("MaxStateVersion"), MAX_STATE_VERSION, "pkg/protocol's MaxStateVersion differs");
  // The key space is shared with version 4 (docs/protocol.md §10).
  assert.equal(KEY_PREFIX, "spillway:v4:");
  assert.ok(go.includes(`const KeyPrefix = "${KEY_PREFIX}"`));
});
