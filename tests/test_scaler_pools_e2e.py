"""Model pools in the scaler, end to end: `kvgate scaler` asked over real gRPC the way KEDA asks, each
scaler pool fed by its own kvgate pool's series — read straight from kvgate's /metrics, and through a
real Prometheus (Debian's) with the shipped recording rules and dashboard.

kvgate's side is a metrics page written here, over real HTTP, in the exposition the pools contract
spells (every per-request and per-node family labelled with its ``pool``, ``none`` for requests refused
before routing), so that these tests pin the scaler to that format rather than to kvgate's code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ext_proc.stats import FOLLOW_MODES
from kvgate.dev.stack import free_port, wait_port
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.signals import TRIGGER_QUERY, PrometheusSource, trigger_query
from tests.helpers import metric, wait_for

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "helm" / "kvgate" / "files" / "prometheus-rules.yaml"
DASHBOARD = ROOT / "helm" / "kvgate" / "files" / "dashboard.json"
# Prometheus's increase() extrapolates each series by its own samples: its ratios are the page's within this
TOL = 0.01
# three ScaledObjects: two of kvgate's pools, and one kvgate does not have (a misspelt name)
POOLS = {"small": {"min_replicas": 1, "max_replicas": 8, "step": 2},
         "big": {"min_replicas": 1, "max_replicas": 8, "step": 2},
         "idle": {"min_replicas": 1, "max_replicas": 8}}


class Page:
    """One kvgate replica's /metrics with the counts a test sets (the series exist from the start at 0,
    as kvgate's do once a pool has seen a request: Prometheus's increase() then sees every step)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvgate_requests", "Final decisions", ["tenant", "tier", "decision", "reason", "class",
                                                                       "pool"], registry=r)
        self.fleet = Gauge("kvgate_fleet_inflight_requests", "Requests holding a fleet slot", ["pool"], registry=r)
        self.depth = Gauge("kvgate_queue_depth_requests", "Requests held", ["tier", "pool"], registry=r)
        self.nodes = Gauge("kvgate_nodes_total", "vLLM nodes", ["discovery", "pool"], registry=r)
        self.kv = Gauge("kvgate_node_kv_usage_ratio", "KV-cache usage", ["node", "pool"], registry=r)
        self.breaker = Gauge("kvgate_node_breaker_state", "Breaker", ["node", "pool"], registry=r)
        self.follow = Gauge("kvgate_probe_follow_nodes", "Nodes by follow mode", ["mode", "pool"], registry=r)
        self.duration = Histogram("kvgate_request_duration_seconds", "Duration", ["tier", "pool"], registry=r)
        self.wait = Histogram("kvgate_queue_wait_seconds", "Queue wait", ["tier", "outcome", "pool"], registry=r)

    def pool(self, name: str, nodes: int, kv: float) -> None:
        self.fleet.labels(name).set(0)
        self.depth.labels("standard", name).set(0)
        self.nodes.labels("static", name).set(nodes)
        for mode in FOLLOW_MODES:
            self.follow.labels(mode, name).set(nodes if mode == "stream" else 0)
        for i in range(nodes):
            node = f"{name}-{i}:8000"
            self.kv.labels(node, name).set(kv)
            self.breaker.labels(node, name).set(0)

    def admit(self, pool: str, tenant: str, n: int) -> None:
        self.requests.labels(tenant, "standard", "admit", "ok", "none", pool).inc(n)
        for _ in range(n):
            self.duration.labels("standard", pool).observe(0.5)
            self.wait.labels("standard", "admitted", pool).observe(0.01)

    def reject(self, pool: str, tenant: str, n: int, reason: str = "fleet-kv", klass: str = "capacity") -> None:
        self.requests.labels(tenant, "standard", "reject", reason, klass, pool).inc(n)

    @contextlib.contextmanager
    def served(self) -> Iterator[str]:
        port = free_port()
        httpd, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            httpd.shutdown()


