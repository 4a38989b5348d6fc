"""Spend budgets shared by every replica: the ledger on Redis, exact and durable.

Exact: a reservation is one Lua script (``lua/spend_reserve.lua``) that checks ``spent + reserved + need
<= limit`` on every hard budget of the request and debits ``reserved`` in the same step; Redis runs one
script at a time, so replicas racing for the last dollar reserve at most the limit together — no lease
that could overshoot. Settling (``lua/spend_settle.lua``) takes the reservation back exactly once (the
ticket leaves the replica's holds hash in the same script) and charges the real cost to the window current
then, and to a per-day record (``day:YYYY-MM-DD``, field ``tenant|model``, in currency: what ``kvgate
spend`` reads; kept ``DAY_TTL_S``).

Durable: the store runs with an append-only file (``appendonly yes``, ``appendfsync everysec``): a crash
of Redis loses at most about one second of charges; a replica's crash loses nothing — its holds stay in
``holds:<replica>`` and, once its ``alive:<replica>`` key has expired, any replica's :meth:`reap` charges
them at their reservation (a request whose end nobody saw is never counted cheaper than it may have been).
Why Redis with AOF rather than PostgreSQL: ``docs/guides/budgets.md``.

The arithmetic (windows, prices, worst cases, messages) is ``budgets.py``'s; this is the I/O shell around it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from .budgets import ROLLING_SLOTS, applies, price_for, rates, refusal_message, unpriced_message, window, worst
from .prices import Price, SpendBudget, Spent, cost
from .store import LUA

ROLL = (LUA / "spend_roll.lua").read_text()
RESERVE = ROLL + (LUA / "spend_reserve.lua").read_text()
SETTLE = ROLL + (LUA / "spend_settle.lua").read_text()
SPEND_SCRIPTS = {"spend_reserve": RESERVE, "spend_settle": SETTLE}
PREFIX = "{kvgate}:spend:"
"""Where the ledger's keys live with the default ``store.redis.key_prefix`` (``kvgate``): in braces, as
``store.py``'s keys, so that a Redis Cluster keeps every key a script touches in one slot."""
DAY_TTL_S = 400 * 86400
"""The per-day record is kept a little over a year: chargeback for the last billing year."""
ALIVE_TTL_S = 30.0
"""A replica that has not said it is alive for this long is taken for dead: its holds are reaped."""


@dataclass(frozen=True, slots=True)
class Held:
    """A reservation in the store: the ticket, and (budget, rates) of each account it holds, in order."""

    ticket: str
    tenant: str
    model: str | None
    price: Price | None
    items: tuple[tuple[SpendBudget, Price], ...]
    left: tuple[float, ...] = ()
    """What was left of each budget fleet-wide once this reservation was made (the response header)."""


@dataclass(frozen=True, slots=True)
class Refused:
    budget: SpendBudget
    need: float
    left: float
    retry_after: float
    message: str


