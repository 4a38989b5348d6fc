"""Best effort (issue 30 §1): a tenant over a protective limit is served when the fleet has room nobody
within quota needs — holding a fleet slot and no quota, at the lowest tier's priority, never scaling
demand — and refused (429) otherwise, or when the limit is one it may not exceed."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import generate_latest

from ext_proc.admission import Usage
from ext_proc.config import ConfigError, parse_config
from ext_proc.core import Answer, Core, Ended, Held, Request, null_logger
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from gpu_probe.snapshot import Snapshot
from scaler.signals import parse_kvgate
from tests.helpers import FakeClock

NODE = "10.0.0.1:8000"
A_NODE, B_NODE = "10.1.0.1:8000", "10.2.0.1:8000"
"""``two_pools``' nodes: pool a's, pool b's."""


def make(over_limit: Any = "best-effort", *, enabled: bool = True, tenant: dict[str, Any] | None = None,
         extra: dict[str, Any] | None = None) -> tuple[Core, FakeClock]:
    clock = FakeClock()
    t = {"name": "b", "tier": "batch", "api_key_sha256": [hash_key("kb")], "max_concurrent": 1,
         "over_limit": over_limit, **(tenant or {})}
    cfg = parse_config({
        "nodes": {"static": [{"address": NODE, "probe": "http://p"}], "performance": {"profile": "34b-a100"}},
        "queue": {"inject_priority": True},
        "best_effort": {"enabled": enabled},
        "tenants": [t, {"name": "i", "tier": "interactive", "api_key_sha256": [hash_key("ki")]}],
        **(extra or {})})
    core = Core(cfg, clock, random.Random(1), log=null_logger())
    idle(core, clock, 0.0)
    return core, clock


def idle(core: Core, clock: FakeClock, kv: float, waiting: int = 0, node: str = NODE) -> None:
    core.snapshot(node, Snapshot(node="n", at=clock(), ok=True, kv_usage=kv, blocks_total=2537, block_size=16,
                                 running=0, waiting=waiting))


def ask(core: Core, rid: str, key: str = "kb", prompt: int = 100, out: int = 10) -> Answer | Held:
    a = core.decide(Request("/v1/chat/completions", rid, f"Bearer {key}", estimate=Estimate(prompt, out, True),
                            body_bytes=prompt * 4))
    assert isinstance(a, (Answer, Held)), a
    return a


def answer(a: Any) -> Answer:
    assert isinstance(a, Answer), a
    return a


def test_over_its_concurrency_cap_a_tenant_is_served_from_spare_room_holding_no_quota() -> None:
    core, _ = make()
    first = answer(ask(core, "r1"))
    assert first.decision.admitted and first.decision.best_effort is None
    b = core.admission.tenant_state("b")
    assert b is not None and b.inflight == 1
    second = answer(ask(core, "r2"))
    d = second.decision
    assert d.admitted and d.rejection is None
    assert d.best_effort is not None and d.best_effort.reason == "tenant-concurrency"
    assert d.lease is not None and d.lease.best_effort and not d.lease.charged and d.lease.node == NODE
    assert second.metadata["best_effort"] is True
    assert b.inflight == 1, "best effort takes none of its tenant's slots"
    assert core.admission.inflight == 2, "but it holds a fleet slot"
    text = generate_latest(core.stats.registry).decode()
    assert ('kvgate_best_effort_admissions_total{limit="concurrency",pool="default",tenant="b",tier="batch"} 1.0'
            in text)
    assert ('kvgate_requests_total{class="none",decision="best-effort",pool="default",reason="tenant-concurrency",'
            'tenant="b",tier="batch"} 1.0') in text
    # it ends exactly once, and gives back its fleet slot only
    assert core.ended(Ended(d.lease.ticket, "r2", 200, Usage(100, 10), upstream_answered=True)) is not None
    assert core.ended(Ended(d.lease.ticket, "r2", 200, Usage(100, 10), upstream_answered=True)) is None
    assert core.admission.inflight == 1 and b.inflight == 1


