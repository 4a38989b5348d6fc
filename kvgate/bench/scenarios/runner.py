"""``kvgate bench scenarios``: every policy of a scenario over the same trace, side by side, in one run.

A user's own traffic runs the same way: ``--trace FILE`` (see ``trace.py``) with ``--config FILE``, a
bench config naming the node profile, the fleet size, kvgate's config and (optionally) the policies::

    profile: 8b-h100          # one of ext_proc.profiles (kvgate sim --profile)
    nodes: 2                  # the fleet each static policy gets
    kvgate: {tenants: [...]}  # kvgate's config (a nodes section is added if missing)
    policies: [none, kv-shed, kvgate, autoscale-only, kvgate+scaler]
    max_nodes: 16             # for the autoscaling policies

With ``pools`` in kvgate's config, each pool runs its own simulated nodes (of the pool's
``nodes.performance.profile``, else ``profile``) and the trace's ``model`` picks the pool; ``pools:``
here sizes each (default: ``nodes``, ``min_nodes``, ``max_nodes``)::

    kvgate: {pools: [{name: small, models: [llama-8b], nodes: {static: [...], performance: {profile: 8b-h100}}},
                     {name: large, models: [llama-70b], nodes: {...}}], tenants: [...]}
    pools: {small: {nodes: 2}, large: {nodes: 1, max_nodes: 4}}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ext_proc.config import Config, ConfigError, config_error, load_yaml, parse_config
from ext_proc.profiles import PROFILES, get_profile
from scaler.law import LawSettings

from . import report
from .driver import Autoscaling, Policy, PoolSize, simulate
from .trace import TraceRequest, read_trace
from .workloads import PLACEHOLDER_NODES, Ideal, Scenario, get_scenario

PolicyName = Literal["none", "kv-shed", "kvgate", "autoscale-only", "kvgate+scaler"]
DEFAULT_POLICIES: tuple[PolicyName, ...] = ("none", "kv-shed", "kvgate")


class ScalerSettings(BaseModel):
    """The scaler's control law and the autoscalers' timing in a bench config (``scaler:``); defaults as
    ``kvgate scaler``'s own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: Annotated[int, Field(ge=1)] = 2
    scale_up_threshold: Annotated[float, Field(gt=0, le=1)] = 0.25
    scale_down_threshold: Annotated[float, Field(ge=0, le=1)] = 0.05
    cooldown_s: Annotated[float, Field(ge=0)] = 600.0
    warm_pool: Annotated[int, Field(ge=0)] = 0
    window_s: Annotated[float, Field(gt=0)] = 60.0
    """The scaler's signal window."""
    interval_s: Annotated[float, Field(gt=0)] = 15.0
    """KEDA's pollingInterval (both autoscalers)."""
    waiting_per_node: Annotated[float, Field(gt=0)] = 4.0
    """autoscale-only: requests waiting in vLLM per node (its HPA target)."""
    kv_usage_per_node: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.5, description="autoscale-only's second HPA trigger: vLLM's KV-cache usage per node (0..1, "
        "AverageValue of the nodes' sum); the HPA follows whichever trigger asks for more nodes")
    scale_down_window_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=300.0, description="autoscale-only: the HPA's scale-down stabilisation window (Kubernetes' "
        "default 300 s; 0-3600 as the HPA allows)")
    law_scale_down_window_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=300.0, description="kvgate+scaler: how far back the law reads the peak load a scale-down must fit "
        "(the scaler's ``scale_down_window_seconds``; 0: only since the unmet rate went low)")
    law_behind_hpa: bool = Field(
        default=True, description="kvgate+scaler: the law's count goes through the HPA the chart renders (10% "
        "tolerance; up at once; down one pod per 15 s, to the highest count asked over the cooldown), as in a "
        "cluster; false: straight to the fleet, as it is (and the law assumes no HPA tolerance)")
    concentration: Annotated[float, Field(gt=0, le=1)] = 0.8
    trend_window_s: Annotated[float, Field(gt=0)] = 60.0
    spread_share: Annotated[float, Field(gt=0, le=1)] = 0.30
    spread_tenants: Annotated[float, Field(gt=0, le=1)] = 0.5
    scale_down_kv_usage: Annotated[float, Field(gt=0, le=1)] = 0.45
    warm_pool_kv_usage: Annotated[float, Field(gt=0, le=1)] = 0.55
    scale_down_prefill_usage: Annotated[float, Field(gt=0, le=1)] = 0.3

    @model_validator(mode="after")
    def _kv_bounds(self) -> ScalerSettings:
        if self.scale_down_kv_usage >= self.warm_pool_kv_usage:
            raise ValueError("scaler.scale_down_kv_usage: must be below scaler.warm_pool_kv_usage (else the law flaps)")
        return self


