"""The scaler's control law, table-driven, with an injected clock."""

from __future__ import annotations

import pytest

from scaler.law import ControlLaw, LawSettings, Signals


def sig(at: float, admitted: float = 100, rejected: float = 0, replicas: int | None = 2, held: float = 0,
        complete: bool = True, by: dict[str, float] | None = None, policy: dict[str, float] | None = None) -> Signals:
    adm = {"a": admitted / 2, "b": admitted / 2}
    rej = by if by is not None else {"a": rejected / 2, "b": rejected / 2}
    return Signals(at, adm, rej, policy or {}, held, replicas, complete)


S = LawSettings(min_replicas=1, max_replicas=8, step=2, cooldown_s=600)


@pytest.mark.parametrize(("rejected", "action", "desired"), [
    (50, "up", 4),     # 50 / 150 = 33% > 25%: +2
    (40, "up", 4),     # 40 / 140 = 28.6%
    (30, "hold", 2),   # 30 / 130 = 23%: between the thresholds
    (15, "hold", 2),   # 15 / 115 = 13%
    (0, "hold", 2),    # low, but the cooldown has only started
])
def test_one_evaluation(rejected: float, action: str, desired: int) -> None:
    v = ControlLaw(S).decide(sig(0, rejected=rejected), 0)
    assert (v.action, v.desired) == (action, desired), v.reason


def test_budget_rejections_never_scale_up() -> None:
    # every tenant far over its own request / token budget: a quota problem everywhere, never GPUs
    flood = {"a": 5000.0, "b": 5000.0}
    v = ControlLaw(S).decide(Signals(0, {"a": 50, "b": 50}, {}, flood, 0, 2, True, budget_rejected=flood), 0)
    assert v.action == "hold" and v.desired == 2 and v.reject_rate == 0


def test_scale_down_only_after_a_whole_cooldown_of_low_rejections_one_at_a_time() -> None:
    law = ControlLaw(S)
    law.decide(sig(0, replicas=4), 0)
    steps = [(t, law.decide(sig(t, replicas=4 if t < 700 else 3), t)) for t in range(0, 1400, 50)]
    downs = [(t, v.desired) for t, v in steps if v.action == "down"]
    assert downs == [(600, 3), (1200, 2)]


def test_an_in_between_rate_restarts_the_cooldown() -> None:
    law = ControlLaw(S)
    law.decide(sig(0, replicas=4), 0)
    law.decide(sig(500, replicas=4), 500)
    law.decide(sig(550, rejected=15, replicas=4), 550)  # 13%: between the thresholds
    assert law.decide(sig(700, replicas=4), 700).action == "hold"
    assert law.decide(sig(1300, replicas=4), 1300).action == "down"


@pytest.mark.parametrize("bad", ["none", "stale", "incomplete"])
def test_no_data_holds_and_never_scales_down(bad: str) -> None:
    law = ControlLaw(S)
    law.decide(sig(0, replicas=4), 0)
    for t in range(0, 3000, 100):
        s = None if bad == "none" else sig(t - 100 if bad == "stale" else t, replicas=4, complete=bad != "incomplete")
        v = law.decide(s, t + (70 if bad == "stale" else 0))
        assert v.action == "hold" and v.desired == 4, v.reason


def test_a_scale_up_is_not_repeated_while_its_replicas_are_loading() -> None:
    law = ControlLaw(S)
    assert law.decide(sig(0, rejected=80, replicas=2), 0).desired == 4
    for t in (30, 60, 90):  # still 2 up, rejections go on: expected during a cold start
        v = law.decide(sig(t, rejected=80, replicas=2), t)
        assert (v.action, v.desired) == ("hold", 4) and "already asked" in v.reason
    v = law.decide(sig(120, rejected=80, replicas=4), 120)  # they just came: the window has not seen them yet
    assert (v.action, v.desired) == ("hold", 4) and "cover it" in v.reason
    v = law.decide(sig(180, rejected=80, replicas=4), 180)  # a whole window with them, still 44% short
    assert (v.action, v.desired) == ("up", 8) and "4.0 up over the window / 56% served = 8 needed" in v.reason


