"""kvgate's configuration: one YAML file, validated on load.

Validation errors name the field by its path in the file (``tenants[2].max_concurrent``) so that a
person can fix the file without reading this module.
"""

from __future__ import annotations

import ipaddress
import re
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .prices import Price, SpendBudget
from .profiles import PROFILES

Mode = Literal["enforce", "shadow"]
OverLimit = Literal["refuse", "best-effort"]
"""What a tenant over a protective limit gets: a 429 (``refuse``), or service as best effort when the
fleet has room nobody within quota needs (``best-effort``; ``docs/guides/best-effort.md``)."""
ProtectiveLimit = Literal["concurrency", "requests", "tokens"]
"""The limits that protect the fleet rather than bill a tenant: the only ones that may be exceeded as
best effort. A limit that is a contract (a billed spend budget) is not one of them and stays hard."""
_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and each bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Quota(_Strict):
    """Per-tenant limits. ``None`` means unlimited for that dimension."""

    max_concurrent: PositiveInt | None = Field(
        default=None, description="requests in flight at once; beyond it 429 tenant-concurrency; None: no cap")
    requests_per_minute: PositiveFloat | None = Field(
        default=None, description="request budget, refilled continuously; empty: 429 tenant-requests; None: no "
        "budget")
    request_burst: PositiveInt | None = Field(
        default=None, description="bucket size for requests; default: one minute's worth, at least 1"
    )
    tokens_per_minute: PositiveFloat | None = Field(
        default=None, description="token budget (prompt estimate + output reservation, reconciled with the "
        "reported usage); short: 429 tenant-tokens; None: no budget")
    token_burst: PositiveInt | None = Field(
        default=None, description="bucket size for tokens; default: one minute's worth, at least 1"
    )
    max_prompt_tokens: PositiveInt | None = Field(
        default=None, description="largest estimated prompt; above it 400 prompt-too-long; None: no cap")
    max_context_tokens: PositiveInt | None = Field(
        default=None, description="cap on estimated prompt tokens + reserved output tokens"
    )
    default_max_tokens: PositiveInt | None = Field(
        default=None, description="output reservation when a request sets no max_tokens"
    )


ModelName = Annotated[str, Field(pattern=r"^[^\s\x00-\x1f\x7f]{1,256}$")]
"""A model or LoRA adapter name as clients send it in ``model``, or a pattern of them (``*``, ``?``,
``[...]`` as in shell globs): one to 256 printable characters, no spaces."""


def is_pattern(name: str) -> bool:
    """Whether a model name in the config is a glob pattern (matched with :func:`fnmatch.fnmatchcase`)."""
    return any(c in name for c in "*?[")


class ModelBudget(_Strict):
    """A tenant's own limits on one model (``tenants[i].model_budgets``): on top of its overall quota, so
    the 70B cannot take all of a tenant's tokens per minute. ``None``: no separate limit."""

    max_concurrent: PositiveInt | None = Field(
        default=None, description="this tenant's requests in flight on the model at once")
    requests_per_minute: PositiveFloat | None = Field(
        default=None, description="this tenant's request budget on the model")
    request_burst: PositiveInt | None = Field(
        default=None, description="bucket size for requests on the model; default: one minute's worth, at least 1")
    tokens_per_minute: PositiveFloat | None = Field(default=None, description="this tenant's token budget on the model")
    token_burst: PositiveInt | None = Field(
        default=None, description="bucket size for tokens on the model; default: one minute's worth, at least 1")


