"""Backoff arithmetic, as pkg/retry computes it: capped exponential backoff
with jitter, a server's Retry-After jittered upward, and the parking delay
once the fleet's retry budget is spent. Durations are seconds (floats);
randomness comes from a caller's random.Random so tests can seed it."""

from __future__ import annotations

import random as _random
from dataclasses import dataclass

FULL, EQUAL, NONE = "Full", "Equal", "None"


@dataclass(frozen=True)
class Backoff:
    base: float  # seconds: the ceiling after the first failed attempt, > 0
    max: float  # seconds: the cap, >= base
    jitter: str = FULL  # Full, Equal or None ('' means Full)

    def valid(self) -> bool:
        return self.base > 0 and self.max >= self.base and self.jitter in ("", FULL, EQUAL, NONE)

    def ceiling(self, attempt: int) -> float:
        """min(max, base × 2^(attempt−1)); attempt below 1 counts as 1."""
        if self.base <= 0 or self.max <= 0:
            return 0.0
        shift = max(attempt, 1) - 1
        if shift >= 63 or self.base * (2 ** shift) > self.max:
            return self.max
        return self.base * (2 ** shift)

    def delay(self, attempt: int, rnd=_random) -> float:
        c = self.ceiling(attempt)
        if self.jitter == NONE:
            return c
        if self.jitter == EQUAL:
            return c / 2 + _uniform(c - c / 2, rnd)
        return _uniform(c, rnd)


# The backoff a guard uses before it has read the policy's: 1s, 5m, Full.
FALLBACK = Backoff(1.0, 300.0, FULL)


def retry_after(server: float, rnd=_random) -> float:
    """Never earlier than server, jittered upward by up to half of it."""
    if server <= 0:
        return 0.0
    return server + _uniform(server / 2, rnd)


def park(b: Backoff, rnd=_random) -> float:
    """The delay of work refused by the retry budget: max + uniform(0, max)."""
    if b.max <= 0:
        return 0.0
    return b.max + _uniform(b.max, rnd)


def allows_ppm(retries: int, calls: int, ratio_ppm: int, min_retries: int) -> bool:
    """The retry-budget rule (docs/protocol.md §6), exact in integers."""
    return retries * 1_000_000 < max(min_retries * 1_000_000, ratio_ppm * calls)


def _uniform(d: float, rnd) -> float:
    if d <= 0:
        return 0.0
    f = rnd.random()
    if not f > 0:
        return 0.0
    return min(f * d, d)
