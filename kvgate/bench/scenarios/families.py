"""``kvgate bench families``: generated workload families, traffic nobody tuned kvgate for.

The three built-in scenarios (``workloads.py``) are the field guide's cases, each hand-set. A family is
a *generator*: for a (family, seed) it draws a whole case (tenants, their tiers and traffic, a model
profile, a small static fleet, an offered load, kvgate's config) and every policy runs over the same
trace through the production path (``runner.run`` → ``driver.simulate``). Several seeds per family
give a median and a worst case instead of one hand-picked figure. Deterministic: one
``random.Random`` per (family, seed), never the global one; the same (family, seed) always gives the
same scenario and the same trace.

Families (the names are an interface; they stay):

* ``bursty-onoff`` — each tenant alternates on and off periods of random (exponential) lengths;
* ``bursty-mmpp`` — each tenant a Markov-modulated Poisson process: 2-3 rate states, random switching;
* ``diurnal`` — a day compressed into the run (trough at start and end, peak mid-run; batch tenants in
  anti-phase, as night jobs) and a burst of 1.5-3x for 30-90 s on the interactive and standard tenants;
* ``mixed`` — each tenant's share of long requests shifts over the run (piecewise linear), so the mix of
  short and long prompts the fleet sees changes under a steady request rate;
* ``shared-prefix`` — prompts that share prefixes (``workloads.SharedPrefixes``, the generator of the
  pinned ``shared-prefix`` scenario): chat sessions whose history grows, RAG questions over shared
  documents, one-off jobs, a system prompt per tenant; its parameters drawn per seed (below).

What every seed of the first four draws (``family``):

* 2-5 tenants over the tiers interactive / standard / batch, at least one interactive (with three or
  more, each tier at least once), named ``chat-N`` / ``api-N`` / ``batch-N``, each with a share of the
  requests (lognormal weights) and of long requests (interactive 0-10%, standard 10-50%, batch 40-90%);
  requests are ``workloads.SHORT`` or ``workloads.LONG`` (long ones reserve ``max_tokens: 1024``
  outside the interactive tier);
* the profile, rotating over ``8b-h100``, ``34b-h100``, ``70b-h100x4`` with the seed (and the family,
  so one seed gives each family a different one): three seeds cover the three;
* a static fleet of 2-4 nodes, a run of 300-600 s (whole 30 s), and an offered load of 60-110% of the
  fleet's estimated capacity (``node_capacity_rps``), averaged over the run (bursts go above it);
* kvgate's config: the tenants with their tiers; every batch tenant a ``max_concurrent`` sized as
  ``docs/concepts/tenants.md``'s "Sizing ``max_concurrent``" says (its peak request rate x its requests'
  duration on a healthy node x 1.5-2.5, at least 4) that stretches with the fleet's slowdown up to
  ``STRETCH`` (``tenants[i].max_concurrent_stretch``: the cap is sized on a healthy fleet); half the
  standard tenants ``tokens_per_minute`` of 1.5-3x their mean demand (two significant figures); no vLLM
  priority in the bodies (``queue.inject_priority`` at its default, false: ``docs/guides/vllm-settings.md``
  says why); every protective limit best effort (``best_effort: {default: best-effort}``, the same for
  every seed: a quota protects, it does not refuse what the fleet has spare room for —
  ``docs/guides/best-effort.md``); the nodes placeholder (``PLACEHOLDER_NODES``).

What a ``shared-prefix`` seed draws (``_shared_prefix``): the profile, the fleet, the run and the offered
load as above, then ``SharedPrefixes``' parameters:

* a system prompt of 200-3,000 tokens (whole hundreds) for every tenant;
* chat: sessions of 1-3 to 4-12 turns (the longest cut to what fits in 80% of the run at the mean turn
  gap), think times from 3-15 s to that + 10-60 s; a session stops before a turn that would not fit the
  model's context (``max_model_len``: 16k tokens on the 34B);
* RAG: 10-50% of the requests, over 5-50 documents of 1,000-3,000 to that + 1,000-5,000 tokens (whole
  hundreds), Zipf popularity with an exponent of 0.6-1.4;
* jobs: 5-30% of the requests; chat has the rest;
* the number of sessions: what brings the trace to the drawn load by ``workloads.offered_load``, the
  same yardstick as ``node_capacity_rps`` with no prefix-cache hit (hits make the real load lower);
* the tenants ``chat`` (interactive), ``rag`` (standard) and ``api`` (batch), without quotas, as in the
  pinned scenario (where the prefixes are cached is the point); no vLLM priority, as above.

A tenant's long requests (``long_share``) are, in this family, its prompts of ``LONG``'s median (3,000
tokens) or more: the system prompt alone takes most prompts past ``SHORT``'s longest.

Policies (default: all five): ``none``, ``kv-shed`` and ``kvgate`` on the drawn fleet;
``autoscale-only`` and ``kvgate+scaler`` start at that fleet, between 1 and min(16, 3x) nodes, with
``kvgate scaler``'s default law except a 120 s cooldown (runs are 5-10 minutes: the default 10-minute
cooldown would never scale down).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from ext_proc.profiles import Profile, get_profile

from . import report, targets
from .runner import BenchConfig, PolicyName, ScalerSettings, ScenarioResult, run
from .trace import TraceRequest
from .workloads import (
    CHAT_TURN,
    LONG,
    PLACEHOLDER_NODES,
    RESPONSE_S,
    RESPONSE_S_PER_TOKEN,
    SHORT,
    Rate,
    Scenario,
    Shape,
    SharedPrefixes,
    Stream,
    offered_load,
    thinned,
    working_set,
)

FAMILIES: dict[str, str] = {
    "bursty-onoff": "tenants alternating on/off periods of random lengths",
    "bursty-mmpp": "Markov-modulated Poisson: 2-3 rate states per tenant, random switching",
    "diurnal": "a compressed day (batch in anti-phase) and a burst on the interactive and standard tenants",
    "mixed": "each tenant's short/long prompt mix shifts over the run",
    "shared-prefix": "chat sessions whose history grows, RAG over shared documents, a system prompt per tenant",
}
"""Family name → what it is. The names are an interface (CLI, JSON): keep them stable."""

FAMILY_PROFILES = ("8b-h100", "34b-h100", "70b-h100x4")
POLICIES: tuple[PolicyName, ...] = ("none", "kv-shed", "kvgate", "autoscale-only", "kvgate+scaler")
TIERS = ("interactive", "standard", "batch")
PREFIX = {"interactive": "chat", "standard": "api", "batch": "batch"}
LONG_SHARE = {"interactive": (0.0, 0.1), "standard": (0.1, 0.5), "batch": (0.4, 0.9)}
"""Range of a tenant's share of long requests, by tier (``mixed``: the range its share moves in)."""
LONG_MAX_TOKENS = 1024
SCALER = ScalerSettings(cooldown_s=120.0)
STRETCH = 2.0
"""Every batch tenant's ``max_concurrent_stretch`` (the same for every seed): its cap is sized on a healthy fleet's
durations, as ``docs/concepts/tenants.md`` advises, so while the fleet serves it slower (and it sends no faster
than its cap allows) the cap follows, up to twice."""
GRID_S = 0.25
"""Step of the grid rates are integrated and their peak found on (piecewise-constant segments last
at least ``MIN_SEGMENT_S``, so none falls between two points)."""
MIN_SEGMENT_S = 2.0
WINDOW_S = report.JAIN_WINDOW_S

