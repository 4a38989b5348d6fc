"""How one replica enforces the tenants' quotas: the seam between the decision and replication.

``admission.py`` decides; it asks this module four things about a tenant's (or a per-model budget's)
quota, and nothing else:

* what a budget is made of in this mode (:meth:`Quota.bucket`);
* when the budget here cannot pay for a request, what to answer (:meth:`Quota.short`): borrow from the
  fleet first, refuse as *over quota fleet-wide* (429), or say that the fleet-wide answer is not known
  (503 ``quota-unavailable``, retryable, gateway class — never a claim about the tenant);
* that a request was charged (:meth:`Quota.took`), completed with tokens given back or charged more
  (:meth:`Quota.settled`), or refunded because it never went (:meth:`Quota.refunded`).

One implementation per mode, swapped by ``Admission`` as the store comes and goes:

* :class:`LocalQuota` — one replica, no store: the buckets are the tenant's whole budget, so a refusal
  is over quota by construction.
* :class:`LeasedQuota` — several replicas sharing Redis (``store.py``): slots granted and credit leased
  from the fleet's buckets (``share.py`` has the arithmetic). A slice that is short borrows first; a 429
  only when the store's word is that the fleet has nothing left; while the store cannot be asked, 503.
* :class:`SplitQuota` — the store is out of reach: an even split of every limit (``share.fallback_slots``).
  Only what this replica alone holds can prove a tenant over its fleet-wide limit; any other refusal is
  503 ``quota-unavailable``. What it spends is kept for the store to debit when it answers again.

Later quota kinds plug in at the same points — a spend budget (money per day/month) reserves in
``short``/``took`` before dispatch and reconciles in ``settled``; best effort over a protective limit
answers ``short`` with a lowest-priority admission when the fleet has headroom.

``store.py`` talks to :class:`LeasedQuota`'s narrow API (``report``, ``slots``, ``credit``, ``needs``,
``debits``, ``held``) and never to ``TenantState`` or ``Credit`` fields. Pure: no I/O, time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from .config import Tenant
from .limits import Credit, TokenBucket, default_burst
from .share import IDLE_S, ORPHANED, credit_target, fallback_slots, slot_demand

if TYPE_CHECKING:
    from .admission import TenantState

Bucket = TokenBucket | Credit
"""A budget: the whole bucket (one replica, or a local split) or this replica's credit leased from the
shared one."""
Limit = Literal["slots", "requests", "tokens"]
Short = Literal["borrow", "over", "unknown"]
"""What a budget that cannot pay here means: borrow from the store first | over quota fleet-wide (429) |
the fleet-wide answer is not known now (503 ``quota-unavailable``)."""

SPEND_ALPHA = 0.3
LARGEST_DECAY = 0.95
"""Per sync: the largest recent request, which a replica keeps credit for, is forgotten over ~20 syncs."""


@dataclass(frozen=True, slots=True)
class ShareReport:
    """One tenant's line in a replica's sync with the store (:meth:`LeasedQuota.report`)."""

    tenant: str
    cap: int | None
    """Its ``max_concurrent`` (None: no cap)."""
    slots: int
    """Slots this replica admits on now: the store's record never drops below it, and adopts it when it
    has no record (it restarted empty)."""
    inflight: int
    demand: int | None
    spare: bool
    requests: tuple[float, float, float] | None
    """(per minute, bucket size, amount to lease (+) or give back (-)) for its request budget."""
    tokens: tuple[float, float, float] | None
    stays: int | None = None
    """Of ``inflight``, what stays taken if this replica dies (``TenantState.orphanable``; None: all of it)."""
    heirs: frozenset[str] = frozenset()
    """Tickets of the slot holders sent on the cap's stretch (``TenantState.heirs``): a completion forwarded for
    one gives its slot back."""


class SlotNeed(NamedTuple):
    """A borrow's slot: the tenant's cap, the slots it holds here, in flight, and what of that stays taken if
    this replica dies (as in :class:`ShareReport`; its heirs go with the next sync)."""

    cap: int
    held: int
    inflight: int
    stays: int


@dataclass(frozen=True, slots=True)
class Need:
    """What a borrow asks the store for one tenant: a slot, and the credit each budget lacks as (budget, rate per
    second, bucket size, amount)."""

    slot: SlotNeed | None
    credit: tuple[tuple[str, float, float, float], ...]


def budgets(q: Tenant) -> tuple[tuple[Literal["requests", "tokens"], float | None, int | None], ...]:
    """A tenant's two budgets: (the TenantState attribute, per minute, burst)."""
    return ("requests", q.requests_per_minute, q.request_burst), ("tokens", q.tokens_per_minute, q.token_burst)


