// A guarded BullMQ processor: every run of a job takes a fleet-wide slot of
// one dependency around the processor's body, and the guard's answer
// decides what BullMQ does next.
//
//   const worker = new Worker("enrich", guardedProcessor(guard, async (job, signal) => ...), {
//     connection, settings: { backoffStrategy: spillwayBackoff },
//   });
//   await queue.add("vin", data, { attempts: 5, backoff: { type: "spillway" } });
//
// - A refusal (throttled, rate limited, Open, no policy, another protocol
//   version, Redis unavailable, cancelled, a lost lease) puts the job back
//   with job.moveToDelayed after the guard's delay and throws DelayedError:
//   the attempt is not consumed (attemptsMade is unchanged).
// - A failure is released as one outcome and asks the fleet's retry budget
//   once. Allowed, the processor throws CallFailed, and BullMQ retries the job
//   once through `attempts`, after the delay spillwayBackoff reads from it
//   (the fleet's full-jitter backoff, no sooner than a Retry-After). Denied,
//   it throws RetryBudgetDenied, an UnrecoverableError: the job fails with no
//   further retry, and its failedReason starts with "park: retry budget
//   exhausted". The last attempt (attemptsMade + 1 = attempts) is final: its
//   failure is counted, the budget is not asked, and the error is thrown as
//   it is.
// - BullMQ's own errors (UnrecoverableError, DelayedError, RateLimitError,
//   WaitingChildrenError, WaitingError) pass through uncounted.
// - A stale job (its timestamp plus maxAge is past) or a superseded one (a
//   newer version of its key exists) completes unrun, with {dropped: "stale"}
//   or {dropped: "superseded"} as its return value.

import {
  DelayedError, RateLimitError, UnrecoverableError, WaitingChildrenError,
  type Job as BullJob, type Processor,
} from "bullmq";
import * as bullmq from "bullmq";
import * as E from "./errors.js";
import type { Guard, Job } from "./guard.js";
import * as R from "./retry.js";

/** The backoff type of jobs whose retries follow the fleet's backoff: `backoff: { type: "spillway" }`. */
export const BACKOFF_TYPE = "spillway";

/** What a dropped job returns. */
export interface Dropped {
  dropped: "stale" | "superseded";
}

/** A job's key and version, for supersession (docs/protocol.md supersede). */
export interface JobVersion {
  key: string;
  version: number;
}

export interface GuardedProcessorOptions<D> {
  /**
   * How long after job.timestamp the job stops mattering, ms: a number, or a
   * function of the job (undefined: never stale). Default: job.data.spillway.maxAge.
   */
  maxAge?: number | ((job: BullJob<D>) => number | undefined);
  /** The job's key and version (undefined: not superseded). Default: job.data.spillway.{key, version}. */
  supersede?: (job: BullJob<D>) => JobVersion | undefined;
}

interface SpillwayData {
  spillway?: { maxAge?: unknown; key?: unknown; version?: unknown };
}

function dataOf(job: BullJob): SpillwayData["spillway"] {
  const d = job.data as SpillwayData | undefined;
  return d && typeof d === "object" && d.spillway && typeof d.spillway === "object" ? d.spillway : undefined;
}

function defaultMaxAge(job: BullJob): number | undefined {
  const v = dataOf(job)?.maxAge;
  return typeof v === "number" && v > 0 ? v : undefined;
}

function defaultSupersede(job: BullJob): JobVersion | undefined {
  const s = dataOf(job);
  return s && typeof s.key === "string" && s.key && typeof s.version === "number" ? { key: s.key, version: s.version } : undefined;
}

const WaitingError = (bullmq as unknown as { WaitingError?: new (...a: unknown[]) => Error }).WaitingError;
const BULL_ERRORS = new Set(["UnrecoverableError", "DelayedError", "RateLimitError", "WaitingChildrenError", "WaitingError"]);

