"""The scaler's configuration (``kvgate scaler --config FILE``), validated; errors name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ext_proc.config import ConfigError, config_error, load_yaml

from .law import LawSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Pool(_Strict):
    """One pool's scaling law (``pools.<name>``): one per KEDA ScaledObject."""

    min_replicas: Annotated[int, Field(ge=0)] = Field(default=1, description="fewest vLLM replicas the scaler asks for")
    max_replicas: Annotated[int, Field(ge=1)] = Field(default=10, description="most vLLM replicas the scaler asks for")
    step: Annotated[int, Field(ge=1)] = Field(default=2, description="the least a scale-up adds")
    scale_up_threshold: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=0.25, description="unmet-demand rate (share of the demand the fleet could not serve within SLO) "
        "above which the pool scales up")
    scale_down_threshold: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.05, description="unmet-demand rate below which the pool may scale down (after the cooldown); "
        "also the share of the window's admissions that waited in kvgate's queue at or above which it may not")
    cooldown_seconds: Annotated[float, Field(ge=0)] = Field(
        default=600.0, description="no scale-down sooner than this after the last change")
    warm_pool: Annotated[int, Field(ge=0)] = Field(
        default=0, description="replicas kept beyond what the demand needs, for bursts")
    concentration: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.8, description="one tenant's share of capacity rejections that makes them its problem")
    cold_start_seconds: Annotated[float, Field(ge=0)] = Field(
        default=60.0, description="a replica's model-load time: how far ahead the unmet rate's trend is projected")
    trend_window_seconds: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="the evaluations the unmet rate's trend is fitted over")
    spread_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.3, description="rejections spread over the tenants at this share of their requests count "
        "every 429 of the tenants inside their budgets")
    spread_tenants: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.5, description="... when at least this share of the active tenants (and two) have rejections")
    scale_down_kv_usage: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.45, description="scale down only if the replicas left beyond the warm pool would run at most "
        "at this mean KV-cache usage")
    warm_pool_kv_usage: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.55, description="the replicas beyond the warm pool above this mean KV-cache usage: one more "
        "replica, to keep the pool spare")
    scale_down_prefill_usage: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.3, description="scale down only if the replicas left beyond the warm pool would spend at most "
        "this share of their time prefilling what kvgate sent the pool (kvgate_prefill_seconds_total, its peak "
        "over the cooldown and scale_down_window_seconds)")

    scale_down_window_seconds: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=300.0, description="a scale-down must also fit the peak KV and prefill load over this long, "
        "bursts that outran the fleet included (the law's own stabilisation, as long as Kubernetes' default for "
        "an HPA's; each reading is the signal window's mean (window_seconds); it matters only with a cooldown "
        "shorter than it; 0: only the peak since the unmet rate went low)")
    hpa_tolerance: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.1, description="the tolerance the scaler assumes of the HPA between it and the pods "
        "(Kubernetes' default 10%; the chart's pool entry hpaTolerance): a scale-up asks at least the least count "
        "past this tolerance of the replicas running (12 of 10), which the HPA does not ignore, and a scale from "
        "zero past it of the warm pool; replicas asked for that have not come after two cold starts and a window "
        "(at least 300 s) are given up on, and what is asked then is past it too, and past the count asked before "
        "where that already cleared what runs. Assumed too low, an ask can be ignored (a give-up then clears the "
        "count asked as well); set 0 where the HPA has no tolerance (keda.hpaTolerance: 0 with the feature gate "
        "on), or a large pool's scale-ups ask about 10% too many")

    @model_validator(mode="after")
    def _order(self) -> Pool:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas: must be at least min_replicas")
        if self.scale_down_threshold >= self.scale_up_threshold:
            raise ValueError("scale_down_threshold: must be below scale_up_threshold")
        if self.scale_down_kv_usage >= self.warm_pool_kv_usage:
            raise ValueError("scale_down_kv_usage: must be below warm_pool_kv_usage (the gap keeps a scale-down "
                             "from causing the next scale-up)")
        return self

    def law(self, stale_after_s: float, window_s: float = 60.0) -> LawSettings:
        return LawSettings(
            min_replicas=self.min_replicas, max_replicas=self.max_replicas, step=self.step,
            scale_up_threshold=self.scale_up_threshold, scale_down_threshold=self.scale_down_threshold,
            cooldown_s=self.cooldown_seconds, warm_pool=self.warm_pool, concentration=self.concentration,
            stale_after_s=stale_after_s, cold_start_s=self.cold_start_seconds,
            trend_window_s=self.trend_window_seconds, spread_share=self.spread_share,
            spread_tenants=self.spread_tenants, scale_down_kv_usage=self.scale_down_kv_usage,
            warm_pool_kv_usage=self.warm_pool_kv_usage, scale_down_prefill_usage=self.scale_down_prefill_usage,
            scale_down_window_s=self.scale_down_window_seconds, hpa_tolerance=self.hpa_tolerance, window_s=window_s)


class Source(_Strict):
    """Where the scaler reads kvgate's counters: every replica's /metrics, or Prometheus."""

    kvgate: list[Annotated[str, Field(pattern=r"^https?://")]] = Field(
        default_factory=list, description="every kvgate replica's metrics URL")
    kvgate_dns: Annotated[str, Field(pattern=r"^[^\s:/]+:\d{1,5}$")] | None = Field(
        default=None, description="host:port of a headless Service of kvgate's metrics: every address is a replica")
    prometheus: Annotated[str, Field(pattern=r"^https?://")] | None = Field(
        default=None, description="or a Prometheus server's URL that scrapes every kvgate replica (job names the "
        "job)")
    job: str = Field(default="kvgate", description="kvgate's scrape job in Prometheus")

    @model_validator(mode="after")
    def _one(self) -> Source:
        if bool(self.kvgate or self.kvgate_dns) == bool(self.prometheus):
            raise ValueError("source: set either source.kvgate / source.kvgate_dns (kvgate's metrics) or "
                             "source.prometheus, not both")
        return self


class ScalerConfig(_Strict):
    """The whole scaler configuration file."""

    grpc_address: str = Field(
        default="0.0.0.0:9105", description="where the scaler serves KEDA's external-scaler gRPC API")
    metrics_address: str = Field(
        default="0.0.0.0:9106", description="where the scaler serves its own Prometheus /metrics")
    source: Source
    window_seconds: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="the window kvgate's counters are read over")
    interval_seconds: Annotated[float, Field(gt=0)] = Field(
        default=5.0, description="how often the signal is read and the law evaluated")
    stale_after_seconds: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="a signal older than this holds the replica count (no blind changes)")
    pools: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")], Pool] = Field(
        default_factory=lambda: {"default": Pool()},
        description="one per ScaledObject; its scalerMetadata 'pool' names it, and it scales on kvgate's pool of "
        "the same name (a kvgate without pools: its one pool, whatever the name)")

    @model_validator(mode="after")
    def _no_none_pool(self) -> ScalerConfig:
        # pool="none" labels kvgate's requests refused before routing: a pool of that name would read nothing
        if "none" in self.pools:
            raise ValueError("pools.none: 'none' is reserved (kvgate labels requests refused before routing with it)")
        return self


def load_scaler_config(path: str | Path) -> ScalerConfig:
    p = Path(path)
    try:
        data: Any = load_yaml(p.read_text(), str(p), allow_empty=True)  # duplicate keys are errors
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    try:
        return ScalerConfig.model_validate(data or {})
    except ValidationError as e:
        raise config_error(e, f"{p}: invalid scaler configuration") from None