def whole_tokens(q: Tenant) -> float | None:
    """The tenant's whole token budget fleet-wide (its bucket's size): a request costing more can never
    be admitted (400). Never this replica's slice of it: a request that fits the fleet's budget is not
    invalid because a local split holds a third of it."""
    return None if q.tokens_per_minute is None else default_burst(q.tokens_per_minute, q.token_burst)


class Quota(Protocol):
    """One replica's way of enforcing quotas (see the module's docstring)."""

    mode: Literal["local", "leased", "split"]

    def bucket(self, per_minute: float | None, burst: int | None, now: float) -> Bucket | None:
        """A new budget of this mode (None: no such limit)."""
        ...

    def short(self, s: TenantState, limit: Limit, need: float, now: float, may_borrow: bool) -> Short:
        """The budget ``limit`` here cannot pay ``need`` (a slot, a request, tokens): what that means."""
        ...

    def took(self, s: TenantState, tokens: int) -> None:
        """A request of ``tokens`` was charged (its buckets already debited)."""
        ...

    def settled(self, s: TenantState, returned: float) -> None:
        """A request charged in this mode completed: ``returned`` tokens of its reservation went back
        (negative: it used more). (Admission tells it only for leases charged while this mode ran: a
        lease charged on the lease and ended on the split must not shrink what the split spent.)"""
        ...

    def refunded(self, s: TenantState, tokens: int) -> None:
        """A request charged in this mode never went (refused from the queue, cancelled): all of it
        went back."""
        ...


class LocalQuota:
    """One replica: its buckets are the tenants' whole budgets."""

    mode: Literal["local", "leased", "split"] = "local"

    def bucket(self, per_minute: float | None, burst: int | None, now: float) -> Bucket | None:
        return None if per_minute is None else TokenBucket(per_minute, default_burst(per_minute, burst), now)

    def short(self, s: TenantState, limit: Limit, need: float, now: float, may_borrow: bool) -> Short:
        return "over"

    def took(self, s: TenantState, tokens: int) -> None:
        return None

    def settled(self, s: TenantState, returned: float) -> None:
        return None

    def refunded(self, s: TenantState, tokens: int) -> None:
        return None


