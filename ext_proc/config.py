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

from .profiles import PROFILES

Mode = Literal["enforce", "shadow"]
OverLimit = Literal["refuse", "best-effort"]
"""What a tenant over a protective limit gets: a 429 (``refuse``), or service as best effort when the
fleet has room nobody within quota needs (``best-effort``; ``docs/best-effort.md``)."""
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

    max_concurrent: PositiveInt | None = None
    requests_per_minute: PositiveFloat | None = None
    request_burst: PositiveInt | None = Field(
        default=None, description="bucket size for requests; default: one minute's worth, at least 1"
    )
    tokens_per_minute: PositiveFloat | None = None
    token_burst: PositiveInt | None = Field(
        default=None, description="bucket size for tokens; default: one minute's worth, at least 1"
    )
    max_prompt_tokens: PositiveInt | None = None
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

    max_concurrent: PositiveInt | None = None
    requests_per_minute: PositiveFloat | None = None
    request_burst: PositiveInt | None = None
    tokens_per_minute: PositiveFloat | None = None
    token_burst: PositiveInt | None = None


class Tenant(Quota):
    name: Annotated[str, Field(pattern=_NAME)]
    models: list[ModelName] | None = Field(
        default=None, description="the models (names or patterns) this tenant may use: any other is 403 "
        "model_not_allowed; None: every model the pools serve")
    model_budgets: dict[ModelName, ModelBudget] = Field(
        default_factory=dict, description="per-model limits (key: a model name or pattern; the first that "
        "matches applies), enforced besides the tenant's own")
    api_key_sha256: list[str] = Field(default_factory=list)
    tier: Annotated[str, Field(pattern=_NAME)] = "standard"
    weight: PositiveFloat = Field(
        default=1.0, description="share of its tier when the queue decides whose turn it is (fair queueing)"
    )
    mode: Mode | None = None
    over_limit: OverLimit | dict[ProtectiveLimit, OverLimit] | None = Field(
        default=None, description="over a protective limit (max_concurrent, requests_per_minute, "
        "tokens_per_minute, and the same limits of its model_budgets): refuse (429) or best-effort (served "
        "at the lowest priority when the fleet has room nobody within quota needs); one word for all "
        "three, or per limit ({concurrency: best-effort, tokens: refuse}; a limit left out: "
        "best_effort.default); None: best_effort.default")

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
    unknown_keys: Literal["reject", "default"] = Field(
        default="reject", description="reject: 401; default: account to the tenant named by default_tenant"
    )
    default_tenant: Annotated[str, Field(pattern=_NAME)] | None = None
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
    chars_per_token: PositiveFloat = 4.0
    per_message_tokens: Annotated[int, Field(ge=0)] = 4
    default_max_tokens: PositiveInt = 256
    tokenizer_json: Path | None = None

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
    max_inflight: PositiveInt | None = Field(
        default=None, description="requests in flight across all tenants before 503"
    )


class Retry(_Strict):
    jitter: Annotated[float, Field(ge=0, le=1)] = 0.2
    min_ms: Annotated[int, Field(ge=1)] = 100
    default_request_seconds: PositiveFloat = Field(
        default=2.0, description="expected request duration before any has been seen"
    )


MAX_QUEUE_WAIT_MS = 55_000
"""Envoy's ``max_message_timeout`` in the generated filter is 60 s; a held request must be answered first."""


class BestEffort(_Strict):
    """Serving tenants over a protective limit when the fleet has room (``docs/best-effort.md``)."""

    enabled: bool = Field(
        default=True, description="false: every limit refuses (429), whatever the tenants say; the switch "
        "that turns best effort off everywhere (an ablation, an incident)")
    default: OverLimit = Field(
        default="refuse", description="what a protective limit does for a tenant whose over_limit does "
        "not say: refuse (429) or best-effort")


class Tier(_Strict):
    """An SLA tier. Tiers are served in strict ``priority`` order (0 first), with a starvation guard."""

    priority: Annotated[int, Field(ge=0)]
    max_queue_wait_ms: Annotated[int, Field(ge=1, le=MAX_QUEUE_WAIT_MS)] = Field(
        description="longest a request of this tier may wait in kvgate's queue; past it (or as soon as it "
        "cannot make it) it gets 503 + Retry-After"
    )
    ttft_target_ms: PositiveInt | None = Field(default=None, description="the tier's time-to-first-token target")
    ttft_percentile: Annotated[float, Field(gt=0, le=100)] = 99.0
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

    enabled: bool = True
    max_size: PositiveInt = Field(default=1024, description="requests held at once, all tiers together")
    starvation_guard: PositiveInt = Field(
        default=8, description="after this many releases from higher tiers in a row, a waiting lower tier gets one"
    )
    output_token_weight: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="weight of an output token against a prompt token in the fair-share counters"
    )
    inject_priority: bool = Field(
        default=False, description="write the tier's vllm_priority into each request body (for vLLM servers "
        "run with --scheduling-policy priority); a client's own 'priority' is overwritten"
    )


