"""Real fleets (issue 32): a pool of mixed GPUs, each node with its own performance prior — detected
from what its probe reports, or pinned in the config — and the simulator and benchmarks that run such
a pool. Virtual time and fixed seeds only: no wall-clock threshold."""

from __future__ import annotations

import copy
import random
import statistics
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ext_proc.config import ConfigError, parse_config
from ext_proc.core import Answer, Core, null_logger
from ext_proc.core import Request as GatewayRequest
from ext_proc.identity import hash_key
from ext_proc.nodes import Fleet
from ext_proc.perf import from_config
from ext_proc.profiles import PROFILES, detect, get_profile
from gpu_probe.parse import EngineReading, parse
from gpu_probe.snapshot import Deriver, Snapshot, StreamDecoder
from kvgate.bench.scenarios.driver import Policy, Run, kv_shed_config
from kvgate.bench.scenarios.runner import run as run_scenario
from kvgate.bench.scenarios.workloads import PLACEHOLDER_NODES, SHORT, Stream, const, get_scenario, poisson
from sim.engine import Engine, EngineOptions
from sim.metrics import NodeMetrics
from sim.scheduler import Request as SimRequest
from tests.helpers import FakeClock

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
    for at in (1.0, 2.0, 3.0):  # a probe that now reports its GPU: taken after HARDWARE_CONFIRM readings
        assert n.profile == "8b-h100"
        f.on_snapshot(n.address, reading(A100, at=at), at)
    assert n.profile == "8b-a100" and n.speed.readings == 0 and n.speed.factor == 1.0
    f.on_snapshot(n.address, reading(A100, at=4.0), 4.0)  # the same hardware again: nothing relearned
    n.speed.observe(1.1)
    f.on_snapshot(n.address, reading(A100, at=5.0), 5.0)
    assert n.speed.readings == 1


def test_a_probe_reporting_other_hardware_each_reading_cannot_reset_its_node() -> None:
    """Review: every change of the reported GPU reset the node's learned speed and latency baseline, so
    a probe alternating its GPU name kept its node from ever learning a baseline — from ever tripping
    its latency breaker. A change is taken only after HARDWARE_CONFIRM readings in a row."""
    from ext_proc.nodebook import HARDWARE_CONFIRM

    f = fleet(1)
    n = f.nodes["10.0.0.0:8000"]
    f.on_snapshot(n.address, reading(H100), 0.0)
    n.speed.observe(1.2)
    for i in range(1, 20):
        f.on_snapshot(n.address, reading(A100 if i % 2 else H100, at=float(i)), float(i))
    assert n.profile == "8b-h100" and n.speed.readings == 1, "the flapping node kept what it learned"
    for i in range(20, 20 + HARDWARE_CONFIRM):
        f.on_snapshot(n.address, reading(A100, at=float(i)), float(i))
    assert n.profile == "8b-a100" and n.speed.readings == 0


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


# == LoRA adapters ========================================================================================

LORA_SAMPLE = Path(__file__).resolve().parent / "fixtures" / "vllm-lora-metrics-sample.txt"
REFERENCE = Path(__file__).resolve().parent / "fixtures" / "vllm-metrics-sample.txt"


# -- the probe reads vllm:lora_requests_info -----------------------------------------------------------------


def test_the_probe_reads_the_newest_lora_series_of_a_real_exposition() -> None:
    text = REFERENCE.read_text() + LORA_SAMPLE.read_text()
    (r,) = parse(text).values()
    # three label sets; the newest (the largest time) is the state now: nothing running or waiting
    assert (r.lora_running, r.lora_waiting, r.max_lora) == ([], [], 2)
    # the same exposition a moment earlier: adapter_json was running and waiting
    earlier = text.replace("1.7886264577368872e+09", "1.7886264500000000e+09")
    (r,) = parse(earlier).values()
    assert (r.lora_running, r.lora_waiting, r.max_lora) == (["adapter_json"], ["adapter_json"], 2)
    snap = Deriver("n").update(parse(earlier), 1.0)
    assert (snap.lora_running, snap.lora_waiting, snap.max_lora) == (["adapter_json"], ["adapter_json"], 2)
    # no LoRA metric (vLLM without --enable-lora): None, not "no adapter"
    assert Deriver("n").update(parse(REFERENCE.read_text()), 1.0).lora_running is None


