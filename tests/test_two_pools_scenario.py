"""The pinned ``two-pools`` scenario (issue 15): an 8B pool and a 70B pool behind one kvgate, the 70B
flooded while the 8B stays healthy. Under kvgate the 8B tenants get what they get without the flood
(the scenario's ``no flood`` reference rows: the same trace less the flood stream), the scaler adds
nodes to the 70B pool only, and every request reaches only its model's pool's nodes (counted at the
nodes). And the generalised driver leaves a single-pool run exactly as it was: pinned outcomes of a
small run, and a one-pool ``pools`` config that runs exactly as the same config without pools."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from ext_proc.config import ConfigError, parse_config
from ext_proc.profiles import get_profile
from kvgate.bench.scenarios.driver import Autoscaling, Policy, RunResult, simulate
from kvgate.bench.scenarios.report import Summary
from kvgate.bench.scenarios.runner import ScenarioResult, run
from kvgate.bench.scenarios.trace import TraceRequest, parse_line
from kvgate.bench.scenarios.workloads import LARGE_MODEL, SMALL_MODEL, Scenario, get_scenario
from scaler.law import LawSettings

MODEL_OF = {"8b": SMALL_MODEL, "70b": LARGE_MODEL}
FLOOD = (60.0, 240.0)
SLO_MARGIN = 0.01
"""How far the 8B tenants' SLO attainment under kvgate may be from the no-flood reference (it is 0 today)."""


@pytest.fixture(scope="module")
def sc() -> Scenario:
    return get_scenario("two-pools")


@pytest.fixture(scope="module")
def res(sc: Scenario) -> ScenarioResult:
    return run(sc)


def by_name(sums: list[Summary]) -> dict[str, Summary]:
    return {s.result.policy.name: s for s in sums}


def test_the_pools_the_policies_and_the_reference_are_pinned(sc: Scenario) -> None:
    cfg = parse_config(sc.config)
    assert [(p.name, p.models, p.nodes.performance.profile) for p in cfg.pools] == [
        ("8b", [SMALL_MODEL], "8b-h100"), ("70b", [LARGE_MODEL], "70b-h100x4")]
    assert cfg.nodes is None
    assert [p.name for p in sc.policies] == ["none", "kv-shed", "kvgate", "autoscale-only", "kvgate+scaler"]
    for p in sc.policies:
        assert [(s.pool, s.nodes, s.min_nodes, s.max_nodes) for s in p.pools] == [("8b", 2, 2, 8), ("70b", 1, 1, 4)]
    assert sc.reference is not None and sc.reference.label == "no flood"
    (flood,) = [sc.streams[i] for i in sc.reference.without]
    assert flood.tenant == "rag" and flood.model == LARGE_MODEL
    assert flood.rate(FLOOD[0] - 1) == 0 and flood.rate(FLOOD[0]) > 0 and flood.rate(FLOOD[1]) == 0
    assert {t.name: t.models for t in cfg.tenants} == {
        "chat-a": [SMALL_MODEL], "chat-b": [SMALL_MODEL], "docs": [SMALL_MODEL],
        "assistant": [LARGE_MODEL], "rag": [LARGE_MODEL]}


def test_the_reference_trace_is_the_trace_less_the_flood(sc: Scenario) -> None:
    trace, calm = sc.trace(), sc.reference_trace()
    assert sc.trace() == trace and sc.reference_trace() == calm  # seeded
    assert all(r.model in (SMALL_MODEL, LARGE_MODEL) for r in trace)
    # every other stream's requests are the very same ones; only rag's extra 70B requests are gone
    assert [r for r in trace if r.tenant != "rag"] == [r for r in calm if r.tenant != "rag"]
    kept = set(calm)
    removed = [r for r in trace if r not in kept]
    assert len(removed) == len(trace) - len(calm)
    assert all(r.tenant == "rag" and r.model == LARGE_MODEL and FLOOD[0] <= r.t < FLOOD[1] for r in removed)
    assert 1300 < len(removed) < 1600  # 8 req/s for 180 s