def test_best_effort_is_never_scaling_demand() -> None:
    """The scaler reads kvgate_requests_total by decision and class: a best-effort admission is neither
    an admission (demand) nor a 429 (the spread rule would count it)."""
    core, _ = make()
    answer(ask(core, "r1"))
    assert answer(ask(core, "r2")).decision.best_effort is not None
    reading = parse_kvgate(generate_latest(core.stats.registry).decode())
    assert reading.totals.get(("admitted", "b")) == 1.0
    assert ("policy", "b") not in reading.totals


def test_best_effort_runs_at_the_lowest_tiers_vllm_priority() -> None:
    core, _ = make(tenant={"tier": "interactive"})
    answer(ask(core, "r1"))
    lease = answer(ask(core, "r2")).decision.lease
    assert lease is not None and lease.best_effort
    assert lease.tier == "interactive", "its SLO is still accounted to its tier"
    assert core.admission.runs_as(lease) == "batch"
    doc: dict[str, Any] = {"model": "m", "messages": []}
    body, _ = core._rewrite(Estimate(10, 10, True, document=doc), core.admission.runs_as(lease))
    assert body is not None and b'"priority":2' in body


@pytest.mark.parametrize("over_limit", [None, "refuse", {"tokens": "best-effort"}, {"concurrency": "refuse"}])
def test_a_limit_the_tenant_may_not_exceed_refuses(over_limit: Any) -> None:
    core, _ = make(over_limit)
    answer(ask(core, "r1"))
    r = answer(ask(core, "r2")).decision.rejection
    assert r is not None and (r.status, r.reason) == (429, "tenant-concurrency")


def test_the_switch_turns_best_effort_off_everywhere() -> None:
    core, _ = make(enabled=False)
    answer(ask(core, "r1"))
    r = answer(ask(core, "r2")).decision.rejection
    assert r is not None and r.status == 429


def test_the_default_is_a_per_config_word() -> None:
    core, _ = make(None, extra={"best_effort": {"default": "best-effort"}})
    answer(ask(core, "r1"))
    assert answer(ask(core, "r2")).decision.best_effort is not None


def test_over_a_hard_budget_too_it_is_refused() -> None:
    """Over its concurrency cap (may be exceeded) and its token budget (may not): the 429 stands."""
    core, _ = make({"concurrency": "best-effort"}, tenant={"tokens_per_minute": 150})
    answer(ask(core, "r1"))  # 110 of its 150 tokens
    r = answer(ask(core, "r2")).decision.rejection
    assert r is not None and r.status == 429
    # the same over its token budget only, when tokens may be exceeded: best effort, nothing taken
    core, _ = make("best-effort", tenant={"tokens_per_minute": 150, "max_concurrent": None})
    answer(ask(core, "r1"))
    b = core.admission.tenant_state("b")
    assert b is not None and b.tokens is not None
    before = b.tokens.available(0.0)
    d = answer(ask(core, "r2")).decision
    assert d.best_effort is not None and d.best_effort.reason == "tenant-tokens"
    assert b.tokens.available(0.0) == before, "a best-effort admission debits no bucket"


