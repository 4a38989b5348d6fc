"""The pinned ``shared-prefix`` scenario: its trace is what the issue pins (8b-h100 x 4, 10 minutes, 200
chat sessions of 2-10 turns whose history grows, 20 RAG documents of 2-6k tokens in 30% of the requests,
a 1,500-token system prompt per tenant, a working set between one node's KV and the fleet's), and the
simulated nodes reuse its prefixes even under plain least-request."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from ext_proc.config import parse_config
from ext_proc.profiles import get_profile
from kvgate.bench.scenarios.driver import simulate
from kvgate.bench.scenarios.trace import TraceRequest, read_trace
from kvgate.bench.scenarios.workloads import (
    SharedPrefixScenario,
    get_scenario,
    offered_load,
    working_set,
)
from kvgate.cli import main

NODES = 4
MINUTES = 10


@pytest.fixture(scope="module")
def sc() -> SharedPrefixScenario:
    s = get_scenario("shared-prefix")
    assert isinstance(s, SharedPrefixScenario)
    return s


@pytest.fixture(scope="module")
def trace(sc: SharedPrefixScenario) -> list[TraceRequest]:
    return sc.trace()


def test_the_fleet_the_run_and_the_policies_are_pinned(sc: SharedPrefixScenario) -> None:
    assert sc.profile == "8b-h100" and sc.duration_s == MINUTES * 60
    assert [(p.name, p.nodes, p.admission, p.prefix, p.autoscale) for p in sc.policies] == [
        ("none", NODES, "none", True, "none"), ("kv-shed", NODES, "kv-shed", True, "none"),
        ("kvgate", NODES, "kvgate", True, "none"), ("kvgate-noprefix", NODES, "kvgate", False, "none")]
    assert sc.ideal is None and not sc.degrade
    cfg = parse_config(sc.config)
    assert {t.name: t.tier for t in cfg.tenants} == {"chat": "interactive", "rag": "standard", "api": "batch"}


def test_the_trace_is_deterministic_and_a_shorter_run_is_its_start(sc: SharedPrefixScenario,
                                                                   trace: list[TraceRequest]) -> None:
    assert sc.trace() == trace
    assert sc.trace(0.1) == [r for r in trace if r.t < sc.duration_s * 0.1]
    assert replace(sc, seed=2).trace(0.1) != sc.trace(0.1)


def test_every_request_arrives_in_the_ten_minutes_and_its_segments_fit_its_prompt(
        trace: list[TraceRequest]) -> None:
    assert all(0 <= r.t < MINUTES * 60 for r in trace) and trace[-1].t > MINUTES * 60 * 0.95
    size: dict[str, int] = {}
    for r in trace:
        assert r.segments, "every prompt starts with at least its system prompt"
        assert sum(n for _, n in r.segments) <= r.prompt_tokens
        for seg, n in r.segments:
            assert size.setdefault(seg, n) == n, f"{seg}: the same id is the same tokens everywhere"


def test_each_prompt_starts_with_its_tenants_1500_token_system_prompt(trace: list[TraceRequest]) -> None:
    assert {r.tenant for r in trace} == {"chat", "rag", "api"}
    for r in trace:
        assert r.segments is not None and r.segments[0] == (f"sys-{r.tenant}", 1500)
        assert not any(seg.startswith("sys-") for seg, _ in r.segments[1:])


def test_200_chat_sessions_of_2_to_10_turns_whose_history_grows_by_each_previous_turn(
        trace: list[TraceRequest]) -> None:
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in trace:
        assert (r.session is not None) == (r.tenant == "chat") and (r.stream or r.tenant != "chat")
        if r.session is not None:
            sessions[r.session].append(r)
    assert len(sessions) == 200
    turns = [len(s) for s in sessions.values()]
    assert min(turns) >= 2 and max(turns) <= 10 and {2, 10} <= set(turns)
    for name, turn in sessions.items():
        for prev, cur in pairwise(turn):
            assert prev.segments is not None and cur.segments is not None
            assert cur.t > prev.t
            # the next turn's prompt: everything the last one had, then its answer, then a new message
            assert cur.segments[:len(prev.segments)] == prev.segments, name
            assert len(cur.segments) == len(prev.segments) + 2
            assert cur.segments[-2][1] == prev.output_tokens  # the answer, as long as it was
            assert cur.prompt_tokens == prev.prompt_tokens + prev.output_tokens + cur.segments[-1][1]
            assert all(seg.startswith(f"{name}-") for seg, _ in cur.segments[1:])  # a session's own history


def test_20_documents_of_2_to_6k_tokens_are_shared_by_30_percent_of_the_requests(
        sc: SharedPrefixScenario, trace: list[TraceRequest]) -> None:
    docs: dict[str, int] = {}
    uses: dict[str, int] = defaultdict(int)
    with_doc = 0
    for r in trace:
        assert r.segments is not None
        mine = [(seg, n) for seg, n in r.segments if seg.startswith("doc-")]
        assert (len(mine) == 1) == (r.tenant == "rag") and len(mine) <= 1
        if mine:
            with_doc += 1
            seg, n = mine[0]
            docs[seg] = n
            uses[seg] += 1
            assert r.segments == (("sys-rag", 1500), mine[0]) and r.prompt_tokens > 1500 + n  # + the question
    assert with_doc / len(trace) == pytest.approx(0.30, abs=0.03)
    assert len(docs) == 20 and all(2000 <= n <= 6000 for n in docs.values())
    assert docs == {f"doc-{i}": n for i, n in enumerate(sc.traffic.document_sizes(sc.seed))}
    assert uses["doc-0"] == max(uses.values()) > 3 * min(uses.values())  # skewed popularity, the first the top


def test_the_working_set_is_larger_than_one_nodes_kv_and_smaller_than_the_fleets(
        sc: SharedPrefixScenario, trace: list[TraceRequest]) -> None:
    node_kv = get_profile(sc.profile).kv_tokens
    ws = working_set(trace)
    assert ws[-1][1] == 0 and all(v >= 0 for _, v in ws)
    peak = max(v for _, v in ws)
    mean = sum(v * (t1 - t0) for (t0, v), (t1, _) in pairwise(ws)) / sc.duration_s
    above = sum(t1 - t0 for (t0, v), (t1, _) in pairwise(ws) if v > node_kv)
    print(f"working set: mean {mean:,.0f} tokens, peak {peak:,} tokens, above one node's KV for {above:.0f} s; "
          f"one node's KV {node_kv:,}, the fleet's {NODES * node_kv:,}")
    assert node_kv < mean and peak < NODES * node_kv  # on average more than a node holds, never the fleet
    assert above > sc.duration_s / 3


def test_the_offered_load_is_about_half_the_fleet_with_no_cache_hit(sc: SharedPrefixScenario,
                                                                    trace: list[TraceRequest]) -> None:
    load = offered_load(trace, get_profile(sc.profile), NODES, sc.duration_s)
    assert 0.4 < load < 0.6


def test_bench_trace_writes_the_segments_and_sessions(sc: SharedPrefixScenario, tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["bench", "trace", "--scenario", "shared-prefix", "--scale", "0.1", "--out", str(out)]) == 0
    assert read_trace(out) == sc.trace(0.1)
    assert '"segments":[["sys-chat",1500]' in out.read_text() and '"session":"s' in out.read_text()


def test_the_nodes_hit_shared_prefixes_even_under_plain_least_request(sc: SharedPrefixScenario) -> None:
    short = sc.trace(0.1)
    none = next(p for p in sc.policies if p.name == "none")
    r = simulate(parse_config(sc.config), none, get_profile(sc.profile), short, sc.seed)
    given = sum(q.prompt_tokens for q in short)
    assert r.lost == 0 and all(o.status == 200 for o in r.outcomes)
    assert 0 < r.prefill_tokens_computed < given
