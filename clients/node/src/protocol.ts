// Spillway's Redis protocol for Node.js (docs/protocol.md): the keys of one
// dependency and typed calls for the scripts a worker runs (acquire, renew,
// hold, release, forget, budget, supersede; publish and window, the controller's,
// for the tests). The scripts are the files of pkg/protocol/lua, byte for
// byte (a copy in lua/ that test/lua_sync.test.js compares with the Go tree),
// composed as the Go client composes them: lib.lua followed by the script, so
// every client runs the same SHA1 on a server.
//
// Every script runs with EVALSHA, and EVAL's text on a NOSCRIPT error. Each
// round trip is an ioredis Command with its own timeout, so that the guard
// bounds each one separately, connecting included (a command queued while
// ioredis connects times out like one sent).

import { createHash, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command } from "ioredis";
import type { Cluster, Redis } from "ioredis";

/** The protocol version this client speaks (docs/protocol.md §1, §10). */
export const VERSION = 6;
/**
 * The state versions these scripts act on (docs/protocol.md §10): a worker
 * at N acts on N-2..N, what a manager one version older (5 writes 4), this
 * version's (6 writes 5) and one version newer (7 will write 6) publish.
 * Another is refused with {6, ...}: VersionError.
 */
export const MIN_STATE_VERSION = VERSION - 2, MAX_STATE_VERSION = VERSION;
/** Every key of a dependency starts with this prefix (docs/protocol.md §1): "v4" names the key space versions 4 to 6 share, not the version. */
export const KEY_PREFIX = "spillway:v4:";
/** How often a process registers its client and version (register.lua), ms. */
export const REGISTER_EVERY = 15_000;
/** This client's name in the registry of worker processes (register.lua). */
export const CLIENT_NAME = "node";
/**
 * How often a process that holds leases of its own calls hold (hold.lua),
 * ms: a fraction of LEARN_FOR, so that the leases Redis lost are back
 * before it admits anything new (Go's protocol.HoldEvery).
 */
export const HOLD_EVERY = 250;
/**
 * How soon a holder tries again after a hold that failed (holdRetryEvery in
 * Go): the learning second counts from the first script on the new server,
 * and a holder that waited a whole HOLD_EVERY after it could reach Redis
 * again may miss it.
 */
export const HOLD_RETRY_EVERY = 50;
/**
 * How long a dependency learns once Redis lost leases (lib.lua learning),
 * ms: nothing new is admitted while holders put back what they hold (Go's
 * protocol.LearnFor).
 */
export const LEARN_FOR = 1000;

/** The scripts this client runs, by file name in lua/ (lib.lua is prepended to all but noop). */
export const SCRIPT_NAMES = [
  "acquire", "renew", "hold", "release", "forget", "budget", "supersede",
  "publish", "window", "read", "noop", "register", "versions",
] as const;
export type ScriptName = (typeof SCRIPT_NAMES)[number];

export const CLOSED = "Closed", OPEN = "Open", HALF_OPEN = "HalfOpen", RAMPING = "Ramping";

/** Outcomes reported on release: success, failure, timeout, cancelled. */
export type Outcome = "s" | "f" | "t" | "c";
export const OUTCOMES: readonly Outcome[] = ["s", "f", "t", "c"];

// Acquire reply codes.
export const ADMITTED = 0, REFUSED_OPEN = 1, REFUSED_THROTTLED = 2, REFUSED_RATE = 3;
export const REFUSED_SUPERSEDED = 4, NO_POLICY = 5, OTHER_VERSION = 6, REFUSED_LATE = 7;

export const MAX_JOB_VERSION = 2 ** 53 - 1;

const LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;

/** lua/ of this package: the scripts, byte for byte those of pkg/protocol/lua. */
export const LUA_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "lua");

/** A reply the protocol does not allow, or an invalid argument. */
export class ProtocolError extends Error {
  override name = "ProtocolError";
}

