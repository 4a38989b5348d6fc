"""What a run means: latency percentiles per tier and tenant, SLO attainment, goodput, rejections by
reason, fairness, GPU-hours; printed as Markdown tables (readable in a terminal too), with PNG plots.

Definitions (also in docs/benchmarks/index.md):

* TTFT and e2e are measured from the client's arrival, gateway queueing included, over the requests
  that were admitted; a rejection has no latency but counts against SLO attainment.
* SLO attainment of a tier: the share of its *offered* requests that got their first token within the
  tier's ``ttft_target_ms`` (kvgate's tier config; 200 ms / 1 s / 5 s by default).
* Goodput: requests within SLO per second of the run, and per GPU (GPU-seconds / run time = GPUs on
  average).
* Fairness: Jain's index of the weighted tokens each tenant was served, each divided by its weighted
  max-min fair share of the total that was served (so a tenant that asked for less than its share is
  not "unfair" by being served less). 1.0 = every tenant got its fair share.
* Fairness over time (``jain_60s_mean``, ``jain_60s_min``): the same index per 60 s window of arrivals,
  over the tenants active in that window (see ``jain_windows``); the mean over windows, and the worst
  window. A run can be fair in total and starve a tenant for a minute; these show it.
* Breaker opens: the total, and by cause as kvgate classifies them (``ext_proc.breaker.open_cause``):
  ``latency`` (a prefill-latency trip), ``kv`` (a KV trip), ``trial`` (re-opened while half-open).
* The ideal row (``ideal (N nodes)``, ``"ideal": true`` in JSON; ``Scenario.ideal``): policy none
  without the scenario's disturbance, a reference rather than a policy. Its figures are over what it
  was offered: where the ideal removes tenants from the trace (noisy-neighbour keeps only the
  interactive tier), SLO attainment, latency and Jain are over the kept tenants alone, and a removed
  tenant has no row at all (not a 0%-served one); every ratio is guarded, so an ideal offered nothing
  reports ``-``/None, never a division by zero.
* Per pool (a kvgate config with ``pools``; ``"pools"`` in JSON, absent otherwise): the same figures over
  the requests routed to each pool (its models' tenants), the pool's nodes over time (start, most,
  time-weighted average, every change) and the requests its nodes were sent, by model — counted at the
  nodes, so a request reaching another pool's node would show there.
* Reference rows (``Scenario.reference``; ``"references"`` in JSON, beside ``"policies"``): each policy
  again over the trace without the left-out streams, labelled ``policy (...) [label]``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ext_proc.config import Config

from .driver import BREAKER_CAUSES, Outcome, PoolResult, RunResult


def percentile(xs: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def jain(xs: Sequence[float]) -> float | None:
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def max_min_shares(demand: dict[str, float], weight: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair allocation of ``capacity`` (water-filling)."""
    share = {t: 0.0 for t in demand}
    left = dict(demand)
    cap = capacity
    while left and cap > 1e-9:
        w = sum(weight[t] for t in left)
        unit = cap / w
        done = [t for t in left if left[t] <= unit * weight[t]]
        if not done:
            for t in left:
                share[t] += unit * weight[t]
            break
        for t in done:
            share[t] += left[t]
            cap -= left[t]
            del left[t]
    return share


@dataclass(frozen=True)
class Group:
    """Figures for one set of requests (a policy's, a tier's or a tenant's)."""

    offered: int
    admitted: int
    rejected_policy: int
    rejected_capacity: int
    rejected_other: int
    ttft: tuple[float | None, float | None, float | None]
    e2e: tuple[float | None, float | None, float | None]
    slo: float | None
    """Share of offered requests within their tier's TTFT target."""
    within_slo: int


