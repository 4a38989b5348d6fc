"""Where the scaler's signals come from: every kvgate replica's /metrics, or a Prometheus that scrapes them.

Both give the same ``Signals``: per-tenant admitted and capacity-rejected requests over the window,
policy rejections (and, of those, the ones for a tenant's own request or token budget and the ones
the fleet caused), admitted requests predicted to miss their SLO, requests held in kvgate's queues
now, the vLLM replicas kvgate sees and their mean KV-cache usage. Shadow-mode would-be rejections are
admits (they reached the fleet). A kvgate of an older version exports no fleet-caused or
predicted-miss counters: read as none. The PromQL of ``TRIGGER_QUERY`` is what the README offers as a
KEDA Prometheus trigger, for users who want no scaler service.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ext_proc.addresses import join_hostport

from .law import Signals

# what one kvgate replica reports, cumulative
Totals = dict[tuple[str, str], float]
"""(kind, tenant) → count; kind: admitted | capacity | policy | budget (of policy: a tenant's own request
or token budget) | fleet (of policy: caused by the fleet) | slo_miss (of admitted: predicted to miss)."""

KINDS = ("admitted", "capacity", "policy", "budget", "fleet", "slo_miss")
BUDGET_REASONS = ("tenant-requests", "tenant-tokens")
"""The 429 reasons of a tenant over its own budget: never a scaling signal."""
FLEET_CAUSED = "kvgate_fleet_caused_rejections_total"
PREDICTED_MISSES = "kvgate_predicted_slo_misses_total"


@dataclass(frozen=True)
class Reading:
    totals: Totals
    held: float
    nodes: int | None
    """vLLM nodes this replica knows; None when it does not choose nodes (Envoy does)."""
    kv_usage: float | None = None
    """The mean KV-cache usage of the nodes this replica probes; None: no node reading."""


def parse_kvgate(text: str) -> Reading:
    """One replica's exposition → cumulative counts (raises ValueError on text that is not one)."""
    totals: Totals = {}
    held = 0.0
    nodes: int | None = None
    kv: list[float] = []
    seen = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvgate_requests_total":
                seen = True
                dec, cls, tenant = s.labels.get("decision"), s.labels.get("class"), s.labels.get("tenant", "")
                kind = ("admitted" if dec in ("admit", "shadow_reject") else
                        "capacity" if cls == "capacity" else "policy" if cls == "policy" else None)
                if kind is not None:
                    totals[(kind, tenant)] = totals.get((kind, tenant), 0.0) + s.value
                if kind == "policy" and s.labels.get("reason") in BUDGET_REASONS:
                    totals[("budget", tenant)] = totals.get(("budget", tenant), 0.0) + s.value
            elif s.name in (FLEET_CAUSED, PREDICTED_MISSES):
                kind = "fleet" if s.name == FLEET_CAUSED else "slo_miss"
                tenant = s.labels.get("tenant", "")
                totals[(kind, tenant)] = totals.get((kind, tenant), 0.0) + s.value
            elif s.name == "kvgate_queue_depth_requests":
                held += s.value
            elif s.name == "kvgate_nodes_total":
                nodes = (nodes or 0) + int(s.value)
            elif s.name == "kvgate_node_kv_usage_ratio":
                kv.append(s.value)
            elif s.name == "kvgate_fleet_inflight_requests":
                seen = True
    if not seen:
        raise ValueError("not a kvgate metrics page (no kvgate_requests_total / kvgate_fleet_inflight_requests)")
    return Reading(totals, held, nodes, sum(kv) / len(kv) if kv else None)


def _signals(at: float, delta: Totals, held: float, nodes: int | None, complete: bool,
             kv_usage: float | None = None) -> Signals:
    by: dict[str, dict[str, float]] = {k: {} for k in KINDS}
    for (kind, tenant), v in delta.items():
        by[kind][tenant] = by[kind].get(tenant, 0.0) + v
    return Signals(at, by["admitted"], by["capacity"], by["policy"], held, nodes, complete,
                   fleet_caused=by["fleet"], budget_rejected=by["budget"], slo_missed=by["slo_miss"],
                   kv_usage=kv_usage)