class LeasedQuota:
    """Several replicas sharing the store: slots and credit leased from it (``store.py`` moves them)."""

    mode: Literal["local", "leased", "split"] = "leased"

    def __init__(self, states: Callable[[], list[TenantState]]) -> None:
        self._states = states
        self.down = False
        """The store's last sync failed (before the local split starts): its word is not fresh."""
        self.unreached: set[str] = set()
        """Tenants whose last borrow could not ask the store (an error, a timeout)."""

    def bucket(self, per_minute: float | None, burst: int | None, now: float) -> Bucket | None:
        return None if per_minute is None else Credit(per_minute, default_burst(per_minute, burst), now)

    def short(self, s: TenantState, limit: Limit, need: float, now: float, may_borrow: bool) -> Short:
        cap = s.config.max_concurrent
        if limit == "slots":
            if s.slots is not None and cap is not None and s.slots < cap:
                # this replica's slice is full: the fleet may have a slot nobody holds, or one held idle
                # at another replica (the borrow then waits for it to move: ``store.borrow``)
                if may_borrow and s.fleet_free > 0:
                    s.fleet_free -= 1  # a burst here does not send more borrows than slots are free
                    return "borrow"
                if may_borrow and self.idle_elsewhere(s):
                    assert s.fleet_running is not None
                    s.fleet_running += 1  # nor more than slots are idle
                    return "borrow"
                s.refused += 1
        else:
            b = s.requests if limit == "requests" else s.tokens
            if may_borrow and b is not None and b.borrowable(need, now):
                b.borrowing(need, now)
                return "borrow"
        if self.down or s.name in self.unreached:
            # the store was not asked: its last word may be stale; say nothing about the tenant
            return "over" if limit == "slots" and cap is not None and s.inflight >= cap else "unknown"
        return "over"

    def took(self, s: TenantState, tokens: int) -> None:
        s.peak = max(s.peak, s.inflight)
        s.spent_requests += 1
        s.spent_tokens += tokens
        s.largest = max(s.largest, tokens)

    def settled(self, s: TenantState, returned: float) -> None:
        return None

    def refunded(self, s: TenantState, tokens: int) -> None:
        return None

    # -- the store's narrow API ------------------------------------------------------------------

    def report(self, replicas: int, interval: float, now: float) -> list[ShareReport]:
        """What this replica asks the store for, tenant by tenant: the slots it wants and the credit to
        lease (positive) or give back (negative; taken off the local credit now, so a lost reply loses
        credit rather than spends it twice). Resets the demand seen since the last report."""
        out = []
        for s in self._states():
            q = s.config
            idle = s.inflight == 0 and now - s.last_seen > IDLE_S
            buckets = (s.requests, s.tokens)
            if q.max_concurrent is None and all(b is None for b in buckets):
                continue
            if idle and not s.slots and not s.record and all(not isinstance(b, Credit) or b.level == 0
                                                             for b in buckets):
                # nothing held, nothing asked: what the fleet has free is no longer known, so the next
                # request borrows (one round trip) rather than trusting a stale "none"
                s.fleet_free = q.max_concurrent or 0
                continue
            demand, spare = None, False
            if q.max_concurrent is not None:
                demand, spare = slot_demand(s.inflight, s.peak, s.refused, idle)
                demand = min(q.max_concurrent, demand)
            amounts: list[tuple[float, float, float] | None] = []
            dt = max(interval, 1e-3)
            s.rate_requests += SPEND_ALPHA * (s.spent_requests / dt - s.rate_requests)
            s.rate_tokens += SPEND_ALPHA * (s.spent_tokens / dt - s.rate_tokens)
            for b, rate, largest in ((s.requests, s.rate_requests, 1.0), (s.tokens, s.rate_tokens, s.largest)):
                if not isinstance(b, Credit):
                    amounts.append(None)
                    continue
                if idle:
                    amount = -max(0.0, b.level)
                else:
                    target = credit_target(rate, largest, b.capacity, replicas)
                    if b.level < target / 2 or b.level > 2 * target:
                        amount = target - b.level
                    else:
                        amount = 0.0
                if amount < 0:
                    b.level += amount
                amounts.append((b.rate * 60.0, b.capacity, amount))
            out.append(ShareReport(s.name, q.max_concurrent, s.slots or 0, s.inflight, demand, spare,
                                   amounts[0], amounts[1], s.orphanable, s.heirs))
            s.peak, s.refused = s.inflight, 0
            s.spent_requests = s.spent_tokens = 0.0
            s.largest = 0.0 if idle else s.largest * LARGEST_DECAY
        return out

    @staticmethod
    def slots(s: TenantState, slots: int, free: int, record: int | None = None, running: int | None = None) -> None:
        """The store's answer for one tenant's concurrency: the slots this replica may now admit on, how
        many nobody holds, what the store has on record for this replica, and the requests in flight
        fleet-wide as the replicas last reported them."""
        s.slots, s.fleet_free = slots, free
        s.record = slots if record is None else record
        s.fleet_running = running

    @staticmethod
    def idle_elsewhere(s: TenantState) -> bool:
        """Every slot of the tenant is held, and the store's last answer says fewer requests than its
        cap are running fleet-wide: a slot sits idle at another replica (a spare), not over the cap."""
        cap = s.config.max_concurrent
        return (cap is not None and s.fleet_free <= 0 and s.fleet_running is not None
                and s.fleet_running < cap and s.inflight < cap)

    @staticmethod
    def wants_slot(s: TenantState) -> None:
        """A request here waits for a slot: count it as demand this replica reports at its next sync."""
        s.refused += 1

    def credit(self, s: TenantState, budget: str, granted: float, fleet_level: float, now: float) -> None:
        """The store's answer for one budget (``requests`` | ``tokens``): credit granted, and the level
        of the fleet's bucket after it."""
        b = s.requests if budget == "requests" else s.tokens if budget == "tokens" else None
        if isinstance(b, Credit):
            b.level += granted
            b.seen(fleet_level, now)

    @staticmethod
    def needs(s: TenantState, tokens: float) -> Need:
        """What a borrow for a request of ``tokens`` asks the store for: a slot when this replica's
        slice is full, and what each budget's credit here lacks."""
        cap = s.config.max_concurrent
        held = s.slots or 0
        slot = SlotNeed(cap, held, s.inflight, s.orphanable) if cap is not None and s.inflight >= held else None
        credit = []
        for dim, b, need in (("requests", s.requests, 1.0), ("tokens", s.tokens, tokens)):
            if isinstance(b, Credit) and b.lacks(need) > 0:
                credit.append((dim, b.rate, b.capacity, b.lacks(need)))
        return Need(slot, tuple(credit))

    def debits(self, spent: Mapping[str, tuple[float, float]]) -> list[tuple[str, str, float, float, float]]:
        """(budget name, ``requests`` | ``tokens``, rate per second, bucket size, amount) to debit from the
        store's buckets for what was spent on a local split (``SplitQuota.rejoin``)."""
        out = []
        for s in self._states():
            requests, tokens = spent.get(s.name, (0.0, 0.0))
            for dim, amount, b in (("requests", requests, s.requests), ("tokens", tokens, s.tokens)):
                if isinstance(b, Credit) and amount > 0:
                    out.append((s.name, dim, b.rate, b.capacity, amount))
        return out

    def held(self) -> list[tuple[str, int, frozenset[str]]]:
        """(name, requests sent, the heirs among them) of every budget holding slots here: what a clean stop keeps
        taken until their completions come (``TenantState.orphanable``, ``TenantState.heirs``)."""
        return [(s.name, s.orphanable, s.heirs) for s in self._states() if s.slots]


