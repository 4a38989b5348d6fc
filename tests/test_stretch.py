"""A concurrency cap's stretch (``tenants[i].max_concurrent_stretch``): while the fleet holds a tenant's requests
longer than usual and the tenant sends no faster than its cap allows at its usual duration, the cap grows by the
slowdown up to the factor; what goes on the stretch holds no slot and is given back exactly once."""

from __future__ import annotations

import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ext_proc.admission import SLOWED as SLOWED_AT
from ext_proc.admission import STRETCH_SLOWED as STRETCH_AT
from ext_proc.admission import Admission, Usage
from ext_proc.config import ConfigError, parse_config
from ext_proc.core import Core, Held, Request, null_logger
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from tests.helpers import FakeClock


def E(prompt: int = 10, out: int = 10) -> Estimate:
    return Estimate(prompt_tokens=prompt, output_tokens=out, parsed=True, stream=False)


def history(a: Admission, clock: FakeClock, t: Any, durations: list[float], gap: float = 1.0) -> None:
    """Requests one at a time, each lasting its duration, ``gap`` seconds apart."""
    for i, d in enumerate(durations):
        lease = a.decide(t, f"w{i}", E(), 10).lease
        assert lease is not None
        clock.advance(d)
        a.complete(lease.ticket, Usage(10, 10), responded=True)
        clock.advance(gap)


STEADY = [1.0] * 20
SLOWED = STEADY + [3.0] * 5
"""1 s each, then 3 s: the recent mean about 2.3x the norm (a stretch of 2 reaches its factor)."""


def admission(stretch: float | None, cap: int = 4, queue: bool = False, **tenant: Any) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    extra = {} if stretch is None else {"max_concurrent_stretch": stretch}
    cfg = parse_config({"tenants": [{"name": "t", "max_concurrent": cap, **extra, **tenant}],
                        "queue": {"enabled": queue}})
    return Admission(cfg, clock, random.Random(1)), clock


def fill(a: Admission, t: Any, prefix: str, n: int) -> list[Any]:
    out = []
    for i in range(n):
        d = a.decide(t, f"{prefix}{i}", E(), 10)
        assert d.lease is not None, d.rejection
        out.append(d.lease)
    return out


def keyed(cap: int) -> Any:
    """Tenant ``t`` behind API key ``k``: ``cap`` slots stretching up to 2x, no gateway queue (for a Core)."""
    return parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "max_concurrent": cap,
                                      "max_concurrent_stretch": 2}], "queue": {"enabled": False}})


def asker(core: Core) -> Any:
    """``ask(rid)``: the core's decision for one request of tenant ``t`` (never held: no queue)."""
    def ask(rid: str) -> Any:
        a = core.decide(Request("/v1/chat/completions", rid, "Bearer k", estimate=E(), body_bytes=10))
        assert not isinstance(a, Held)
        return a.decision
    return ask


def test_a_slowed_fleet_stretches_the_cap_by_the_slowdown_up_to_the_factor() -> None:
    a, clock = admission(2.0)
    t = a.config.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None and state.mean_seconds is not None and state.norm_seconds is not None
    assert state.mean_seconds > 2 * state.norm_seconds
    held = fill(a, t, "h", 4)  # its slots
    assert [x.stretched for x in held] == [False] * 4 and state.inflight == 4
    over = fill(a, t, "s", 4)  # the stretch: 4 x (2 - 1)
    assert all(x.stretched for x in over) and state.inflight == 4 and state.stretched == 4
    refused = a.decide(t, "x", E(), 10)
    assert refused.rejection is not None and refused.rejection.reason == "tenant-concurrency"
    assert refused.rejection.fleet_caused  # past the stretch, still the fleet's doing: scaling demand
    for x in held + over:
        assert a.complete(x.ticket, Usage(10, 10), responded=True) is not None
        assert a.complete(x.ticket, Usage(10, 10), responded=True) is None  # exactly once
    assert (state.inflight, state.stretched, a.inflight) == (0, 0, 0)


