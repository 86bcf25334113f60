// The worker side of Spillway for Node.js: every protection the fleet puts
// on calls to one dependency, enforced through Redis at each call, with the
// failure-mode rules of the Go guard (pkg/guard) and the Python client:
//
// - every acquisition carries a deadline in Redis time, from an estimate of
//   Redis's clock, past which Redis refuses it and writes nothing;
// - an acquisition (or a release) whose reply was not read is handed to a
//   background forgetter that makes its lease stop counting (no ghost leases);
// - a call cut short by its caller (its job's signal aborted, guard.close(),
//   a thrown Cancelled) or by a lost lease is released with the outcome "c":
//   it counts nothing against the dependency and is deferred, never retried
//   as a failure; the call learns of it through its AbortSignal;
// - a long call's lease is renewed every third of its TTL, and renewals stop
//   when the call ends, whatever it threw;
// - while calls run, the guard hands Redis the leases it holds every
//   HOLD_EVERY (hold.lua): after a failover or a restart that lost them,
//   Redis puts them back while it learns, before it admits anything new;
// - Redis unavailable (paused, gone, connecting) fails closed within
//   redisTimeout, unless failOpenLimit admits the call locally.
//
//   const guard = new Guard(redis, "mail/template-api");
//   try {
//     await guard.do({ attempt, deadline: enqueued + 300_000 }, async (signal) => fetch(url, { signal }));
//   } catch (err) {
//     const { action, after } = decide(err); // defer / retry / park: again after `after` ms; drop: ack
//   }

import { performance } from "node:perf_hooks";
import type { Registry } from "prom-client";
import type { Cluster, Redis } from "ioredis";
import { defaultClassify } from "./classify.js";
import * as E from "./errors.js";
import { Metrics, type ThrottleReason } from "./metrics.js";
import * as P from "./protocol.js";
import * as R from "./retry.js";

/** One run of a job. */
export interface Job {
  /** 1 for the first call, 2 for the first retry; deferred runs keep their attempt number. Default 1. */
  attempt?: number;
  /** Unix ms (or a Date) after which the job is dropped as stale; undefined: it never expires. */
  deadline?: number | Date;
  /** With key, the run is dropped if a newer version of key ran or was announced with guard.supersede. */
  key?: string;
  /** The job's version for key: an integer in [0, 2^53). */
  version?: number;
  /** No retry follows a failure of this run: the failure is counted, the budget is not asked, and the call's own error is thrown as is. */
  final?: boolean;
  /** The caller's cancellation: aborting it aborts the call's signal, and the call counts nothing. */
  signal?: AbortSignal;
}

export interface GuardOptions {
  /** How long a slot's lease lasts without renewal, ms (default 30 000); renewed every third of it. */
  leaseTtl?: number;
  /** The bound on each Redis round trip, connecting included, ms (default 250). */
  redisTimeout?: number;
  /** After this long a call's lease is no longer renewed and the call is aborted, ms (default 600 000); it counts as a timeout. */
  maxCallLifetime?: number;
  /** Wait for a slot (or a rate token) instead of refusing at once (default false); Open is never waited on. */
  waitForSlot?: boolean;
  /** With waitForSlot, the longest wait, ms (0: unbounded). */
  maxWait?: number;
  /** Calls admitted locally, at most this many at once, while Redis is unavailable (default 0: fail closed). */
  failOpenLimit?: number;
  /** How long a job key's newest version is kept in Redis, ms (default one day). */
  jobTtl?: number;
  /** The delay of a deferral without a hint (no policy, Redis unavailable, cancelled), ms, jittered upward (default 1 000). */
  deferDelay?: number;
  /** The longest delay of a throttled call, ms, jittered (default 200). */
  throttleDelay?: number;
  /** The outcome of a call's error: "f" failure, "t" timeout, "s" success, "c" counts nothing. Default: defaultClassify. */
  classify?: (err: unknown) => P.Outcome;
  /** Errors that are a job framework's control flow, not the dependency's answer: released as "c" and thrown as they are. */
  passThrough?: (err: unknown) => boolean;
  /** prom-client registry for the spillway_worker_* series; undefined: prom-client's default registry; null: no metrics. */
  registry?: Registry | null;
  /** Randomness in [0, 1) for the jitter (default Math.random). */
  random?: () => number;
  /** Wall clock in Unix ms, for job deadlines (default Date.now). */
  now?: () => number;
  /** This process's caller id in acquisitions (default: a random one). */
  callerId?: string;
  /** How long close() waits for running calls to end before it releases their slots itself, ms (default 5 000). */
  closeTimeout?: number;
  /**
   * Let the guard run on a Redis configured to evict keys (a
   * maxmemory-policy other than noeviction), which it refuses by default
   * (every do() throws EvictionPolicyError): under memory pressure such a
   * Redis may drop leases, the published state or a job's version. With
   * it, calls go on and the gauge spillway_worker_redis_evicting says 1;
   * alert on it. The policy is read once, with INFO memory on every master,
   * before the first call; a Redis that does not answer is not waited for.
   */
  allowEviction?: boolean;
}