def test_every_request_reaches_only_its_models_pool(res: ScenarioResult) -> None:
    for s in res.summaries + res.references:
        r = s.result
        assert r.pooled and set(r.pools) == {"8b", "70b"} and r.lost == 0
        for o in r.outcomes:
            assert o.pool == next(p for p, m in MODEL_OF.items() if m == o.req.model), s.label
        for name, pool in r.pools.items():
            # counted at the nodes: what each pool's nodes were sent, by model
            admitted = sum(1 for o in r.outcomes if o.pool == name and o.status == 200)
            assert pool.served == {MODEL_OF[name]: admitted}, (s.label, name)
            assert s.pools[name].all.admitted == admitted


def test_under_kvgate_the_8b_tenants_are_unaffected_by_the_70b_flood(res: ScenarioResult) -> None:
    runs, refs = by_name(res.summaries), by_name(res.references)
    for name in ("kvgate", "kvgate+scaler"):
        flooded, calm = runs[name].pools, refs[name].pools
        small, small_ref = flooded["8b"], calm["8b"]
        assert small.all.offered == small_ref.all.offered > 5000
        assert small.all.rejected_policy == small.all.rejected_capacity == 0
        assert small.all.slo is not None and small_ref.all.slo is not None and small.all.slo > 0.99
        assert abs(small.all.slo - small_ref.all.slo) <= SLO_MARGIN
        for tenant, g in small.tenants.items():
            ref = small_ref.tenants[tenant]
            assert g.slo is not None and ref.slo is not None and abs(g.slo - ref.slo) <= SLO_MARGIN, tenant
        p50, _, p99 = small.all.ttft
        r50, _, r99 = small_ref.all.ttft
        assert p50 is not None and p99 is not None and r50 is not None and r99 is not None
        assert p50 == pytest.approx(r50, rel=0.05) and p99 == pytest.approx(r99, rel=0.05)
        # ...while the flood really floods the 70B: its tenants lose against their own no-flood run
        large, large_ref = flooded["70b"], calm["70b"]
        assert large.all.rejected_capacity > 300 and large_ref.all.rejected_capacity == 0
        assert large.all.slo is not None and large_ref.all.slo is not None
        assert large.all.slo < large_ref.all.slo - 0.3


def test_the_scaler_scales_only_the_70b_pool(res: ScenarioResult) -> None:
    runs, refs = by_name(res.summaries), by_name(res.references)
    for name in ("kvgate+scaler", "autoscale-only"):
        pools = runs[name].result.pools
        assert [c for _, c in pools["8b"].node_timeline] == [2], name  # never moves
        grew = pools["70b"].node_timeline
        assert grew[0][1] == 1 and max(c for _, c in grew) >= 3, name
        assert all(t >= FLOOD[0] for t, _ in grew[1:]), name  # not before the flood
        calm = refs[name].result.pools  # without the flood neither pool moves
        assert [c for _, c in calm["8b"].node_timeline] == [2] and [c for _, c in calm["70b"].node_timeline] == [1]
    scaled = runs["kvgate+scaler"].pools["70b"]
    static = runs["kvgate"].pools["70b"]
    assert scaled.all.rejected_capacity < static.all.rejected_capacity  # the nodes it added served the flood
    assert scaled.all.admitted > static.all.admitted
    for name in ("none", "kv-shed", "kvgate"):
        assert all(len(p.node_timeline) == 1 for p in runs[name].result.pools.values())