class Tenant(Quota):
    """A tenant (``tenants[i]``): who it is (its API keys), its tier and its quota."""

    name: Annotated[str, Field(pattern=_NAME)] = Field(
        description="the tenant's name: the tenant label on metrics and logs")
    models: list[ModelName] | None = Field(
        default=None, description="the models (names or patterns) this tenant may use: any other is 403 "
        "model_not_allowed; None: every model the pools serve")
    model_budgets: dict[ModelName, ModelBudget] = Field(
        default_factory=dict, description="per-model limits (key: a model name or pattern; the first that "
        "matches applies), enforced besides the tenant's own")
    api_key_sha256: list[str] = Field(
        default_factory=list,
        description="hex SHA-256 of each API key of this tenant (kvgate hash-key KEY), never the key itself")
    tier: Annotated[str, Field(pattern=_NAME)] = Field(
        default="standard", description="the SLA tier (a key of tiers) its requests are queued and judged in")
    weight: PositiveFloat = Field(
        default=1.0, description="share of its tier when the queue decides whose turn it is (fair queueing)"
    )
    mode: Mode | None = Field(
        default=None, description="this tenant's own mode (enforce | shadow); None: the global mode")
    over_limit: OverLimit | dict[ProtectiveLimit, OverLimit] | None = Field(
        default=None, description="over a protective limit (max_concurrent, requests_per_minute, "
        "tokens_per_minute, and the same limits of its model_budgets): refuse (429) or best-effort (served "
        "at the lowest priority when the fleet has room nobody within quota needs); one word for all "
        "three, or per limit ({concurrency: best-effort, tokens: refuse}; a limit left out: "
        "best_effort.default); None: best_effort.default")
    max_concurrent_stretch: Annotated[float, Field(ge=1, le=4, allow_inf_nan=False, strict=True)] = Field(
        default=1.0, description="how far max_concurrent stretches while the fleet serves this tenant slower than "
        "usual (its recent request duration and seconds per output token both more than 1.3x their norms, timed "
        "to the node's last byte) and "
        "it sends no faster than the cap allows at its usual duration: the cap times the slowdown, up to this "
        "factor. A cap sized on a healthy fleet's durations (docs/concepts/tenants.md, Sizing max_concurrent) "
        "otherwise refuses the same traffic once the fleet slows. Requests on the stretch hold no slot of the "
        "shared store; needs max_concurrent; 1: never")
    budgets: list[SpendBudget] = Field(
        default_factory=list, description="spend budgets (money or weighted tokens per window): see "
        "docs/guides/budgets.md")

    @field_validator("budgets")
    @classmethod
    def _budget_names(cls, v: list[SpendBudget]) -> list[SpendBudget]:
        seen: set[str] = set()
        for b in v:
            if b.name in seen:
                raise ValueError(f"budget {b.name!r} is defined twice; each budget of a tenant needs its own name")
            seen.add(b.name)
        return v

    @model_validator(mode="after")
    def _stretch_needs_a_cap(self) -> Tenant:
        if self.max_concurrent_stretch != 1.0 and self.max_concurrent is None:
            raise ValueError("max_concurrent_stretch stretches max_concurrent, which this tenant does not set")
        return self

    @field_validator("over_limit", mode="before")
    @classmethod
    def _over_limit(cls, v: Any) -> Any:
        """One plain message (pydantic's own, for a union, names both alternatives' insides)."""
        words, limits = get_args(OverLimit), get_args(ProtectiveLimit)
        if v is None or (isinstance(v, str) and v in words):
            return v
        if not isinstance(v, dict):
            raise ValueError(f"must be refuse or best-effort, or a map of limit ({', '.join(limits)}) to one "
                             "of them")
        for k, x in v.items():
            if k not in limits:
                raise ValueError(f"{k!r} is not a limit that may be exceeded as best effort (only "
                                 f"{', '.join(limits)}: a limit that is a contract always refuses)")
            if x not in words:
                raise ValueError(f"{k}: must be refuse or best-effort, not {x!r}")
        return v

    def over_limit_for(self, limit: ProtectiveLimit, default: OverLimit) -> OverLimit:
        """What this tenant gets over ``limit``: its own word for it, else ``default``."""
        v = self.over_limit
        if v is None:
            return default
        return v if isinstance(v, str) else v.get(limit, default)

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        out = []
        for digest in v:
            d = digest.strip().lower()
            if not _SHA256.match(d):
                raise ValueError(
                    "each entry must be the hex SHA-256 of an API key (64 hex digits); "
                    "make one with: kvgate hash-key <key>"
                )
            out.append(d)
        return out


class Identity(_Strict):
    """How a request's tenant is found: the API key, and optionally a header set by a trusted filter."""

    unknown_keys: Literal["reject", "default"] = Field(
        default="reject", description="reject: 401; default: account to the tenant named by default_tenant"
    )
    default_tenant: Annotated[str, Field(pattern=_NAME)] | None = Field(
        default=None, description="with unknown_keys: default, the tenant requests without a known key are "
        "accounted to")
    trusted_header: str | None = Field(
        default=None,
        description="a header set by a trusted filter in front of kvgate naming the tenant; off by default",
    )
    trusted_header_overrides_key: bool = Field(
        default=False,
        description="let the trusted header name another tenant than a valid API key's; by default the key wins",
    )

    @field_validator("trusted_header")
    @classmethod
    def _header_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.strip().lower()
        if not re.match(r"^[a-z0-9-]+$", v) or v.startswith("x-kvgate-"):
            raise ValueError("must be a plain lower-case header name, not one of kvgate's own x-kvgate-*")
        return v


class Estimation(_Strict):
    """How a request's tokens are estimated before it runs (reconciled with the reported usage after)."""

    chars_per_token: PositiveFloat = Field(
        default=4.0, description="prompt tokens are estimated as characters / this (no tokenizer is downloaded)")
    per_message_tokens: Annotated[int, Field(ge=0)] = Field(
        default=4, description="tokens added per chat message for its framing")
    default_max_tokens: PositiveInt = Field(
        default=256, description="output tokens reserved when a request sets no max_tokens (a tenant's own "
        "default_max_tokens wins)")
    tokenizer_json: Path | None = Field(
        default=None, description="a local tokenizer.json for exact prompt counts (needs kvgate[tokenizer]); it "
        "reads ~3 MB/s on kvgate's one event loop: a 4 MB prompt holds it ~1.2 s — pair it with a "
        "limits.max_body_bytes you can afford")

    @field_validator("tokenizer_json")
    @classmethod
    def _tokenizer(cls, v: Path | None) -> Path | None:
        if v is None:
            return v
        if not v.is_file():
            raise ValueError(f"file {v} does not exist")
        try:
            import tokenizers  # noqa: F401
        except ImportError as e:
            raise ValueError("needs the 'tokenizers' package: pip install 'kvgate[tokenizer]'") from e
        return v


