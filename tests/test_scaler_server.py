"""The scaler shell around the law, table-driven, with an injected clock: what KEDA's calls answer before
the first verdict (an error, so KEDA's fallback applies), after it, and while data is missing."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from scaler import externalscaler_pb2 as pb
from scaler.config import ScalerConfig
from scaler.law import Signals
from scaler.server import METRIC_PREFIX, ExternalScalerServicer, Scaler
from scaler.signals import PoolSignals, SourceError

REF = pb.ScaledObjectRef(name="vllm", namespace="llm", scalerMetadata={"pool": "gpu"})


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    """What the servicer uses of grpc.aio's ServicerContext: abort raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Script:
    """A source that answers from a script: 'down' raises SourceError; 'part<N>' a replica did not answer;
    'idle<N>' a complete window without traffic; 'busy<N>' a complete window with traffic (N: replicas)."""

    def __init__(self) -> None:
        self.next = "down"

    def read(self, now: float) -> Signals:
        kind, n = self.next.rstrip("0123456789"), self.next.lstrip("abcdefghijklmnopqrstuvwxyz")
        if kind == "down":
            raise SourceError("connection refused")
        traffic = {"a": 10.0} if kind == "busy" else {}
        return Signals(now, traffic, {}, {}, 0.0, int(n), kind != "part")


def scaler() -> tuple[Scaler, Script, ExternalScalerServicer]:
    cfg = ScalerConfig.model_validate({"source": {"prometheus": "http://p"},
                                       "pools": {"gpu": {"min_replicas": 1, "max_replicas": 8}}})
    src = Script()
    s = Scaler(cfg, src)
    return s, src, ExternalScalerServicer(s)


async def answers(svc: ExternalScalerServicer) -> tuple[Any, Any]:
    """(GetMetrics value or the error code, IsActive or the error code)."""
    out: list[Any] = []
    for call in (lambda: svc.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="s0-" + METRIC_PREFIX
                                                             + "gpu"), Context()),
                 lambda: svc.IsActive(REF, Context())):
        try:
            r = await call()
        except Aborted as e:
            out.append(e.code)
            continue
        out.append(r.metricValues[0].metricValue if hasattr(r, "metricValues") else r.result)
    return out[0], out[1]


def gauge(s: Scaler, name: str) -> float | None:
    return s.registry.get_sample_value(name, {"pool": "gpu"})


U = grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(("script", "expected"), [
    pytest.param(["part4", "idle4"], [(U, U), (U, U), (4, False)],
                 id="restart: UNAVAILABLE until the first complete window, then the pool's size"),
    pytest.param(["down", "down", "busy3"], [(U, U), (U, U), (U, U), (3, True)],
                 id="restart with the source down: UNAVAILABLE, never min_replicas"),
    pytest.param(["busy2", "busy5", "down", "part5"],
                 [(U, U), (2, True), (2, True), (5, True), (5, True)],
                 id="missing later: held at the replicas last observed, the last activity answer stands"),
    pytest.param(["idle3", "down"], [(U, U), (3, False), (3, False)],
                 id="an idle pool stays inactive but is never scaled below what is up on missing data"),
])
async def test_what_keda_gets(script: list[str], expected: list[tuple[Any, Any]]) -> None:
    s, src, svc = scaler()
    got = [await answers(svc)]  # before any read
    for i, step in enumerate(script):
        src.next = step
        s.evaluate(10.0 * i)
        got.append(await answers(svc))
    assert got == expected


async def test_holding_on_missing_data_is_logged_and_exported() -> None:
    s, src, _ = scaler()
    with capture_logs() as logs:
        s.evaluate(0.0)  # source down at start
        assert (gauge(s, "kvgate_scaler_ready"), gauge(s, "kvgate_scaler_holding_on_missing_data")) == (0, 1)
        assert gauge(s, "kvgate_scaler_desired_replicas") is None  # no verdict: nothing to export
        src.next = "idle2"
        s.evaluate(5.0)
        assert (gauge(s, "kvgate_scaler_ready"), gauge(s, "kvgate_scaler_holding_on_missing_data")) == (1, 0)
        src.next = "part6"  # replicas were added by hand; then a kvgate replica stops answering
        s.evaluate(10.0)
        src.next = "down"
        s.evaluate(15.0)
        s.evaluate(20.0)
    assert gauge(s, "kvgate_scaler_desired_replicas") == 6
    assert gauge(s, "kvgate_scaler_observed_replicas") == 6
    assert gauge(s, "kvgate_scaler_holding_on_missing_data") == 1
    holds = [e for e in logs if e["event"] == "holding_on_missing_data"]
    assert len(holds) == 2, holds  # once at the start (no verdict), once when the data went missing: no spam
    assert holds[0]["ready"] is False and "no verdict yet" in holds[0]["reason"]
    assert holds[1]["ready"] is True and holds[1]["observed_replicas"] == 6 and holds[1]["desired"] == 6
    assert "did not answer" in holds[1]["reason"]
    assert [e["first_verdict"] for e in logs if e["event"] == "signals_back"] == [True]


class Fixed:
    def __init__(self, sig: Signals) -> None:
        self.sig = sig

    def read(self, now: float) -> Signals:
        return Signals(**{**self.sig.__dict__, "at": now})


