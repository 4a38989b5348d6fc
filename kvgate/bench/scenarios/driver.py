"""One policy over one trace, in virtual time: kvgate's own decision core in front of simulated nodes.

What runs here is what runs in the live server, minus the transport: ``ext_proc.core.Core``, the
gateway core the gRPC server drives too (identity, quotas, tiers, the fair queue, node choice,
breakers, completions), fed by the probe's own ``gpu_probe.snapshot.Deriver``, and
``scaler.law.ControlLaw``; the nodes are ``sim.engine.Engine`` (the vLLM v1 scheduler mirror and
step-time model). This module only plays the transport: requests in, answers out, the end of each
request, the core's tick every 50 ms, probe readings every ``nodes.poll_interval_seconds``. Each
tenant of the config gets an API key for the run and every request carries it, so identity is the
production path too; the one shortcut is that token counts are known exactly (no body is built and
estimated).

Simplifications, all documented in docs/benchmarks/index.md: a probe reads its node every ``PROBE_INTERVAL_S``
(the default ``kvgate probe --interval``) with no network delay; TTFT/queue observations enter the
probe's histograms when a request finishes (vLLM observes TTFT at the first token); clients do not
retry a rejection; a node being removed first drains its requests.

Model pools: when the kvgate config has ``pools``, each pool is its own set of simulated nodes (its
profile: the pool's ``nodes.performance.profile``), its own size (``Policy.pools``) and, for the
autoscaling policies, its own autoscaler — one ScaledObject per pool in the chart, so one
``ControlLaw`` per pool here, fed only the decisions kvgate routed to that pool (``Answer.pool``), as
the scaler reads only that pool's series. A trace request's ``model`` goes into the estimate, and
kvgate's own router (``ext_proc.pools``) picks the pool; the baselines without kvgate route by model
with the same router, then pick within the pool, as a per-model Envoy route to each Deployment would.
A config without pools is the one pool ``default``: the run is what it was before pools existed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ext_proc.admission import Usage
from ext_proc.config import Config, Nodes, parse_config
from ext_proc.core import Answer, Core, Ended, Held, null_logger
from ext_proc.core import Request as GatewayRequest
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from ext_proc.pools import NO_POOL, PoolSpec, Router
from ext_proc.prefix import segment_chain
from ext_proc.profiles import Profile, get_profile
from gpu_probe.parse import EngineReading
from gpu_probe.snapshot import Deriver
from scaler.law import ControlLaw, LawSettings, Signals
from scaler.signals import BUDGET_REASONS, KINDS
from sim.engine import Engine, EngineOptions
from sim.prefix_cache import Prompt
from sim.scheduler import Request

from .hpa import DEFAULT_SCALE_DOWN, Hpa, HpaSettings, ScalingPolicy, ScalingRules, chart_metric, metric_replicas
from .switches import switch_off
from .trace import TraceRequest

PUMP_INTERVAL_S = 0.05
"""As ``ext_proc.server.TICK_S``."""
PROBE_INTERVAL_S = 0.5
"""As ``kvgate probe --interval``'s default."""
CHARS_PER_TOKEN = 4

BREAKER_CAUSES = ("latency", "kv", "trial")
"""A breaker's opening by cause (``ext_proc.breaker.open_cause``, what kvgate's metric counts): a latency
trip, a KV trip, or a re-open while half-open (a trial failed or the node still read unhealthy)."""

Admit = Literal["none", "kv-shed", "kvgate"]
Autoscale = Literal["none", "queue", "scaler"]


@dataclass(frozen=True)
class PoolSize:
    """One model pool's simulated nodes under a policy (a kvgate config with ``pools``): where it starts
    and its autoscaler's bounds. Each pool is a Deployment of its own with a ScaledObject of its own, so
    each has its own size and its own min/max replicas."""

    pool: str
    nodes: int
    min_nodes: int = 1
    max_nodes: int = 16