/** BullMQ's control flow, not the dependency's answer. */
export function isBullMQError(err: unknown): boolean {
  return err instanceof UnrecoverableError || err instanceof DelayedError || err instanceof RateLimitError ||
    err instanceof WaitingChildrenError || (WaitingError !== undefined && err instanceof WaitingError) ||
    (err instanceof Error && BULL_ERRORS.has(err.name));
}

/**
 * The job failed and the fleet's retry budget is spent: BullMQ fails it with
 * no further retry (an UnrecoverableError). Its message starts with
 * "park: retry budget exhausted"; `parked` is the guard's BudgetExhausted,
 * whose `after` is how long to wait before enqueuing the work again.
 */
export class RetryBudgetDenied extends UnrecoverableError {
  constructor(readonly parked: E.BudgetExhausted) {
    super(parked.message);
    this.name = "RetryBudgetDenied";
  }
}

/**
 * BullMQ's backoff strategy for jobs with `backoff: { type: "spillway" }`:
 * the delay the guard decided (CallFailed.after: the fleet's published
 * backoff with full jitter, no sooner than a server's Retry-After); for an
 * error the guard did not decide on, full jitter over the fallback backoff.
 * Put it in the Worker's settings: `settings: { backoffStrategy: spillwayBackoff }`.
 */
export function spillwayBackoff(attemptsMade: number, _type?: string, err?: Error): number {
  if (err instanceof E.CallFailed) return Math.round(err.after);
  return Math.round(R.FALLBACK.delay(attemptsMade));
}

/**
 * A BullMQ processor that runs processor(job, signal) under guard: use it as
 * `new Worker(queue, guardedProcessor(guard, processor, options), { connection, settings: { backoffStrategy: spillwayBackoff } })`.
 * signal is aborted when BullMQ cancels the job, when the slot's lease is
 * lost and when the guard is closed.
 */
export function guardedProcessor<D = unknown, R = unknown, N extends string = string>(
  guard: Guard,
  processor: (job: BullJob<D, R, N>, signal: AbortSignal) => Promise<R>,
  options: GuardedProcessorOptions<D> = {},
): Processor<D, R | Dropped, N> {
  const maxAge = options.maxAge;
  const supersede = options.supersede ?? defaultSupersede;
  return async (job: BullJob<D, R | Dropped, N>, token?: string, signal?: AbortSignal): Promise<R | Dropped> => {
    const age = typeof maxAge === "function" ? maxAge(job as never) : maxAge ?? defaultMaxAge(job as never);
    const attempt = job.attemptsMade + 1;
    const g: Job = {
      attempt,
      final: attempt >= Math.max(job.opts.attempts ?? 1, 1),
      deadline: age !== undefined ? job.timestamp + age : undefined,
      signal,
    };
    const v = supersede(job as never);
    if (v) {
      g.key = v.key;
      g.version = v.version;
    }
    let own: unknown; // BullMQ's control flow thrown by the processor
    try {
      return await guard.do(g, async (s) => {
        try {
          return await processor(job as never, s);
        } catch (e) {
          if (!isBullMQError(e)) throw e;
          own = e;
          throw new E.Cancelled(0, { detail: "BullMQ's own error" }); // released as "c": uncounted
        }
      });
    } catch (err) {
      if (own !== undefined) throw own;
      if (!(err instanceof E.SpillwayError)) throw err; // a final attempt's own error, a Permanent's: BullMQ fails the job
      switch (err.action) {
        case "drop":
          return { dropped: err instanceof E.Superseded ? "superseded" : "stale" };
        case "defer":
          // No attempt consumed: back to delayed, attemptsMade unchanged.
          await job.moveToDelayed(Date.now() + Math.max(1, Math.round(err.after)), token);
          throw new DelayedError(err.message);
        case "retry":
          throw err; // BullMQ retries once through attempts; spillwayBackoff reads err.after
        case "park":
          throw new RetryBudgetDenied(err as E.BudgetExhausted);
      }
      throw err;
    }
  };
}