class PoolBench(BaseModel):
    """One model pool's fleet in a bench config (``pools.NAME``); unset: the top-level figure."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: Annotated[int, Field(ge=1, le=64)] | None = None
    min_nodes: Annotated[int, Field(ge=1, le=64)] | None = None
    max_nodes: Annotated[int, Field(ge=1, le=256)] | None = None


class IdealBench(BaseModel):
    """The ideal row of a ``--trace`` run (``ideal:`` in a bench config): policy none on the static fleet,
    offered only the requests of the tiers kvgate protects, so the row is the bar for those tenants —
    what they get on the same nodes when nobody else is there (the noisy-neighbour scenario's ideal,
    for any trace)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="add the ideal row to a --trace run")
    nodes: Annotated[int, Field(ge=1, le=64)] | None = Field(
        default=None, description="the ideal row's fleet (each pool's, with pools); default: nodes (and each "
        "pool's size), the static policies' fleet")
    tiers: list[str] | None = Field(
        default=None, min_length=1, description="the SLA tiers whose tenants the ideal row is offered; default: "
        "the most urgent tier (lowest priority number) that has requests in the trace")


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str = "8b-h100"
    nodes: Annotated[int, Field(ge=1, le=64)] = 2
    """The static policies' fleet, and where the autoscaling ones start."""
    min_nodes: Annotated[int, Field(ge=1, le=64)] = 1
    max_nodes: Annotated[int, Field(ge=1, le=256)] = 16
    kvgate: dict[str, Any] = Field(default_factory=dict)
    policies: list[PolicyName] = Field(default_factory=lambda: list(DEFAULT_POLICIES))
    scaler: ScalerSettings = ScalerSettings()
    seed: int = 1
    pools: dict[str, PoolBench] = Field(default_factory=dict)
    """Each model pool's fleet (kvgate's config with ``pools``), by pool name."""
    node_profiles: list[str] = Field(
        default_factory=list, description="a pool of mixed nodes: the k-th node runs node_profiles[k % len] and "
        "its probe reports that profile's GPU (kvgate detects each node's prior); empty: every node runs profile")
    ideal: IdealBench = Field(default_factory=IdealBench, description="the ideal row of a --trace run")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="the simulated nodes' vLLM --long-prefill-token-threshold (0: off, vLLM's "
        "default); kvgate's performance prior gets it too unless kvgate's config sets nodes.performance")

    def pool_sizes(self) -> tuple[PoolSize, ...]:
        """Every pool of kvgate's config, sized by ``pools`` or the top-level figures."""
        out = []
        for p in self.kvgate.get("pools") or []:
            b = self.pools.get(p["name"], PoolBench())
            n = b.nodes if b.nodes is not None else self.nodes
            top = max(b.max_nodes if b.max_nodes is not None else self.max_nodes, n)
            out.append(PoolSize(p["name"], n, min(b.min_nodes if b.min_nodes is not None else self.min_nodes, n), top))
        return tuple(out)

    def policy_list(self) -> tuple[Policy, ...]:
        n, top = self.nodes, max(self.max_nodes, self.nodes)
        low = min(self.min_nodes, n)
        pools = self.pool_sizes()
        known = {"none": Policy("none", n, pools=pools), "kv-shed": Policy("kv-shed", n, "kv-shed", pools=pools),
                 "kvgate": Policy("kvgate", n, "kvgate", pools=pools),
                 "autoscale-only": Policy("autoscale-only", n, autoscale="queue", min_nodes=low, max_nodes=top,
                                          pools=pools),
                 "kvgate+scaler": Policy("kvgate+scaler", n, "kvgate", autoscale="scaler", min_nodes=low,
                                         max_nodes=top, pools=pools)}
        return tuple(known[p] for p in self.policies)

    def autoscaling(self) -> Autoscaling:
        s = self.scaler
        law = LawSettings(min_replicas=min(self.min_nodes, self.nodes), max_replicas=max(self.max_nodes, self.nodes),
                          step=s.step, scale_up_threshold=s.scale_up_threshold,
                          scale_down_threshold=s.scale_down_threshold, cooldown_s=s.cooldown_s, warm_pool=s.warm_pool,
                          concentration=s.concentration, trend_window_s=s.trend_window_s, spread_share=s.spread_share,
                          spread_tenants=s.spread_tenants, scale_down_kv_usage=s.scale_down_kv_usage,
                          warm_pool_kv_usage=s.warm_pool_kv_usage,
                          scale_down_prefill_usage=s.scale_down_prefill_usage, window_s=s.window_s,
                          scale_down_window_s=s.law_scale_down_window_s)
        return Autoscaling(interval_s=s.interval_s, waiting_per_node=s.waiting_per_node, window_s=s.window_s, law=law,
                           kv_usage_per_node=s.kv_usage_per_node, scale_down_window_s=s.scale_down_window_s,
                           law_behind_hpa=s.law_behind_hpa)


