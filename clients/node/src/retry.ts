// Backoff arithmetic, as pkg/retry computes it: capped exponential backoff
// with jitter, a server's Retry-After jittered upward, and the parking delay
// once the fleet's retry budget is spent. Durations are milliseconds;
// randomness comes from a caller's () => number in [0, 1) so tests can seed it.

export type Jitter = "Full" | "Equal" | "None" | "";
export type Rand = () => number;

export class Backoff {
  /** baseMs: the ceiling after the first failed attempt; maxMs: the cap. */
  constructor(readonly baseMs: number, readonly maxMs: number, readonly jitter: Jitter | string = "Full") {}

  valid(): boolean {
    return this.baseMs > 0 && this.maxMs >= this.baseMs && ["", "Full", "Equal", "None"].includes(this.jitter);
  }

  /** min(max, base × 2^(attempt−1)); attempt below 1 counts as 1. */
  ceiling(attempt: number): number {
    if (this.baseMs <= 0 || this.maxMs <= 0) return 0;
    const shift = Math.max(attempt, 1) - 1;
    if (shift >= 63 || this.baseMs * 2 ** shift > this.maxMs) return this.maxMs;
    return this.baseMs * 2 ** shift;
  }

  delay(attempt: number, rand: Rand = Math.random): number {
    const c = this.ceiling(attempt);
    if (this.jitter === "None") return c;
    if (this.jitter === "Equal") return c / 2 + uniform(c - c / 2, rand);
    return uniform(c, rand);
  }
}

/** The backoff a guard uses before it has read the policy's: 1s, 5m, Full. */
export const FALLBACK = new Backoff(1000, 300_000, "Full");

/** Never earlier than server, jittered upward by up to half of it. */
export function retryAfter(serverMs: number, rand: Rand = Math.random): number {
  if (serverMs <= 0) return 0;
  return serverMs + uniform(serverMs / 2, rand);
}

/** The delay of work refused by the retry budget: max + uniform(0, max). */
export function park(b: Backoff, rand: Rand = Math.random): number {
  if (b.maxMs <= 0) return 0;
  return b.maxMs + uniform(b.maxMs, rand);
}

/** The retry-budget rule (docs/protocol.md §6), exact in integers. */
export function allowsPPM(retries: number, calls: number, ratioPPM: number, minRetries: number): boolean {
  return retries * 1_000_000 < Math.max(minRetries * 1_000_000, ratioPPM * calls);
}

function uniform(d: number, rand: Rand): number {
  if (d <= 0) return 0;
  const f = rand();
  if (!(f > 0)) return 0;
  return Math.min(f * d, d);
}