@dataclass(frozen=True)
class Policy:
    """What stands in front of the nodes."""

    name: str
    nodes: int
    admission: Admit = "none"
    autoscale: Autoscale = "none"
    min_nodes: int = 1
    max_nodes: int = 16
    ideal: bool = False
    """A scenario's ideal reference (``workloads.Ideal``), not a policy to compare as one."""
    prefix: bool = True
    """kvgate's prefix-cache awareness (``nodes.prefix.enabled``); False: the ``kvgate-noprefix`` policy."""
    pools: tuple[PoolSize, ...] = ()
    """Per model pool (a config with ``pools``): its nodes and autoscaling bounds. A pool not listed gets
    ``nodes``, ``min_nodes`` and ``max_nodes``."""
    reference: str = ""
    """A scenario's reference run of this policy (``workloads.Reference``): what its trace was run without
    (``no flood``), in the label; '' for the scenario's own run."""
    off: tuple[str, ...] = ()
    """kvgate's mechanisms switched off by their own config keys (``switches.SWITCHES``: the ablation's
    rows); () for every other policy."""

    def size(self, pool: str) -> PoolSize:
        """The nodes and bounds of ``pool`` under this policy."""
        return next((p for p in self.pools if p.pool == pool),
                    PoolSize(pool, self.nodes, self.min_nodes, self.max_nodes))

    @property
    def label(self) -> str:
        plus = "+" if self.autoscale != "none" else ""
        fleet = ", ".join(f"{p.pool}: {p.nodes}{plus}" for p in self.pools) if self.pools else f"{self.nodes}{plus}"
        label = f"{self.name} ({fleet} nodes)"
        return f"{label} [{self.reference}]" if self.reference else label

    def configure(self, base: Config, profile: str | None = None, long_prefill_token_threshold: int = 0) -> Config:
        """The kvgate config this policy runs with; every tenant gets the run's API key. ``profile``: the
        simulated nodes' step-time profile, the prior of kvgate's performance model unless the config
        names one (what an operator sets in ``nodes.performance`` for the model and GPU the pool runs);
        with ``pools``, the same for each pool's ``nodes`` (a pool that names its profile runs nodes of it).
        ``long_prefill_token_threshold``: the nodes' (0: off), told to that same prior."""
        doc = kv_shed_config(base) if self.admission == "kv-shed" else base.model_dump(mode="json")
        sections: list[tuple[Nodes | None, dict[str, Any]]]
        if base.pools:
            sections = [(p.nodes, d["nodes"]) for p, d in zip(base.pools, doc["pools"], strict=True)]
        elif base.nodes is not None:
            sections = [(base.nodes, doc.setdefault("nodes", {}))]
        else:
            sections = [(None, doc["nodes"])] if doc.get("nodes") is not None else []
        for given, section in sections:
            if profile is not None and given is not None and "performance" not in given.model_fields_set:
                section["performance"] = {"profile": profile}
                if long_prefill_token_threshold:
                    section["performance"]["long_prefill_token_threshold"] = long_prefill_token_threshold
            if not self.prefix:
                section["prefix"] = {**(section.get("prefix") or {}), "enabled": False}
        switch_off(doc, self.off)
        for t in doc.get("tenants", []):
            t["api_key_sha256"] = [hash_key(run_key(t["name"]))]
        return parse_config(doc)


def run_key(tenant: str) -> str:
    """The API key a tenant's requests carry in virtual time."""
    return f"sk-bench-{tenant}"


@dataclass(frozen=True)
class Autoscaling:
    """Settings of both autoscalers. ``queue``: what KEDA on vLLM's queue depth does (HPA AverageValue
    of ``vllm:num_requests_waiting`` with the HPA's default behaviour, ``hpa.py``: 10% tolerance, 300 s
    scale-down stabilisation, up by max(4 pods, 100%) per 15 s, never below the fleet it starts with);
    ``scaler``: kvgate's control law on capacity rejections, behind the HPA the chart renders
    (``law_behind_hpa``)."""

    interval_s: float = 15.0
    """KEDA's pollingInterval."""
    waiting_per_node: float = 4.0
    """The queue autoscaler's target: requests waiting in vLLM per node."""
    kv_usage_per_node: float = 0.5
    """The queue autoscaler's second trigger: ``vllm:kv_cache_usage_perc`` summed over the nodes, per node
    (AverageValue): what holds the fleet at a peak where vLLM's queue is empty because every request fits."""
    scale_down_window_s: float = 300.0
    """The queue autoscaler's scale-down stabilisation window (the HPA's default)."""
    window_s: float = 60.0
    """The scaler's signal window."""
    law: LawSettings = field(default_factory=lambda: LawSettings(min_replicas=1, max_replicas=16, step=2,
                                                                  cooldown_s=600.0))
    law_behind_hpa: bool = True
    """kvgate+scaler: the law's count goes through the HPA the chart's ScaledObject renders (``chart_hpa``),
    as it does in a cluster; False: straight to the fleet (the default before the law cleared the HPA's
    tolerance on every scale-up)."""

    def chart_hpa(self, size: PoolSize) -> HpaSettings:
        """The HPA between the scaler and one pool's pods as the chart renders it (helm/kvgate/templates/
        scaledobject.yaml): Kubernetes' 10% tolerance on the law's count (``AverageValue``, target 1); up by
        up to ``maxReplicas`` pods per 15 s, unstabilised; down one pod per 15 s, to the highest count asked
        over the cooldown (whole seconds, at most 3600)."""
        low = max(1, size.min_nodes)  # (an HPA's floor is 1; KEDA's scale to and from zero is not modelled)
        top = max(low, size.max_nodes)
        return HpaSettings(low, top, scale_up=ScalingRules(0.0, (ScalingPolicy("Pods", top, 15.0),)),
                           scale_down=ScalingRules(float(min(3600, int(self.law.cooldown_s))),
                                                   (ScalingPolicy("Pods", 1, 15.0),)))

    def hpa(self, size: PoolSize) -> HpaSettings:
        """The queue autoscaler's HPA for one pool: ``minReplicas`` is the fleet the pool starts with (a
        tuned deployment does not scale below its provisioned baseline: scaling a day's fleet down to one
        node because vLLM's queue is empty at the peak is what an untuned HPA does, not a baseline),
        ``maxReplicas`` the pool's bound; Kubernetes' default behaviour otherwise."""
        low = min(size.nodes, size.max_nodes)
        return HpaSettings(low, max(low, size.max_nodes),
                           scale_down=replace(DEFAULT_SCALE_DOWN, stabilization_s=self.scale_down_window_s))