class Fleet(_Strict):
    """A cap on the whole fleet's requests in flight, when kvgate does not pick the node itself."""

    max_inflight: PositiveInt | None = Field(
        default=None, description="requests in flight across all tenants before 503"
    )


class Retry(_Strict):
    """How Retry-After is computed for 429s and 503s."""

    jitter: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.2, description="Retry-After is stretched by up to this fraction, so refused clients do not come "
        "back together")
    min_ms: Annotated[int, Field(ge=1)] = Field(default=100, description="the shortest Retry-After given, in ms")
    default_request_seconds: PositiveFloat = Field(
        default=2.0, description="expected request duration before any has been seen"
    )


MAX_QUEUE_WAIT_MS = 55_000
"""Envoy's ``max_message_timeout`` in the generated filter is 60 s; a held request must be answered first."""


class BestEffort(_Strict):
    """Serving tenants over a protective limit when the fleet has room (``docs/guides/best-effort.md``)."""

    enabled: bool = Field(
        default=True, description="false: every limit refuses (429), whatever the tenants say; the switch "
        "that turns best effort off everywhere (an ablation, an incident)")
    default: OverLimit = Field(
        default="refuse", description="what a protective limit does for a tenant whose over_limit does "
        "not say: refuse (429) or best-effort")


class Tier(_Strict):
    """An SLA tier. The most urgent tier (lowest ``priority``) goes first, with a starvation guard;
    below it ``queue.lower_tiers`` (share, the default, or strict) decides."""

    priority: Annotated[int, Field(ge=0)] = Field(
        description="the tier's rank: 0 is served first; each tier needs its own")
    max_queue_wait_ms: Annotated[int, Field(ge=1, le=MAX_QUEUE_WAIT_MS)] = Field(
        description="longest a request of this tier may wait in kvgate's queue; past it (or as soon as it "
        "cannot make it) it gets 503 + Retry-After"
    )
    ttft_target_ms: PositiveInt | None = Field(default=None, description="the tier's time-to-first-token target")
    ttft_percentile: Annotated[float, Field(gt=0, le=100)] = Field(
        default=99.0, description="the percentile of TTFT the target applies to")
    reserve_kv: Annotated[float, Field(ge=0, le=0.5)] = Field(
        default=0.0, description="KV-cache fraction this tier leaves free for more important ones: its "
        "requests go to a node only below the node's kv_admit_threshold minus this"
    )
    vllm_priority: int | None = Field(
        default=None, description="the 'priority' written into request bodies (queue.inject_priority); "
        "default: the tier's priority (vLLM runs lower values first)"
    )


DEFAULT_TIERS: dict[str, Tier] = {
    "interactive": Tier(priority=0, max_queue_wait_ms=1000, ttft_target_ms=200, ttft_percentile=99),
    "standard": Tier(priority=1, max_queue_wait_ms=5000, ttft_target_ms=1000, ttft_percentile=99, reserve_kv=0.05),
    "batch": Tier(priority=2, max_queue_wait_ms=30000, ttft_target_ms=5000, ttft_percentile=95, reserve_kv=0.10),
}


class Queue(_Strict):
    """kvgate's gateway queue: requests no node can take yet wait here, not in vLLM's unbounded queue."""

    enabled: bool = Field(default=True, description="hold requests no node can take yet; false: 503 at once")
    max_size: PositiveInt = Field(default=1024, description="requests held at once, all tiers together")
    starvation_guard: PositiveInt = Field(
        default=8, description="after this many releases from higher tiers in a row (a direct dispatch of a smaller "
        "request counts as a fraction of one, and with lower_tiers: share so does a release of a tier below the "
        "top), a waiting lower tier gets one; below the second priority its own release smaller than its mean "
        "request pays only that fraction of the debt, at least half (then at least guard/2 releases from above "
        "before the next)"
    )
    output_token_weight: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="weight of an output token against a prompt token in the fair-share counters"
    )
    lower_tiers: Literal["share", "strict"] = Field(
        default="share", description="below the most urgent tier: 'share' — the tiers take turns by their "
        "tenants' weighted service over the last minute (the tier whose next tenant was served least goes next), "
        "except that one holding a request that has used half its wait (up to its TTFT target) goes before the "
        "less urgent ones; 'strict' — in priority order (the starvation guard aside)"
    )
    shed_parity_gap: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=0.05, description="shed parity: a tier below the top refused over about the last minute (capacity "
        "503s and the quota 429s the fleet caused, of tenants with a protective limit) more than this share more "
        "often than the tiers above it together is lagging: its turn comes after each release from above (not "
        "after starvation_guard of them), without its KV reserve as the guard's own, until it is back within "
        "half the gap. Priority decides who waits, not who is refused; null: off"
    )
    inject_priority: bool = Field(
        default=False, description="write the tier's vllm_priority into each request body (for vLLM servers "
        "run with --scheduling-policy priority); a client's own 'priority' is overwritten"
    )