/** No policy is published for the dependency (acquire {5}, budget {-5}). */
export class NoPolicyError extends Error {
  override name = "NoPolicyError";
}

/**
 * The state hash was published for a protocol version this client does not
 * act on (acquire {6, state version, manager version}, budget {-6, ...}):
 * `stateVersion` is the oldest worker version the publishing manager serves
 * (-1 when not a number), `managerVersion` that manager's own (-1 when
 * unknown), `clientVersion` this client's. The message names them and what
 * to upgrade (docs/operations.md, Upgrading).
 */
export class VersionError extends Error {
  override name = "VersionError";
  readonly clientVersion = VERSION;
  constructor(readonly dependency: string, readonly stateVersion: number = -1, readonly managerVersion: number = -1) {
    const manager = managerVersion > 0 ? `a manager at protocol version ${managerVersion}` : "a manager of an unknown protocol version";
    const what = stateVersion >= 0 && stateVersion < MIN_STATE_VERSION ? "upgrade the Spillway manager" : "upgrade this worker's Spillway client";
    super(`${dependency}: the state was published by ${manager} for workers at protocol version ${stateVersion} or later; ` +
      `this worker speaks version ${VERSION}, which acts on state versions ${MIN_STATE_VERSION} to ${MAX_STATE_VERSION}: ${what} (docs/operations.md, Upgrading)`);
  }
}

/** The round trip failed or timed out: it may have run in Redis, its reply was not read. */
export class RedisUnread extends Error {
  override name = "RedisUnread";
}

export interface Dependency {
  namespace: string;
  name: string;
}

export function parseDependency(s: string): Dependency {
  const i = s.indexOf("/");
  if (i < 0) throw new TypeError(`dependency "${s}" must be namespace/name`);
  const d = { namespace: s.slice(0, i), name: s.slice(i + 1) };
  if (!(d.namespace.length > 0 && d.namespace.length <= 63 && LABEL.test(d.namespace))) {
    throw new TypeError(`dependency namespace "${d.namespace}" must be a DNS label (lower-case alphanumerics and '-', at most 63)`);
  }
  if (!(d.name.length > 0 && d.name.length <= 253 && SUBDOMAIN.test(d.name))) {
    throw new TypeError(`dependency name "${d.name}" must be a DNS subdomain (lower-case alphanumerics, '-' and '.', at most 253)`);
  }
  return d;
}

/** The keys of one dependency (docs/protocol.md §1). */
export class Keys {
  readonly prefix: string;
  constructor(d: Dependency) {
    this.prefix = `${KEY_PREFIX}{${d.namespace}/${d.name}}:`;
  }
  get state() { return this.prefix + "state"; }
  get leases() { return this.prefix + "leases"; }
  get gcra() { return this.prefix + "gcra"; }
  get stats() { return this.prefix + "stats"; }
  get probes() { return this.prefix + "probes"; }
  get pools() { return this.prefix + "pools"; }
  get wants() { return this.prefix + "wants"; }
  get callers() { return this.prefix + "callers"; }
  /** The worker processes registered in the last 5 minutes (register.lua). */
  get clients() { return this.prefix + "clients"; }
  /** Calls by protocol version (5 on) per 10 s bucket (lib.lua count_version). */
  get calls() { return this.prefix + "calls"; }
  /** Leases released while the dependency learned (lib.lua remember_released). */
  get released() { return this.prefix + "released"; }
  get changes() { return this.prefix + "changes"; }
  job(key: string) { return this.prefix + "job:" + key; }
}

/** One protocol script: its text as it runs and its SHA1. */
export class Script {
  readonly text: Buffer;
  readonly sha: string;
  constructor(readonly name: ScriptName) {
    const body = readFileSync(join(LUA_DIR, name + ".lua"));
    this.text = name === "noop" ? body : Buffer.concat([readFileSync(join(LUA_DIR, "lib.lua")), body]);
    this.sha = createHash("sha1").update(this.text).digest("hex");
  }
}