METRICS: dict[str, tuple[str, bool]] = {
    "interactive_slo": ("interactive SLO", True),
    "slo": ("SLO (all)", True),
    "goodput_per_gpu": ("goodput/GPU", True),
    "gpu_hours": ("GPU-h", False),
    "jain": ("Jain", True),
    "jain_60s_mean": ("Jain 60 s mean", True),
    "jain_60s_min": ("Jain 60 s worst", True),
    "ttft_p50": ("TTFT p50 (s)", False),
    "ttft_p99": ("TTFT p99 (s)", False),
    "prefill_tokens_computed": ("prefill (M tokens)", False),
    "standard_slo": ("standard SLO", True),
    "batch_slo": ("batch SLO", True),
    "interactive_ttft_p99": ("interactive TTFT p99 (s)", False),
}
"""Per family and policy, over the seeds: name → (table header, higher is better). ``worst`` is the
lowest seed's value, the highest for ``gpu_hours``, the TTFTs (over every served request: a rejected one
has none, so read them beside the SLO) and ``prefill_tokens_computed`` (prompt tokens the nodes
prefilled: what they were asked for less their prefix-cache hits; fewer admitted requests also mean
fewer, so read it beside the SLO and goodput)."""
EXTRA_METRICS = ("ttft_p50", "ttft_p99", "prefill_tokens_computed")
"""Added with ``shared-prefix``: in the JSON of every family, in the table of ``shared-prefix`` only (the
other families' tables keep their columns)."""
TIER_METRICS = ("standard_slo", "batch_slo", "interactive_ttft_p99")
"""The lower tiers' SLO attainment and the interactive tier's TTFT p99 (over its served requests), per
seed: in the JSON of every family, in no table (the tables keep their columns). A placement change can
raise the interactive and all-tier figures while the standard tier loses — the batch tier's gain hides it
in the all-tier SLO (attack47: bursty-mmpp seed 6, standard 91.3% -> 88.2% under a higher all-tier SLO);
these say so. None for a seed whose run offered that tier nothing (no tenant of it, or a short ``--scale``
run), and the p99 also where the policy served no interactive request; ``median`` and ``worst`` are over
the seeds with a value, so read the p99 beside the interactive SLO."""


# -- capacity ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Moments:
    """Expected sizes of one request shape."""

    prompt: float
    """E[P], prompt tokens."""
    output: float
    """E[O], output tokens."""
    output_ctx: float
    """E[O·(P + O/2)]: KV tokens held, summed over a request's decode steps."""