def test_the_stretch_follows_the_slowdown_below_the_factor() -> None:
    a, clock = admission(4.0, cap=10)
    t = a.config.tenant("t")
    history(a, clock, t, STEADY + [1.9] * 8, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None and state.mean_seconds is not None and state.norm_seconds is not None
    ratio = state.mean_seconds / state.norm_seconds
    assert 1.5 < ratio < 2.0
    fill(a, t, "h", 10)
    stretched = 0
    while a.decide(t, f"s{stretched}", E(), 10).lease is not None:
        stretched += 1
    assert stretched == int(10 * (ratio - 1.0))


def test_no_stretch_on_a_healthy_fleet_or_without_the_switch() -> None:
    for stretch, durations in ((2.0, STEADY), (None, SLOWED), (1.0, SLOWED)):
        a, clock = admission(stretch)
        t = a.config.tenant("t")
        history(a, clock, t, durations, gap=4.0)
        held = fill(a, t, "h", 4)
        d = a.decide(t, "x", E(), 10)
        assert d.rejection is not None and d.rejection.reason == "tenant-concurrency", (stretch, durations)
        state = a.tenant_state("t")
        assert state is not None and state.stretched == 0
        for x in held:
            a.complete(x.ticket, Usage(10, 10), responded=True)


def test_a_tenant_sending_faster_than_its_cap_allows_gets_no_more_stretch() -> None:
    """Its own burst: once its arrival rate x its usual duration reaches the cap, the 429 is its excess — the
    stretch takes only what came before the rate got there, never the whole factor."""
    a, clock = admission(2.0, cap=4)
    t = a.config.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None and state.norm_seconds is not None
    fill(a, t, "h", 4)
    answers = []
    for i in range(60):  # 60 within 3 s: 20/s against a cap that allows 4 / ~1 s
        d = a.decide(t, f"b{i}", E(), 10)
        answers.append(d.lease is not None)
        if d.lease is not None:  # (ended at once, unanswered: its place on the stretch is free again)
            a.complete(d.lease.ticket, None, responded=False)
        clock.advance(0.05)
    assert state.arrival_rate * state.norm_seconds >= 4
    assert any(answers[:10]) and not any(answers[-20:])  # (without the rate test: every one of them)
    assert state.stretched == 0
    # the stretch the slowdown allows is 4; what came while its rate was still within the cap took part of it
    slowed_alone, clock2 = admission(2.0, cap=4)
    history(slowed_alone, clock2, t, SLOWED, gap=4.0)
    fill(slowed_alone, t, "h", 4)
    assert len(fill(slowed_alone, t, "s", 4)) == 4


def test_a_queued_request_on_the_stretch_gives_its_place_back_when_cancelled() -> None:
    a, clock = admission(2.0, queue=True)
    t = a.config.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None
    fill(a, t, "h", 4)
    d = a.decide(t, "s", E(), 10)  # no node choice: admitted at once, or queued — either way on the stretch
    assert d.lease is not None and d.lease.stretched and state.stretched == 1
    if d.queued:
        assert a.cancel(d.lease.ticket) and state.stretched == 0
    else:
        a.complete(d.lease.ticket, None, responded=False)
        assert state.stretched == 0
    assert state.inflight == 4


def test_a_model_budgets_cap_does_not_stretch() -> None:
    a, clock = admission(2.0, cap=50, model_budgets={"big": {"max_concurrent": 2}})
    t = a.config.tenant("t")
    big = Estimate(prompt_tokens=10, output_tokens=10, parsed=True, stream=False, model="big")
    for i, d in enumerate(SLOWED):  # slowed on the model: the tenant's stretch applies, the budget's cap holds
        lease = a.decide(t, f"w{i}", big, 10).lease
        assert lease is not None
        clock.advance(d)
        a.complete(lease.ticket, Usage(10, 10), responded=True)
        clock.advance(4.0)

    def ask(rid: str) -> Any:
        return a.decide(t, rid, Estimate(prompt_tokens=10, output_tokens=10, parsed=True, stream=False, model="big"),
                        10)

    assert ask("a").lease is not None and ask("b").lease is not None
    d = ask("c")
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"
    state, budget = a.tenant_state("t"), a.tenant_state("t/big")
    assert state is not None and budget is not None and state.stretched == 0 and budget.inflight == 2
    assert budget.norm_seconds is None and budget.mean_pace is None  # (a budget keeps no norm of its own)


def test_the_factor_is_bounded_and_named_in_errors() -> None:
    for bad in (0.5, 5.0, "x"):
        try:
            parse_config({"tenants": [{"name": "t", "max_concurrent": 2, "max_concurrent_stretch": bad}]})
        except ConfigError as e:
            assert "max_concurrent_stretch" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_the_counter_of_stretched_admissions_moves() -> None:
    clock = FakeClock()
    core = Core(keyed(2), clock, random.Random(1), log=null_logger())
    ask = asker(core)

    from ext_proc.core import Ended

    for i, d in enumerate(SLOWED):
        lease = ask(f"w{i}").lease
        assert lease is not None
        clock.advance(d)
        core.ended(Ended(lease.ticket, f"w{i}", 200, Usage(10, 10), upstream_answered=True))
        clock.advance(4.0)
    answers = [core.decide(Request("/v1/chat/completions", f"h{i}", "Bearer k", estimate=E(), body_bytes=10))
               for i in range(4)]
    assert not any(isinstance(x, Held) for x in answers)
    leases = [x.decision.lease for x in answers]  # type: ignore[union-attr]
    assert all(x is not None for x in leases) and [x.stretched for x in leases] == [False, False, True, True]
    # the access log's metadata says so: a replica that forwards its completion gives back no slot of the
    # tenant's for it (``server.py``), as for best effort
    assert [x.metadata.get("stretched") for x in answers] == [None, None, True, True]  # type: ignore[union-attr]
    refused = ask("x")
    assert refused.rejection is not None and refused.rejection.status == 429
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_concurrency_stretched_admissions_total{pool="default",tenant="t",tier="standard"} 2.0' in text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ask", "end", "drop", "cancel", "wait"]), st.integers(0, 30)),
                max_size=80),
       st.sampled_from([1.0, 1.5, 2.0, 3.0]), st.booleans())