export const SCRIPTS: Readonly<Record<ScriptName, Script>> = Object.freeze(
  Object.fromEntries(SCRIPT_NAMES.map((n) => [n, new Script(n)])) as Record<ScriptName, Script>,
);

/** 128 random bits in base 36, like protocol.NewLeaseID. */
export function newLeaseId(): string {
  const b = randomBytes(16);
  return b.readBigUInt64BE(0).toString(36) + "-" + b.readBigUInt64BE(8).toString(36);
}

// The process's lease ids: 128 random bits drawn once, then a counter, so
// that each id is unique (an id is never reused: a forgotten lease stays
// forgotten) without drawing randomness on every call.
const LEASE_PREFIX = newLeaseId() + "-";
let leaseSeq = 0;

/** A lease id unique to this call: the process's random prefix and a counter. */
export function nextLeaseId(): string {
  return LEASE_PREFIX + (leaseSeq++).toString(36);
}

export interface Admission {
  code: number;
  nowMs: number; // Redis time when the script ran
  epoch: number;
  limit: number;
  held: number;
  state: string;
  waitMs: number;
  newest: number;
  member: string;
}

/** hold's answer (Go's protocol.Held). */
export interface Held {
  /** The ms of learning left; 0 when the dependency is not learning. */
  learningMs: number;
  /**
   * Redis holds no state for the dependency (lost with its data, or never
   * published): nobody admits, and the leases were put back as while
   * learning.
   */
  noState: boolean;
  /** How many of the members were missing and were put back. */
  putBack: number;
  /**
   * Outside learning, with a state: the members the fleet no longer counts
   * (missing, or expired by Redis's clock). Their holder came back after the
   * learning second and another call may hold their slots: their calls
   * must stop, as after a renewal that found them lost.
   */
  lost: string[];
}

export interface BudgetDecision {
  allowed: boolean;
  backoffBaseMs: number;
  backoffMaxMs: number;
  jitter: string;
  calls: number;
  granted: number;
}

export type RedisLike = Redis | Cluster;

type Reply = unknown;

function int(v: Reply): number {
  if (typeof v === "number" && Number.isInteger(v)) return v;
  if (typeof v === "string" && /^-?\d+$/.test(v)) return Number(v);
  if (Buffer.isBuffer(v) && /^-?\d+$/.test(v.toString())) return Number(v.toString());
  throw new ProtocolError(`not an integer: ${JSON.stringify(v)}`);
}

function text(v: Reply): string {
  if (v === null || v === undefined) return "";
  if (typeof v === "string") return v;
  if (Buffer.isBuffer(v)) return v.toString();
  if (typeof v === "number") return String(v);
  throw new ProtocolError(`not a string: ${JSON.stringify(v)}`);
}

function list(v: Reply, what: string, min = 1): Reply[] {
  if (!Array.isArray(v) || v.length < min) throw new ProtocolError(`unexpected ${what} reply ${JSON.stringify(v)}`);
  return v;
}

function versionError(dependency: string, res: Reply[]): VersionError {
  return new VersionError(dependency, res.length > 1 ? int(res[1]) : -1, res.length > 2 ? int(res[2]) : -1);
}

/** Runs the protocol's scripts for one dependency over an ioredis client (standalone, Sentinel or Cluster). */
export class Client {
  readonly dependency: string;
  readonly keys: Keys;
  readonly callerId: string;
  private readonly acquireKeys: string[];
  private readonly releaseKeys: string[];
  private readonly renewKeys: string[];
  private readonly holdKeys: string[];

