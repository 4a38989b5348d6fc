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

    def borrowable(self, amount: float, now: float) -> bool:
        """A bucket of one replica's own has nowhere to borrow from."""
        return False

    def borrowing(self, amount: float, now: float) -> None:
        return None

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


CREDIT_TOLERANCE = 1e-9
"""Relative slack when credit is compared with what a request needs. Leased credit is the sum of floats
that crossed the store (``level + (need - level)`` need not round back to ``need``): without slack a
replica that leased exactly the missing 23 tokens could hold 22.999999999999996 and refuse the request
it borrowed for — a 429 for a tenant inside its fleet-wide budget."""


def covers(have: float, need: float) -> bool:
    """``have`` pays for ``need``, up to float rounding (:data:`CREDIT_TOLERANCE`)."""
    return have >= need - CREDIT_TOLERANCE * max(1.0, abs(need))


class Credit:
    """A replica's slice of a budget several replicas share: units leased from the fleet's bucket in
    the store (``store.py``). It never refills by itself — the store's bucket does, and the replica
    leases more — so what the replicas spend together never exceeds what the bucket gave out.

    ``fleet`` is the store's bucket level when last read (``read_at``), projected forward at the
    bucket's rate: it says whether leasing more could pay for a request (:meth:`borrowable`) and when a
    refused request could be paid (its Retry-After).
    """

    __slots__ = ("capacity", "fleet", "level", "rate", "read_at")

    def __init__(self, per_minute: float, capacity: float, now: float, level: float = 0.0) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(capacity)
        self.level = level
        self.fleet = float(capacity)
        self.read_at = now

    def fleet_level(self, now: float) -> float:
        return min(self.capacity, self.fleet + max(0.0, now - self.read_at) * self.rate)

    def available(self, now: float) -> float:
        """What the tenant could spend now, fleet-wide as far as this replica knows (for its headers)."""
        return self.level + max(0.0, self.fleet_level(now))

    def seconds_until(self, amount: float, now: float) -> float:
        """0 only when this replica's own credit pays for ``amount``; else when the fleet's bucket
        should hold enough (at least a millisecond: the request is not paid for locally)."""
        if amount > self.capacity:
            return math.inf
        if covers(self.level, amount):
            return 0.0
        deficit = amount - self.level - max(0.0, self.fleet_level(now))
        return max(1e-3, deficit / self.rate)

    def borrowable(self, amount: float, now: float) -> bool:
        """Leasing more from the store could pay for ``amount`` (as of the last reading)."""
        return covers(self.level + max(0.0, self.fleet_level(now)), amount)

    def lacks(self, amount: float) -> float:
        """What this replica's own credit lacks to pay for ``amount`` (0: it pays): what a borrow asks for."""
        return 0.0 if covers(self.level, amount) else amount - self.level

    def borrowing(self, amount: float, now: float) -> None:
        """A borrow of what ``amount`` lacks is on its way: the fleet's bucket is taken as that much
        lower until the store answers, so a burst here does not send more borrows than it can pay."""
        self.fleet -= max(0.0, amount - self.level)

    def seconds_until_full(self, now: float) -> float:
        return (self.capacity - max(0.0, self.fleet_level(now))) / self.rate

    def take(self, amount: float, now: float) -> None:
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        """A refund (negative: a charge) on what this replica holds; its surplus goes back at the next sync."""
        self.level += amount

    def retune(self, per_minute: float, capacity: float, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(capacity)

    def seen(self, fleet_level: float, now: float) -> None:
        """The store's bucket level, just read."""
        self.fleet, self.read_at = fleet_level, now