def test_a_probe_cannot_send_anything_but_names_as_adapters() -> None:
    doc = {"node": "n", "at": 1.0, "ok": True, "lora_running": ["a", 3]}
    with pytest.raises(ValueError, match="lora_running"):
        Snapshot.from_json(doc)
    d = StreamDecoder()
    d.feed({"node": "n", "at": 1.0, "ok": True, "lora_running": ["a"]})
    with pytest.raises(ValueError, match="lora_running"):
        d.feed({"at": 2.0, "lora_running": [{"x": 1}]})


# -- the simulator: slots, loads, the metric -----------------------------------------------------------------


def lora_engine(max_loras: int | None = 1, **opts: Any) -> Engine:
    return Engine(get_profile("8b-h100"), EngineOptions(max_loras=max_loras, **opts))


def run_until_idle(e: Engine, now: float = 0.0) -> float:
    while (dt := e.begin_step(now)) is not None:
        now += dt
        e.end_step(now)
    return now


def test_a_request_whose_adapter_cannot_join_the_batch_waits_and_lets_others_by() -> None:
    e = lora_engine(1)
    a = SimRequest("a", 100, 20, 0.0, lora="x")
    b = SimRequest("b", 100, 20, 0.0, lora="y")  # its adapter needs a slot: the batch's one is x's
    c = SimRequest("c", 100, 20, 0.0)  # the base model: no slot
    d = SimRequest("d", 100, 20, 0.0, lora="x")
    for r in (a, b, c, d):
        e.add(r)
    plan = e.scheduler.schedule(0.0)
    assert [r.id for r, _ in plan.scheduled] == ["a", "c", "d"]
    assert [r.id for r in e.scheduler.waiting()] == ["b"]  # kept its place
    e.scheduler.finish_step(plan, 0.01)
    assert e.scheduler.lora_requests() == ({"x": 2}, {"y": 1})
    run_until_idle(e, 0.01)
    assert a.first_token is not None and b.first_scheduled is not None and a.finished_at is not None
    assert d.finished_at is not None and b.first_scheduled >= max(a.finished_at, d.finished_at)


def test_without_max_loras_adapters_are_not_limited() -> None:
    e = lora_engine(None)
    for i, lora in enumerate("xyz"):
        e.add(SimRequest(f"r{i}", 100, 20, 0.0, lora=lora))
    plan = e.scheduler.schedule(0.0)
    assert len(plan.scheduled) == 3
    assert e.begin_step(0.0) == pytest.approx(
        get_profile("8b-h100").step_ms(plan.prefill_tokens, plan.decode_seqs, plan.context_tokens) / 1000.0)


def test_loading_an_adapter_costs_its_step_time_once_until_it_is_evicted() -> None:
    e = lora_engine(2, lora_load_ms=150.0, lora_swap_ms=2.0)
    prof = get_profile("8b-h100")

    def step_of(*loras: str) -> float:
        for i, lora in enumerate(loras):
            e.add(SimRequest(f"{lora}{e.steps}-{i}", 16, 1, 0.0, lora=lora))
        dt = e.begin_step(0.0)
        assert dt is not None and e._plan is not None
        p = e._plan
        e.end_step(dt)
        return dt * 1000.0 - prof.step_ms(p.prefill_tokens, p.decode_seqs, p.context_tokens)

    assert step_of("x", "y") == pytest.approx(2 * 152.0)  # both loaded from disk into a slot
    assert step_of("x") == pytest.approx(0.0)  # held: nothing to load
    assert step_of("z") == pytest.approx(152.0)  # y, the least recently used, leaves for z
    assert step_of("y") == pytest.approx(152.0)
    assert (e.lora_loads, e.lora_swaps) == (4, 4)
    # host memory larger than the slots: an evicted adapter comes back from there, cheaply
    e = lora_engine(1, max_cpu_loras=4, lora_load_ms=150.0, lora_swap_ms=2.0)
    assert [step_of(x) for x in "xyx"] == pytest.approx([152.0, 152.0, 2.0])