def day_of(now: float) -> str:
    """The UTC day of the per-day record."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")


class SpendStore:
    """One replica's handle on the shared ledger."""

    def __init__(self, client: aioredis.Redis, replica: str, prices: Mapping[str, Price],
                 budgets: Mapping[str, Sequence[SpendBudget]], key_prefix: str = "kvgate") -> None:
        self.prefix = "{" + key_prefix + "}:spend:"
        self.client = client
        self.replica = replica
        self.prices = prices
        self.budgets = budgets
        self._reserve = client.register_script(RESERVE)
        self._settle = client.register_script(SETTLE)

    def account(self, tenant: str, b: SpendBudget) -> str:
        return f"{self.prefix}acct:{tenant}/{b.name}"

    def holds(self, replica: str | None = None) -> str:
        return f"{self.prefix}holds:{replica or self.replica}"

    @staticmethod
    def _slots(b: SpendBudget, now: float) -> tuple[str, int, int]:
        """(window id, oldest live slot or -1, this slot) of ``b`` at ``now``."""
        if b.window != "rolling":
            return window(b, now).id, -1, 0
        assert b.rolling_seconds is not None
        slot = math.floor(now / (b.rolling_seconds / ROLLING_SLOTS))
        return "rolling", slot - ROLLING_SLOTS + 1, slot

    async def alive(self) -> None:
        """Say this replica is alive (every sync): its holds are not reaped while it is."""
        await self.client.set(f"{self.prefix}alive:{self.replica}", "1", px=int(ALIVE_TTL_S * 1000))

    async def reserve(self, ticket: str, tenant: str, model: str | None, pool: str | None, prompt: int,
                      output_cap: int, now: float) -> Held | Refused | None:
        """Reserve the request's worst case on every budget of ``tenant`` it counts against, atomically
        across replicas; :class:`Refused` names the first hard budget that cannot pay (None: no budget)."""
        price = price_for(self.prices, model, pool)
        items: list[tuple[SpendBudget, Price]] = []
        keys: list[str] = []
        args: list[Any] = [ticket]
        for b in self.budgets.get(tenant, ()):
            if not applies(b, model, pool):
                continue
            need = worst(b, price, prompt, output_cap)
            r = rates(b, price)
            if need is None or r is None:
                if b.mode == "hard":
                    return Refused(b, math.inf, 0.0, window(b, now).end - now, unpriced_message(b, model))
                continue
            win, oldest, _ = self._slots(b, now)
            keys.append(self.account(tenant, b))
            args += [win, oldest, repr(b.limit), repr(need), b.mode]
            items.append((b, r))
        if not items:
            return None
        got = await self._reserve(keys=[*keys, self.holds()], args=args)
        if int(got[0]) == 1:
            remaining = tuple(float(x) for x in _text(got[2]).split(",") if x) if len(got) > 2 else ()
            return Held(ticket, tenant, model, price, tuple(items), remaining)
        b = items[int(got[1]) - 1][0]
        spent, reserved = float(got[2]), float(got[3])
        need = float(args[1 + (int(got[1]) - 1) * 5 + 3])
        left = max(0.0, b.limit - spent - reserved)
        wait = window(b, now).end - now if b.window != "rolling" else float(b.rolling_seconds or 0)
        return Refused(b, need, left, wait, refusal_message(b, need, left, wait))

    async def settle(self, held: Held, used: Spent | None, now: float, replica: str | None = None) -> bool:
        """Charge the real cost (None: the whole reservation) and release the hold, exactly once; False
        when the ticket is no longer held. ``replica``: whose holds it is in (a reap)."""
        keys: list[str] = [self.holds(replica)]
        args: list[Any] = [held.ticket]
        for b, r in held.items:
            win, oldest, slot = self._slots(b, now)
            charge = cost(r, used) if used is not None else None
            keys.append(self.account(held.tenant, b))
            args += [win, oldest, slot, "held" if charge is None else repr(charge)]
        day = 0.0
        if held.price is not None and used is not None:
            day = cost(held.price, used)
        keys.append(f"{self.prefix}day:{day_of(now)}")
        args += [f"{held.tenant}|{held.model or ''}" if day > 0 else "", repr(day)]
        done = int(await self._settle(keys=keys, args=args)) == 1
        if done and day > 0:
            await self.client.expire(keys[-1], DAY_TTL_S)
        return done

    async def release(self, held: Held, now: float) -> bool:
        """A request that never went: its reservation goes back, nothing is charged."""
        return await self.settle(held, Spent(0, 0), now)

    async def state(self, tenant: str, b: SpendBudget, now: float) -> tuple[float, float]:
        """(spent in the current window, reserved) of one budget, as the store has it."""
        h = {_text(k): _text(v) for k, v in (await self.client.hgetall(self.account(tenant, b))).items()}
        win, oldest, _ = self._slots(b, now)
        if oldest < 0:
            spent = float(h.get("spent", 0)) if h.get("w") == win else 0.0
        else:
            spent = sum(float(v) for k, v in h.items() if k.startswith("s:") and int(k[2:]) >= oldest)
        return spent, float(h.get("reserved", 0))

    async def reap(self, now: float) -> int:
        """Charge the holds of replicas taken for dead at their reservation: nothing a dead replica
        admitted is lost. Returns how many holds were charged."""
        n = 0
        async for key in self.client.scan_iter(match=f"{self.prefix}holds:*"):
            replica = _text(key).rsplit(":", 1)[1]
            if replica == self.replica or await self.client.exists(f"{self.prefix}alive:{replica}"):
                continue
            for ticket, payload in (await self.client.hgetall(key)).items():
                held = self._parse(_text(ticket), _text(payload))
                if held is not None and await self.settle(held, None, now, replica):
                    n += 1
        return n

    def _parse(self, ticket: str, payload: str) -> Held | None:
        """A hold as another replica wrote it (``acct:tenant/budget=amount,...``): its budgets from config."""
        items: list[tuple[SpendBudget, Price]] = []
        tenant = ""
        for pair in payload.split(","):
            key = pair.split("=", 1)[0]
            tenant, name = key[len(self.prefix) + len("acct:"):].split("/", 1)
            b = next((x for x in self.budgets.get(tenant, ()) if x.name == name), None)
            if b is None:
                continue  # a budget removed since: its reservation is dropped with it
            items.append((b, rates(b, None) or Price(prompt=0, completion=0)))
        return Held(ticket, tenant, None, None, tuple(items)) if items else None


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v