def test_the_report_and_the_json_show_each_pool_and_the_reference(res: ScenarioResult) -> None:
    doc = res.to_json()
    assert len(doc["policies"]) == 5 and len(doc["references"]) == 5
    assert doc["reference_scope"] == {"label": "no flood", "requests": res.reference_requests,
                                      "without": [{"tenant": "rag", "model": LARGE_MODEL}]}
    assert all(e["reference"] == "no flood" for e in doc["references"])
    assert all("reference" not in e for e in doc["policies"])
    entry = doc["policies"][4]
    assert entry["policy"] == "kvgate+scaler (8b: 2+, 70b: 1+ nodes)"
    assert set(entry["pools"]) == {"8b", "70b"}
    large = entry["pools"]["70b"]
    assert large["profile"] == "70b-h100x4" and large["nodes_start"] == 1 and large["nodes_max"] >= 3
    assert large["requests_at_nodes_by_model"] == {LARGE_MODEL: large["admitted"]}
    assert entry["gpu_hours"] > entry["pools"]["8b"]["gpu_hours"] + large["gpu_hours"] - 1e-3
    md = res.markdown()
    for needle in ("Per model pool", "Nodes per pool over time", "Per pool, as run / [no flood]", "[no flood]"):
        assert needle in md, needle
    side = md.split("Per pool, as run / [no flood]")[1]
    most = large["nodes_max"]  # (3 or more with the flood: asserted above)
    assert any(line.startswith("| kvgate+scaler ") and "| 70b " in line and f"| {most} / 1 " in line
               for line in side.splitlines())  # the most 70B nodes: with the flood, and 1 without


def test_a_single_pool_scenario_has_no_pool_or_reference_fields() -> None:
    res = run(get_scenario("noisy-neighbour"), scale=0.05)
    doc = res.to_json()
    assert "references" not in doc and "reference_scope" not in doc
    assert all("pools" not in e and "reference" not in e for e in doc["policies"])
    assert "Per model pool" not in res.markdown()


def test_the_trace_format_carries_the_model() -> None:
    r = parse_line('{"t": 1, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5, "model": "llama-3.1-8b"}')
    assert r.model == "llama-3.1-8b" and r.to_json()["model"] == "llama-3.1-8b"
    assert "model" not in parse_line('{"t": 1, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5}').to_json()
    with pytest.raises(ValueError, match="model: must be a non-empty string"):
        parse_line('{"t": 1, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5, "model": ""}')


def test_a_bench_config_with_pools_replays_a_trace_with_models(tmp_path: Path) -> None:
    from kvgate.bench.scenarios.runner import from_trace, load_bench_config
    from kvgate.bench.scenarios.trace import write_trace

    trace = tmp_path / "t.jsonl"
    write_trace(trace, get_scenario("two-pools").trace(0.1))
    cfg = tmp_path / "bench.yaml"
    pool = {"static": [{"address": "x:1", "probe": "http://x:2"}]}
    cfg.write_text(yaml.safe_dump({
        "policies": ["none", "kvgate"], "pools": {"large": {"nodes": 1}},
        "kvgate": {"tenants": [{"name": t} for t in ("chat-a", "chat-b", "docs", "assistant", "rag")],
                   "pools": [{"name": "small", "models": [SMALL_MODEL], "nodes": pool},
                             {"name": "large", "models": ["llama-3.1-70b*"],
                              "nodes": {"static": [{"address": "y:1", "probe": "http://y:2"}],
                                        "performance": {"profile": "70b-h100x4"}}}]}}))
    bc = load_bench_config(cfg)
    assert [(p.pool, p.nodes) for p in bc.policy_list()[0].pools] == [("small", 2), ("large", 1)]
    res = run(*from_trace(trace, bc))
    for s in res.summaries:
        pools = s.result.pools
        assert pools["small"].profile == "8b-h100" and pools["large"].profile == "70b-h100x4"
        assert set(pools["small"].served) <= {SMALL_MODEL} and set(pools["large"].served) <= {LARGE_MODEL}
        assert sum(p.all.admitted for p in s.pools.values()) == s.all.admitted > 0
    cfg.write_text(yaml.safe_dump({"pools": {"nope": {"nodes": 1}}}))
    with pytest.raises(ConfigError, match="pools: nope: no such pool"):
        load_bench_config(cfg)


# -- a single pool runs as it did ---------------------------------------------------------------------

NODES = {"static": [{"address": "node-0:8000", "probe": "http://node-0:9102"}]}
SMALL = {"tenants": [{"name": "chat", "tier": "interactive"},
                     {"name": "rag", "tier": "standard", "max_concurrent": 6, "tokens_per_minute": 400000}],
         "queue": {"inject_priority": True}, "nodes": NODES}
AUTO = Autoscaling(interval_s=5.0, window_s=20.0,
                   law=LawSettings(min_replicas=1, max_replicas=4, step=1, cooldown_s=20.0))