def two_pools() -> Page:
    """kvgate with pools small and big (2 nodes each), a lifetime of traffic before the scaler starts, and
    the 404s of a model no pool serves (pool "none")."""
    page = Page()
    page.pool("small", 2, 0.3)
    page.pool("big", 2, 0.4)
    page.admit("small", "chat", 100)
    page.admit("big", "rag", 100)
    # 503s and 429s before it too: a counter that starts at 0 in the window is not extrapolated back as one
    # that does not (Prometheus's increase()), and the ratio would not be the page's 40%. As many as the
    # admits: increase() extrapolates a counter back at most to where it would have been zero, which for a
    # small start (10 of 50) is further back than the half scrape interval the others get, while Prometheus
    # has only seconds of samples (40% then read 41.6%: 16 of 47 readings in the seconds after the flood)
    page.reject("big", "rag", 100)
    page.reject("big", "rag", 5, "tenant-tokens", "policy")
    page.reject("none", "chat", 20, "model-not-found", "invalid")
    return page


def flood_big(page: Page) -> None:
    """40% of the big pool's demand refused 503 (2 replicas served 60%: 4 needed); the small pool's all
    served; and more requests for a model no pool serves, which are nobody's demand. The admits first: a
    read between the two steps sees less unmet demand, never more."""
    page.admit("big", "rag", 60)
    page.reject("big", "rag", 40)
    page.admit("small", "chat", 100)
    page.reject("none", "chat", 500, "model-not-found", "invalid")


@contextlib.contextmanager
def scaler(tmp: Path, source: dict[str, Any]) -> Iterator[tuple[pb_grpc.ExternalScalerStub, str]]:
    """`kvgate scaler` with POOLS, asked over real gRPC; yields the stub and its metrics URL."""
    port, mport = free_port(), free_port()
    (tmp / "scaler.yaml").write_text(yaml.safe_dump({
        "grpc_address": f"127.0.0.1:{port}", "metrics_address": f"127.0.0.1:{mport}", "source": source,
        "window_seconds": 30, "interval_seconds": 0.2, "pools": POOLS}))
    log = open(tmp / "scaler.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "scaler", "--config", str(tmp / "scaler.yaml")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc=proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield pb_grpc.ExternalScalerStub(ch), f"http://127.0.0.1:{mport}/metrics"  # type: ignore[no-untyped-call]
    except BaseException:
        print((tmp / "scaler.log").read_text()[-4000:])  # its verdicts' reasons, in the failure's report
        raise
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def ref(pool: str) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name=f"vllm-{pool}", namespace="llm", scalerMetadata={"pool": pool})


def desired(stub: Any, pool: str) -> int | None:
    """The pool's desired replicas as KEDA reads them; None before the pool's first verdict."""
    try:
        r = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(pool),
                                                 metricName=f"s0-kvgate-desired-replicas-{pool}"))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return None
    (v,) = r.metricValues
    return int(v.metricValue)


def check_pools_scale_apart(stub: Any, metrics: str, page: Page, timeout: float) -> None:
    """The scenario both sources must give: before the flood every pool holds (2, 2, and the unknown pool's
    minimum — answered, not UNAVAILABLE); after it only big scales, by its own shortfall."""
    wait_for(lambda: all(desired(stub, p) is not None for p in POOLS), timeout=timeout, what="first verdicts")
    assert {p: desired(stub, p) for p in POOLS} == {"small": 2, "big": 2, "idle": 1}
    flood_big(page)
    wait_for(lambda: desired(stub, "big") == 4, timeout=timeout, what="the big pool scaled up")
    assert {p: desired(stub, p) for p in POOLS} == {"small": 2, "big": 4, "idle": 1}
    assert {p: stub.IsActive(ref(p)).result for p in POOLS} == {"small": True, "big": True, "idle": False}
    forty = pytest.approx(0.4, abs=TOL)
    assert metric(metrics, "kvgate_scaler_unmet_demand_ratio", pool="big", cause="capacity") == forty
    assert metric(metrics, "kvgate_scaler_unmet_demand_ratio", pool="small", cause="capacity") == 0
    assert [metric(metrics, "kvgate_scaler_pool_reported", pool=p) for p in POOLS] == [1, 1, 0]
    assert metric(metrics, "kvgate_scaler_observed_replicas", pool="big") == 2


