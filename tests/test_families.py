"""Workload families (``kvgate bench families``): deterministic generation, valid cases (the shared-prefix
family's included), the capacity yardstick, the windowed Jain index, the command's JSON, and the
missing-matplotlib message."""

from __future__ import annotations

import builtins
import json
import sys
from collections import defaultdict
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ext_proc.config import parse_config
from ext_proc.profiles import get_profile
from kvgate.bench.scenarios import report
from kvgate.bench.scenarios.driver import Outcome, Policy, RunResult
from kvgate.bench.scenarios.families import (
    EXTRA_METRICS,
    FAMILIES,
    FAMILY_PROFILES,
    METRICS,
    POLICIES,
    TIER_METRICS,
    SharedPrefixFamily,
    arrivals,
    columns,
    family,
    node_capacity_rps,
    run_family,
)
from kvgate.bench.scenarios.trace import TraceRequest
from kvgate.bench.scenarios.workloads import (
    SHORT,
    SharedPrefixes,
    SharedPrefixScenario,
    Stream,
    get_scenario,
    offered_load,
    poisson,
)
from kvgate.cli import main

SEEDS = (1, 2, 3)
STREAM_FAMILIES = [n for n in FAMILIES if n != "shared-prefix"]
"""The families drawn as tenants' Poisson streams of ``SHORT`` and ``LONG`` requests."""


# -- generation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_is_deterministic_per_seed(name: str) -> None:
    a, b = family(name, 2), family(name, 2)
    assert a.config == b.config and a.describe() == b.describe()
    assert a.trace(0.2) == b.trace(0.2)
    assert family(name, 3).trace(0.2) != a.trace(0.2)
    # a shortened run is the start of the full one (the same requests, not a redraw)
    full = a.trace()
    assert a.trace(0.2) == [r for r in full if r.t < a.duration_s * 0.2]


@pytest.mark.parametrize("name", STREAM_FAMILIES)
def test_each_seed_draws_a_valid_case(name: str) -> None:
    profiles = set()
    for seed in SEEDS:
        sc = family(name, seed)
        profiles.add(sc.profile)
        cfg = parse_config(sc.config)  # a valid kvgate config
        tiers = {t.name: t.tier for t in cfg.tenants}
        assert 2 <= len(tiers) <= 5 and "interactive" in tiers.values()
        assert set(tiers.values()) <= {"interactive", "standard", "batch"}
        if len(tiers) >= 3:
            assert set(tiers.values()) == {"interactive", "standard", "batch"}
        assert all(t.max_concurrent for t in cfg.tenants if t.tier == "batch")
        # kvgate as shipped: no vLLM priority in the bodies (docs/guides/vllm-settings.md says why)
        assert not cfg.queue.inject_priority and cfg.nodes is not None
        assert cfg.best_effort.enabled and cfg.best_effort.default == "best-effort", "the same rule every seed"
        assert all(t.over_limit is None for t in cfg.tenants)
        assert 2 <= sc.nodes <= 4 and 300 <= sc.duration_s <= 600 and 0.6 <= sc.load <= 1.1
        assert [p.name for p in sc.policies] == list(POLICIES)
        for p in sc.policies:
            assert p.nodes == sc.nodes and p.min_nodes == 1
        trace = sc.trace()
        assert {r.tenant for r in trace} <= set(tiers)
        # the offered rate is the drawn load of the estimated capacity (Poisson noise aside)
        assert len(trace) / sc.duration_s == pytest.approx(sc.offered_rps, rel=0.1)
        assert {r.prompt_tokens > 1024 for r in trace} == {True, False}  # short and long requests
    assert profiles == set(FAMILY_PROFILES)