def test_slots_and_the_stretch_are_given_back_exactly_once(ops: list[tuple[str, int]], stretch: float,
                                                           queue: bool) -> None:
    """Whatever the order of arrivals, completions, drops and cancels: at most the cap holds slots, at most
    the cap x the factor (less one part) run, and when everything has ended both counters are 0."""
    a, clock = admission(stretch, cap=4, queue=queue)
    t = a.config.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None
    live: list[Any] = []
    n = 0
    for op, k in ops:
        if op == "ask":
            n += 1
            d = a.decide(t, f"r{n}", E(), 10)
            if d.lease is not None:
                live.append(d.lease)
                # sent at once on the stretch: its access log says so for good (as ``core.py`` marks it)
                d.lease.tagged = d.lease.stretched and d.lease.queued_at is None
        elif op == "wait":
            clock.advance(k / 10)
        elif live:
            lease = live.pop(k % len(live))
            if op == "cancel":
                if not a.cancel(lease.ticket):
                    a.complete(lease.ticket, None, responded=False)
            else:
                a.complete(lease.ticket, Usage(10, 10) if op == "end" else None, responded=op == "end")
        assert 0 <= state.inflight <= 4
        assert 0 <= state.stretched <= int(4 * (stretch - 1.0))
        assert state.inflight + state.stretched == len(live)
        # a dead replica leaves taken its slot holders sent to a node; those sent on the stretch are its heirs
        assert set(state.heirs) == {x.ticket for x in live if x.tagged and not x.stretched}
        assert 0 <= state.orphanable <= state.inflight
    for lease in live:
        if not a.cancel(lease.ticket):
            a.complete(lease.ticket, Usage(10, 10), responded=True)
    assert (state.inflight, state.stretched, state.heirs, a.inflight) == (0, 0, frozenset(), 0)


def six_on_a_slowed_fleet() -> tuple[Admission, Any, Any]:
    """Cap 4 stretched by 2 on a slowed fleet of 6 slots (``fleet.max_inflight``): past 6, requests queue."""
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "max_concurrent": 4, "max_concurrent_stretch": 2}],
                        "fleet": {"max_inflight": 6}})
    a = Admission(cfg, clock, random.Random(1))
    t = cfg.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None
    return a, t, state