@dataclass(frozen=True)
class Degrade:
    """At ``at`` the node ``node`` (index) slows down by ``factor`` (1 = healthy again)."""

    at: float
    node: int
    factor: float


@dataclass(frozen=True)
class Outage:
    """From ``start`` to ``end`` (virtual seconds) the node ``node`` (index) is out of service: plain
    least-request routing (the ``none`` admission) sends it no new request; what it already runs
    finishes there at its normal speed. An ideal reference's way of taking a sick node out exactly
    while it is sick (no detection delay, no false positives)."""

    start: float
    end: float
    node: int

    def covers(self, node: int, t: float) -> bool:
        return node == self.node and self.start <= t < self.end


@dataclass
class Outcome:
    """What the client saw for one trace request."""

    req: TraceRequest
    tier: str
    status: int = 0
    """200, or the rejection's status; 0 while undecided."""
    reason: str = ""
    klass: str = ""
    """policy | capacity | invalid | auth | '' (admitted)."""
    ttft: float | None = None
    e2e: float | None = None
    node: int | None = None
    decided_at: float | None = None
    pool: str = ""
    """The model pool it was routed to (``Answer.pool``; ``none``: refused before routing); '' undecided."""


@dataclass
class SimNode:
    index: int
    address: str
    engine: Engine
    provisioned_at: float
    ready_at: float
    pool: str = "default"
    """The model pool it belongs to (``ext_proc.pools.DEFAULT_POOL`` without ``pools``)."""
    served: dict[str, int] = field(default_factory=dict)
    """Requests this node was sent, by their ``model`` ('' for none): proof that a model reaches only its
    pool's nodes, counted where the requests land rather than where they were routed."""
    state: Literal["loading", "ready", "draining", "gone"] = "loading"
    stopped_at: float | None = None
    busy: bool = False
    deriver: Deriver = field(init=False)
    hist: dict[str, list[float]] = field(default_factory=dict)
    snapshot_at: float = -1.0
    snapshot: Any = None
    gpu: dict[str, Any] | None = None
    """What its probe's NVML reads (GPU name and count) in a pool of mixed nodes; None: no GPU reported
    (kvgate keeps the pool's prior, as before per-node profiles existed)."""

    def __post_init__(self) -> None:
        self.deriver = Deriver(self.address)
        self.base_profile = self.engine.profile
        """What it runs when not slowed (a ``Degrade`` of factor 1 gives it back)."""

    def observe(self, name: str, value: float) -> None:
        h = self.hist.get(name)
        if h is None:
            self.hist[name] = [value, 1.0]
        else:
            h[0] += value
            h[1] += 1.0

    def reading(self) -> EngineReading:
        e = self.engine
        s = e.scheduler
        lora: dict[str, Any] = {}
        if e.options.max_loras is not None:  # what vllm:lora_requests_info says now
            running, waiting = s.lora_requests()
            lora = {"lora_running": list(running), "lora_waiting": list(waiting), "max_lora": e.options.max_loras}
        return EngineReading(self.engine.profile.model_name, "0", kv_usage=s.kv_usage,
                             kv_metric="vllm:kv_cache_usage_perc",
                             running=float(len(s.running)), waiting=float(s.num_waiting),
                             counters={"preemptions": float(s.preemptions),
                                       "generation_tokens": float(s.generation_tokens)},
                             hist={**{k: (v[0], v[1]) for k, v in self.hist.items()},
                                   "itl": (e.itl_sum, float(e.itl_count)),
                                   "iteration": (float(e.step_tokens), float(e.steps))},
                             num_gpu_blocks=s.cfg.num_gpu_blocks, block_size=s.cfg.block_size, **lora)

    @property
    def load(self) -> int:
        s = self.engine.scheduler
        return len(s.running) + s.num_waiting


@dataclass
class PoolResult:
    """One model pool's nodes over a run."""

    name: str
    profile: str
    nodes: int
    """Its nodes at the start."""
    gpus_per_node: int
    gpu_seconds: float
    node_timeline: list[tuple[float, int]]
    """(time, nodes provisioned in this pool) at every change."""
    served: dict[str, int]
    """Requests its nodes were sent, by ``model`` ('' for a request naming none)."""


@dataclass
class RunResult:
    policy: Policy
    outcomes: list[Outcome]
    duration_s: float
    """From the first arrival to the last request's end."""
    gpu_seconds: float
    gpus_per_node: int
    node_timeline: list[tuple[float, int]]
    """(time, nodes provisioned) at every change."""
    breaker_opens: int
    lost: int
    breaker_opens_by_cause: dict[str, int] = field(default_factory=dict)
    """``breaker_opens`` split by cause (latency | kv | trial), as kvgate's core classifies them."""
    prefill_tokens_computed: int = 0
    """Prompt tokens the nodes actually prefilled: what they were asked for less their prefix-cache hits."""
    pools: dict[str, PoolResult] = field(default_factory=dict)
    """Each model pool's nodes (the one pool ``default`` without ``pools`` in the config)."""
    pooled: bool = False
    """Whether kvgate's config had ``pools`` (the report shows per-pool figures only then)."""
    lora_loads: int = 0
    """LoRA adapters the nodes loaded from disk (``Engine.lora_loads``; 0 without ``max_loras``)."""
    lora_swaps: int = 0
    """LoRA adapters the nodes copied into a GPU slot (``Engine.lora_swaps``)."""
    prediction_errors: dict[str, list[float]] = field(default_factory=dict)
    """Node profile → (predicted - actual) / actual time to the first token, measured from dispatch at the
    node, of every request kvgate placed there with a prediction (mixed-node runs only; else empty)."""