def test_rejections_concentrated_in_one_tenants_quota_are_a_policy_problem() -> None:
    # tenant "rag" is far over its quota (429s) and its overflow is also most of the 503s
    v = ControlLaw(S).decide(sig(0, admitted=100, by={"rag": 45, "a": 3}, policy={"rag": 400}), 0)
    assert (v.action, v.desired, v.policy_tenant) == ("hold", 2, "rag") and "quota" in v.reason
    # the same quota problem, but the other tenants are short of capacity too: scale up, and report it
    v = ControlLaw(S).decide(sig(0, admitted=100, by={"rag": 45, "a": 60}, policy={"rag": 400}), 0)
    assert (v.action, v.policy_tenant) == ("up", "rag")
    # 503s concentrated in one tenant without any quota trouble: capacity, scale up
    v = ControlLaw(S).decide(sig(0, admitted=100, by={"rag": 95, "a": 2}), 0)
    assert (v.action, v.policy_tenant) == ("up", None)
    # 429s spread over tenants: nobody's problem in particular
    v = ControlLaw(S).decide(sig(0, policy={"a": 50, "b": 50}), 0)
    assert v.policy_tenant is None


def test_bounds_and_warm_pool() -> None:
    law = ControlLaw(LawSettings(min_replicas=1, max_replicas=5, step=2, warm_pool=1))
    assert law.decide(sig(0, rejected=80, replicas=2), 0).desired == 4  # demand 1 -> 3, +1 warm
    assert law.decide(sig(10, rejected=80, replicas=4), 10).action == "hold"  # they just came: the window
    v = law.decide(sig(70, rejected=80, replicas=4), 70)  # has not seen them yet; now a whole window has
    assert (v.action, v.desired) == ("up", 5)  # demand 3 -> 5 at most; + warm would be 6: capped at max 5
    v = law.decide(sig(80, rejected=80, replicas=5), 80)
    assert (v.action, v.desired) == ("hold", 5) and "bounded" in v.reason
    low = ControlLaw(LawSettings(min_replicas=2, max_replicas=5, cooldown_s=10))
    low.decide(sig(0, replicas=2), 0)
    v = low.decide(sig(20, replicas=2), 20)
    assert v.desired == 2 and v.action == "hold"  # at the floor


def test_scale_from_zero_when_requests_are_held() -> None:
    law = ControlLaw(LawSettings(min_replicas=0, max_replicas=4))
    idle = Signals(0, {}, {}, {}, 0, 0, True)
    assert law.decide(idle, 0).desired == 0
    waiting = Signals(5, {}, {}, {}, 3, 0, True)
    v = law.decide(waiting, 5)
    assert (v.action, v.desired) == ("up", 1)


