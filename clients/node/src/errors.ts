// The guard's answers when a call was not made or failed: typed errors that
// mirror pkg/guard's, each carrying the action a job framework should take
// (defer, retry, park, drop) and the delay before the job runs again, and
// decide(), which reads them. Durations are milliseconds.

export type Action = "defer" | "retry" | "park" | "drop";

/**
 * A refusal or a failed call: what to do with the job, and when.
 *
 * action is "defer" (no attempt consumed: run the job again after `after`
 * ms with the same attempt number), "retry" (the call failed and the fleet's
 * retry budget allows attempt + 1 after `after`), "park" (the call failed and
 * the budget is spent, or Redis could not say: run it again only after the
 * long delay `after`) or "drop" (the job no longer matters: ack it without
 * running it). cause is the call's own error (retry, park) or the Redis error.
 */
export class SpillwayError extends Error {
  readonly action: Action = "defer";
  readonly reason: string = "refused";
  /** Milliseconds before the job should run again. */
  readonly after: number;
  readonly detail: string;

  constructor(after = 0, options: { cause?: unknown; detail?: string } = {}) {
    super(undefined, options.cause !== undefined ? { cause: options.cause } : undefined);
    this.after = Math.max(0, Number(after) || 0);
    this.detail = options.detail ?? "";
  }

  override get message(): string {
    let msg = `${this.action}: ${this.reason}`;
    if (this.after > 0) msg += ` (after ${Math.round(this.after)}ms)`;
    if (this.detail) msg += `: ${this.detail}`;
    if (this.cause !== undefined) msg += `: ${this.cause instanceof Error ? this.cause.message : String(this.cause)}`;
    return msg;
  }
  override set message(_: string) { /* computed */ }

  override get name(): string { return this.constructor.name; }
  override set name(_: string) { /* the class's */ }
}

/** Every fleet-wide slot is held. */
export class Throttled extends SpillwayError {
  override readonly reason = "throttled: every fleet-wide slot is held";
}
/** The fleet-wide rate is reached. */
export class RateLimited extends SpillwayError {
  override readonly reason = "rate limited: the fleet-wide rate is reached";
}
/** The breaker is Open: the dependency is failing. */
export class BreakerOpen extends SpillwayError {
  override readonly reason = "breaker open: the dependency is failing";
}
/** Redis did not answer within redisTimeout (or could not be reached): fail closed. */
export class RedisUnavailable extends SpillwayError {
  override readonly reason: string = "redis unavailable";
}
/** Redis answered outside the protocol: fail closed, like Redis unavailable. */
export class BadReply extends RedisUnavailable {
  override readonly reason = "redis unavailable: a reply outside the protocol";
}
/** No policy is published for the dependency. */
export class NoPolicy extends SpillwayError {
  override readonly reason: string = "no policy published for this dependency";
}
/**
 * The dependency's state was published for a protocol version this client
 * does not act on (outside the version skew of docs/operations.md): the job
 * is deferred, the worker never guesses. `stateVersion` is the version the
 * state names, `managerVersion` the publishing manager's (-1 when unknown),
 * `clientVersion` this client's; the cause, a protocol.VersionError, says
 * what to upgrade.
 */
export class VersionMismatch extends NoPolicy {
  override readonly reason = "the state was published for a protocol version this client does not speak";
  constructor(after: number, readonly stateVersion: number, readonly managerVersion: number, readonly clientVersion: number,
    options: { cause?: unknown; detail?: string } = {}) {
    const versions = `state version ${stateVersion}, manager version ${managerVersion < 0 ? "unknown" : managerVersion}, this client's version ${clientVersion}`;
    super(after, { ...options, detail: options.detail ? `${versions}; ${options.detail}` : versions });
  }
}
/**
 * The call was cut short for a reason of the caller's own (its signal was
 * aborted, the guard closed, or the code threw it): it counted nothing
 * against the dependency and is deferred.
 */
export class Cancelled extends SpillwayError {
  override readonly reason: string = "cancelled: the caller cancelled the call";
}
/** The slot's lease expired before it was renewed: the fleet stopped counting the call. */
export class LeaseLost extends Cancelled {
  override readonly reason = "lease lost: the slot expired before it was renewed";
}
/** The job is past its deadline: drop it. */
export class Stale extends SpillwayError {
  override readonly action = "drop";
  override readonly reason = "stale: the job is past its deadline";
}
/** A newer version of the job exists: drop it. */
export class Superseded extends SpillwayError {
  override readonly action = "drop";
  override readonly reason = "superseded: a newer version of the job exists";
}
/** The call failed; the fleet's retry budget allows a retry after `after`. */
export class CallFailed extends SpillwayError {
  override readonly action = "retry";
  override readonly reason = "call failed";
}
/** The call failed and the fleet's retry budget is spent: park the job for `after`. */
export class BudgetExhausted extends SpillwayError {
  override readonly action = "park";
  override readonly reason = "retry budget exhausted";
}

export interface Decision {
  /** null: not the guard's decision (a success, a Permanent error, another error). */
  action: Action | null;
  /** Milliseconds. */
  after: number;
}

/**
 * The action and delay of an error thrown by guard.do; {action: null,
 * after: 0} for anything the guard did not decide on: those are the job's
 * own outcome.
 */
export function decide(err: unknown): Decision {
  if (err instanceof SpillwayError) return { action: err.action, after: err.after };
  return { action: null, after: 0 };
}

/**
 * Wrap an error the dependency answered with that retrying cannot fix (a
 * validation error): the call counts as a success for the breaker and the
 * guard throws the wrapped error unchanged.
 */
export class Permanent extends Error {
  override name = "Permanent";
  constructor(readonly error: unknown) {
    super(error instanceof Error ? error.message : String(error), { cause: error });
  }
}

/**
 * Wrap a refusal that carried a server's Retry-After (HTTP 429 or 503): the
 * retry comes no earlier than `after` ms, jittered upward, and never earlier
 * than the backoff would have it. checkResponse throws it.
 */
export class RetryAfter extends Error {
  override name = "RetryAfter";
  constructor(readonly after: number, readonly error?: unknown) {
    super(error instanceof Error ? error.message : `retry after ${after}ms`, { cause: error });
  }
}

/** An HTTP response with an error status (checkResponse). */
export class HttpStatusError extends Error {
  override name = "HttpStatusError";
  constructor(readonly status: number, readonly url: string) {
    super(`${url}: HTTP ${status}`);
  }
}

/**
 * Redis is configured to evict keys (a maxmemory-policy other than
 * noeviction): under memory pressure it may drop leases, the published state
 * or a job's version, and the fleet would then run more calls than its
 * limit. Every guard.do throws it (a configuration error, not a refusal:
 * decide() says null) unless the guard has allowEviction.
 */
export class EvictionPolicyError extends Error {
  override name = "EvictionPolicyError";
  constructor(readonly policy: string, dependency: string) {
    super(`redis has maxmemory-policy ${policy}: it may evict Spillway's leases and state for ${dependency} under memory pressure, ` +
      "and the fleet would then run more calls than its limit; set maxmemory-policy noeviction " +
      "(or pass allowEviction: true, and alert on spillway_worker_redis_evicting)");
  }
}
