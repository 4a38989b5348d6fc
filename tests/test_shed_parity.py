"""Shed parity (``queue.shed_parity_gap``, issue 30 §3): strict priority decides who waits, not who is refused
wholesale. A tier below the top that was refused more than the gap more often than the tiers above it over
the last minute is *lagging*: owed a release after one from above (without its KV reserve, as the starvation
guard's own) until it is back within half the gap. A tenant's own excess never makes its tier lagging."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ext_proc.admission import Decision
from ext_proc.core import Held
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
    tally(q, "interactive", 100, 0)
    tally(q, "b", 0, 12)  # 12 of 112 (10.7%) against interactive's 0%: a, all refused, is beside it, not above
    assert q.lagging("a") and q.lagging("b")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["interactive", "standard", "batch"]), st.booleans(),
                          st.floats(0, 30)), max_size=160))
def test_lagging_is_exactly_the_rule_over_the_decayed_counts(events: list[tuple[str, bool, float]]) -> None:
    """Whatever the sequence, after each decision: a tier is lagging iff it is below the top, it and the tiers
    above it together each have the evidence, and its decayed refused share is past the decayed share of the
    tiers above by the gap — by half the gap if it was lagging before (hysteresis)."""
    q = queue()
    now = 0.0
    log: list[tuple[str, bool, float]] = []
    before: set[str] = set()
    for tier, refused, dt in events:
        now += dt
        q.tally(tier, refused, now)
        log.append((tier, refused, now))
        counts = {t.name: [0.0, 0.0] for t in TIERS}
        for name, r, at in log:
            f = math.exp(-(now - at) / SHARE_TAU_S)
            counts[name][0] += f
            counts[name][1] += f if r else 0.0
        after: set[str] = set()
        for spec in TIERS:
            d, r = counts[spec.name]
            above = [counts[t.name] for t in TIERS if t.rank < spec.rank]
            total = sum(x[0] for x in above)
            line = 0.025 if spec.name in before else 0.05
            margin = r / d - sum(x[1] for x in above) / total - line if d > 0 and total > 0 else 1.0
            want = spec.rank > 0 and d >= PARITY_MIN_OFFERED and total >= PARITY_MIN_OFFERED and margin > 0
            share = q.refused_share(spec.name)
            if d > 0:
                assert share is not None and math.isclose(share, r / d, rel_tol=1e-9, abs_tol=1e-12)
            edge = abs(margin) < 1e-9 or abs(d - PARITY_MIN_OFFERED) < 1e-9 or abs(total - PARITY_MIN_OFFERED) < 1e-9
            got = q.lagging(spec.name)
            if not edge:
                assert got == want, (spec.name, counts, before)
            if got:
                after.add(spec.name)
        before = after


def test_a_share_exactly_at_the_gap_is_not_past_it() -> None:
    q = queue(0.25)
    tally(q, "interactive", 20, 0)
    tally(q, "batch", 15, 5)  # 0.25 refused, 0 above: at the line, not past it
    assert not q.lagging("batch")
    tally(q, "batch", 0, 1)
    assert q.lagging("batch")


def test_the_tiers_above_need_the_evidence_too() -> None:
    q = queue()
    tally(q, "interactive", math.ceil(PARITY_MIN_OFFERED) - 1, 0)
    tally(q, "batch", 50, 50)
    assert not q.lagging("batch"), "a few served chat requests are no baseline (review91 M3)"
    tally(q, "interactive", 1, 0)
    assert q.lagging("batch")


def test_once_lagging_a_tier_stays_so_until_within_half_the_gap() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 90, 10)  # 10% against 0%: past 5 points
    assert q.lagging("batch")
    tally(q, "batch", 150, 0)  # 10 of 250, 4%: within the gap, past half of it
    assert q.lagging("batch")
    tally(q, "batch", 200, 0)  # 10 of 450, 2.2%: within half the gap
    assert not q.lagging("batch")
    tally(q, "batch", 0, 10)  # 20 of 460, 4.3%: within the gap again, not yet lagging
    assert not q.lagging("batch")


def test_turning_it_off_on_a_reload_ends_the_lagging_at_once_and_forgets_the_ledger() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 50, 50)
    assert q.lagging("batch")
    q.parity_gap = None
    assert not q.lagging("batch") and q.refused_share("batch") is None
    fill(q)
    assert released(q, 4, 1) == ["i0", "i1", "i2", "b0"], "the starvation guard alone again"
    q.parity_gap = 0.05
    assert not q.lagging("batch"), "back on, it starts from an empty ledger"


def test_a_wider_gap_on_a_reload_is_read_at_once() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 80, 20)
    assert q.lagging("batch")
    q.parity_gap = 0.5
    assert not q.lagging("batch")


def test_a_tier_a_reload_removes_leaves_the_ledger() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "standard", 100, 0)
    tally(q, "batch", 50, 50)
    q.set_tiers([TierSpec("interactive", 0, 60), TierSpec("batch", 2, 60)])
    assert q.refused_share("standard") is None and q.lagging("batch")


def test_a_quiet_pool_stops_lagging_as_its_ledger_fades() -> None:
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 50, 50)
    assert q.lagging("batch") and q.lagging_at(0.0) == {"batch"}
    assert q.lagging_at(10 * SHARE_TAU_S) == frozenset() and q.lagging("batch"), "a scrape changes nothing"
    q.refresh(10 * SHARE_TAU_S)
    assert not q.lagging("batch")


def test_a_lagging_tier_is_owed_a_turn_after_one_release_and_never_goes_twice_running() -> None:
    """review91 M1: a lagging tier that ran up a debt (its head could not be placed while the tiers above went)
    is owed one release, then one from above goes — the debt is paid against the threshold in force."""
    q = queue()
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 50, 50)
    q.push(Entry("b0", "bt", "batch", 100, 0, 60), 0)
    q.push(Entry("big", "bt", "batch", 10_000, 0, 60), 0)  # the tier's mean request: far above its short ones
    for i in range(1, 3):
        q.push(Entry(f"b{i}", "bt", "batch", 100, 0, 60), 0)
    for i in range(4):
        q.push(Entry(f"i{i}", "it", "interactive", 100, 0, 60), 0)
    assert not q.guarded("batch")
    q.passed("interactive", 10_000)  # one large release from above while batch could not go: its turn, ...
    assert q.guarded("batch"), "... without its KV reserve, as the starvation guard's own release"
    for _ in range(7):
        q.passed("interactive", 10_000)  # eight in all
    # b0 pays a sliver of its debt (100 tokens of a 2,575-token mean); paid against the guard's eight, the
    # debt left owed batch ``big`` straight after it
    assert released(q, 8, 1) == ["b0", "i0", "big", "i1", "b1", "i2", "b2", "i3"]


def drained(q: FairQueue) -> None:
    """A drain rate to predict from: eight 100-token interactive requests released over the first second."""
    for i in range(8):
        q.push(Entry(f"w{i}", "it", "interactive", 100, i / 8, 60), i / 8)
        e = q.peek()
        assert e is not None
        q.take(e, (i + 1) / 8)


def test_the_tiers_above_a_lagging_one_predict_its_turns_in_their_wait() -> None:
    """attack90 F4: an interactive request's predicted wait counts the lagging tier's releases between."""
    q = queue()
    drain = FairQueue(TIERS, 1000, 3)
    for x in (q, drain):
        drained(x)
        for i in range(4):
            x.push(Entry(f"b{i}", "bt", "batch", 100, 1, 60), 1)
            x.push(Entry(f"i{i}", "it", "interactive", 100, 1, 60), 1)
    plain = drain.predicted_wait("it", "interactive", 100)
    assert plain is not None
    tally(q, "interactive", 100, 0, 1)
    tally(q, "batch", 50, 50, 1)
    assert q.lagging("batch")
    lag = q.predicted_wait("it", "interactive", 100)
    assert lag is not None and lag > plain * 1.5


def test_sharing_lower_tiers_a_lagging_tier_still_gets_its_turns() -> None:
    q = FairQueue(TIERS, 1000, 8, share_lower=True)
    q.parity_gap = 0.05
    tally(q, "interactive", 100, 0)
    tally(q, "batch", 50, 50)
    for i in range(3):
        q.push(Entry(f"b{i}", "bt", "batch", 10, 0, 60), 0)
    for i in range(6):
        q.push(Entry(f"i{i}", "it", "interactive", 10, 0, 60), 0)
    assert released(q, 6, 1) == ["i0", "b0", "i1", "b1", "i2", "b2"]


# -- what the admission counts ---------------------------------------------------------------------------

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


def test_a_lagging_tiers_concurrency_caps_stay_exact() -> None:
    """Shed parity changes the queue's order, not a tenant's quota: a fleet-caused cap 429 stays a 429 (the
    demand the scaler scales on) while the tier lags."""
    core, clock = make(tenant={"max_concurrent": 2})
    assert [answer(ask(core, f"r{i}")).decision.best_effort is None for i in range(2)] == [True, True]
    b = core.admission.tenant_state("b")
    assert b is not None
    b.norm_seconds, b.mean_seconds = 1.0, 1.8
    b.fleet_seconds = (1.8, 1.0)  # (the fleet serves it 1.8x slower than usual)
    q = core.admission.queue_of("default")
    tally(q, "interactive", 100, 0, core.now())
    tally(q, "batch", 50, 50, core.now())
    assert q.lagging("batch")
    idle(core, clock, 0.99)  # no spare room for best effort: it waits for some, in vain
    held = ask(core, "r3")
    assert isinstance(held, Held)
    clock.advance(held.max_wait_s + 0.01)
    core.tick()
    [a] = core.answers()
    d = a.decision
    assert not d.admitted and d.rejection is not None and d.rejection.reason == "tenant-concurrency"
    assert d.rejection.fleet_caused


def test_a_queued_request_that_times_out_is_counted_once_through_the_core() -> None:
    """review91 M2: the core's every final decision feeds the ledger — a held request at its delivery, not
    when it is held, and once."""
    core, clock = make(tenant={"max_concurrent": 10})
    idle(core, clock, 0.999)  # no node has room: the batch requests wait
    q = core.admission.queue_of("default")
    held = [ask(core, f"r{i}") for i in range(3)]
    assert all(isinstance(h, Held) for h in held)
    assert q.refused_share("batch") is None, "nothing is decided while it waits"
    for _ in range(100):
        clock.advance(0.5)
        core.tick()
    got = core.answers()
    assert len(got) == 3 and all(a.decision.rejection is not None for a in got)
    assert {a.decision.rejection.reason for a in got if a.decision.rejection} <= {"queue-timeout", "queue-deadline"}
    assert q.refused_share("batch") == 1.0 and math.isclose(q._ledger["batch"][0], 3.0, rel_tol=0.05)
    idle(core, clock, 0.0)
    d = answer(ask(core, "r9")).decision
    assert d.admitted
    assert math.isclose(q._ledger["batch"][0] - q._ledger["batch"][1], 1.0, rel_tol=1e-6), "served: one more"


@pytest.mark.parametrize("limit", [{"max_concurrent": 10}, {"requests_per_minute": 6000},
                                   {"tokens_per_minute": 10_000_000}, {}])
def test_every_protective_limit_makes_a_tenant_counted_and_none_leaves_it_out(limit: dict[str, int]) -> None:
    core, _ = make(tenant={"max_concurrent": None, **limit})
    a = core.admission
    a.tally(Decision("b", "batch", None, reject("queue-timeout")), "default", 0.0)
    assert (a.queue_of("default").refused_share("batch") is not None) == bool(limit)


def test_queue_full_is_counted_only_where_the_tier_itself_does_not_fill_the_queue() -> None:
    """attack90 F2: a queue-full 503 where the arrival's own tier holds half the queue or more is its own
    flood; review92 L1: one where the tiers above fill it is priority refusing it, and counts."""
    core, _ = make()
    a = core.admission
    q = a.queue_of("default")
    q.max_size = 4
    for i in range(2):
        q.push(Entry(f"x{i}", "b", "interactive", 10, 0, 60), 0)
    a.tally(Decision("b", "batch", None, reject("queue-full")), "default", 0.0)
    assert q.refused_share("batch") == 1.0, "a queue the tiers above fill: counted"
    q.parity_gap = None
    q.parity_gap = 0.05
    for i in range(2):
        q.push(Entry(f"y{i}", "b", "batch", 10, 0, 60), 0)
    a.tally(Decision("b", "batch", None, reject("queue-full")), "default", 0.0)
    assert q.refused_share("batch") is None, "its own tier holds half the queue: not counted"
    a.tally(Decision("b", "batch", None, reject("queue-evicted")), "default", 0.0)
    assert q.refused_share("batch") == 1.0, "evicted for a more urgent arrival: counted"


def test_the_metrics_say_which_tier_is_lagging_and_its_refused_share() -> None:
    core, clock = make()
    q = core.admission.queue_of("default")
    tally(q, "interactive", 100, 0, core.now())
    tally(q, "batch", 60, 40, core.now())
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_queue_tier_lagging{pool="default",tier="batch"} 1.0' in text
    assert 'kvgate_queue_tier_lagging{pool="default",tier="interactive"} 0.0' in text
    assert 'kvgate_queue_tier_refused_ratio{pool="default",tier="batch"} 0.4' in text
    assert 'kvgate_queue_tier_refused_ratio{pool="default",tier="standard"}' not in text, "nothing counted there"
    clock.advance(10 * SHARE_TAU_S)  # a quiet pool: the scrape reads the ledger as of now, and changes nothing
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_queue_tier_lagging{pool="default",tier="batch"} 0.0' in text
    assert 'kvgate_queue_tier_refused_ratio{pool="default",tier="batch"}' not in text
    assert q.lagging("batch")


def test_the_top_tier_predicts_a_whole_turn_of_a_lagging_tier_per_request_ahead() -> None:
    """review92 M2: a queued top-tier release owes a lagging tier a whole release, whatever their sizes."""
    waits = {}
    for gap in (None, 0.05):
        q = queue(gap)
        drained(q)
        for i in range(4):
            q.push(Entry(f"b{i}", "bt", "batch", 10_000, 1, 60), 1)
            q.push(Entry(f"i{i}", "it", "interactive", 100, 1, 60), 1)
        tally(q, "interactive", 100, 0, 1)
        tally(q, "batch", 50, 50, 1)
        w = q.predicted_wait("it", "interactive", 100)
        assert w is not None
        waits[gap] = w
    # four 100-token requests ahead (and its own): four 10,000-token batch turns between them
    assert waits[0.05] > waits[None] + 40_000 / 800 * 0.9


def test_one_large_top_tier_request_is_one_request_ahead_of_the_lagging_turns() -> None:
    """attack93 H1: a prompt far above the top tier's mean queued request is one request: it waits for one
    lagging turn per request ahead of it, not for the lagging tier's whole queue."""
    q = queue()
    drained(q)
    q.push(Entry("c", "ct", "interactive", 20, 1, 60), 1)
    for i in range(40):
        q.push(Entry(f"b{i}", "bt", "batch", 8_000, 1, 60), 1)
    plain = q.predicted_wait("it", "interactive", 6_000)
    tally(q, "interactive", 100, 0, 1)
    tally(q, "batch", 50, 50, 1)
    lag = q.predicted_wait("it", "interactive", 6_000)
    assert plain is not None and lag is not None
    # one chat request ahead and itself: two batch turns of 8,000 tokens, not forty
    rate = (20 + 6_000) / plain  # parity off: the chat request ahead and itself, over the drain rate
    assert lag == pytest.approx(plain + 2 * 8_000 / rate, rel=0.05)
