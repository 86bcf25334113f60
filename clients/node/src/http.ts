// A fetch Response helper, as pkg/guard's CheckResponse: a 429 or 503 with a
// Retry-After becomes a retry no earlier than the server asked, another 5xx
// (or a 429/503 without one) a failure, any other 4xx a Permanent error (the
// dependency answered; retrying cannot fix it), anything below 400 the
// response itself.

import { HttpStatusError, Permanent, RetryAfter } from "./errors.js";

/** The longest Retry-After honoured: one further away is ignored (pkg/guard maxRetryAfter). */
export const MAX_RETRY_AFTER = 24 * 3_600_000;

interface ResponseLike {
  status: number;
  url?: string;
  headers: { get(name: string): string | null };
}

/** Returns res when its status is below 400, else throws as described in the module. */
export function checkResponse<T extends ResponseLike>(res: T): T {
  if (res.status < 400) return res;
  const err = new HttpStatusError(res.status, res.url ?? "");
  if (res.status === 429 || res.status === 503) {
    const after = parseRetryAfter(res.headers.get("retry-after"), Date.now());
    if (after !== undefined) throw new RetryAfter(after, err);
    throw err;
  }
  if (res.status >= 500) throw err;
  throw new Permanent(err);
}

/** A Retry-After value, delay seconds or an HTTP date, as ms; undefined when unusable or over MAX_RETRY_AFTER. */
export function parseRetryAfter(v: string | null | undefined, nowMs: number): number | undefined {
  const s = (v ?? "").trim();
  if (!s) return undefined;
  let d: number;
  if (/^\d+$/.test(s)) {
    d = Number(s) * 1000;
  } else {
    const t = Date.parse(s);
    if (Number.isNaN(t) || !/GMT$/.test(s)) return undefined;
    d = Math.max(t - nowMs, 0);
  }
  return d > MAX_RETRY_AFTER ? undefined : d;
}
