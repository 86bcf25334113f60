// The guard's Prometheus series through prom-client, with the names and
// labels of pkg/guard's (spillway_worker_*), so the dashboard and the alerts
// work unchanged; nothing when prom-client is not installed or the registry
// is null. Several guards (one per dependency) share the collectors of one
// registry.

import { createRequire } from "node:module";
import type { Outcome } from "./protocol.js";

const require = createRequire(import.meta.url);

// prom-client's module, when installed (an optional peer dependency).
type Prom = typeof import("prom-client");
let prom: Prom | null | undefined;
function loadProm(): Prom | null {
  if (prom === undefined) {
    try {
      prom = require("prom-client") as Prom;
    } catch {
      prom = null;
    }
  }
  return prom;
}

type Registry = import("prom-client").Registry;

const OUTCOME_NAMES: Record<Outcome, string> = { s: "success", f: "failure", t: "timeout", c: "cancelled" };
const ATTEMPTS = ["1", "2", "3", "4+"];
export type ThrottleReason = "slots" | "rate" | "open" | "redis_unavailable" | "no_policy" | "version";
export type UnreadResult = "queued" | "forgotten" | "expired" | "dropped";

interface Inc { inc(): void }
interface Obs { observe(v: number): void }
interface Gauge { inc(): void; dec(): void; set(v: number): void }
const NOP: Inc & Obs & Gauge = { inc() {}, observe() {}, dec() {}, set() {} };

/** The series of one dependency, or no-ops. */
export class Metrics {
  stale: Inc = NOP;
  superseded: Inc = NOP;
  budgetRefusals: Inc = NOP;
  retries: Inc = NOP;
  redisErrors: Inc = NOP;
  leaseLost: Inc = NOP;
  failOpen: Inc = NOP;
  slotWait: Obs = NOP;
  inFlight: Gauge = NOP;
  redisEvicting: Gauge = NOP;
  private calls = new Map<string, Inc>();
  private throttledBy = new Map<string, Inc>();
  private unreadBy = new Map<string, Inc>();

  /** registry: a prom-client Registry; undefined for prom-client's default registry; null for none. */
  constructor(dependency: string, registry?: Registry | null) {
    const p = loadProm();
    if (registry === null || p === null) return;
    const reg = registry ?? p.register;
    const counter = (name: string, help: string, ...labels: string[]) =>
      (reg.getSingleMetric(name) as import("prom-client").Counter<string> | undefined) ??
      new p.Counter({ name, help, labelNames: ["dependency", ...labels], registers: [reg] });
    const d = dependency;
    const calls = counter("spillway_worker_calls_total", "Calls made to the dependency, by outcome (success, failure, timeout, cancelled) and attempt number.", "outcome", "attempt");
    const throttled = counter("spillway_worker_throttled_total", "Calls not made because the fleet refused them, by reason (slots, rate, open, redis_unavailable, no_policy, version).", "reason");
    const unread = counter("spillway_worker_unread_leases_total", "Leases whose acquire or release reply was never read, by what became of them (queued for forgetting, forgotten, expired first, dropped).", "result");
    this.stale = counter("spillway_worker_stale_dropped_total", "Jobs dropped before any call because they were past their deadline.").labels(d);
    this.superseded = counter("spillway_worker_superseded_total", "Jobs dropped before any call because a newer version exists.").labels(d);
    this.budgetRefusals = counter("spillway_worker_budget_refusals_total", "Failed calls parked because the fleet's retry budget was spent.").labels(d);
    this.retries = counter("spillway_worker_retries_scheduled_total", "Failed calls the retry budget allowed to retry.").labels(d);
    this.redisErrors = counter("spillway_worker_redis_errors_total", "Redis round trips that failed or timed out.").labels(d);
    this.leaseLost = counter("spillway_worker_lease_lost_total", "Calls whose lease expired before it was renewed.").labels(d);
    this.failOpen = counter("spillway_worker_fail_open_calls_total", "Calls admitted by the local cap while Redis was unavailable.").labels(d);
    const wait = (reg.getSingleMetric("spillway_worker_slot_wait_seconds") as import("prom-client").Histogram<string> | undefined) ??
      new p.Histogram({
        name: "spillway_worker_slot_wait_seconds", help: "Time spent waiting for a fleet-wide slot before a call was admitted.",
        labelNames: ["dependency"], buckets: p.exponentialBuckets(0.001, 4, 10), registers: [reg],
      });
    this.slotWait = wait.labels(d);
    const inFlight = (reg.getSingleMetric("spillway_worker_in_flight") as import("prom-client").Gauge<string> | undefined) ??
      new p.Gauge({ name: "spillway_worker_in_flight", help: "Calls admitted and not yet finished, fail-open admissions included.", labelNames: ["dependency"], registers: [reg] });
    this.inFlight = inFlight.labels(d);
    const evicting = (reg.getSingleMetric("spillway_worker_redis_evicting") as import("prom-client").Gauge<string> | undefined) ??
      new p.Gauge({
        name: "spillway_worker_redis_evicting",
        help: "1 when the guard started (Options.AllowEviction) on a Redis whose maxmemory-policy evicts keys: leases and the published state may disappear, and the fleet's limits no longer hold.",
        labelNames: ["dependency"], registers: [reg],
      });
    this.redisEvicting = evicting.labels(d);
    for (const [o, name] of Object.entries(OUTCOME_NAMES)) {
      for (const a of ATTEMPTS) this.calls.set(o + a, calls.labels(d, name, a));
    }
    for (const r of ["slots", "rate", "open", "redis_unavailable", "no_policy", "version"]) this.throttledBy.set(r, throttled.labels(d, r));
    for (const r of ["queued", "forgotten", "expired", "dropped"]) this.unreadBy.set(r, unread.labels(d, r));
  }

  call(outcome: Outcome, attempt: number): void {
    this.calls.get(outcome + ATTEMPTS[Math.min(Math.max(attempt, 1), 4) - 1])?.inc();
  }

  throttled(reason: ThrottleReason): void {
    this.throttledBy.get(reason)?.inc();
  }

  unread(result: UnreadResult): void {
    this.unreadBy.get(result)?.inc();
  }
}