  /**
   * callerId names this client in acquisitions: refused for want of a slot,
   * it is a contender of its own in the batching pools' fair split
   * (docs/protocol.md §4 pool). Undefined draws a random one; "" makes the
   * client anonymous.
   */
  constructor(readonly rdb: RedisLike, dependency: string, callerId?: string) {
    if (!rdb) throw new TypeError("redis client must not be null");
    const d = parseDependency(dependency);
    this.dependency = `${d.namespace}/${d.name}`;
    this.keys = new Keys(d);
    const k = this.keys;
    this.acquireKeys = [k.state, k.leases, k.gcra, k.probes, k.wants, k.callers];
    // Every release passes the state and probes keys (a failure may trip the
    // breaker in the fleet's path) and the calls hash (this version's calls
    // are counted, lib.lua count_version).
    this.releaseKeys = [k.leases, k.stats, k.state, k.probes, k.calls, k.released];
    // renew puts back a lease Redis lost while the dependency learns, which
    // it reads in the state (lib.lua learning).
    this.renewKeys = [k.leases, k.state, k.released];
    this.holdKeys = [k.state, k.leases, k.released];
    this.callerId = callerId ?? newLeaseId();
  }

  /**
   * EVALSHA (EVAL's text on NOSCRIPT) in one round trip bounded by timeoutMs
   * (0: unbounded). Rejects with RedisUnread when the round trip failed or
   * timed out (it may have run), and with Redis's ReplyError for a script
   * error.
   */
  async run(script: Script, keys: readonly string[], args: readonly (string | number)[], timeoutMs = 0): Promise<Reply> {
    try {
      return await this.send("evalsha", [script.sha, keys.length, ...keys, ...args], timeoutMs);
    } catch (e) {
      if (e instanceof Error && e.message.startsWith("NOSCRIPT")) {
        // Nothing ran. Run the text; Redis caches it under its SHA.
        return await this.send("eval", [script.text, keys.length, ...keys, ...args], timeoutMs);
      }
      throw e;
    }
  }

  private send(name: string, args: (string | number | Buffer)[], timeoutMs: number): Promise<Reply> {
    const cmd = new Command(name, args, { replyEncoding: "utf8" });
    if (timeoutMs > 0) cmd.setTimeout(timeoutMs);
    // A command's own failure (a ReplyError: NOSCRIPT, a script error) is
    // Redis's answer; anything else (a timeout, a closed connection, a
    // rejected offline queue) means the reply was not read.
    return (this.rdb.sendCommand(cmd) as Promise<Reply>).catch((e: unknown) => {
      if (e instanceof Error && e.name === "ReplyError") throw e;
      throw new RedisUnread(e instanceof Error ? e.message : String(e), { cause: e });
    });
  }

  async acquire(leaseId: string, ttlMs: number, deadlineMs = 0, job?: { key: string; version: number; ttlMs: number }, timeoutMs = 0): Promise<Admission> {
    if (!leaseId) throw new TypeError("lease id must not be empty");
    if (!(ttlMs >= 1)) throw new RangeError(`lease ttl must be at least 1ms, got ${ttlMs}`);
    let keys = this.acquireKeys;
    const args: (string | number)[] = [leaseId, Math.floor(ttlMs), Math.floor(deadlineMs)];
    if (job && job.key) {
      if (!(Number.isInteger(job.version) && job.version >= 0 && job.version <= MAX_JOB_VERSION)) {
        throw new RangeError(`job version must be an integer in [0, 2^53), got ${job.version}`);
      }
      if (!(job.ttlMs >= 1)) throw new RangeError(`job ttl must be at least 1ms, got ${job.ttlMs}`);
      keys = [...keys, this.keys.job(job.key)];
      args.push(job.version, Math.floor(job.ttlMs));
    }
    if (this.callerId) {
      if (!(job && job.key)) args.push("", "");
      args.push(this.callerId);
    }
    const res = list(await this.run(SCRIPTS.acquire, keys, args, timeoutMs), "acquire");
    const code = int(res[0]);
    const adm: Admission = { code, nowMs: 0, epoch: 0, limit: 0, held: 0, state: "", waitMs: 0, newest: 0, member: "" };
    if (code === NO_POLICY) throw new NoPolicyError(`${this.dependency}: no policy published for this dependency`);
    if (code === OTHER_VERSION) throw versionError(this.dependency, res);
    adm.nowMs = int(res[res.length - 1]);
    switch (code) {
      case ADMITTED:
        list(res, "acquire", 5);
        adm.epoch = int(res[1]);
        adm.limit = int(res[2]);
        adm.state = text(res[3]);
        adm.member = leaseId;
        return adm;
      case REFUSED_OPEN:
      case REFUSED_RATE:
        list(res, "acquire", 3);
        adm.waitMs = int(res[1]);
        return adm;
      case REFUSED_THROTTLED:
        list(res, "acquire", 5);
        adm.waitMs = int(res[1]);
        adm.held = int(res[2]);
        adm.limit = int(res[3]);
        return adm;
      case REFUSED_SUPERSEDED:
        list(res, "acquire", 3);
        adm.newest = int(res[1]);
        return adm;
      case REFUSED_LATE:
        return adm;
    }
    throw new ProtocolError(`unexpected acquire reply ${JSON.stringify(res)}`);
  }