def test_the_simulated_node_exports_lora_requests_info_as_vllm_does() -> None:
    e = lora_engine(1)
    metrics = NodeMetrics(e, "m")
    e.add(SimRequest("a", 100, 5, 0.0, lora="x"))
    e.add(SimRequest("b", 100, 5, 0.0, lora="y"))
    dt = e.begin_step(0.0)
    assert dt is not None
    e.end_step(dt)
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="x",waiting_lora_adapters="y"}' in text
    (r,) = parse(text).values()
    assert (r.lora_running, r.lora_waiting, r.max_lora) == (["x"], ["y"], 1)
    run_until_idle(e, dt)
    (r,) = parse(generate_latest(metrics.registry).decode()).values()  # the older label sets stay; the newest wins
    assert (r.lora_running, r.lora_waiting) == ([], [])


# -- kvgate: adapter affinity ---------------------------------------------------------------------------------


def lora_fleet(**lora: Any) -> Fleet:
    f = fleet(2, lora=lora)
    f.adapters = frozenset({"x", "y"})
    return f


def lora_reading(running: list[str], at: float = 0.0, waiting: float = 0.0, max_lora: int = 4) -> Snapshot:
    return Snapshot(node="n", at=at, ok=True, kv_usage=0.1, blocks_total=20_000, block_size=16,
                    running=float(len(running)), waiting=waiting, lora_running=running, lora_waiting=[],
                    max_lora=max_lora)


def test_a_node_holding_the_adapter_wins_and_a_load_is_counted_in_the_prediction() -> None:
    f = lora_fleet(load_seconds=0.15)
    f.on_snapshot("10.0.0.0:8000", lora_reading([]), 0.0)
    f.on_snapshot("10.0.0.1:8000", lora_reading(["x"]), 0.0)
    other, holder = f.nodes["10.0.0.0:8000"], f.nodes["10.0.0.1:8000"]
    for i in range(4):  # the same answer every time, whatever the tie-break among equals would say
        c = f.choose(300, 0.0, prompt_tokens=200, adapter="x")
        assert c.node is holder and c.ttft == pytest.approx(f.predict(holder, 200, 0, 0.0)), i
    c = f.choose(300, 0.0, prompt_tokens=200, adapter="y")  # nobody holds it: a load either way
    assert c.node is not None and c.ttft == pytest.approx(f.predict(c.node, 200, 0, 0.0) + 0.15)
    # sent there: held from now on, before any reading says so
    placed = f.place(300, 200, "t1", 0.0, adapter="y")
    assert placed.node is not None and "y" in placed.node.loras
    assert f.choose(300, 0.0, prompt_tokens=200, adapter="y").node is placed.node
    assert "y" not in (holder if placed.node is other else other).loras


def test_an_adapter_load_is_the_requests_own_time_not_work_ahead() -> None:
    """attack68 H1: a request is refused for the work ahead of it, not for its own prefill — and loading its
    adapter is its own too (a refused request never loads it: counted as work ahead, a standard request whose
    prefill and load together passed its 1 s target was refused on every retry on an idle node while the
    interactive tier had traffic; it goes, late by its own time)."""
    from ext_proc.nodes import Level

    static = [{"address": "a:1", "probe": "http://p"}]
    f = fleet(static=static, performance={"profile": "34b-a100"}, lora={"load_seconds": 0.15})
    f.adapters = frozenset({"z"})
    f.on_snapshot("a:1", lora_reading([]), 0.0)
    f.set_levels([Level(0, 0.2)])
    n = f.nodes["a:1"]
    p = 2730
    assert 0.85 < f.predict(n, p, 0, 0.0) < 1.0 < f.predict(n, p, 0, 0.0) + f.lora_cost(n, "z")
    f.choose(216, 0.0, prompt_tokens=200, target=0.2, limit=1.0, urgent=True)  # the top tier has traffic
    c = f.choose(p + 16, 0.0, prompt_tokens=p, target=1.0, limit=5.0, urgent=False, adapter="z")
    assert c.node is n and c.ttft is not None and c.ttft > 1.0