@cache
def moments(shape: Shape, points: int = 400) -> Moments:
    """``shape``'s moments, by quadrature over the normal's quantiles (the clipping included)."""
    nd = statistics.NormalDist()
    zs = [nd.inv_cdf((j + 0.5) / points) for j in range(points)]

    def values(median: int, lo_hi: tuple[int, int]) -> list[float]:
        return [float(min(lo_hi[1], max(lo_hi[0], round(median * math.exp(shape.sigma * z))))) for z in zs]

    ps = values(shape.prompt_median, shape.prompt_range)
    os_ = values(shape.output_median, shape.output_range)
    ep, eo = statistics.fmean(ps), statistics.fmean(os_)
    return Moments(ep, eo, eo * ep + statistics.fmean(o * o for o in os_) / 2)


def node_capacity_rps(profile: Profile, long_share: float) -> float:
    """Requests per second one node serves at saturation, for a mix of ``SHORT`` and ``LONG`` requests
    (``long_share`` of them long), from the profile's step-time model
    ``step_ms = a + b·prefill_tokens + c·decode_seqs + d·context_tokens``.

    Over a second of a busy node, the steps' costs add up to 1000 ms. Every request brings
    ``W = b·E[P] + c·E[O] + d·E[O·(P + O/2)]`` ms (its prefill, its decode slots, the KV it holds at
    each decode step: on average P + O/2), whatever the batch; the fixed ``a`` per step is shared by
    the batch, ``a·E[O]/B`` ms per request. The batch is as large as the node allows:
    ``B = min(max_num_seqs, kv_tokens / (E[O·(P + O/2)] / E[O]))`` (the KV a decoding sequence holds,
    weighted by its decode steps). So ``capacity = 1000 / (W + a·E[O]/B)``.

    A saturation throughput, not a latency-bound one: at 100% the queue grows without bound and TTFT
    targets are missed well before. It ignores preemption, the chunked-prefill budget
    (``max_num_batched_tokens``) and the gateway; it is the yardstick an offered load is set against."""
    s, lg, f = moments(SHORT), moments(LONG), long_share
    ep = (1 - f) * s.prompt + f * lg.prompt
    eo = (1 - f) * s.output + f * lg.output
    eoc = (1 - f) * s.output_ctx + f * lg.output_ctx
    work_ms = profile.b_ms_per_prefill_token * ep + profile.c_ms_per_decode_seq * eo \
        + profile.d_ms_per_context_token * eoc
    batch = min(float(profile.max_num_seqs), profile.kv_tokens / (eoc / eo))
    return 1000.0 / (work_ms + profile.a_ms * eo / batch)


# -- rates -------------------------------------------------------------------------------------------

BUSY_SEQS = 128


def request_seconds(profile: Profile, long_share: float, short: Moments, long: Moments) -> float:
    """A request's typical duration on a healthy, busy node (``BUSY_SEQS`` sequences decoding, or as many
    as its KV cache holds): its prefill, then one step per output token — what a concurrency cap is
    sized against."""
    def one(m: Moments) -> float:
        seqs = min(BUSY_SEQS, profile.kv_tokens / (m.prompt + m.output))
        step = profile.step_ms(0, int(seqs), int(seqs * (m.prompt + m.output / 2)))
        return (profile.b_ms_per_prefill_token * m.prompt + step * m.output) / 1000.0

    return (1 - long_share) * one(short) + long_share * one(long)


def _const(x: float) -> Rate:
    return lambda t: x


def _steps(times: Sequence[float], levels: Sequence[float]) -> Rate:
    """Piecewise constant: ``levels[i]`` from ``times[i]`` on (``times[0]`` = 0)."""
    ts, ls = tuple(times), tuple(levels)
    return lambda t: ls[max(0, bisect_right(ts, t) - 1)]


def _linear(times: Sequence[float], values: Sequence[float]) -> Rate:
    """Piecewise linear through (times[i], values[i]), constant outside."""
    ts, vs = tuple(times), tuple(values)

    def rate(t: float) -> float:
        i = bisect_right(ts, t)
        if i == 0:
            return vs[0]
        if i >= len(ts):
            return vs[-1]
        t0, t1 = ts[i - 1], ts[i]
        return vs[i - 1] + (vs[i] - vs[i - 1]) * (t - t0) / (t1 - t0)

    return rate


def _scaled(f: Rate, k: float) -> Rate:
    return lambda t: k * f(t)


def _part(k: float, u: Rate, p: Rate, long: bool) -> Rate:
    """A tenant's short (``long`` False) or long requests: ``k·u(t)·(1 - p(t))`` or ``k·u(t)·p(t)``."""
    if long:
        return lambda t: k * u(t) * p(t)
    return lambda t: k * u(t) * (1.0 - p(t))


def _grid(horizon: float) -> list[float]:
    """Midpoints of the ``GRID_S`` cells of [0, horizon)."""
    return [(i + 0.5) * GRID_S for i in range(max(1, math.ceil(horizon / GRID_S)))]


def _mean(f: Rate, horizon: float) -> float:
    g = _grid(horizon)
    return sum(f(t) for t in g) / len(g)


def _peak(f: Rate, horizon: float) -> float:
    """An upper bound of ``f`` over [0, horizon] for thinning (2% over the grid's maximum)."""
    pts = [i * GRID_S for i in range(math.ceil(horizon / GRID_S) + 1)]
    return 1.02 * max(f(t) for t in pts)


