"""Spend budgets (issue 31): config, windows, prices, the pure ledger and its guarantee, the 429."""

import random
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.admission import Admission, Usage
from ext_proc.budgets import BudgetBook, Hold, Refusal, human, window
from ext_proc.budgetstats import BudgetCollector
from ext_proc.config import ConfigError, parse_config
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from ext_proc.prices import Price, SpendBudget, Spent, cost, worst_cost
from ext_proc.wire import reject_reply
from tests.helpers import FakeClock

PRICE = Price(prompt=1.0, cached_prompt=0.1, completion=2.0, reasoning=4.0)
DEC_5 = datetime(2026, 12, 5, 10, 0, tzinfo=ZoneInfo("UTC")).timestamp()


def ts(*args: int, tz: str = "UTC") -> float:
    return datetime(*args, tzinfo=ZoneInfo(tz)).timestamp()  # type: ignore[misc]


def cfg(**budget: Any) -> dict[str, Any]:
    b = {"name": "monthly", "limit": 1.0, **budget}
    return {"prices": {"m": {"prompt": 1.0, "completion": 2.0}}, "tenants": [{"name": "t", "budgets": [b]}]}


# -- config ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("budget", "field"), [
    ({"window": "rolling"}, "rolling_seconds"),
    ({"timezone": "Mars/Olympus"}, "timezone"),
    ({"mode": "loose"}, "mode"),
    ({"limit": 0}, "limit"),
    ({"alert_at": [1.5]}, "alert_at"),
    ({"weights": {"prompt": 1, "completion": 1}}, "weights"),
])
def test_budget_config_errors_name_the_field(budget: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(cfg(**budget))
    assert field in str(e.value) and "tenants[0].budgets" in str(e.value)


def test_currency_budget_without_prices_and_duplicate_names_are_refused() -> None:
    c = cfg()
    del c["prices"]
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.budgets"):
        parse_config(c)
    c = cfg()
    c["tenants"][0]["budgets"].append({"name": "monthly", "limit": 2})
    with pytest.raises(ConfigError, match="defined twice"):
        parse_config(c)


# -- windows and prices ------------------------------------------------------------------------------

def test_calendar_windows_start_in_the_budget_time_zone() -> None:
    b = SpendBudget(name="b", limit=1, window="month", timezone="Europe/Paris")
    # 2026-11-30 23:30 UTC is already December in Paris
    w = window(b, ts(2026, 11, 30, 23, 30))
    assert w.id == "2026-12" and w.start == ts(2026, 12, 1, tz="Europe/Paris")
    assert w.end == ts(2027, 1, 1, tz="Europe/Paris")
    day = window(SpendBudget(name="b", limit=1, window="day", timezone="Europe/Paris"), ts(2026, 3, 29, 12))
    assert day.end - day.start == 23 * 3600  # the day the clocks go forward
    week = window(SpendBudget(name="b", limit=1, window="week"), DEC_5)  # a Saturday
    assert week.start == ts(2026, 11, 30) and week.end == ts(2026, 12, 7)
    hour = window(SpendBudget(name="b", limit=1, window="hour"), DEC_5 + 59)
    assert (hour.start, hour.end) == (DEC_5, DEC_5 + 3600)


def test_cost_prices_cached_and_reasoning_tokens_and_worst_case_bounds_it() -> None:
    used = Spent(prompt=1000, completion=500, cached=600, reasoning=100)
    assert cost(PRICE, used) == pytest.approx((400 * 1.0 + 600 * 0.1 + 400 * 2.0 + 100 * 4.0) / 1e6)
    assert worst_cost(PRICE, 1000, 500) == pytest.approx((1000 * 1.0 + 500 * 4.0) / 1e6)
    assert cost(PRICE, used) <= worst_cost(PRICE, 1000, 500)


def test_human_reset_time() -> None:
    assert human(3 * 86400 + 4 * 3600 + 5) == "3 days 4 h"
    assert human(3725) == "1 h 2 min" and human(40) == "40 s"


# -- the ledger ---------------------------------------------------------------------------------------

def book(limit: float = 1.0, **kw: Any) -> BudgetBook:
    return BudgetBook({"m": PRICE}, {"t": [SpendBudget(name="b", limit=limit, **kw)]}, DEC_5)


def test_reserve_worst_case_charge_real_cost_release_exactly_once() -> None:
    bk = book(limit=1.0)
    # worst case: 100_000 prompt at 1.0 + 100_000 output at 4.0 per million = 0.5
    h = bk.reserve("a", "t", "m", None, 100_000, 100_000, DEC_5)
    assert isinstance(h, Hold)
    r = bk.reserve("b", "t", "m", None, 100_000, 150_000, DEC_5)
    assert isinstance(r, Refusal) and r.account.budget.name == "b"
    assert r.retry_after == pytest.approx(ts(2027, 1, 1) - DEC_5)
    assert "days" in r.message and "'b'" in r.message
    charged = bk.settle("a", Spent(50_000, 10_000, cached=50_000), DEC_5)
    assert charged == pytest.approx((50_000 * 0.1 + 10_000 * 2.0) / 1e6)
    assert bk.settle("a", Spent(50_000, 10_000), DEC_5) is None  # exactly once
    assert not bk.release("a")
    acc = bk.accounts["t"][0]
    assert acc.reserved == 0 and acc.spent == pytest.approx(charged)
    assert isinstance(bk.reserve("b", "t", "m", None, 100_000, 150_000, DEC_5), Hold)
    assert bk.release("b") and not bk.release("b")
    assert acc.reserved == 0


def test_window_reset_frees_spend_but_keeps_reservations_in_flight() -> None:
    bk = book(limit=1.0, window="day")
    assert isinstance(bk.reserve("a", "t", "m", None, 0, 100_000, DEC_5), Hold)  # 0.4 held
    bk.settle("a", None, DEC_5)  # no usage: the whole reservation is charged
    assert isinstance(bk.reserve("b", "t", "m", None, 0, 100_000, DEC_5), Hold)
    assert isinstance(bk.reserve("c", "t", "m", None, 0, 100_000, DEC_5), Refusal)
    nxt = ts(2026, 12, 6, 0, 0, 1)
    acc = bk.accounts["t"][0]
    assert acc.left(nxt) == pytest.approx(0.6)  # the new day: nothing spent, 0.4 still held by "b"


def test_rolling_window_frees_as_slots_age_out() -> None:
    bk = book(limit=1.0, window="rolling", rolling_seconds=3600)
    assert isinstance(bk.reserve("a", "t", "m", None, 0, 250_000, DEC_5), Hold)
    bk.settle("a", None, DEC_5)
    r = bk.reserve("b", "t", "m", None, 0, 10_000, DEC_5 + 10)
    assert isinstance(r, Refusal) and 3500 < r.retry_after <= 3600
    assert isinstance(bk.reserve("b", "t", "m", None, 0, 10_000, DEC_5 + 3600), Hold)


def test_shadow_counts_would_be_refusals_and_soft_never_refuses() -> None:
    for mode in ("shadow", "soft"):
        bk = book(limit=0.1, mode=mode)
        assert isinstance(bk.reserve("a", "t", "m", None, 0, 100_000, DEC_5), Hold)
        assert bk.accounts["t"][0].would_refuse == (1 if mode == "shadow" else 0)


def test_models_filter_and_unpriced_model_fails_closed() -> None:
    bk = BudgetBook({"m": PRICE}, {"t": [SpendBudget(name="b", limit=1, models=["m"])]}, DEC_5)
    assert bk.reserve("a", "t", "other", None, 10, 10, DEC_5) is None
    bk = BudgetBook({"m": PRICE}, {"t": [SpendBudget(name="b", limit=1)]}, DEC_5)
    r = bk.reserve("a", "t", "other", None, 10, 10, DEC_5)
    assert isinstance(r, Refusal) and "No price" in r.message


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "end", "drop"]), st.integers(0, 40_000),
                          st.integers(0, 40_000), st.floats(0, 1.5)), max_size=80),
       st.booleans())
