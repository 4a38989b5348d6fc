"""Several replicas on one real ``redis-server``: slices, borrowing, completions anywhere, faults.

Each replica here is a real gateway core with its real store link (``ext_proc/store.py``), driven in
one process so that the test can count what every replica holds at every step; the end-to-end test
through Envoy is ``test_replicas_e2e.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from ext_proc.config import parse_config
from ext_proc.core import Answer, Borrow, Core, Ended, Held, Request
from ext_proc.identity import hash_key
from ext_proc.share import fair_slots
from ext_proc.store import SLOTS, SharedStore

from .redis_server import RedisServer

KEY = "sk-store-a"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":40}'
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    r = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield r
    finally:
        r.stop()


def config(url: str, **tenant: Any) -> Any:
    store = {"url": url, "key_prefix": f"t{next(_prefixes)}", "lease_ttl_seconds": 1.0, "timeout_ms": 200,
             "fallback_after_seconds": 0.2}
    return parse_config({"store": {"redis": store},
                         "tenants": [{"name": "a", "api_key_sha256": [hash_key(KEY)], **tenant}]})


class Replica:
    def __init__(self, cfg: Any) -> None:
        self.core = Core(cfg, time.monotonic)
        self.store = SharedStore(cfg.store.redis, self.core, CollectorRegistry())
        self.admitted: list[str] = []
        self.alive = True

    @property
    def tenant(self) -> Any:
        return self.core.admission.tenant_state("a")

    async def ask(self, rid: str) -> Answer | Held:
        out = self.core.decide(Request("/v1/chat/completions", rid, f"Bearer {KEY}", BODY))
        if isinstance(out, Borrow):
            await self.store.borrow(out.tenant, float(out.request.estimate.total if out.request.estimate else 0))
            out = self.core.decide(out.request, borrowed=True)
        assert not isinstance(out, Borrow)
        if isinstance(out, Answer) and out.decision.admitted and out.ticket:
            self.admitted.append(out.ticket)
        return out


async def sync_all(replicas: list[Replica], rounds: int = 1) -> None:
    for _ in range(rounds):
        for r in replicas:
            if r.alive:
                await r.store.sync()


def inflight(replicas: list[Replica]) -> int:
    return sum(r.tenant.inflight for r in replicas if r.alive)


def test_concurrency_is_exact_across_replicas_and_a_completion_may_reach_any_replica(server: RedisServer) -> None:
    async def run() -> None:
        cfg = config(server.url, max_concurrent=4)
        reps = [Replica(cfg) for _ in range(3)]
        await sync_all(reps, 2)
        answers = []
        for i in range(30):
            answers.append(await reps[i % 3].ask(f"r{i}"))
            assert inflight(reps) <= 4
        admitted = [a for a in answers if isinstance(a, Answer) and a.decision.admitted]
        refused = [a for a in answers if isinstance(a, Answer) and a.reply is not None]
        assert len(admitted) == 4, "the tenant reaches its whole cap though spread over three replicas"
        assert all(a.decision.rejection is not None and a.decision.rejection.reason == "tenant-concurrency"
                   and a.decision.rejection.retry_after for a in refused)
        assert sum(r.tenant.slots or 0 for r in reps) <= 4
        # the access log of a request owned by replica 0 reaches replica 2: forwarded, released once
        owner = next(r for r in reps if r.admitted)
        ticket = owner.admitted[0]
        other = reps[(reps.index(owner) + 2) % 3]
        assert not other.core.owns(ticket)
        other.store.forward(Ended(ticket, "x", 200, None, upstream_answered=True))
        other.store.forward(Ended(ticket, "x", 200, None, upstream_answered=True))  # a duplicate
        await other.store.sync()
        before = owner.tenant.inflight
        await owner.store.sync()
        assert owner.tenant.inflight == before - 1
        assert owner.core.admission.open_leases == before - 1
        # the freed slot can be used from any replica (after the owner gives back what it does not use)
        await sync_all(reps, 3)
        got = [await reps[i % 3].ask(f"s{i}") for i in range(3)]
        assert sum(1 for a in got if isinstance(a, Answer) and a.decision.admitted) == 1
        assert inflight(reps) == 4
        for r in reps:
            await r.store.close()

    asyncio.run(run())


def test_token_budget_holds_across_replicas(server: RedisServer) -> None:
    async def run() -> None:
        cfg = config(server.url, tokens_per_minute=60, token_burst=600)  # ~no refill during the test
        reps = [Replica(cfg) for _ in range(3)]
        await sync_all(reps, 2)
        spent = 0
        for i in range(60):
            a = await reps[i % 3].ask(f"r{i}")
            if isinstance(a, Answer) and a.decision.admitted:
                spent += a.decision.lease.reserved_tokens if a.decision.lease else 0
            if i % 5 == 0:
                await sync_all(reps)
        reservation = 55
        assert 600 - 3 * reservation <= spent <= 600 + 1, f"spent {spent} of a 600-token bucket"
        for r in reps:
            await r.store.close()

    asyncio.run(run())


def test_a_dead_replicas_slots_return_within_the_lease_ttl(server: RedisServer) -> None:
    async def run() -> None:
        cfg = config(server.url, max_concurrent=2)
        a, b = Replica(cfg), Replica(cfg)
        await sync_all([a, b], 2)
        assert isinstance(await a.ask("1"), Answer) and isinstance(await a.ask("2"), Answer)
        assert a.tenant.inflight == 2
        refused = await b.ask("3")
        assert isinstance(refused, Answer) and refused.reply is not None
        a.alive = False  # killed: no more heartbeats, nothing given back
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b.tenant.fleet_free == 0:
            await b.store.sync()
            await asyncio.sleep(0.1)
        assert b.tenant.fleet_free == 2, "the dead replica's slots went back"
        ok = await b.ask("4")
        assert isinstance(ok, Answer) and ok.decision.admitted
        await b.store.close()

    asyncio.run(run())


def test_redis_down_falls_back_to_a_safe_local_split_and_rejoins_without_double_counting(
        tmp_path: Path) -> None:
    srv = RedisServer(tmp_path).start()

    async def run() -> None:
        cfg = config(srv.url, max_concurrent=4)
        reps = [Replica(cfg) for _ in range(3)]
        await sync_all(reps, 2)
        for i in range(3):
            await reps[0].ask(f"a{i}")  # replica 0 holds 3 in flight
        assert inflight(reps) == 3
        await sync_all(reps, 2)
        srv.stop(kill=True)
        await sync_all(reps)
        assert all(r.store.up_gauge._value.get() == 0 for r in reps)
        await asyncio.sleep(0.25)
        await sync_all(reps)
        assert all(r.core.admission.local_split == 3 for r in reps), "each replica enforces its split"
        for i in range(12):
            await reps[i % 3].ask(f"b{i}")
            assert inflight(reps) <= 4, "the split keeps the total within the cap while replica 0 drains"
        srv.start()  # back, empty
        await sync_all(reps, 2)
        assert all(r.core.admission.local_split == 0 and r.store.ok for r in reps)
        for i in range(12):
            await reps[i % 3].ask(f"c{i}")
            assert inflight(reps) <= 4
            await sync_all(reps)
        held = sum(r.tenant.slots or 0 for r in reps)
        assert held <= max(4, inflight(reps))
        for r in reps:
            await r.store.close()

    try:
        asyncio.run(run())
    finally:
        srv.stop()


def test_redis_restarted_empty_rebuilds_from_what_replicas_hold_with_no_burst(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path).start()

    async def run() -> None:
        cfg = config(srv.url, max_concurrent=4, tokens_per_minute=6, token_burst=300)  # ~no refill here
        reps = [Replica(cfg) for _ in range(2)]
        await sync_all(reps, 2)
        tokens = 0
        for i in range(4):
            a = await reps[i % 2].ask(f"a{i}")
            tokens += a.decision.lease.reserved_tokens if isinstance(a, Answer) and a.decision.lease else 0
        assert inflight(reps) == 4
        srv.stop()
        srv.start()  # empty, before any replica noticed
        await sync_all(reps, 3)
        assert all(r.store.ok for r in reps)
        assert reps[0].store.epoch == reps[1].store.epoch
        assert all(r.store.learning for r in reps), "a restarted, empty store relearns first"
        for i in range(8):
            await reps[i % 2].ask(f"b{i}")
            assert inflight(reps) <= 4, "what each replica holds was rebuilt: no slot given twice"
        # the requests end; slots free up; the token bucket came back empty, not full
        for r in reps:
            for t in list(r.admitted):
                r.core.ended(Ended(t, "", 200, None, upstream_answered=True))
            r.admitted.clear()
        await asyncio.sleep(1.1)  # the learning period ends
        await sync_all(reps, 3)
        for i in range(20):
            r = reps[i % 2]
            a = await r.ask(f"c{i}")
            if isinstance(a, Answer) and a.decision.lease is not None and a.ticket:
                tokens += a.decision.lease.reserved_tokens
                r.core.ended(Ended(a.ticket, "", 200, None, upstream_answered=True))  # done: its slot is free
            await sync_all(reps)
        assert tokens <= 300 + 2 * 47, f"{tokens} tokens admitted from a 300-token bucket (no burst on restart)"
        for r in reps:
            await r.store.close()

    try:
        asyncio.run(run())
    finally:
        srv.stop()


# -- the allocator in Redis matches the one in Python ------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(0, 20), wants=st.lists(st.integers(0, 12), min_size=1, max_size=5))
def test_the_slots_script_converges_to_max_min_fair_shares(server: RedisServer, cap: int, wants: list[int]) -> None:
    r = redis.Redis.from_url(server.url)
    script = r.register_script(SLOTS)
    p = f"{{p{next(_prefixes)}}}"
    names = [f"r{i}" for i in range(len(wants))]
    now_ms = int(time.time() * 1000)
    r.zadd(f"{p}:replicas", {n: now_ms + 60_000 for n in names})
    held = dict.fromkeys(names, 0)
    for _ in range(4):  # a few syncs: those above their share give back, the others take what was freed
        for n, w in zip(names, wants, strict=True):
            out = script(keys=[f"{p}:replicas", f"{p}:c:a", f"{p}:learning", f"{p}:over"],
                         args=[n, cap, held[n], 0, w, 60_000, 0, "a"])
            held[n] = int(out[0])
            assert sum(held.values()) <= cap, "grants never exceed the capacity"
            assert held[n] <= w
    assert held == fair_slots(dict(zip(names, wants, strict=True)), cap)
    r.close()
