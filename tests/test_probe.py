"""The probe: vLLM's exposition (the real reference sample too), deltas, failures, a live sim node."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpu_probe.nvml import Nvml
from gpu_probe.parse import KV_NEW, KV_OLD, ParseError, parse
from gpu_probe.server import STREAM_PATH, Probe
from gpu_probe.snapshot import Deriver, Snapshot, changes
from kvgate.dev.stack import free_port, wait_port

REFERENCE = Path(__file__).resolve().parent / "fixtures" / "vllm-metrics-sample.txt"
M = 'model_name="m",engine="0"'


def exposition(kv: float = 0.5, name: str = KV_NEW, prefill: tuple[float, float] = (1.0, 10), engine: str = "0",
               model: str = "m", preempt: float = 0) -> str:
    lab = f'model_name="{model}",engine="{engine}"'
    return (f"# TYPE {name} gauge\n{name}{{{lab}}} {kv}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{lab}}} 3\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{lab}}} 2\n"
            f"# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{{{lab}}} {preempt}\n"
            f"# TYPE vllm:request_prefill_time_seconds histogram\n"
            f'vllm:request_prefill_time_seconds_bucket{{{lab},le="+Inf"}} {prefill[1]}\n'
            f"vllm:request_prefill_time_seconds_sum{{{lab}}} {prefill[0]}\n"
            f"vllm:request_prefill_time_seconds_count{{{lab}}} {prefill[1]}\n"
            f"# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",engine="{engine}",num_gpu_blocks="1000"}} 1\n')


def test_reads_the_real_vllm_exposition() -> None:
    [r] = parse(REFERENCE.read_text()).values()
    assert (r.model, r.engine) == ("meta-llama/Llama-3.1-8B-Instruct", "0")
    assert r.kv_usage == 0.4375 and r.kv_metric == KV_NEW
    assert (r.running, r.waiting) == (12, 3)
    assert (r.num_gpu_blocks, r.block_size) == (27306, 16)
    assert r.counters["preemptions"] == 2 and r.hist["ttft"] == (0.12, 1.0)


def test_falls_back_to_the_pre_0_10_name() -> None:
    [r] = parse(exposition(0.7, KV_OLD)).values()
    assert r.kv_usage == 0.7 and r.kv_metric == KV_OLD
    both = exposition(0.3, KV_NEW) + exposition(0.9, KV_OLD).split("\n", 2)[2]  # new wins when both exist
    assert next(iter(parse(both).values())).kv_usage == 0.3


def test_several_engines_and_models() -> None:
    text = exposition(0.2, engine="0", model="a") + exposition(0.8, engine="1", model="b").replace("# TYPE", "# X")
    readings = parse(text.replace("# X", "# TYPE", 0))
    assert set(readings) == {("a", "0"), ("b", "1")}
    snap = Deriver("n").update(readings, 1.0)
    assert snap.kv_usage == 0.8 and snap.running == 6 and snap.blocks_total == 2000
    assert snap.blocks_used == 1000


@pytest.mark.parametrize("text", ["", "garbage {{{ not prometheus", "# TYPE up gauge\nup 1\n", "\x00\xff"])
def test_garbage_and_missing_metrics_are_a_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse(text)


def test_missing_optional_metrics_give_nulls() -> None:
    [r] = parse(f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{M}}} 1\n").values()
    snap = Deriver("n").update({(r.model, r.engine): r}, 0.0)
    assert snap.running == 1 and snap.kv_usage is None and snap.prefill_s is None and snap.blocks_total is None


def test_recent_latency_and_preemption_rate_come_from_deltas() -> None:
    d = Deriver("n")
    assert d.update(parse(exposition(prefill=(10.0, 100))), 0.0).prefill_s is None  # no history yet
    s = d.update(parse(exposition(prefill=(13.0, 110), preempt=4)), 2.0)
    assert s.prefill_s == pytest.approx(0.3)  # 3 s over 10 new requests, not the lifetime mean 0.118
    assert s.preemptions_per_s == pytest.approx(2.0)
    s = d.update(parse(exposition(prefill=(13.0, 110), preempt=4)), 3.0)
    assert s.prefill_s == pytest.approx(0.3) and s.preemptions_per_s == 0  # no new observation: kept


def test_nvml_without_a_gpu_gives_nulls_and_never_raises() -> None:
    n = Nvml()
    reading = n.read()
    if n.error is not None:  # no package, driver or device (every CI machine)
        assert reading == {"memory_used": None, "memory_total": None, "utilization": None}
    else:
        assert reading["memory_total"] > 0 and 0 <= reading["utilization"] <= 1


def _sim(port: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "sim", "--port", str(port), "--num-gpu-blocks", "100"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc=p)
    return p


async def test_probe_against_a_live_sim_node_and_one_that_dies() -> None:
    port = free_port()
    sim = _sim(port)
    probe = Probe(f"http://127.0.0.1:{port}", timeout=0.5)
    try:
        async with aiohttp.ClientSession() as s:
            snap = await probe.poll_once(s)
            assert snap.ok and snap.kv_usage == 0 and snap.blocks_total == 100 and snap.running == 0
            assert snap.gpu_memory_total_bytes is None or snap.gpu_memory_total_bytes > 0
            req = s.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"prompt": "x" * 400, "max_tokens": 300, "ignore_eos": True})
            task = asyncio.ensure_future(req.__aenter__())
            for _ in range(100):
                snap = await probe.poll_once(s)
                if snap.running:
                    break
                await asyncio.sleep(0.02)
            assert snap.running == 1 and snap.kv_usage is not None and snap.kv_usage > 0
            resp = await task
            await resp.release()
            sim.terminate()
            sim.wait(5)
            snap = await probe.poll_once(s)
            assert not snap.ok and snap.error and snap.kv_usage is None
    finally:
        sim.kill()


def test_prefill_latency_is_normalised_by_prompt_tokens() -> None:
    def text(prefill: tuple[float, float], prompt: tuple[float, float]) -> str:
        return exposition(prefill=prefill) + (
            "# TYPE vllm:request_prompt_tokens histogram\n"
            f'vllm:request_prompt_tokens_bucket{{{M},le="+Inf"}} {prompt[1]}\n'
            f"vllm:request_prompt_tokens_sum{{{M}}} {prompt[0]}\n"
            f"vllm:request_prompt_tokens_count{{{M}}} {prompt[1]}\n")

    d = Deriver("n")
    d.update(parse(text((10.0, 100), (50_000, 100))), 0.0)
    s = d.update(parse(text((13.0, 110), (56_000, 110))), 1.0)
    assert s.prefill_s == pytest.approx(0.3)
    assert s.prefill_s_per_ktok == pytest.approx(0.5)  # 3 s of prefill for 6000 prompt tokens
    assert s.latency_fresh is True
    idle = d.update(parse(text((13.0, 110), (56_000, 110))), 2.0)  # no request finished since
    assert idle.prefill_s_per_ktok == pytest.approx(0.5) and idle.latency_fresh is False  # shown, but old


def prefix(queries: float, hits: float, old: bool = False, lab: str = M) -> str:
    q, h = ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits") if old else \
        ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    return (f"# TYPE {q} counter\n{q}_total{{{lab}}} {queries}\n"
            f"# TYPE {h} counter\n{h}_total{{{lab}}} {hits}\n")


def test_reads_the_prefix_cache_counters_of_the_real_exposition() -> None:
    [r] = parse(REFERENCE.read_text()).values()
    assert (r.counters["prefix_queries"], r.counters["prefix_hits"]) == (20480, 8192)


def test_prefix_cache_counters_fall_back_to_the_pre_0_9_2_names() -> None:
    [new] = parse(exposition() + prefix(100, 40)).values()
    [old] = parse(exposition() + prefix(300, 30, old=True)).values()
    [both] = parse(exposition() + prefix(100, 40) + prefix(300, 30, old=True)).values()  # the new name wins
    assert (new.counters["prefix_queries"], new.counters["prefix_hits"]) == (100, 40)
    assert (old.counters["prefix_queries"], old.counters["prefix_hits"]) == (300, 30)
    assert (both.counters["prefix_queries"], both.counters["prefix_hits"]) == (100, 40)
    [none] = parse(exposition()).values()
    assert "prefix_queries" not in none.counters


def test_prefix_hit_rate_is_of_the_last_interval() -> None:
    d = Deriver("n")
    assert d.update(parse(exposition() + prefix(1000, 900)), 0.0).prefix_hit_rate is None  # no interval yet
    s = d.update(parse(exposition() + prefix(1400, 1000)), 1.0)
    assert s.prefix_hit_rate == pytest.approx(0.25)  # 100 of 400 tokens looked up, not the lifetime 0.71
    assert d.update(parse(exposition() + prefix(1400, 1000)), 2.0).prefix_hit_rate is None  # nothing looked up
    assert d.update(parse(exposition() + prefix(50, 50)), 3.0).prefix_hit_rate is None  # restarted: no delta
    assert d.update(parse(exposition() + prefix(150, 100, old=True)), 4.0).prefix_hit_rate == pytest.approx(0.5)
    # several engines: tokens summed over them (the second engine's TYPE lines made comments: no duplicates)
    def two(q0: float, h0: float, q1: float, h1: float) -> str:
        second = exposition(engine="1") + prefix(q1, h1, lab='model_name="m",engine="1"')
        return exposition(engine="0") + prefix(q0, h0) + second.replace("# TYPE", "# X")

    d = Deriver("n")
    d.update(parse(two(0, 0, 0, 0)), 0.0)
    assert d.update(parse(two(100, 100, 300, 0)), 1.0).prefix_hit_rate == pytest.approx(0.25)


def test_snapshot_json_carries_the_hit_rate_and_reads_older_probes() -> None:
    d = Deriver("n")
    d.update(parse(exposition() + prefix(0, 0)), 0.0)
    snap = d.update(parse(exposition() + prefix(10, 5)), 1.0)
    doc = snap.to_json()
    assert doc["prefix_hit_rate"] == 0.5 and Snapshot.from_json(doc).prefix_hit_rate == 0.5
    del doc["prefix_hit_rate"]  # a probe from before the field
    assert Snapshot.from_json(doc).prefix_hit_rate is None
    with pytest.raises(ValueError, match="prefix_hit_rate"):
        Snapshot.from_json({**doc, "prefix_hit_rate": "high"})


# -- the stream (GET /snapshot/stream) ---------------------------------------------------------------


class _Driven(Probe):
    """The real probe server whose readings the test publishes (no vLLM polled)."""

    async def _run(self) -> None:
        await asyncio.Event().wait()


def _reading(i: int, kv: float = 0.5) -> Snapshot:
    return Snapshot(node="n", at=1000.0 + i, ok=True, kv_usage=kv, blocks_total=100, block_size=16, running=3.0,
                    waiting=0.0, engines=[{"model": "m", "engine": "0", "kv_usage": kv}])


async def _served(probe: Probe, shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(probe.app(), access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_the_stream_sends_the_snapshot_then_what_changed_then_heartbeats() -> None:
    probe = _Driven("http://vllm.invalid")
    probe.publish(_reading(0))
    runner, url = await _served(probe)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/snapshot") as r:  # the poll is what it always was
                assert r.content_type == "application/json" and await r.json() == _reading(0).to_json()
            async with s.get(url + STREAM_PATH, params={"heartbeat": "0.2"}) as r:
                assert r.status == 200 and r.content_type == "application/x-ndjson"

                async def line() -> Any:
                    raw = await r.content.readline()
                    assert raw.endswith(b"\n")
                    return json.loads(raw)

                assert await line() == _reading(0).to_json()  # whole, first
                probe.publish(_reading(1, kv=0.7))
                assert await line() == {"at": 1001.0, "kv_usage": 0.7,  # then what changed, nothing else
                                        "engines": [{"model": "m", "engine": "0", "kv_usage": 0.7}]}
                probe.publish(_reading(2, kv=0.7))
                assert await line() == {"at": 1002.0}  # a reading always moves `at`
                assert await line() == {}  # nothing for a heartbeat: the connection is alive, no reading
                probe.publish(_reading(3, kv=0.1))
                probe.publish(_reading(4, kv=0.7))  # two readings before the stream could send: folded
                assert await line() == {"at": 1004.0}
    finally:
        await runner.cleanup()


async def test_the_stream_sends_at_most_one_line_per_interval_asked() -> None:
    probe = _Driven("http://vllm.invalid")
    probe.publish(_reading(0))
    runner, url = await _served(probe)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + STREAM_PATH, params={"interval": "1.0"}) as r:
                assert json.loads(await r.content.readline())["at"] == 1000.0
                probe.publish(_reading(1, kv=0.6))
                await asyncio.sleep(0.05)  # (well within the interval: the line for reading 1 is not due yet)
                probe.publish(_reading(2, kv=0.8))
                assert json.loads(await r.content.readline()) == {
                    "at": 1002.0, "kv_usage": 0.8, "engines": [{"model": "m", "engine": "0", "kv_usage": 0.8}]}
            for bad in ({"interval": "soon"}, {"heartbeat": "-1"}, {"interval": "nan"}):
                async with s.get(url + STREAM_PATH, params=bad) as r:
                    assert r.status == 400
    finally:
        await runner.cleanup()


async def test_a_probe_shutting_down_ends_its_streams_cleanly() -> None:
    """Without it the server waits out its shutdown timeout for a response that never ends (60 s by
    default: a probe's rolling update stuck for a minute), then cuts it."""
    probe = _Driven("http://vllm.invalid")
    probe.publish(_reading(0))
    runner, url = await _served(probe, shutdown_timeout=0.5)
    async with aiohttp.ClientSession() as s, s.get(url + STREAM_PATH) as r:
        await r.content.readline()
        cleanup = asyncio.ensure_future(runner.cleanup())
        assert await r.content.read() == b""  # a clean end of the chunked body (a cut one raises)
        await cleanup


def test_stream_changes_compare_types_too() -> None:
    assert changes({"a": 1, "b": 0, "c": None}, {"a": 1.0, "b": False, "c": None}) == {"a": 1.0, "b": False}
    assert changes({}, {"x": None}) == {"x": None}