class Server(_Strict):
    """kvgate's listening addresses and shutdown (these need a restart, not a reload)."""

    grpc_address: str = Field(
        default="127.0.0.1:9001", description="where kvgate serves Envoy's ext_proc, the access log and gRPC "
        "health (needs a restart)")
    metrics_address: str = Field(
        default="127.0.0.1:9101", description="where kvgate serves Prometheus /metrics (needs a restart)")
    drain_seconds: PositiveFloat = Field(
        default=30.0, description="on SIGTERM: NOT_SERVING, then open streams get this long to finish")
    lease_timeout_seconds: PositiveFloat = Field(
        default=900.0, description="a lease with no completion after this long is reclaimed"
    )


class Metrics(_Strict):
    """Prometheus metrics: label cardinality."""

    max_tenant_labels: PositiveInt = Field(
        default=100, description="tenants named in metric labels at most; the rest are reported as tenant='other'")


class Logs(_Strict):
    """Log volume under floods."""

    reject_interval_seconds: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="at most one 'reject' line per tenant, reason and pool in this interval; the "
        "ones between are counted into the next line ('folded') or a 'reject_folded' line; 0: every refusal")


class Limits(_Strict):
    """What any request may ask for, whoever sends it; beyond these it is a 400 naming the parameter."""

    max_body_bytes: PositiveInt = Field(
        default=4 * 1024 * 1024, description="largest request body; above it 413 body-too-large. It also sets "
        "what reading one body may cost kvgate: about 4.8 ms of CPU per 4 MiB (never less), past which a body is "
        "400 body-too-complex")
    max_n: PositiveInt = Field(default=16, description="largest n (and best_of) a request may ask for")
    max_model_name_chars: Annotated[int, Field(ge=16)] = Field(
        default=256, description="longest 'model' a request may name (and GET /v1/models/{id} ask for): a "
        "Hugging Face id is at most 96 characters after its owner, a configured model name at most 256; vLLM "
        "sets no limit of its own"
    )
    max_output_tokens: PositiveInt | None = Field(
        default=None, description="largest max_tokens / max_completion_tokens / max_output_tokens; None: no cap"
    )
    model_context_tokens: PositiveInt | None = Field(
        default=None, description="the served model's context length: prompt + requested output above it is "
        "400 context-too-long; None: not checked"
    )


class BreakerConfig(_Strict):
    """Per-node circuit breakers (``nodes.breaker``): a node that is full or slow gets no traffic until it recovers."""

    enabled: bool = Field(
        default=True, description="per-node circuit breakers; false: no node is ever ejected (KV-aware choice "
        "and the performance model still steer around a full or slow node) — for ablation runs and fleets "
        "where something else ejects sick nodes")
    kv_threshold: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.95, description="a node's KV-cache usage at or above this opens its breaker")
    latency_multiplier: Annotated[float, Field(gt=1)] = Field(
        default=3.0, description="a node's step time over this x its learned baseline (observed / modelled) counts "
        "as slow")
    recovery_window_seconds: PositiveFloat = Field(
        default=30.0, description="an open breaker waits this long before it lets trial requests through "
        "(half-open)")
    half_open_requests: PositiveInt = Field(default=5, description="trial requests a half-open breaker lets through")
    close_kv: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.85, description="a half-open breaker closes only with KV usage below this (below kv_threshold)")
    close_latency_multiplier: Annotated[float, Field(gt=1)] = Field(
        default=1.5, description="... and its step time below this x its baseline")
    latency_trip_readings: PositiveInt = Field(
        default=3, description="consecutive slow probe readings (each with new latency) before a latency trip")
    max_open_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.5, description="latency trips may open breakers on at most this fraction of the nodes "
        "(never on the last closed one): a whole fleet slowing down is load, not a sick node"
    )


class PrefixAffinity(_Strict):
    """Prefix-cache awareness (``nodes.prefix``): kvgate remembers which prompt prefixes it sent to which
    node and counts the expected cache hit in that node's TTFT prediction and KV projection."""

    enabled: bool = Field(default=True, description="count expected prefix-cache hits when choosing a node")
    block_chars: Annotated[int, Field(ge=16, le=4096)] = Field(
        default=512, description="characters of prompt text per index block (~128 tokens at 4 chars a token)")
    max_blocks_per_node: Annotated[int, Field(ge=16)] = Field(
        default=10_000, description="blocks remembered per node (least recently used forgotten first): "
        "about the node's KV cache in index blocks (10,000 x 128 tokens)")
    max_blocks: Annotated[int, Field(ge=16)] = Field(
        default=300_000, description="blocks remembered across all of the pool's nodes (the least recently sent "
        "of any node forgotten first): ~350-460 B each, so ~140 MiB at the default, which keeps the chart's 512 Mi "
        "limit at 1,000 nodes; each pool's index has its own")
    ttl_seconds: PositiveFloat = Field(default=600.0, description="a block not sent again for this long is forgotten")
    max_blocks_per_request: Annotated[int, Field(ge=1, le=4096)] = Field(
        default=128, description="leading blocks of a prompt that are hashed (bounds the cost per request)")

    @property
    def block_tokens(self) -> int:
        """Tokens an index block stands for (at 4 characters a token): a hit's size, and the block of
        the trace's segments in virtual time."""
        return self.block_chars // 4