def arrivals(streams: Sequence[Stream], duration_s: float, seed: int, until: float | None = None) -> list[TraceRequest]:
    """Non-homogeneous Poisson arrivals by thinning, one RNG per stream, as ``workloads.poisson`` but with
    each rate's peak found on a fine grid over the whole ``duration_s`` (``poisson`` samples 201 points,
    which can miss a short burst and clip it). ``until`` < ``duration_s`` cuts the run short; what it
    gives is then exactly the start of the full trace."""
    end = duration_s if until is None else until
    horizon = max(duration_s, end)
    return thinned(streams, end, seed, lambda s: _peak(s.rate, horizon))


# -- the generator -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TenantPlan:
    name: str
    tier: str
    share: float
    """Share of the run's requests."""
    long_share: float
    """Share of its requests that are long (``mixed``: averaged over the run)."""
    pattern: str = ""
    """Its traffic pattern, in words."""
    quota: tuple[tuple[str, int], ...] = ()
    """Quota fields of its kvgate tenant entry."""


@dataclass(frozen=True)
class FamilyScenario(Scenario):
    """A scenario drawn by ``family``; ``trace`` uses ``arrivals`` (every rate's exact peak)."""

    family: str = ""
    nodes: int = 2
    """The static fleet (and where the autoscalers start)."""
    load: float = 1.0
    """Offered load: the run's mean request rate over the fleet's estimated capacity."""
    capacity_rps: float = 0.0
    """The fleet's estimated capacity (``node_capacity_rps`` x nodes) for the run's mix."""
    long_share: float = 0.0
    """Expected share of long requests over the run."""
    trace_seed: int = 0
    plan: tuple[TenantPlan, ...] = ()

    def trace(self, scale: float = 1.0) -> list[TraceRequest]:
        """The requests; ``scale`` < 1 keeps the start of the run (the same requests as at scale 1)."""
        return arrivals(list(self.streams), self.duration_s, self.trace_seed, until=self.duration_s * scale)

    @property
    def offered_rps(self) -> float:
        return self.load * self.capacity_rps

    def details(self) -> dict[str, Any]:
        """What the family adds to a seed's JSON (``SeedRun.to_json``)."""
        return {}

    def describe(self) -> str:
        ts = ", ".join(f"{p.name} ({p.tier}, {100 * p.share:.0f}% of requests, {100 * p.long_share:.0f}% long"
                       + "".join(f", {k} {v}" for k, v in p.quota) + ")" for p in self.plan)
        return (f"{self.profile} x {self.nodes} nodes, {self.duration_s:g} s, offered load {100 * self.load:.0f}% "
                f"of the fleet's estimated capacity ({self.offered_rps:.1f} of {self.capacity_rps:.1f} req/s, "
                f"{100 * self.long_share:.0f}% long); {len(self.plan)} tenants: {ts}")


Pattern = Callable[[random.Random, list[tuple[str, str, float]], float], list[tuple[Rate, Rate | None, str]]]
"""(rng, [(name, tier, base long share)], duration) → per tenant (unit rate u(t), long share p(t) or None
for the constant base share, description)."""


def _onoff(rng: random.Random, tenants: list[tuple[str, str, float]], duration: float) -> list[
        tuple[Rate, Rate | None, str]]:
    out: list[tuple[Rate, Rate | None, str]] = []
    for _ in tenants:
        mean_on, mean_off = rng.uniform(15.0, 60.0), rng.uniform(10.0, 90.0)
        on = rng.random() < 0.5
        t, times, levels = 0.0, [], []
        while t < duration:
            times.append(t)
            levels.append(1.0 if on else 0.0)
            t += max(MIN_SEGMENT_S, rng.expovariate(1.0 / (mean_on if on else mean_off)))
            on = not on
        out.append((_steps(times, levels), None, f"on ~{mean_on:.0f} s / off ~{mean_off:.0f} s"))
    return out


def _mmpp(rng: random.Random, tenants: list[tuple[str, str, float]], duration: float) -> list[
        tuple[Rate, Rate | None, str]]:
    out: list[tuple[Rate, Rate | None, str]] = []
    for _ in tenants:
        n = rng.choice((2, 3))
        states = [rng.uniform(0.1, 0.5), *([1.0] if n == 3 else []), rng.uniform(2.0, 6.0)]
        hold = [rng.uniform(10.0, 60.0) for _ in states]
        s = rng.randrange(n)
        t, times, levels = 0.0, [], []
        while t < duration:
            times.append(t)
            levels.append(states[s])
            t += max(MIN_SEGMENT_S, rng.expovariate(1.0 / hold[s]))
            s = rng.choice([i for i in range(n) if i != s])
        desc = ", ".join(f"{x:.2g}x for ~{h:.0f} s" for x, h in zip(states, hold, strict=True))
        out.append((_steps(times, levels), None, f"{n} states ({desc})"))
    return out