def test_a_freed_slot_goes_to_a_request_not_sent_yet_before_one_already_sent_on_the_stretch() -> None:
    """The access log of a request sent on the stretch says it holds no slot of the tenant's, whatever it takes
    over later: a queued heir is preferred (its metadata, made when it goes, will be right), and one already sent
    is listed as an heir (``heirs``), for the shared store to give its slot back when another replica forwards
    its completion for this one, dead (review108 N1). What stays taken then is what was sent to a node."""
    a, t, state = six_on_a_slowed_fleet()
    held = fill(a, t, "h", 4)
    sent = fill(a, t, "s", 2)  # on the stretch, sent
    for x in sent:
        x.tagged = True  # as core.py marks what it sends on the stretch
    waiting = fill(a, t, "q", 2)  # on the stretch, queued
    assert all(x.queued_at is not None for x in waiting)
    a.complete(held[0].ticket, Usage(10, 10), responded=True)
    assert [x.stretched for x in waiting] == [False, True] or [x.stretched for x in waiting] == [True, False]
    assert all(x.stretched for x in sent) and not state.heirs and state.orphanable == 3  # (one heir queued)
    a.complete(held[1].ticket, Usage(10, 10), responded=True)
    assert not any(x.stretched for x in waiting) and not state.heirs and state.orphanable == 2
    a.complete(held[2].ticket, Usage(10, 10), responded=True)  # only sent ones left on the stretch
    heir = next(x for x in sent if not x.stretched)
    assert sum(x.stretched for x in sent) == 1 and state.heirs == {heir.ticket}
    assert (state.inflight, state.orphanable) == (4, 2)
    a.complete(heir.ticket, Usage(10, 10), responded=True)  # an heir ends: its slot goes to the last one
    last = next(x for x in sent if x is not heir)
    assert not last.stretched and state.heirs == {last.ticket} and state.stretched == 0
    rest = [held[3], *waiting, next(x for x in sent if x is not heir)]
    for x in rest:
        if not a.cancel(x.ticket):
            a.complete(x.ticket, Usage(10, 10), responded=True)
    assert (state.inflight, state.stretched, state.heirs) == (0, 0, frozenset())


def test_shorter_answers_alone_give_no_stretch() -> None:
    """Pace (seconds per output token) also grows when the tenant asks for shorter answers: requests lasting as
    long as ever with a tenth of the output are no slower fleet (attack106 F1) — the duration must agree."""
    a, clock = admission(2.0)
    t = a.config.tenant("t")
    for i in range(20):
        lease = a.decide(t, f"w{i}", E(), 10).lease
        assert lease is not None
        clock.advance(1.0)
        a.complete(lease.ticket, Usage(10, 100 if i < 15 else 10), responded=True)
        clock.advance(4.0)
    state = a.tenant_state("t")
    assert state is not None and state.mean_pace is not None and state.norm_pace is not None
    assert state.mean_pace > 1.5 * state.norm_pace
    fill(a, t, "h", 4)
    assert a.precheck(t, 100) is not None  # refused unread, as decide refuses it
    d = a.decide(t, "s", E(), 10)
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"


def test_answers_of_every_length_on_a_healthy_fleet_open_no_stretch() -> None:
    """Pace is a ratio of averages (seconds over output tokens), not an average of each answer's own: averaged
    per answer, a 1-token answer lasting its fixed 0.4 s counted as 0.4 s a token, and on this healthy fleet
    (answers of 1-200 tokens, 0.4 s + 20 ms a token, +-20%) both signals agreed on a slowdown after about one
    completion in nine (recheck108 F1). Checked after every completion: slots full, one more is refused."""
    a, clock = admission(2.0, cap=2)
    t = a.config.tenant("t")
    rng = random.Random(7)
    for i in range(400):
        out = rng.randint(1, 200)
        lease = a.decide(t, f"w{i}", E(out=out), 10).lease
        assert lease is not None
        clock.advance((0.4 + 0.02 * out) * rng.uniform(0.8, 1.2))
        a.complete(lease.ticket, Usage(10, out), responded=True)
        if i >= 50:
            held = fill(a, t, f"h{i}-", 2)
            d = a.decide(t, f"x{i}", E(), 10)
            assert d.rejection is not None and d.rejection.reason == "tenant-concurrency", i
            for x in held:
                a.complete(x.ticket, None, responded=False)
        clock.advance(4.0)


def test_a_slowdown_no_answer_has_renewed_for_a_minute_gives_no_stretch() -> None:
    a, clock = admission(2.0)
    t = a.config.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    held = fill(a, t, "h", 4)
    clock.advance(61.0)
    d = a.decide(t, "s", E(), 10)
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"
    for x in held:
        a.complete(x.ticket, None, responded=False)
    # an hour later one answer at the usual speed does not bring last hour's slowdown back (attack106 F7)
    clock.advance(3600.0)
    history(a, clock, t, [1.0])
    fill(a, t, "k", 4)
    d = a.decide(t, "s2", E(), 10)
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"