def test_signals_from_a_real_kvgate_exposition() -> None:
    from prometheus_client import generate_latest

    from ext_proc.admission import Decision, Rejection
    from ext_proc.config import parse_config
    from ext_proc.server import Gateway
    from scaler.signals import parse_kvgate

    gw = Gateway(parse_config({"tenants": [{"name": "a"}, {"name": "b"}]}))
    assert parse_kvgate(generate_latest(gw.stats.registry).decode()).nodes is None  # Envoy picks: unknown
    gw.stats.decision(Decision("a", "standard", None, Rejection(503, "queue-timeout", "capacity", "")))
    gw.stats.decision(Decision("b", "standard", None, Rejection(429, "tenant-tokens", "policy", "")))
    r = parse_kvgate(generate_latest(gw.stats.registry).decode())
    assert r.totals == {("capacity", "a"): 1, ("policy", "b"): 1, ("budget", "b"): 1}  # b: over its own budget
    with_nodes = Gateway(parse_config({"nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}]}}))
    export = getattr(with_nodes, "export_nodes", None)  # node gauges pushed (before ext_proc/core.py) or
    if export is not None:  # computed at scrape time (after it)
        export()
    assert parse_kvgate(generate_latest(with_nodes.stats.registry).decode()).nodes == 1


# -- restarts and missing data: no verdict before the first complete window; a hold never goes below the
# replicas last observed. Each row: a script of (time, signals) fed to a fresh law (a restart), then the
# expected (ready, desired, action, missing_data) after each step. "x" = no read at all (source down).
def _step(spec: str, t: float) -> Signals | None:
    """'x': unreadable; 'ok4': complete, 4 replicas; 'part4': a kvgate replica silent; 'old4': 100 s stale;
    'up4': complete with a 33% capacity reject rate; a trailing '?' instead of a count: replicas unknown."""
    if spec == "x":
        return None
    kind, n = spec.rstrip("0123456789?"), spec.lstrip("abcdefghijklmnopqrstuvwxyz")
    replicas = None if n == "?" else int(n)
    return sig(t - 100 if kind == "old" else t, rejected=50 if kind == "up" else 0, replicas=replicas,
               complete=kind != "part")


LOW = LawSettings(min_replicas=1, max_replicas=8, step=2, cooldown_s=600)


@pytest.mark.parametrize(("script", "expected"), [
    pytest.param(["part4", "ok4"], [(False, 4, "hold", True), (True, 4, "hold", False)],
                 id="restart: the direct source's first read is incomplete, then the pool's size is kept"),
    pytest.param(["x", "x", "ok4"], [(False, 1, "hold", True), (False, 1, "hold", True), (True, 4, "hold", False)],
                 id="restart with the source down: no verdict, and the law is not pinned to min_replicas"),
    pytest.param(["old4", "ok4"], [(False, 4, "hold", True), (True, 4, "hold", False)],
                 id="restart on stale data: no verdict"),
    pytest.param(["part6", "x", "ok6"], [(False, 6, "hold", True), (False, 6, "hold", True),
                                         (True, 6, "hold", False)],
                 id="restart: the placeholder is the replicas last observed, even across a failed read"),
    pytest.param(["ok2", "ok5", "x", "part5", "old5"],
                 [(True, 2, "hold", False), (True, 2, "hold", False), (True, 5, "hold", True),
                  (True, 5, "hold", True), (True, 5, "hold", True)],
                 id="data goes missing: never below the 5 replicas last observed (the law's own count is 2)"),
    pytest.param(["ok2", "up2", "x", "part2"],
                 [(True, 2, "hold", False), (True, 4, "up", False), (True, 4, "hold", True), (True, 4, "hold", True)],
                 id="data goes missing during a scale-up: the law's higher count holds"),
    pytest.param(["ok?", "x", "part?"], [(True, 1, "hold", False), (True, 1, "hold", True), (True, 1, "hold", True)],
                 id="replicas never reported: the law's own count holds"),
    pytest.param(["ok9", "x"], [(True, 8, "hold", False), (True, 9, "hold", True)],
                 id="the observed floor wins over max_replicas: no data never shrinks the pool"),
])
def test_restarts_and_missing_data(script: list[str], expected: list[tuple[bool, int, str, bool]]) -> None:
    law = ControlLaw(LOW)
    got = []
    for i, spec in enumerate(script):
        t = 5.0 * i
        v = law.decide(_step(spec, t), t)
        assert v.ready == law.ready
        got.append((v.ready, v.desired, v.action, v.missing_data))
    assert got == expected


def test_a_hold_on_missing_data_says_why_and_names_the_floor() -> None:
    law = ControlLaw(LOW)
    assert "no verdict yet" in law.decide(None, 0).reason
    law.decide(sig(1, replicas=2), 1)
    law.decide(sig(2, replicas=5), 2)
    v = law.decide(sig(3, replicas=5, complete=False), 3)
    assert "did not answer" in v.reason and "5 replica(s) last observed" in v.reason
    assert law.observed == 5 and law.desired == 2  # the law's own level is untouched by the floor
