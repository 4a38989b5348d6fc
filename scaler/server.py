"""``kvgate scaler``: KEDA's external scaler over gRPC, around the pure control law.

Every ``interval_seconds`` it reads the signals (every kvgate replica, or Prometheus) and runs each
pool's law on that pool's own signals: scaler pool ``NAME`` reads kvgate's series labelled
``pool="NAME"`` (``scaler.signals.PoolSignals.of``), so a flood on one model scales only the Deployment
serving it. A kvgate without ``pools`` reports the one pool ``default`` (or no pool label at all): every
scaler pool then reads that fleet-wide signal, as before pools. A pool kvgate does not report reads zero
demand (a complete read that saw none of its requests is not missing data); since a misspelt pool name
would scale its Deployment down to ``min_replicas`` that way, it is logged (``pool_not_reported``, with
the pools kvgate does report) and exported (``kvgate_scaler_pool_reported{pool}`` 0). KEDA asks:

* ``GetMetricSpec`` → one metric per pool, ``kvgate-desired-replicas-<pool>``, target 1 (KEDA's
  default AverageValue: the HPA computes desired = ceil(value / 1), i.e. the law's replica count);
* ``GetMetrics`` → the law's desired replicas (KEDA may prefix the name ``sN-``);
* ``IsActive`` / ``StreamIsActive`` → traffic in the window or requests held in kvgate's queues: the
  activation signal for scale-from-zero. With no data it repeats its last answer (never a scale to
  zero on no data).

Until a pool's law has its first verdict — a complete window since the scaler started; the direct
source's first read is never one — ``GetMetrics`` and ``IsActive`` fail with ``UNAVAILABLE`` (and
``StreamIsActive`` sends nothing yet): KEDA then keeps the replicas as they are or applies the
ScaledObject's ``fallback``, rather than reading a guess. Data that goes missing later is a hold at
the law's count, never below the replica count the signals last reported; logged
(``holding_on_missing_data``) and exported (``kvgate_scaler_holding_on_missing_data{pool}``,
``kvgate_scaler_observed_replicas{pool}``).

Every verdict that changes the count or the action is logged (``scaling_decision``: its reason, the
unmet rate and its split by cause, the projection, the KV-cache usage) and the numbers are exported
per pool (``kvgate_scaler_unmet_demand_ratio{pool,cause}``, ``kvgate_scaler_projected_unmet_ratio``,
``kvgate_scaler_kv_usage_ratio``).

A ScaledObject names its pool in ``scalerMetadata.pool`` (default ``default``): kvgate's pool of that name.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from ext_proc import logs
from ext_proc.addresses import split_hostport

from . import externalscaler_pb2 as pb
from . import externalscaler_pb2_grpc as pb_grpc
from .config import ScalerConfig
from .law import CAUSES, ControlLaw, Signals, Verdict
from .signals import DEFAULT_POOL, DirectSource, PoolSignals, PrometheusSource, SourceError

log = logs.get("kvgate.scaler")
METRIC_PREFIX = "kvgate-desired-replicas-"
KEDA_PREFIX = re.compile(r"^s\d+-")


class Source(Protocol):
    """A source that knows no pools: its fleet-wide signals are every scaler pool's (``PoolSignals.single``)."""

    def read(self, now: float) -> Signals: ...


@runtime_checkable
class PoolSource(Protocol):
    """A source that reads every pool's signals at once (``DirectSource``, ``PrometheusSource``)."""

    def read_pools(self, now: float) -> PoolSignals: ...


def source_for(cfg: ScalerConfig) -> PoolSource:
    s = cfg.source
    if s.prometheus:
        return PrometheusSource(s.prometheus, s.job, cfg.window_seconds)
    return DirectSource(list(s.kvgate), cfg.window_seconds, dns=s.kvgate_dns)


@dataclass
class PoolState:
    law: ControlLaw
    verdict: Verdict | None = None
    active: bool = True