POLICIES = (Policy("none", 2), Policy("kv-shed", 2, "kv-shed"), Policy("kvgate", 2, "kvgate"),
            Policy("autoscale-only", 1, autoscale="queue", max_nodes=4),
            Policy("kvgate+scaler", 1, "kvgate", autoscale="scaler", max_nodes=4))
PINNED = {"none": ("0c4d544868a956f5", 600, 0, 0), "kv-shed": ("f9130b06724b3a9f", 203, 397, 0),
          "kvgate": ("05b13b38938a5993", 217, 357, 26), "autoscale-only": ("20b78234ecef11bc", 600, 0, 0),
          "kvgate+scaler": ("6335265b9cbf3bc2", 125, 475, 0)}
"""What the driver before model pools gave for ``small_trace`` (digest, admitted, 503, 429): every
request's status, reason, TTFT, e2e, node and decision time, the node timeline, GPU-seconds, breaker
opens and prefill tokens. No RNG draws the trace; the run's own RNGs are seeded. (kvgate's rows re-pinned
when the picker began counting every less urgent prefill vLLM runs ahead of a request, issue 30: kvgate
223/319/58 before, kvgate+scaler 103/450/47; again when a lower tier's new arrival began to go only
within its TTFT target while the top tier is active: 183/360/57 and 97/446/57 before — refused at once, a
request holds no concurrency slot, so fewer 429s. Read against the target, best fit sent a long RAG prompt
to the fullest node even past its max wait: 236/320/44, the chat tenant served 230 requests, 19 within
target; bounded by the max wait, as before, 187/387/26, 181 and 13 — kept: an 11 s first token where
another node gave 0.5 s, review68 H1, is no placement to pay for the top tier with. Again when a breaker
opened by a full KV cache alone began to go half-open once the cache drained instead of after its recovery
window, and only its trials' results to close it: 187/387/26 before.)"""


def small_trace(model: str | None = None) -> list[TraceRequest]:
    """30 s of a chat tenant and a RAG tenant on two 34B nodes: quotas, the queue, 503s and both
    autoscalers all act in it."""
    return [TraceRequest(round(i * 0.05, 6), "rag" if i % 4 == 0 else "chat",
                         3000 + (i * 53) % 2000 if i % 4 == 0 else 200 + (i * 37) % 600,
                         50 + (i * 11) % 200, i % 2 == 0, 1024 if i % 4 == 0 else None, model=model)
            for i in range(600)]


def digest(r: RunResult) -> tuple[str, int, int, int]:
    def rnd(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    doc: list[object] = [[o.status, o.reason, o.klass, rnd(o.ttft), rnd(o.e2e), o.node, rnd(o.decided_at)]
                         for o in r.outcomes]
    doc.append([[rnd(t), c] for t, c in r.node_timeline])
    doc.append([rnd(r.gpu_seconds), r.breaker_opens, r.lost, r.prefill_tokens_computed])
    return (hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16], sum(o.status == 200 for o in r.outcomes),
            sum(o.status == 503 for o in r.outcomes), sum(o.status == 429 for o in r.outcomes))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_single_pool_run_is_what_it_was_before_pools(policy: Policy) -> None:
    r = simulate(parse_config(SMALL), policy, get_profile("34b-a100"), small_trace(), 3, autoscaling=AUTO)
    assert digest(r) == PINNED[policy.name]
    assert not r.pooled and list(r.pools) == ["default"] and {o.pool for o in r.outcomes} == {"default"}


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_one_pool_in_pools_runs_as_the_same_config_without_pools(policy: Policy) -> None:
    pooled = {"tenants": SMALL["tenants"], "queue": SMALL["queue"],
              "pools": [{"name": "only", "models": ["*"], "nodes": NODES}]}
    r = simulate(parse_config(pooled), policy, get_profile("34b-a100"), small_trace("any-model"), 3,
                 autoscaling=AUTO)
    assert digest(r) == PINNED[policy.name]
    assert r.pooled and r.pools["only"].served == {"any-model": PINNED[policy.name][1]}
