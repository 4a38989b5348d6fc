"""Bounds and baselines for any trace: the ideal row of ``--trace`` runs (issue 30 §5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ext_proc.config import ConfigError
from kvgate.bench.scenarios.runner import BenchConfig, from_trace, load_bench_config, run


def _trace(path: Path) -> Path:
    lines = []
    for i in range(40):
        lines.append({"t": i * 0.25, "tenant": "chat", "prompt_tokens": 200, "output_tokens": 20})
        lines.append({"t": i * 0.25 + 0.1, "tenant": "bulk", "prompt_tokens": 3000, "output_tokens": 200})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


TENANTS = {"tenants": [{"name": "chat", "tier": "interactive"}, {"name": "bulk", "tier": "batch"}]}


def test_a_trace_run_has_an_ideal_row_of_its_most_urgent_tier_alone(tmp_path: Path) -> None:
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(yaml.safe_dump({"nodes": 1, "policies": ["none"], "kvgate": TENANTS}))
    sc, reqs = from_trace(_trace(tmp_path / "t.jsonl"), load_bench_config(cfg))
    res = run(sc, reqs)
    none, ideal = res.summaries
    assert not none.ideal and ideal.ideal and ideal.result.policy.label == "ideal (1 nodes)"
    assert none.all.offered == 80 and ideal.all.offered == 40  # only chat's requests were offered
    assert set(ideal.tenants) == {"chat"}
    doc = res.to_json()["policies"][1]
    assert doc["ideal"] and doc["ideal_scope"]["tenants"] == ["chat"] and doc["ideal_scope"]["not_offered"] == ["bulk"]
    assert "only the interactive tier's tenants (chat) are offered" in res.markdown()
    # alone on the node, chat's first tokens come no later than beside the batch prompts
    assert ideal.tenants["chat"].ttft[2] <= none.tenants["chat"].ttft[2]


def test_the_ideal_row_of_a_trace_can_be_set_or_turned_off(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    sc, _ = from_trace(trace, BenchConfig(nodes=2, policies=["none"], kvgate=TENANTS,
                                          ideal={"tiers": ["interactive", "batch"], "nodes": 3}))
    assert sc.ideal is not None and (sc.ideal.nodes, sc.ideal.tiers) == (3, ("interactive", "batch"))
    sc, _ = from_trace(trace, BenchConfig(policies=["none"], kvgate=TENANTS, ideal={"enabled": False}))
    assert sc.ideal is None
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(yaml.safe_dump({"kvgate": TENANTS, "ideal": {"tiers": ["gold"]}}))
    with pytest.raises(ConfigError, match=r"ideal\.tiers: no tier named gold"):
        load_bench_config(cfg)