def group(outcomes: Iterable[Outcome], targets: dict[str, float | None]) -> Group:
    os_ = list(outcomes)
    ok = [o for o in os_ if o.status == 200]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    within = sum(1 for o in ok if _in_slo(o, targets.get(o.tier)))
    has_target = [o for o in os_ if targets.get(o.tier) is not None]
    return Group(
        len(os_), len(ok),
        sum(1 for o in os_ if o.klass == "policy"), sum(1 for o in os_ if o.klass == "capacity"),
        sum(1 for o in os_ if o.status not in (0, 200) and o.klass not in ("policy", "capacity")),
        (percentile(ttft, 50), percentile(ttft, 95), percentile(ttft, 99)),
        (percentile(e2e, 50), percentile(e2e, 95), percentile(e2e, 99)),
        within / len(has_target) if has_target else None, within,
    )


def _in_slo(o: Outcome, target: float | None) -> bool:
    return target is not None and o.ttft is not None and o.ttft <= target


@dataclass(frozen=True)
class PoolSummary:
    """One model pool's figures in a run: its requests (those routed to it) and its nodes."""

    pool: PoolResult
    all: Group
    tenants: dict[str, Group]
    avg_nodes: float
    """Nodes provisioned, time-weighted over the run (GPU-seconds / GPUs per node / run time)."""

    @property
    def nodes_max(self) -> int:
        return max(c for _, c in self.pool.node_timeline) if self.pool.node_timeline else self.pool.nodes

    @property
    def nodes_end(self) -> int:
        return self.pool.node_timeline[-1][1] if self.pool.node_timeline else self.pool.nodes

    def to_json(self) -> dict[str, Any]:
        a, p = self.all, self.pool
        return {"profile": p.profile, "offered": a.offered, "admitted": a.admitted,
                "rejected_429": a.rejected_policy, "rejected_503": a.rejected_capacity,
                "ttft_p50_p95_p99": a.ttft, "e2e_p50_p95_p99": a.e2e, "slo_attainment": a.slo,
                "nodes_start": p.nodes, "nodes_max": self.nodes_max, "nodes_end": self.nodes_end,
                "avg_nodes": round(self.avg_nodes, 3), "gpu_hours": round(p.gpu_seconds / 3600.0, 4),
                "node_timeline": [[round(t, 3), c] for t, c in p.node_timeline],
                "requests_at_nodes_by_model": dict(sorted(p.served.items())),
                "tenants": {t: {"offered": g.offered, "admitted": g.admitted, "rejected_429": g.rejected_policy,
                                "rejected_503": g.rejected_capacity, "ttft_p50_p95_p99": g.ttft,
                                "slo_attainment": g.slo} for t, g in self.tenants.items()}}


def summarize_pools(r: RunResult, targets: dict[str, float | None]) -> dict[str, PoolSummary]:
    """Each pool's figures: over the requests routed to it (``Outcome.pool``) and its own nodes."""
    out = {}
    dur = max(r.duration_s, 1e-9)
    for name, p in r.pools.items():
        mine = [o for o in r.outcomes if o.pool == name]
        tenants = sorted({o.req.tenant for o in mine})
        out[name] = PoolSummary(p, group(mine, targets),
                                {t: group((o for o in mine if o.req.tenant == t), targets) for t in tenants},
                                p.gpu_seconds / p.gpus_per_node / dur)
    return out