class Performance(_Strict):
    """The prior of each node's performance model (``ext_proc/perf.py``): the step time of the model and
    GPU the pool serves, ``a + b·prefill_tokens + c·decode_seqs + d·context_tokens`` ms. Either a
    ``profile`` (one of ``kvgate sim --profile``'s: 8b-h100, 8b-a100, 34b-h100, 34b-a100, 70b-h100x4) or
    the figures; a figure given overrides the profile's. Each node then learns how much faster or
    slower it really is, so the prior only has to be of the right shape."""

    profile: str = Field(default="8b-h100", description="a built-in step-time profile")
    a_ms: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="fixed ms per engine step (overrides the profile's)")
    b_ms_per_prefill_token: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="ms per prefill token in a step (overrides the profile's)")
    c_ms_per_decode_seq: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="ms per decoding sequence in a step (overrides the profile's)")
    d_ms_per_context_token: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="ms per token of context held by the decoding sequences (overrides the "
        "profile's)")
    max_num_batched_tokens: PositiveInt | None = Field(default=None, description="vLLM's per-step token budget")
    max_num_seqs: PositiveInt | None = Field(default=None, description="vLLM's sequences per step (--max-num-seqs)")
    detect: bool = Field(
        default=True, description="pick each node's profile from the GPU and model its probe reports (a pool "
        "mixing H100 and A100 nodes gets each its own prior); a node pinned with nodes.static[].profile or "
        "nodes.dns.profile keeps its pin, and a node whose hardware matches no profile keeps this one")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="the nodes' vLLM --long-prefill-token-threshold (0: vLLM's default, off): "
        "the most prompt tokens one request prefills per step, so a long prompt takes more steps and a short one "
        "behind it waits for less (docs/guides/vllm-settings.md)")

    @field_validator("profile")
    @classmethod
    def _known(cls, v: str) -> str:
        return known_profile(v)


def known_profile(v: str) -> str:
    """A built-in profile's name, or a ValueError listing them (pydantic names the field)."""
    if v not in PROFILES:
        raise ValueError(f"unknown profile {v!r}; known: {', '.join(PROFILES)}")
    return v


_ADDRESS = re.compile(r"^(?:(?P<host>[^\s:/\[\]@?#]+)|\[(?P<v6>[^\s\[\]/]+)\]):(?P<port>\d{1,5})$")


def check_address(v: str) -> str:
    """``host:port`` or ``[ipv6]:port`` (the form Envoy's original-destination header takes); port 1-65535."""
    m = _ADDRESS.match(v)
    if m is None:
        raise ValueError("must be host:port, or [ipv6]:port with the IPv6 address in brackets")
    if m["v6"] is not None:
        try:
            ipaddress.IPv6Address(m["v6"])
        except ValueError:
            raise ValueError(f"{m['v6']!r} in brackets is not an IPv6 address") from None
    if not 1 <= int(m["port"]) <= 65535:
        raise ValueError("the port must be 1-65535")
    return v


class NodeEntry(_Strict):
    """One vLLM node (``nodes.static[i]``) and its kvgate probe."""

    address: str = Field(description="host:port (or [ipv6]:port) of the vLLM server")
    probe: Annotated[str, Field(pattern=r"^https?://", description="base URL of this node's kvgate probe")]
    kv_admit_threshold: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="this node's own kv_admit_threshold; default: the pool's")
    profile: str | None = Field(
        default=None, description="this node's performance profile, pinned (a pool mixing GPUs): it wins over "
        "nodes.performance.profile and over what the probe reports")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return check_address(v)

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str | None) -> str | None:
        return None if v is None else known_profile(v)


class DnsDiscovery(_Strict):
    """Nodes found by DNS (``nodes.dns``): every address of a headless Service is a node."""

    name: str = Field(description="a headless Service, e.g. vllm.llm.svc.cluster.local")
    port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=8000, description="the vLLM port on every address the name resolves to")
    probe_port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=9102, description="the kvgate probe's port on every address")
    refresh_seconds: PositiveFloat = Field(default=10.0, description="how often the name is resolved again")
    profile: str | None = Field(
        default=None, description="the performance profile of every node this name resolves to, pinned (one "
        "GPU kind behind one Service); default: detected per node, else nodes.performance.profile")

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str | None) -> str | None:
        return None if v is None else known_profile(v)


class LoraRouting(_Strict):
    """LoRA adapters (``nodes.lora``): a request for one of the pool's ``adapters`` prefers a node that holds
    it, unless that node's predicted first token is later by more than a load costs (``picker.py``)."""

    enabled: bool = Field(default=True, description="count adapter loads and slot waits in node choice's "
                          "predictions; off: an adapter is routed as any model name of its pool")
    load_seconds: Annotated[float, Field(ge=0)] = Field(
        default=0.15, description="what loading an adapter a node does not hold adds to a request's first "
        "token (read from disk into a GPU slot): the prior of the cost a node that holds it saves")
    max_loras: PositiveInt = Field(
        default=1, description="adapters one batch holds on a node that does not report it (vLLM --max-loras; "
        "a node exporting vllm:lora_requests_info says its own)")


