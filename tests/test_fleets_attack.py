"""Hostile input to LoRA routing and per-node GPU profiles (attack14): a vLLM exposition or probe that
says odd things about adapters, max_lora, the GPU or the model must never take a node out of service, nor
grow anything without bound."""

from __future__ import annotations

import pytest

from ext_proc.profiles import detect
from gpu_probe.parse import MAX_NAME_CHARS, MAX_NAMES, parse
from gpu_probe.snapshot import Deriver, Snapshot, StreamDecoder
from tests.test_fleets import A100, H100, LLAMA_8B, fleet, reading

ENGINE = 'vllm:num_requests_running{model_name="m",engine="0"} 1\n'


def lora_exposition(running: str, waiting: str, max_lora: str, series: int = 1) -> str:
    lines = ["# TYPE vllm:lora_requests_info gauge"]
    lines += [f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
              f'waiting_lora_adapters="{waiting}"}} {1.0 + i}' for i in range(series)]
    return "\n".join(lines) + "\n" + ENGINE


def through_the_wire(text: str, gpu: dict | None = None, model: str | None = None) -> Snapshot:
    """What the probe derives from ``text`` and kvgate reads back, by poll and by stream."""
    if model is not None:
        text = text.replace('model_name="m"', f'model_name="{model}"')
    snap = Deriver("n").update(parse(text), 1.0, gpu)
    back = Snapshot.from_json(snap.to_json())
    assert StreamDecoder().feed(snap.to_json()) == back
    return back


def test_thousands_of_adapters_huge_labels_and_many_series_are_capped() -> None:
    names = ",".join(f"adapter-{i}" for i in range(5000))
    back = through_the_wire(lora_exposition(names, names, "4"))
    assert back.lora_running is not None and len(back.lora_running) == MAX_NAMES
    assert back.lora_waiting is not None and len(back.lora_waiting) == MAX_NAMES
    big = "x" * (1 << 20)
    back = through_the_wire(lora_exposition(big, f"a,{big},b", "4"))
    assert (back.lora_running, back.lora_waiting) == ([], ["a", "b"])
    # duplicate series (the same labels twice) and many label sets: the newest wins, nothing breaks
    text = lora_exposition("a", "", "2", series=3000)
    back = through_the_wire(text + text.split("\n", 1)[1])
    assert (back.lora_running, back.max_lora) == (["a"], 2)


@pytest.mark.parametrize(("raw", "want"), [
    ("NaN", None), ("1e9", None), ("", None), ("0", 0), ("3", 3),
    # what vLLM reports, odd or hostile, must not make kvgate refuse every reading of a healthy node
    ("-5", None), ("512", MAX_NAMES), ("99999999999999999999", MAX_NAMES),
])
def test_an_odd_max_lora_is_capped_not_a_reading_kvgate_refuses(raw: str, want: int | None) -> None:
    back = through_the_wire(lora_exposition("a", "", raw))
    assert back.max_lora == want
    assert back.lora_running == ["a"]


def test_an_over_long_model_or_gpu_name_is_dropped_not_a_reading_kvgate_refuses() -> None:
    back = through_the_wire(lora_exposition("", "", "2"), gpu={"name": "H" * 10_000, "count": 1},
                            model="m" * (MAX_NAME_CHARS + 1))
    assert (back.gpu_name, back.model, back.kv_usage) == (None, None, None)
    assert back.running == 1.0  # the reading itself is there
    ok = through_the_wire(lora_exposition("", "", "2"), gpu={"name": H100, "count": 1}, model=LLAMA_8B)
    assert (ok.gpu_name, ok.model) == (H100, LLAMA_8B)


@pytest.mark.parametrize(("gpu", "count", "want"), [
    ("", 1, None), (None, 1, None), ("NVIDIA L40S", 1, None), ("H" * 10_000, 1, None),
    ("x" * 10_000 + "H100", 1, "8b-h100"),  # (detect itself takes any length: the snapshot bounds it)
    (H100, None, "8b-h100"),  # no count: one GPU
    (H100, 0, "8b-h100"),  # zero read as one (NVML says at least one when it names a GPU)
    (H100, -2, None), (H100, 3, None), (H100, 10**9, None),
])
def test_detect_falls_back_clearly_on_names_and_counts_no_profile_knows(gpu: str | None, count: int | None,
                                                                        want: str | None) -> None:
    assert detect("8b-h100", gpu, count, LLAMA_8B) == want