@dataclass(frozen=True)
class Summary:
    label: str
    result: RunResult
    all: Group
    tiers: dict[str, Group]
    tenants: dict[str, Group]
    reasons: dict[str, int]
    gpu_hours: float
    avg_gpus: float
    goodput: float
    goodput_per_gpu: float
    fairness: float | None
    served_tokens: dict[str, float]
    jain_60s_mean: float | None = None
    """Jain's index (as ``fairness``) per 60 s window of arrivals over the tenants active in it
    (``jain_windows``), averaged over the windows; None: no window with two active tenants."""
    jain_60s_min: float | None = None
    """The same index in the worst 60 s window."""
    pools: dict[str, PoolSummary] = field(default_factory=dict)
    """Per model pool, when kvgate's config has ``pools`` (empty otherwise)."""

    @property
    def ideal(self) -> bool:
        """The scenario's ideal reference row (``Scenario.ideal``), not a policy: its figures cover only
        what it was offered (a tenant removed from its trace has no row, not a 0% one)."""
        return self.result.policy.ideal

    @property
    def breaker_opens_by_cause(self) -> dict[str, int]:
        """Every cause, 0 when none opened (a policy without kvgate's core has no breakers)."""
        return {**{c: 0 for c in BREAKER_CAUSES}, **self.result.breaker_opens_by_cause}

    def to_json(self) -> dict[str, Any]:
        a = self.all
        return {
            "policy": self.label, "gpu_hours": round(self.gpu_hours, 4), "avg_gpus": round(self.avg_gpus, 3),
            "offered": a.offered, "admitted": a.admitted, "rejected_429": a.rejected_policy,
            "rejected_503": a.rejected_capacity, "lost": self.result.lost,
            "ttft_p50_p95_p99": a.ttft, "e2e_p50_p95_p99": a.e2e, "slo_attainment": a.slo,
            "goodput_rps": self.goodput, "goodput_per_gpu": self.goodput_per_gpu, "jain": self.fairness,
            "jain_60s_mean": self.jain_60s_mean, "jain_60s_min": self.jain_60s_min,
            "breaker_opens": self.result.breaker_opens, "breaker_opens_by_cause": self.breaker_opens_by_cause,
            "prefill_tokens_computed": self.result.prefill_tokens_computed,
            "ideal": self.ideal,
            "tiers": {t: {"ttft_p50_p95_p99": g.ttft, "slo_attainment": g.slo, "offered": g.offered,
                          "admitted": g.admitted} for t, g in self.tiers.items()},
            "tenants": {t: {"offered": g.offered, "admitted": g.admitted, "rejected_429": g.rejected_policy,
                            "rejected_503": g.rejected_capacity} for t, g in self.tenants.items()},
            "reasons": self.reasons,
            # additive, and only where they apply: a single-pool scenario's JSON is what it always was
            **({"pools": {n: p.to_json() for n, p in self.pools.items()}} if self.pools else {}),
            **({"reference": self.result.policy.reference} if self.result.policy.reference else {})}


def summarize(r: RunResult, config: Config) -> Summary:
    targets = {n: (t.ttft_target_ms / 1000.0 if t.ttft_target_ms else None) for n, t in config.tiers.items()}
    w_out = config.queue.output_token_weight
    tiers = sorted({o.tier for o in r.outcomes}, key=lambda n: config.tiers[n].priority if n in config.tiers else 99)
    tenants = sorted({o.req.tenant for o in r.outcomes})
    reasons: dict[str, int] = {}
    demand: dict[str, float] = {t: 0.0 for t in tenants}
    served: dict[str, float] = {t: 0.0 for t in tenants}
    for o in r.outcomes:
        cost = o.req.prompt_tokens + w_out * o.req.output_tokens
        demand[o.req.tenant] += cost
        if o.status == 200:
            served[o.req.tenant] += cost
        elif o.status:
            key = f"{o.status} {o.reason}"
            reasons[key] = reasons.get(key, 0) + 1
    weight = {t: (c.weight if (c := config.tenant(t)) is not None else 1.0) for t in tenants}
    fair = max_min_shares({t: demand[t] / weight[t] for t in tenants}, weight, sum(served.values()))
    fairness = jain([served[t] / fair[t] for t in tenants if fair[t] > 0])
    a = group(r.outcomes, targets)
    dur = max(r.duration_s, 1e-9)
    avg_gpus = r.gpu_seconds / dur
    goodput = a.within_slo / dur
    return Summary(r.policy.label, r, a, {t: group((o for o in r.outcomes if o.tier == t), targets) for t in tiers},
                   {t: group((o for o in r.outcomes if o.req.tenant == t), targets) for t in tenants}, reasons,
                   r.gpu_seconds / 3600.0, avg_gpus, goodput, goodput / avg_gpus if avg_gpus else 0.0, fairness,
                   served, **_windowed(r.outcomes, weight, w_out),
                   pools=summarize_pools(r, targets) if r.pooled else {})


JAIN_WINDOW_S = 60.0


