"""The spend-budget ledger: reserve a request's worst case before admission, charge its real cost when it
ends, release exactly once. Functional core: no I/O, every method takes ``now`` (epoch seconds).

The invariant it keeps, per budget: ``spent in the current window + reserved by requests in flight <=
limit`` is checked before every reservation of a *hard* budget, and a request whose worst case does not
fit is refused (``429 tenant-budget``). Reservations are not tied to a window: a request reserved before
midnight and finished after it is charged to the window current when it ends, and its reservation counted
against both until then — so the invariant survives a window's reset.

The guarantee that follows: when every request's real cost is at most its reservation (an output cap —
``max_tokens`` or the tenant's ``default_max_tokens`` — and a prompt estimate that is not below the real
prompt), a hard budget's spend never exceeds its limit at any instant. Otherwise the overshoot is bounded
by the sum over requests in flight of (real cost - reservation), which only requests that ran past what
they reserved can add (documented in ``docs/guides/budgets.md``; ``tests/test_budgets.py`` checks both).

A shared store (``spendstore.py``) makes the same check and debit in one Redis script across replicas;
this module is the one replica's ledger and the arithmetic both use (windows, prices, Retry-After).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from fnmatch import fnmatchcase
from zoneinfo import ZoneInfo

from .prices import UNIT_WEIGHTS, Price, SpendBudget, Spent, cost, worst_cost

ROLLING_SLOTS = 60
"""A rolling window is kept as this many slots: spend leaves it one slot (1/60 of the window) at a time."""


@dataclass(frozen=True, slots=True)
class Span:
    """One window of a budget: its id (``2026-12`` for a month, ``2026-12-05`` for a day; ``rolling``),
    when it started and when it resets (epoch seconds)."""

    id: str
    start: float
    end: float


def window(b: SpendBudget, now: float) -> Span:
    """The window of ``b`` that contains ``now``: calendar windows start at the hour, day, Monday or first
    of the month in the budget's time zone (DST included: a day is 23 or 25 hours when the clocks move)."""
    if b.window == "rolling":
        assert b.rolling_seconds is not None
        return Span("rolling", now - b.rolling_seconds, now + b.rolling_seconds / ROLLING_SLOTS)
    tz = ZoneInfo(b.timezone)
    local = datetime.fromtimestamp(now, tz)
    if b.window == "hour":
        start = local.replace(minute=0, second=0, microsecond=0)
        nxt = start.replace(tzinfo=None) + timedelta(hours=1)
        ident = start.strftime("%Y-%m-%dT%H")
    elif b.window == "day":
        start = local.replace(hour=0, minute=0, second=0, microsecond=0)
        nxt = start.replace(tzinfo=None) + timedelta(days=1)
        ident = start.strftime("%Y-%m-%d")
    elif b.window == "week":
        day = local.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=local.weekday())
        start = day.replace(tzinfo=None).replace(tzinfo=tz)
        nxt = start.replace(tzinfo=None) + timedelta(days=7)
        ident = start.strftime("%G-W%V")
    else:
        start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        nxt = (start.replace(tzinfo=None) + timedelta(days=32)).replace(day=1)
        ident = start.strftime("%Y-%m")
    # wall-clock arithmetic, then back to an instant in the zone: the next boundary after a DST change
    # is where the zone's clocks show it, not 24 h later
    start_ts = start.replace(tzinfo=None).replace(tzinfo=tz).timestamp()
    return Span(ident, start_ts, nxt.replace(tzinfo=tz).timestamp())


def price_key(prices: Mapping[str, Price], model: str | None, pool: str | None) -> str | None:
    """The ``prices`` key that prices ``model``: its exact name, then the first pattern that matches, then
    its pool (None: none). Also the ``model`` label of the spend metrics: a config key, so bounded."""
    if model is not None:
        if model in prices:
            return model
        for key in prices:
            if any(c in key for c in "*?[") and fnmatchcase(model, key):
                return key
    return pool if pool is not None and pool in prices else None