// Redis clock estimate (pkg/guard/redisclock.go).
const OFFSET_PERIOD = 30_000;
const DEADLINE_SLACK = 2;
const BOOTSTRAP_SKEW = 1_000;

// Forgetter (pkg/guard/forget.go).
const FORGET_QUEUE = 8192;
const FORGET_BACKOFF_MIN = 20;
const FORGET_BACKOFF_MAX = 500;
const FORGET_TIMEOUT_MIN = 250;

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms).unref());

/** Names this process in the registry of worker processes (register.lua), whatever its guards. */
const PROCESS_ID = P.newLeaseId();

/**
 * Estimates Redis's time from the local monotonic clock (redisclock.go).
 * Each reply gives a sample: Redis's time when the script ran minus the local
 * time the request was sent; the script ran after the send, so every sample
 * is at least the true offset and the smallest recent one is the closest. A
 * deadline built from it is never earlier than the true one.
 */
export class RedisClock {
  private known = false;
  private cur = 0;
  private prev = 0;
  private hasPrev = false;
  private curStart = 0;
  constructor(private readonly wall: () => number = Date.now) {}

  observe(sent: number, redisNowMs: number): void {
    if (!redisNowMs) return;
    const s = redisNowMs - sent;
    if (!this.known) {
      this.known = true;
      this.cur = s;
      this.hasPrev = false;
      this.curStart = sent;
    } else if (sent - this.curStart >= OFFSET_PERIOD) {
      this.prev = this.cur;
      this.hasPrev = true;
      this.cur = s;
      this.curStart = sent;
    } else {
      this.cur = Math.min(this.cur, s);
    }
  }

  /** A reply that came in time was refused as late: Redis's clock moved. */
  reset(sent: number, redisNowMs: number): void {
    this.known = false;
    this.observe(sent, redisNowMs);
  }

  /** [deadline in Unix ms of Redis time, ms after sent it lies]. */
  deadline(sent: number, wait: number): [number, number] {
    if (!this.known) {
      const late = wait + BOOTSTRAP_SKEW;
      return [Math.floor(this.wall() + late), late];
    }
    const off = this.hasPrev ? Math.min(this.cur, this.prev) : this.cur;
    return [Math.floor(off + sent + wait + DEADLINE_SLACK), wait + DEADLINE_SLACK];
  }
}

/**
 * Makes unread leases stop counting, in one background loop per guard,
 * started by the first lease it is handed; retries with a capped backoff
 * while Redis does not answer and gives a lease up once it has expired by
 * itself. It never blocks a caller: when its queue is full the lease is
 * left to expire.
 */
class Forgetter {
  private queue: [string, number][] = [];
  private running: Promise<void> | null = null;
  private closed = false;
  private stopped = false;
  forgotten = 0;
  constructor(private readonly proto: P.Client, private readonly timeout: number, private readonly metrics: Metrics) {}

  add(member: string, expires: number): void {
    if (this.closed || this.queue.length >= FORGET_QUEUE) {
      this.metrics.unread("dropped");
      return;
    }
    this.queue.push([member, expires]);
    this.metrics.unread("queued");
    this.running ??= this.run().finally(() => { this.running = null; });
  }

  /** Stop taking leases; wait (bounded) for the ones queued to be forgotten. */
  async close(bound: number): Promise<void> {
    this.closed = true;
    if (this.running) await Promise.race([this.running, sleep(bound)]);
    this.stopped = true;
    for (const _ of this.queue) this.metrics.unread("dropped");
    this.queue.length = 0;
  }

  private async run(): Promise<void> {
    for (let item = this.queue.shift(); item; item = this.queue.shift()) {
      const [member, expires] = item;
      let pause = FORGET_BACKOFF_MIN;
      for (;;) {
        if (this.closed && this.stopped) {
          this.metrics.unread("dropped");
          break;
        }
        if (performance.now() >= expires) {
          this.metrics.unread("expired");
          break;
        }
        try {
          await this.proto.forget(member, Math.max(this.timeout, FORGET_TIMEOUT_MIN));
          this.metrics.unread("forgotten");
          this.forgotten++;
          break;
        } catch {
          this.metrics.redisErrors.inc(); // Redis away: try again, sooner than the lease expires
        }
        await sleep(pause);
        pause = Math.min(2 * pause, FORGET_BACKOFF_MAX);
      }
    }
  }
}

/**
 * One admitted call: its lease, its renewals and its signal. The signal's
 * AbortController is made when the call asks for it (most of a guarded
 * call's own cost in Node is the AbortSignal), aborted at once if the call
 * was already cut short. Renewals run from the guard's one renewal tick.
 */
class Permit {
  readonly member: string;
  readonly probeEpoch: number;
  lost = false;
  lifetimeExceeded = false;
  done = false;
  settled = false; // released, or handed to the forgetter
  renewing = false;
  /** When the next renewal is due (performance.now() ms). */
  nextRenewal: number;
  /** When the lease expires by the local clock, unless renewed (performance.now() ms). */
  expires: number;
  /** Why the call was cut short, once it was: a Cancelled or a LeaseLost. */
  abortReason: E.SpillwayError | undefined;
  private controller: AbortController | null = null;
  private readonly endOfLife: number;
  private readonly admitted = performance.now();
  private readonly onAbort: (() => void) | null = null;