def jain_windows(outcomes: Sequence[Outcome], weight: dict[str, float], output_token_weight: float = 1.0,
                 window_s: float = JAIN_WINDOW_S) -> list[float]:
    """Jain's index per window, in time order: ``summarize``'s whole-run ``fairness``, computed the same
    way over the requests that *arrived* in each window of ``window_s`` seconds (counted from the first
    arrival; the last one may be shorter). Per window: each active tenant's demand (prompt +
    ``output_token_weight`` x output tokens of the requests it offered in the window) and what of it was
    served (admitted), the weighted max-min fair shares of what the window served, and Jain's index of
    served / fair share. Active tenants: those that offered a request in the window (a tenant silent for
    a minute is not starved in it). Windows with fewer than two active tenants say nothing about fairness
    and are left out, as are windows where nothing was served (no index)."""
    if not outcomes:
        return []
    start = min(o.req.t for o in outcomes)
    demand: dict[int, dict[str, float]] = {}
    served: dict[int, dict[str, float]] = {}
    for o in outcomes:
        k = int((o.req.t - start) // window_s)
        cost = o.req.prompt_tokens + output_token_weight * o.req.output_tokens
        d, s = demand.setdefault(k, {}), served.setdefault(k, {})
        d[o.req.tenant] = d.get(o.req.tenant, 0.0) + cost
        s[o.req.tenant] = s.get(o.req.tenant, 0.0) + (cost if o.status == 200 else 0.0)
    out = []
    for k in sorted(demand):
        d, s = demand[k], served[k]
        if len(d) < 2:
            continue
        w = {t: weight.get(t, 1.0) for t in d}
        fair = max_min_shares({t: d[t] / w[t] for t in d}, w, sum(s.values()))
        j = jain([s[t] / fair[t] for t in d if fair[t] > 0])
        if j is not None:
            out.append(j)
    return out


def _windowed(outcomes: Sequence[Outcome], weight: dict[str, float], w_out: float) -> dict[str, float | None]:
    js = jain_windows(outcomes, weight, w_out)
    return {"jain_60s_mean": sum(js) / len(js) if js else None, "jain_60s_min": min(js) if js else None}


# -- tables ----------------------------------------------------------------------------------------

def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])


def overview(sums: list[Summary]) -> str:
    rows = []
    for s in sums:
        a = s.all
        rows.append([s.label, f"{s.avg_gpus:.1f}", f"{s.gpu_hours:.2f}", str(a.offered), str(a.admitted),
                     str(a.rejected_policy), str(a.rejected_capacity), str(s.result.lost),
                     f"{fmt_s(a.ttft[0])} / {fmt_s(a.ttft[2])}", f"{fmt_s(a.e2e[2])}", _pct(a.slo),
                     f"{s.goodput:.2f}", f"{s.goodput_per_gpu:.2f}",
                     "-" if s.fairness is None else f"{s.fairness:.2f}", _opens(s)])
    return table(["policy", "GPUs (avg)", "GPU-h", "offered", "admitted", "429", "503", "lost",
                   "TTFT p50 / p99", "e2e p99", "SLO met", "goodput req/s", "per GPU", "Jain",
                   "breaker opens (lat/kv/trial)"], rows)


def _opens(s: Summary) -> str:
    """The total, and its split by cause when any opened: ``7 (5/0/2)``."""
    total = s.result.breaker_opens
    if not total:
        return "0"
    return f"{total} ({'/'.join(str(n) for n in s.breaker_opens_by_cause.values())})"


def by_tier(sums: list[Summary]) -> str:
    rows = []
    for s in sums:
        for tier, g in s.tiers.items():
            rows.append([s.label, tier, str(g.offered), _pct(g.admitted / g.offered if g.offered else None),
                         " / ".join(fmt_s(x) for x in g.ttft), " / ".join(fmt_s(x) for x in g.e2e), _pct(g.slo)])
    return table(["policy", "tier", "offered", "admitted", "TTFT p50 / p95 / p99", "e2e p50 / p95 / p99",
                   "SLO met"], rows)