class Scaler:
    def __init__(self, cfg: ScalerConfig, source: Source | PoolSource,
                 registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.source = source
        self.pools = {name: PoolState(ControlLaw(p.law(cfg.stale_after_seconds, cfg.window_seconds)))
                      for name, p in cfg.pools.items()}
        self.signals: PoolSignals | None = None
        self.shared: bool | None = None
        """Whether the last complete read had one fleet-wide signal for every pool (None: none yet)."""
        self._reported: dict[str, bool] = {}
        """Per pool: whether kvgate reported it at the last complete read."""
        self.changed = asyncio.Event()
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.m_desired = Gauge("kvgate_scaler_desired_replicas", "Replicas the control law asks for", ["pool"],
                               registry=r)
        self.m_rate = Gauge("kvgate_scaler_capacity_reject_ratio",
                            "Capacity rejections / (admitted + capacity rejections) over the window", registry=r)
        self.m_decisions = Counter("kvgate_scaler_decisions_total", "Law evaluations by action (up | down | hold)",
                                   ["pool", "action"], registry=r)
        self.m_policy = Gauge("kvgate_scaler_policy_problem",
                              "1 while a tenant's flood holds a scale-up back (a quota problem)", ["pool", "tenant"],
                              registry=r)
        self.m_unmet = Gauge("kvgate_scaler_unmet_demand_ratio",
                             "Unmet demand over the window as a share of demand, by cause: capacity (503s), "
                             "fleet_caused (429s the fleet caused), slo_miss (admitted, predicted to miss the "
                             "TTFT target), spread (other 429s, counted when rejections are spread over the tenants)",
                             ["pool", "cause"], registry=r)
        self.m_projected = Gauge("kvgate_scaler_projected_unmet_ratio",
                                 "The unmet rate the law acted on, projected one cold start ahead on its trend",
                                 ["pool"], registry=r)
        self.m_kv = Gauge("kvgate_scaler_kv_usage_ratio",
                          "The fleet's mean KV-cache usage over the window, as the law's warm-pool and scale-down "
                          "bounds read it", ["pool"], registry=r)
        self.m_source = Gauge("kvgate_scaler_source_up", "1 when the last signal read succeeded", registry=r)
        self.m_ready = Gauge("kvgate_scaler_ready",
                             "1 once the pool's law has a verdict from a complete window; until then KEDA's "
                             "GetMetrics / IsActive get UNAVAILABLE", ["pool"], registry=r)
        self.m_missing = Gauge("kvgate_scaler_holding_on_missing_data",
                               "1 while the pool holds because its signals are missing, incomplete or stale",
                               ["pool"], registry=r)
        self.m_observed = Gauge("kvgate_scaler_observed_replicas",
                                "vLLM replicas the signals last reported: the floor of a hold on missing data",
                                ["pool"], registry=r)
        self.m_reported = Gauge("kvgate_scaler_pool_reported",
                                "1 when kvgate reports series for the pool (pool=\"<name>\", or a kvgate without "
                                "pools: its one pool); 0: the pool reads zero demand (is it named as in kvgate's "
                                "config pools?)", ["pool"], registry=r)
        for name in self.pools:
            self.m_ready.labels(name).set(0)
            self.m_missing.labels(name).set(1)

    def read(self, now: float) -> PoolSignals | None:
        """The signals now (blocking HTTP: the server calls it off the event loop); None when unreadable."""
        try:
            if isinstance(self.source, PoolSource):
                return self.source.read_pools(now)
            return PoolSignals.single(self.source.read(now))
        except SourceError as e:
            log.warning("signal_source_failed", error=str(e))
            return None

    def _track_pools(self, sig: PoolSignals) -> None:
        """Export which pools kvgate reports, and log a change (complete reads only: a partial one may miss
        a pool)."""
        if sig.shared != self.shared:
            self.shared = sig.shared
            if sig.shared and set(self.pools) != {DEFAULT_POOL}:
                log.info("one_fleet_signal", pools=sorted(self.pools),
                         note="kvgate reports no pool but 'default' (no pools in its config): every scaler pool "
                         "reads its fleet-wide signal")
        for name in self.pools:
            reported = sig.reported(name)
            self.m_reported.labels(name).set(1 if reported else 0)
            if not reported and self._reported.get(name, True):
                log.warning("pool_not_reported", pool=name, kvgate_pools=sorted(sig),
                            note="kvgate reports no series for this pool: it reads zero demand (a scaler pool "
                            "scales kvgate's pool of the same name)")
            self._reported[name] = reported

    def apply(self, sig: Signals | PoolSignals | None, now: float) -> None:
        """Run each pool's law on its own signals and publish the verdicts (fleet-wide ``Signals``: every
        pool's)."""
        if isinstance(sig, Signals):
            sig = PoolSignals.single(sig)
        self.m_source.set(1 if sig is not None and sig.complete else 0)
        if sig is not None and sig.complete:
            fleet = sig.fleet().reject_rate
            if fleet is not None:
                self.m_rate.set(fleet)
            self._track_pools(sig)
        if sig is not None:
            self.signals = sig
        self.m_policy.clear()
        for name, st in self.pools.items():
            old = st.verdict
            ps = sig.of(name) if sig is not None else None
            v = st.verdict = st.law.decide(ps, now)
            if not v.missing_data and ps is not None:
                st.active = ps.held > 0 or ps.demand > 0
            self.m_ready.labels(name).set(1 if v.ready else 0)
            self.m_missing.labels(name).set(1 if v.missing_data else 0)
            if st.law.observed is not None:
                self.m_observed.labels(name).set(st.law.observed)
            if v.missing_data and (old is None or not old.missing_data):
                log.warning("holding_on_missing_data", pool=name, desired=v.desired if v.ready else None,
                            observed_replicas=st.law.observed, ready=v.ready, reason=v.reason,
                            note="no verdict yet: KEDA gets UNAVAILABLE" if not v.ready
                            else "holding; never below the replicas last observed")
            elif not v.missing_data and old is not None and old.missing_data:
                log.info("signals_back", pool=name, first_verdict=not old.ready)
            if not v.ready:
                continue
            self.m_desired.labels(name).set(v.desired)
            self.m_decisions.labels(name, v.action).inc()
            if v.unmet is not None:
                for cause in CAUSES:
                    self.m_unmet.labels(name, cause).set(v.unmet.share(cause))
            if v.projected is not None:
                self.m_projected.labels(name).set(v.projected)
            if v.utilisation is not None:
                self.m_kv.labels(name).set(v.utilisation)
            if v.policy_tenant is not None:
                self.m_policy.labels(name, v.policy_tenant).set(1)
                if old is None or old.policy_tenant != v.policy_tenant:
                    log.warning("policy_problem", pool=name, tenant=v.policy_tenant, action=v.action,
                                reason=v.reason, note="rejections concentrated in this tenant's quota")
            if old is None or old.desired != v.desired or old.action != v.action:
                log.info("scaling_decision", pool=name, desired=v.desired, action=v.action, reason=v.reason,
                         unmet_rate=None if v.reject_rate is None else round(v.reject_rate, 4),
                         unmet_by_cause=None if v.unmet is None else {
                             c: round(v.unmet.share(c), 4) for c in CAUSES if v.unmet.counts.get(c)},
                         demand=None if v.unmet is None else v.unmet.demand,
                         projected=None if v.projected is None else round(v.projected, 4),
                         kv_usage=None if v.utilisation is None else round(v.utilisation, 4))
        self.changed.set()
        self.changed = asyncio.Event()

    def evaluate(self, now: float) -> None:
        self.apply(self.read(now), now)

    def pool(self, ref: pb.ScaledObjectRef) -> tuple[str, PoolState]:
        name = ref.scalerMetadata.get("pool", "default")
        st = self.pools.get(name)
        if st is None:
            raise KeyError(f"no pool {name!r} in the scaler's config (pools: {', '.join(sorted(self.pools))}); "
                           "set scalerMetadata.pool")
        return name, st


class ExternalScalerServicer(pb_grpc.ExternalScalerServicer):
    def __init__(self, scaler: Scaler) -> None:
        self.s = scaler

    async def _pool(self, ref: pb.ScaledObjectRef, context: Any) -> tuple[str, PoolState]:
        try:
            return self.s.pool(ref)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
            raise

    async def _ready(self, name: str, st: PoolState, context: Any) -> Verdict:
        """The pool's verdict; UNAVAILABLE (KEDA's fallback applies) until it has a first one."""
        v = st.verdict
        if v is None or not v.ready:
            why = "no signal read yet" if v is None else v.reason
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"pool {name!r}: no verdict yet — the scaler has not read a complete window of "
                                f"kvgate's signals since it started ({why}); retry later")
            raise AssertionError("unreachable")  # abort raises
        return v

    async def IsActive(self, request: pb.ScaledObjectRef, context: Any) -> pb.IsActiveResponse:
        name, st = await self._pool(request, context)
        await self._ready(name, st, context)
        return pb.IsActiveResponse(result=st.active)

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context: Any) -> AsyncIterator[pb.IsActiveResponse]:
        _, st = await self._pool(request, context)
        last: bool | None = None
        while True:
            if st.verdict is None or not st.verdict.ready:  # no first verdict yet: nothing to push
                await self.s.changed.wait()
                continue
            if st.active != last:
                last = st.active
                yield pb.IsActiveResponse(result=last)
            await self.s.changed.wait()

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context: Any) -> pb.GetMetricSpecResponse:
        name, _ = await self._pool(request, context)
        return pb.GetMetricSpecResponse(metricSpecs=[
            pb.MetricSpec(metricName=METRIC_PREFIX + name, targetSize=1, targetSizeFloat=1.0)])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context: Any) -> pb.GetMetricsResponse:
        name, st = await self._pool(request.scaledObjectRef, context)
        asked = KEDA_PREFIX.sub("", request.metricName)
        if asked and asked != METRIC_PREFIX + name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown metric {request.metricName!r}; this pool's is {METRIC_PREFIX + name!r}")
        desired = (await self._ready(name, st, context)).desired
        return pb.GetMetricsResponse(metricValues=[
            pb.MetricValue(metricName=request.metricName or METRIC_PREFIX + name, metricValue=desired,
                           metricValueFloat=float(desired))])


