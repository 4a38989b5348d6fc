"""Shed parity (``queue.shed_parity_gap``, issue 30 §3): strict priority decides who waits, not who is refused
wholesale. A tier below the top that was refused more than the gap more often than the tiers above it over
the last minute is *lagging*: owed a release after one from above, and its tenants' protective concurrency
caps stretch with their slowdown meanwhile. A tenant's own excess never makes its tier lagging."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.admission import Decision
from ext_proc.core import Core
from ext_proc.queue import PARITY_MIN_OFFERED, SHARE_TAU_S, Entry, FairQueue, TierSpec
from ext_proc.reasons import reject
from tests.test_best_effort import answer, ask, idle, make
from tests.test_queue import released

TIERS = [TierSpec("interactive", 0, 60), TierSpec("standard", 1, 60), TierSpec("batch", 2, 60)]


def queue(gap: float | None = 0.05) -> FairQueue:
    q = FairQueue(TIERS, 1000, 3)
    q.parity_gap = gap
    return q


def tally(q: FairQueue, tier: str, served: int, refused: int, now: float = 0.0) -> None:
    for _ in range(served):
        q.tally(tier, False, now)
    for _ in range(refused):
        q.tally(tier, True, now)


def fill(q: FairQueue) -> None:
    """Four batch requests behind ten interactive ones, all the same size."""
    for i in range(4):
        q.push(Entry(f"b{i}", "bt", "batch", 10, 0, 60), 0)
    for i in range(10):
        q.push(Entry(f"i{i}", "it", "interactive", 10, 0, 60), 0)


def test_a_tier_refused_more_than_the_gap_above_the_tiers_above_goes_every_other_release() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 80, 20)
    assert q.lagging("batch") and not q.lagging("interactive")
    assert q.refused_share("batch") == 0.2
    fill(q)
    assert released(q, 8, 1) == ["i0", "b0", "i1", "b1", "i2", "b2", "i3", "b3"]


def test_within_the_gap_the_starvation_guard_alone_decides() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 96, 4)  # 4% refused against 0%: within 5 points
    assert not q.lagging("batch")
    fill(q)
    assert released(q, 8, 1) == ["i0", "i1", "i2", "b0", "i3", "i4", "i5", "b1"]


def test_the_tiers_above_are_counted_together_and_refused_too_they_owe_nothing() -> None:
    q = queue()
    tally(q, "interactive", 50, 0)
    tally(q, "standard", 30, 20)  # 40% refused: 20% of the tiers above batch together
    tally(q, "batch", 76, 24)  # 24%: within 5 points of 20%
    assert q.lagging("standard") and not q.lagging("batch")
    tally(q, "batch", 0, 5)  # 29 of 105, 27.6%: past it
    assert q.lagging("batch")


def test_off_without_a_gap_and_never_the_top_tier() -> None:
    q = queue(None)
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 0, 100)
    assert not q.lagging("batch") and q.refused_share("batch") is None
    q = queue()
    tally(q, "interactive", 0, 100)
    tally(q, "batch", 100, 0)
    assert not q.lagging("interactive")


def test_a_few_refusals_are_not_a_pattern_and_the_ledger_forgets_within_minutes() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    n = math.ceil(PARITY_MIN_OFFERED) - 1
    tally(q, "batch", 0, n)
    assert not q.lagging("batch"), "fewer decisions than the evidence it takes"
    tally(q, "batch", 0, 1)
    assert q.lagging("batch")
    # five minutes on, one request served: what was refused then has faded below the evidence
    tally(q, "batch", 1, 0, now=5 * SHARE_TAU_S)
    assert not q.lagging("batch")


def test_a_tier_of_the_same_rank_is_not_above_it() -> None:
    q = FairQueue([TierSpec("interactive", 0, 60), TierSpec("a", 1, 60), TierSpec("b", 1, 60)], 1000, 3)
    q.parity_gap = 0.05
    tally(q, "a", 0, 100)
    tally(q, "b", 100, 0)
    assert not q.lagging("a") and not q.lagging("b"), "no tier above either has decided anything"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["interactive", "standard", "batch"]), st.booleans(),
                          st.floats(0, 30)), max_size=120))
def test_lagging_is_exactly_the_rule_over_the_decayed_counts(events: list[tuple[str, bool, float]]) -> None:
    """Whatever the sequence: a tier is lagging iff it is below the top, has the evidence, and its decayed
    refused share is more than the gap above the decayed share of the tiers above together."""
    q = queue()
    now = 0.0
    log: list[tuple[str, bool, float]] = []
    for tier, refused, dt in events:
        now += dt
        q.tally(tier, refused, now)
        log.append((tier, refused, now))
        counts = {t.name: [0.0, 0.0] for t in TIERS}
        for name, r, at in log:
            f = math.exp(-(now - at) / SHARE_TAU_S)
            counts[name][0] += f
            counts[name][1] += f if r else 0.0
        for spec in TIERS:
            d, r = counts[spec.name]
            above = [counts[t.name] for t in TIERS if t.rank < spec.rank]
            total = sum(x[0] for x in above)
            want = spec.rank > 0 and d >= PARITY_MIN_OFFERED and total > 0 and \
                r / d > sum(x[1] for x in above) / total + 0.05
            share = q.refused_share(spec.name)
            if d > 0:
                assert share is not None and math.isclose(share, r / d, rel_tol=1e-9, abs_tol=1e-12)
            near = d > 0 and total > 0 and abs(r / d - sum(x[1] for x in above) / total - 0.05) < 1e-9
            if not near and abs(d - PARITY_MIN_OFFERED) > 1e-9:
                assert q.lagging(spec.name) == want, (spec.name, counts)


# -- what the admission counts, and the concurrency cap it stretches -------------------------------------

def test_only_capacity_refusals_and_quota_429s_the_fleet_caused_count_as_refused() -> None:
    core, _ = make()
    q = core.admission.queue_of("default")
    a = core.admission
    a.tally(Decision("b", "batch", None, reject("tenant-concurrency")), "default", 0.0)
    a.tally(Decision("b", "batch", None, reject("tenant-tokens")), "default", 0.0)
    a.tally(Decision("b", "batch", None, reject("body-too-large")), "default", 0.0)
    assert q.refused_share("batch") is None, "a tenant's own excess and a bad request are not counted"
    a.tally(Decision("b", "batch", None, reject("queue-timeout")), "default", 0.0)
    a.tally(Decision("b", "batch", None, replace(reject("tenant-concurrency"), fleet_caused=True)), "default", 0.0)
    assert q.refused_share("batch") == 1.0
    a.tally(Decision("b", "batch", None, reject("queue-timeout")), "no-such-pool", 0.0)  # (no queue: nothing)
    assert q.refused_share("batch") == 1.0
    # a tenant without a protective limit has no bound on what it asks: its refusals owe its tier nothing
    a.tally(Decision("i", "batch", None, reject("queue-timeout")), "default", 0.0)
    a.tally(Decision("i", "batch", None, reject("queue-timeout")), "default", 0.0)
    a.tally(Decision("i", "batch", None, reject("queue-timeout")), "default", 0.0)
    a.tally(Decision("b", "batch", None, reject("tenant-tokens")), "default", 0.0)
    assert q.refused_share("batch") == 1.0
    v = q._ledger["batch"]
    assert math.isclose(v[0], 2.0), "two counted: the bounded tenant's queue-timeout and fleet-caused 429"


def slowed_and_lagging(core: Core, ratio: float) -> None:
    b = core.admission.tenant_state("b")
    assert b is not None
    b.norm_seconds, b.mean_seconds = 1.0, ratio
    q = core.admission.queue_of("default")
    tally(q, "interactive", 100, 0, core.now())
    tally(q, "batch", 50, 50, core.now())
    assert q.lagging("batch")


def test_lagging_and_slowed_a_best_effort_cap_stretches_and_the_request_is_charged() -> None:
    core, clock = make(tenant={"max_concurrent": 2})
    assert answer(ask(core, "r1")).decision.lease is not None
    assert answer(ask(core, "r2")).decision.lease is not None
    slowed_and_lagging(core, 1.6)
    d = answer(ask(core, "r3")).decision
    assert d.admitted and d.best_effort is None, "within the stretched cap (2 x 1.6 = 3): an ordinary admission"
    b = core.admission.tenant_state("b")
    assert b is not None and b.inflight == 3
    idle(core, clock, 0.99)  # no spare room: past the stretched cap it is a 429 (best effort has none)
    d = answer(ask(core, "r4")).decision
    assert not d.admitted and d.rejection is not None and d.rejection.reason == "tenant-concurrency"


def test_the_stretch_is_at_most_twice_the_cap() -> None:
    core, clock = make(tenant={"max_concurrent": 2})
    slowed_and_lagging(core, 10.0)
    idle(core, clock, 0.0)
    got = [answer(ask(core, f"r{i}")).decision for i in range(6)]
    assert [d.best_effort is None and d.admitted for d in got] == [True] * 4 + [False] * 2


def test_a_cap_that_may_not_be_exceeded_does_not_stretch() -> None:
    core, _ = make("refuse", tenant={"max_concurrent": 2})
    slowed_and_lagging(core, 1.6)
    got = [answer(ask(core, f"r{i}")).decision for i in range(3)]
    assert [d.admitted for d in got] == [True, True, False]
    assert got[2].rejection is not None and got[2].rejection.reason == "tenant-concurrency"


def test_not_slowed_or_not_behind_the_cap_stays() -> None:
    for ratio, extra in ((1.4, None), (1.6, {"queue": {"inject_priority": True, "shed_parity_gap": None}})):
        core, clock = make(tenant={"max_concurrent": 2}, extra=extra)
        assert [answer(ask(core, f"r{i}")).decision.best_effort is None for i in range(2)] == [True, True]
        b = core.admission.tenant_state("b")
        assert b is not None
        b.norm_seconds, b.mean_seconds = 1.0, ratio
        q = core.admission.queue_of("default")
        tally(q, "interactive", 100, 0, core.now())
        tally(q, "batch", 50, 50, core.now())
        assert q.lagging("batch") == (extra is None)
        idle(core, clock, 0.99)  # no spare room for best effort either
        d = answer(ask(core, "r3")).decision
        assert not d.admitted and d.rejection is not None and d.rejection.reason == "tenant-concurrency", ratio