def test_no_room_waits_for_it_then_429() -> None:
    """A node too full for the lowest tier (its KV reserve): the tenant over its cap waits behind the
    queue for room, up to the lowest tier's hold, and gets its 429 when none comes."""
    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)  # under the admit threshold (0.92), above it minus batch's 10% reserve
    held = ask(core, "r2")
    assert isinstance(held, Held)
    b = core.admission.tenant_state("b")
    assert b is not None and b.inflight == 1, "waiting, it takes none of its tenant's slots"
    assert core.admission.inflight == 1, "nor a fleet slot"
    clock.advance(1.0)
    idle(core, clock, 0.88)
    assert core.answers() == [], "still within its hold: it waits"
    clock.advance(30.0)
    core.tick()
    [a] = core.answers()
    r = a.decision.rejection
    assert a.held == held.ticket and r is not None and (r.status, r.reason) == (429, "tenant-concurrency")
    assert core.admission.queued == 0 and core.admission.inflight == 1
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_queue_rejections_total{' not in text, "a 429 is the tenant's excess, not the queue's 503"
    assert ('kvgate_requests_total{class="policy",decision="reject",pool="default",reason="tenant-concurrency",'
            'tenant="b",tier="batch"} 1.0') in text


def test_room_that_comes_within_the_hold_serves_a_waiting_best_effort_request() -> None:
    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    held = ask(core, "r2")
    assert isinstance(held, Held)
    clock.advance(0.5)
    idle(core, clock, 0.2)  # room for the lowest tier
    [a] = core.answers()
    d = a.decision
    assert a.held == held.ticket and d.admitted and d.best_effort is not None
    assert d.best_effort.reason == "tenant-concurrency"
    assert d.lease is not None and d.lease.best_effort and not d.lease.charged and d.lease.node == NODE
    assert a.metadata["best_effort"] is True
    b = core.admission.tenant_state("b")
    assert b is not None and b.inflight == 1 and core.admission.inflight == 2
    assert d.waited == pytest.approx(0.5)
    reading = parse_kvgate(generate_latest(core.stats.registry).decode())
    assert ("policy", "b") not in reading.totals, "never scaling demand, waited or not"
    assert core.ended(Ended(d.lease.ticket, "r2", 200, Usage(100, 10), upstream_answered=True)) is not None
    assert core.ended(Ended(d.lease.ticket, "r2", 200, Usage(100, 10), upstream_answered=True)) is None
    assert core.admission.inflight == 1 and b.inflight == 1


def test_nobody_within_quota_waits_behind_best_effort() -> None:
    """A request within quota waiting in the gateway queue: best effort waits behind it, and goes only
    once nothing within quota waits — never ahead of it."""
    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.95)  # full: the interactive request within quota waits
    w = ask(core, "w", key="ki")
    assert isinstance(w, Held)
    idle(core, clock, 0.95)
    be = ask(core, "r2")
    assert isinstance(be, Held), "over its cap with a request within quota waiting: it waits behind it"
    assert core.admission.queued == 2
    clock.advance(0.05)
    idle(core, clock, 0.2)
    first, second = core.answers()
    assert first.held == w.ticket and first.decision.admitted, "the request within quota goes first"
    assert second.held == be.ticket and second.decision.best_effort is not None, "then, with the queue empty"


def test_best_effort_waits_while_the_pool_refuses_requests_within_quota_for_room() -> None:
    """A request within quota refused for capacity (a 503) never waits in the queue: an empty queue right
    after it does not mean nobody within quota needs the room. Best effort stays off the pool for
    ``ROOM_QUIET_S`` after such a refusal."""
    from ext_proc.admission import ROOM_QUIET_S

    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.95)
    w = ask(core, "w", key="ki")
    assert isinstance(w, Held)
    clock.advance(60.0)
    core.tick()
    [refused] = core.answers()
    assert refused.decision.rejection is not None and refused.decision.rejection.status == 503
    idle(core, clock, 0.2)  # room again, the queue empty
    held = ask(core, "r2")
    assert isinstance(held, Held), "within ROOM_QUIET_S of a 503 within quota: it waits"
    clock.advance(ROOM_QUIET_S / 2)
    idle(core, clock, 0.2)
    assert core.answers() == []
    clock.advance(ROOM_QUIET_S / 2)
    idle(core, clock, 0.2)
    [a] = core.answers()
    assert a.held == held.ticket and a.decision.best_effort is not None and a.decision.admitted


def test_envoy_waits_for_a_waiting_best_effort_request_as_long_as_kvgate_holds_it() -> None:
    """attack98 F1: an interactive tenant over its cap waits up to the *lowest* tier's hold (~5 s), but its
    Held said its own tier's max wait (1 s): Envoy gave up first, with its own error. The Held carries
    the hold the request really has."""
    core, clock = make(tenant={"tier": "interactive"})
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    held = ask(core, "r2")
    assert isinstance(held, Held)
    deadline = core.admission.spare_deadline(held.ticket)
    assert deadline is not None and held.max_wait_s == pytest.approx(deadline - clock())
    assert held.max_wait_s > core.config.tiers["interactive"].max_queue_wait_ms / 1000.0
    clock.advance(held.max_wait_s - 0.01)
    core.tick()
    assert core.answers() == [], "still waiting within what Envoy was told"
    clock.advance(0.02)
    core.tick()
    [a] = core.answers()
    assert a.decision.rejection is not None and a.decision.rejection.status == 429, "answered by then"
    assert a.reply is not None and ("retry-after", "1") in a.reply.headers, "Retry-After less what it waited"