  constructor(private readonly g: Guard, readonly job: Job, adm: P.Admission | null, sent: number, readonly local = false) {
    this.member = adm ? adm.member : "";
    this.probeEpoch = adm && adm.state === P.HALF_OPEN ? adm.epoch : 0;
    this.expires = sent + g.leaseTtl;
    this.endOfLife = sent + g.maxCallLifetime;
    this.nextRenewal = Math.min(sent + g.leaseTtl / 3, this.endOfLife);
    const outer = job.signal;
    if (outer) {
      const onAbort = () => this.abort(new E.Cancelled(0, { cause: outer.reason, detail: "the job's signal was aborted" }));
      if (outer.aborted) {
        onAbort(); // aborted while the acquisition was on its way: its event has fired already
      } else {
        this.onAbort = onAbort;
        outer.addEventListener("abort", onAbort, { once: true });
      }
    }
  }

  get attempt(): number {
    return Math.max(this.job.attempt ?? 1, 1);
  }

  get signal(): AbortSignal {
    if (!this.controller) {
      this.controller = new AbortController();
      if (this.abortReason) this.controller.abort(this.abortReason);
    }
    return this.controller.signal;
  }

  private abort(reason: E.SpillwayError): void {
    if (this.abortReason) return;
    this.abortReason = reason;
    this.controller?.abort(reason);
  }

  /** One renewal, when due (the guard's tick calls it). */
  async renew(now: number): Promise<void> {
    const g = this.g;
    if (this.done || this.lost || this.renewing || now < this.nextRenewal) return;
    if (now >= this.endOfLife) {
      this.lifetimeExceeded = true;
      this.markLost(new E.Cancelled(0, { detail: `the call ran past maxCallLifetime (${g.maxCallLifetime}ms)` }));
      return;
    }
    if (now >= this.expires) {
      this.lose();
      return;
    }
    this.renewing = true;
    const sent = performance.now();
    let held: boolean;
    try {
      held = await g.proto.renew(this.member, g.ttlMs, g.redisTimeout);
    } catch {
      g.metrics.redisErrors.inc();
      this.nextRenewal = performance.now(); // again at the next tick, sooner than the lease expires
      return;
    } finally {
      this.renewing = false;
    }
    if (this.done) return;
    if (!held) {
      this.lose();
      return;
    }
    this.expires = sent + g.leaseTtl;
    this.nextRenewal = Math.min(sent + g.leaseTtl / 3, this.endOfLife);
    g.renewals++;
  }

  /** @internal The lease is gone (a renewal or the guard's hold found it lost). */
  lose(): void {
    this.g.metrics.leaseLost.inc();
    this.markLost(new E.LeaseLost(this.g.jitterUp(this.g.deferDelay)));
  }

  /** The call runs on without a lease the fleet counts: tell it through its signal. */
  markLost(reason: E.SpillwayError): void {
    if (this.done) return;
    if (!this.lost) {
      this.lost = true;
      this.g.lostCount++;
    }
    this.abort(reason);
  }

  /** The call ended: stop renewing, untrack. Returns false when it had ended already. */
  finish(): boolean {
    if (this.done) return false;
    this.done = true;
    if (this.onAbort) this.job.signal?.removeEventListener("abort", this.onAbort);
    if (this.lost) this.g.lostCount--;
    this.g.untrack(this);
    return true;
  }

  /** One release round trip (or the local cap's). Never throws. */
  async release(outcome: P.Outcome): Promise<void> {
    const g = this.g;
    if (this.settled) return;
    this.settled = true;
    if (this.local) {
      g.localInUse--;
      g.metrics.call(outcome, this.attempt);
      return;
    }
    try {
      const now = performance.now();
      await g.proto.release(this.member, outcome, this.attempt, this.probeEpoch, g.redisTimeout,
        outcome === "s" && g.timeDue(now) ? now - this.admitted : undefined);
    } catch {
      // It may not have run: the lease lasts at most a TTL from now.
      g.forgetLater(this.member, performance.now() + g.leaseTtl);
      g.metrics.redisErrors.inc();
    }
    g.metrics.call(outcome, this.attempt);
  }
}

/**
 * Enforces one dependency's fleet-wide limits. Create one per dependency and
 * process, share it between the process's calls, and close() it on shutdown.
 */
/** Spaces the successes whose release reports the call's duration (ms). */
const TIME_EVERY = 10;

