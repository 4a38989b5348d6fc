"""Prometheus metrics of the admission service.

Tenant labels come only from configured tenant names (never from request input), and at most
``metrics.max_tenant_labels`` of them are used; the rest are reported as ``other``. Children are
cached so the hot path pays a dict lookup, not a label resolution.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .admission import Admission, Completion, Decision
from .breaker import STATE_VALUE
from .config import Config
from .nodes import Fleet

OTHER = "other"


class Stats:
    def __init__(self, registry: CollectorRegistry | None = None, max_tenant_labels: int = 100) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests_total",
            "Admission decisions. decision: admit | reject | shadow_reject (shadow mode: would have "
            "been rejected, was admitted). class: policy (429) | capacity (503) | invalid | auth | none.",
            ["tenant", "tier", "decision", "reason", "class"],
            registry=r,
        )
        self.tokens = Counter(
            "kvgate_tokens_total",
            "Tokens by kind: reserved (estimate at admission), prompt and completion (reported usage), "
            "unreported (reservation charged when no usage came back)",
            ["tenant", "kind"],
            registry=r,
        )
        self.completions = Counter(
            "kvgate_completions_total",
            "Leases released, by outcome: ok | no_usage | upstream_error | disconnect | aborted | reclaimed",
            ["tenant", "outcome"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvgate_decision_duration_seconds",
            "Time to decide one request inside kvgate (parse, estimate, decide, build the reply)",
            buckets=(2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvgate_request_duration_seconds",
            "Admission to completion, per tier",
            ["tier"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.unparsed_bodies = Counter(
            "kvgate_unparsed_bodies_total", "Request bodies that were not a JSON object (decided on size)", registry=r
        )
        self.reloads = Counter(
            "kvgate_config_reloads_total", "Config reloads by result (ok | error)", ["result"], registry=r
        )
        self.node_transitions = Counter("kvgate_node_breaker_transitions_total", "Breaker transitions per node",
                                        ["node", "from", "to"], registry=r)
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds", "Time queued requests waited, per tier and outcome (admitted | rejected)",
            ["tier", "outcome"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r)
        self.queue_rejections = Counter(
            "kvgate_queue_rejections_total",
            "Queued or arriving requests answered 503 by the queue: queue-deadline (could not make its "
            "deadline: rejected early), queue-timeout, queue-evicted (made room for a higher tier), queue-full",
            ["tier", "reason"], registry=r)
        self.queue_cancelled = Counter("kvgate_queue_cancelled_total",
                                       "Queued requests whose client went away before they were served",
                                       ["tier"], registry=r)
        self.service = Counter(
            "kvgate_tenant_service_tokens_total",
            "Service each tenant received, in weighted tokens (prompt + queue.output_token_weight x completion): "
            "what fair queueing equalises (per unit of weight)", ["tenant"], registry=r)
        self.fleet_caused = Counter(
            "kvgate_fleet_caused_rejections_total",
            "429s the fleet caused: a concurrency-cap rejection of a tenant inside its request and token "
            "budgets whose requests last clearly longer than its own norm (unmet demand for the scaler)",
            ["tenant", "tier"], registry=r)
        self.slo_misses = Counter(
            "kvgate_predicted_slo_misses_total",
            "Requests admitted although kvgate predicted they miss their tier's TTFT target (unmet demand "
            "for the scaler)", ["tenant", "tier"], registry=r)
        self._allowed: frozenset[str] = frozenset()
        self._max = max_tenant_labels
        self._req_children: dict[tuple[str, str, str, str, str], Counter] = {}
        self._unmet_children: dict[tuple[bool, str, str], Counter] = {}
        self._state: _State | None = None
        r.register(_StateCollector(self))

    def bind(self, state: _State) -> None:
        """The core whose state the gauges report; read at scrape time, so each gauge equals the state
        it reports by construction (no inc/dec to drift, no label left behind by a reload)."""
        self._state = state

    def set_tenants(self, names: list[str], max_labels: int | None = None) -> None:
        if max_labels is not None:
            self._max = max_labels
        self._allowed = frozenset(names[: self._max]) | {"unknown"}
        self._req_children.clear()
        self._unmet_children.clear()

    def label(self, tenant: str) -> str:
        return tenant if tenant in self._allowed else OTHER

    def decision(self, d: Decision) -> None:
        r = d.rejection
        if r is None:
            key = (d.tenant, d.tier, "admit", "ok", "none")
        else:
            key = (d.tenant, d.tier, "shadow_reject" if d.admitted else "reject", r.reason, r.klass)
        child = self._req_children.get(key)
        if child is None:
            child = self.requests.labels(self.label(d.tenant), *key[1:])
            self._req_children[key] = child
        child.inc()
        if d.lease is not None:
            self.tokens.labels(self.label(d.tenant), "reserved").inc(d.lease.reserved_tokens)
            if d.lease.slo_miss:
                self._unmet(False, d.tenant, d.tier).inc()
        elif r is not None and r.fleet_caused:
            self._unmet(True, d.tenant, d.tier).inc()

    def _unmet(self, fleet: bool, tenant: str, tier: str) -> Counter:
        """The cached child of the fleet-caused (``fleet``) or the predicted-miss counter."""
        key = (fleet, tenant, tier)
        child = self._unmet_children.get(key)
        if child is None:
            child = (self.fleet_caused if fleet else self.slo_misses).labels(self.label(tenant), tier)
            self._unmet_children[key] = child
        return child

    def completion(self, c: Completion, outcome: str) -> None:
        t = self.label(c.lease.tenant.name)
        self.completions.labels(t, outcome).inc()
        if c.usage is not None:
            self.tokens.labels(t, "prompt").inc(c.usage.prompt_tokens)
            self.tokens.labels(t, "completion").inc(c.usage.completion_tokens)
        elif c.charged_tokens:
            self.tokens.labels(t, "unreported").inc(c.charged_tokens)
        if c.service:
            self.service.labels(t).inc(c.service)
        self.request_seconds.labels(c.lease.tenant.config.tier).observe(c.seconds)



class _State(Protocol):
    """What the state gauges read (``core.Core``)."""

    admission: Admission
    fleet: Fleet | None
    config: Config

    def now(self) -> float: ...


class _StateCollector(Collector):
    """Gauges computed from the core's state at scrape time."""

    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self._stats._state))

    def _families(self, st: _State | None) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("kvgate_inflight_requests",
                                     "Requests admitted and not yet completed, per tenant", labels=["tenant"])
        fleet = GaugeMetricFamily("kvgate_fleet_inflight_requests", "Requests holding a fleet slot "
                                  "(fleet.max_inflight)")
        depth = GaugeMetricFamily("kvgate_queue_depth_requests", "Requests held in kvgate's gateway queue, per tier",
                                  labels=["tier"])
        total = GaugeMetricFamily("kvgate_nodes_total", "vLLM nodes kvgate knows, by discovery (static | dns | "
                                  "static+dns); no sample when Envoy picks the node", labels=["discovery"])
        kv = GaugeMetricFamily("kvgate_node_kv_usage_ratio", "KV-cache usage of each node from its last probe "
                               "snapshot", labels=["node"])
        projected = GaugeMetricFamily("kvgate_node_projected_kv_usage_ratio",
                                      "KV usage of each node projected with what kvgate sent since the snapshot",
                                      labels=["node"])
        node_inflight = GaugeMetricFamily("kvgate_node_inflight_requests",
                                          "Requests kvgate has in flight on each node", labels=["node"])
        age = GaugeMetricFamily("kvgate_node_snapshot_age_seconds", "Age of each node's last good probe snapshot",
                                labels=["node"])
        breaker = GaugeMetricFamily("kvgate_node_breaker_state",
                                    "Circuit breaker per node: 0 closed, 1 half-open, 2 open", labels=["node"])
        hit = GaugeMetricFamily("kvgate_node_prefix_cache_hit_ratio", "Each node's prefix-cache hits over its "
                                "queried prompt tokens in its probe's last interval (vLLM's own counters)",
                                labels=["node"])
        if st is not None:
            a = st.admission
            per: dict[str, int] = {self._stats.label(t.name): 0 for t in a.tenants()}
            for lease in a.leases(queued=True):  # queued requests hold their tenant's slot too
                if lease.charged:
                    label = self._stats.label(lease.tenant.name)
                    per[label] = per.get(label, 0) + 1
            for label, count in sorted(per.items()):
                inflight.add_metric([label], count)
            fleet.add_metric([], a.inflight)
            q = a.queue
            for tier in q.tiers():
                depth.add_metric([tier], q.depth(tier))
            f = st.fleet
            cfg = st.config.nodes
            if f is not None:
                now = st.now()
                discovery = "+".join(k for k, on in (("static", bool(cfg and cfg.static)),
                                                     ("dns", bool(cfg and cfg.dns))) if on)
                total.add_metric([discovery or "static"], len(f.nodes))
                for n in f.nodes.values():
                    if n.snapshot is not None and n.snapshot.kv_usage is not None:
                        kv.add_metric([n.address], n.snapshot.kv_usage)
                        projected.add_metric([n.address], n.projected_kv() or 0.0)
                    node_inflight.add_metric([n.address], n.inflight)
                    breaker.add_metric([n.address], STATE_VALUE[n.breaker.state])
                    if n.fresh_at is not None:
                        age.add_metric([n.address], max(0.0, now - n.fresh_at))
                    rate = n.snapshot.prefix_hit_rate if n.snapshot is not None else None
                    if rate is not None:
                        hit.add_metric([n.address], rate)
        yield from (inflight, fleet, depth, total, kv, projected, node_inflight, age, breaker, hit)
