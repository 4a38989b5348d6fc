"""``kvgate bench scenarios``: every policy of a scenario over the same trace, side by side, in one run.

A user's own traffic runs the same way: ``--trace FILE`` (see ``trace.py``) with ``--config FILE``, a
bench config naming the node profile, the fleet size, kvgate's config and (optionally) the policies::

    profile: 8b-h100          # one of sim.profiles (kvgate sim --profile)
    nodes: 2                  # the fleet each static policy gets
    kvgate: {tenants: [...]}  # kvgate's config (a nodes section is added if missing)
    policies: [none, kv-shed, kvgate, autoscale-only, kvgate+scaler]
    max_nodes: 16             # for the autoscaling policies
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ext_proc.config import Config, ConfigError, config_error, load_yaml, parse_config
from scaler.law import LawSettings
from sim.profiles import PROFILES, get_profile

from . import report
from .driver import Autoscaling, Policy, simulate
from .trace import TraceRequest, read_trace
from .workloads import PLACEHOLDER_NODES, Scenario, get_scenario

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
    concentration: Annotated[float, Field(gt=0, le=1)] = 0.8
    trend_window_s: Annotated[float, Field(gt=0)] = 60.0
    spread_share: Annotated[float, Field(gt=0, le=1)] = 0.30
    spread_tenants: Annotated[float, Field(gt=0, le=1)] = 0.5
    scale_down_kv_usage: Annotated[float, Field(gt=0, le=1)] = 0.45
    warm_pool_kv_usage: Annotated[float, Field(gt=0, le=1)] = 0.55

    @model_validator(mode="after")
    def _kv_bounds(self) -> ScalerSettings:
        if self.scale_down_kv_usage >= self.warm_pool_kv_usage:
            raise ValueError("scaler.scale_down_kv_usage: must be below scaler.warm_pool_kv_usage (else the law flaps)")
        return self


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

    def policy_list(self) -> tuple[Policy, ...]:
        n, top = self.nodes, max(self.max_nodes, self.nodes)
        low = min(self.min_nodes, n)
        known = {"none": Policy("none", n), "kv-shed": Policy("kv-shed", n, "kv-shed"),
                 "kvgate": Policy("kvgate", n, "kvgate"),
                 "autoscale-only": Policy("autoscale-only", n, autoscale="queue", min_nodes=low, max_nodes=top),
                 "kvgate+scaler": Policy("kvgate+scaler", n, "kvgate", autoscale="scaler", min_nodes=low,
                                         max_nodes=top)}
        return tuple(known[p] for p in self.policies)

    def autoscaling(self) -> Autoscaling:
        s = self.scaler
        law = LawSettings(min_replicas=min(self.min_nodes, self.nodes), max_replicas=max(self.max_nodes, self.nodes),
                          step=s.step, scale_up_threshold=s.scale_up_threshold,
                          scale_down_threshold=s.scale_down_threshold, cooldown_s=s.cooldown_s, warm_pool=s.warm_pool,
                          concentration=s.concentration, trend_window_s=s.trend_window_s, spread_share=s.spread_share,
                          spread_tenants=s.spread_tenants, scale_down_kv_usage=s.scale_down_kv_usage,
                          warm_pool_kv_usage=s.warm_pool_kv_usage, window_s=s.window_s)
        return Autoscaling(interval_s=s.interval_s, waiting_per_node=s.waiting_per_node, window_s=s.window_s, law=law)


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
    if cfg.profile not in PROFILES:
        raise ConfigError(f"{p}: invalid bench configuration\n  profile: unknown profile {cfg.profile!r}; "
                          f"known: {', '.join(PROFILES)}")
    kv = dict(cfg.kvgate)
    kv.setdefault("nodes", PLACEHOLDER_NODES)
    try:
        parse_config(kv)
    except ConfigError as e:
        raise ConfigError(f"{p}: kvgate: {e}") from None
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
                  trace[-1].t, cfg.kvgate, cfg.policy_list(), (), seed=cfg.seed, autoscaling=cfg.autoscaling())
    return sc, trace


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

    def markdown(self) -> str:
        sc = self.scenario
        parts = [f"## {sc.title}", "", sc.about, ""]
        if sc.guide:
            parts += [f"The field guide: {sc.guide}", ""]
        parts += [f"{self.requests} requests, seed {sc.seed}; simulated in {self.seconds:.1f} s of wall time.", "",
                  report.overview(self.summaries), ""]
        if sc.ideal is not None:
            parts += [self.ideal_note, ""]
        parts += ["Per SLA tier:", "", report.by_tier(self.summaries), "",
                  "Per tenant:", "", report.by_tenant(self.summaries), "", "Rejections by reason:", "",
                  report.reasons(self.summaries), ""]
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario.name, "requests": self.requests, "seed": self.scenario.seed,
                "policies": [{**s.to_json(), **({"ideal_scope": self.ideal_scope} if s.ideal else {})}
                             for s in self.summaries]}


def run(sc: Scenario, trace: list[TraceRequest] | None = None, scale: float = 1.0) -> ScenarioResult:
    """Every policy of the scenario over one trace."""
    t0 = time.perf_counter()
    config = parse_config(sc.config)
    trace = trace if trace is not None else sc.trace(scale)
    profile = get_profile(sc.profile)
    degrade = tuple(replace(d, at=d.at * scale) for d in sc.degrade)
    sums = []
    for p in sc.policies:
        r = simulate(config, p, profile, trace, sc.seed, autoscaling=sc.autoscaling, degrade=degrade,
                     cold_start_s=sc.cold_start_s)
        sums.append(report.summarize(r, config))
    note, scope = "", None
    if sc.ideal is not None:  # the reference: policy none, no disturbance, same seed, same run
        ideal = sc.ideal
        outages = ideal.scaled(scale)
        r = simulate(config, ideal.policy, profile, ideal.offered(config, trace), sc.seed,
                     autoscaling=sc.autoscaling, outages=outages, cold_start_s=sc.cold_start_s)
        sums.append(report.summarize(r, config))
        kept, removed = ideal.tenants(config, trace)
        note = ideal.describe(config, trace, scale)
        scope = {"nodes": ideal.nodes, "tenants": kept, "not_offered": removed,
                 "out": [{"node": o.node, "start": o.start, "end": o.end} for o in outages]}
    return ScenarioResult(sc, config, len(trace), sums, time.perf_counter() - t0, note, scope)


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
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=2))
    return md


def scenario_names(names: list[str] | None) -> list[Scenario]:
    from .workloads import SCENARIOS

    return [get_scenario(n) for n in (names or list(SCENARIOS))]
