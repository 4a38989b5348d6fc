"""Prometheus metrics of the admission service.

Tenant labels come only from configured tenant names (never from request input), and at most
``metrics.max_tenant_labels`` of them are used; the rest are reported as ``other``. Children are
cached so the hot path pays a dict lookup, not a label resolution.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .admission import Completion, Decision

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
        self.inflight = Gauge(
            "kvgate_inflight_requests", "Requests admitted and not yet completed, per tenant", ["tenant"], registry=r
        )
        self.fleet_inflight = Gauge(
            "kvgate_fleet_inflight_requests", "Requests holding a fleet slot (fleet.max_inflight)", registry=r
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
        self.nodes_total = Gauge("kvgate_nodes_total", "vLLM nodes kvgate knows, by discovery (static | dns | "
                                 "static+dns); no sample when Envoy picks the node", ["discovery"], registry=r)
        self.node_kv = Gauge("kvgate_node_kv_usage_ratio", "KV-cache usage of each node from its last probe snapshot",
                             ["node"], registry=r)
        self.node_projected_kv = Gauge(
            "kvgate_node_projected_kv_usage_ratio",
            "KV usage of each node projected with what kvgate sent since the snapshot", ["node"], registry=r)
        self.node_inflight = Gauge("kvgate_node_inflight_requests", "Requests kvgate has in flight on each node",
                                   ["node"], registry=r)
        self.node_age = Gauge("kvgate_node_snapshot_age_seconds", "Age of each node's last good probe snapshot",
                              ["node"], registry=r)
        self.node_breaker = Gauge("kvgate_node_breaker_state",
                                  "Circuit breaker per node: 0 closed, 1 half-open, 2 open", ["node"], registry=r)
        self.node_transitions = Counter("kvgate_node_breaker_transitions_total", "Breaker transitions per node",
                                        ["node", "from", "to"], registry=r)
        self.queue_depth = Gauge("kvgate_queue_depth_requests", "Requests held in kvgate's gateway queue, per tier",
                                 ["tier"], registry=r)
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
        self._allowed: frozenset[str] = frozenset()
        self._max = max_tenant_labels
        self._req_children: dict[tuple[str, str, str, str, str], Counter] = {}
        self._inflight_children: dict[str, Gauge] = {}

    def set_tenants(self, names: list[str], max_labels: int | None = None) -> None:
        if max_labels is not None:
            self._max = max_labels
        self._allowed = frozenset(names[: self._max]) | {"unknown"}
        self._req_children.clear()
        self._inflight_children.clear()

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
            if d.lease.charged:
                self._inflight(d.tenant).inc()
                self.fleet_inflight.inc()

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
        if c.lease.charged:
            self._inflight(c.lease.tenant.name).dec()
            self.fleet_inflight.dec()
        self.request_seconds.labels(c.lease.tenant.config.tier).observe(c.seconds)

    def _inflight(self, tenant: str) -> Gauge:
        g = self._inflight_children.get(tenant)
        if g is None:
            g = self.inflight.labels(self.label(tenant))
            self._inflight_children[tenant] = g
        return g