@pytest.mark.parametrize(("gpu", "count"), [("", 1), ("NVIDIA L40S", 1), (H100, 0), (A100, 7), (None, None)])
def test_a_node_on_unknown_hardware_keeps_the_pool_prior_and_is_placed(gpu: str | None, count: int | None) -> None:
    f = fleet(2, performance={"profile": "8b-h100"})
    for a in f.nodes:
        f.on_snapshot(a, reading(gpu, count), 0.0)
    for n in f.nodes.values():
        want = "8b-a100" if (gpu, count) == (A100, 1) else "8b-h100"
        assert n.profile == want
    assert f.choose(1000, 0.0, prompt_tokens=900) is not None


def test_ten_thousand_distinct_models_grow_no_metric_label_and_no_per_model_state() -> None:
    """Clients naming 10,000 distinct models — unknown ones (404), and ones a pool's pattern routes
    (``llama-8b-*``) — grow no Prometheus series and no per-model table in the core beyond a bound."""
    import orjson
    from prometheus_client import generate_latest

    from ext_proc.core import Answer, Ended
    from ext_proc.core import Request as GatewayRequest
    from ext_proc.pools import _CACHE_MAX
    from tests.test_pools import core_and_clock

    core, clock = core_and_clock()
    admitted = 0

    def send(i: int, model: str) -> None:
        nonlocal admitted
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        a = core.decide(GatewayRequest("/v1/chat/completions", f"r{i}", "Bearer k-bulk", body))
        if isinstance(a, Answer) and a.decision.admitted and a.decision.lease is not None:
            admitted += 1
            core.ended(Ended(a.decision.lease.ticket, f"r{i}", 200, upstream_answered=True))

    def series() -> int:
        return sum(1 for line in generate_latest(core.stats.registry).decode().splitlines()
                   if line and not line.startswith("#"))

    for i in range(100):
        send(i, f"unknown-{i}")
        send(10**6 + i, f"llama-8b-{i}")
        clock.advance(0.001)
    before = series()
    for i in range(100, 10_000):
        send(i, f"unknown-{i}")
        send(10**6 + i, f"llama-8b-{i}")
        clock.advance(0.001)
    assert series() == before
    assert admitted > 5_000  # (the routed ones went through)
    assert len(core.router._cache) <= _CACHE_MAX
    for f in core.fleets.values():
        assert all(len(n.loras) == 0 and not n.lora_sent for n in f.nodes.values())


def engine_text(extra: str) -> str:
    return ENGINE + extra


@pytest.mark.parametrize("extra", [
    'vllm:kv_cache_usage_perc{model_name="m",engine="0"} NaN\n',
    'vllm:kv_cache_usage_perc{model_name="m",engine="0"} -1\n',
    'vllm:kv_cache_usage_perc{model_name="m",engine="0"} +Inf\n',
    'vllm:num_requests_waiting{model_name="m",engine="0"} NaN\n',
    'vllm:num_requests_waiting{model_name="m",engine="0"} -3\n',
    'vllm:cache_config_info{engine="0",num_gpu_blocks="-5",block_size="16"} 1\n',
    'vllm:cache_config_info{engine="0",num_gpu_blocks="1000",block_size="-16"} 1\n',
])
def test_an_odd_vllm_value_is_dropped_not_a_reading_kvgate_refuses(extra: str) -> None:
    d = Deriver("n")
    for at in (1.0, 2.0):
        snap = d.update(parse(engine_text(extra)), at)
        back = Snapshot.from_json(snap.to_json())
    assert back.running == 1.0


def ttft(total: float | str, count: float) -> str:
    return engine_text(f'vllm:time_to_first_token_seconds_sum{{model_name="m",engine="0"}} {total}\n'
                       f'vllm:time_to_first_token_seconds_count{{model_name="m",engine="0"}} {count}\n')