async def test_a_scaling_decision_is_explained_in_logs_and_metrics() -> None:
    cfg = ScalerConfig.model_validate({"source": {"prometheus": "http://p"},
                                       "pools": {"gpu": {"min_replicas": 1, "max_replicas": 8}}})
    # 140 requests wanted the fleet: 20 refused 503, 20 refused 429 because the fleet slowed down, and 10
    # admitted although predicted to miss their TTFT target; b's own budget 429s never count
    sig = Signals(0.0, {"a": 50, "b": 50}, {"a": 20}, {"a": 20, "b": 30}, 0.0, 2, True, fleet_caused={"a": 20},
                  budget_rejected={"b": 30}, slo_missed={"b": 10}, kv_usage=0.8)
    s = Scaler(cfg, Fixed(sig))
    with capture_logs() as logs:
        s.evaluate(0.0)
    (d,) = [e for e in logs if e["event"] == "scaling_decision"]
    assert d["action"] == "up" and d["desired"] == 4
    assert d["unmet_rate"] == round(50 / 140, 4) and d["demand"] == 140
    assert d["unmet_by_cause"] == {"capacity": round(20 / 140, 4), "fleet_caused": round(20 / 140, 4),
                                   "slo_miss": round(10 / 140, 4)}
    assert "fleet-caused 429 14%" in d["reason"] and d["kv_usage"] == 0.8

    def unmet(cause: str) -> float | None:
        return s.registry.get_sample_value("kvgate_scaler_unmet_demand_ratio", {"pool": "gpu", "cause": cause})

    assert (unmet("capacity"), unmet("fleet_caused"), unmet("spread")) == (20 / 140, 20 / 140, 0.0)
    assert unmet("slo_miss") == pytest.approx(10 / 140)
    assert gauge(s, "kvgate_scaler_projected_unmet_ratio") == pytest.approx(50 / 140)
    assert gauge(s, "kvgate_scaler_kv_usage_ratio") == 0.8
    # the capacity reject ratio keeps its meaning: 503s / (admitted + 503s)
    assert s.registry.get_sample_value("kvgate_scaler_capacity_reject_ratio") == 20 / 120


def test_the_pools_law_settings_come_from_the_config() -> None:
    cfg = ScalerConfig.model_validate({"source": {"prometheus": "http://p"}, "window_seconds": 30,
                                       "pools": {"gpu": {"cold_start_seconds": 90, "spread_share": 0.4,
                                                         "scale_down_kv_usage": 0.4, "warm_pool_kv_usage": 0.7}}})
    law = Scaler(cfg, Script()).pools["gpu"].law.s
    assert (law.cold_start_s, law.spread_share, law.scale_down_kv_usage, law.warm_pool_kv_usage, law.window_s) == (
        90, 0.4, 0.4, 0.7, 30)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="scale_down_kv_usage: must be below warm_pool_kv_usage"):
        ScalerConfig.model_validate({"source": {"prometheus": "http://p"},
                                     "pools": {"gpu": {"scale_down_kv_usage": 0.7, "warm_pool_kv_usage": 0.7}}})


class Pools:
    """A source that reads every pool at once (as DirectSource and PrometheusSource do)."""

    def __init__(self, pools: dict[str, Signals]) -> None:
        self.pools = pools

    def read_pools(self, now: float) -> PoolSignals:
        return PoolSignals(now, {p: Signals(**{**sig.__dict__, "at": now}) for p, sig in self.pools.items()})


def ref(pool: str) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name=pool, namespace="llm", scalerMetadata={"pool": pool})


async def test_each_pool_acts_on_its_own_signals() -> None:
    cfg = ScalerConfig.model_validate({"source": {"prometheus": "http://p"},
                                       "pools": {"small": {}, "big": {}, "typo": {}}})
    # big: 40% of its demand refused 503; small: all served; kvgate has no pool "typo"
    src = Pools({"small": Signals(0.0, {"a": 100}, {}, {}, 0.0, 2, True),
                 "big": Signals(0.0, {"b": 60}, {"b": 40}, {}, 0.0, 2, True)})
    s = Scaler(cfg, src)
    svc = ExternalScalerServicer(s)
    with capture_logs() as logs:
        s.evaluate(0.0)
        s.evaluate(5.0)
    desired = {p: (await svc.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(p)), Context())).metricValues[0]
               .metricValue for p in cfg.pools}
    active = {p: (await svc.IsActive(ref(p), Context())).result for p in cfg.pools}
    # big scales by its shortfall (2 up served 60%: 4 needed); small holds; typo reads zero demand: its
    # minimum, inactive, and answered (a complete read that saw none of its requests is not missing data)
    assert desired == {"small": 2, "big": 4, "typo": 1}
    assert active == {"small": True, "big": True, "typo": False}

    def g(name: str, pool: str, **labels: str) -> float | None:
        return s.registry.get_sample_value(name, {"pool": pool, **labels})

    assert (g("kvgate_scaler_unmet_demand_ratio", "big", cause="capacity"),
            g("kvgate_scaler_unmet_demand_ratio", "small", cause="capacity")) == (0.4, 0.0)
    assert [g("kvgate_scaler_pool_reported", p) for p in ("small", "big", "typo")] == [1, 1, 0]
    assert s.registry.get_sample_value("kvgate_scaler_capacity_reject_ratio") == 40 / 200  # the fleet's
    (warning,) = [e for e in logs if e["event"] == "pool_not_reported"]  # once, not at every evaluation
    assert warning["pool"] == "typo" and warning["kvgate_pools"] == ["big", "small"]

    # kvgate restarted without pools: one pool, "default" — every scaler pool reads its signal again
    src.pools = {"default": Signals(0.0, {"a": 10}, {}, {}, 0.0, 3, True)}
    with capture_logs() as logs:
        s.evaluate(10.0)
    assert [g("kvgate_scaler_pool_reported", p) for p in ("small", "big", "typo")] == [1, 1, 1]
    assert s.pools["typo"].active and s.pools["typo"].law.observed == 3
    assert [e["event"] for e in logs if e["event"] in ("one_fleet_signal", "pool_not_reported")] == [
        "one_fleet_signal"]
