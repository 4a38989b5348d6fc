"""Real fleets (issue 32): a pool of mixed GPUs, each node with its own performance prior — detected
from what its probe reports, or pinned in the config — and the simulator and benchmarks that run such
a pool. Virtual time and fixed seeds only: no wall-clock threshold."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from ext_proc.config import ConfigError, parse_config
from ext_proc.nodes import Fleet
from ext_proc.perf import from_config
from ext_proc.profiles import detect, get_profile
from gpu_probe.parse import EngineReading
from gpu_probe.snapshot import Deriver, Snapshot
from kvgate.bench.scenarios.driver import Policy, Run
from kvgate.bench.scenarios.workloads import PLACEHOLDER_NODES, SHORT, Stream, const, poisson

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def fleet(n: int = 2, **nodes: Any) -> Fleet:
    static = nodes.pop("static", None) or [{"address": f"10.0.0.{i}:8000", "probe": f"http://p{i}"} for i in range(n)]
    cfg = parse_config({"nodes": {"static": static, **nodes}})
    assert cfg.nodes is not None
    return Fleet(cfg.nodes, random.Random(3))


def reading(gpu: str | None, count: int | None = 1, model: str | None = LLAMA_8B, at: float = 0.0,
            kv: float = 0.1, running: float = 4.0) -> Snapshot:
    return Snapshot(node="n", at=at, ok=True, kv_usage=kv, blocks_total=20_000, block_size=16, running=running,
                    waiting=0.0, gpu_name=gpu, gpu_count=count, model=model)


# -- which profile a node's hardware matches ---------------------------------------------------------------


@pytest.mark.parametrize(("prior", "gpu", "count", "model", "want"), [
    ("8b-h100", A100, 1, LLAMA_8B, "8b-a100"),
    ("8b-h100", H100, 1, LLAMA_8B, "8b-h100"),
    ("8b-a100", H100, 1, LLAMA_8B, "8b-h100"),
    # a served-model alias (--served-model-name) says nothing: the prior's model, on the node's GPU
    ("8b-h100", A100, 1, "my-chat-model", "8b-a100"),
    ("34b-h100", A100, 1, "codellama/CodeLlama-34b-Instruct-hf", "34b-a100"),
    ("70b-h100x4", H100, 4, "meta-llama/Llama-3.1-70B-Instruct", "70b-h100x4"),
    # nothing built in matches: the caller keeps the pool's prior
    ("70b-h100x4", H100, 2, "meta-llama/Llama-3.1-70B-Instruct", None),
    ("8b-h100", "NVIDIA L4", 1, LLAMA_8B, None),
    ("8b-h100", None, None, LLAMA_8B, None),
])
def test_detect_matches_the_gpu_the_count_and_the_model(prior: str, gpu: str | None, count: int | None,
                                                        model: str, want: str | None) -> None:
    assert detect(prior, gpu, count, model) == want


# -- the probe reports the hardware ---------------------------------------------------------------------


def test_the_probe_reports_the_gpu_its_count_and_the_served_model() -> None:
    d = Deriver("n")
    snap = d.update({("m-8b", "0"): EngineReading("m-8b", "0", kv_usage=0.2)}, 1.0,
                    {"memory_used": 1, "memory_total": 2, "utilization": 0.5, "name": A100, "count": 1})
    assert (snap.gpu_name, snap.gpu_count, snap.model) == (A100, 1, "m-8b")
    # through the JSON kvgate reads, validated like every field
    back = Snapshot.from_json(snap.to_json())
    assert (back.gpu_name, back.gpu_count, back.model) == (A100, 1, "m-8b")
    with pytest.raises(ValueError, match="gpu_count"):
        Snapshot.from_json({**snap.to_json(), "gpu_count": -1})


# -- each node gets its own prior ------------------------------------------------------------------------


def test_a_node_gets_the_prior_of_the_gpu_its_probe_reports() -> None:
    f = fleet(2, performance={"profile": "8b-h100"})
    f.on_snapshot("10.0.0.0:8000", reading(H100), 0.0)
    f.on_snapshot("10.0.0.1:8000", reading(A100), 0.0)
    h, a = f.nodes["10.0.0.0:8000"], f.nodes["10.0.0.1:8000"]
    assert (h.profile, h.profile_source) == ("8b-h100", "pool")
    assert (a.profile, a.profile_source) == ("8b-a100", "detected")
    assert a.model == from_config(parse_config({"nodes": {**PLACEHOLDER_NODES,
                                                          "performance": {"profile": "8b-a100"}}}).nodes.performance)
    # the same prompt on the same load takes longer to prefill on the A100, and the prediction says so
    assert f.predict(a, 2000, 0, 0.0) > 2 * f.predict(h, 2000, 0, 0.0)


def test_placement_prefers_the_faster_node_for_equal_load() -> None:
    f = fleet(2, performance={"profile": "8b-h100"})
    f.on_snapshot("10.0.0.0:8000", reading(A100), 0.0)
    f.on_snapshot("10.0.0.1:8000", reading(H100), 0.0)
    choice = f.choose(1000, 0.0, prompt_tokens=900)
    assert choice.node is not None and choice.node.address == "10.0.0.1:8000"


def test_detection_can_be_turned_off_and_a_pin_wins_over_the_probe() -> None:
    off = fleet(1, performance={"profile": "8b-h100", "detect": False})
    off.on_snapshot("10.0.0.0:8000", reading(A100), 0.0)
    assert off.nodes["10.0.0.0:8000"].profile == "8b-h100"
    pinned = fleet(static=[{"address": "10.0.0.0:8000", "probe": "http://p0", "profile": "8b-a100"},
                           {"address": "10.0.0.1:8000", "probe": "http://p1"}])
    pinned.on_snapshot("10.0.0.0:8000", reading(H100), 0.0)  # the pin wins over what the probe says
    pinned.on_snapshot("10.0.0.1:8000", reading(None), 0.0)  # no GPU reported: the pool's prior
    assert [(n.profile, n.profile_source) for n in pinned.nodes.values()] == [("8b-a100", "pinned"),
                                                                               ("8b-h100", "pool")]
    group = fleet(static=[], dns={"name": "vllm-a100.llm.svc", "profile": "8b-a100"})
    group.set_nodes([("10.1.0.1:8000", "http://10.1.0.1:9102", None)])
    assert group.nodes["10.1.0.1:8000"].profile_source == "pinned"


def test_an_unknown_pinned_profile_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"nodes\.static\[0\]\.profile"):
        parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://p", "profile": "8b-tpu"}]}})
    with pytest.raises(ConfigError, match=r"nodes\.dns\.profile"):
        parse_config({"nodes": {"dns": {"name": "vllm", "profile": "8b-tpu"}}})


def test_a_node_whose_prior_changes_learns_its_speed_again() -> None:
    f = fleet(1)
    n = f.nodes["10.0.0.0:8000"]
    f.on_snapshot(n.address, reading(None), 0.0)
    n.speed.observe(2.5)  # an A100 read against the H100 prior: 2.5x slow
    f.on_snapshot(n.address, reading(A100, at=1.0), 1.0)  # a probe that now reports its GPU
    assert n.profile == "8b-a100" and n.speed.readings == 0 and n.speed.factor == 1.0
    f.on_snapshot(n.address, reading(A100, at=2.0), 2.0)  # the same hardware again: nothing relearned
    n.speed.observe(1.1)
    f.on_snapshot(n.address, reading(A100, at=3.0), 3.0)
    assert n.speed.readings == 1


# -- the simulator and the benchmarks run mixed nodes -------------------------------------------------------


def test_a_mixed_run_gives_each_node_its_profile_and_kvgate_learns_each_prior() -> None:
    cfg = parse_config({"tenants": [{"name": "t"}], "nodes": {**PLACEHOLDER_NODES,
                                                              "performance": {"profile": "8b-h100"}}})
    trace = poisson([Stream("t", SHORT, const(20.0))], 20.0, 1)
    run = Run(cfg, Policy("kvgate", 4, "kvgate"), get_profile("8b-h100"), trace, 1,
              node_profiles=("8b-h100", "8b-a100"))
    res = run.run()
    assert [n.engine.profile.name for n in run.nodes] == ["8b-h100", "8b-a100"] * 2
    assert run.core is not None and run.core.fleet is not None
    book = run.core.fleet
    assert [book.nodes[n.address].profile for n in run.nodes] == ["8b-h100", "8b-a100"] * 2
    # every node runs at its own prior's speed: nothing left for the speed factor to learn
    assert all(0.8 < n.speed.factor < 1.25 for n in book.nodes.values())
    assert set(res.prediction_errors) == {"8b-h100", "8b-a100"}
    assert all(abs(statistics.median(e)) < 0.5 for e in res.prediction_errors.values())


def test_a_uniform_run_reports_no_gpu_and_records_no_prediction_errors() -> None:
    cfg = parse_config({"tenants": [{"name": "t"}], "nodes": PLACEHOLDER_NODES})
    trace = poisson([Stream("t", SHORT, const(5.0))], 5.0, 1)
    run = Run(cfg, Policy("kvgate", 2, "kvgate"), get_profile("8b-h100"), trace, 1)
    res = run.run()
    assert all(n.gpu is None for n in run.nodes) and res.prediction_errors == {}