@pytest.mark.parametrize("after", [ttft(50, 20), ttft("NaN", 20), ttft(-10, 20)])
def test_a_histogram_that_went_back_leaves_no_figure_kvgate_refuses_on_every_later_reading(after: str) -> None:
    """vLLM restarted between two readings and served more requests than before: its TTFT count went up
    but its sum down. The interval's mean (-5 s) was kept until newer observations replaced it, so every
    later reading was refused — the node failed and, sent nothing, never got a newer observation."""
    d = Deriver("n")
    d.update(parse(ttft(100, 10)), 1.0)
    for at in (2.0, 3.0, 4.0):
        snap = Snapshot.from_json(d.update(parse(after), at).to_json())
        assert snap.ttft_s is None or snap.ttft_s >= 0
    snap = d.update(parse(ttft(150, 30)), 5.0)  # the next interval's requests are read again
    assert snap.ttft_s is not None and snap.ttft_s > 0


@pytest.mark.parametrize("odd", ["NaN", "-10", "+Inf"])
def test_a_histogram_with_half_its_pair_dropped_is_not_read_as_a_zero_sum(odd: str) -> None:
    """review15: the probe drops an odd value (NaN, negative, inf) sample by sample; a histogram whose
    ``_sum`` was dropped kept its ``_count`` beside a sum of 0, and the next interval took every second
    vLLM had ever spent on TTFT as that interval's: 150 s over 10 requests, a 15 s TTFT for a node whose
    requests took 5 s. A histogram read by half is not read."""
    d = Deriver("n")
    d.update(parse(ttft(100, 10)), 1.0)
    d.update(parse(ttft(odd, 20)), 2.0)
    snap = d.update(parse(ttft(150, 30)), 3.0)
    assert snap.ttft_s is None or snap.ttft_s <= 5.0 + 1e-9


def test_adapter_requests_sent_during_a_probe_outage_keep_node_state_bounded() -> None:
    """Every adapter request sent to a node is remembered until its next reading (it is running there
    though no reading says so yet), and each adapter request's node choice went over all of them on every
    candidate: with the probes silent (stale nodes still served) 2,000 adapter requests a second made a
    placement 20 times dearer after 9 s (52 -> 570 µs). What matters is which adapters were sent, not how
    many times."""
    import random

    from ext_proc.config import parse_config
    from ext_proc.nodes import Fleet

    cfg = parse_config({"nodes": {"static": [{"address": f"10.0.0.{i}:8000", "probe": f"http://p{i}"}
                                             for i in range(4)], "unknown": "serve"}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes, random.Random(1))
    f.adapters = frozenset(f"a{i}" for i in range(4))
    for a in f.nodes:
        f.on_snapshot(a, Snapshot(node="n", at=0.0, ok=True, kv_usage=0.1, blocks_total=10**7, block_size=16,
                                  running=0.0, waiting=0.0, lora_running=[], max_lora=2), 0.0)
    for k in range(4_000):
        f.place(200, 100, f"t{k}", k / 1000, adapter=f"a{k % 4}")
    assert all(len(n.lora_sent) <= len(f.adapters) for n in f.nodes.values())
    # the next reading still sees what was sent since it was taken (those sent before are in it)
    n = next(iter(f.nodes.values()))
    snap = Snapshot(node="n", at=3.9985, ok=True, kv_usage=0.1, blocks_total=10**7, block_size=16, running=1.0,
                    waiting=0.0, lora_running=[], max_lora=2)
    f.on_snapshot(n.address, snap, 4.0, 0.0015)
    assert set(n.lora_sent) <= {"a3"} and len(n.loras) <= 2


@pytest.mark.parametrize("odd", ["NaN", "-10", "+Inf"])
def test_a_half_read_histogram_does_not_make_the_next_interval_vllms_lifetime_mean(odd: str) -> None:
    """review16: since review15 a histogram read by half is absent from its reading, and the next reading's
    interval took an absent previous histogram as (0, 0): the mean of every request vLLM had served since it
    started, given as the last interval's. A node that served 1000 requests at 1 s and then 20 at 10 s
    read 1.18 s. The interval is measured from the last reading that had the histogram whole."""
    d = Deriver("n")
    d.update(parse(ttft(1000, 1000)), 1.0)
    d.update(parse(ttft(odd, 1010)), 2.0)
    snap = d.update(parse(ttft(1200, 1020)), 3.0)
    assert snap.ttft_s is None or abs(snap.ttft_s - 10.0) < 1e-9
