"""The shell between the decision and the shared spend ledger (``store.redis`` set, tenants with budgets).

The core decides on its own replica's ledger (``budgets.BudgetBook``: what this replica saw). Before an
admitted answer goes back to Envoy, :meth:`SpendGate.gate` reserves the same worst case in Redis
(``spendstore.py``, one script that checks and debits every hard budget fleet-wide): the store refusing
turns the admission into ``429 tenant-budget`` (the lease is released as never sent), so a hard budget
holds across replicas. The store not answering in ``timeout_ms`` is ``503 quota-unavailable``: a hard
budget nobody could check is not admitted (contract limits stay hard). The end of every hold the core
releases (``BudgetBook.on_end``: completion, refund, reclaim — exactly once) is settled in Redis in the
background; a settle that fails is retried at the next :meth:`run` round, so charges are not dropped while
the store is briefly away (kvgate itself crashing meanwhile: those holds are charged at their reservation
by :meth:`SpendStore.reap` on another replica).

Costs one round trip per admitted request of a tenant with budgets; none for the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from . import logs
from .prices import Spent
from .reasons import BudgetView, Rejection, reject
from .spendstore import ALIVE_TTL_S, Held, Refused, SpendStore
from .wire import reject_reply

if TYPE_CHECKING:
    from .core import Answer, Core

log = logs.get("kvgate.spend")
ENDED_KEEP_S = 60.0
MAX_UNSETTLED = 1_000_000
"""Ended holds kept for the store while it is away (~200 bytes each). Past it the oldest are given up:
their reservation stays held in the store (never charged less than it may have cost) until this replica
is gone and another reaps it — a store away this long is an outage to alert on."""


class SpendGate:
    def __init__(self, store: SpendStore, core: Core, timeout_s: float) -> None:
        self.store = store
        self.core = core
        self.timeout_s = timeout_s
        self.held: dict[str, Held] = {}
        self.ended: dict[str, tuple[Spent | None, float]] = {}
        """Holds that ended before their reservation in Redis was made (what they used, when): the gate
        settles them as soon as it is; forgotten after ``ENDED_KEEP_S`` (a hold never gated: a queued
        request refused, a shadow admission)."""
        self._retry: deque[tuple[Held, Spent | None, float]] = deque()
        core.admission.spend.on_end = self._on_end

    def configure(self, core: Core) -> None:
        """A reload: the store prices and checks with the new config."""
        cfg = core.config
        self.store.prices = cfg.prices
        self.store.budgets = {t.name: t.budgets for t in cfg.tenants if t.budgets}

    async def gate(self, answer: Answer) -> Answer:
        """The admitted ``answer`` as it may go to Envoy: unchanged, or a refusal when the fleet's budget
        (not only this replica's view of it) cannot pay the request's worst case."""
        lease = answer.decision.lease
        # a best-effort lease takes no quota but pays spend budgets (contracts) like any admission: not
        # gated here, each replica admitted it on its own view and the fleet's budget was exceeded
        if answer.reply is not None or lease is None or not (lease.charged or lease.best_effort):
            return answer
        hold = self.core.admission.spend.hold(lease.ticket)
        if hold is None:
            return answer  # no budget applies
        tenant, model, pool, prompt, cap = hold.request
        now = time.time()
        try:
            async with asyncio.timeout(self.timeout_s):
                got = await self.store.reserve(lease.ticket, tenant, model, pool, prompt, cap, now)
        except (TimeoutError, RedisError, OSError) as e:
            log.warning("spend_store_unreachable", error=str(e) or type(e).__name__, tenant=tenant)
            r = reject("quota-unavailable", "This gateway could not check the tenant's spend budget with its shared "
                       "store; the tenant may be within its budget. Retry after the indicated time.", 1.0)
            return self._refuse(answer, r)
        if isinstance(got, Refused):
            b = got.budget
            r = replace(reject("tenant-budget", got.message, got.retry_after),
                        budget=BudgetView(b.name, b.limit, got.left, got.retry_after))
            return self._refuse(answer, r)
        if got is None:
            return answer
        if got.left and "budget_remaining" in answer.metadata:  # the fleet's figure, not this replica's view
            answer.metadata["budget_remaining"] = ", ".join(
                f"{b.name}={max(0.0, x):.6g}" for (b, _), x in zip(got.items, got.left, strict=False))
        if lease.ticket in self.ended:  # (ended while the reservation was on its way: settle it now)
            self._retry.append((got, self.ended.pop(lease.ticket)[0], now))
        else:
            self.held[lease.ticket] = got
        return answer

    def _refuse(self, answer: Answer, r: Rejection) -> Answer:
        from .core import Answer, Ended

        lease = answer.decision.lease
        assert lease is not None
        self.held.pop(lease.ticket, None)
        # released as a request that never went: nothing charged, its slot and node booking back
        self.core.ended(Ended(lease.ticket, answer.request_id, r.status, None, upstream_answered=False))
        self.ended.pop(lease.ticket, None)
        d = replace(answer.decision, lease=None, rejection=r)
        return Answer(answer.request_id, d, reject_reply(r), pool=answer.pool)

    def _on_end(self, ticket: str, used: Spent | None) -> None:
        held = self.held.pop(ticket, None)
        if held is None:
            self.ended[ticket] = (used, time.time())
            return
        if len(self._retry) >= MAX_UNSETTLED:
            dropped = self._retry.popleft()
            log.error("spend_unsettled_dropped", ticket=dropped[0].ticket, note="the store has been away too long")
        self._retry.append((held, used, time.time()))

    async def flush(self) -> None:
        """Settle every ended hold in Redis; what fails stays for the next round."""
        todo, self._retry = self._retry, deque()
        for held, used, when in todo:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self.store.settle(held, used, when)
            except (TimeoutError, RedisError, OSError):
                self._retry.append((held, used, when))
        horizon = time.time() - ENDED_KEEP_S
        self.ended = {t: v for t, v in self.ended.items() if v[1] >= horizon}

    async def run(self) -> None:
        """Background: settle ended holds, say this replica is alive, reap dead replicas' holds."""
        while True:
            await self.flush()
            try:
                await self.store.alive()
                await self.store.reap(time.time())
            except (RedisError, OSError) as e:
                log.warning("spend_store_sync_failed", error=str(e) or type(e).__name__)
            await asyncio.sleep(min(0.1, ALIVE_TTL_S / 10))