def test_a_503_within_quota_keeps_best_effort_off_the_room_in_the_same_pump() -> None:
    """review99 M1: a request within quota timed out of the queue and the room it waited for went to best
    effort in the same pump (the refusal was booked only after the pump)."""
    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.95)
    w = ask(core, "w", key="ki")
    be = ask(core, "r2")
    assert isinstance(w, Held) and isinstance(be, Held)
    clock.advance(1.001)  # past the interactive request's hold (its 1 s max wait)
    idle(core, clock, 0.2)  # room, in the pump that times it out
    answers = core.answers()
    assert [(a.held, a.decision.rejection and a.decision.rejection.status) for a in answers] == [(w.ticket, 503)]
    assert core.admission.queued == 1, "best effort still waits"


def test_waiting_best_effort_goes_oldest_first_when_pumps_are_put_off() -> None:
    """review99 M2: with the live server's put-off pumps, a new over-limit request took the room before the
    pump that would have sent the older one. While any wait, a new one waits behind them."""
    core, clock = make()
    later: list[Any] = []
    core.pump_once_per_turn(later.append)
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    old = ask(core, "old")
    assert isinstance(old, Held)
    clock.advance(0.1)
    idle(core, clock, 0.2)  # room: the pump is put off to the end of the turn
    new = ask(core, "new")
    assert isinstance(new, Held), "not placed ahead of the one already waiting"
    while later:
        later.pop(0)()
    first = core.answers()[0]
    assert first.held == old.ticket and first.decision.best_effort is not None


@pytest.mark.parametrize(("change", "label"), [
    ({"best_effort": {"enabled": False}}, "the switch off"),
    ({"tenant": {"over_limit": "refuse"}}, "the tenant's over_limit: refuse"),
    ({"queue": {"enabled": False}}, "the queue off"),
    ({"drop_tenant": True}, "the tenant removed"),
])
def test_a_reload_that_takes_best_effort_away_answers_those_waiting_with_their_429(change: dict[str, Any],
                                                                                   label: str) -> None:
    """review99 M3 / attack98 F4: a reload did not reach best-effort requests already waiting: they were
    still sent as best effort after it was switched off for them."""
    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    held = ask(core, "r2")
    assert isinstance(held, Held)
    t = {"name": "b", "tier": "batch", "api_key_sha256": [hash_key("kb")], "max_concurrent": 1,
         "over_limit": "best-effort", **change.get("tenant", {})}
    tenants = [] if change.get("drop_tenant") else [t]
    core.reconfigure(parse_config({
        "nodes": {"static": [{"address": NODE, "probe": "http://p"}], "performance": {"profile": "34b-a100"}},
        "queue": {"inject_priority": True, **change.get("queue", {})},
        "best_effort": change.get("best_effort", {"enabled": True}),
        "tenants": [*tenants, {"name": "i", "tier": "interactive", "api_key_sha256": [hash_key("ki")]}]}))
    clock.advance(0.5)
    idle(core, clock, 0.2)  # room: it would have gone
    [a] = core.answers()
    r = a.decision.rejection
    assert a.held == held.ticket and r is not None and (r.status, r.reason) == (429, "tenant-concurrency"), label
    assert core.admission.queued == 0 and core.admission.inflight == 1


