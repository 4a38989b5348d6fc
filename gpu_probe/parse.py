"""vLLM's Prometheus text → readings per (model, engine). Pure.

Reads ``vllm:kv_cache_usage_perc`` and falls back to ``vllm:gpu_cache_usage_perc`` (the name before
0.10, removed in 0.12); likewise the prefix-cache counters ``vllm:prefix_cache_queries`` / ``_hits``
(in tokens) fall back to ``vllm:gpu_prefix_cache_queries`` / ``_hits`` (the names before 0.9.2). A server
with several engines or models yields one reading each.

LoRA (``vllm:lora_requests_info``): a gauge without ``model_name`` whose labels carry the state —
``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated adapter names with requests
running / waiting) and ``max_lora`` — and whose value is when it was set. Every label set it ever had
stays in the exposition, so the current state is the series with the newest time. vLLM serves LoRA on
one engine only (no data parallelism), so the state goes on every reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

KV_NEW = "vllm:kv_cache_usage_perc"
KV_OLD = "vllm:gpu_cache_usage_perc"
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "request_prompt": "vllm:request_prompt_tokens",
    "iteration": "vllm:iteration_tokens_total",
}
COUNTERS = {
    "preemptions": "vllm:num_preemptions",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "prefix_queries": "vllm:prefix_cache_queries",
    "prefix_hits": "vllm:prefix_cache_hits",
}
OLD_COUNTERS = {
    "prefix_queries": "vllm:gpu_prefix_cache_queries",
    "prefix_hits": "vllm:gpu_prefix_cache_hits",
}
"""Older names of some counters, read only where the new name is absent."""


class ParseError(ValueError):
    """The text is not a Prometheus exposition, or holds no vLLM engine."""


MAX_NAMES = 256
"""Most adapter names a reading carries in each LoRA list, and the largest ``max_lora`` taken: vLLM's
``--max-loras`` is a handful and a batch runs at most that many; a waiting list longer than this says
nothing node choice can use, and an unbounded one would cost every reading and every adapter request."""
MAX_NAME_CHARS = 256
"""Longest adapter, model or GPU name a reading carries (a Hugging Face id is at most 96 characters)."""

@dataclass
class EngineReading:
    model: str
    engine: str
    kv_usage: float | None = None
    kv_metric: str | None = None
    running: float | None = None
    waiting: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    hist: dict[str, tuple[float, float]] = field(default_factory=dict)
    """name → (sum, count)."""
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    lora_running: list[str] | None = None
    """Adapters with requests running (``vllm:lora_requests_info``); None: no LoRA metric."""
    lora_waiting: list[str] | None = None
    """Adapters with requests waiting."""
    max_lora: int | None = None
    """Adapters one batch may hold (vLLM ``--max-loras``)."""


def parse(text: str) -> dict[tuple[str, str], EngineReading]:
    out: dict[tuple[str, str], EngineReading] = {}
    cache_info: dict[str, tuple[int | None, int | None]] = {}
    old_kv: dict[tuple[str, str], float] = {}
    old_counters: dict[tuple[str, str], dict[str, float]] = {}
    lora: tuple[float, dict[str, str]] | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, TypeError, IndexError on garbage
        raise ParseError(f"not a Prometheus exposition: {e}") from None

    def reading(labels: dict[str, str]) -> EngineReading:
        key = (labels.get("model_name", ""), labels.get("engine", "0"))
        r = out.get(key)
        if r is None:
            r = out[key] = EngineReading(*key)
        return r

    # matched on sample names, which do not depend on how the TYPE lines were written
    hist_sums = {v + "_sum": k for k, v in HISTOGRAMS.items()}
    hist_counts = {v + "_count": k for k, v in HISTOGRAMS.items()}
    counter_names = {v + "_total": k for k, v in COUNTERS.items()}
    old_counter_names = {v + "_total": k for k, v in OLD_COUNTERS.items()}
    for fam in families:
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                cache_info[s.labels.get("engine", "0")] = (_count(s.labels.get("num_gpu_blocks")),
                                                           _count(s.labels.get("block_size")))
            continue
        if fam.name == "vllm:lora_requests_info":
            for s in fam.samples:
                # (a NaN or infinite time never wins, nor pins: a comparison with NaN is always false)
                if math.isfinite(s.value) and (lora is None or s.value > lora[0]):
                    lora = (s.value, s.labels)
            continue
        for s in fam.samples:
            if "model_name" not in s.labels or not 0.0 <= s.value < math.inf:
                # (no vLLM engine figure is negative or NaN: one that is would make the snapshot one kvgate
                # refuses whole, the node failed on every reading — dropped, as if not reported)
                continue
            if s.name == KV_NEW:
                r = reading(s.labels)
                r.kv_usage, r.kv_metric = s.value, KV_NEW
            elif s.name == KV_OLD:
                old_kv[(s.labels["model_name"], s.labels.get("engine", "0"))] = s.value
                reading(s.labels)
            elif s.name == "vllm:num_requests_running":
                reading(s.labels).running = s.value
            elif s.name == "vllm:num_requests_waiting":
                reading(s.labels).waiting = s.value
            elif s.name in counter_names:
                reading(s.labels).counters[counter_names[s.name]] = s.value
            elif s.name in old_counter_names:
                r = reading(s.labels)
                old_counters.setdefault((r.model, r.engine), {})[old_counter_names[s.name]] = s.value
            elif s.name in hist_sums or s.name in hist_counts:
                r = reading(s.labels)
                is_sum = s.name in hist_sums
                k = hist_sums[s.name] if is_sum else hist_counts[s.name]
                total, count = r.hist.get(k, (math.nan, math.nan))
                r.hist[k] = (s.value, count) if is_sum else (total, s.value)
    for r in out.values():
        # a histogram read by half (its sum or count odd, dropped above, or absent) is not read: a missing
        # sum taken as 0 made the next interval count every second vLLM ever spent as that interval's
        r.hist = {k: v for k, v in r.hist.items() if not (math.isnan(v[0]) or math.isnan(v[1]))}
    for key, value in old_kv.items():
        r = out[key]
        if r.kv_usage is None:
            r.kv_usage, r.kv_metric = value, KV_OLD
    for key, values in old_counters.items():
        for name, value in values.items():
            out[key].counters.setdefault(name, value)
    for r in out.values():
        r.num_gpu_blocks, r.block_size = cache_info.get(r.engine, (None, None))
        if lora is not None:
            labels = lora[1]
            r.lora_running, r.lora_waiting = _names(labels.get("running_lora_adapters")), _names(
                labels.get("waiting_lora_adapters"))
            r.max_lora = _slots(labels.get("max_lora"))
    if not out:
        raise ParseError("no vLLM engine metrics (vllm:* with a model_name label) in the exposition")
    return out


def _names(v: str | None) -> list[str]:
    """A comma-separated list of adapter names ('' for none), capped as a snapshot caps it
    (``snapshot.MAX_NAMES`` names of at most ``snapshot.MAX_NAME_CHARS``): a label of any length from a
    hostile or broken exposition costs one bounded split."""
    names = (v or "").split(",", MAX_NAMES)[:MAX_NAMES]
    return [n for n in names if n and len(n) <= MAX_NAME_CHARS]


def _slots(v: str | None) -> int | None:
    """``max_lora`` as a snapshot takes it: at most ``MAX_NAMES``, None when negative or not an integer
    (kvgate refuses a snapshot outside those bounds, so an odd label would cost the node every reading)."""
    n = _count(v)
    return None if n is None else min(n, MAX_NAMES)


def _count(v: str | None) -> int | None:
    """A label that counts something (blocks, tokens): None when negative or not an integer."""
    n = _int(v)
    return None if n is None or n < 0 else n


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