  async renew(member: string, ttlMs: number, timeoutMs = 0): Promise<boolean> {
    if (!(ttlMs >= 1)) throw new RangeError(`lease ttl must be at least 1ms, got ${ttlMs}`);
    return int(await this.run(SCRIPTS.renew, this.renewKeys, [member, Math.floor(ttlMs)], timeoutMs)) === 1;
  }

  /**
   * Put back the leases this process holds that Redis lost
   * (docs/protocol.md §4 "Learning"): members are the leases of its running
   * calls whose ttl has not passed by its own clock. Outside learning, with
   * a state, it writes nothing. A process that holds leases calls it every
   * HOLD_EVERY (the guard does); it also finds a failover out when nothing
   * is acquired.
   */
  async hold(members: readonly string[], ttlMs: number, timeoutMs = 0): Promise<Held> {
    if (!(ttlMs >= 1)) throw new RangeError(`lease ttl must be at least 1ms, got ${ttlMs}`);
    const res = list(await this.run(SCRIPTS.hold, this.holdKeys, [Math.floor(ttlMs), ...members], timeoutMs), "hold", 2);
    const left = int(res[0]);
    const lost = res.length > 2 ? list(res[2], "hold lost", 0).map((m) => text(m)) : [];
    return { learningMs: Math.max(left, 0), noState: left < 0, putBack: int(res[1]), lost };
  }

  /**
   * Free member ("" for none) and report the outcome in one round trip; epoch
   * only for a call admitted HalfOpen (a probe), 0 otherwise; tookMs, how
   * long the call took, goes into the window's success latency.
   */
  async release(member: string, outcome: Outcome, attempt: number, epoch = 0, timeoutMs = 0, tookMs?: number): Promise<boolean> {
    if (!OUTCOMES.includes(outcome)) throw new TypeError(`outcome must be s, f, t or c, got ${outcome}`);
    if (!(attempt >= 1)) throw new RangeError(`attempt must be at least 1, got ${attempt}`);
    const args: (string | number)[] = [member, outcome, Math.floor(attempt)];
    if (epoch || tookMs !== undefined) args.push(epoch);
    if (tookMs !== undefined) args.push(Math.max(0, Math.floor(tookMs * 1000)));
    return int(await this.run(SCRIPTS.release, this.releaseKeys, args, timeoutMs)) === 1;
  }

  async forget(member: string, timeoutMs = 0): Promise<void> {
    if (!member) throw new TypeError("lease member must not be empty");
    await this.run(SCRIPTS.forget, [this.keys.leases], [member], timeoutMs);
  }

  async budget(timeoutMs = 0): Promise<BudgetDecision> {
    const res = list(await this.run(SCRIPTS.budget, [this.keys.state, this.keys.stats], [], timeoutMs), "budget");
    const code = int(res[0]);
    if (code === -5) throw new NoPolicyError(`${this.dependency}: no policy published for this dependency`);
    if (code === -6) throw versionError(this.dependency, res);
    list(res, "budget", 6);
    return {
      allowed: code === 1, backoffBaseMs: int(res[1]), backoffMaxMs: int(res[2]),
      jitter: text(res[3]), calls: int(res[4]), granted: int(res[5]),
    };
  }