def test_the_wait_for_a_free_adapter_slot_is_work_ahead() -> None:
    """review69 M3: the wait for a LoRA slot (every slot runs another adapter) is the other requests' work,
    not the request's own: a request whose prefill and load make its target but not with that wait is
    refused for it — with the top tier active, as a new arrival of a lower tier — and told to come back."""
    from ext_proc.nodes import Level

    static = [{"address": "a:1", "probe": "http://p"}]
    f = fleet(static=static, performance={"profile": "34b-a100"}, lora={"load_seconds": 0.15})
    f.adapters = frozenset({"z"})
    f.on_snapshot("a:1", lora_reading(["a", "b", "c", "d"], max_lora=4), 0.0)  # every slot taken
    f.set_levels([Level(0, 0.2)])
    n = f.nodes["a:1"]
    p = 500
    own = f.predict(n, p, 0, 0.0)
    slot = f.lora_cost(n, "z") - 0.15
    assert slot > 0.1
    target = own + 0.15 + slot / 2  # made with the load, not with the slot wait
    f.choose(216, 0.0, prompt_tokens=200, target=0.2, limit=1.0, urgent=True)  # the top tier has traffic
    c = f.choose(p + 16, 0.0, prompt_tokens=p, target=target, limit=5.0, urgent=False, adapter="z")
    assert (c.node, c.reason) == (None, "fleet-queue") and c.ttft is not None
    assert c.retry_after == pytest.approx(c.ttft - target)  # when it would make its target


@pytest.mark.parametrize(("booked", "holder_wins"), [(400, True), (12000, False)])
def test_a_holder_loses_when_its_first_token_is_later_by_more_than_a_load(booked: int, holder_wins: bool) -> None:
    f = lora_fleet(load_seconds=0.15)
    f.on_snapshot("10.0.0.0:8000", lora_reading([]), 0.0)
    f.on_snapshot("10.0.0.1:8000", lora_reading(["x"]), 0.0)
    other, holder = f.nodes["10.0.0.0:8000"], f.nodes["10.0.0.1:8000"]
    f.booked_elsewhere(holder.address, booked + 100, booked, 0, 0.0)  # prefill queued on the holder
    gap = f.predict(holder, 200, 0, 0.0) - f.predict(other, 200, 0, 0.0)
    assert (gap <= 0.15) == holder_wins  # the cases are what they claim
    c = f.choose(300, 0.0, prompt_tokens=200, adapter="x")
    assert (c.node is holder) == holder_wins


def test_a_slot_wait_counts_when_every_slot_runs_another_adapter() -> None:
    f = lora_fleet(load_seconds=0.15)
    f.on_snapshot("10.0.0.0:8000", lora_reading(["a", "b"], max_lora=2), 0.0)
    n = f.nodes["10.0.0.0:8000"]
    assert f.lora_cost(n, "a") == 0.0
    assert f.lora_cost(n, "x") > 0.15  # a load, and the wait for a batch with a free slot
    f.on_snapshot("10.0.0.0:8000", lora_reading(["a"], at=1.0, max_lora=2), 1.0)
    assert f.lora_cost(n, "x") == pytest.approx(0.15)  # a slot is free: only the load


def test_lora_affinity_can_be_turned_off() -> None:
    f = lora_fleet(enabled=False)
    f.on_snapshot("10.0.0.0:8000", lora_reading([]), 0.0)
    f.on_snapshot("10.0.0.1:8000", lora_reading(["x"]), 0.0)
    c = f.choose(300, 0.0, prompt_tokens=200, adapter="y")
    assert c.node is not None and c.ttft == pytest.approx(f.predict(c.node, 200, 0, 0.0))


