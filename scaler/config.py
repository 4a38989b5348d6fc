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
    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 10
    step: Annotated[int, Field(ge=1)] = 2
    scale_up_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.25
    scale_down_threshold: Annotated[float, Field(ge=0, lt=1)] = 0.05
    cooldown_seconds: Annotated[float, Field(ge=0)] = 600.0
    warm_pool: Annotated[int, Field(ge=0)] = 0
    concentration: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.8, description="one tenant's share of capacity rejections that makes them its problem")

    @model_validator(mode="after")
    def _order(self) -> Pool:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas: must be at least min_replicas")
        if self.scale_down_threshold >= self.scale_up_threshold:
            raise ValueError("scale_down_threshold: must be below scale_up_threshold")
        return self

    def law(self, stale_after_s: float) -> LawSettings:
        return LawSettings(self.min_replicas, self.max_replicas, self.step, self.scale_up_threshold,
                           self.scale_down_threshold, self.cooldown_seconds, self.warm_pool, self.concentration,
                           stale_after_s)


class Source(_Strict):
    kvgate: list[Annotated[str, Field(pattern=r"^https?://")]] = Field(
        default_factory=list, description="every kvgate replica's metrics URL")
    kvgate_dns: Annotated[str, Field(pattern=r"^[^\s:/]+:\d{1,5}$")] | None = Field(
        default=None, description="host:port of a headless Service of kvgate's metrics: every address is a replica")
    prometheus: Annotated[str, Field(pattern=r"^https?://")] | None = None
    job: str = Field(default="kvgate", description="kvgate's scrape job in Prometheus")

    @model_validator(mode="after")
    def _one(self) -> Source:
        if bool(self.kvgate or self.kvgate_dns) == bool(self.prometheus):
            raise ValueError("source: set either source.kvgate / source.kvgate_dns (kvgate's metrics) or "
                             "source.prometheus, not both")
        return self


class ScalerConfig(_Strict):
    grpc_address: str = "0.0.0.0:9105"
    metrics_address: str = "0.0.0.0:9106"
    source: Source
    window_seconds: Annotated[float, Field(gt=0)] = 60.0
    interval_seconds: Annotated[float, Field(gt=0)] = 5.0
    stale_after_seconds: Annotated[float, Field(gt=0)] = 60.0
    pools: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")], Pool] = Field(
        default_factory=lambda: {"default": Pool()},
        description="one per ScaledObject; its scalerMetadata 'pool' names it")


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
