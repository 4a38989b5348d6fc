"""The built-in scenarios: the field guide's three cases, each a generated trace (fixed seed), a kvgate
config and the policies compared side by side. Every parameter is here, in one place, and printed
with the results; the README says where and why they differ from the guide's own figures."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ext_proc.config import Config
from scaler.law import LawSettings

from .driver import Autoscaling, Degrade, Outage, Policy
from .trace import TraceRequest

Rate = Callable[[float], float]
"""Requests per second at time t."""


@dataclass(frozen=True)
class Shape:
    """Request sizes: lognormal around a median, clipped."""

    prompt_median: int
    prompt_range: tuple[int, int]
    output_median: int
    output_range: tuple[int, int]
    sigma: float = 0.5

    def draw(self, rng: random.Random) -> tuple[int, int]:
        def one(median: int, lo_hi: tuple[int, int]) -> int:
            return int(min(lo_hi[1], max(lo_hi[0], round(median * rng.lognormvariate(0.0, self.sigma)))))

        return one(self.prompt_median, self.prompt_range), one(self.output_median, self.output_range)


SHORT = Shape(250, (32, 1024), 120, (16, 400))
"""A chat turn or a classification call."""
LONG = Shape(3000, (1500, 6000), 300, (100, 800))
"""A RAG request: retrieved context in the prompt, a long answer."""


@dataclass(frozen=True)
class Stream:
    """One tenant's traffic: Poisson arrivals at ``rate(t)``."""

    tenant: str
    shape: Shape
    rate: Rate
    max_tokens: int | None = None
    """What the client asks for (the reservation); default: the real output."""
    stream_share: float = 0.5


def poisson(streams: list[Stream], duration_s: float, seed: int) -> list[TraceRequest]:
    """Non-homogeneous Poisson arrivals by thinning, one RNG per stream (adding a stream does not
    change the others' requests)."""
    return thinned(streams, duration_s, seed,
                   lambda s: max(s.rate(t) for t in [duration_s * i / 200 for i in range(201)]) or 1e-9)


def thinned(streams: Sequence[Stream], end: float, seed: int, peak_of: Callable[[Stream], float]
            ) -> list[TraceRequest]:
    """Arrivals up to ``end`` by thinning each stream's rate against ``peak_of(stream)`` (an upper bound of
    its rate; a stream whose bound is not positive sends nothing), one RNG per stream."""
    out: list[TraceRequest] = []
    for k, s in enumerate(streams):
        rng = random.Random(seed * 7919 + k)
        peak = peak_of(s)
        if peak <= 0:
            continue
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= end:
                break
            if rng.random() * peak > s.rate(t):
                continue
            prompt, output = s.shape.draw(rng)
            out.append(TraceRequest(round(t, 6), s.tenant, prompt, output, rng.random() < s.stream_share,
                                    max(output, s.max_tokens) if s.max_tokens else None))
    out.sort(key=lambda r: r.t)
    return out


def const(r: float) -> Rate:
    return lambda t: r