def test_per_adapter_budgets_come_from_per_model_budgets() -> None:
    cfg = parse_config({
        "tenants": [{"name": "acme", "api_key_sha256": [hash_key("k")],
                     "model_budgets": {"sql-lora": {"max_concurrent": 1}}}],
        "pools": [{"name": "p", "models": ["llama-8b"], "adapters": ["sql-lora", "chat-lora"],
                   "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}]}}],
    })
    clock = FakeClock()
    core = Core(cfg, clock, rng=random.Random(1), log=null_logger())
    core.snapshot("10.0.0.1:8000", Snapshot(node="n", at=clock(), ok=True, kv_usage=0.1, blocks_total=20_000,
                                            block_size=16, running=0.0, waiting=0.0, lora_running=[],
                                            lora_waiting=[], max_lora=4), 0.0)

    def ask(model: str, rid: str) -> Answer:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
        out = core.decide(GatewayRequest("/v1/chat/completions", rid, "Bearer k", orjson.dumps(body)))
        assert isinstance(out, Answer)
        return out

    first = ask("sql-lora", "a")
    assert first.reply is None and first.decision.lease is not None
    second = ask("sql-lora", "b")  # the adapter's own budget: one at a time
    assert second.reply is not None and second.reply.status == 429
    assert second.decision.rejection is not None and second.decision.rejection.reason == "tenant-concurrency"
    other = ask("chat-lora", "c")  # another adapter of the same pool is not limited by it
    assert other.reply is None
    book = core.fleet
    assert book is not None and book.adapters == frozenset({"sql-lora", "chat-lora"})
    # the adapter went into the node's slots
    assert set(book.nodes["10.0.0.1:8000"].loras) == {"sql-lora", "chat-lora"}


def test_kv_shed_routes_adapters_as_plain_model_names() -> None:
    cfg = parse_config({"tenants": [{"name": "t"}], "pools": [
        {"name": "p", "models": ["m"], "adapters": ["x"],
         "nodes": {"static": [{"address": "a:1", "probe": "http://p"}]}}]})
    shed = kv_shed_config(cfg)
    assert shed["pools"][0]["nodes"]["lora"]["enabled"] is False


def test_the_lora_scenario_loads_fewer_adapters_with_kvgate() -> None:
    sc = get_scenario("lora-adapters")
    res = run_scenario(sc, scale=0.25)
    loads = res.lora_loads
    none, shed, gate = (loads[p.label]["loads"] for p in sc.policies)
    assert gate < shed and gate < none
    p99 = {s.result.policy.name: s.tiers["interactive"].ttft[2] for s in res.summaries}
    assert p99["kvgate"] < p99["kv-shed"]
    # and it is the adapter affinity that does it: kvgate with it off loads about as many as kv-shed
    doc = copy.deepcopy(sc.config)
    doc["pools"][0]["nodes"]["lora"] = {"enabled": False}
    off = Run(parse_config(doc), sc.policies[2], get_profile(sc.profile), sc.trace(0.25), sc.seed,
              engine=sc.engine).run()
    assert gate < off.lora_loads / 1.5


async def test_the_simulated_server_serves_its_lora_modules_and_reports_them() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from sim.server import SimOptions, SimServer

    server = SimServer(get_profile("8b-h100"), EngineOptions(max_loras=2),
                       SimOptions(served_model_name="base", lora_modules=("sql-lora",), mean_output_tokens=4))
    async with TestClient(TestServer(server.app())) as client:
        models = await (await client.get("/v1/models")).json()
        assert [(m["id"], m["parent"]) for m in models["data"]] == [("base", None), ("sql-lora", "base")]
        ok = await client.post("/v1/completions", json={"model": "sql-lora", "prompt": "hi", "max_tokens": 3})
        assert ok.status == 200
        missing = await client.post("/v1/completions", json={"model": "other-lora", "prompt": "hi"})
        assert missing.status == 404
        text = await (await client.get("/metrics")).text()
    assert 'running_lora_adapters="sql-lora"' in text  # while it ran
    (r,) = parse(text).values()
    assert r.max_lora == 2 and r.lora_running == []  # the newest state: done


# -- the scaler's KV arithmetic over nodes of different sizes -------------------------------------------------

KV_PAGE = """# TYPE kvgate_requests_total counter
kvgate_requests_total{tenant="a",tier="standard",decision="admit",reason="ok",class="none",pool="p"} 1
# TYPE kvgate_node_kv_usage_ratio gauge
kvgate_node_kv_usage_ratio{node="big:8000",pool="p"} 0.9
kvgate_node_kv_usage_ratio{node="small:8000",pool="p"} 0.1
"""


def test_the_scaler_weighs_each_nodes_kv_usage_by_its_size() -> None:
    from scaler.signals import parse_kvgate

    sized = KV_PAGE + """# TYPE kvgate_node_kv_capacity_tokens gauge
kvgate_node_kv_capacity_tokens{node="big:8000",pool="p"} 300000
kvgate_node_kv_capacity_tokens{node="small:8000",pool="p"} 100000
"""
    # 270k of 300k tokens used and 10k of 100k: the pool is 70% full, not the mean ratio's 50%
    r = parse_kvgate(sized)
    assert r.pools["p"].kv_usage == pytest.approx(0.7) and r.kv_usage == pytest.approx(0.7)
    # an older kvgate (no capacity gauge), or a node without a size: the mean ratio, as before
    assert parse_kvgate(KV_PAGE).pools["p"].kv_usage == pytest.approx(0.5)
    partial = KV_PAGE + ('# TYPE kvgate_node_kv_capacity_tokens gauge\n'
                         'kvgate_node_kv_capacity_tokens{node="big:8000",pool="p"} 3\n')
    assert parse_kvgate(partial).pools["p"].kv_usage == pytest.approx(0.5)


def test_kvgate_exports_each_nodes_kv_capacity() -> None:
    cfg = parse_config({"tenants": [{"name": "t"}], "nodes": {"static": [
        {"address": "10.0.0.1:8000", "probe": "http://p"}, {"address": "10.0.0.2:8000", "probe": "http://q"}]}})
    core = Core(cfg, FakeClock(), rng=random.Random(1), log=null_logger())
    core.snapshot("10.0.0.1:8000", Snapshot(node="n", at=0.0, ok=True, kv_usage=0.5, blocks_total=1000,
                                            block_size=16), 0.0)
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_node_kv_capacity_tokens{node="10.0.0.1:8000",pool="default"} 16000.0' in text
    assert 'kvgate_node_kv_capacity_tokens{node="10.0.0.2:8000"' not in text  # no reading: no size


def test_kvgate_says_which_profile_each_node_runs_and_why() -> None:
    cfg = parse_config({"tenants": [{"name": "t"}], "nodes": {"static": [
        {"address": "10.0.0.1:8000", "probe": "http://p"},
        {"address": "10.0.0.2:8000", "probe": "http://q", "profile": "8b-a100"}]}})
    core = Core(cfg, FakeClock(), rng=random.Random(1), log=null_logger())
    core.snapshot("10.0.0.1:8000", reading(A100), 0.0)
    text = generate_latest(core.stats.registry).decode()
    assert ('kvgate_node_profile_info{node="10.0.0.1:8000",pool="default",profile="8b-a100",source="detected"} 1.0'
            in text)
    assert 'kvgate_node_profile_info{node="10.0.0.2:8000",pool="default",profile="8b-a100",source="pinned"}' in text


def test_nvml_reports_the_gpus_name_and_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from gpu_probe.nvml import Nvml

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: object()  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA A100-SXM4-80GB"  # type: ignore[attr-defined]  # older pynvml: bytes
    fake.nvmlDeviceGetCount = lambda: 4  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=1, total=2)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reading = Nvml().read()
    assert (reading["name"], reading["count"]) == ("NVIDIA A100-SXM4-80GB", 4)
    assert detect("70b-h100x4", reading["name"], reading["count"]) is None  # an A100 x4 has no built-in profile


# -- invariants ----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, "a", "b", "c", "d", "e"]), st.integers(1, 600), st.integers(1, 40),
                          st.floats(0, 0.5)), min_size=1, max_size=40),
       st.integers(1, 3), st.sampled_from(["fcfs", "priority"]))