def _diurnal(rng: random.Random, tenants: list[tuple[str, str, float]], duration: float) -> list[
        tuple[Rate, Rate | None, str]]:
    trough = rng.uniform(0.15, 0.4)
    start = rng.uniform(0.3, 0.8) * duration
    end = start + rng.uniform(30.0, 90.0)
    mult = rng.uniform(1.5, 3.0)

    def day(anti: bool, bursts: bool) -> Rate:
        def rate(t: float) -> float:
            x = (1.0 - math.cos(2.0 * math.pi * t / duration)) / 2.0
            level = trough + (1.0 - trough) * (1.0 - x if anti else x)
            return level * (mult if bursts and start <= t < end else 1.0)

        return rate

    out: list[tuple[Rate, Rate | None, str]] = []
    for _, tier, _ in tenants:
        anti = tier == "batch"
        desc = ("night jobs: peaks at start and end" if anti else "peaks mid-run") + f", trough {trough:.0%} " \
            "of peak" + ("" if anti else f", burst {mult:.1f}x from {start:.0f} s to {end:.0f} s")
        out.append((day(anti, not anti), None, desc))
    return out


def _mixed(rng: random.Random, tenants: list[tuple[str, str, float]], duration: float) -> list[
        tuple[Rate, Rate | None, str]]:
    out: list[tuple[Rate, Rate | None, str]] = []
    for _, tier, _ in tenants:
        lo, hi = LONG_SHARE[tier]
        if tier != "batch":
            hi = min(1.0, hi + 0.2)  # a tenant whose traffic turns long for a while (a new RAG feature)
        span = hi - lo
        first, last = rng.uniform(lo, lo + 0.25 * span), rng.uniform(hi - 0.25 * span, hi)
        if rng.random() < 0.5:
            first, last = last, first
        inner = sorted(rng.uniform(0.15, 0.85) * duration for _ in range(rng.randint(1, 3)))
        times = [0.0, *inner, duration]
        values = [first, *(rng.uniform(lo, hi) for _ in inner), last]
        desc = "long share " + " -> ".join(f"{100 * v:.0f}%" for v in values) + " at " + \
            ", ".join(f"{t:.0f}" for t in times) + " s"
        out.append((_const(1.0), _linear(times, values), desc))
    return out


PATTERNS: dict[str, Pattern] = {"bursty-onoff": _onoff, "bursty-mmpp": _mmpp, "diurnal": _diurnal, "mixed": _mixed}


def _two_figures(x: float) -> int:
    if x <= 0:
        return 1
    e = math.floor(math.log10(x)) - 1
    return max(1, int(round(x / 10**e) * 10**e))


def family(name: str, seed: int, policies: Sequence[PolicyName] = POLICIES) -> FamilyScenario:
    """The scenario of family ``name`` for ``seed`` (see the module's docstring for what it draws)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"kvgate-families/{name}/{seed}")
    profile = FAMILY_PROFILES[(seed + list(FAMILIES).index(name)) % len(FAMILY_PROFILES)]
    nodes = rng.randint(2, 4)
    duration = 30.0 * rng.randint(10, 20)
    load = round(rng.uniform(0.6, 1.1), 2)
    trace_seed = rng.randrange(1, 2**31)
    if name == "shared-prefix":
        return _shared_prefix(rng, seed, profile, nodes, duration, load, trace_seed, policies)

    n = rng.randint(2, 5)
    tiers = ["interactive", *(["standard", "batch"] if n >= 3 else [rng.choice(("standard", "batch"))])]
    tiers += [rng.choice(TIERS) for _ in range(n - len(tiers))]
    tiers.sort(key=TIERS.index)
    counts: dict[str, int] = {}
    tenants: list[tuple[str, str, float]] = []
    for tier in tiers:
        counts[tier] = counts.get(tier, 0) + 1
        tenants.append((f"{PREFIX[tier]}-{counts[tier]}", tier, rng.uniform(*LONG_SHARE[tier])))
    weights = [rng.lognormvariate(0.0, 0.5) for _ in tenants]
    shares = [w / sum(weights) for w in weights]

    shapes = PATTERNS[name](rng, tenants, duration)
    units: list[tuple[Rate, Rate]] = []
    for (_, _, base), (u, p, _) in zip(tenants, shapes, strict=True):
        m = _mean(u, duration)
        units.append((_scaled(u, 1.0 / m) if m > 0 else _const(1.0), p if p is not None else _const(base)))

    # expected requests at one request/s in all, short and long: the run's mix, hence its capacity
    g = _grid(duration)
    long_avg = [sum(p(t) * u(t) for t in g) / sum(u(t) for t in g) for u, p in units]
    long_total = sum(sh * la for sh, la in zip(shares, long_avg, strict=True))
    capacity = nodes * node_capacity_rps(get_profile(profile), long_total)
    k = load * capacity

    s_m, l_m = moments(SHORT), moments(LONG)
    streams: list[Stream] = []
    plan: list[TenantPlan] = []
    entries: list[dict[str, Any]] = []
    for (tname, tier, _), share, la, (u, p), (_, _, desc) in zip(tenants, shares, long_avg, units, shapes,
                                                                 strict=True):
        reserve = LONG_MAX_TOKENS if tier != "interactive" else None
        streams.append(Stream(tname, SHORT, _part(k * share, u, p, long=False)))
        streams.append(Stream(tname, LONG, _part(k * share, u, p, long=True), max_tokens=reserve))
        quota: list[tuple[str, int]] = []
        if tier == "batch":
            # sized as the families page says: its request rate x its requests' duration on a healthy fleet, with
            # headroom for its bursts (a fixed 8 against 40 req/s measured the operator, not kvgate)
            seconds = request_seconds(get_profile(profile), la, s_m, l_m)
            peak = k * share * _peak(u, duration)
            quota.append(("max_concurrent", max(4, math.ceil(peak * seconds * rng.uniform(1.5, 2.5)))))
        elif tier == "standard" and rng.random() < 0.5:
            tokens = (1 - la) * (s_m.prompt + s_m.output) + la * (l_m.prompt + (reserve or l_m.output))
            quota.append(("tokens_per_minute", _two_figures(60.0 * k * share * tokens * rng.uniform(1.5, 3.0))))
        plan.append(TenantPlan(tname, tier, share, la, desc, tuple(quota)))
        limits = dict(quota)
        stretch = {"max_concurrent_stretch": STRETCH} if "max_concurrent" in limits else {}
        entries.append({"name": tname, "tier": tier, **limits, **stretch})
    config: dict[str, Any] = {"tenants": entries, "best_effort": {"default": "best-effort"},
                              "nodes": PLACEHOLDER_NODES}
    bench = BenchConfig(profile=profile, nodes=nodes, min_nodes=1, max_nodes=min(16, 3 * nodes), kvgate=config,
                        policies=list(policies), scaler=SCALER, seed=seed)
    sc = FamilyScenario(
        f"{name}-{seed}", f"{name}, seed {seed}", FAMILIES[name], profile, duration, config, bench.policy_list(),
        tuple(streams), seed=seed, autoscaling=bench.autoscaling(), family=name, nodes=nodes, load=load,
        capacity_rps=capacity, long_share=long_total, trace_seed=trace_seed, plan=tuple(plan))
    return sc


# -- shared prefixes ---------------------------------------------------------------------------------

SHARED_TENANTS = (("chat", "interactive"), ("rag", "standard"), ("api", "batch"))
"""``SharedPrefixes``' tenants and their tiers."""
CALIBRATION_SESSIONS = 100
"""Sessions of the first trace the load is measured on; the count is then scaled to the drawn load."""