def price_for(prices: Mapping[str, Price], model: str | None, pool: str | None) -> Price | None:
    """The price of ``model`` (:func:`price_key`)."""
    key = price_key(prices, model, pool)
    return None if key is None else prices[key]


def applies(b: SpendBudget, model: str | None, pool: str | None) -> bool:
    """Whether a request for ``model`` (routed to ``pool``) counts against ``b``."""
    if b.models is None:
        return True
    return any(m in (model, pool) or (model is not None and fnmatchcase(model, m)) for m in b.models)


def human(seconds: float) -> str:
    """A reset time a person reads in a 429's body: ``3 days 4 h``, ``2 h 5 min``, ``40 s``."""
    s = max(0, math.ceil(seconds))
    days, rest = divmod(s, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} day{'s' if days != 1 else ''} {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


@dataclass(slots=True, eq=False)
class Account:
    """One tenant's one budget: what its window has spent and what requests in flight hold."""

    tenant: str
    budget: SpendBudget
    span: Span
    spent: float = 0.0
    """Charged in ``span`` (calendar windows)."""
    reserved: float = 0.0
    """Worst cases of the requests in flight (counted against whichever window is current)."""
    slots: dict[int, float] = field(default_factory=dict)
    """Rolling windows: charges by slot index (``now // slot length``)."""
    oldest: int = -(2**62)
    """Rolling windows: the oldest slot still in the window at the last :meth:`roll`."""
    total_spent: float = 0.0
    """Every charge since this process started (a Prometheus counter never goes down)."""
    refused: int = 0
    would_refuse: int = 0
    """Shadow budgets: requests a hard budget would have refused."""

    @property
    def key(self) -> str:
        return f"{self.tenant}/{self.budget.name}"

    def roll(self, now: float) -> None:
        """Move to the window containing ``now``: a calendar window resets what was spent (reservations
        in flight stay held); a rolling one drops the slots that left it."""
        b = self.budget
        if b.window == "rolling":
            assert b.rolling_seconds is not None
            oldest = math.floor(now / (b.rolling_seconds / ROLLING_SLOTS)) - ROLLING_SLOTS + 1
            if oldest != self.oldest:  # the window moved on by a slot (at most 60 times a window)
                self.oldest = oldest
                for k in [k for k in self.slots if k < oldest]:
                    del self.slots[k]
                self.spent = sum(self.slots.values())
                self.span = window(b, now)
        elif now >= self.span.end or now < self.span.start:
            self.span = window(b, now)
            self.spent = 0.0

    def charge(self, amount: float, now: float) -> None:
        self.roll(now)
        self.spent += amount
        self.total_spent += amount
        if self.budget.window == "rolling":
            assert self.budget.rolling_seconds is not None
            k = math.floor(now / (self.budget.rolling_seconds / ROLLING_SLOTS))
            self.slots[k] = self.slots.get(k, 0.0) + amount

    def left(self, now: float) -> float:
        """What a new reservation may still take (never below 0)."""
        self.roll(now)
        return max(0.0, self.budget.limit - self.spent - self.reserved)

    def frees_in(self, need: float, now: float) -> float:
        """Seconds until ``need`` fits once every reservation in flight is gone: the window's reset, or
        (rolling) when enough old slots have left it."""
        self.roll(now)
        b = self.budget
        if b.window != "rolling":
            return self.span.end - now
        assert b.rolling_seconds is not None
        slot_s = b.rolling_seconds / ROLLING_SLOTS
        excess = self.spent + need - b.limit
        for k in sorted(self.slots):
            excess -= self.slots[k]
            if excess <= 0:
                return (k + ROLLING_SLOTS) * slot_s - now
        return b.rolling_seconds


@dataclass(frozen=True, slots=True)
class Hold:
    """A request's reservation: (account, amount, price) for each budget it counts against."""

    ticket: str
    items: tuple[tuple[Account, float, Price], ...]
    priced: tuple[str, Price, float] | None = None
    """(``prices`` key, price, worst case in money) of its model: what the chargeback counters charge
    (None: unpriced)."""
    request: tuple[str, str | None, str | None, int, int] = ("", None, None, 0, 0)
    """(tenant, model, pool, prompt estimate, output cap): what the shared ledger reserves again."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A hard budget that cannot pay a request's worst case (the first such, in config order)."""

    account: Account
    need: float
    left: float
    retry_after: float
    """Seconds until the window resets (or, rolling, until enough spend leaves it); when only requests in
    flight hold the rest, the same figure — they may end up charging all of it."""
    message: str


def rates(b: SpendBudget, price: Price | None) -> Price | None:
    """What ``b`` charges a request at: its token weights, or the model's price (None: no price)."""
    return (b.weights or UNIT_WEIGHTS) if b.unit == "tokens" else price


def worst(b: SpendBudget, price: Price | None, prompt: int, output_cap: int) -> float | None:
    """A request's worst case on ``b`` (None: a currency budget and no price for the model)."""
    if b.unit == "tokens":
        return worst_cost(b.weights or UNIT_WEIGHTS, prompt, output_cap)
    return None if price is None else worst_cost(price, prompt, output_cap)


def refusal_message(b: SpendBudget, need: float, left: float, wait: float) -> str:
    """A ``tenant-budget`` 429's body: the budget, what the request may cost, what is left, and when it
    frees up — in words too, since a monthly budget's Retry-After is days."""
    unit = "" if b.unit == "currency" else " weighted tokens"
    when = "as spend leaves the rolling window" if b.window == "rolling" else f"when the {b.window} window resets"
    return (f"Spend budget {b.name!r} of this tenant is exhausted: this request may cost up to "
            f"{need:.6g}{unit} and {left:.6g}{unit} of the {b.limit:g}{unit} {b.window} budget is left. "
            f"It frees up {when}, in {human(wait)} (Retry-After: {math.ceil(wait)} s); lower max_tokens "
            "to reserve less.")


def unpriced_message(b: SpendBudget, model: str | None) -> str:
    return (f"No price is configured for model {model!r}, so budget {b.name!r} of this tenant cannot be "
            "checked; ask the operator to add it to `prices`.")


class BudgetBook:
    """Every tenant's spend budgets on one replica (see the module's docstring)."""

    def __init__(self, prices: Mapping[str, Price], budgets: Mapping[str, Sequence[SpendBudget]], now: float) -> None:
        self.prices: Mapping[str, Price] = {}
        self.accounts: dict[str, list[Account]] = {}
        self._holds: dict[str, Hold] = {}
        self.spent_by: dict[tuple[str, str], float] = {}
        """Money charged since start by (tenant, ``prices`` key): the chargeback counter."""
        self.reserved_by: dict[tuple[str, str], float] = {}
        """Money held by requests in flight, by (tenant, ``prices`` key)."""
        self.on_end: Callable[[str, Spent | None], None] | None = None
        """Told each hold's end, exactly once: (ticket, what it used; None: charged its reservation; a
        release is ``Spent(0, 0)``). The shell's shared ledger (``spendgate.py``) settles it in Redis."""
        self.on_shadow: Callable[[Account, float, float], None] | None = None
        """Told each request a shadow budget would have refused: (its account, the worst case, what was
        left). The core logs it (folded like its other refusals)."""
        self.configure(prices, budgets, now)

    def configure(self, prices: Mapping[str, Price], budgets: Mapping[str, Sequence[SpendBudget]], now: float) -> None:
        """New prices and budgets (a reload): an account whose tenant and budget name stay keeps its spend
        and reservations; holds in flight keep the account objects they reserved on."""
        old = {a.key: a for accs in self.accounts.values() for a in accs}
        self.prices = dict(prices)
        self.accounts = {}
        for tenant, bs in budgets.items():
            accs = []
            for b in bs:
                a = old.get(f"{tenant}/{b.name}")
                if a is None:
                    a = Account(tenant, b, window(b, now))
                else:
                    a.budget = b
                    a.span = window(b, now) if a.span.id != window(b, now).id else a.span
                accs.append(a)
            if accs:
                self.accounts[tenant] = accs

    def reserve(self, ticket: str, tenant: str, model: str | None, pool: str | None, prompt: int,
                output_cap: int, now: float) -> Refusal | Hold | None:
        """Reserve the worst case of a request on every budget of ``tenant`` it counts against.

        A :class:`Refusal` when a hard budget cannot pay it (nothing is taken); else its :class:`Hold`
        (None: no budget applies). Shadow budgets that could not pay count ``would_refuse`` and reserve
        all the same; soft ones never refuse."""
        accs = self.accounts.get(tenant)
        if not accs:
            return None
        key = price_key(self.prices, model, pool)
        price = None if key is None else self.prices[key]
        items: list[tuple[Account, float, Price]] = []
        for a in accs:
            b = a.budget
            if not applies(b, model, pool):
                continue
            need = worst(b, price, prompt, output_cap)
            if need is None:  # a currency budget and no price: fail closed where the budget is hard
                if b.mode == "hard":
                    a.refused += 1
                    return Refusal(a, math.inf, a.left(now), a.frees_in(0.0, now), unpriced_message(b, model))
                continue
            left = a.left(now)
            if need > left + 1e-12 and b.mode != "soft":
                if b.mode == "shadow":
                    a.would_refuse += 1
                    if self.on_shadow is not None:
                        self.on_shadow(a, need, left)
                else:
                    a.refused += 1
                    wait = a.frees_in(need, now)
                    return Refusal(a, need, left, wait, refusal_message(b, need, left, wait))
            items.append((a, need, rates(b, price) or UNIT_WEIGHTS))
        if not items:
            return None
        for a, need, _ in items:
            a.reserved += need
        money = None if key is None or price is None else (key, price, worst_cost(price, prompt, output_cap))
        hold = Hold(ticket, tuple(items), money, (tenant, model, pool, prompt, output_cap))
        if money is not None:
            k = (tenant, money[0])
            self.reserved_by[k] = self.reserved_by.get(k, 0.0) + money[2]
        self._holds[ticket] = hold
        return hold

    def settle(self, ticket: str, used: Spent | None, now: float) -> float | None:
        """Release a hold exactly once and charge its real cost (``used``; None: the whole reservation —
        a response without usage cannot be proved cheaper). Returns the first budget's charge, or None
        for a ticket with no hold (unknown or already released)."""
        hold = self._holds.pop(ticket, None)
        if hold is None:
            return None
        self._unhold(hold, used)
        if self.on_end is not None:
            self.on_end(ticket, used)
        first: float | None = None
        for a, need, price in hold.items:
            a.reserved = max(0.0, a.reserved - need)
            amount = need if used is None else cost(price, used)
            a.charge(amount, now)
            first = amount if first is None else first
        return first

    def release(self, ticket: str) -> bool:
        """A request that never went: its reservation goes back, nothing is charged. Exactly once."""
        hold = self._holds.pop(ticket, None)
        if hold is None:
            return False
        self._unhold(hold, Spent(0, 0))
        if self.on_end is not None:
            self.on_end(ticket, Spent(0, 0))
        for a, need, _ in hold.items:
            a.reserved = max(0.0, a.reserved - need)
        return True

    def _unhold(self, hold: Hold, used: Spent | None) -> None:
        """The chargeback counters: the hold's money leaves ``reserved_by``, its real cost (None: the
        reservation) joins ``spent_by``."""
        if hold.priced is None:
            return
        key, price, worst_case = hold.priced
        k = (hold.items[0][0].tenant, key)
        self.reserved_by[k] = max(0.0, self.reserved_by.get(k, 0.0) - worst_case)
        charge = worst_case if used is None else cost(price, used)
        self.spent_by[k] = self.spent_by.get(k, 0.0) + charge

    def hold(self, ticket: str) -> Hold | None:
        return self._holds.get(ticket)

    def holds(self) -> int:
        return len(self._holds)

    def remaining(self, tenant: str, now: float) -> list[tuple[Account, float]]:
        """Each budget of ``tenant`` and what is left of it (for the response header)."""
        return [(a, a.left(now)) for a in self.accounts.get(tenant, ())]