def test_a_slot_freed_goes_to_a_request_on_the_stretch_and_a_queued_one_gives_its_place_back() -> None:
    """The stretch drains first: a slot freed while requests on the stretch run or wait is taken over by one of
    them, so no slot goes back to the shared store while more than the cap runs here (attack106 F2); a queued
    request on the stretch that is cancelled gives its place back."""
    a, t, state = six_on_a_slowed_fleet()
    held = fill(a, t, "h", 4)
    running = fill(a, t, "s", 2)  # on the stretch, sent (6 fleet slots)
    assert all(x.stretched for x in running) and state.stretched == 2
    waiting = fill(a, t, "q", 2)  # on the stretch, queued: the fleet's 6 are taken
    assert all(x.stretched and x.queued_at is not None for x in waiting) and state.stretched == 4
    assert a.cancel(waiting[0].ticket) and state.stretched == 3 and state.inflight == 4
    a.complete(held[0].ticket, Usage(10, 10), responded=True)
    # the slot it held went to one on the stretch: still 4 slots taken, one fewer on the stretch
    assert state.inflight == 4 and state.stretched == 2
    assert sum(not x.stretched for x in running + waiting[1:]) == 1
    for x in held[1:] + running + waiting[1:]:
        if not a.cancel(x.ticket):
            a.complete(x.ticket, Usage(10, 10), responded=True)
        for _ in a.pump():
            pass
    assert (state.inflight, state.stretched) == (0, 0)


def test_a_lowered_cap_gives_no_stretch_until_what_runs_fits_it() -> None:
    a, clock = admission(2.0, cap=4)
    t = a.config.tenant("t")
    history(a, clock, t, SLOWED, gap=4.0)
    fill(a, t, "h", 4)
    cfg = parse_config({"tenants": [{"name": "t", "max_concurrent": 2, "max_concurrent_stretch": 2}],
                        "queue": {"enabled": False}})
    a.reconfigure(cfg)
    d = a.decide(cfg.tenant("t"), "s", E(), 10)  # 4 run against 2 x 2: nothing more
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"