class Nodes(_Strict):
    """Where requests go: kvgate picks the vLLM node and tells Envoy (ORIGINAL_DST + header)."""

    static: list[NodeEntry] = Field(
        default_factory=list, description="the vLLM nodes by address, each with its probe")
    dns: DnsDiscovery | None = Field(
        default=None, description="or discover them: every address of a headless Service is a node")
    kv_admit_threshold: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.92, description="no new request goes to a node whose projected KV-cache usage passes this")
    poll_interval_seconds: PositiveFloat = Field(
        default=0.25, description="how often a probe without the snapshot stream is polled")
    stale_after_seconds: PositiveFloat = Field(
        default=2.0, description="a node whose last snapshot is older is 'unknown' (see unknown)")
    dead_after_seconds: PositiveFloat = Field(
        default=10.0, description="a node whose last snapshot is older still gets no traffic at all")
    unknown: Literal["fallback", "serve", "avoid"] = Field(
        default="fallback",
        description="nodes with a stale snapshot: fallback (only when no fresh node can take it) | serve | avoid",
    )
    max_waiting_requests: PositiveInt | None = Field(
        default=None, description="deprecated (the performance model decides): requests waiting inside one "
        "vLLM node before kvgate holds new ones itself; still applied when set"
    )
    max_prefill_tokens: PositiveInt | None = Field(
        default=None, description="deprecated (the performance model decides): prompt tokens sent to one node "
        "and not yet prefilled before kvgate holds new ones; still applied when set"
    )
    performance: Performance = Performance()
    breaker: BreakerConfig = BreakerConfig()
    prefix: PrefixAffinity = PrefixAffinity()
    lora: LoraRouting = Field(default_factory=LoraRouting, description="LoRA adapter affinity (LoraRouting)")

    def deprecations(self) -> list[str]:
        """Settings still honoured but on their way out: said once per load (logged by the server)."""
        return [f"nodes.{k} is deprecated: each node's performance model now decides when its queue is long "
                "enough (a fixed cap, checked against readings a poll old, held requests vLLM could have served); "
                "it still applies while set" for k in ("max_waiting_requests", "max_prefill_tokens")
                if getattr(self, k) is not None]

    @model_validator(mode="after")
    def _limits(self) -> Nodes:
        if self.dead_after_seconds <= self.stale_after_seconds:
            raise ValueError("nodes.dead_after_seconds: must be longer than nodes.stale_after_seconds")
        if not self.static and self.dns is None:
            raise ValueError("nodes: list nodes under nodes.static or set nodes.dns")
        if self.breaker.close_kv >= self.breaker.kv_threshold:
            raise ValueError("nodes.breaker.close_kv: must be below nodes.breaker.kv_threshold")
        return self


class PoolQueue(_Strict):
    """A pool's own gateway queue (``pools[i].queue``)."""

    max_size: PositiveInt | None = Field(
        default=None, description="requests this pool's gateway queue holds at once; default: queue.max_size")


class Pool(_Strict):
    """One set of vLLM nodes serving the same models (``pools[i]``): its own nodes, performance prior
    (``nodes.performance.profile``), KV thresholds, breakers and gateway queue. A request goes to the pool
    that serves its ``model``."""

    name: Annotated[str, Field(pattern=_NAME)] = Field(description="the pool's name: the pool label on metrics")
    models: list[ModelName] = Field(
        min_length=1, description="model names the pool serves, exactly as clients send them, or patterns "
        "('llama-3.1-8b-*'); an exact name wins over a pattern, then patterns in file order")
    adapters: list[ModelName] = Field(
        default_factory=list, description="LoRA adapter names loaded on the pool's nodes (vLLM --lora-modules): "
        "routed here and listed by GET /v1/models with the pool's first model as parent")
    weight: PositiveFloat | None = Field(
        default=None, description="for a model several pools serve: this pool's share of its requests "
        "(every pool serving it needs one)")
    nodes: Nodes
    queue: PoolQueue = PoolQueue()

    @field_validator("adapters")
    @classmethod
    def _exact(cls, v: list[str]) -> list[str]:
        for name in v:
            if is_pattern(name):
                raise ValueError(f"{name!r}: an adapter is named exactly (no '*', '?' or '[')")
        return v