def by_tenant(sums: list[Summary]) -> str:
    rows = []
    for s in sums:
        total = sum(s.served_tokens.values()) or 1.0
        for tenant, g in s.tenants.items():
            rows.append([s.label, tenant, str(g.offered), str(g.admitted), str(g.rejected_policy),
                         str(g.rejected_capacity), fmt_s(g.ttft[2]), _pct(s.served_tokens[tenant] / total)])
    return table(["policy", "tenant", "offered", "admitted", "429", "503", "TTFT p99", "share of tokens served"],
                  rows)


def timeline_text(timeline: Sequence[tuple[float, int]]) -> str:
    """A node-count timeline in words: ``1 -> 3 at 75 s -> 1 at 900 s`` (changes at one instant merged)."""
    merged: list[tuple[float, int]] = []
    for t, c in timeline:
        if merged and abs(merged[-1][0] - t) < 1e-9:
            merged[-1] = (t, c)
        else:
            merged.append((t, c))
    if not merged:
        return "-"
    return " -> ".join([str(merged[0][1])] + [f"{c} at {t:.0f} s" for t, c in merged[1:]])


def by_pool(sums: list[Summary]) -> str:
    """Per model pool: its requests' figures, its nodes (start, most, average) and what its nodes were
    sent by model."""
    rows = []
    for s in sums:
        for name, p in s.pools.items():
            a = p.all
            rows.append([s.label, name, p.pool.profile, f"{p.pool.nodes} / {p.nodes_max} / {p.avg_nodes:.1f}",
                         str(a.offered), str(a.admitted), str(a.rejected_policy), str(a.rejected_capacity),
                         f"{fmt_s(a.ttft[0])} / {fmt_s(a.ttft[2])}", _pct(a.slo),
                         ", ".join(f"{m or '(none)'} {n}" for m, n in sorted(p.pool.served.items())) or "-"])
    if not rows:
        return "(no pools)"
    return table(["policy", "pool", "profile", "nodes start / max / avg", "offered", "admitted", "429", "503",
                  "TTFT p50 / p99", "SLO met", "sent to its nodes, by model"], rows)


def pool_timelines(sums: list[Summary]) -> str:
    rows = [[s.label, name, timeline_text(p.pool.node_timeline)] for s in sums for name, p in s.pools.items()]
    return table(["policy", "pool", "nodes over time"], rows) if rows else "(no pools)"


def against_reference(sums: list[Summary], refs: list[Summary], label: str) -> str:
    """Each policy's pools beside the same policy's reference run (the trace without the disturbance):
    SLO attainment, TTFT p50 / p99, 503s and the most nodes, ``with / without``."""
    by_name = {r.result.policy.name: r for r in refs}
    rows = []
    for s in sums:
        ref = by_name.get(s.result.policy.name)
        if ref is None:
            continue
        for name, p in s.pools.items():
            q = ref.pools.get(name)
            if q is None:
                continue
            a, b = p.all, q.all
            rows.append([s.result.policy.name, name, f"{_pct(a.slo)} / {_pct(b.slo)}",
                         f"{fmt_s(a.ttft[0])} / {fmt_s(b.ttft[0])}", f"{fmt_s(a.ttft[2])} / {fmt_s(b.ttft[2])}",
                         f"{a.rejected_capacity} / {b.rejected_capacity}", f"{p.nodes_max} / {q.nodes_max}"])
    if not rows:
        return "(no reference runs)"
    return table(["policy", "pool", f"SLO met (as run / {label})", f"TTFT p50 (as run / {label})",
                  f"TTFT p99 (as run / {label})", f"503 (as run / {label})", f"most nodes (as run / {label})"], rows)


def reasons(sums: list[Summary]) -> str:
    keys = sorted({k for s in sums for k in s.reasons})
    if not keys:
        return "(no rejections)"
    return table(["policy", *keys], [[s.label, *(str(s.reasons.get(k, 0)) for k in keys)] for s in sums])


# -- plots -----------------------------------------------------------------------------------------

PLOTS_HINT = "pip install 'kvgate[bench]'"