def _fleet_config(cap: int | None, stretch: float | None, present: bool = True) -> Any:
    tenants: list[dict[str, Any]] = [{"name": "u", "max_concurrent": 50}]
    if present:
        t: dict[str, Any] = {"name": "t"}
        if cap is not None:
            t["max_concurrent"] = cap
            if stretch is not None:
                t["max_concurrent_stretch"] = stretch
        tenants.append(t)
    return parse_config({"tenants": tenants, "fleet": {"max_inflight": 6}, "queue": {"enabled": True}})


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_what_stays_taken_and_the_heirs_follow_every_handover(seed: int) -> None:
    """With queueing (a fleet cap), pumps, cancels, completions, reclaims and reloads (cap lowered, raised or
    removed, the stretch off, the tenant gone and back), leases marked as ``core.py`` marks them when they go:
    the heirs are exactly the slot holders sent on the stretch, what stays taken if the replica dies exactly the
    slot holders sent to a node, and everything is back to 0 at the end (attack109's fuzz)."""
    rng = random.Random(seed)
    clock = FakeClock()
    a = Admission(_fleet_config(4, 2.0), clock, random.Random(seed))
    history(a, clock, a.config.tenant("t"), SLOWED, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None
    live: dict[str, Any] = {}  # the charged leases of t, queued or sent

    def sent(lease: Any) -> None:
        lease.tagged = lease.tagged or lease.stretched  # (core.py, as the request goes)

    def pump() -> None:
        for o in a.pump():
            if o.decision.lease is not None and o.decision.lease.ticket in live:
                sent(o.decision.lease)
            elif o.ticket in live and o.decision.lease is None:
                live.pop(o.ticket)  # refused out of the queue: refunded

    n = 0
    for _ in range(120):
        op = rng.choice(["ask"] * 5 + ["end", "end", "cancel", "wait", "reload", "reclaim", "pump"])
        if op == "ask":
            n += 1
            if all(x.name != "t" for x in a.config.tenants):
                continue
            d = a.decide(a.config.tenant("t"), f"r{n}", E(), 10)
            if d.lease is not None and d.lease.tenant is state:
                live[d.lease.ticket] = d.lease
                if d.lease.queued_at is None:
                    sent(d.lease)
        elif op == "wait":
            clock.advance(rng.random() * 3)
        elif op == "pump":
            pump()
        elif op == "reclaim":
            clock.advance(rng.choice([0, 0, 1000]))
            a.reclaim_expired()
            open_ = {x.ticket for x in a.leases(queued=True)}
            for tk in [tk for tk in live if tk not in open_]:
                live.pop(tk)
            pump()
        elif op == "reload":
            choice = rng.choice([(4, 2.0), (2, 2.0), (8, 3.0), (4, None), (None, None), "gone", (4, 1.5)])
            a.reconfigure(_fleet_config(3, None, present=False) if choice == "gone" else _fleet_config(*choice))
            pump()
        elif live:
            tk = rng.choice(list(live))
            live.pop(tk)
            if not a.cancel(tk):
                a.complete(tk, Usage(10, 10), responded=rng.random() < 0.7)
            pump()
        going = {x.ticket for x in a.leases()}
        assert set(state.heirs) == {tk for tk, x in live.items() if x.tagged and not x.stretched}
        assert state.orphanable == sum(1 for tk, x in live.items() if not x.stretched and tk in going)
        assert 0 <= state.orphanable <= state.inflight
        assert state.inflight + state.stretched == len(live)
    for tk in list(live):
        if not a.cancel(tk):
            a.complete(tk, Usage(10, 10), responded=True)
    assert (state.inflight, state.stretched, state.heirs, state.orphanable) == (0, 0, frozenset(), 0)


def test_a_stream_its_client_holds_open_is_not_the_fleets_time() -> None:
    """The tenant's durations and pace are timed to the node's last byte (``Ended.tail_s``, from Envoy's access
    log): one answer its client held open 30 s moved both (attack110 M1: pace 3.2x, duration 4.9x — the whole
    stretch on a healthy fleet); told the tail, neither moves."""
    from ext_proc.core import Ended

    clock = FakeClock()
    core = Core(keyed(4), clock, random.Random(1), log=null_logger())
    ask = asker(core)

    for i in range(30):
        x = ask(f"w{i}").lease
        clock.advance(1.0 if i < 29 else 31.0)  # the last one held 30 s by its client after the node's last byte
        core.ended(Ended(x.ticket, f"w{i}", 200, Usage(10, 100), upstream_answered=True,
                         tail_s=30.0 if i == 29 else 0.0))
        clock.advance(4.0)
    state = core.admission.tenant_state("t")
    assert state is not None and state.fleet_seconds is not None and state.mean_seconds is not None
    assert state.fleet_seconds[0] < 1.1 * state.fleet_seconds[1]
    assert state.mean_seconds > 2.0  # (its slot was held all along: Retry-After and Little's law count the tail)
    assert state.mean_pace is not None and state.norm_pace is not None
    assert state.mean_pace < 1.1 * state.norm_pace  # (each signal on its own: the stretch reads the smaller)
    held = [ask(f"h{i}").lease for i in range(4)]
    assert all(x is not None and not x.stretched for x in held)
    refused = ask("x").rejection
    assert refused is not None  # (without the tail: on the stretch)
    assert not refused.fleet_caused  # (nor a 429 of the fleet's doing, scaling it)
    assert refused.retry_after >= 1  # (from how long its slots are held, the tail counted)


def test_the_tail_is_read_from_envoys_access_log() -> None:
    """``Ended.tail_s``: Envoy's last byte sent downstream less its last byte received upstream; 0 where the node
    never finished (no upstream last byte) or the client's side came first. The Gateway passes it on."""
    from envoy.data.accesslog.v3 import accesslog_pb2

    from ext_proc.server import META_NS, Gateway, _tail

    entry = accesslog_pb2.HTTPAccessLogEntry()
    c = entry.common_properties
    assert _tail(c) == 0.0
    c.time_to_last_upstream_rx_byte.FromMilliseconds(1500)
    assert _tail(c) == 0.0
    c.time_to_last_downstream_tx_byte.FromMilliseconds(31250)
    assert abs(_tail(c) - 29.75) < 1e-9
    c.time_to_last_downstream_tx_byte.FromMilliseconds(1000)
    assert _tail(c) == 0.0
    gw = Gateway(keyed(4))
    lease = asker(gw.core)("r").lease
    assert lease is not None
    entry.request.request_id = "r"
    entry.response.response_code.value = 200
    c.time_to_first_upstream_rx_byte.FromMilliseconds(100)
    c.time_to_last_downstream_tx_byte.FromMilliseconds(31250)
    c.metadata.filter_metadata[META_NS].update({"ticket": lease.ticket})
    gw.on_access_log(entry)
    state = gw.core.admission.tenant_state("t")
    assert state is not None and state.fleet_seconds is None  # (a tail longer than its time here: says nothing)


def test_a_noisy_healthy_fleet_opens_no_stretch_and_a_slowed_one_still_does() -> None:
    """Each norm rises at its slow rate only while the tenant reads slowed. Chosen by each answer's own side of the
    norm, the norms settled at a low expectile rather than the mean: with answers varying as LLM requests do
    (lognormal noise, sigma 0.35, around a healthy line of their shape), both signals read over 1.5x after about a
    quarter of completions (review112 H3; about 1% now, at ``STRETCH_SLOWED``). A fleet slowed 2x is still read
    within a few answers."""
    for slow in (1.0, 2.0):
        a, clock = admission(2.0, cap=4)
        t = a.config.tenant("t")
        rng = random.Random(11)
        opened = fleet_slowed = pace_slowed = 0
        for i in range(700):
            out, prompt = rng.randint(1, 400), int(math.exp(rng.uniform(math.log(50), math.log(8000))))
            lease = a.decide(t, f"w{i}", E(prompt, out), 10).lease
            assert lease is not None
            f = slow if i >= 500 else 1.0
            clock.advance((0.4 + 0.02 * out + 0.0002 * prompt) * math.exp(rng.gauss(0, 0.35)) * f)
            a.complete(lease.ticket, Usage(prompt, out), responded=True)
            clock.advance(4.0)
            if i < 100 or (slow == 1.0 and i % 10) or (slow != 1.0 and i < 510):
                continue
            held = fill(a, t, f"h{i}-", 4)
            d = a.decide(t, f"x{i}", E(), 10)
            if d.lease is not None:
                opened += 1
                a.complete(d.lease.ticket, None, responded=False)
            for x in held:
                a.complete(x.ticket, None, responded=False)
            if slow == 1.0:
                state = a.tenant_state("t")
                assert state is not None and state.fleet_seconds is not None and state.norm_pace is not None
                fleet_slowed += state.fleet_seconds[0] > SLOWED_AT * state.fleet_seconds[1]
                pace_slowed += (state.mean_pace or 0.0) > STRETCH_AT * state.norm_pace
        if slow == 1.0:
            assert opened <= 3, f"healthy: the stretch read open at {opened} of 60 checks"
            # (24 of 60 with each answer choosing its norm's rate by its own side of it) and each signal on its own
            # (the stretch reads the smaller, the fleet-caused 429 the duration alone): 1 and 1 of 60 here
            assert fleet_slowed <= 6 and pace_slowed <= 6, (fleet_slowed, pace_slowed)
        else:  # (read open at most checks from ten answers into the slowdown on: 125 of 190 here, the duration of
            # answers this varied dipping under the bar now and then; 23 with the norms held only at SLOWED's 1.5)
            assert opened >= 0.5 * 190, opened


def test_a_slowdown_between_the_stretchs_bar_and_the_fleet_caused_one_stretches_and_scales_nothing() -> None:
    """A fleet 1.4x slower than usual: past ``STRETCH_SLOWED`` (1.3), so the cap grows by that slowdown; short of
    ``SLOWED`` (1.5), so the 429 past the stretch is the tenant's own, not the fleet's doing."""
    a, clock = admission(2.0, cap=10)
    t = a.config.tenant("t")
    history(a, clock, t, STEADY + [1.45] * 12, gap=4.0)
    state = a.tenant_state("t")
    assert state is not None and state.fleet_seconds is not None
    ratio = state.fleet_seconds[0] / state.fleet_seconds[1]
    assert 1.3 < ratio < 1.5
    fill(a, t, "h", 10)
    stretched = 0
    while (d := a.decide(t, f"s{stretched}", E(), 10)).lease is not None:
        stretched += 1
    assert stretched == int(10 * ratio) - 10 > 0
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency" and not d.rejection.fleet_caused