export class Guard {
  readonly proto: P.Client;
  readonly dependency: string;
  readonly leaseTtl: number;
  readonly ttlMs: number;
  readonly redisTimeout: number;
  readonly maxCallLifetime: number;
  readonly waitForSlot: boolean;
  readonly maxWait: number;
  readonly failOpenLimit: number;
  readonly jobTtl: number;
  readonly deferDelay: number;
  readonly throttleDelay: number;
  readonly closeTimeout: number;
  readonly classify: (err: unknown) => P.Outcome;
  readonly passThrough: (err: unknown) => boolean;
  readonly metrics: Metrics;
  readonly clock: RedisClock;
  readonly random: () => number;
  readonly now: () => number;
  /** The backoff of the last budget answer (the policy's), for parking when Redis cannot answer. */
  lastBackoff: R.Backoff = R.FALLBACK;
  /** Successful lease renewals, for tests. */
  renewals = 0;
  /** Leases Redis had lost that hold put back, for tests. */
  heldBack = 0;
  lostCount = 0;
  localInUse = 0;
  private readonly running = new Set<Permit>();
  private readonly forgetter: Forgetter;
  private renewTick: NodeJS.Timeout | null = null;
  private holdTick: NodeJS.Timeout | null = null;
  private holding = false;
  /**
   * A connection of the guard's own for its holds (docs/protocol.md §4
   * "Learning") while the user's client is not ready: a duplicate of the
   * user's standalone or Sentinel client that reconnects every
   * HOLD_RETRY_EVERY, closed once the user's client is ready again. The
   * learning second counts from the first script on the new server, and the
   * user's client may come back late: ioredis's default retryStrategy waits
   * up to 2 s between reconnections. A Cluster's holds go on the user's
   * client.
   */
  private link: P.Client | null = null;
  private linkRedis: Redis | null = null;
  private lastRunning = 0;
  private readonly evictionChecked: Promise<void>;
  private evictionKnown = false;
  private evictionError: E.EvictionPolicyError | null = null;
  private registerAt = 0;
  private registering = false;
  private closed = false;

  constructor(redis: P.RedisLike, dependency: string, options: GuardOptions = {}) {
    if (!redis) throw new TypeError("redis client must not be null");
    const o = options;
    const ms = (name: string, v: number | undefined, def: number) => {
      const x = v ?? def;
      if (!(typeof x === "number" && x >= 0 && Number.isFinite(x))) throw new RangeError(`${name} must be a non-negative number of ms, got ${x}`);
      return x;
    };
    this.leaseTtl = ms("leaseTtl", o.leaseTtl, 30_000);
    if (this.leaseTtl < 10) throw new RangeError(`leaseTtl must be at least 10ms, got ${this.leaseTtl}`);
    this.ttlMs = Math.max(Math.floor(this.leaseTtl), 1);
    this.redisTimeout = ms("redisTimeout", o.redisTimeout, 250);
    if (this.redisTimeout <= 0) throw new RangeError(`redisTimeout must be positive, got ${this.redisTimeout}`);
    this.maxCallLifetime = ms("maxCallLifetime", o.maxCallLifetime, 600_000);
    this.waitForSlot = o.waitForSlot ?? false;
    this.maxWait = ms("maxWait", o.maxWait, 0);
    this.failOpenLimit = ms("failOpenLimit", o.failOpenLimit, 0);
    this.jobTtl = ms("jobTtl", o.jobTtl, 86_400_000);
    this.deferDelay = ms("deferDelay", o.deferDelay, 1_000);
    this.throttleDelay = ms("throttleDelay", o.throttleDelay, 200);
    this.closeTimeout = ms("closeTimeout", o.closeTimeout, 5_000);
    this.classify = o.classify ?? defaultClassify;
    this.passThrough = o.passThrough ?? (() => false);
    this.random = o.random ?? Math.random;
    this.now = o.now ?? Date.now;
    this.proto = new P.Client(redis, dependency, o.callerId);
    this.dependency = this.proto.dependency;
    this.metrics = new Metrics(this.dependency, o.registry);
    this.clock = new RedisClock(this.now);
    this.forgetter = new Forgetter(this.proto, this.redisTimeout, this.metrics);
    const allow = o.allowEviction ?? false;
    this.evictionChecked = this.proto.evictionPolicy(this.redisTimeout).then((policy) => {
      if (policy === "noeviction") return this.metrics.redisEvicting.set(0);
      if (!allow) {
        this.evictionError = new E.EvictionPolicyError(policy, this.dependency);
        return;
      }
      console.warn(`spillway: Redis evicts keys (maxmemory-policy ${policy}): the fleet's limits for ${this.dependency} no longer hold under memory pressure`);
      this.metrics.redisEvicting.set(1);
    }, () => { /* Redis did not answer: calls fail closed until it does; not checked again */ })
      .finally(() => { this.evictionKnown = true; });
  }

  /** Calls admitted (fail-open ones included) that have not ended. */
  get inFlight(): number {
    return this.running.size;
  }

  /** Leases handed to the forgetter that it made stop counting, for tests. */
  get forgotten(): number {
    return this.forgetter.forgotten;
  }