@dataclass
class DirectSource:
    """Scrapes every kvgate replica and differences its counters over ``window_s`` itself.

    Replicas: fixed ``urls``, and/or every address ``dns`` ("name:port" of a headless Service)
    resolves to at each read."""

    urls: list[str]
    window_s: float = 60.0
    timeout_s: float = 2.0
    dns: str | None = None
    _history: dict[str, deque[tuple[float, Totals]]] = field(default_factory=dict)

    def targets(self) -> list[str] | None:
        """The replicas' metrics URLs now; None when the DNS name does not resolve."""
        urls = list(self.urls)
        if self.dns:
            host, _, port = self.dns.rpartition(":")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError:
                return None
            ips = sorted({str(i[4][0]) for i in infos})
            urls += [f"http://{join_hostport(ip, port)}/metrics" for ip in ips]
        return urls

    def fetch(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
            return str(r.read().decode())

    def read(self, now: float) -> Signals:
        delta: Totals = {}
        held = 0.0
        nodes: int | None = None
        kv: list[float] = []
        urls = self.targets()
        if urls is None:
            raise SourceError(f"cannot resolve {self.dns}")
        complete = bool(urls)
        first = not self._history
        for gone in set(self._history) - set(urls):  # replicas that went away
            del self._history[gone]
        for url in urls:
            try:
                reading = parse_kvgate(self.fetch(url))
            except (OSError, ValueError):
                complete = False
                continue
            held += reading.held
            if reading.nodes is not None:  # every replica sees the same fleet: the largest view
                nodes = max(nodes or 0, reading.nodes)
            if reading.kv_usage is not None:
                kv.append(reading.kv_usage)
            h = self._history.get(url)
            if h is None:
                h = self._history[url] = deque()
                # A replica that appears later is new: all its counts fall in the window. On the scaler's
                # own first read the replicas' totals span their whole lives, not a window: no verdict yet.
                complete = complete and not first
            h.append((now, reading.totals))
            while len(h) > 2 and h[1][0] <= now - self.window_s:
                h.popleft()
            base = h[0][1] if len(h) > 1 else {}
            for k, v in reading.totals.items():
                before = base.get(k, 0.0)
                d = v - before if v >= before else v  # a counter reset: the replica restarted
                delta[k] = delta.get(k, 0.0) + d
        return _signals(now, delta, held, nodes, complete, sum(kv) / len(kv) if kv else None)


QUERIES = {
    "admitted": 'sum by (tenant) (increase(kvgate_requests_total{decision=~"admit|shadow_reject"}[%s]))',
    "capacity": 'sum by (tenant) (increase(kvgate_requests_total{decision="reject",class="capacity"}[%s]))',
    "policy": 'sum by (tenant) (increase(kvgate_requests_total{decision="reject",class="policy"}[%s]))',
    "budget": 'sum by (tenant) (increase(kvgate_requests_total{decision="reject",class="policy",'
              f'reason=~"{"|".join(BUDGET_REASONS)}"}}[%s]))',
    # absent from an older kvgate: no series, an empty answer, none counted
    "fleet": f"sum by (tenant) (increase({FLEET_CAUSED}[%s]))",
    "slo_miss": f"sum by (tenant) (increase({PREDICTED_MISSES}[%s]))",
    "held": "sum(kvgate_queue_depth_requests)",
    "nodes": "max(sum by (instance) (kvgate_nodes_total))",
    "kv_usage": "avg(kvgate_node_kv_usage_ratio)",
    "replicas_up": 'count(up{job="%s"} == 1)',
    "replicas_all": 'count(up{job="%s"})',
}

_CAP = '(sum(rate(kvgate_requests_total{decision="reject",class="capacity"}[2m])) or vector(0))'
_ADM = '(sum(rate(kvgate_requests_total{decision=~"admit|shadow_reject"}[2m])) or vector(0))'
TRIGGER_QUERY = f"{_CAP} / clamp_min({_ADM} + {_CAP}, 1e-9)"
"""The simple path (README): the capacity reject ratio as a KEDA Prometheus trigger, metricType Value."""


@dataclass
class PrometheusSource:
    """Asks a Prometheus (instant queries over ``window_s``); ``job`` is kvgate's scrape job."""

    url: str
    job: str = "kvgate"
    window_s: float = 60.0
    timeout_s: float = 2.0

    def query(self, q: str) -> list[tuple[dict[str, str], float]]:
        u = self.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with urllib.request.urlopen(u, timeout=self.timeout_s) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise ValueError(f"prometheus: {doc.get('error', doc)}")
        return [(x.get("metric", {}), float(x["value"][1])) for x in doc["data"]["result"]]

    def read(self, now: float) -> Signals:
        w = f"{int(self.window_s)}s"
        try:
            delta: Totals = {}
            for kind in KINDS:
                for labels, v in self.query(QUERIES[kind] % w):
                    delta[(kind, labels.get("tenant", ""))] = v
            held = sum(v for _, v in self.query(QUERIES["held"]))
            node_rows = self.query(QUERIES["nodes"])
            kv_rows = self.query(QUERIES["kv_usage"])
            up = sum(v for _, v in self.query(QUERIES["replicas_up"] % self.job))
            total = sum(v for _, v in self.query(QUERIES["replicas_all"] % self.job))
        except (OSError, ValueError, KeyError) as e:
            raise SourceError(f"prometheus at {self.url}: {e}") from e
        if total == 0:
            raise SourceError(f"prometheus at {self.url}: no scrape target in job {self.job!r}")
        nodes = int(node_rows[0][1]) if node_rows else None
        return _signals(now, delta, held, nodes, complete=up == total, kv_usage=kv_rows[0][1] if kv_rows else None)


class SourceError(Exception):
    """The signal source could not be read: the law holds."""