def load_bench_config(path: str | Path) -> BenchConfig:
    p = Path(path)
    try:
        doc = load_yaml(p.read_text(), str(p), allow_empty=True)  # duplicate keys are errors
    except OSError as e:
        raise ConfigError(f"{p}: cannot read bench config: {e.strerror}") from None
    try:
        cfg = BenchConfig.model_validate(doc)
    except ValidationError as e:
        raise config_error(e, f"{p}: invalid bench configuration") from None
    for field_name, name in [("profile", cfg.profile), *(("node_profiles", n) for n in cfg.node_profiles)]:
        if name not in PROFILES:
            raise ConfigError(f"{p}: invalid bench configuration\n  {field_name}: unknown profile {name!r}; "
                              f"known: {', '.join(PROFILES)}")
    kv = dict(cfg.kvgate)
    if not kv.get("pools"):  # with pools each pool lists its own nodes (a top-level nodes is an error)
        kv.setdefault("nodes", PLACEHOLDER_NODES)
    try:
        parsed = parse_config(kv)
    except ConfigError as e:
        raise ConfigError(f"{p}: kvgate: {e}") from None
    bad = [t for t in cfg.ideal.tiers or [] if t not in parsed.tiers]
    if bad:
        raise ConfigError(f"{p}: invalid bench configuration\n  ideal.tiers: no tier named {', '.join(bad)} in "
                          f"kvgate's config (tiers: {', '.join(parsed.tiers)})")
    unknown = sorted(set(cfg.pools) - {pool.name for pool in parsed.pools})
    if unknown:
        known = ", ".join(pool.name for pool in parsed.pools)
        raise ConfigError(f"{p}: invalid bench configuration\n  pools: {', '.join(unknown)}: no such pool in "
                          + (f"kvgate.pools (known: {known})" if known else "kvgate's config (it has no pools)"))
    return cfg.model_copy(update={"kvgate": kv})


def from_trace(trace_path: str | Path, cfg: BenchConfig) -> tuple[Scenario, list[TraceRequest]]:
    trace = read_trace(trace_path)
    # times count from the first request: a trace of absolute (epoch) timestamps works as it is
    t0 = trace[0].t
    if t0:
        trace = [replace(r, t=r.t - t0) for r in trace]
    name = Path(trace_path).stem
    sc = Scenario(name, f"Trace {Path(trace_path).name}",
                  f"{len(trace)} requests from {trace_path}, {cfg.profile} nodes.", cfg.profile,
                  trace[-1].t, cfg.kvgate, cfg.policy_list(), (), seed=cfg.seed, autoscaling=cfg.autoscaling(),
                  node_profiles=tuple(cfg.node_profiles), ideal=trace_ideal(cfg, trace),
                  long_prefill_token_threshold=cfg.long_prefill_token_threshold)
    return sc, trace


