// @spillway/client: Spillway's worker client for Node.js. See README.md.
export { Guard, RedisClock, type GuardOptions, type Job } from "./guard.js";
export {
  SpillwayError, Throttled, RateLimited, BreakerOpen, RedisUnavailable, BadReply, NoPolicy, VersionMismatch,
  Cancelled, LeaseLost, Stale, Superseded, CallFailed, BudgetExhausted, Permanent, RetryAfter, HttpStatusError, EvictionPolicyError,
  decide, type Action, type Decision,
} from "./errors.js";
export { checkResponse, parseRetryAfter } from "./http.js";
export { defaultClassify, isTimeout } from "./classify.js";
export { Backoff, FALLBACK, retryAfter, park, allowsPPM } from "./retry.js";
export * as protocol from "./protocol.js";
export { VERSION, MIN_STATE_VERSION, MAX_STATE_VERSION, KEY_PREFIX } from "./protocol.js";