def two_pools(cap: int) -> tuple[Core, FakeClock, Any, Any]:
    """Pools a and b, one node each, under one ``fleet.max_inflight``; a batch tenant over its cap of 1
    (best effort) and a standard tenant within quota."""
    a_node, b_node = A_NODE, B_NODE
    clock = FakeClock()

    def nodes(addr: str) -> dict[str, Any]:
        return {"static": [{"address": addr, "probe": f"http://{addr}"}], "performance": {"profile": "34b-a100"}}

    cfg = parse_config({
        "pools": [{"name": "a", "models": ["ma"], "nodes": nodes(a_node)},
                  {"name": "b", "models": ["mb"], "nodes": nodes(b_node)}],
        "fleet": {"max_inflight": cap}, "queue": {"inject_priority": True},
        "tenants": [{"name": "be", "tier": "batch", "api_key_sha256": [hash_key("kb")], "max_concurrent": 1,
                     "over_limit": "best-effort"},
                    {"name": "s", "tier": "standard", "api_key_sha256": [hash_key("ks")]}]})
    core = Core(cfg, clock, random.Random(1), log=null_logger())

    def idle_all(b_kv: float = 0.0) -> None:
        idle(core, clock, 0.0, node=a_node)
        idle(core, clock, b_kv, node=b_node)

    def ask_pool(rid: str, key: str, model: str) -> Answer | Held:
        return core.decide(Request("/v1/chat/completions", rid, f"Bearer {key}",
                                   estimate=Estimate(100, 10, True, model=model), body_bytes=400))

    idle_all()
    return core, clock, idle_all, ask_pool


def both_waiting_at_the_cap() -> tuple[Core, FakeClock, Any, Any, Held, Held]:
    """``two_pools`` under a cap of 2, both slots taken (pool a's tenant within its cap, pool b's): a
    best-effort request of pool a and a request within quota of pool b wait. Returns the core, its clock,
    ``idle_all``, pool a's admitted decision, the best-effort Held and pool b's Held."""
    core, clock, idle_all, ask_pool = two_pools(2)
    r1 = answer(ask_pool("r1", "kb", "ma")).decision
    assert r1.lease is not None and answer(ask_pool("s1", "ks", "mb")).decision.admitted
    be = ask_pool("r2", "kb", "ma")
    w = ask_pool("w", "ks", "mb")
    assert isinstance(be, Held) and isinstance(w, Held)
    return core, clock, idle_all, r1, be, w


def test_with_one_fleet_cap_over_every_pool_best_effort_waits_while_another_pool_refuses() -> None:
    """attack98 F2: ``fleet.max_inflight`` is one cap over every pool; best effort of pool a took the slot
    pool b had just refused a request within quota for."""
    core, clock, idle_all, r1, be, w = both_waiting_at_the_cap()
    clock.advance(1.0)  # past the standard request's hold (~0.9 s), within the best-effort one's (~4.9 s)
    core.tick()
    [refused] = core.answers()
    assert refused.held == w.ticket and refused.decision.rejection is not None
    assert refused.decision.rejection.status == 503
    clock.advance(0.1)
    core.ended(Ended(r1.lease.ticket, "r1", 200, Usage(100, 10), upstream_answered=True))  # a fleet slot frees
    idle_all()
    assert core.answers() == [], "pool b refused a request within quota for that slot 0.1 s ago"
    clock.advance(1.0)
    idle_all()
    [a] = core.answers()
    assert a.held == be.ticket and a.decision.best_effort is not None and a.decision.admitted


def test_one_pass_leaves_the_fleet_slots_another_pools_queue_needs() -> None:
    """attack101 F1: under one fleet cap, whether another pool's queue leaves room changes with every slot
    best effort takes; judged once per pass, one pass filled the cap and pool b's request timed out."""
    core, clock, _, ask_pool = two_pools(3)
    a = core.admission
    assert answer(ask_pool("r1", "kb", "ma")).decision.admitted
    idle(core, clock, 0.95, node=B_NODE)
    w = ask_pool("w", "ks", "mb")
    assert isinstance(w, Held), "pool b's own node is full: its request waits"
    idle(core, clock, 0.95, node=A_NODE)
    assert isinstance(ask_pool("r2", "kb", "ma"), Held) and isinstance(ask_pool("r3", "kb", "ma"), Held)
    clock.advance(0.05)
    idle(core, clock, 0.0, node=A_NODE)  # pool a has room again
    sent = [x for x in core.answers() if x.decision.admitted]
    assert len(sent) == 1 and a.inflight == 2, "one slot left for pool b's waiting request"
    clock.advance(0.05)
    idle(core, clock, 0.0, node=B_NODE)
    [served] = core.answers()
    assert served.held == w.ticket and served.decision.admitted


