"""Token buckets: the arithmetic behind per-tenant request and token budgets.

Pure and clock-free: every method takes ``now``. A bucket may go *negative* when the real usage of
a request turns out larger than its reservation; the tenant then waits for the debt to refill,
which is what keeps concurrent requests from overrunning a budget.
"""

from __future__ import annotations

import math


class TokenBucket:
    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, per_minute: float, capacity: float, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(capacity)
        self.level = float(capacity)
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def available(self, now: float) -> float:
        self._refill(now)
        return self.level

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken; ``inf`` when it exceeds the bucket's size."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        deficit = amount - self.level
        return 0.0 if deficit <= 0 else deficit / self.rate

    def seconds_until_full(self, now: float) -> float:
        self._refill(now)
        return (self.capacity - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        """Return ``amount`` (negative: charge more); never above the bucket's size."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def retune(self, per_minute: float, capacity: float, now: float) -> None:
        """New limits from a config reload; what was spent stays spent."""
        self._refill(now)
        self.rate = per_minute / 60.0
        self.capacity = float(capacity)
        self.level = min(self.level, self.capacity)


def default_burst(per_minute: float, burst: int | None) -> float:
    """A bucket's size: the configured burst, else one minute's worth — but never below one, or a
    budget under one per minute (``requests_per_minute: 0.5``) could never pay for a single request."""
    return float(burst) if burst is not None else max(1.0, per_minute)