def test_a_batch_never_holds_more_adapters_than_max_loras_and_every_request_ends(
        reqs: list[tuple[str | None, int, int, float]], max_loras: int, policy: str) -> None:
    e = Engine(get_profile("8b-h100"), EngineOptions(max_loras=max_loras, policy=policy,  # type: ignore[arg-type]
                                                     num_gpu_blocks=400))
    pending = sorted((SimRequest(f"r{i}", p, o, t, priority=i % 2, lora=lora)
                      for i, (lora, p, o, t) in enumerate(reqs)), key=lambda r: r.arrival)
    now, k, steps = 0.0, 0, 0
    while k < len(pending) or e.scheduler.has_work():
        while k < len(pending) and pending[k].arrival <= now:
            e.add(pending[k])
            k += 1
        dt = e.begin_step(now)
        if dt is None:
            now = pending[k].arrival
            continue
        assert e._plan is not None
        assert len({r.lora for r, _ in e._plan.scheduled if r.lora is not None}) <= max_loras
        assert len(e.gpu_loras) <= max_loras
        now += dt
        e.end_step(now)
        steps += 1
        assert steps < 20_000
    assert all(r.finished_at is not None for r in pending)


@given(st.sampled_from(sorted(PROFILES)), st.text(max_size=30) | st.sampled_from([H100, A100, "NVIDIA L40S"]),
       st.none() | st.integers(0, 8), st.none() | st.sampled_from([p.model_name for p in PROFILES.values()] + ["x"]))