def test_a_request_that_waited_out_the_fleet_cap_keeps_best_effort_off_the_slot_it_frees() -> None:
    """attack101 F2: a request that waited for a slot under the cap and timed out, dropped by the pump a
    completion triggers (no tick in between), kept nothing off: best effort took the slot it freed."""
    core, clock, _, r1, _, w = both_waiting_at_the_cap()
    clock.advance(1.0)  # past the standard request's hold, no pump since
    core.ended(Ended(r1.lease.ticket, "r1", 200, Usage(100, 10), upstream_answered=True))
    [refused] = core.answers()
    assert refused.held == w.ticket and refused.decision.rejection is not None
    assert core.admission.queued == 1, "best effort still waits"


def test_another_pools_own_full_nodes_do_not_stop_best_effort_under_a_loose_fleet_cap() -> None:
    """review100 N1: with ``fleet.max_inflight`` far from reached, pool b's queue (its own nodes full) is
    pool b's affair: pool a's spare room still serves best effort."""
    _, _, idle_all, ask_pool = two_pools(100)
    assert answer(ask_pool("r1", "kb", "ma")).decision.admitted
    idle_all(b_kv=0.95)
    assert isinstance(ask_pool("w", "ks", "mb"), Held), "pool b's node is full: its request waits"
    d = answer(ask_pool("r2", "kb", "ma")).decision
    assert d.admitted and d.best_effort is not None


def test_a_waiting_best_effort_request_cancelled_gives_back_its_spend_reservation() -> None:
    budget = {"name": "daily", "window": "day", "limit": 1.0, "mode": "hard"}
    core, clock = make(tenant={"budgets": [budget]}, extra={"prices": {"default": {"prompt": 1.0, "completion": 1.0}}})
    answer(ask(core, "r1"))
    acc = core.admission.spend.accounts["b"][0]
    idle(core, clock, 0.88)
    held = ask(core, "r2")
    assert isinstance(held, Held)
    assert acc.reserved == pytest.approx(0.000_22), "reserved while it waits, as any admission"
    core.cancel(held.ticket)
    assert core.admission.queued == 0 and acc.reserved == pytest.approx(0.000_11)
    clock.advance(60.0)
    core.tick()
    assert core.answers() == [], "cancelled: no answer, nothing left to time out"


def test_clients_that_send_and_leave_at_once_leave_nothing_behind() -> None:
    """A tenant over its cap sending and cancelling without end: the deadlines kept for those gone are
    compacted, the gauge follows the requests waiting, and each one gone is a cancelled queue wait."""
    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    keep = ask(core, "keep")
    assert isinstance(keep, Held)
    for i in range(500):
        h = ask(core, f"c{i}")
        assert isinstance(h, Held)
        core.cancel(h.ticket)
    a = core.admission
    assert a.queued == 1 and len(a._spare_due) <= 2 * len(a._spare) + 64
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_best_effort_waiting_requests{pool="default"} 1.0' in text
    assert 'kvgate_queue_cancelled_total{pool="default",tier="batch"} 500.0' in text
    assert 'kvgate_queue_depth_requests{pool="default",tier="batch"} 0.0' in text


def test_a_pass_tries_few_waiting_requests_no_node_takes() -> None:
    """A flood waiting for room costs a few node choices per pass, not one per request at every event."""
    from ext_proc.admission import SPARE_TRIES

    core, clock = make()
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    for i in range(50):
        assert isinstance(ask(core, f"w{i}"), Held)
    calls: list[str] = []
    place = core.admission._place

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args[1])
        return place(*args, **kw)

    core.admission._place = counted  # type: ignore[method-assign]
    idle(core, clock, 0.88)
    assert 0 < len(calls) <= SPARE_TRIES // 2, "one tenant: half the pass's tries"