def test_each_shared_prefix_seed_draws_a_valid_case() -> None:
    profiles = set()
    for seed in SEEDS:
        sc = family("shared-prefix", seed)
        assert isinstance(sc, SharedPrefixFamily) and sc.family == "shared-prefix"
        profiles.add(sc.profile)
        cfg = parse_config(sc.config)
        assert {t.name: t.tier for t in cfg.tenants} == {"chat": "interactive", "rag": "standard", "api": "batch"}
        assert not any(t.max_concurrent or t.tokens_per_minute for t in cfg.tenants)  # no quotas, as pinned
        assert not cfg.queue.inject_priority and cfg.nodes is not None
        assert 2 <= sc.nodes <= 4 and 300 <= sc.duration_s <= 600 and 0.6 <= sc.load <= 1.1
        assert [p.name for p in sc.policies] == list(POLICIES)
        assert all(p.nodes == sc.nodes and p.min_nodes == 1 for p in sc.policies)
        # the generator's parameters, within their ranges
        t, prof = sc.traffic, get_profile(sc.profile)
        assert t.duration_s == sc.duration_s and t.max_context == prof.max_model_len
        assert 200 <= t.system_tokens <= 3000 and t.system_tokens % 100 == 0
        assert 1 <= t.turns[0] <= 3 and t.turns[0] <= t.turns[1] <= 12
        assert 3 <= t.think_s[0] <= 15 and t.think_s[0] + 10 <= t.think_s[1] <= t.think_s[0] + 60
        assert 5 <= t.documents <= 50 and 1000 <= t.document_tokens[0] <= 3000
        assert t.document_tokens[0] + 1000 <= t.document_tokens[1] <= t.document_tokens[0] + 5000
        assert 0.6 <= t.zipf <= 1.4 and 0.1 <= t.rag_share <= 0.5 and 0.05 <= t.job_share <= 0.3
        assert t.sessions >= 1 and 0 < sc.working_set[0] <= sc.working_set[1]

        trace = sc.trace()
        assert {r.tenant for r in trace} == {"chat", "rag", "api"}
        assert all(0 <= r.t < sc.duration_s for r in trace)
        # the session count brings the trace to the drawn load (no cache hit), hence the offered rate
        assert offered_load(trace, prof, sc.nodes, sc.duration_s) == pytest.approx(sc.load, rel=0.05)
        assert len(trace) / sc.duration_s == pytest.approx(sc.offered_rps, rel=0.05)
        assert [p.share for p in sc.plan] == pytest.approx(
            [sum(r.tenant == n for r in trace) / len(trace) for n in ("chat", "rag", "api")])
        for r in trace:  # every prompt starts with its tenant's system prompt; its segments fit in it
            assert r.segments is not None and r.segments[0] == (f"sys-{r.tenant}", t.system_tokens)
            assert sum(n for _, n in r.segments) <= r.prompt_tokens
            assert r.prompt_tokens + max(r.output_tokens, r.max_tokens or 0) <= prof.max_model_len
        sessions: dict[str, list[TraceRequest]] = defaultdict(list)
        for r in trace:
            if r.session is not None:
                sessions[r.session].append(r)
        assert 0 < len(sessions) <= t.sessions and max(len(s) for s in sessions.values()) <= t.turns[1]
        for turn in sessions.values():  # the history grows: a turn's prompt is the last one's + its answer
            for prev, cur in pairwise(turn):
                assert prev.segments is not None and cur.segments is not None
                assert cur.segments[:len(prev.segments)] == prev.segments
                assert cur.segments[len(prev.segments)][1] == prev.output_tokens
        docs = {seg for r in trace for seg, _ in r.segments or () if seg.startswith("doc-")}
        assert 0 < len(docs) <= t.documents
        doc = sc.details()
        assert doc["traffic"]["sessions"] == t.sessions and doc["traffic"]["max_context"] == prof.max_model_len
        assert set(doc["working_set_kv"]) == {"mean", "peak"}
        assert "system prompt" in sc.describe() and "working set" in sc.describe()
    assert profiles == set(FAMILY_PROFILES)


def test_a_shared_prefix_seed_is_deterministic_and_its_own() -> None:
    a, b = family("shared-prefix", 1), family("shared-prefix", 1)
    assert isinstance(a, SharedPrefixFamily) and isinstance(b, SharedPrefixFamily)
    assert a.traffic == b.traffic and a.details() == b.details() and a.trace() == b.trace()
    c = family("shared-prefix", 2)
    assert isinstance(c, SharedPrefixFamily) and c.traffic != a.traffic


def test_a_session_stops_before_a_turn_that_would_not_fit_the_context() -> None:
    base = SharedPrefixes(duration_s=600.0, sessions=40, turns=(8, 12), think_s=(1.0, 5.0))
    free = [r for r in base.build(3) if r.tenant == "chat"]
    assert max(r.prompt_tokens + r.output_tokens for r in free) > 16_384
    capped = [r for r in replace(base, max_context=16_384).build(3) if r.tenant == "chat"]
    # the same sessions, each cut before its first turn over the limit (a session's context only grows)
    assert capped == [r for r in free if r.prompt_tokens + r.output_tokens <= 16_384] and len(capped) < len(free)
    assert not [r for r in replace(base, max_context=100).build(3) if r.tenant == "chat"]  # none fits at all
    # no limit: the pinned scenario's generator, as it was
    pinned = get_scenario("shared-prefix")
    assert isinstance(pinned, SharedPrefixScenario) and pinned.traffic.max_context is None