  /**
   * Run fn once under the fleet's protections and return its result, or
   * throw: a SpillwayError saying what to do with the job (see decide()), a
   * Permanent's wrapped error, a passThrough error as it is, or the call's
   * own error for a final job. fn gets an AbortSignal when it declares a
   * parameter (fn.length > 0), aborted when the job's signal is, when the
   * call's lease is lost, when it runs past maxCallLifetime and on close();
   * its reason is a Cancelled or a LeaseLost. A function that declares none
   * gets no signal (and costs the guard none).
   */
  async do<T>(job: Job | undefined, fn: (signal: AbortSignal) => Promise<T> | T): Promise<T> {
    if (typeof fn !== "function") throw new TypeError("fn must be a function");
    const j: Job = job ?? {};
    const permit = await this.admit(j);
    let result: T;
    try {
      result = await (fn.length > 0 ? fn(permit.signal) : (fn as () => Promise<T> | T)());
    } catch (err) {
      throw await this.failed(permit, err);
    }
    permit.finish();
    // Ended after the fleet stopped counting it: counted nowhere, its result still returned.
    await permit.release(permit.lost && !permit.lifetimeExceeded ? "c" : "s");
    return result;
  }

  /** Announce that version of the job key exists, so queued older versions are dropped unrun. */
  async supersede(key: string, version: number): Promise<void> {
    try {
      await this.proto.supersede(key, version, Math.floor(this.jobTtl), this.redisTimeout);
    } catch (e) {
      if (e instanceof TypeError || e instanceof RangeError) throw e;
      this.metrics.redisErrors.inc();
      throw new E.RedisUnavailable(0, { cause: e });
    }
  }

  /**
   * Stop: abort every running call (its signal's reason is a Cancelled),
   * wait up to closeTimeout for them to end and release their slots, release
   * the slots of those still running then (as cancelled), and forget the
   * leases whose replies were lost (bounded). Safe to call more than once.
   */
  async close(): Promise<void> {
    this.closed = true;
    const permits = [...this.running];
    for (const p of permits) {
      if (!p.local) p.markLost(new E.Cancelled(this.jitterUp(this.deferDelay), { detail: "the guard was closed" }));
    }
    const deadline = performance.now() + this.closeTimeout;
    while (this.running.size > 0 && performance.now() < deadline) await sleep(5);
    await Promise.all([...this.running].map((p) => p.release("c")));
    if (this.renewTick) clearInterval(this.renewTick);
    this.renewTick = null;
    this.stopHolding();
    await this.forgetter.close(Math.max(2 * this.redisTimeout, 250));
  }

  // -- internals ---------------------------------------------------------

  /** When, by performance.now(), the next success may report its duration. */
  private timedAt = 0;

  /**
   * @internal Whether a success ending at now reports its duration: at most
   * one every TIME_EVERY ms per guard. The window's mean success latency
   * (the controller's rate bound) needs a sample, not every call, and timing
   * costs Redis two counters a release; below 100 successes a second every
   * one is timed. As the Go and Python guards do.
   */
  timeDue(now: number): boolean {
    if (now < this.timedAt) return false;
    this.timedAt = now + TIME_EVERY;
    return true;
  }

  /** @internal */
  untrack(p: Permit): void {
    this.running.delete(p);
    this.metrics.inFlight.dec();
  }

  /**
   * Renew the running calls' leases that are due: one tick every sixth of
   * leaseTtl while calls run (instead of a timer per call), so a lease is
   * renewed between a third and a half of its TTL after its last renewal,
   * a failed renewal is tried again at the next tick, and a lease found
   * expired or gone, or a call past maxCallLifetime, is told within a
   * sixth of the TTL.
   */
  private renewDue(): void {
    const now = performance.now();
    if (this.running.size === 0) {
      // Idle: the tick stops, the next admitted call starts it again. Not
      // stopped by the call that ends (a guard calling one at a time would
      // make and clear a timer per call).
      if (now - this.lastRunning >= this.leaseTtl && this.renewTick) {
        clearInterval(this.renewTick);
        this.renewTick = null;
      }
      return;
    }
    this.lastRunning = now;
    for (const p of this.running) if (!p.local) void p.renew(now);
  }

  /**
   * Hand Redis the leases of the running calls (docs/protocol.md §4
   * "Learning"), every HOLD_EVERY while the guard holds one: those whose
   * ttl has not passed by the local clock, of calls not cut short. Redis
   * writes nothing unless it lost leases: after a failover to a replica
   * that missed their writes, or a restart without data, it puts back the
   * ones missing, and admits nothing new for LEARN_FOR meanwhile, so no
   * call is admitted into a slot a running call still holds. One hold at
   * a time, bounded by redisTimeout; a failure is tried again
   * HOLD_RETRY_EVERY later. The first tick that finds no lease held stops
   * the timer (not the call that ends: a guard calling one at a time would
   * make and clear a timer per call); the next admitted call starts it
   * again.
   */
  private holdDue(): void {
    if (this.holding) return;
    const now = performance.now();
    const held: Permit[] = [];
    for (const p of this.running) {
      if (!p.local && !p.done && !p.lost && now < p.expires) held.push(p);
    }
    if (held.length === 0) {
      this.stopHolding();
      return;
    }
    this.holding = true;
    let failed = false;
    this.holdClient().hold(held.map((p) => p.member), this.ttlMs, this.redisTimeout).then(
      (h) => {
        this.heldBack += h.putBack;
        // Back after the learning second: another call may hold these
        // slots. Stop the calls now, not at their next renewal.
        if (h.lost.length > 0) {
          const lost = new Set(h.lost);
          for (const p of held) if (lost.has(p.member) && !p.done && !p.lost) p.lose();
        }
      },
      () => { this.metrics.redisErrors.inc(); failed = true; },
    ).finally(() => {
      this.holding = false;
      // Again soon, not a whole HOLD_EVERY later, while a timer runs.
      if (failed && this.holdTick) setTimeout(() => { if (this.holdTick) this.holdDue(); }, P.HOLD_RETRY_EVERY).unref();
    });
  }