def trace_ideal(cfg: BenchConfig, trace: list[TraceRequest]) -> Ideal | None:
    """The ideal row of a trace run (``IdealBench``): the built-in scenarios each hand-set theirs from
    the disturbance they stage; a trace has no staged disturbance, only tenants disturbing each other,
    so its bar is the protected tier alone on the same fleet. None: ``ideal.enabled`` is off."""
    spec = cfg.ideal
    if not spec.enabled:
        return None
    config = parse_config(cfg.kvgate)
    tiers = spec.tiers
    if tiers is None:
        present = {t.tier if (t := config.tenant(r.tenant)) is not None else config.lowest_tier for r in trace}
        tiers = [min(present, key=lambda n: config.tiers[n].priority)]
    n = spec.nodes if spec.nodes is not None else cfg.nodes
    pools = tuple(replace(p, nodes=spec.nodes) for p in cfg.pool_sizes()) if spec.nodes is not None \
        else cfg.pool_sizes()
    return Ideal(n, tiers=tuple(tiers), pools=pools)


@dataclass
class ScenarioResult:
    scenario: Scenario
    config: Config
    requests: int
    summaries: list[report.Summary]
    seconds: float
    """Wall-clock time the whole comparison took."""
    ideal_note: str = ""
    """What the ideal row (if any) was offered, in words."""
    ideal_scope: dict[str, Any] | None = None
    """The same for ``--json``: the ideal entry's ``ideal_scope``."""
    references: list[report.Summary] = field(default_factory=list)
    """The scenario's reference runs (``Scenario.reference``): each policy over the trace without the
    left-out streams; kept apart from ``summaries``, which are all over the one trace."""
    reference_requests: int = 0
    prediction_errors: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """Mixed nodes (``Scenario.node_profiles``): per policy with predictions, each node profile's median
    relative error of kvgate's TTFT predictions (``report.prediction_errors``)."""
    lora_loads: dict[str, dict[str, int]] = field(default_factory=dict)
    """LoRA scenarios (``Scenario.engine.max_loras``): per policy, the adapters its nodes loaded from disk
    (``loads``) and copied into a GPU slot (``swaps``)."""

    def markdown(self) -> str:
        sc = self.scenario
        parts = [f"## {sc.title}", "", sc.about, ""]
        if sc.guide:
            parts += [f"The field guide: {sc.guide}", ""]
        parts += [f"{self.requests} requests, seed {sc.seed}; simulated in {self.seconds:.1f} s of wall time.", "",
                  report.overview(self.summaries), ""]
        if sc.ideal is not None:
            parts += [self.ideal_note, ""]
        pooled = any(s.pools for s in self.summaries)
        if pooled:
            parts += ["Per model pool (the requests routed to it; its nodes at the start / at most / on average; "
                      "what its nodes were sent, counted at the nodes):", "", report.by_pool(self.summaries), "",
                      "Nodes per pool over time:", "", report.pool_timelines(self.summaries), ""]
        ref = sc.reference
        if ref is not None and self.references:
            parts += [ref.describe(sc), "",
                      f"{self.reference_requests} requests [{ref.label}]:", "", report.overview(self.references), ""]
            if pooled:
                parts += [f"Per pool, as run / [{ref.label}]:", "",
                          report.against_reference(self.summaries, self.references, ref.label), "",
                          f"Nodes per pool over time [{ref.label}]:", "", report.pool_timelines(self.references), ""]
        if self.prediction_errors:
            parts += [report.prediction_table(self.prediction_errors), ""]
        if self.lora_loads:
            parts += [report.lora_table(self.lora_loads), ""]
        parts += ["Per SLA tier:", "", report.by_tier(self.summaries), "",
                  "Per tenant:", "", report.by_tenant(self.summaries), "", "Rejections by reason:", "",
                  report.reasons(self.summaries), ""]
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        doc = {"scenario": self.scenario.name, "requests": self.requests, "seed": self.scenario.seed,
               "policies": [{**s.to_json(), **({"ideal_scope": self.ideal_scope} if s.ideal else {})}
                            for s in self.summaries]}
        ref = self.scenario.reference
        if ref is not None and self.references:  # additive: only a scenario with reference runs has these
            doc["references"] = [s.to_json() for s in self.references]
            doc["reference_scope"] = {"label": ref.label, "requests": self.reference_requests,
                                      "without": [{"tenant": self.scenario.streams[i].tenant,
                                                   "model": self.scenario.streams[i].model} for i in ref.without]}
        if self.prediction_errors:  # additive: only a scenario of mixed nodes has these
            doc["ttft_prediction_median_error"] = self.prediction_errors
        if self.lora_loads:  # additive: only a LoRA scenario has these
            doc["lora_adapter_loads"] = self.lora_loads
        return doc