def test_spend_never_exceeds_limit_with_caps_and_overshoot_is_bounded_without(
        ops: list[tuple[str, int, int, float]], capped: bool) -> None:
    """With every real cost within its reservation (output caps), spend <= limit at every instant; with
    requests that overrun, the overshoot is at most what the overruns added. Every hold is released once."""
    limit = 0.2
    bk = book(limit=limit)
    acc = bk.accounts["t"][0]
    live: dict[str, tuple[int, int]] = {}
    overrun = 0.0
    for i, (op, prompt, out, ratio) in enumerate(ops):
        if op == "start":
            if isinstance(bk.reserve(str(i), "t", "m", None, prompt, out, DEC_5), Hold):
                live[str(i)] = (prompt, out)
        elif live:
            t = sorted(live)[prompt % len(live)]
            p, o = live.pop(t)
            if op == "drop":
                assert bk.release(t)
            else:
                used_out = int(o * (ratio if capped else 1 + ratio))
                spent = cost(PRICE, Spent(p, used_out))
                overrun += max(0.0, spent - worst_cost(PRICE, p, o))
                assert bk.settle(t, Spent(p, used_out), DEC_5) is not None
            assert bk.settle(t, None, DEC_5) is None and not bk.release(t)
        assert acc.spent + acc.reserved <= limit + overrun + 1e-9
        if capped:
            assert acc.spent <= limit + 1e-9
    assert bk.holds() == len(live)