def test_the_capacity_yardstick_agrees_with_the_overload_scenario() -> None:
    # workloads.py: 55 req/s of 85% short / 15% long on three 8b-h100 nodes is "about 55%" load
    cap = 3 * node_capacity_rps(get_profile("8b-h100"), 0.15)
    assert 0.5 < 55.0 / cap < 0.65
    assert node_capacity_rps(get_profile("8b-h100"), 0.0) > node_capacity_rps(get_profile("8b-h100"), 0.5)
    assert node_capacity_rps(get_profile("34b-h100"), 0.3) < node_capacity_rps(get_profile("8b-h100"), 0.3)


def test_a_short_burst_is_not_clipped() -> None:
    """poisson() finds a rate's peak on 201 points (every 3 s here): a burst between two of them is clipped
    to the base rate; arrivals() finds it."""
    def rate(t: float) -> float:
        return 100.0 if 301.0 <= t < 302.5 else 1.0

    s = [Stream("a", SHORT, rate)]
    burst = [r for r in arrivals(s, 600.0, 1) if 301.0 <= r.t < 302.5]
    assert 100 < len(burst) < 200
    assert len([r for r in poisson(s, 600.0, 1) if 301.0 <= r.t < 302.5]) < 10


# -- the windowed Jain index -------------------------------------------------------------------------

def test_windowed_jain_sees_a_tenant_starved_for_one_window() -> None:
    cfg = parse_config({"tenants": [{"name": "a"}, {"name": "b"}]})
    outcomes = []
    for w in range(3):
        for i in range(10):
            for tenant in ("a", "b"):
                starved = tenant == "a" and w == 1
                outcomes.append(Outcome(TraceRequest(w * 60.0 + i, tenant, 90, 10), "standard",
                                        status=429 if starved else 200, klass="policy" if starved else "",
                                        ttft=None if starved else 0.1, e2e=None if starved else 0.5))
    r = RunResult(Policy("none", 1), outcomes, 180.0, 180.0, 1, [(0.0, 1)], 0, 0)
    s = report.summarize(r, cfg)
    assert report.jain_windows(outcomes, {"a": 1.0, "b": 1.0}) == pytest.approx([1.0, 0.5, 1.0])
    # whole run: a got 20 of 30, b 30 of 30, fair shares 25 each -> (0.8, 1.2) -> 4 / 4.16
    assert s.fairness == pytest.approx(4 / 4.16)
    assert s.jain_60s_min == pytest.approx(0.5) and s.jain_60s_mean == pytest.approx(2.5 / 3)
    assert s.jain_60s_min is not None and s.jain_60s_mean is not None and s.fairness is not None
    assert s.jain_60s_min < s.jain_60s_mean < s.fairness
    doc = s.to_json()
    assert doc["jain"] == s.fairness and doc["jain_60s_min"] == s.jain_60s_min
    assert doc["jain_60s_mean"] == s.jain_60s_mean
    # a window with a single active tenant says nothing about fairness
    alone = [o for o in outcomes if not (o.req.tenant == "b" and o.req.t >= 120)]
    assert report.jain_windows(alone, {"a": 1.0, "b": 1.0}) == pytest.approx([1.0, 0.5])


# -- the command -------------------------------------------------------------------------------------

def test_the_families_command_prints_the_documented_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "families", "--family", "mixed", "--seeds", "1", "--scale", "0.05", "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert {"kind", "version", "scale", "seeds", "policies", "window_s", "metrics", "wall_s", "families"} <= set(doc)
    assert doc["kind"] == "kvgate-bench-families" and doc["seeds"] == [1] and doc["scale"] == 0.05
    assert doc["policies"] == list(POLICIES) and set(doc["metrics"]) == set(METRICS)
    assert doc["metrics"]["gpu_hours"]["worst"] == "max" and doc["metrics"]["slo"]["worst"] == "min"
    [fam] = doc["families"]
    assert fam["family"] == "mixed" and fam["wall_s"] >= 0
    [seed] = fam["seeds"]
    assert {"seed", "profile", "nodes", "duration_s", "offered_load", "capacity_rps", "offered_rps",
            "long_share", "requests", "wall_s", "lost", "tenants"} <= set(seed)
    assert seed["lost"] == 0 and seed["requests"] > 0
    assert all({"name", "tier", "share", "long_share", "pattern"} <= set(t) for t in seed["tenants"])
    assert "traffic" not in seed and "working_set_kv" not in seed  # the shared-prefix family's alone
    assert [p["policy"] for p in fam["policies"]] == list(POLICIES)
    for p in fam["policies"]:
        for m in ("interactive_slo", "slo", "goodput_per_gpu", "gpu_hours", "jain", "jain_60s_mean",
                  "jain_60s_min", "ttft_p50", "ttft_p99", "prefill_tokens_computed", "standard_slo", "batch_slo",
                  "interactive_ttft_p99"):
            assert set(p[m]) == {"median", "worst", "per_seed"} and len(p[m]["per_seed"]) == 1
            assert p[m]["median"] == p[m]["worst"] == p[m]["per_seed"][0]
        assert p["gpu_hours"]["median"] > 0 and 0 <= p["slo"]["median"] <= 1