def _content(i: int, r: TraceRequest) -> Prompt | None:
    """What the node can cache of a trace request's prompt: its shared segments, then its own tokens."""
    if not r.segments:
        return None
    own = r.prompt_tokens - sum(n for _, n in r.segments)
    return Prompt.from_segments([*r.segments, *([(f"\x00r{i}", own)] if own > 0 else [])])


def _slowed(p: Profile, factor: float) -> Profile:
    return replace(p, a_ms=p.a_ms * factor, b_ms_per_prefill_token=p.b_ms_per_prefill_token * factor,
                   c_ms_per_decode_seq=p.c_ms_per_decode_seq * factor,
                   d_ms_per_context_token=p.d_ms_per_context_token * factor)


def kv_shed_config(base: Config) -> dict[str, Any]:
    """The Gateway API Inference Extension's approach on kvgate's core: KV/queue-threshold shedding and
    KV-aware picking, no tenants (every tenant unlimited and alike), no gateway queue, no breakers. With
    ``pools``, the same in each pool (the extension's InferencePool is per model too): a request still
    goes only to its model's nodes, and sheds on their KV alone."""
    def shed(nodes: dict[str, Any]) -> dict[str, Any]:
        nodes["breaker"] = {"kv_threshold": 1.0, "close_kv": 0.99, "latency_multiplier": 1e9,
                            "close_latency_multiplier": 1e9 - 1}
        nodes["prefix"] = {**(nodes.get("prefix") or {}), "enabled": False}  # KV-aware picking only
        nodes["lora"] = {**(nodes.get("lora") or {}), "enabled": False}  # an adapter is just a model name
        return nodes

    doc: dict[str, Any] = {"tenants": [{"name": t.name} for t in base.tenants], "queue": {"enabled": False}}
    if base.pools:
        pools = [p.model_dump(mode="json") for p in base.pools]
        for p in pools:
            shed(p["nodes"])
        return {**doc, "pools": pools}
    return {**doc, "nodes": shed(base.nodes.model_dump(mode="json") if base.nodes is not None else {})}


@dataclass
class SimPool:
    """One model pool in the run: its simulated nodes, and what its autoscaler keeps."""

    spec: PoolSpec
    profile: Profile
    size: PoolSize
    cold_start_s: float
    node_profiles: tuple[Profile, ...] = ()
    """Mixed nodes: the k-th node provisioned runs ``node_profiles[k % len]`` (and its probe reports its
    GPU); empty: every node runs ``profile``."""
    law: ControlLaw | None = None
    nodes: list[SimNode] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    decisions: deque[tuple[float, str, str]] = field(default_factory=deque)
    """(time, kind, tenant) for this pool's scaler window: admitted | capacity | policy, and besides those
    budget (a policy 429 for the tenant's own budget), fleet (a 429 the fleet caused), slo_miss (admitted,
    predicted to miss its TTFT target) — only of the requests routed to this pool."""
    prefill_marks: deque[tuple[float, float]] = field(default_factory=deque)
    """(time, kvgate's cumulative prefill seconds sent to this pool: ``Core.prefill_seconds``) at each scaler
    evaluation over the window: the window's difference is ``Signals.prefill_seconds``, as the scaler reads
    ``kvgate_prefill_seconds_total``'s increase."""
    hpa: Hpa | None = None
    """The ``autoscale-only`` policy's HPA (``hpa.py``), or kvgate+scaler's as the chart renders it
    (``Autoscaling.law_behind_hpa``); None otherwise."""
    next_poll: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gpus(self) -> int:
        """GPUs per node, from the profile's name (``70b-h100x4``: 4)."""
        name = self.profile.name
        return int(name.rsplit("x", 1)[1]) if "x" in name.rsplit("-", 1)[-1] else 1