async def serve(cfg: ScalerConfig, source: Source | PoolSource | None = None) -> None:
    scaler = Scaler(cfg, source or source_for(cfg))
    server = grpc.aio.server()
    pb_grpc.add_ExternalScalerServicer_to_server(ExternalScalerServicer(scaler), server)  # type: ignore[no-untyped-call]
    if server.add_insecure_port(cfg.grpc_address) == 0:
        raise OSError(f"grpc_address: cannot listen on {cfg.grpc_address}")
    host, port = split_hostport(cfg.metrics_address)
    start_http_server(port, addr=host, registry=scaler.registry)
    await server.start()
    log.info("scaler_serving", grpc=cfg.grpc_address, metrics=cfg.metrics_address, pools=sorted(cfg.pools),
             source=cfg.source.prometheus or cfg.source.kvgate_dns or f"{len(cfg.source.kvgate)} kvgate replica(s)")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def tick() -> None:
        while True:
            now = time.monotonic()
            try:
                scaler.apply(await asyncio.to_thread(scaler.read, now), now)
            except Exception:  # a bug must not freeze the verdicts KEDA reads: log it, keep evaluating
                log.exception("scaler_evaluation_failed")
            await asyncio.sleep(cfg.interval_seconds)

    task = asyncio.create_task(tick())
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await server.stop(grace=0.5)


def run(config_path: str, log_level: str = "info") -> int:
    from .config import load_scaler_config

    logs.setup(log_level)
    cfg = load_scaler_config(config_path)
    asyncio.run(serve(cfg))
    return 0
