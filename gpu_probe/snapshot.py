"""Readings over time → the snapshot a probe serves. Pure: the caller passes the time.

Latencies are *recent* ones: the mean of the observations that arrived between two readings
(Δsum / Δcount of vLLM's histograms), kept until newer observations replace them. The node's
figures aggregate its engines: the fullest KV cache, the sum of running and waiting requests. The
prefix-cache hit rate is of the last interval only (Δhits / Δqueries over all engines), null when
nothing queried the cache in it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .parse import MAX_NAME_CHARS, MAX_NAMES, EngineReading


@dataclass
class Snapshot:
    node: str
    at: float
    ok: bool
    error: str | None = None
    kv_usage: float | None = None
    kv_metric: str | None = None
    blocks_total: int | None = None
    blocks_used: int | None = None
    block_size: int | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_per_s: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    prefill_s: float | None = None
    prefill_s_per_ktok: float | None = None
    """Recent prefill time per 1000 prompt tokens: a latency signal that does not move with the prompt mix."""
    latency_fresh: bool | None = None
    """Whether requests finished since the previous reading, i.e. whether ``prefill_s_per_ktok`` is new.
    A node that gets no traffic (its breaker open) keeps showing its last, old figure; None: unknown."""
    queue_s: float | None = None
    step_fresh: bool | None = None
    """Whether tokens were decoded since the previous reading, i.e. whether ``itl_s`` (the mean engine step
    time while decoding) and the batch figures below describe the last interval; None: unknown."""
    step_tokens: float | None = None
    """Tokens per engine step over the last interval (vLLM's iteration-tokens histogram): the batch the
    step times were measured on."""
    step_decode: float | None = None
    """Of those, decode tokens per step (generated tokens / steps): the rest is prefill."""
    prefix_hit_rate: float | None = None
    """Prompt tokens found in vLLM's prefix cache / prompt tokens looked up, over the last interval (vLLM's
    ``prefix_cache_hits`` / ``prefix_cache_queries``); None when nothing was looked up in it, or unknown."""
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    gpu_utilization: float | None = None
    gpu_name: str | None = None
    """The GPU's model as NVML names it: what kvgate picks the node's performance prior from."""
    gpu_count: int | None = None
    """GPUs the node's host shows (a tensor-parallel engine's size)."""
    model: str | None = None
    """The model the node serves (vLLM's ``model_name`` label; its first engine's): with the GPU, the prior."""
    lora_running: list[str] | None = None
    """LoRA adapters with requests running there (``vllm:lora_requests_info``): loaded in a GPU slot.
    None: the node reports no LoRA metric (LoRA off, or an older vLLM)."""
    lora_waiting: list[str] | None = None
    """LoRA adapters with requests waiting there."""
    max_lora: int | None = None
    """Adapters one batch may hold (vLLM ``--max-loras``)."""
    engines: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> Snapshot:
        """A snapshot from a probe's JSON; anything of the wrong shape (a probe of another version, a
        confused or hostile one) is a ValueError naming the field, never a snapshot that breaks later."""
        if not isinstance(doc, dict):
            raise ValueError(f"a snapshot is a JSON object, got {type(doc).__name__}")
        known: dict[str, Any] = {}
        for k, kind in _FIELDS.items():
            if k in doc:
                known[k] = _checked(k, kind, doc[k])
        for required in ("node", "at", "ok"):
            if required not in known:
                raise ValueError(f"snapshot field {required!r} is missing")
        return cls(**known)


def _checked(k: str, kind: type, v: Any) -> Any:
    """One field of a probe's JSON, validated (``from_json``)."""
    if v is None and k not in ("node", "at", "ok"):
        return None
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"snapshot field {k!r}: expected a finite number >= 0, got {v!r}")
        return float(v)
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"snapshot field {k!r}: expected an integer >= 0, got {v!r}")
    elif not isinstance(v, kind):
        raise ValueError(f"snapshot field {k!r}: expected {kind.__name__}, got {v!r}")
    elif k in NAME_LISTS and not (isinstance(v, list) and len(v) <= MAX_NAMES
                                  and all(isinstance(x, str) and len(x) <= MAX_NAME_CHARS for x in v)):
        raise ValueError(f"snapshot field {k!r}: expected a list of at most {MAX_NAMES} names of at most "
                         f"{MAX_NAME_CHARS} characters, got {shown_value(v)}")
    elif k in BOUNDED_NAMES and isinstance(v, str) and len(v) > MAX_NAME_CHARS:
        raise ValueError(f"snapshot field {k!r}: at most {MAX_NAME_CHARS} characters, got {len(v)}")
    if k == "max_lora" and isinstance(v, int) and v > MAX_NAMES:
        raise ValueError(f"snapshot field 'max_lora': at most {MAX_NAMES}, got {v}")
    return v


