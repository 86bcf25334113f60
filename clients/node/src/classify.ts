// What a call's error says about the dependency: a timeout ("t") or a
// failure ("f"), for the errors of the clients Node services use, read from
// the error's name and code and those of its causes (error.cause, an
// AggregateError's errors), without importing any of them:
//
// - fetch and undici: AbortSignal.timeout's DOMException "TimeoutError",
//   undici's UND_ERR_CONNECT_TIMEOUT, UND_ERR_HEADERS_TIMEOUT and
//   UND_ERR_BODY_TIMEOUT (fetch throws TypeError("fetch failed") with the
//   undici error as its cause);
// - axios: ECONNABORTED (its `timeout`) and ETIMEDOUT (with
//   transitional.clarifyTimeoutError);
// - got: TimeoutError (code ETIMEDOUT);
// - sockets: ETIMEDOUT and ESOCKETTIMEDOUT, and a connection refused
//   (ECONNREFUSED) or reset (ECONNRESET), as every one of these libraries
//   raises them (issue 33): the dependency did not answer the call.
//
// Here Node differs from the Go and Python clients, which count a refused
// or reset connection a failure. Both outcomes count against the breaker
// alike; only the outcome's label differs. Anything else (an HTTP 5xx, a
// DNS error, undici's UND_ERR_SOCKET for a peer that closed without an
// RST) is a failure.

import type { Outcome } from "./protocol.js";

const TIMEOUT_NAMES = new Set(["TimeoutError", "ConnectTimeoutError", "HeadersTimeoutError", "BodyTimeoutError"]);
const TIMEOUT_CODES = new Set([
  "ETIMEDOUT", "ESOCKETTIMEDOUT", "ECONNABORTED", "ECONNREFUSED", "ECONNRESET",
  "UND_ERR_CONNECT_TIMEOUT", "UND_ERR_HEADERS_TIMEOUT", "UND_ERR_BODY_TIMEOUT",
  "ERR_GOT_REQUEST_TIMEOUT", // not thrown by got 14 (its TimeoutError has ETIMEDOUT); kept for forks
]);
const MAX_CHAIN = 8; // causes followed, so that a cycle cannot loop

/** "t" for a timeout of any client listed in the module, else "f". */
export function defaultClassify(err: unknown): Outcome {
  return isTimeout(err) ? "t" : "f";
}

/** Whether err, or an error it wraps (cause, AggregateError.errors), is a timeout. */
export function isTimeout(err: unknown, depth = 0): boolean {
  if (depth >= MAX_CHAIN || err === null || typeof err !== "object") return false;
  const e = err as { name?: unknown; code?: unknown; cause?: unknown; errors?: unknown };
  if (typeof e.name === "string" && TIMEOUT_NAMES.has(e.name)) return true;
  if (typeof e.code === "string" && TIMEOUT_CODES.has(e.code)) return true;
  if (e.cause !== undefined && e.cause !== err && isTimeout(e.cause, depth + 1)) return true;
  if (Array.isArray(e.errors)) {
    for (const x of e.errors.slice(0, MAX_CHAIN)) if (isTimeout(x, depth + 1)) return true;
  }
  return false;
}
