"""What a run means: latency percentiles per tier and tenant, SLO attainment, goodput, rejections by
reason, fairness, GPU-hours; printed as Markdown tables (readable in a terminal too), with PNG plots.

Definitions (also in the README):

* TTFT and e2e are measured from the client's arrival, gateway queueing included, over the requests
  that were admitted; a rejection has no latency but counts against SLO attainment.
* SLO attainment of a tier: the share of its *offered* requests that got their first token within the
  tier's ``ttft_target_ms`` (kvgate's tier config; 200 ms / 1 s / 5 s by default).
* Goodput: requests within SLO per second of the run, and per GPU (GPU-seconds / run time = GPUs on
  average).
* Fairness: Jain's index of the weighted tokens each tenant was served, each divided by its weighted
  max-min fair share of the total that was served (so a tenant that asked for less than its share is
  not "unfair" by being served less). 1.0 = every tenant got its fair share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ext_proc.config import Config

from .driver import Outcome, RunResult


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

    def to_json(self) -> dict[str, Any]:
        a = self.all
        return {
            "policy": self.label, "gpu_hours": round(self.gpu_hours, 4), "avg_gpus": round(self.avg_gpus, 3),
            "offered": a.offered, "admitted": a.admitted, "rejected_429": a.rejected_policy,
            "rejected_503": a.rejected_capacity, "lost": self.result.lost,
            "ttft_p50_p95_p99": a.ttft, "e2e_p50_p95_p99": a.e2e, "slo_attainment": a.slo,
            "goodput_rps": self.goodput, "goodput_per_gpu": self.goodput_per_gpu, "jain": self.fairness,
            "breaker_opens": self.result.breaker_opens,
            "tiers": {t: {"ttft_p50_p95_p99": g.ttft, "slo_attainment": g.slo, "offered": g.offered,
                          "admitted": g.admitted} for t, g in self.tiers.items()},
            "tenants": {t: {"offered": g.offered, "admitted": g.admitted, "rejected_429": g.rejected_policy,
                            "rejected_503": g.rejected_capacity} for t, g in self.tenants.items()},
            "reasons": self.reasons}


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
                   served)


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
                     "-" if s.fairness is None else f"{s.fairness:.2f}", str(s.result.breaker_opens)])
    return table(["policy", "GPUs (avg)", "GPU-h", "offered", "admitted", "429", "503", "lost",
                   "TTFT p50 / p99", "e2e p99", "SLO met", "goodput req/s", "per GPU", "Jain",
                   "breaker opens"], rows)


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


def reasons(sums: list[Summary]) -> str:
    keys = sorted({k for s in sums for k in s.reasons})
    if not keys:
        return "(no rejections)"
    return table(["policy", *keys], [[s.label, *(str(s.reasons.get(k, 0)) for k in keys)] for s in sums])


# -- plots -----------------------------------------------------------------------------------------

def plots(name: str, sums: list[Summary], out: Path, bin_s: float = 10.0) -> list[Path]:
    """Latency CDFs per policy, reject rate over time, and (when it changes) the fleet size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # an optional extra: pip install 'kvgate[bench]'
        return []

    def save(fig: Any, axes: list[Any], xlabel: str | None, ylabel: str, title: str, what: str) -> Path:
        for ax in axes:
            if xlabel is not None:
                ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{name}: {title}")
        fig.tight_layout()
        p = out / f"{name}-{what}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        return p

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (attr, label) in zip(axes, (("ttft", "TTFT"), ("e2e", "e2e latency")), strict=True):
        ax.set_xlabel(f"{label} (s, log)")
        ax.set_xscale("log")
        for s in sums:
            xs = sorted(getattr(o, attr) for o in s.result.outcomes if getattr(o, attr) is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=s.label)
    paths.append(save(fig, list(axes), None, "share of admitted requests", "latency CDFs", "latency-cdf"))

    fig, ax = plt.subplots(figsize=(12, 4))
    for s in sums:
        rs = s.result.outcomes
        n = int(max((o.req.t for o in rs), default=0.0) // bin_s) + 1
        tot, rej = [0] * n, [0] * n
        for o in rs:
            b = int(o.req.t // bin_s)
            tot[b] += 1
            rej[b] += 1 if o.status not in (0, 200) else 0
        ax.plot([i * bin_s for i in range(n)], [r / t if t else 0 for r, t in zip(rej, tot, strict=True)],
                label=s.label)
    paths.append(save(fig, [ax], "time (s)", f"rejected share ({bin_s:g} s bins)", "rejections over time",
                      "rejections"))

    moving = [s for s in sums if len(s.result.node_timeline) > 1]
    if moving:
        fig, ax = plt.subplots(figsize=(12, 3.5))
        for s in moving:
            tl = s.result.node_timeline
            ax.step([t for t, _ in tl] + [s.result.duration_s], [c for _, c in tl] + [tl[-1][1]], where="post",
                    label=s.label)
        paths.append(save(fig, [ax], "time (s)", "nodes provisioned", "fleet size", "nodes"))
    return paths