def shown_value(v: Any) -> str:
    """A value for an error message, cut short (a hostile one may be megabytes)."""
    r = repr(v)
    return r if len(r) <= 200 else r[:200] + "..."


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The probe's stream message between two snapshot documents: the fields of ``new`` whose value
    differs from ``old``'s (by type too: ``0`` and ``False``, ``1`` and ``1.0`` are different JSON).

    Merging each message into the previous document (:class:`StreamDecoder`) gives ``new`` back. A
    reading always moves ``at``, so a reading is never an empty message: ``{}`` is free to mean a
    heartbeat (the connection is alive, no reading since)."""
    out = {}
    for k, v in new.items():
        was = old.get(k, _ABSENT)
        if was is _ABSENT or type(was) is not type(v) or was != v:
            out[k] = v
    return out


class StreamDecoder:
    """kvgate's side of one probe stream (``GET /snapshot/stream``): each message is merged into the
    snapshot so far. What comes out is what ``Snapshot.from_json`` makes of the merged document (the
    same validation as a poll's: a stream cannot smuggle in what a poll would refuse), but only the
    fields a message carries are checked again: at 4,000 readings a second, validating every field of
    every reading cost twice as much (6 µs a reading against 3)."""

    def __init__(self) -> None:
        self.last: Snapshot | None = None

    def feed(self, msg: Any) -> Snapshot | None:
        """One decoded line: the snapshot it makes, or None for a heartbeat (``{}``). A message that is
        not a JSON object, a first message that is not a whole snapshot (``node``, ``at``, ``ok``), or a
        bad value is a ValueError: the stream cannot be trusted further and the caller reconnects (a new
        stream starts with a whole snapshot)."""
        if not isinstance(msg, dict):
            raise ValueError(f"a stream message is a JSON object, got {type(msg).__name__}")
        if not msg:
            return None
        last = self.last
        if last is None:
            snap = Snapshot.from_json(msg)
        else:
            fields = dict(last.__dict__)
            for k, v in msg.items():
                kind = _FIELDS.get(k)
                if kind is None:
                    continue  # a newer probe's field: ignored, as by from_json
                t = type(v)
                if (t is not kind or (t is float and not 0.0 <= v < math.inf) or (t is int and v < 0)
                        or k in _CHECK_ALWAYS):
                    v = _checked(k, kind, v)  # (the common case, a value of the field's own type, is checked inline)
                fields[k] = v
            # the previous snapshot with these fields changed: a new object (the core keeps the previous
            # one), made without dataclasses.replace's __init__ call — 3 µs a reading, for nothing to check
            snap = object.__new__(Snapshot)
            snap.__dict__ = fields
        self.last = snap
        return snap


_ABSENT = object()
NAME_LISTS = frozenset({"lora_running", "lora_waiting"})
"""List fields whose items are adapter names: a probe cannot slip other things into node choice."""
BOUNDED_NAMES = frozenset({"gpu_name", "model"})
"""Name fields held at most ``MAX_NAME_CHARS`` long: profile detection reads them on a hardware change."""
_CHECK_ALWAYS = NAME_LISTS | BOUNDED_NAMES | {"max_lora"}
"""Fields a stream message is checked for beyond its type (their bounds)."""

_FIELDS: dict[str, type] = {
    "node": str, "at": float, "ok": bool, "error": str, "kv_usage": float, "kv_metric": str, "blocks_total": int,
    "blocks_used": int, "block_size": int, "running": float, "waiting": float, "preemptions_per_s": float,
    "ttft_s": float, "itl_s": float, "prefill_s": float, "prefill_s_per_ktok": float, "latency_fresh": bool,
    "queue_s": float, "step_fresh": bool, "step_tokens": float, "step_decode": float, "prefix_hit_rate": float,
    "gpu_memory_used_bytes": int, "gpu_memory_total_bytes": int, "gpu_utilization": float,
    "gpu_name": str, "gpu_count": int, "model": str, "lora_running": list, "lora_waiting": list,
    "max_lora": int, "engines": list,
}


class Deriver:
    def __init__(self, node: str) -> None:
        self.node = node
        self._prev: dict[tuple[str, str], EngineReading] = {}
        self._prev_at: float | None = None
        self._hist: dict[tuple[tuple[str, str], str], tuple[float, float]] = {}
        """(engine, histogram) → its last whole reading (sum, count): what the next interval is measured
        from. The previous reading's when it had it; when it had it only by half (``parse`` leaves it
        out), the one before — not (0, 0), vLLM's lifetime mean read as the interval's (review16)."""
        self._recent: dict[str, float] = {}
        self._preempt_rate: float | None = None

    def update(self, readings: dict[tuple[str, str], EngineReading], at: float,
               gpu: dict[str, Any] | None = None) -> Snapshot:
        dt = None if self._prev_at is None else at - self._prev_at
        had_prev = bool(self._prev)
        sums: dict[str, list[float]] = {}
        preempted = generated = queried = hit = 0.0
        for key, r in readings.items():
            prev = self._prev.get(key)
            if prev is None:
                continue
            for name, (total, count) in r.hist.items():
                p_total, p_count = self._hist.get((key, name), (0.0, 0.0))
                if count > p_count and total >= p_total:
                    # (a sum that went back with a count that went up: vLLM restarted between the readings
                    # and served more than before — the interval says nothing, and its negative mean, kept
                    # until newer observations, made every later snapshot one kvgate refuses)
                    acc = sums.setdefault(name, [0.0, 0.0])
                    acc[0] += total - p_total
                    acc[1] += count - p_count
            c, pc = r.counters, prev.counters
            preempted += max(0.0, c.get("preemptions", 0.0) - pc.get("preemptions", 0.0))
            generated += max(0.0, c.get("generation_tokens", 0.0) - pc.get("generation_tokens", 0.0))
            if "prefix_queries" in c and "prefix_queries" in pc:
                dq = c["prefix_queries"] - pc["prefix_queries"]
                if dq > 0:  # (a restarted vLLM's counters went back: skip that engine this time)
                    queried += dq
                    hit += max(0.0, c.get("prefix_hits", 0.0) - pc.get("prefix_hits", 0.0))
        for name, (total, count) in sums.items():
            self._recent[name] = total / count
        # both observed when requests finish, over the same requests: seconds of prefill per prompt token
        fresh = "prefill" in sums and "request_prompt" in sums and sums["request_prompt"][0] > 0
        if fresh:
            self._recent["prefill_per_ktok"] = 1000.0 * sums["prefill"][0] / sums["request_prompt"][0]
        # the batch the interval's steps ran: what a node's performance model predicts their time from
        steps = sums.get("iteration")
        step_tokens = step_decode = None
        if steps is not None and steps[1] > 0:
            step_tokens = steps[0] / steps[1]
            step_decode = min(step_tokens, generated / steps[1])
        if dt is not None and dt > 0 and self._prev:
            self._preempt_rate = preempted / dt
        self._hist = {(key, name): v for (key, name), v in self._hist.items() if key in readings}  # (bounded)
        self._hist.update({(key, name): v for key, r in readings.items() for name, v in r.hist.items()})
        self._prev, self._prev_at = readings, at
        kv = [r.kv_usage for r in readings.values() if r.kv_usage is not None]
        total_blocks = sum(r.num_gpu_blocks or 0 for r in readings.values()) or None
        used = None
        if total_blocks is not None:
            used = round(sum((r.num_gpu_blocks or 0) * (r.kv_usage or 0.0) for r in readings.values()))
        gpu = gpu or {}
        return Snapshot(
            node=self.node, at=at, ok=True,
            kv_usage=max(kv) if kv else None,
            kv_metric=next((r.kv_metric for r in readings.values() if r.kv_metric), None),
            blocks_total=total_blocks, blocks_used=used,
            block_size=next((r.block_size for r in readings.values() if r.block_size), None),
            running=_sum(r.running for r in readings.values()),
            waiting=_sum(r.waiting for r in readings.values()),
            preemptions_per_s=self._preempt_rate,
            ttft_s=self._recent.get("ttft"), itl_s=self._recent.get("itl"),
            prefill_s=self._recent.get("prefill", self._recent.get("ttft")),
            prefill_s_per_ktok=self._recent.get("prefill_per_ktok"), latency_fresh=fresh,
            queue_s=self._recent.get("queue"),
            step_fresh="itl" in sums if had_prev else None, step_tokens=step_tokens, step_decode=step_decode,
            prefix_hit_rate=min(1.0, hit / queried) if queried > 0 else None,
            gpu_memory_used_bytes=gpu.get("memory_used"), gpu_memory_total_bytes=gpu.get("memory_total"),
            gpu_utilization=gpu.get("utilization"), gpu_name=_bounded(gpu.get("name")), gpu_count=gpu.get("count"),
            model=_bounded(next((r.model for r in readings.values() if r.model), None)),
            lora_running=_first(r.lora_running for r in readings.values()),
            lora_waiting=_first(r.lora_waiting for r in readings.values()),
            max_lora=_first(r.max_lora for r in readings.values()),
            engines=[{"model": r.model, "engine": r.engine, "kv_usage": r.kv_usage, "running": r.running,
                      "waiting": r.waiting} for r in readings.values()],
        )

    def failed(self, error: str, at: float) -> Snapshot:
        return Snapshot(node=self.node, at=at, ok=False, error=error)


def _bounded(name: Any) -> str | None:
    """A GPU or model name as kvgate takes it (``BOUNDED_NAMES``): None when over ``MAX_NAME_CHARS`` — kvgate
    refuses such a snapshot whole, so one over-long name would cost the node every reading."""
    return name if isinstance(name, str) and len(name) <= MAX_NAME_CHARS else None


def _first(values: Any) -> Any:
    """The first of ``values`` that is not None (the LoRA state: one engine has it)."""
    return next((v for v in values if v is not None), None)


def _sum(values: Any) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None