class SplitQuota(LeasedQuota):
    """The store is out of reach: each replica enforces an even split of every limit among the
    replicas last seen alive, padded to those expected (``share.with_expected``)."""

    mode: Literal["local", "leased", "split"] = "split"

    def __init__(self, states: Callable[[], list[TenantState]], replicas: Sequence[str], me: str,
                 holdings: Mapping[str, Mapping[str, int]]) -> None:
        super().__init__(states)
        self.live = sorted(set(replicas) | {me})
        self.me = me
        self.holdings = holdings
        self.spent: dict[str, tuple[float, float]] = {}
        """(requests, tokens) each budget spent from its local split: debited from the store's buckets
        when it answers again (real usage, not reservations)."""
        self.adopted: set[str] = set()
        """Tickets of other replicas whose completion reached here during the split (:meth:`adopt`)."""

    @property
    def replicas(self) -> int:
        return len(self.live)

    def bucket(self, per_minute: float | None, burst: int | None, now: float) -> Bucket | None:
        # whole here; :meth:`split` cuts it to this replica's share right after
        return None if per_minute is None else TokenBucket(per_minute, default_burst(per_minute, burst), now)

    def split(self, now: float) -> None:
        """Cut every limit to this replica's share, corrected for what the others held
        (``share.fallback_slots``). Applied again after a reload."""
        n = self.replicas
        for s in self._states():
            q = s.config
            if q.max_concurrent is not None:
                held = self.holdings.get(s.name, {})
                # slots of replicas that died are still taken by what they admitted
                cap = max(0, q.max_concurrent - held.get(ORPHANED, 0))
                s.slots = fallback_slots(cap, held, self.live).get(self.me, 0)
            for attr, per_minute, burst in budgets(q):
                b = s.requests if attr == "requests" else s.tokens
                if b is None or per_minute is None:
                    continue
                local = TokenBucket(per_minute / n, max(1.0, default_burst(per_minute, burst) / n), now)
                local.level = min(b.level, local.capacity)
                if attr == "requests":
                    s.requests = local
                else:
                    s.tokens = local

    def adopt(self, states: Sequence[TenantState], ticket: str) -> bool:
        """A completion for another replica's ``ticket`` reached this replica while the store is away:
        its slot is free fleet-wide, but its owner cannot learn it before the store answers (the
        completion is forwarded through the store), so its split would stay full of requests that have
        ended. This replica takes the slot over instead — one more slot for each budget the request was
        charged to (``states``: its tenant, its per-model budget), never above the cap, once per ticket.
        The fleet's total stays within the cap: the owner's slot is one that nothing runs on. True when
        a slot was added (requests queued here may go)."""
        if ticket in self.adopted:
            return False
        self.adopted.add(ticket)
        grew = False
        for s in states:
            cap = s.config.max_concurrent
            if cap is not None and s.slots is not None and s.slots < cap:
                s.slots += 1
                grew = True
        return grew

    def short(self, s: TenantState, limit: Limit, need: float, now: float, may_borrow: bool) -> Short:
        cap = s.config.max_concurrent
        if limit == "slots":
            if s.slots is not None and cap is not None and s.slots < cap:
                s.refused += 1
            # only what this replica alone holds proves the tenant over its fleet-wide cap
            return "over" if cap is not None and s.inflight >= cap else "unknown"
        # a slice of the budget ran short: the fleet's budget may not have
        return "unknown"

    def took(self, s: TenantState, tokens: int) -> None:
        super().took(s, tokens)
        r, t = self.spent.get(s.name, (0.0, 0.0))
        self.spent[s.name] = (r + 1, t + tokens)

    def settled(self, s: TenantState, returned: float) -> None:
        if s.name in self.spent:
            r, t = self.spent[s.name]
            self.spent[s.name] = (r, t - returned)

    def refunded(self, s: TenantState, tokens: int) -> None:
        if s.name in self.spent:
            r, t = self.spent[s.name]  # never sent: nothing to debit on rejoining
            self.spent[s.name] = (r - 1, t - tokens)

    def rejoin(self, now: float) -> dict[str, tuple[float, float]]:
        """The store answers again: budgets become leased credit, keeping only debts. Returns what was
        spent meanwhile, for the store to debit."""
        for s in self._states():
            for attr, per_minute, burst in budgets(s.config):
                b = s.requests if attr == "requests" else s.tokens
                if isinstance(b, TokenBucket) and per_minute is not None:
                    c = Credit(per_minute, default_burst(per_minute, burst), now, level=min(0.0, b.level))
                    if attr == "requests":
                        s.requests = c
                    else:
                        s.tokens = c
        spent, self.spent = self.spent, {}
        return spent