  /** The client for the next hold: the user's while it is ready, else the link. */
  private holdClient(): P.Client {
    const rdb = this.proto.rdb as P.RedisLike;
    if (this.closed || (rdb as Cluster).isCluster || typeof (rdb as Redis).duplicate !== "function") return this.proto;
    if ((rdb as Redis).status === "ready") {
      this.closeLink();
      return this.proto;
    }
    if (!this.link) {
      const r = (rdb as Redis).duplicate({
        retryStrategy: () => P.HOLD_RETRY_EVERY,
        enableOfflineQueue: false, // a hold while it connects fails, and is tried again
        lazyConnect: false,
      });
      r.on("error", () => { /* a failed hold counts in redisErrors */ });
      this.linkRedis = r;
      this.link = new P.Client(r, this.dependency, this.proto.callerId);
    }
    return this.link;
  }

  private closeLink(): void {
    this.linkRedis?.disconnect();
    this.link = this.linkRedis = null;
  }

  private stopHolding(): void {
    if (this.holdTick) clearInterval(this.holdTick);
    this.holdTick = null;
    this.closeLink();
  }

  /** @internal */
  forgetLater(member: string, expires: number): void {
    this.forgetter.add(member, expires);
  }

  /** @internal A delay never shorter than d, jittered upward by up to half of it. */
  jitterUp(d: number): number {
    return R.retryAfter(d, this.random);
  }

  private async admit(job: Job): Promise<Permit> {
    const attempt = job.attempt ?? 1;
    if (!(Number.isInteger(attempt) && attempt >= 0)) throw new RangeError(`job attempt must be a non-negative integer, got ${attempt}`);
    if (job.key && !(Number.isInteger(job.version ?? 0) && (job.version ?? 0) >= 0 && (job.version ?? 0) <= P.MAX_JOB_VERSION)) {
      throw new RangeError(`job version must be an integer in [0, 2^53), got ${job.version}`);
    }
    if (this.closed) throw new E.Cancelled(this.jitterUp(this.deferDelay), { detail: "the guard is closed" });
    if (!this.evictionKnown) await this.evictionChecked;
    if (this.evictionError) throw this.evictionError;
    if (job.signal?.aborted) throw new E.Cancelled(this.jitterUp(this.deferDelay), { cause: job.signal.reason, detail: "the job's signal was aborted" });
    const deadline = job.deadline instanceof Date ? job.deadline.getTime() : job.deadline;
    if (deadline !== undefined && this.now() >= deadline) {
      this.metrics.stale.inc();
      throw new E.Stale();
    }
    const start = performance.now();
    this.maybeRegister(start);
    const stopWaiting = this.maxWait > 0 ? start + this.maxWait : Infinity;
    let pause = 0;
    for (;;) {
      let refusal = this.overLeases();
      if (!refusal) {
        const got = await this.acquireOnce(job, start);
        if (got instanceof Permit) return got;
        refusal = got;
      }
      if (!this.waitForSlot || refusal.action !== "defer" || refusal instanceof E.BreakerOpen ||
          refusal instanceof E.RedisUnavailable || refusal instanceof E.NoPolicy) {
        throw this.count(refusal);
      }
      // Wait without hot polling: capped exponential steps with full
      // jitter, never past the hint the server gave.
      pause = Math.min(Math.max(2 * pause, 5), 250);
      let wait = this.random() * pause;
      if (refusal.after > 0 && refusal.after < wait) wait = refusal.after;
      if (performance.now() + wait >= stopWaiting) throw this.count(refusal);
      if (job.signal?.aborted) throw new E.Cancelled(this.jitterUp(this.deferDelay), { cause: job.signal.reason });
      await sleep(wait);
    }
  }

  /**
   * Register this process's client ("node") and protocol version
   * (docs/protocol.md §4 register) at its first acquisition and every
   * REGISTER_EVERY after, so that the manager and `spillway status` see
   * which versions the fleet speaks: in the background, one at a time,
   * never on a call's path; a failure is tried again a second later and
   * fails no call.
   */
  private maybeRegister(now: number): void {
    if (now < this.registerAt || this.registering) return;
    this.registering = true;
    this.proto.register(P.CLIENT_NAME, PROCESS_ID, this.redisTimeout).then(
      () => { this.registerAt = performance.now() + P.REGISTER_EVERY; },
      () => { this.registerAt = performance.now() + 1000; },
    ).finally(() => { this.registering = false; });
  }