def test_each_pool_scales_on_its_own_signal_read_from_kvgate(tmp_path: Path) -> None:
    page = two_pools()
    with page.served() as target, scaler(tmp_path, {"kvgate": [f"http://{target}/metrics"]}) as (stub, metrics):
        check_pools_scale_apart(stub, metrics, page, timeout=20)
        # the fleet-wide ratio still exported: 40 503s of the 200 requests that wanted a pool
        assert metric(metrics, "kvgate_scaler_capacity_reject_ratio") == pytest.approx(40 / 200)


@contextlib.contextmanager
def prometheus(tmp: Path, target: str) -> Iterator[PrometheusSource]:
    """Debian's Prometheus scraping ``target`` every second as job kvgate, with the shipped rules."""
    port = free_port()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvgate", "static_configs": [{"targets": [target]}]}]}))
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc=proc)
        prom = PrometheusSource(f"http://127.0.0.1:{port}", window_s=30)

        def scraped_twice() -> bool:  # increase() needs two samples
            try:
                return bool(prom.query('count_over_time(up{job="kvgate"}[1m]) >= 2'))
            except OSError:  # 503 while its storage starts
                return False

        wait_for(scraped_twice, timeout=30, what="two scrapes")
        yield prom
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def by_pool(rows: list[tuple[dict[str, str], float]]) -> dict[str, float]:
    return {labels.get("pool", ""): v for labels, v in rows}


@pytest.mark.skipif(shutil.which("prometheus") is None and not os.environ.get("CI"),
                    reason="prometheus not installed (apt-get install prometheus)")
def test_each_pool_scales_on_its_own_signal_through_prometheus(tmp_path: Path) -> None:
    page = two_pools()
    with page.served() as target, prometheus(tmp_path, target) as prom, \
            scaler(tmp_path, {"prometheus": prom.url, "job": "kvgate"}) as (stub, metrics):
        check_pools_scale_apart(stub, metrics, page, timeout=30)

        # the source itself: sum by (tenant, pool); the 404s of pool "none" nowhere
        s = prom.read_pools(0.0)
        assert s.complete and set(s) == {"small", "big"}
        assert s["big"].reject_rate == pytest.approx(0.4, abs=TOL) and s["small"].reject_rate == 0
        assert (s["big"].replicas, s["small"].replicas, s["big"].kv_usage) == (2, 2, 0.4)  # gauges: as they are

        # the documented triggers: per pool, and the recorded series (one per pool, 0 where no 503 yet)
        assert by_pool(prom.query(trigger_query("big"))) == {"": pytest.approx(0.4, abs=TOL)}
        assert by_pool(prom.query(trigger_query("small"))) == {"": 0}
        assert by_pool(prom.query(TRIGGER_QUERY)) == {"": pytest.approx(40 / 200, abs=TOL)}  # fleet-wide: both pools
        wait_for(lambda: by_pool(prom.query("kvgate:capacity_reject_ratio:rate2m")).get("big", 0) > 0.3,
                 timeout=15, what="the recording rule after the flood")
        forty = pytest.approx(0.4, abs=TOL)
        assert by_pool(prom.query("kvgate:capacity_reject_ratio:rate2m")) == {"small": 0, "big": forty}

        # the dashboard with one pool picked: every panel that filters by pool shows that pool, and only it
        dash = json.loads(DASHBOARD.read_text())
        (var,) = [v for v in dash["templating"]["list"] if v["name"] == "pool"]
        m = re.fullmatch(r"label_values\((\w+), pool\)", var["definition"])
        assert m is not None
        assert sorted(labels["pool"] for labels, _ in prom.query(f"group by (pool) ({m.group(1)})")) == \
            ["big", "small"]  # the picker offers kvgate's pools (not "none")
        filtered = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"] if "$pool" in t["expr"]]
        assert len(filtered) >= 10
        for title, expr in filtered:
            rows = prom.query(expr.replace("$__rate_interval", "1m").replace("$pool", "big"))
            assert rows, title
            assert {labels.get("pool") for labels, _ in rows} == {"big"}, (title, rows)