# -- through the admission decision -------------------------------------------------------------------

def test_admission_refuses_with_429_tenant_budget_headers_and_reset() -> None:
    clock = FakeClock()
    c = parse_config(cfg(limit=0.001, window="day"))
    a = Admission(c, clock, random.Random(1), wall=lambda: DEC_5)
    t = c.tenant("t")
    d = a.decide(t, "r1", Estimate(100, 400, parsed=True, model="m"), 10)  # worst case 0.0009
    assert d.admitted and d.lease is not None
    assert a.budget_left("t") == "monthly=0.0001"
    d2 = a.decide(t, "r2", Estimate(100, 400, parsed=True, model="m"), 10)
    assert d2.rejection is not None and (d2.rejection.status, d2.rejection.reason) == (429, "tenant-budget")
    reply = reject_reply(d2.rejection)
    h = dict(reply.headers)
    assert h["x-kvgate-budget"] == "monthly" and h["x-ratelimit-limit-budget"] == "0.001"
    assert h["x-ratelimit-remaining-budget"] == "0.0001" and h["x-ratelimit-reset-budget"] == "840m0s"
    assert int(h["retry-after"]) == 14 * 3600  # until midnight UTC
    assert b"14 h 0 min" in reply.body
    a.complete(d.lease.ticket, Usage(100, 100, cached_tokens=100), responded=True)
    assert a.spend.accounts["t"][0].spent == pytest.approx(100 * 2.0 / 1e6 + 100 * 1.0 / 1e6)
    # 0.0003 spent, nothing held: a worst case of 0.0005 fits again
    assert a.decide(t, "r3", Estimate(100, 200, parsed=True, model="m"), 10).admitted


def test_admission_releases_the_budget_of_a_request_refused_for_capacity() -> None:
    clock = FakeClock()
    c = parse_config({**cfg(limit=1.0), "fleet": {"max_inflight": 1}, "queue": {"enabled": False}})
    a = Admission(c, clock, random.Random(1), wall=lambda: DEC_5)
    t = c.tenant("t")
    assert a.decide(t, "r1", Estimate(10, 10, parsed=True, model="m"), 10).admitted
    d = a.decide(t, "r2", Estimate(10, 10, parsed=True, model="m"), 10)
    assert d.rejection is not None and d.rejection.reason == "fleet-inflight"
    assert a.spend.holds() == 1


def _samples(bk: BudgetBook) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    fams = BudgetCollector(lambda: bk, lambda t: t, lambda: DEC_5).collect()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_metrics_read_the_ledger_with_labels_from_config_only() -> None:
    bk = book(limit=1.0, mode="shadow", alert_at=[0.5, 0.9])
    h = bk.reserve("a", "t", "m", None, 1000, 1000, DEC_5)
    assert isinstance(h, Hold)
    bk.reserve("b", "t", "a-model-nobody-configured", None, 10, 10, DEC_5)  # unpriced: no series for it
    tm = (("model", "m"), ("tenant", "t"))
    assert _samples(bk)[("kvgate_spend_reserved", tm)] == pytest.approx(worst_cost(PRICE, 1000, 1000))
    bk.settle("a", Spent(1000, 10), DEC_5)
    samples = _samples(bk)
    assert samples[("kvgate_spend_total", tm)] == pytest.approx(cost(PRICE, Spent(1000, 10)))
    assert samples[("kvgate_spend_reserved", tm)] == pytest.approx(0)
    assert samples[("kvgate_budget_limit", (("budget", "b"), ("mode", "shadow"), ("tenant", "t")))] == 1.0
    assert samples[("kvgate_budget_alert_threshold", (("budget", "b"), ("tenant", "t"), ("threshold", "0.9")))] == 0.9
    assert {dict(k[1]).get("model") for k in samples if k[0].startswith("kvgate_spend")} == {"m"}