  /**
   * Throttled while a call whose lease is lost still runs: the process then
   * runs more calls than the leases it holds, and a new lease would let the
   * fleet run one call more than its limit.
   */
  private overLeases(): E.SpillwayError | null {
    if (this.lostCount <= 0) return null;
    const d = this.throttleDelay;
    return new E.Throttled(d / 2 + (this.random() * d) / 2, {
      detail: `${this.lostCount} of this process's ${this.running.size} calls run on after their lease was lost`,
    });
  }

  /**
   * Ask Redis for a slot under a fresh lease id, with the Redis time after
   * which the reply would no longer be read: a Permit or the refusal. A reply
   * not read (a timeout, a broken connection) hands the lease to the
   * forgetter; a reply that came in time but was refused as late means
   * Redis's clock moved: the estimate restarts and the request is made once
   * more.
   */
  private async acquireOnce(job: Job, start: number): Promise<Permit | E.SpillwayError> {
    for (let retried = false; ; retried = true) {
      const lease = P.nextLeaseId(); // never reuse an id that may be forgotten
      const sent = performance.now();
      const [deadlineMs, late] = this.clock.deadline(sent, this.redisTimeout);
      let adm: P.Admission;
      try {
        adm = await this.proto.acquire(lease, this.ttlMs, deadlineMs,
          job.key ? { key: job.key, version: job.version ?? 0, ttlMs: Math.floor(this.jobTtl) } : undefined, this.redisTimeout);
      } catch (e) {
        if (e instanceof P.NoPolicyError) return new E.NoPolicy(this.jitterUp(this.deferDelay), { cause: e });
        if (e instanceof P.VersionError) {
          return new E.VersionMismatch(this.jitterUp(this.deferDelay), e.stateVersion, e.managerVersion, e.clientVersion, { cause: e });
        }
        if (e instanceof P.RedisUnread) {
          // If it ran, it ran by its deadline: its lease ends a TTL later.
          this.forgetLater(lease, sent + late + this.leaseTtl);
          return this.unavailable(job, e);
        }
        this.metrics.redisErrors.inc();
        if (e instanceof P.ProtocolError) return new E.BadReply(this.jitterUp(this.deferDelay), { cause: e });
        return new E.RedisUnavailable(this.jitterUp(this.deferDelay), { cause: e }); // a script error: Redis answered, nothing written
      }
      if (adm.code === P.REFUSED_LATE) {
        this.clock.reset(sent, adm.nowMs);
        if (!retried) continue;
        this.metrics.redisErrors.inc();
        return new E.RedisUnavailable(this.jitterUp(this.deferDelay), {
          detail: "redis refused the acquisition as late twice: its clock is not where the guard estimates it",
        });
      }
      this.clock.observe(sent, adm.nowMs);
      if (adm.code !== P.ADMITTED) return this.refusal(adm);
      if (this.closed) {
        // closed while the acquisition was on its way: give the slot back at once
        void this.proto.release(lease, "c", Math.max(job.attempt ?? 1, 1), 0, this.redisTimeout).catch(() => this.forgetLater(lease, performance.now() + this.leaseTtl));
        return new E.Cancelled(this.jitterUp(this.deferDelay), { detail: "the guard is closed" });
      }
      return this.track(new Permit(this, job, adm, sent), start);
    }
  }

  private track(p: Permit, start: number): Permit {
    this.running.add(p);
    if (!this.renewTick && !p.local) {
      this.lastRunning = performance.now();
      this.renewTick = setInterval(() => this.renewDue(), Math.max(this.leaseTtl / 6, 1));
      this.renewTick.unref();
    }
    if (!this.holdTick && !p.local) {
      this.holdTick = setInterval(() => this.holdDue(), P.HOLD_EVERY);
      this.holdTick.unref();
    }
    this.metrics.inFlight.inc();
    this.metrics.slotWait.observe((performance.now() - start) / 1000);
    return p;
  }

  private refusal(adm: P.Admission): E.SpillwayError {
    switch (adm.code) {
      case P.REFUSED_OPEN:
        // Past open_until the breaker waits for the controller: never hint 0.
        return new E.BreakerOpen(this.jitterUp(Math.max(adm.waitMs, this.throttleDelay)));
      case P.REFUSED_THROTTLED: {
        let d = this.throttleDelay;
        if (adm.waitMs > 0) d = Math.min(adm.waitMs, d); // the first lease expires sooner
        // A free slot refused with a wait: Redis lost leases and learns
        // (docs/protocol.md §4 "Learning"); waitMs is the learning left.
        const detail = adm.held < adm.limit && adm.waitMs > 0
          ? `redis lost leases and learns for ${adm.waitMs}ms more while their holders put them back (${adm.held} held, limit ${adm.limit})`
          : `${adm.held} held, limit ${adm.limit}`;
        return new E.Throttled(d / 2 + (this.random() * d) / 2, { detail });
      }
      case P.REFUSED_RATE:
        return new E.RateLimited(this.jitterUp(adm.waitMs));
      case P.REFUSED_SUPERSEDED:
        return new E.Superseded(0, { detail: `newest version ${adm.newest}` });
    }
    return new E.BadReply(this.jitterUp(this.deferDelay), { detail: `unknown admission code ${adm.code}` });
  }