def run(sc: Scenario, trace: list[TraceRequest] | None = None, scale: float = 1.0) -> ScenarioResult:
    """Every policy of the scenario over one trace."""
    t0 = time.perf_counter()
    config = parse_config(sc.config)
    given = trace is not None
    trace = trace if trace is not None else sc.trace(scale)
    profile = get_profile(sc.profile)
    degrade = tuple(replace(d, at=d.at * scale) for d in sc.degrade)
    sums = []
    errors: dict[str, dict[str, dict[str, float]]] = {}
    loras: dict[str, dict[str, int]] = {}
    engine = sc.engine_options()
    for p in sc.policies:
        r = simulate(config, p, profile, trace, sc.seed, autoscaling=sc.autoscaling, degrade=degrade,
                     cold_start_s=sc.cold_start_s, node_profiles=sc.node_profiles, engine=engine)
        sums.append(report.summarize(r, config))
        if r.prediction_errors:
            errors[p.label] = report.prediction_errors(r)
        if sc.engine is not None and sc.engine.max_loras is not None:
            loras[p.label] = {"loads": r.lora_loads, "swaps": r.lora_swaps}
    note, scope = "", None
    if sc.ideal is not None:  # the reference: policy none, no disturbance, same seed, same run
        ideal = sc.ideal
        outages = ideal.scaled(scale)
        r = simulate(config, ideal.policy, profile, ideal.offered(config, trace), sc.seed,
                     autoscaling=sc.autoscaling, outages=outages, cold_start_s=sc.cold_start_s, engine=engine)
        sums.append(report.summarize(r, config))
        kept, removed = ideal.tenants(config, trace)
        note = ideal.describe(config, trace, scale)
        scope = {"nodes": ideal.nodes, "tenants": kept, "not_offered": removed,
                 "out": [{"node": o.node, "start": o.start, "end": o.end} for o in outages]}
    refs: list[report.Summary] = []
    offered = 0
    if sc.reference is not None and not given:  # the scenario's own trace, less the left-out streams
        calm = sc.reference_trace(scale)
        offered = len(calm)
        for p in sc.policies:
            r = simulate(config, replace(p, reference=sc.reference.label), profile, calm, sc.seed,
                         autoscaling=sc.autoscaling, degrade=degrade, cold_start_s=sc.cold_start_s, engine=engine)
            refs.append(report.summarize(r, config))
    return ScenarioResult(sc, config, len(trace), sums, time.perf_counter() - t0, note, scope, refs, offered,
                          errors, loras)


def write_report(results: list[ScenarioResult], out: Path, plots: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# kvgate benchmark scenarios", "",
             "Virtual time, kvgate's own decision core in front of simulated vLLM nodes; `kvgate bench "
             "scenarios` reproduces every figure (fixed seeds).", ""]
    for r in results:
        lines.append(r.markdown())
        if plots:
            for p in report.plots(r.scenario.name, r.summaries, out, r.config):
                lines += [f"![{p.stem}]({p.name})", ""]
            if report.plots_available():
                lines += [f"*{n}*\n" for n in report.plot_notes(r.summaries)]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=2))
    return md


def scenario_names(names: list[str] | None) -> list[Scenario]:
    from .workloads import SCENARIOS

    return [get_scenario(n) for n in (names or list(SCENARIOS))]