class Server(_Strict):
    grpc_address: str = "127.0.0.1:9001"
    metrics_address: str = "127.0.0.1:9101"
    drain_seconds: PositiveFloat = 30.0
    lease_timeout_seconds: PositiveFloat = Field(
        default=900.0, description="a lease with no completion after this long is reclaimed"
    )


class Metrics(_Strict):
    max_tenant_labels: PositiveInt = 100


class Logs(_Strict):
    reject_interval_seconds: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="at most one 'reject' line per tenant, reason and pool in this interval; the "
        "ones between are counted into the next line ('folded') or a 'reject_folded' line; 0: every refusal")


class Limits(_Strict):
    """What any request may ask for, whoever sends it; beyond these it is a 400 naming the parameter."""

    max_body_bytes: PositiveInt = 4 * 1024 * 1024
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
    kv_threshold: Annotated[float, Field(gt=0, le=1)] = 0.95
    latency_multiplier: Annotated[float, Field(gt=1)] = 3.0
    recovery_window_seconds: PositiveFloat = 30.0
    half_open_requests: PositiveInt = 5
    close_kv: Annotated[float, Field(gt=0, le=1)] = 0.85
    close_latency_multiplier: Annotated[float, Field(gt=1)] = 1.5
    latency_trip_readings: PositiveInt = Field(
        default=3, description="consecutive slow probe readings (each with new latency) before a latency trip")
    max_open_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.5, description="latency trips may open breakers on at most this fraction of the nodes "
        "(never on the last closed one): a whole fleet slowing down is load, not a sick node"
    )


class PrefixAffinity(_Strict):
    """Prefix-cache awareness (``nodes.prefix``): kvgate remembers which prompt prefixes it sent to which
    node and counts the expected cache hit in that node's TTFT prediction and KV projection."""

    enabled: bool = True
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
    a_ms: Annotated[float, Field(ge=0)] | None = None
    b_ms_per_prefill_token: Annotated[float, Field(ge=0)] | None = None
    c_ms_per_decode_seq: Annotated[float, Field(ge=0)] | None = None
    d_ms_per_context_token: Annotated[float, Field(ge=0)] | None = None
    max_num_batched_tokens: PositiveInt | None = Field(default=None, description="vLLM's per-step token budget")
    max_num_seqs: PositiveInt | None = None

    @field_validator("profile")
    @classmethod
    def _known(cls, v: str) -> str:
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
    address: str = Field(description="host:port (or [ipv6]:port) of the vLLM server")
    probe: Annotated[str, Field(pattern=r"^https?://", description="base URL of this node's kvgate probe")]
    kv_admit_threshold: Annotated[float, Field(gt=0, le=1)] | None = None

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return check_address(v)


class DnsDiscovery(_Strict):
    name: str = Field(description="a headless Service, e.g. vllm.llm.svc.cluster.local")
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    probe_port: Annotated[int, Field(ge=1, le=65535)] = 9102
    refresh_seconds: PositiveFloat = 10.0


class Nodes(_Strict):
    """Where requests go: kvgate picks the vLLM node and tells Envoy (ORIGINAL_DST + header)."""

    static: list[NodeEntry] = Field(default_factory=list)
    dns: DnsDiscovery | None = None
    kv_admit_threshold: Annotated[float, Field(gt=0, le=1)] = 0.92
    poll_interval_seconds: PositiveFloat = 0.25
    stale_after_seconds: PositiveFloat = 2.0
    dead_after_seconds: PositiveFloat = 10.0
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
    max_size: PositiveInt | None = Field(
        default=None, description="requests this pool's gateway queue holds at once; default: queue.max_size")


class Pool(_Strict):
    """One set of vLLM nodes serving the same models (``pools[i]``): its own nodes, performance prior
    (``nodes.performance.profile``), KV thresholds, breakers and gateway queue. A request goes to the pool
    that serves its ``model``."""

    name: Annotated[str, Field(pattern=_NAME)]
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
    mode: Mode = "enforce"
    server: Server = Server()
    identity: Identity = Identity()
    estimation: Estimation = Estimation()
    fleet: Fleet = Fleet()
    retry: Retry = Retry()
    limits: Limits = Limits()
    metrics: Metrics = Metrics()
    logs: Logs = Logs()
    nodes: Nodes | None = None
    tiers: dict[Annotated[str, Field(pattern=_NAME)], Tier] = Field(default_factory=lambda: dict(DEFAULT_TIERS))
    queue: Queue = Queue()
    best_effort: BestEffort = Field(
        default_factory=BestEffort, description="tenants over a protective limit served as best effort "
        "when the fleet has room (see tenants[i].over_limit)")
    store: Store = Store()
    pools: list[Pool] = Field(
        default_factory=list, description="several models, each on its own nodes; none: one pool named "
        "'default' serving every model on the nodes of 'nodes'")
    tenants: list[Tenant] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if not self.tiers:
            raise ValueError("tiers: define at least one tier (or leave the setting out for the defaults)")
        ranks: dict[int, str] = {}
        for name, tier in self.tiers.items():
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