@dataclass(frozen=True)
class SharedPrefixFamily(FamilyScenario):
    """A ``shared-prefix`` seed: its trace is ``traffic``'s (sessions, not independent streams)."""

    traffic: SharedPrefixes = field(default_factory=SharedPrefixes)
    working_set: tuple[float, float] = (0.0, 0.0)
    """The prefix cache's working set (``workloads.working_set``) over one node's KV: mean over the run,
    peak."""

    def trace(self, scale: float = 1.0) -> list[TraceRequest]:
        """The requests; ``scale`` < 1 keeps the start of the full trace (the same requests, not a redraw)."""
        end = self.duration_s * scale
        return [r for r in self.traffic.build(self.trace_seed) if r.t < end]

    def details(self) -> dict[str, Any]:
        t = self.traffic
        return {"traffic": {
            "system_tokens": t.system_tokens, "sessions": t.sessions, "turns": list(t.turns),
            "think_s": [round(x, 3) for x in t.think_s], "documents": t.documents,
            "document_tokens": list(t.document_tokens), "zipf": t.zipf, "rag_share": t.rag_share,
            "job_share": t.job_share, "max_context": t.max_context},
            "working_set_kv": {"mean": round(self.working_set[0], 3), "peak": round(self.working_set[1], 3)}}

    def describe(self) -> str:
        return (f"{super().describe()}; every prompt starts with its tenant's {self.traffic.system_tokens:,}-token "
                f"system prompt; the prefix working set is {self.working_set[0]:.1f}x one node's KV on average, "
                f"{self.working_set[1]:.1f}x at its peak")


def _working_set_kv(trace: Sequence[TraceRequest], duration: float, kv_tokens: int) -> tuple[float, float]:
    steps = working_set(trace)
    if not steps:
        return 0.0, 0.0
    area = sum(n * (min(t1, duration) - min(t0, duration))
               for (t0, n), (t1, _) in zip(steps, [*steps[1:], (duration, 0)], strict=True))
    return area / duration / kv_tokens, max(n for _, n in steps) / kv_tokens


