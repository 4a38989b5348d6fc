"""Model/GPU profiles: kvgate's performance priors (``nodes.performance.profile``), and what the
simulated node in ``sim/`` runs on.

Step time follows the model published simulators fit to real vLLM runs (BLIS; Vidur reports <9%
error with profiled kernels): ``step_ms = a + b·prefill_tokens + c·decode_seqs + d·context_tokens``.
Sources of each figure are in docs/development/simulator.md. KV capacity is given in tokens as
measured/derived for one card at ``gpu_memory_utilization`` 0.9, and turned into blocks here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    model_name: str
    a_ms: float
    b_ms_per_prefill_token: float
    c_ms_per_decode_seq: float
    d_ms_per_context_token: float
    kv_tokens: int
    """Tokens of KV cache the engine can hold."""
    kv_bytes_per_token: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    cold_start_s: float
    """Model load time for a new replica (autoscaling scenarios)."""
    block_size: int = 16
    gpu: str = ""
    """The GPU it was measured on, as NVML names it in part (``H100``, ``A100``): what the probe's
    ``gpu_name`` is matched against to pick a node's prior (:func:`detect`)."""
    gpus: int = 1
    """GPUs one engine spans (tensor-parallel size): matched against the probe's ``gpu_count``."""

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    def step_ms(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (self.a_ms + self.b_ms_per_prefill_token * prefill_tokens
                + self.c_ms_per_decode_seq * decode_seqs + self.d_ms_per_context_token * context_tokens)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


KIB = 1024
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        # a, c: Vidur H100 Llama-2-7B linear ops x1.1 (its 8B/7B A100 ratio), decode 1-256 seqs; b, d kept
        Profile("8b-h100", "meta-llama/Llama-3.1-8B-Instruct", 7.0, 0.020, 0.015, 5.2e-5,
                kv_tokens=436_896, kv_bytes_per_token=128 * KIB, max_num_batched_tokens=8192,
                max_num_seqs=1024, max_model_len=131_072, cold_start_s=30.0, gpu="H100"),
        # b, c: Vidur A100 Llama-3-8B linear ops (+ attention for b), 1-2k-token chunks, decode 1-256 seqs;
        # d: Vidur A100 decode attention (~1.65 TB/s of KV reads); a kept
        Profile("8b-a100", "meta-llama/Llama-3.1-8B-Instruct", 12.0, 0.070, 0.044, 7.9e-5,
                kv_tokens=436_896, kv_bytes_per_token=128 * KIB, max_num_batched_tokens=2048,
                max_num_seqs=256, max_model_len=131_072, cold_start_s=45.0, gpu="A100"),
        # a, b, KV (2537 blocks): BLIS 34B/H100/TP1 fit; c: Vidur H100 CodeLlama-34B linear ops, 1-128
        # seqs (BLIS's 0.057 also holds attention, which d carries here); d kept
        Profile("34b-h100", "codellama/CodeLlama-34b-Instruct-hf", 26.6, 0.096, 0.022, 7.8e-5,
                kv_tokens=40_592, kv_bytes_per_token=192 * KIB, max_num_batched_tokens=8192,
                max_num_seqs=1024, max_model_len=16_384, cold_start_s=60.0, gpu="H100"),
        # a, b, c: Vidur A100 CodeLlama-34B linear ops (+ attention for b), 1-128 seqs; d as 8b-a100
        # scaled to 192 KiB/token; KV: the H100 figure
        Profile("34b-a100", "codellama/CodeLlama-34b-Instruct-hf", 46.0, 0.300, 0.080, 1.2e-4,
                kv_tokens=40_592, kv_bytes_per_token=192 * KIB, max_num_batched_tokens=2048,
                max_num_seqs=256, max_model_len=16_384, cold_start_s=75.0, gpu="A100"),
        # a, c: Vidur H100 Llama-2-70B TP4 linear ops + 160 NCCL all-reduces per step, 1-512 seqs;
        # b, d kept (Vidur: b 0.06)
        Profile("70b-h100x4", "meta-llama/Llama-3.1-70B-Instruct", 18.5, 0.065, 0.049, 3.3e-5,
                kv_tokens=458_752, kv_bytes_per_token=320 * KIB, max_num_batched_tokens=8192,
                max_num_seqs=1024, max_model_len=131_072, cold_start_s=90.0, gpu="H100",
                gpus=4),
    )
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None


def detect(prior: str, gpu_name: str | None, gpu_count: int | None, model: str | None = None) -> str | None:
    """The profile of a node that reports ``gpu_count`` GPUs named ``gpu_name`` (NVML, via the probe) serving
    ``model`` (vLLM's ``model_name`` label), in a pool whose prior is ``prior``; None when no built-in
    profile matches (the pool's prior stays, and the node's speed factor learns the difference).

    A profile matches when its ``gpu`` is part of the NVML name (``NVIDIA A100-SXM4-80GB`` is an
    ``A100``) and it spans as many GPUs. Of those, the one for the served model wins; a served name
    that is an alias (vLLM ``--served-model-name``) says nothing, so then the one for the prior's model
    — the operator named the model when they named the pool's profile. The prior itself wins a tie:
    detection never moves a node whose hardware the prior already describes."""
    if not gpu_name:
        return None
    name = gpu_name.upper()
    count = gpu_count or 1
    fits = [p for p in PROFILES.values() if p.gpu and p.gpu.upper() in name and p.gpus == count]
    base = PROFILES.get(prior)
    for want in (model, base.model_name if base is not None else None):
        same = [p.name for p in fits if want and p.model_name == want]
        if same:
            return prior if prior in same else same[0]
    return None