def plots_available() -> bool:
    """matplotlib is an optional extra (``kvgate[bench]``); without it no PNG is written. Tried by
    importing it: a package that is found but does not import (a broken install) counts as absent, so
    the report is still written and the caller says why there are no plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def refused(sums: list[Summary]) -> bool:
    """Whether any policy answered a request 429 or 503: without one a rejections plot is an empty chart."""
    return any(o.status in (429, 503) for s in sums for o in s.result.outcomes)


def _timeline(s: Summary, pool: str | None) -> list[tuple[float, int]] | None:
    if pool is None:
        return s.result.node_timeline or [(0.0, s.result.policy.nodes)]
    if pool in s.pools:
        return s.pools[pool].pool.node_timeline or [(0.0, s.pools[pool].pool.nodes)]
    return None


def _pools(sums: list[Summary]) -> list[str | None]:
    return list(dict.fromkeys(n for s in sums for n in s.pools)) or [None]


def fleet_changes(sums: list[Summary]) -> bool:
    """Whether any policy's fleet (or a pool of it) changes size: without that a nodes plot is flat lines."""
    return any(len({c for _, c in tl}) > 1 for s in sums for pool in _pools(sums)
               if (tl := _timeline(s, pool)) is not None)


def plot_notes(sums: list[Summary]) -> list[str]:
    """Why a plot was left out, for the report (a reader then knows it was not lost)."""
    notes = []
    if not refused(sums):
        notes.append("No rejections plot: no policy answered any request 429 or 503.")
    if not fleet_changes(sums):
        sizes = sorted({c for s in sums for pool in _pools(sums) if (tl := _timeline(s, pool)) for _, c in tl})
        notes.append(f"No fleet-size plot: every policy keeps the same nodes ({', '.join(map(str, sizes))}) "
                     "the whole run.")
    return notes


def _tiers(sums: list[Summary], config: Config) -> list[str]:
    return sorted({o.tier for s in sums for o in s.result.outcomes},
                  key=lambda n: config.tiers[n].priority if n in config.tiers else 99)


