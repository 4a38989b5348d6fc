"""Sharing a tenant's limits between kvgate replicas: the arithmetic, no I/O.

Each replica holds a *slice* of every active tenant's limits and decides on it locally — no network
round trip per request. A slice is sized by the replica's demand and refilled or returned through the
store (``store.py``) every ``sync_interval_ms``, Doorman-style (wants → gets):

* **concurrency** — slots. Every replica reports what it needs (its peak in flight plus what it refused
  for want of a slot) and whether it is active; the store divides ``max_concurrent`` among the live
  replicas *max-min fair by demand* (:func:`fair_slots`), then a spare each from what nobody demands,
  and grants only slots nobody holds, so the sum of the slices never exceeds the cap. A replica above
  its fair share gives slots back as its requests end; the store's record of a replica never drops
  below what that replica admits on until the replica itself has lowered it.
* **token and request budgets** — credit leased from one bucket in the store: a replica spends only
  what it leased, so the fleet never spends more than the bucket holds; a request whose real usage
  exceeds its reservation may overrun by that difference, as with one replica.

When the store cannot be reached each replica falls back to an even split of every limit among the
replicas it last saw alive (:func:`fallback_slots`), correcting for what the others held above their
even share so that the total stays within the cap while their requests drain.

The same water-filling runs inside Redis (the slots script in ``store.py``); the property tests check
the two against each other on a real ``redis-server``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

ORPHANED = "~orphaned"
"""In a tenant's holdings as read from the store: the slots of replicas that died, still taken by the
requests they admitted (not a replica name: those are hex)."""
IDLE_S = 1.0
"""A tenant with no request on a replica for this long gives back everything it does not use."""
CREDIT_HORIZON_S = 1.0
"""Token credit a replica keeps in hand: about this many seconds of its recent spend."""


def waterfill(wants: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of ``capacity``: nobody gets more than it wants, and capacity left over by
    those who want little is split evenly among the others (ties broken by name, so every replica
    and the store compute the same answer)."""
    out: dict[str, float] = {}
    left = max(0.0, float(capacity))
    order = sorted(wants, key=lambda k: (wants[k], k))
    for i, k in enumerate(order):
        share = left / (len(order) - i)
        give = min(max(0.0, float(wants[k])), share)
        out[k] = give
        left -= give
    return out


def fair_slots(demands: Mapping[str, int], capacity: int, spares: Collection[str] = ()) -> dict[str, int]:
    """:func:`waterfill` in whole slots. Each share is rounded down; the slots the rounding left go one
    each to the largest unmet fractions (ties by name); then what nobody demands goes as one *spare*
    each to the replicas in ``spares`` (active ones: their next request needs no round trip), fewest
    slots first. Demand always comes before spares, so a small cap is not parked as some replica's
    spare while another is refusing. The sum never exceeds ``capacity``."""
    capacity = max(0, capacity)
    shares = waterfill(demands, capacity)
    out = {k: math.floor(v) for k, v in shares.items()}
    left = capacity - sum(out.values())
    for k in sorted(out, key=lambda k: (-(shares[k] - out[k]), k)):
        if left <= 0:
            break
        if out[k] < demands[k]:
            out[k] += 1
            left -= 1
    for k in sorted((k for k in out if k in spares), key=lambda k: (out[k], k)):
        if left <= 0:
            break
        out[k] += 1
        left -= 1
    return out


EXPECTED = "!expected-"
"""The names of the replicas a fallback split counts without having seen them (``expected_replicas``
more than the store last listed). ``!`` sorts before every real replica id (hex): the remainder of an
even split goes to these unknown replicas first (:func:`even_slots`)."""


def with_expected(live: Collection[str], expected: int) -> list[str]:
    """The replicas a fallback split divides among: ``live`` (the ones last seen, this one included),
    padded with placeholders up to ``expected``.

    Why placeholders come first in the split's order: a replica that never heard from the store knows
    only itself, so each such replica would otherwise count itself as the first name and take the
    remainder — with 3 replicas a cap of 4 became 2 + 2 + 2 and a cap of 1 became 3. A placeholder stands
    for a replica whose view nobody knows: giving it the remainder keeps that remainder unused rather
    than claimed by every replica at once."""
    names = sorted(set(live))
    return names + [f"{EXPECTED}{i}" for i in range(max(0, expected - len(names)))]


def even_slots(capacity: int, replicas: Sequence[str]) -> dict[str, int]:
    """``capacity`` split evenly, the remainder one each to the first replicas by name (placeholders of
    :func:`with_expected` before every real name): sums to it."""
    live = sorted(set(replicas))
    if not live:
        return {}
    base, extra = divmod(max(0, capacity), len(live))
    return {r: base + (1 if i < extra else 0) for i, r in enumerate(live)}


def fallback_slots(capacity: int, holdings: Mapping[str, int], replicas: Sequence[str]) -> dict[str, int]:
    """Each replica's slots while the store is out of reach: an even split of ``capacity`` among the
    ``replicas`` last seen alive, less what the others held above their even split when the store was
    last read (they keep those requests until they end; taking the excess off the replicas below
    their split keeps the total within ``capacity``). Every replica computes the same answer from the
    same last reading. A replica above its split gets its split (it admits nothing until it drains
    below it)."""
    even = even_slots(capacity, replicas)
    excess = sum(max(0, holdings.get(r, 0) - e) for r, e in even.items())
    out = dict(even)
    # take the excess from those below their split, largest slack first, ties by name
    for r in sorted(even, key=lambda k: (-(even[k] - holdings.get(k, 0)), k)):
        if excess <= 0:
            break
        slack = max(0, even[r] - holdings.get(r, 0))
        cut = min(slack, excess, out[r])
        out[r] -= cut
        excess -= cut
    return out


def slot_demand(inflight: int, peak: int, refused: int, idle: bool) -> tuple[int, bool]:
    """(slots a replica needs, whether it wants a spare): what it has in flight (it cannot give those
    back), its peak since the last sync plus what it refused for want of a slot (demand it saw), and
    while the tenant is active here a spare, granted only from slots nobody demands."""
    if idle:
        return inflight, False
    return max(inflight, peak + refused), True


def credit_target(spend_per_s: float, largest: float, capacity: float, replicas: int) -> float:
    """Credit a replica keeps in hand for one budget: about ``CREDIT_HORIZON_S`` of its recent spend,
    at least its largest recent request, at most its even share of the bucket (so an idle replica
    cannot sit on a budget another needs; a larger request borrows)."""
    share = capacity / max(1, replicas)
    return min(max(spend_per_s * CREDIT_HORIZON_S, largest), max(share, min(largest, capacity)))