def _shared_prefix(rng: random.Random, seed: int, profile: str, nodes: int, duration: float, load: float,
                   trace_seed: int, policies: Sequence[PolicyName]) -> SharedPrefixFamily:
    prof = get_profile(profile)
    system = 100 * rng.randint(2, 30)
    lo_turns, hi_turns = rng.randint(1, 3), rng.randint(4, 12)
    think_lo = rng.uniform(3.0, 15.0)
    think = (round(think_lo, 1), round(think_lo + rng.uniform(10.0, 60.0), 1))
    gap = RESPONSE_S + RESPONSE_S_PER_TOKEN * moments(CHAT_TURN).output + sum(think) / 2
    hi_turns = min(hi_turns, max(2, 1 + int(0.8 * duration / gap)))
    doc_lo = 100 * rng.randint(10, 30)
    docs = (doc_lo, doc_lo + 100 * rng.randint(10, 50))
    traffic = SharedPrefixes(
        duration_s=duration, system_tokens=system, sessions=CALIBRATION_SESSIONS,
        turns=(min(lo_turns, hi_turns), hi_turns), think_s=think, documents=rng.randint(5, 50),
        document_tokens=docs, zipf=round(rng.uniform(0.6, 1.4), 2), rag_share=round(rng.uniform(0.1, 0.5), 2),
        job_share=round(rng.uniform(0.05, 0.3), 2), max_context=prof.max_model_len)

    # the load is about proportional to the sessions (the first k sessions are the same whatever the count,
    # and RAG and jobs follow the chat's count): scale, then correct it, at most twice
    def measured(t: SharedPrefixes) -> tuple[list[TraceRequest], float]:
        tr = t.build(trace_seed)
        return tr, offered_load(tr, prof, nodes, duration)

    trace, measured_load = measured(traffic)
    for _ in range(3):
        sessions = max(1, round(traffic.sessions * load / measured_load))
        if sessions == traffic.sessions:
            break
        traffic = replace(traffic, sessions=sessions)
        trace, measured_load = measured(traffic)

    limit = LONG.prompt_median
    plan: list[TenantPlan] = []
    turns, think = traffic.turns, traffic.think_s
    desc = {"chat": f"{traffic.sessions} sessions of {turns[0]}-{turns[1]} turns (think {think[0]:g}-{think[1]:g} "
                    "s), each prompt the session's history",
            "rag": f"questions over {traffic.documents} documents of {docs[0]}-{docs[1]} tokens (Zipf "
                   f"{traffic.zipf:g})",
            "api": "one-off jobs"}
    for tname, tier in SHARED_TENANTS:
        mine = [r for r in trace if r.tenant == tname]
        plan.append(TenantPlan(tname, tier, len(mine) / max(1, len(trace)),
                               sum(r.prompt_tokens >= limit for r in mine) / max(1, len(mine)), desc[tname]))
    config: dict[str, Any] = {"tenants": [{"name": n, "tier": t} for n, t in SHARED_TENANTS],
                              "nodes": PLACEHOLDER_NODES}
    bench = BenchConfig(profile=profile, nodes=nodes, min_nodes=1, max_nodes=min(16, 3 * nodes), kvgate=config,
                        policies=list(policies), scaler=SCALER, seed=seed)
    name = "shared-prefix"
    return SharedPrefixFamily(
        f"{name}-{seed}", f"{name}, seed {seed}", FAMILIES[name], profile, duration, config, bench.policy_list(),
        (), seed=seed, autoscaling=bench.autoscaling(), family=name, nodes=nodes, load=load,
        capacity_rps=len(trace) / duration / measured_load if measured_load > 0 else 0.0,
        long_share=sum(r.prompt_tokens >= limit for r in trace) / max(1, len(trace)), trace_seed=trace_seed,
        plan=tuple(plan), traffic=traffic, working_set=_working_set_kv(trace, duration, prof.kv_tokens))


# -- running and reporting ---------------------------------------------------------------------------

def metric(s: report.Summary, name: str) -> float | None:
    """One of ``METRICS`` for one policy's run."""
    if name in ("interactive_slo", "standard_slo", "batch_slo"):
        g = s.tiers.get(name.removesuffix("_slo"))
        return g.slo if g is not None else None
    if name == "interactive_ttft_p99":
        return targets.figures(s)[name]  # (what the targets read: one expression)
    values: dict[str, float | None] = {
        "slo": s.all.slo, "goodput_per_gpu": s.goodput_per_gpu, "gpu_hours": s.gpu_hours, "jain": s.fairness,
        "jain_60s_mean": s.jain_60s_mean, "jain_60s_min": s.jain_60s_min,
        "ttft_p50": s.all.ttft[0], "ttft_p99": s.all.ttft[2],
        "prefill_tokens_computed": float(s.result.prefill_tokens_computed)}
    return values[name]


def aggregate(values: Sequence[float | None], higher_is_better: bool) -> dict[str, Any]:
    """``median`` (``statistics.median``: the middle seed, or the mean of the two middle ones) and
    ``worst`` over the seeds that have a value, and ``per_seed`` in seed order (None: no value, e.g.
    no interactive request in a very short run)."""
    xs = [x for x in values if x is not None]
    worst = (min(xs) if higher_is_better else max(xs)) if xs else None
    return {"median": statistics.median(xs) if xs else None, "worst": worst, "per_seed": list(values)}