class RedisStore(_Strict):
    """Shared state for several kvgate replicas (``store.redis``): leased quota slices, completions
    forwarded to the replica that owns a ticket, merged fair-share counters and node bookings."""

    url: Annotated[str, Field(pattern=r"^(redis|rediss|unix)://")] = Field(
        description="redis://[user:password@]host:port/db, rediss:// for TLS, unix:///path.sock")
    password_file: Path | None = Field(
        default=None, description="a file holding the password (a mounted Secret); overrides one in the URL")
    tls_ca_file: Path | None = Field(default=None, description="CA bundle to verify a rediss:// server with")
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = Field(
        default="kvgate", description="every key kvgate writes starts with it: one per release sharing a Redis")
    sync_interval_ms: Annotated[int, Field(ge=10, le=1000)] = Field(
        default=100, description="how often each replica refills and returns its slices and publishes its counters")
    lease_ttl_seconds: Annotated[float, Field(ge=1, le=60)] = Field(
        default=3.0, description="a replica not heard from for this long is dead: its slices go back to the others")
    timeout_ms: Annotated[int, Field(ge=10, le=5000)] = Field(
        default=500, description="one Redis call; past it the call counts as failed")
    expected_replicas: PositiveInt = Field(
        default=1, description="replicas expected to run (the chart sets replicaCount): a replica that cannot "
        "reach Redis splits every limit among at least this many, even if it never saw the others")
    fallback_after_seconds: Annotated[float, Field(gt=0, le=10)] = Field(
        default=1.0, description="Redis failing this long: each replica enforces a safe local slice of every limit "
        "(the limit divided among the replicas last seen alive)")

    @field_validator("password_file", "tls_ca_file")
    @classmethod
    def _exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"file {v} does not exist")
        return v

    @model_validator(mode="after")
    def _timing(self) -> RedisStore:
        sync_s = self.sync_interval_ms / 1000.0 + 2 * self.timeout_ms / 1000.0
        if self.lease_ttl_seconds <= sync_s:
            raise ValueError(f"lease_ttl_seconds: must be longer than one sync at its slowest "
                             f"(sync_interval_ms + 2 x timeout_ms = {sync_s:g} s), or live replicas read as dead")
        if self.fallback_after_seconds >= self.lease_ttl_seconds:
            raise ValueError("fallback_after_seconds: must be shorter than lease_ttl_seconds")
        return self


class Store(_Strict):
    """Where quota state lives: in this process (one replica, the default) or in Redis (several)."""

    redis: RedisStore | None = None