def test_a_detected_profile_always_fits_the_reported_hardware(prior: str, gpu: str, count: int | None,
                                                               model: str | None) -> None:
    found = detect(prior, gpu, count, model)
    if found is not None:
        p = PROFILES[found]
        assert p.gpu.upper() in gpu.upper() and p.gpus == (count or 1)
        assert p.model_name in (model, PROFILES[prior].model_name)


def test_a_reload_that_pins_a_node_gives_it_that_prior_and_leaves_the_others_learned() -> None:
    f = fleet(2)
    a, b = f.nodes["10.0.0.0:8000"], f.nodes["10.0.0.1:8000"]
    for n in (a, b):
        f.on_snapshot(n.address, reading(None), 0.0)
        n.speed.observe(2.0)
    cfg = parse_config({"nodes": {"static": [{"address": "10.0.0.0:8000", "probe": "http://p0", "profile": "8b-a100"},
                                             {"address": "10.0.0.1:8000", "probe": "http://p1"}]}})
    assert cfg.nodes is not None
    f.reconfigure(cfg.nodes)
    assert (a.profile, a.profile_source, a.speed.readings) == ("8b-a100", "pinned", 0)
    assert (b.profile, b.speed.readings, b.speed.factor) == ("8b-h100", 1, 2.0)


def test_a_hostile_lora_exposition_neither_pins_the_state_nor_grows_without_bound() -> None:
    """Review: a NaN (or infinite) time on the first series froze the choice of the newest one (every
    comparison with NaN is false), and a label of any length became any number of adapter names, each
    inserted per reading and walked per adapter request. Non-finite times are skipped; the lists are
    capped at MAX_NAMES names of at most MAX_NAME_CHARS."""
    from gpu_probe.parse import MAX_NAME_CHARS, MAX_NAMES

    many = ",".join(f"a{i}" for i in range(10_000)) + "," + "x" * 1_000_000
    lora = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="stale",waiting_lora_adapters=""} NaN\n'
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{many}",waiting_lora_adapters=""}} '
        "1.7e+09\n"
    )
    (r,) = parse(REFERENCE.read_text() + lora).values()
    assert r.lora_running is not None and r.lora_running[0] == "a0", "the real series wins over the NaN one"
    assert len(r.lora_running) == MAX_NAMES and all(len(n) <= MAX_NAME_CHARS for n in r.lora_running)
    snap = Deriver("n").update(parse(REFERENCE.read_text() + lora), 1.0)
    assert snap.lora_running is not None and len(snap.lora_running) == MAX_NAMES


def test_a_probe_cannot_send_unbounded_names() -> None:
    """Review: a probe's snapshot could carry 10,000 adapters, a 1 MB GPU name or max_lora of a
    million; each is refused like any other bad value, by a poll and by a stream message."""
    from gpu_probe.parse import MAX_NAME_CHARS, MAX_NAMES

    base = {"node": "n", "at": 1.0, "ok": True}
    for bad in ({"lora_running": [f"a{i}" for i in range(MAX_NAMES + 1)]},
                {"lora_waiting": ["x" * (MAX_NAME_CHARS + 1)]}, {"gpu_name": "H" * 1_000_000},
                {"model": "m" * (MAX_NAME_CHARS + 1)}, {"max_lora": MAX_NAMES + 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Snapshot.from_json({**base, **bad})
        d = StreamDecoder()
        d.feed(dict(base))
        with pytest.raises(ValueError, match=next(iter(bad))):
            d.feed({"at": 2.0, **bad})
    ok = Snapshot.from_json({**base, "gpu_name": "NVIDIA H100 80GB HBM3", "lora_running": ["a"] * MAX_NAMES,
                             "max_lora": MAX_NAMES})
    assert ok.gpu_name == "NVIDIA H100 80GB HBM3" and ok.lora_running is not None