def _legend_below(fig: Any, ax: Any, ncol: int) -> None:
    """One legend for the figure, under the plots: inside an axes it covered the curves where they
    crowd (a CDF's top, where kvgate and the ideal row overlap)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=max(1, min(ncol, 5)), fontsize=8, frameon=False)


def _bins(sums: list[Summary]) -> tuple[float, int]:
    horizon = max((o.req.t for s in sums for o in s.result.outcomes), default=0.0)
    bin_s = float(max(1, round(horizon / 60)))
    return bin_s, int(horizon // bin_s) + 1


def cdf_figure(sums: list[Summary], config: Config, plt: Any, colors: list[str]) -> Any:
    """TTFT CDF per SLA tier, a line per policy, the tier's target dashed (read: where each line crosses
    it). Share of *offered* requests: a policy that refuses never reaches 1.0."""
    tiers = _tiers(sums, config)
    fig, axes = plt.subplots(1, max(1, len(tiers)), figsize=(4.6 * max(1, len(tiers)), 4.3), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=False):
        target = config.tiers[tier].ttft_target_ms if tier in config.tiers else None
        for i, s in enumerate(sums):
            offered = [o for o in s.result.outcomes if o.tier == tier]
            xs = sorted(o.ttft for o in offered if o.status == 200 and o.ttft is not None)
            if xs:
                ax.step(xs, [(k + 1) / len(offered) for k in range(len(xs))], where="post",
                        color=colors[i % len(colors)], label=s.label)
        if target:
            ax.axvline(target / 1000, color="black", linestyle="--", linewidth=1.2)
            ax.annotate(f"target {target} ms", (target / 1000, 0.02), rotation=90, fontsize=8, ha="right",
                        va="bottom")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"tier {tier}", fontsize=10)
        ax.set_xlabel("TTFT (s, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("share of offered requests served by then")
    _legend_below(fig, axes[0][0], len(sums))
    return fig


def ttft_time_figure(sums: list[Summary], config: Config, plt: Any, colors: list[str]) -> Any:
    """p99 TTFT over time per SLA tier, a line per policy, the target dashed: when a disturbance (a
    flood, a slow node, a peak) hurts whom, and for how long, which a CDF over the whole run hides."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    tiers = _tiers(sums, config)
    bin_s, n = _bins(sums)
    fig, axes = plt.subplots(len(tiers) or 1, 1, figsize=(13, 2.6 * max(1, len(tiers)) + 0.8), squeeze=False,
                             sharex=True)
    for ax, tier in zip((row[0] for row in axes), tiers, strict=False):
        target = config.tiers[tier].ttft_target_ms if tier in config.tiers else None
        for i, s in enumerate(sums):
            per: list[list[float]] = [[] for _ in range(n)]
            for o in s.result.outcomes:
                if o.tier == tier and o.status == 200 and o.ttft is not None:
                    per[int(o.req.t // bin_s)].append(o.ttft)
            pts = [(k * bin_s, q) for k, xs in enumerate(per) if (q := percentile(xs, 99)) is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], color=colors[i % len(colors)], label=s.label,
                        linewidth=1.4, drawstyle="steps-post")
        if target:
            ax.axhline(target / 1000, color="black", linestyle="--", linewidth=1.2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(f"tier {tier}\nTTFT p99 (s)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[-1][0].set_xlabel(f"time (s; p99 of the requests sent in each {bin_s:g} s)")
    _legend_below(fig, axes[0][0], len(sums))
    return fig


def rejections_figure(sums: list[Summary], plt: Any, colors: list[str]) -> Any | None:
    """Who got refused and why, over time: per policy that refused anything, 429 (policy) vs 503
    (capacity) on the left and by tenant on the right. None when nobody refused anything."""
    if not refused(sums):
        return None
    bin_s, n = _bins(sums)
    xs_t = [i * bin_s for i in range(n)]
    tenants = sorted({o.req.tenant for s in sums for o in s.result.outcomes})
    shown = [s for s in sums if any(o.status in (429, 503) for o in s.result.outcomes)]
    quiet = [s.label for s in sums if s not in shown]
    fig, axes = plt.subplots(len(shown), 2, figsize=(13, 2.4 * len(shown) + 1.4), squeeze=False, sharex=True)
    for row, s in zip(axes, shown, strict=True):
        by_code = {429: [0.0] * n, 503: [0.0] * n}
        by_tenant = {t: [0.0] * n for t in tenants}
        for o in s.result.outcomes:
            if o.status in (429, 503):
                b = int(o.req.t // bin_s)
                by_code[o.status][b] += 1 / bin_s
                by_tenant[o.req.tenant][b] += 1 / bin_s
        row[0].stackplot(xs_t, by_code[429], by_code[503], labels=["429 policy (tenant over quota)",
                                                                  "503 capacity (fleet full)"],
                         colors=["#f0a030", "#d03030"], step="post")
        row[1].stackplot(xs_t, *by_tenant.values(), labels=tenants, step="post",
                         colors=[colors[i % len(colors)] for i in range(len(tenants))])
        row[0].set_ylabel(f"{s.label}\nrejections/s", fontsize=9)
        for ax in row:
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    axes[0][0].set_title("by status", fontsize=10)
    axes[0][1].set_title("by tenant (429 + 503)", fontsize=10)
    axes[0][0].legend(fontsize=8, loc="upper left")
    axes[0][1].legend(fontsize=8, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel(f"time (s; {bin_s:g} s bins)")
    if quiet:
        fig.text(0.5, 0.005, f"no 429 or 503 at all: {', '.join(quiet)}", ha="center", va="bottom", fontsize=9)
    return fig


def nodes_figure(sums: list[Summary], plt: Any, colors: list[str]) -> Any | None:
    """Nodes over time per policy: the whole fleet, or each model pool's own (each pool scales on its
    own). None when no policy's fleet changes size (flat lines say nothing the tables do not)."""
    if not fleet_changes(sums):
        return None
    pools = _pools(sums)
    fig, axes = plt.subplots(len(pools), 1, figsize=(13, 3.2 * len(pools) + 0.6), squeeze=False, sharex=True)
    for ax, pool in zip((row[0] for row in axes), pools, strict=True):
        for i, s in enumerate(sums):
            tl = _timeline(s, pool)
            if tl is None:
                continue
            ax.step([t for t, _ in tl] + [s.result.duration_s], [c for _, c in tl] + [tl[-1][1]], where="post",
                    color=colors[i % len(colors)], label=s.label, linewidth=2 - 0.25 * i)
        ax.set_ylabel("nodes provisioned" if pool is None else f"pool {pool}: nodes")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("time (s)")
    _legend_below(fig, axes[0][0], len(sums))
    return fig


def plots(name: str, sums: list[Summary], out: Path, config: Config | None = None) -> list[Path]:
    """The figures a platform engineer reads at a glance, one PNG each, only those with something to show
    (:func:`plot_notes` says why one is left out):

    * ``NAME-latency-cdf.png``: TTFT CDF per SLA tier against the tier's target (:func:`cdf_figure`);
    * ``NAME-ttft-over-time.png``: p99 TTFT over time per tier (:func:`ttft_time_figure`);
    * ``NAME-rejections.png``: who got refused and why, over time (:func:`rejections_figure`);
    * ``NAME-nodes.png``: fleet size over time, when it changes (:func:`nodes_figure`).

    ``config``: kvgate's config of the scenario, for the tiers' targets (default: the default tiers).
    Returns [] when matplotlib is not installed."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if config is None:
        from ext_proc.config import parse_config

        config = parse_config({})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figures = [("TTFT CDF per tier (dashed: the tier's TTFT target)", "latency-cdf",
                cdf_figure(sums, config, plt, colors)),
               ("p99 TTFT over time per tier (dashed: the target)", "ttft-over-time",
                ttft_time_figure(sums, config, plt, colors)),
               ("rejections over time", "rejections", rejections_figure(sums, plt, colors)),
               ("fleet size" if _pools(sums) == [None] else "nodes per pool", "nodes", nodes_figure(sums, plt, colors))]
    paths = []
    for title, what, fig in figures:
        if fig is None:
            continue
        fig.suptitle(f"{name}: {title}", fontsize=12)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        p = out / f"{name}-{what}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def prediction_errors(r: RunResult) -> dict[str, dict[str, float]]:
    """Node profile → the median relative error of kvgate's TTFT predictions on nodes of it
    (``RunResult.prediction_errors``): ``abs``, the median of |error|, and ``bias``, the median signed
    error (> 0: predicted later than it came) — how well each node's own prior, and the speed it
    learned, predict. A request arrives at a random point of the step in progress, so part of
    ``abs`` is noise no prior removes; a wrong prior shows as bias."""
    return {name: {"abs": statistics.median(abs(e) for e in errs), "bias": statistics.median(errs)}
            for name, errs in sorted(r.prediction_errors.items()) if errs}


def prediction_table(errors: dict[str, dict[str, dict[str, float]]]) -> str:
    """The markdown table of ``prediction_errors`` per policy (a mixed-node scenario)."""
    kinds = sorted({k for e in errors.values() for k in e})
    lines = ["TTFT predictions per node kind, predicted at dispatch against measured at the node: median "
             "|error| (median signed error, > 0 late):", "",
             "| policy | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for label, e in errors.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{100 * e[k]['abs']:.1f}% ({100 * e[k]['bias']:+.1f}%)" if k in e else "-" for k in kinds) + " |")
    return "\n".join(lines)


def lora_table(loads: dict[str, dict[str, int]]) -> str:
    """The markdown table of a LoRA scenario's adapter loads per policy (``ScenarioResult.lora_loads``)."""
    lines = ["LoRA adapters loaded by the nodes (from disk; copied into a GPU slot):", "",
             "| policy | loads | slot copies |", "|---|---|---|"]
    lines += [f"| {label} | {v['loads']} | {v['swaps']} |" for label, v in loads.items()]
    return "\n".join(lines)