class Config(_Strict):
    """The whole kvgate configuration file."""

    mode: Mode = Field(
        default="enforce", description="enforce, or shadow: decide, count and log, but admit everything (a "
        "tenant's own mode wins)")
    server: Server = Server()
    identity: Identity = Identity()
    estimation: Estimation = Estimation()
    fleet: Fleet = Fleet()
    retry: Retry = Retry()
    limits: Limits = Limits()
    metrics: Metrics = Metrics()
    logs: Logs = Logs()
    nodes: Nodes | None = None
    tiers: dict[Annotated[str, Field(pattern=_NAME)], Tier] = Field(
        default_factory=lambda: dict(DEFAULT_TIERS),
        description="the SLA tiers by name (not none: the metrics label unidentified callers so); leave out for "
        "interactive / standard / batch")
    queue: Queue = Queue()
    best_effort: BestEffort = Field(
        default_factory=BestEffort, description="tenants over a protective limit served as best effort "
        "when the fleet has room (see tenants[i].over_limit)")
    store: Store = Store()
    pools: list[Pool] = Field(
        default_factory=list, description="several models, each on its own nodes; none: one pool named "
        "'default' serving every model on the nodes of 'nodes'")
    tenants: list[Tenant] = Field(
        default_factory=list, description="the tenants, each with its API keys' digests, tier and quota")
    prices: dict[ModelName, Price] = Field(
        default_factory=dict, description="price per million tokens, by model name, pattern or pool name "
        "(what currency spend budgets charge): see docs/guides/budgets.md")

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if not self.tiers:
            raise ValueError("tiers: define at least one tier (or leave the setting out for the defaults)")
        ranks: dict[int, str] = {}
        for name, tier in self.tiers.items():
            if name == "none":
                raise ValueError("tiers.none: 'none' is reserved (the metrics' tier label of a caller refused "
                                 "before any tenant was found)")
            if tier.priority in ranks:
                raise ValueError(f"tiers.{name}.priority: tier {ranks[tier.priority]!r} already has priority "
                                 f"{tier.priority}; each tier needs its own")
            ranks[tier.priority] = name
        names: set[str] = set()
        owners: dict[str, str] = {}
        for i, t in enumerate(self.tenants):
            if t.tier not in self.tiers:
                raise ValueError(f"tenants[{i}].tier: no tier named {t.tier!r}; tiers are: "
                                 + ", ".join(sorted(self.tiers)))
            if t.name in names:
                raise ValueError(f"tenants[{i}].name: tenant {t.name!r} is defined twice")
            names.add(t.name)
            if not self.prices and any(b.unit == "currency" for b in t.budgets):
                raise ValueError(f"tenants[{i}].budgets: a currency budget needs prices (the top-level "
                                 "`prices` table is empty)")
            for digest in t.api_key_sha256:
                if digest in owners:
                    raise ValueError(
                        f"tenants[{i}].api_key_sha256: a key is already given to tenant {owners[digest]!r}"
                    )
                owners[digest] = t.name
        self._check_pools()
        if self.identity.unknown_keys == "default":
            if self.identity.default_tenant is None:
                raise ValueError("identity.default_tenant: required when identity.unknown_keys is 'default'")
            if self.identity.default_tenant not in names:
                raise ValueError(
                    f"identity.default_tenant: no tenant named {self.identity.default_tenant!r} in tenants"
                )
        return self

    def _check_pools(self) -> None:
        """Pool names and nodes unique; a model (or adapter) in two pools only with a weight on each;
        tenants' model entitlements and budgets naming models some pool serves."""
        if not self.pools:
            for i, t in enumerate(self.tenants):
                for key in t.model_budgets:
                    if t.models is not None and not any(fnmatchcase(key, m) or key == m for m in t.models):
                        raise ValueError(f"tenants[{i}].model_budgets.{key}: not among the tenant's models")
            return
        if self.nodes is not None:
            raise ValueError("nodes: with pools, each pool lists its own nodes (pools[i].nodes); move these there")
        pools: dict[str, int] = {}
        where: dict[str, tuple[int, str]] = {}
        served: dict[str, int] = {}
        for i, p in enumerate(self.pools):
            if p.name in pools:
                raise ValueError(f"pools[{i}].name: pool {p.name!r} is defined twice")
            if p.name == "none":
                raise ValueError(f"pools[{i}].name: 'none' is reserved (the metrics' pool label of a request "
                                 "refused before it was routed)")
            pools[p.name] = i
            for field, names in (("models", p.models), ("adapters", p.adapters)):
                for j, m in enumerate(names):
                    if not is_pattern(m) and len(m) > self.limits.max_model_name_chars:
                        raise ValueError(f"pools[{i}].{field}[{j}]: {len(m)} characters, longer than "
                                         f"limits.max_model_name_chars ({self.limits.max_model_name_chars}): no "
                                         "request could name it")
                    first = served.get(m)
                    if first is not None and first != i:
                        other = self.pools[first]
                        if p.weight is None or other.weight is None:
                            raise ValueError(
                                f"pools[{i}].{field}[{j}]: model {m!r} is also served by pool {other.name!r}; "
                                f"give both pools a weight to split its requests between them")
                    served[m] = i
            for n in p.nodes.static:
                if n.address in where and where[n.address][0] != i:
                    raise ValueError(f"pools[{i}].nodes.static: node {n.address} is also in pool "
                                     f"{where[n.address][1]!r}; a node serves one pool")
                where[n.address] = (i, p.name)
            dns = p.nodes.dns
            if dns is not None:
                key = f"dns {dns.name}:{dns.port}"
                if key in where:
                    raise ValueError(f"pools[{i}].nodes.dns: {dns.name}:{dns.port} is also pool "
                                     f"{where[key][1]!r}'s; a node serves one pool")
                where[key] = (i, p.name)
        patterns = [m for m in served if is_pattern(m)]
        for i, t in enumerate(self.tenants):
            for field, names in (("models", t.models or []), ("model_budgets", list(t.model_budgets))):
                for m in names:
                    if m not in served and not any(fnmatchcase(m, pat) for pat in patterns) and \
                            not (is_pattern(m) and any(fnmatchcase(s, m) for s in served)):
                        raise ValueError(f"tenants[{i}].{field}: no pool serves a model {m!r}; pools serve: "
                                         + ", ".join(sorted(served)))
            for key in t.model_budgets:
                if t.models is not None and not any(fnmatchcase(key, m) or key == m for m in t.models):
                    raise ValueError(f"tenants[{i}].model_budgets.{key}: not among the tenant's models")

    @property
    def top_tier(self) -> str:
        return min(self.tiers, key=lambda n: self.tiers[n].priority)

    @property
    def lowest_tier(self) -> str:
        return max(self.tiers, key=lambda n: self.tiers[n].priority)

    def tenant(self, name: str) -> Tenant | None:
        for t in self.tenants:
            if t.name == name:
                return t
        return None


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def parse_config(data: Any, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of settings, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise config_error(e, f"{source}: invalid configuration") from None


def config_error(e: ValidationError, title: str) -> ConfigError:
    """One line per problem, each naming the field by its path in the file."""
    lines = []
    for err in e.errors():
        where = _loc(tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (check the spelling)"
        lines.append(f"  {where}: {msg}" if where else f"  {msg}")
    return ConfigError(title + "\n" + "\n".join(lines))


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"duplicate key {key!r} on line {line}")
        self.key, self.line, self.first = key, line, first


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error, not "last wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *defaults' may be overridden, that is its point
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class says so
            line = key_node.start_mark.line + 1
            if first is not None:
                raise _DuplicateKey(key, line, first)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str = "<config>", allow_empty: bool = False) -> Any:
    """Parse a config document; duplicate keys and (unless ``allow_empty``: then it is ``{}``) an empty
    document are :class:`ConfigError`."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except _DuplicateKey as e:
        raise ConfigError(f"{source}: duplicate key {e.key!r} on line {e.line} (first given on line {e.first}); "
                          "each setting may appear only once") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if data is None and allow_empty:
        return {}
    if data is None:
        raise ConfigError(f"{source}: config file is empty (an empty file would drop every tenant)")
    return data


def load_config(path: str | Path, server: dict[str, Any] | None = None) -> Config:
    """Read and validate a config file; ``server``: settings of ``server.*`` given on the command line,
    which win over the file's (replicas sharing one file each listen on their own ports)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: cannot read config file: not UTF-8 text") from None
    data = load_yaml(text, str(p))
    if server and isinstance(data, dict):
        data = {**data, "server": {**(data.get("server") or {}), **server}}
    return parse_config(data, str(p))