class Run:
    """The event loop. Events: arrivals (from the trace), node step ends, the pump/probe tick, the
    autoscaler's tick, node start-ups and scenario events (a node slowing down). ``outages`` (plain
    least-request only) take a node out of node choice for a window; they need no event."""

    def __init__(self, config: Config, policy: Policy, profile: Profile, trace: list[TraceRequest],
                 seed: int = 0, engine: EngineOptions | None = None, autoscaling: Autoscaling | None = None,
                 cold_start_s: float | None = None, degrade: tuple[Degrade, ...] = (),
                 outages: tuple[Outage, ...] = (), node_profiles: tuple[str, ...] = ()) -> None:
        if outages and policy.admission != "none":
            raise ValueError("outages apply to plain least-request routing (admission none) only")
        self.now = 0.0
        self.policy = policy
        self.profile = profile
        self.trace = trace
        self.seed = seed
        self.auto = autoscaling or Autoscaling()
        self.cold_start_s = profile.cold_start_s if cold_start_s is None else cold_start_s
        self.degrade = sorted(degrade, key=lambda d: d.at)
        self.outages = tuple(outages)
        self.base_config = config
        self.config = config = policy.configure(config, profile.name,
                                                (engine or EngineOptions()).long_prefill_token_threshold)
        self.pooled = bool(config.pools)
        priority = policy.admission == "kvgate" and config.queue.inject_priority
        self.engine_options = replace(engine or EngineOptions(), policy="priority" if priority else "fcfs")
        base = self.base_config  # tiers for the report: the same for every policy
        self.tiers = {t.name: t.tier for t in base.tenants}
        self.outcomes = [Outcome(r, self.tiers.get(r.tenant, base.lowest_tier)) for r in trace]
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.nodes: list[SimNode] = []
        """Every pool's nodes, in the order they were provisioned (``Degrade.node``/``Outage.node`` index it)."""
        self._by_address: dict[str, SimNode] = {}
        self.node_timeline: list[tuple[float, int]] = []
        self.breaker_opens = 0
        self.transitions: list[tuple[float, str, str, str, str]] = []
        self._inflight: dict[Request, tuple[int, str | None]] = {}
        """Engine request → (outcome index, kvgate ticket)."""
        self._predicted: dict[Request, float] = {}
        """Engine request → kvgate's predicted seconds to its first token (mixed-node runs)."""
        self.prediction_errors: dict[str, list[float]] = {}
        self._held: dict[str, int] = {}
        """Request id of a queued request → outcome index."""
        self.router = Router(config, random.Random(seed))
        """kvgate's own model → pool routing (``ext_proc.pools``), for the baselines that run without its
        core and for the prefix settings of a request's pool; kvgate's core routes with its own."""
        self.pools: dict[str, SimPool] = {}
        for spec in self.router.pools:
            size = policy.size(spec.name)
            prof = profile
            if self.pooled and spec.nodes is not None and spec.nodes.performance.profile != profile.name:
                prof = get_profile(spec.nodes.performance.profile)
            cold = prof.cold_start_s if cold_start_s is None else cold_start_s
            law = None
            if policy.autoscale == "scaler":
                # (straight to the fleet, the law's count is applied as it is: no HPA tolerance to clear)
                law = ControlLaw(replace(self.auto.law, min_replicas=size.min_nodes, max_replicas=size.max_nodes,
                                         cold_start_s=cold, window_s=self.auto.window_s,
                                         hpa_tolerance=self.auto.law.hpa_tolerance if self.auto.law_behind_hpa
                                         else 0.0))
            hpa = None
            if policy.autoscale == "queue":
                hpa = Hpa(self.auto.hpa(size))
            elif law is not None and self.auto.law_behind_hpa:
                hpa = Hpa(self.auto.chart_hpa(size))
            self.pools[spec.name] = SimPool(spec, prof, size, cold, law=law, hpa=hpa,
                                            node_profiles=tuple(get_profile(name) for name in node_profiles))
        self.core: Core | None = None
        if policy.admission != "none":
            if config.nodes is None and not config.pools:
                raise ValueError("the scenario's kvgate config needs a nodes section")
            self.core = Core(config, lambda: self.now, rng=random.Random(seed), log=null_logger(),
                             on_transition=self._transition)
        start = trace[0].t if trace else 0.0
        for pool in self.pools.values():
            for _ in range(pool.size.nodes):
                self._provision(pool, ready=True)
            pool.timeline = [(start, pool.size.nodes)]
        self.node_timeline = [(start, sum(p.size.nodes for p in self.pools.values()))]

    @property
    def law(self) -> ControlLaw | None:
        """The first pool's control law (the only one without ``pools``)."""
        return next(iter(self.pools.values())).law

    # -- nodes -------------------------------------------------------------------------------------

    def _provision(self, pool: SimPool, ready: bool = False) -> SimNode:
        i = len(self.nodes)
        opts = replace(self.engine_options, seed=self.seed * 1000 + i)
        address = f"{pool.name}-{i}:8000" if self.pooled else f"node-{i}:8000"
        prof = pool.node_profiles[len(pool.nodes) % len(pool.node_profiles)] if pool.node_profiles else pool.profile
        n = SimNode(i, address, Engine(prof, opts), self.now,
                    self.now if ready else self.now + pool.cold_start_s, pool=pool.name,
                    gpu={"name": f"NVIDIA {prof.gpu}", "count": prof.gpus} if pool.node_profiles else None)
        n.engine.every_token = False
        self.nodes.append(n)
        pool.nodes.append(n)
        self._by_address[n.address] = n
        if ready:
            self._ready(n)
        else:
            self._push(n.ready_at, "ready", n)
        self._timeline(pool)
        return n

    def _ready(self, n: SimNode) -> None:
        if n.state != "loading":
            return
        n.state = "ready"
        self._sync_fleet(self.pools[n.pool])
        if self.core is not None:  # the probe's first reading arrives with the node
            self._probe(n)

    def _retire(self, pool: SimPool, count: int) -> None:
        """Remove ``count`` of the pool's nodes: loading ones first (cancelled), then the least loaded
        ready ones, which drain before they stop."""
        for n in sorted((n for n in pool.nodes if n.state in ("loading", "ready")),
                        key=lambda n: (n.state != "loading", n.load))[:count]:
            if n.state == "loading":
                n.state, n.stopped_at = "gone", self.now
            else:
                n.state = "draining"
                self._maybe_gone(n)
        self._sync_fleet(pool)
        self._timeline(pool)

    def _maybe_gone(self, n: SimNode) -> None:
        if n.state == "draining" and not n.engine.scheduler.has_work() and not n.busy:
            n.state, n.stopped_at = "gone", self.now
            self._timeline(self.pools[n.pool])

    def _sync_fleet(self, pool: SimPool) -> None:
        """The pool's ready nodes, as its discovery would tell kvgate (``Core.set_nodes`` per pool)."""
        if self.core is not None:
            self.core.set_nodes([(n.address, f"http://{n.address}", None) for n in pool.nodes if n.state == "ready"],
                                pool.name)
            self._answers()

    def _timeline(self, pool: SimPool) -> None:
        count = sum(1 for n in self.nodes if n.state != "gone")
        if not self.node_timeline or self.node_timeline[-1][1] != count:
            self.node_timeline.append((self.now, count))
        mine = sum(1 for n in pool.nodes if n.state != "gone")
        if not pool.timeline or pool.timeline[-1][1] != mine:
            pool.timeline.append((self.now, mine))

    def _transition(self, node: str, old: Any, new: Any, why: str) -> None:
        self.transitions.append((self.now, node, old.value, new.value, why))
        if new.value == "open":
            self.breaker_opens += 1

    @property
    def breaker_opens_by_cause(self) -> dict[str, int]:
        """``breaker_opens`` by cause, as kvgate's core counts them for its metric (``open_cause``)."""
        core = self.core
        return {c: core.breaker_opens.get(c, 0) if core is not None else 0 for c in BREAKER_CAUSES}

    def _probe(self, n: SimNode) -> None:
        if self.now - n.snapshot_at >= PROBE_INTERVAL_S - 1e-9:
            n.snapshot = n.deriver.update({(n.engine.profile.model_name, "0"): n.reading()}, self.now, n.gpu)
            n.snapshot_at = self.now
        assert self.core is not None
        self.core.snapshot(n.address, n.snapshot, self.now - n.snapshot_at)

    # -- events ------------------------------------------------------------------------------------

    def _push(self, t: float, kind: str, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, arg))

    def _kick(self, n: SimNode) -> None:
        if n.busy:
            return
        dt = n.engine.begin_step(self.now)
        if dt is not None:
            n.busy = True
            self._push(self.now + dt, "step", n)

    def _send(self, i: int, n: SimNode, ticket: str | None, predicted: float | None = None) -> None:
        o = self.outcomes[i]
        r = o.req
        tier = self.config.tiers.get(o.tier)
        prio = 0
        if tier is not None and self.engine_options.policy == "priority":
            prio = tier.vllm_priority if tier.vllm_priority is not None else tier.priority
        lora = r.model if r.model is not None and r.model in self.pools[n.pool].spec.adapters else None
        sreq = Request(f"r{i}", r.prompt_tokens, r.output_tokens, self.now, priority=prio, content=_content(i, r),
                       lora=lora)
        n.engine.add(sreq)
        model = r.model or ""
        n.served[model] = n.served.get(model, 0) + 1
        self._inflight[sreq] = (i, ticket)
        if predicted is not None and n.gpu is not None:
            self._predicted[sreq] = predicted
        o.status, o.node, o.decided_at = 200, n.index, self.now
        self._kick(n)

    def _reject(self, i: int, status: int, reason: str, klass: str, pool: SimPool | None) -> None:
        """Refuse request ``i``; a refusal that wanted ``pool``'s capacity goes into its scaler window."""
        o = self.outcomes[i]
        o.status, o.reason, o.klass, o.decided_at = status, reason, klass, self.now
        if pool is None:
            return
        if klass in ("capacity", "policy"):
            pool.decisions.append((self.now, klass, o.req.tenant))
        if klass == "policy" and reason in BUDGET_REASONS:
            pool.decisions.append((self.now, "budget", o.req.tenant))

    def _arrive(self, i: int) -> None:
        o = self.outcomes[i]
        r = o.req
        if self.core is None:
            spec = self.router.route(r.model)
            if spec is None:  # nobody serves the model: what kvgate answers too, a 404 that is no capacity
                o.pool = NO_POOL
                self._reject(i, 404, "model-not-found", "invalid", None)
                return
            pool = self.pools[spec.name]
            o.pool = pool.name
            ready = [n for n in pool.nodes if n.state == "ready" and not self._out(n)]
            if not ready:
                self._reject(i, 503, "no-node", "capacity", pool)
                return
            self._send(i, min(ready, key=lambda n: n.load), None)  # plain Envoy's least-request
            pool.decisions.append((self.now, "admitted", r.tenant))
            return
        est = Estimate(r.prompt_tokens, r.reserved_output, parsed=True, stream=r.stream,
                       prefix=self._prefix_chain(r), model=r.model)
        req = GatewayRequest("/v1/chat/completions", f"r{i}", f"Bearer {run_key(r.tenant)}",
                      estimate=est, body_bytes=r.prompt_tokens * CHARS_PER_TOKEN + 200)
        out = self.core.decide(req)
        if isinstance(out, Held):
            self._held[out.request_id] = i
        else:
            assert isinstance(out, Answer), "one process, no store: nothing to borrow"
            self._decided(i, out)
        self._answers()

    def _prefix_chain(self, r: TraceRequest) -> tuple[int, ...]:
        """kvgate's view of a trace request's prefix (no text in virtual time: its segments), with the
        prefix settings of the pool that serves its model."""
        if not r.segments:
            return ()
        specs = self.router.pools[:1] if self.router.single else self.router.candidates(r.model or "")
        nodes: Nodes | None = specs[0].nodes if specs else None
        if nodes is None or not nodes.prefix.enabled:
            return ()
        return segment_chain(r.segments, nodes.prefix.max_blocks_per_request, nodes.prefix.block_tokens)

    def _out(self, n: SimNode) -> bool:
        """Out of service now (an ``Outage``)."""
        return any(o.covers(n.index, self.now) for o in self.outages)

    def _answers(self) -> None:
        """Requests the core decided out of its queue."""
        assert self.core is not None
        a: Answer
        for a in self.core.answers():
            i = self._held.pop(a.request_id, None)
            if i is not None:
                self._decided(i, a)

    def _decided(self, i: int, a: Answer) -> None:
        """kvgate's answer for request ``i``, at once or out of its queue: send it or refuse it. What it
        means for capacity goes into the scaler window of the pool kvgate routed it to, and only that
        pool's (``Answer.pool``; ``none``, refused before routing, is no pool's demand)."""
        d = a.decision
        o = self.outcomes[i]
        o.pool = a.pool
        pool = self.pools.get(a.pool)
        tenant = o.req.tenant
        if d.admitted:
            assert d.lease is not None and d.lease.node is not None
            self._send(i, self._by_address[d.lease.node], d.lease.ticket, d.lease.predicted_ttft)
            if pool is not None and d.best_effort is None:  # best effort is never scaling demand
                pool.decisions.append((self.now, "admitted", tenant))
                if d.lease.slo_miss:
                    pool.decisions.append((self.now, "slo_miss", tenant))
                if a.waited_for_room:  # (kvgate_queue_waited_for_room_total)
                    pool.decisions.append((self.now, "waited", tenant))
        else:
            assert d.rejection is not None
            self._reject(i, d.rejection.status, d.rejection.reason, d.rejection.klass, pool)
            if d.rejection.fleet_caused and pool is not None:
                pool.decisions.append((self.now, "fleet", tenant))

    def _step_end(self, n: SimNode) -> None:
        n.busy = False
        events = n.engine.end_step(self.now)
        done = False
        for ev in events:
            if not ev.finished:
                continue
            req = ev.request
            i, ticket = self._inflight.pop(req)
            o = self.outcomes[i]
            assert req.first_token is not None and req.finished_at is not None
            o.ttft, o.e2e = req.first_token - o.req.t, req.finished_at - o.req.t
            predicted = self._predicted.pop(req, None)
            if predicted is not None:
                actual = req.first_token - req.arrival
                if actual > 0:
                    errors = self.prediction_errors.setdefault(n.base_profile.name, [])
                    errors.append((predicted - actual) / actual)
            n.observe("e2e", req.finished_at - req.arrival)
            n.observe("request_prompt", float(req.prompt_tokens))
            n.observe("ttft", req.first_token - req.arrival)
            if req.first_scheduled is not None:
                n.observe("queue", req.first_scheduled - req.arrival)
                if req.prefill_done_at is not None:
                    n.observe("prefill", req.prefill_done_at - req.first_scheduled)
            if self.core is not None and ticket is not None:
                self.core.ended(Ended(ticket, f"r{i}", 200, Usage(req.prompt_tokens, req.output_tokens),
                                      upstream_answered=True))
                done = True
        self._kick(n)
        self._maybe_gone(n)
        if done:
            self._answers()

    def _tick(self) -> None:
        if self.core is not None:
            for pool in self.pools.values():  # each pool's probes at its own nodes.poll_interval_seconds
                if pool.next_poll <= self.now + 1e-9:
                    for n in pool.nodes:
                        if n.state == "ready":
                            self._probe(n)
                    cfg = pool.spec.nodes
                    pool.next_poll = self.now + (cfg.poll_interval_seconds if cfg is not None else 0.25)
            self.core.tick()
            self._answers()

    def _scale(self, pool: SimPool) -> None:
        """One autoscaler evaluation of one pool, on that pool's own signals."""
        ready = [n for n in pool.nodes if n.state == "ready"]
        provisioned = sum(1 for n in pool.nodes if n.state in ("loading", "ready"))
        if self.policy.autoscale == "queue":
            # KEDA on vLLM's queue depth (AverageValue): the HPA's replica rules (``hpa.py``)
            assert pool.hpa is not None
            waiting = sum(n.engine.scheduler.num_waiting for n in ready)
            kv_sum = sum(n.engine.scheduler.kv_usage for n in ready)
            tol = pool.hpa.settings.tolerance
            # two triggers, as a tuned ScaledObject has: the HPA takes the larger recommendation
            want = max(metric_replicas(waiting, self.auto.waiting_per_node, provisioned, tol),
                       metric_replicas(kv_sum, self.auto.kv_usage_per_node, provisioned, tol))
            target = pool.hpa.decide(self.now, provisioned, want)
        else:
            assert pool.law is not None and self.core is not None
            horizon = self.now - self.auto.window_s
            while pool.decisions and pool.decisions[0][0] < horizon:
                pool.decisions.popleft()
            by: dict[str, dict[str, float]] = {k: {} for k in KINDS}
            for _, kind, tenant in pool.decisions:
                by[kind][tenant] = by[kind].get(tenant, 0.0) + 1
            kv = [n.engine.scheduler.kv_usage for n in ready]  # what kvgate_node_kv_usage_ratio reports
            held = float(len(self.core.admission.queue_of(pool.name)))  # kvgate_queue_depth_requests{pool}
            marks = pool.prefill_marks  # (kvgate_prefill_seconds_total's increase over the window)
            marks.append((self.now, self.core.prefill_seconds.get(pool.name, 0.0)))
            while len(marks) > 1 and marks[1][0] <= horizon:
                marks.popleft()
            sig = Signals(self.now, by["admitted"], by["capacity"], by["policy"], held,
                          len(ready), True, fleet_caused=by["fleet"], budget_rejected=by["budget"],
                          slo_missed=by["slo_miss"], kv_usage=sum(kv) / len(kv) if kv else None,
                          waited=sum(by["waited"].values()), prefill_seconds=marks[-1][1] - marks[0][1])
            target = pool.law.decide(sig, self.now).desired
            if pool.hpa is not None:  # behind the chart's HPA: its tolerance, step and scale-down window
                target = pool.hpa.decide(self.now, provisioned, chart_metric(target, provisioned,
                                                                             pool.hpa.settings.tolerance))
        if target > provisioned:
            for _ in range(target - provisioned):
                self._provision(pool)
        elif target < provisioned:
            self._retire(pool, provisioned - target)

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> RunResult:
        arrivals = self.trace
        k = 0
        start = arrivals[0].t if arrivals else 0.0
        self.now = start
        for pool in self.pools.values():
            pool.next_poll = start
        self._push(start, "tick")
        if self.policy.autoscale != "none":
            self._push(start + self.auto.interval_s, "scale")
        for d in self.degrade:
            self._push(d.at, "degrade", d)
        end_of_trace = arrivals[-1].t if arrivals else start
        while True:
            nxt = arrivals[k].t if k < len(arrivals) else math.inf
            if self._events and self._events[0][0] <= nxt:
                t, _, kind, arg = heapq.heappop(self._events)
                self.now = t
                if kind == "step":
                    self._step_end(arg)
                elif kind == "tick":
                    self._tick()
                    if self._busy() or k < len(arrivals):
                        self._push(t + PUMP_INTERVAL_S, "tick")
                elif kind == "scale":
                    for pool in self.pools.values():  # KEDA polls every pool's ScaledObject
                        self._scale(pool)
                    if t < end_of_trace or self._busy():
                        self._push(t + self.auto.interval_s, "scale")
                elif kind == "ready":
                    self._ready(arg)
                elif kind == "degrade" and arg.node < len(self.nodes):
                    n = self.nodes[arg.node]
                    n.engine.profile = _slowed(n.base_profile, arg.factor)
                continue
            if nxt == math.inf:
                break
            self.now = nxt
            self._arrive(k)
            k += 1
        last = max([o.decided_at or 0.0 for o in self.outcomes] + [
            (o.req.t + o.e2e) for o in self.outcomes if o.e2e is not None] + [start])
        for n in self.nodes:  # what is still up is billed until the run's end, not a later autoscaler tick
            if n.state != "gone":
                n.stopped_at = last
        pools: dict[str, PoolResult] = {}
        for pool in self.pools.values():
            node_s = sum(min(n.stopped_at or last, last) - n.provisioned_at for n in pool.nodes)
            served: dict[str, int] = {}
            for n in pool.nodes:
                for model, count in n.served.items():
                    served[model] = served.get(model, 0) + count
            pools[pool.name] = PoolResult(pool.name, pool.profile.name, pool.size.nodes, pool.gpus,
                                          node_s * pool.gpus, list(pool.timeline), served)
        gpu_s = sum(p.gpu_seconds for p in pools.values())
        lost = sum(1 for o in self.outcomes if o.status == 0 or (o.status == 200 and o.e2e is None))
        computed = sum(n.engine.scheduler.prefix_queries + n.engine.scheduler.preempted_prefix_queries
                       - n.engine.scheduler.prefix_hits - n.engine.scheduler.preempted_prefix_hits for n in self.nodes)
        first = next(iter(self.pools.values()))
        return RunResult(self.policy, self.outcomes, last - start, gpu_s, first.gpus, self.node_timeline,
                         self.breaker_opens, lost, dict(self.breaker_opens_by_cause), computed, pools, self.pooled,
                         sum(n.engine.lora_loads for n in self.nodes), sum(n.engine.lora_swaps for n in self.nodes),
                         self.prediction_errors)

    def _busy(self) -> bool:
        return bool(self._inflight or self._held)


def simulate(config: Config, policy: Policy, profile: Profile, trace: list[TraceRequest], seed: int = 0,
             **kw: Any) -> RunResult:
    return Run(config, policy, profile, trace, seed, **kw).run()