@dataclass(frozen=True)
class Ideal:
    """A scenario's reference row, run beside its policies over the same trace: policy ``none`` (plain
    least-request) on ``nodes`` nodes *without* the scenario's disturbance — no ``degrade`` events, and
    only the requests ``tiers`` keeps, with ``out`` taking nodes out of node choice. Labelled
    ``ideal (N nodes)``; not a policy anyone can deploy, the bar the policies are read against."""

    nodes: int
    tiers: tuple[str, ...] | None = None
    """Offer only the requests of tenants in these SLA tiers (None: the whole trace). The other tenants
    are not offered at all, so the row's figures (SLO, latency, Jain) are over the kept tenants alone."""
    out: tuple[Outage, ...] = ()
    """Nodes out of service, each for a window (scaled with ``--scale`` as ``degrade`` is)."""

    @property
    def policy(self) -> Policy:
        return Policy("ideal", self.nodes, ideal=True)

    def tenants(self, config: Config, trace: list[TraceRequest]) -> tuple[list[str], list[str]]:
        """(kept, removed) tenants of ``trace``; a tenant the config lacks counts in its lowest tier, as
        the driver reports it."""
        names = sorted({r.tenant for r in trace})
        if self.tiers is None:
            return names, []

        def tier(name: str) -> str:
            t = config.tenant(name)
            return t.tier if t is not None else config.lowest_tier

        kept = [n for n in names if tier(n) in self.tiers]
        return kept, [n for n in names if n not in kept]

    def offered(self, config: Config, trace: list[TraceRequest]) -> list[TraceRequest]:
        kept = set(self.tenants(config, trace)[0])
        return [r for r in trace if r.tenant in kept]

    def scaled(self, scale: float) -> tuple[Outage, ...]:
        return tuple(replace(o, start=o.start * scale, end=o.end * scale) for o in self.out)

    def describe(self, config: Config, trace: list[TraceRequest], scale: float = 1.0) -> str:
        kept, removed = self.tenants(config, trace)
        what = []
        if removed:
            what.append(f"only the {' / '.join(self.tiers or ())} tier's tenants ({', '.join(kept) or 'none'}) "
                        f"are offered; {', '.join(removed)}'s requests are removed from the trace, so the row's "
                        f"SLO and latency figures are over {', '.join(kept) or 'nothing'} alone")
        for o in self.scaled(scale):
            what.append(f"node {o.node} is out of service from {o.start:g} s to {o.end:g} s (it takes no new "
                        "request and is not slowed: what it runs finishes at normal speed), in again after")
        return (f"*{self.policy.label}*: policy none (least-request) without the disturbance"
                + (": " + "; ".join(what) if what else "") + ". A reference to read the policies against.")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    about: str
    profile: str
    duration_s: float
    config: dict[str, Any]
    """kvgate's config for the `kvgate` policies (and the tenants/tiers everything is reported by)."""
    policies: tuple[Policy, ...]
    streams: tuple[Stream, ...]
    seed: int = 1
    degrade: tuple[Degrade, ...] = ()
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    cold_start_s: float | None = None
    guide: str = ""
    """What the field guide reports for this case."""
    ideal: Ideal | None = None
    """The reference row (policy none without the disturbance); None: the scenario has no disturbance."""

    def trace(self, scale: float = 1.0) -> list[TraceRequest]:
        """The scenario's requests; ``scale`` < 1 shortens the run (tests)."""
        return poisson(list(self.streams), self.duration_s * scale, self.seed)


PLACEHOLDER_NODES = {"static": [{"address": "node-0:8000", "probe": "http://node-0:9102"}]}
"""Replaced by the driver's nodes; the section turns node choice on."""


def _noisy_neighbour() -> Scenario:
    # Two chat tenants (interactive) and a RAG pipeline (standard tier) that floods: 60% short and
    # 40% long requests by count, as in the guide. Rate scaled to a 34B on A100s (see README).
    rate = 5.0
    streams = (
        Stream("chat-a", SHORT, const(rate * 0.3)),
        Stream("chat-b", SHORT, const(rate * 0.3)),
        Stream("rag", LONG, const(rate * 0.4), max_tokens=1024),
    )
    config = {
        "tenants": [
            {"name": "chat-a", "tier": "interactive", "weight": 1},
            {"name": "chat-b", "tier": "interactive", "weight": 1},
            # its quota: about what 2 nodes can give it beside the chat traffic
            {"name": "rag", "tier": "standard", "tokens_per_minute": 120_000, "token_burst": 20_000,
             "max_concurrent": 4},
        ],
        "queue": {"inject_priority": True},
        "nodes": PLACEHOLDER_NODES,
    }
    return Scenario(
        "noisy-neighbour", "Noisy neighbour: one RAG tenant floods a shared 34B fleet",
        "34B model (34b-a100 profile), chat-a + chat-b: short requests (60%), rag: long requests "
        f"(40%), {rate:g} req/s in all for 300 s. kvgate on 2 nodes against no admission on 2, 4 and 8.",
        "34b-a100", 300.0, config,
        (Policy("none", 2), Policy("none", 4), Policy("none", 8),
         Policy("kv-shed", 2, "kv-shed"), Policy("kvgate", 2, "kvgate")),
        streams,
        guide="34B on A100 80GB, 60% short / 40% long at 200 req/s: p99 2.1 s on 4 nodes, 1.8 s on 8, "
              "340 ms with admission control on 2.",
        ideal=Ideal(2, tiers=("interactive",)),  # the chat tenants alone on the same fleet: no flood
    )