  async supersede(key: string, version: number, ttlMs: number, timeoutMs = 0): Promise<number> {
    if (!key) throw new TypeError("job key must not be empty");
    if (!(Number.isInteger(version) && version >= 0 && version <= MAX_JOB_VERSION)) {
      throw new RangeError(`job version must be an integer in [0, 2^53), got ${version}`);
    }
    if (!(ttlMs >= 1)) throw new RangeError(`job ttl must be at least 1ms, got ${ttlMs}`);
    return int(await this.run(SCRIPTS.supersede, [this.keys.job(key)], [version, Math.floor(ttlMs)], timeoutMs));
  }

  /**
   * Record that this process runs client (node) at this protocol version
   * (register.lua): at its first use of the dependency and every
   * REGISTER_EVERY after. Returns Redis's time in ms.
   */
  async register(client: string, processId: string, timeoutMs = 0): Promise<number> {
    if (!client || !processId || /\s/.test(client + processId)) {
      throw new TypeError(`client "${client}" and process id "${processId}" must be non-empty, without spaces`);
    }
    return int(await this.run(SCRIPTS.register, [this.keys.clients], [client, processId], timeoutMs));
  }

  /** The benchmark baseline: one EVALSHA that does nothing. */
  async noop(timeoutMs = 0): Promise<void> {
    await this.run(SCRIPTS.noop, [this.keys.leases], [], timeoutMs);
  }

  // -- controller scripts (used by tests and tools) ----------------------

  async publish(epoch: number, fields: Record<string, string | number>, seq = 0): Promise<number[]> {
    const args: (string | number)[] = [epoch, seq];
    for (const [k, v] of Object.entries(fields)) args.push(k, v);
    const res = list(await this.run(SCRIPTS.publish, [this.keys.state, this.keys.probes], args), "publish");
    return res.map(int);
  }

  async window(seconds: number, sinceS = 0): Promise<Record<string, number>> {
    const k = this.keys;
    const res = list(await this.run(SCRIPTS.window, [k.state, k.stats, k.probes, k.leases], [seconds, sinceS]), "window");
    const names = ["nowMs", "calls", "successes", "failures", "timeouts", "a1", "a2", "a3", "a4",
      "granted", "refused", "successMicros", "timedSuccesses", "probeSuccesses", "probeFailures", "probeTimeouts"];
    return Object.fromEntries(names.map((n, i) => [n, int(res[i])]));
  }

  /**
   * The maxmemory-policy of every master this client writes to (INFO
   * memory, which works where CONFIG is disabled): the first that is not
   * noeviction, else "noeviction". Rejects when Redis does not answer.
   */
  async evictionPolicy(timeoutMs = 0): Promise<string> {
    const rdb = this.rdb as RedisLike & { nodes?: (role: string) => Redis[] };
    const targets: { sendCommand(c: Command): unknown }[] = typeof rdb.nodes === "function" && (rdb as Cluster).isCluster ? rdb.nodes("master") : [rdb];
    for (const t of targets) {
      const cmd = new Command("info", ["memory"], { replyEncoding: "utf8" });
      if (timeoutMs > 0) cmd.setTimeout(timeoutMs);
      const info = String(await (t.sendCommand(cmd) as Promise<unknown>));
      const policy = /maxmemory_policy:(\S+)/.exec(info)?.[1] ?? "noeviction";
      if (policy !== "noeviction") return policy;
    }
    return "noeviction";
  }

  /** Leases that count now (ZCOUNT leases (now_ms +inf, Redis time). */
  async liveLeases(): Promise<number> {
    const [s, us] = (await this.rdb.time()) as unknown as [string, string];
    const nowMs = Number(s) * 1000 + Math.floor(Number(us) / 1000);
    return await this.rdb.zcount(this.keys.leases, `(${nowMs}`, "+inf");
  }
}