@dataclass
class SeedRun:
    scenario: FamilyScenario
    result: ScenarioResult

    def summary(self, policy: str) -> report.Summary | None:
        return next((s for s in self.result.summaries if s.result.policy.name == policy and not s.ideal), None)

    def markdown(self) -> str:
        sc = self.scenario
        return (f"* seed {sc.seed}: {sc.describe()}; {self.result.requests} requests, simulated in "
                f"{self.result.seconds:.1f} s\n")

    def to_json(self) -> dict[str, Any]:
        sc = self.scenario
        return {"seed": sc.seed, "profile": sc.profile, "nodes": sc.nodes, "duration_s": sc.duration_s,
                "offered_load": sc.load, "capacity_rps": round(sc.capacity_rps, 3),
                "offered_rps": round(sc.offered_rps, 3), "long_share": round(sc.long_share, 4),
                "requests": self.result.requests, "wall_s": round(self.result.seconds, 3),
                "lost": sum(s.result.lost for s in self.result.summaries),
                "tenants": [{"name": p.name, "tier": p.tier, "share": round(p.share, 4),
                             "long_share": round(p.long_share, 4), "pattern": p.pattern, **dict(p.quota)}
                            for p in sc.plan], **sc.details()}


@dataclass
class FamilyResult:
    family: str
    policies: tuple[PolicyName, ...]
    runs: list[SeedRun]
    seconds: float

    def rows(self) -> dict[str, dict[str, dict[str, Any]]]:
        """policy → metric → ``aggregate``."""
        return {p: {m: aggregate([metric(s, m) if (s := r.summary(p)) is not None else None for r in self.runs],
                                 better) for m, (_, better) in METRICS.items()}
                for p in self.policies}

    def checks(self) -> list[tuple[int, list[targets.Check]]]:
        """Issue 30's targets on each seed (``targets.py``)."""
        return [(r.scenario.seed, targets.checks(targets.rows_by_policy(r.result.summaries))) for r in self.runs]

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "about": FAMILIES[self.family], "wall_s": round(self.seconds, 3),
                "seeds": [r.to_json() for r in self.runs],
                "policies": [{"policy": p, **ms} for p, ms in self.rows().items()],
                "targets": [{"seed": seed, **targets.summary_json(cs)} for seed, cs in self.checks()]}

    def markdown(self) -> str:
        return "\n".join([heading(self.family), *(r.markdown() for r in self.runs), self.table()])

    def table(self) -> str:
        """The policies' table, and the family's wall time."""
        cols = columns(self.family)
        highest = "GPU-h" + (", TTFT and prefill" if any(m in EXTRA_METRICS for m in cols) else "")
        return "\n".join([table(self.rows(), cols), "", f"Each cell: median / worst of {len(self.runs)} seed(s) "
                          f"(worst: the lowest, the highest for {highest}). Wall time for the family: "
                          f"{self.seconds:.1f} s.", "", TARGETS_NOTE, "", targets.table(self.checks()), ""])


TARGETS_NOTE = ("Issue 30's targets per seed (`ok`/`MISS` and the margin: SLO in points, goodput in %, the "
                "interactive p99 as a share of kv-shed's, Jain as an index, GPU-h in % of autoscale-only's; "
                "the batch SLO line only where kvgate's interactive SLO meets its check, `-` elsewhere):")


def heading(name: str) -> str:
    return f"## {name}: {FAMILIES[name]}\n"


def columns(name: str) -> list[str]:
    """The metrics in family ``name``'s table (``EXTRA_METRICS`` only in ``shared-prefix``'s,
    ``TIER_METRICS`` in none)."""
    return [m for m in METRICS if m not in TIER_METRICS and (name == "shared-prefix" or m not in EXTRA_METRICS)]


def _cell(name: str, agg: dict[str, Any]) -> str:
    def one(x: float | None) -> str:
        if x is None:
            return "-"
        if name in targets.SLO_COLUMNS:
            return f"{100 * x:.1f}%"
        if name == "prefill_tokens_computed":
            return f"{x / 1e6:.1f}"
        return f"{x:.2f}"

    return f"{one(agg['median'])} / {one(agg['worst'])}"


def table(rows: dict[str, dict[str, dict[str, Any]]], metrics: Sequence[str]) -> str:
    """The policies' rows over ``metrics`` (a family's :func:`columns`)."""
    return report.table(["policy", *(METRICS[m][0] for m in metrics)],
                        [[p, *(_cell(m, ms[m]) for m in metrics)] for p, ms in rows.items()])


def run_family(name: str, seeds: Sequence[int], scale: float = 1.0, policies: Sequence[PolicyName] = POLICIES,
               on_run: Callable[[SeedRun], None] | None = None) -> FamilyResult:
    """Every policy over each seed's scenario of family ``name`` (``runner.run``, the production path)."""
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        sc = family(name, seed, policies)
        r = SeedRun(sc, run(sc, sc.trace(scale), scale))
        runs.append(r)
        if on_run is not None:
            on_run(r)
    return FamilyResult(name, tuple(policies), runs, time.perf_counter() - t0)


def to_json(results: Sequence[FamilyResult], seeds: Sequence[int], scale: float,
            policies: Sequence[PolicyName], seconds: float) -> dict[str, Any]:
    """The ``--json`` document (field names are stable)."""
    return {"kind": "kvgate-bench-families", "version": 1, "scale": scale, "seeds": list(seeds),
            "policies": list(policies), "window_s": WINDOW_S,
            "metrics": {m: {"higher_is_better": better, "worst": "min" if better else "max"}
                        for m, (_, better) in METRICS.items()},
            "wall_s": round(seconds, 3), "families": [r.to_json() for r in results]}