def test_the_access_log_usage_parts_are_counts_within_the_whole() -> None:
    from google.protobuf import struct_pb2

    from ext_proc.server import _part

    assert _part(None, 10) == 0
    assert _part(struct_pb2.Value(number_value=4), 10) == 4
    assert _part(struct_pb2.Value(number_value=11), 10) == 0  # more cached than the prompt: not believed
    assert _part(struct_pb2.Value(number_value=float("nan")), 10) == 0


def test_bench_budgets_reports_its_figures() -> None:
    from kvgate.bench.budgets import budgets

    r = budgets(300, quiet=True)
    assert set(r) == {"requests", "p50_us_without_budgets", "p50_us_with_3_budgets", "p50_us_added"}
    assert r["p50_us_with_3_budgets"] > 0 and r["requests"] == 300


def test_a_shadow_budgets_would_be_refusals_are_logged_folded_and_the_request_admitted() -> None:
    from ext_proc.core import Core, Request

    lines: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def info(self, event: str, **kw: Any) -> None:
            lines.append((event, kw))

        debug = warning = error = exception = info

    c = parse_config({"prices": {"m": {"prompt": 1.0, "completion": 2.0}}, "tenants": [
        {"name": "t", "api_key_sha256": [hash_key("k")], "budgets": [{"name": "trial", "limit": 1e-4,
                                                                      "mode": "shadow"}]}]})
    core = Core(c, FakeClock(), random.Random(1), log=Log(), wall=lambda: DEC_5)
    for i in range(3):
        out = core.decide(Request("/v1/chat/completions", f"r{i}", "Bearer k",
                                  estimate=Estimate(100, 100, True, model="m"), body_bytes=400))
        assert getattr(out, "reply", None) is None  # admitted all the same
    shadow = [kw for event, kw in lines if event == "budget_shadow_reject"]
    assert len(shadow) == 1 and shadow[0]["budget"] == "trial" and shadow[0]["tenant"] == "t"
    assert core.admission.spend.accounts["t"][0].would_refuse == 3


def test_a_reload_keeps_each_budgets_spend_and_holds() -> None:
    clock = FakeClock()
    c = parse_config(cfg(limit=1.0))
    a = Admission(c, clock, random.Random(1), wall=lambda: DEC_5)
    t = c.tenant("t")
    d = a.decide(t, "r1", Estimate(1000, 1000, parsed=True, model="m"), 10)
    assert d.lease is not None
    a.complete(d.lease.ticket, Usage(1000, 500), responded=True)
    d2 = a.decide(t, "r2", Estimate(1000, 1000, parsed=True, model="m"), 10)
    assert d2.lease is not None
    a.reconfigure(parse_config(cfg(limit=0.5)))  # a lower limit, the same budget name: spend kept
    acc = a.spend.accounts["t"][0]
    assert acc.budget.limit == 0.5 and acc.spent == pytest.approx(2000e-6) and acc.reserved == pytest.approx(3000e-6)
    a.complete(d2.lease.ticket, Usage(1000, 1000), responded=True)
    assert acc.reserved == 0 and acc.spent == pytest.approx(5000e-6)


def test_the_docs_example_config_is_valid() -> None:
    from pathlib import Path

    from ext_proc.config import load_yaml

    text = (Path(__file__).parent.parent / "docs" / "guides" / "budgets.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    c = parse_config(load_yaml(block))
    assert [b.name for b in c.tenants[0].budgets] == ["monthly", "daily-70b", "tokens-24h", "trial"]
    assert c.tenants[0].budgets[2].weights is not None