  /** Count a refusal in the metrics and return it. */
  private count(e: E.SpillwayError): E.SpillwayError {
    if (e instanceof E.Superseded) {
      this.metrics.superseded.inc();
      return e;
    }
    const reasons: [new (...a: never[]) => E.SpillwayError, ThrottleReason][] = [
      [E.Throttled, "slots"], [E.RateLimited, "rate"], [E.BreakerOpen, "open"],
      [E.RedisUnavailable, "redis_unavailable"], [E.VersionMismatch, "version"], [E.NoPolicy, "no_policy"],
    ];
    for (const [cls, reason] of reasons) {
      if (e instanceof cls) {
        this.metrics.throttled(reason);
        break;
      }
    }
    return e;
  }

  /** Redis did not answer: fail closed, unless the local cap admits. */
  private unavailable(job: Job, err: unknown): Permit | E.SpillwayError {
    this.metrics.redisErrors.inc();
    if (this.localInUse < this.failOpenLimit && !this.closed) {
      this.localInUse++;
      this.metrics.failOpen.inc();
      return this.track(new Permit(this, job, null, performance.now(), true), performance.now());
    }
    return new E.RedisUnavailable(this.jitterUp(this.deferDelay), { cause: err });
  }

  /** The call threw err: release with its outcome, and return what do() throws. */
  private async failed(permit: Permit, err: unknown): Promise<unknown> {
    permit.finish();
    const reason: unknown = permit.abortReason;
    let outcome: P.Outcome;
    if (err instanceof E.Permanent) outcome = "s";
    else if (permit.lifetimeExceeded) outcome = "t";
    else if (permit.lost || err instanceof E.Cancelled || this.passThrough(err)) outcome = "c";
    else if (reason instanceof E.Cancelled) outcome = "c"; // the job's signal: the caller's own reason
    else {
      try {
        outcome = this.classify(err);
      } catch (e) {
        await permit.release("c"); // a classify that threw counts nothing
        return e;
      }
      if (!P.OUTCOMES.includes(outcome)) {
        await permit.release("c");
        return new TypeError(`classify returned the unknown outcome ${String(outcome)} (want s, f, t or c): the call counted nothing`, { cause: err });
      }
    }
    await permit.release(outcome);
    if (err instanceof E.Permanent) return err.error;
    if (outcome === "c" && this.passThrough(err)) return err;
    if (outcome === "c" || outcome === "s") {
      if (outcome === "s") return err; // a classify that calls it a success: the error is the job's own
      const lost = permit.lost && reason instanceof E.LeaseLost;
      if (err instanceof E.Cancelled && err.after > 0) return lost ? new E.LeaseLost(err.after, { cause: err }) : err;
      const after = this.jitterUp(this.deferDelay);
      return lost ? new E.LeaseLost(after, { cause: err }) : new E.Cancelled(after, { cause: err });
    }
    if (permit.job.final) return err; // no retry follows: the budget is not asked
    return await this.decideRetry(permit.job, err);
  }

  /** Ask the fleet's retry budget whether a failed job may retry, and when. */
  private async decideRetry(job: Job, err: unknown): Promise<E.SpillwayError> {
    let d: P.BudgetDecision;
    try {
      d = await this.proto.budget(this.redisTimeout);
    } catch (e) {
      if (e instanceof P.NoPolicyError || e instanceof P.VersionError) {
        // Redis answered: the policy is gone, or its state is of a version
        // this client does not act on. The job waits as a refusal does, and
        // says why; the call's own error comes with it.
        const detail = `the call failed: ${err instanceof Error ? err.message : String(err)}`;
        const after = this.jitterUp(this.deferDelay);
        return this.count(e instanceof P.VersionError
          ? new E.VersionMismatch(after, e.stateVersion, e.managerVersion, e.clientVersion, { cause: e, detail })
          : new E.NoPolicy(after, { cause: e, detail }));
      }
      // Without Redis the budget is unknown: park rather than pile on.
      this.metrics.redisErrors.inc();
      this.metrics.budgetRefusals.inc();
      return new E.BudgetExhausted(R.park(this.lastBackoff, this.random), {
        cause: err, detail: `the budget could not be read: ${e instanceof Error ? e.message : String(e)}`,
      });
    }
    let b = new R.Backoff(d.backoffBaseMs, d.backoffMaxMs, d.jitter || "Full");
    if (!b.valid()) b = R.FALLBACK;
    this.lastBackoff = b;
    if (!d.allowed) {
      this.metrics.budgetRefusals.inc();
      return new E.BudgetExhausted(R.park(b, this.random), { cause: err });
    }
    this.metrics.retries.inc();
    let after = b.delay(Math.max(job.attempt ?? 1, 1), this.random);
    const server = retryAfterOf(err);
    if (server !== undefined) after = Math.max(after, R.retryAfter(server, this.random));
    return new E.CallFailed(after, { cause: err });
  }
}

/** The server's delay of a RetryAfter in err's chain, ms. */
function retryAfterOf(err: unknown): number | undefined {
  for (let e = err, i = 0; e && i < 8; e = (e as { cause?: unknown }).cause, i++) {
    if (e instanceof E.RetryAfter) return e.after;
  }
  return undefined;
}