def _overload() -> Scenario:
    # Three 8B/H100 nodes at about 55% of what they can serve; at t=60 s node 0 slows to a sixth of
    # its speed (a throttling GPU, a noisy host) for 150 s: its KV fills and its latency climbs.
    rate = 55.0
    streams = (
        Stream("app", SHORT, const(rate * 0.85)),
        Stream("docs", LONG, const(rate * 0.15), max_tokens=1024),
    )
    config = {
        "tenants": [{"name": "app", "tier": "interactive"}, {"name": "docs", "tier": "standard"}],
        "queue": {"inject_priority": True},
        "nodes": {**PLACEHOLDER_NODES, "breaker": {"recovery_window_seconds": 20}},
    }
    return Scenario(
        "overload", "Overload: one node's KV fills and its latency climbs",
        f"8B model (8b-h100 profile), 3 nodes, {rate:g} req/s (85% short for tenant app, 15% long for docs), "
        "300 s; node 0 runs 6x slower from 60 s to 210 s.",
        "8b-h100", 300.0, config,
        (Policy("none", 3), Policy("kv-shed", 3, "kv-shed"), Policy("kvgate", 3, "kvgate")),
        streams, degrade=(Degrade(60.0, 0, 6.0), Degrade(210.0, 0, 1.0)),
        guide="a circuit breaker on KV and latency took p99 from 6.2 s to 480 ms at peak.",
        ideal=Ideal(3, out=(Outage(60.0, 210.0, 0),)),  # node 0 out exactly while it is slow, not slowed
    )


def _diurnal() -> Scenario:
    # A day compressed into 20 minutes: a trough at 25% of the peak, business hours at the peak, and
    # a 2x burst for 60 s on top. Autoscalers start from one node.
    day = 1200.0
    peak = 20.0

    def level(t: float) -> float:
        base = peak * (0.625 - 0.375 * math.cos(2 * math.pi * t / day))
        return base * (2.0 if 750.0 <= t < 810.0 else 1.0)

    streams = (
        Stream("web", SHORT, lambda t: level(t) * 0.7),
        Stream("api", SHORT, lambda t: level(t) * 0.2),
        Stream("batch", LONG, lambda t: level(t) * 0.1, max_tokens=1024),
    )
    config = {
        "tenants": [{"name": "web", "tier": "interactive"}, {"name": "api", "tier": "standard"},
                    {"name": "batch", "tier": "batch", "max_concurrent": 8}],
        "queue": {"inject_priority": True},
        "nodes": PLACEHOLDER_NODES,
    }
    auto = Autoscaling(law=LawSettings(min_replicas=1, max_replicas=12, step=2, scale_up_threshold=0.10,
                                       scale_down_threshold=0.02, cooldown_s=120.0, warm_pool=1))
    return Scenario(
        "diurnal", "Diurnal load and a burst: autoscaling with cold starts",
        f"34B model (34b-h100 profile, 60 s cold start), a {day / 60:g}-minute day between {peak * 0.25:g} and "
        f"{peak:g} req/s (web 70% and api 20% short, batch 10% long), a 2x burst for 60 s at the peak. "
        "Static fleets against autoscaling on vLLM's queue depth (KEDA on num_requests_waiting) and "
        "kvgate + its scaler (warm pool 1, cooldown 2 min for the compressed day).",
        "34b-h100", day, config,
        (Policy("none", 6), Policy("none", 8), Policy("autoscale-only", 1, autoscale="queue", max_nodes=12),
         Policy("kvgate", 6, "kvgate"),
         Policy("kvgate+scaler", 1, "kvgate", autoscale="scaler", max_nodes=12)),
        streams, autoscaling=auto,
        guide="admission control and batch composition met the same p95 on 8 H100s instead of 12.",
    )


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "noisy-neighbour": _noisy_neighbour,
    "overload": _overload,
    "diurnal": _diurnal,
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]()
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