def test_best_effort_waiting_is_bounded_by_the_queue_size() -> None:
    core, clock = make(extra={"queue": {"inject_priority": True, "max_size": 3}})
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    held = [ask(core, f"w{i}") for i in range(3)]
    assert all(isinstance(h, Held) for h in held)
    r = answer(ask(core, "over")).decision.rejection
    assert r is not None and (r.status, r.reason) == (429, "tenant-concurrency"), "no room to wait: its 429 at once"


def test_with_the_queue_off_best_effort_never_waits() -> None:
    core, clock = make(extra={"queue": {"enabled": False}})
    answer(ask(core, "r1"))
    idle(core, clock, 0.88)
    r = answer(ask(core, "r2")).decision.rejection
    assert r is not None and (r.status, r.reason) == (429, "tenant-concurrency")


def test_precheck_lets_a_best_effort_tenant_at_its_cap_be_read() -> None:
    core, _ = make()
    answer(ask(core, "r1"))
    t = core.config.tenant("b")
    assert t is not None
    assert core.admission.precheck(t, 100) is None
    core, _ = make("refuse")
    answer(ask(core, "r1"))
    t = core.config.tenant("b")
    assert t is not None
    r = core.admission.precheck(t, 100)
    assert r is not None and r.reason == "tenant-concurrency"


@pytest.mark.parametrize(("value", "message"), [
    ("maybe", r"tenants\[0\]\.over_limit: must be refuse or best-effort"),
    ({"concurrency": "nope"}, r"tenants\[0\]\.over_limit: concurrency: must be refuse or best-effort"),
    ({"spend": "best-effort"}, r"tenants\[0\]\.over_limit: 'spend' is not a limit that may be exceeded"),
])
def test_config_errors_name_the_field(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"tenants": [{"name": "a", "over_limit": value}]})


def test_best_effort_goes_only_where_the_lowest_tiers_target_is_predicted_to_be_met() -> None:
    """Spare room is a first token within the lowest tier's *target*: a new arrival of that tier may go
    up to its max wait (30 s for batch), which would pile best effort onto a busy node."""
    tiers = {"interactive": {"priority": 0, "max_queue_wait_ms": 1000, "ttft_target_ms": 200},
             "batch": {"priority": 2, "max_queue_wait_ms": 30000, "ttft_target_ms": 300}}
    core, clock = make(extra={"tiers": tiers})
    answer(ask(core, "r1"))
    assert answer(ask(core, "idle")).decision.best_effort is not None, "an idle node: room"
    busy = answer(ask(core, "long", key="ki", prompt=6000)).decision  # ~1-2 s of prefill booked ahead
    assert busy.admitted
    held = ask(core, "r2")
    assert isinstance(held, Held), "not sent behind the long prefill: it waits for room"
    clock.advance(0.1)
    core.tick()
    assert core.answers() == []
    clock.advance(31.0)
    core.tick()
    [a] = core.answers()
    assert a.decision.best_effort is None and a.decision.rejection is not None
    assert a.decision.rejection.status == 429


def test_best_effort_goes_only_where_it_would_start_as_soon_as_a_top_tier_request() -> None:
    """Within the lowest tier's 5 s target is not spare room: sent with a first token a second away it
    would sit in vLLM's queue, ahead of every top-tier request arriving after it (first come, first
    served without priority injection). It waits in kvgate instead, and goes once a node is that free."""
    tiers = {"interactive": {"priority": 0, "max_queue_wait_ms": 1000, "ttft_target_ms": 200},
             "batch": {"priority": 2, "max_queue_wait_ms": 30000, "ttft_target_ms": 5000}}
    core, clock = make(extra={"tiers": tiers})
    answer(ask(core, "r1"))
    busy = answer(ask(core, "long", key="ki", prompt=6000)).decision  # ~1-2 s of prefill booked ahead
    assert busy.admitted and busy.lease is not None
    held = ask(core, "r2")
    assert isinstance(held, Held), "a first token predicted within 5 s but not within 200 ms: it waits"
    core.ended(Ended(busy.lease.ticket, "long", 200, Usage(6000, 10), upstream_answered=True))
    clock.advance(0.5)
    idle(core, clock, 0.1)
    [a] = core.answers()
    assert a.held == held.ticket and a.decision.best_effort is not None and a.decision.lease is not None
    assert a.decision.lease.predicted_ttft is not None and a.decision.lease.predicted_ttft <= 0.2