def test_the_families_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "families", "--family", "mixed", "--seeds", "1", "--scale", "0.05",
                 "--policies", "none", "kvgate"]) == 0
    out = capsys.readouterr().out
    assert "## mixed" in out and "* seed 1: " in out and "| kvgate " in out and "wall time: " in out
    assert "| kv-shed" not in out and "prefill" not in out and "TTFT" not in out  # the columns it always had
    assert main(["bench", "families", "--seeds", "0"]) == 2


def test_the_shared_prefix_family_reports_its_traffic_and_the_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "families", "--family", "shared-prefix", "--seeds", "1", "--scale", "0.05",
                 "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert set(EXTRA_METRICS) <= set(doc["metrics"]) and doc["metrics"]["prefill_tokens_computed"]["worst"] == "max"
    [fam] = doc["families"]
    assert fam["family"] == "shared-prefix"
    [seed] = fam["seeds"]
    assert seed["lost"] == 0 and seed["requests"] > 0
    assert [t["name"] for t in seed["tenants"]] == ["chat", "rag", "api"]
    assert {"system_tokens", "sessions", "turns", "think_s", "documents", "document_tokens", "zipf", "rag_share",
            "job_share", "max_context"} == set(seed["traffic"])
    assert seed["working_set_kv"]["peak"] >= seed["working_set_kv"]["mean"] > 0
    assert [p["policy"] for p in fam["policies"]] == list(POLICIES)
    for p in fam["policies"]:
        assert p["prefill_tokens_computed"]["median"] > 0
    assert main(["bench", "families", "--family", "shared-prefix", "--seeds", "1", "--scale", "0.05",
                 "--policies", "none", "kvgate"]) == 0
    out = capsys.readouterr().out
    assert "## shared-prefix" in out and "system prompt" in out and "| prefill (M tokens) |" in out
    assert "TTFT p99 (s)" in out and "the highest for GPU-h, TTFT and prefill" in out


# -- matplotlib is optional --------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["absent", "broken"])
def test_without_matplotlib_the_report_says_so(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    if how == "absent":
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` fails on
    else:  # installed but failing to import
        real = builtins.__import__

        def fail(name: str, *args: Any, **kw: Any) -> ModuleType:
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ImportError("matplotlib is broken")
            return real(name, *args, **kw)

        monkeypatch.setattr(builtins, "__import__", fail)
    out = tmp_path / "out"
    assert main(["bench", "scenarios", "--scenario", "noisy-neighbour", "--scale", "0.02", "--out", str(out),
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "pip install 'kvgate[bench]'" in err
    assert (out / "report.md").is_file() and (out / "results.json").is_file()
    assert not list(out.glob("*.png"))


def test_the_families_rows_carry_each_tiers_own_figures() -> None:
    """attack47: a placement change raised the interactive and all-tier SLO of a seed while its standard tier
    lost 3 points (the batch tier's gain hid it), and nothing in the families' output showed it. Each
    policy's row carries the standard and batch tiers' SLO and the interactive tier's TTFT p99 (JSON only:
    the tables keep their columns), each the run's own tier figure; a seed without a tenant of the tier has
    none, and ``median``/``worst`` are over the seeds that have one (mixed seed 1 draws no standard tenant,
    seed 2 one of each tier)."""
    r = run_family("mixed", [1, 2], scale=0.05, policies=("kvgate",))
    row = r.rows()["kvgate"]
    summaries = [run.summary("kvgate") for run in r.runs]
    assert all(s is not None for s in summaries)
    for tier in ("standard", "batch"):
        want = [g.slo if (g := s.tiers.get(tier)) is not None else None for s in summaries if s is not None]
        assert row[f"{tier}_slo"]["per_seed"] == want
        values = [x for x in want if x is not None]
        assert row[f"{tier}_slo"]["worst"] == min(values)
    assert row["standard_slo"]["per_seed"][0] is None and row["standard_slo"]["per_seed"][1] is not None
    p99 = [s.tiers["interactive"].ttft[2] for s in summaries if s is not None]
    assert row["interactive_ttft_p99"]["per_seed"] == p99 and row["interactive_ttft_p99"]["worst"] == max(p99)
    assert not set(TIER_METRICS) & set(columns("mixed")) and not set(TIER_METRICS) & set(columns("shared-prefix"))