@pytest.mark.parametrize(("flag", "named"), [("best_effort", ("", "", False)),
                                             ("stretched", ("acme", "acme/llama-70b", True)),
                                             (None, ("acme", "acme/llama-70b", False))])
def test_another_replicas_best_effort_end_gives_back_no_slot(flag: str | None, named: tuple[str, str, bool]) -> None:
    """With several replicas an end reaching the wrong replica is forwarded with the tenant whose slot it
    held (given back if its owner died): a best-effort request held none, so it names none; one sent on its
    tenant's cap's stretch is forwarded as such — it holds the tenant's slot only if it took one over since
    (the store's list of heirs), its per-model budget's all along."""
    from envoy.data.accesslog.v3 import accesslog_pb2

    from ext_proc.server import META_NS, Gateway
    from tests.test_pools import pools_config

    class Store:
        def __init__(self) -> None:
            self.sent: list[tuple[str, str]] = []

        def forward(self, e: Ended, tenant: str = "", budget: str = "", stretched: bool = False) -> None:
            self.sent.append((tenant, budget, stretched))

    gw = Gateway(pools_config())
    store = Store()
    gw.store = store  # type: ignore[assignment]
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = "r"
    fields = entry.common_properties.metadata.filter_metadata[META_NS]
    fields.update({"ticket": "elsewhere-1", "tenant": "acme", "budget": "acme/llama-70b"})
    if flag is not None:
        fields.update({flag: True})
    gw.on_access_log(entry)
    assert store.sent == [named]


def test_a_prefill_longer_than_the_top_tiers_target_is_never_best_effort() -> None:
    """vLLM runs a running prefill's chunks before any waiting request: a top-tier request arriving
    behind a long best-effort prefill would miss its target because of it. A short one may go."""
    core, _ = make()
    answer(ask(core, "r1"))
    r = answer(ask(core, "long", prompt=6000)).decision  # ~1 s of prefill alone, against a 200 ms target
    assert r.best_effort is None and r.rejection is not None and r.rejection.status == 429
    assert answer(ask(core, "short")).decision.best_effort is not None


def test_best_effort_pays_the_tenants_spend_budgets_and_one_that_cannot_pay_is_refused() -> None:
    """Spend budgets are contracts: a request served as best effort (over its concurrency cap) is
    reserved and charged on them as any admission is — before, it skipped them and was never charged —
    and a best-effort request its hard budget cannot pay gets ``tenant-budget``."""
    budget = {"name": "daily", "window": "day", "limit": 0.000_25, "mode": "hard"}
    core, _ = make(tenant={"budgets": [budget]}, extra={"prices": {"default": {"prompt": 1.0, "completion": 1.0}}})
    spend = core.admission.spend
    first = answer(ask(core, "r1"))  # within its cap: worst case 110 tokens = $0.00011
    assert first.decision.admitted and first.decision.best_effort is None
    second = answer(ask(core, "r2"))  # over its cap: best effort, and its worst case reserved
    assert second.decision.best_effort is not None and second.decision.lease is not None
    acc = spend.accounts["b"][0]
    assert acc.reserved == pytest.approx(0.000_22)
    third = answer(ask(core, "r3"))  # best effort again, but $0.00003 is left of the day's budget
    assert not third.decision.admitted
    assert third.decision.rejection is not None and third.decision.rejection.reason == "tenant-budget"
    assert core.ended(Ended(second.decision.lease.ticket, "r2", 200, Usage(100, 10), upstream_answered=True))
    assert acc.reserved == pytest.approx(0.000_11) and acc.spent == pytest.approx(0.000_11)
