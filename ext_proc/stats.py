"""Prometheus metrics of the admission service.

Tenant labels come only from configured tenant names (never from request input), and at most
``metrics.max_tenant_labels`` of them are used; the rest are reported as ``other``. Children are
cached so the hot path pays a dict lookup, not a label resolution.
"""

from __future__ import annotations

import contextlib
import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .admission import UNKNOWN_TENANT, Admission, Completion, Decision
from .breaker import STATE_VALUE, State
from .budgetstats import BudgetCollector
from .config import Config
from .nodes import Fleet
from .reasons import PROTECTIVE

OTHER = "other"
FOLLOW_MODES = ("stream", "poll", "connecting")
"""How kvgate follows a node's probe (``follow.Follower.modes``): every one is reported, zeros included."""


class Counts:
    """A counter family kept as plain numbers and turned into samples at scrape time: the request path
    pays one dict update, not a ``labels()`` resolution, a lock and a method chain (the per-request
    metrics were 15 us of kvgate's CPU per request; ``kvgate bench overhead``'s breakdown)."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.values: dict[tuple[str, ...], float] = {}
        self.created: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        v = self.values.get(key)
        if v is None:
            self.created[key] = time.time()
            self.values[key] = amount
        else:
            self.values[key] = v + amount

    def family(self) -> Metric:
        fam = CounterMetricFamily(self.name.removesuffix("_total"), self.documentation, labels=self.labels)
        for key, v in list(self.values.items()):
            fam.add_metric(list(key), v, created=self.created.get(key))
        return fam


class Hist:
    """A histogram family the same way: bucket counts by a bisection, exported at scrape time."""

    def __init__(self, name: str, documentation: str, labels: list[str], buckets: tuple[float, ...]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = tuple(float(b) for b in buckets)
        self.series: dict[tuple[str, ...], list[float]] = {}
        """Per label set: a count per bucket (the last one +Inf), then the sum."""

    def observe(self, value: float, key: tuple[str, ...] = ()) -> None:
        row = self.series.get(key)
        if row is None:
            row = self.series[key] = [0.0] * (len(self.bounds) + 2)
        row[bisect_left(self.bounds, value)] += 1
        row[-1] += value

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for key, row in list(self.series.items()):
            acc, buckets = 0.0, []
            for bound, n in zip((*self.bounds, math.inf), row[:-1], strict=True):
                acc += n
                buckets.append((floatToGoString(bound), acc))  # type: ignore[no-untyped-call]
            fam.add_metric(list(key), buckets, row[-1])
        return fam


class Stats:
    def __init__(self, registry: CollectorRegistry | None = None, max_tenant_labels: int = 100) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counts(
            "kvgate_requests_total",
            "Admission decisions. decision: admit | reject | shadow_reject (shadow mode: would have "
            "been rejected, was admitted) | best-effort (over a protective limit, served as best effort; "
            "reason: the limit's 429 reason). class: policy (429) | capacity (503) | invalid | auth | none.",
            ["tenant", "tier", "decision", "reason", "class", "pool"])
        self.tokens = Counts(
            "kvgate_tokens_total",
            "Tokens by kind: reserved (estimate at admission), prompt and completion (reported usage), "
            "unreported (reservation charged when no usage came back)", ["tenant", "kind", "pool"])
        self.completions = Counts(
            "kvgate_completions_total",
            "Leases released, by outcome: ok | no_usage | upstream_error | disconnect | aborted | reclaimed",
            ["tenant", "outcome", "pool"])
        self.decision_seconds = Hist(
            "kvgate_decision_duration_seconds",
            "Time to decide one request inside kvgate (parse, estimate, decide, build the reply)", [],
            (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2))
        self.request_seconds = Hist(
            "kvgate_request_duration_seconds", "Admission to completion, per tier", ["tier", "pool"],
            (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.unparsed_bodies = Counter(
            "kvgate_unparsed_bodies_total", "Request bodies that were not a JSON object (decided on size)", registry=r
        )
        self.reloads = Counter(
            "kvgate_config_reloads_total", "Config reloads by result (ok | error)", ["result"], registry=r
        )
        self.node_transitions = Counter("kvgate_node_breaker_transitions_total", "Breaker transitions per node",
                                        ["node", "from", "to", "pool"], registry=r)
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds", "Time queued requests waited, per tier and outcome (admitted | rejected); "
            "best-effort requests that waited for room too, under their tenant's tier",
            ["tier", "outcome", "pool"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r)
        self.prefill_seconds = Counter(
            "kvgate_prefill_seconds_total",
            "Prefill compute kvgate sent to each pool's nodes, in seconds: the prompt tokens it does not expect in "
            "the node's prefix cache x the node's modelled per-token prefill cost x its learned speed (a step's "
            "fixed cost not included): the scaler's scale-down bound on prefill reads its rate", ["pool"],
            registry=r)
        self.queue_waited_for_room = Counter(
            "kvgate_queue_waited_for_room_total",
            "Queued requests admitted after waiting for room: a node choice refused them, or a pass of the queue "
            "found their tier no node, while they waited (not those only queued behind others and released at "
            "once): what the scaler's scale-down gate reads", ["tier", "pool"], registry=r)
        self.queue_rejections = Counter(
            "kvgate_queue_rejections_total",
            "Queued or arriving requests answered 503 by the queue: queue-deadline (could not make its "
            "deadline: rejected early), queue-timeout, queue-evicted (made room for a higher tier), queue-full",
            ["tier", "reason", "pool"], registry=r)
        self.queue_cancelled = Counter("kvgate_queue_cancelled_total",
                                       "Queued requests whose client went away before they were served (best-effort "
                                       "requests waiting for room included)",
                                       ["tier", "pool"], registry=r)
        self.service = Counts(
            "kvgate_tenant_service_tokens_total",
            "Service each tenant received, in weighted tokens (prompt + queue.output_token_weight x completion): "
            "what fair queueing equalises (per unit of weight)", ["tenant", "pool"])
        self.fleet_caused = Counts(
            "kvgate_fleet_caused_rejections_total",
            "429s the fleet caused: a concurrency-cap rejection of a tenant inside its request and token "
            "budgets whose requests last clearly longer than its own norm, timed to the node's last byte (unmet "
            "demand for the scaler)",
            ["tenant", "tier", "pool"])
        self.slo_misses = Counts(
            "kvgate_predicted_slo_misses_total",
            "Requests admitted although kvgate predicted they miss their tier's TTFT target (unmet demand "
            "for the scaler; not a prompt whose own prefill alone outlasts the target: no fleet size helps it)",
            ["tenant", "tier", "pool"])
        self.best_effort = Counts(
            "kvgate_best_effort_admissions_total",
            "Requests of a tenant over a protective limit served as best effort (tenants[i].over_limit): the "
            "fleet had room nobody within quota needed; limit: the one it was over (concurrency | requests | "
            "tokens). Never scaling demand", ["tenant", "tier", "limit", "pool"])
        self.stretched = Counts(
            "kvgate_concurrency_stretched_admissions_total",
            "Requests admitted past their tenant's max_concurrent on the cap's stretch "
            "(tenants[i].max_concurrent_stretch): the fleet served the tenant slower than usual (request duration "
            "and seconds per output token) while it sent no faster than its cap allows; ordinary requests of its "
            "tier otherwise", ["tenant", "tier", "pool"])
        self._allowed: frozenset[str] = frozenset()
        self._max = max_tenant_labels
        self._state: _State | None = None
        self.follow_modes: Mapping[str, str] | None = None
        """Node address → how its probe is followed (``follow.Follower.modes``); None while nothing
        follows the probes (Envoy picks the node, or a core driven in virtual time)."""
        r.register(_CountsCollector([self.requests, self.tokens, self.completions, self.service, self.fleet_caused,
                                     self.slo_misses, self.best_effort, self.stretched],
                                    [self.decision_seconds, self.request_seconds]))
        r.register(_StateCollector(self))
        r.register(BudgetCollector(lambda: self._state.admission.spend if self._state is not None else None,
                                   self.label,
                                   lambda: self._state.admission.wall() if self._state is not None else 0.0))

    def bind(self, state: _State) -> None:
        """The core whose state the gauges report; read at scrape time, so each gauge equals the state
        it reports by construction (no inc/dec to drift, no label left behind by a reload)."""
        self._state = state

    def set_tenants(self, names: list[str], max_labels: int | None = None) -> None:
        if max_labels is not None:
            self._max = max_labels
        self._allowed = frozenset(names[: self._max]) | {UNKNOWN_TENANT}

    def forget_node(self, node: str, pool: str) -> None:
        """A node left its pool (a pod churned away, a reload): its breaker-transition series go with it.
        Node addresses come from discovery, and with pods replaced under new addresses every day the
        series of nodes long gone would otherwise pile up in every scrape (and in kvgate's memory)."""
        for old in State:
            for new in State:
                with contextlib.suppress(KeyError):  # (a pair it never made)
                    self.node_transitions.remove(node, old.value, new.value, pool)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self._allowed else OTHER

    def decision(self, d: Decision, pool: str) -> None:
        """One final decision; ``pool``: where it was routed (``none``: refused before routing). Pool
        names come from the config, never from the request: the label stays bounded."""
        r = d.rejection
        t = d.tenant if d.tenant in self._allowed else OTHER
        # a caller refused before any tenant was found has no tier (the core files it under the lowest as a
        # placeholder): labelled tier="none", as its pool is, so no tier's refusals count it
        tier = d.tier if d.identified else "none"
        if d.best_effort is not None:
            # its own decision (the reason: the limit it is over), class none: neither an admission the
            # scaler counts as demand nor a 429 (``scaler/signals.py`` reads decision and class)
            self.requests.inc((t, tier, "best-effort", d.best_effort.reason, "none", pool))
            self.best_effort.inc((t, tier, PROTECTIVE.get(d.best_effort.reason, "other"), pool))
        elif r is None:
            self.requests.inc((t, tier, "admit", "ok", "none", pool))
            if d.lease is not None and d.lease.stretched:
                self.stretched.inc((t, tier, pool))
        else:
            self.requests.inc((t, tier, "shadow_reject" if d.admitted else "reject", r.reason, r.klass, pool))
        if d.lease is not None:
            self.tokens.inc((t, "reserved", pool), d.lease.reserved_tokens)
            if d.lease.slo_miss:
                self.slo_misses.inc((t, d.tier, pool))
        elif r is not None and r.fleet_caused:
            self.fleet_caused.inc((t, d.tier, pool))

    def completion(self, c: Completion, outcome: str) -> None:
        lease = c.lease
        name, pool = lease.tenant.name, lease.pool
        t = name if name in self._allowed else OTHER
        self.completions.inc((t, outcome, pool))
        if c.usage is not None:
            self.tokens.inc((t, "prompt", pool), c.usage.prompt_tokens)
            self.tokens.inc((t, "completion", pool), c.usage.completion_tokens)
        elif c.charged_tokens:
            self.tokens.inc((t, "unreported", pool), c.charged_tokens)
        if c.service:
            self.service.inc((t, pool), c.service)
        self.request_seconds.observe(c.seconds, (lease.tenant.config.tier, pool))


class _CountsCollector(Collector):
    def __init__(self, counts: list[Counts], hists: list[Hist]) -> None:
        self._families: list[Counts | Hist] = [*counts, *hists]

    def describe(self) -> Iterable[Metric]:
        return [f.family() for f in self._families]

    def collect(self) -> Iterable[Metric]:
        return [f.family() for f in self._families]


class _State(Protocol):
    """What the state gauges read (``core.Core``)."""

    admission: Admission
    fleets: dict[str, Fleet]
    config: Config

    def now(self) -> float: ...

    @property
    def tombstones(self) -> int: ...


class _StateCollector(Collector):
    """Gauges computed from the core's state at scrape time."""

    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self._stats._state))

    def _families(self, st: _State | None) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("kvgate_inflight_requests", "Requests admitted and not yet completed, per "
                                     "tenant and pool", labels=["tenant", "pool"])
        fleet = GaugeMetricFamily("kvgate_fleet_inflight_requests", "Requests holding a fleet slot "
                                  "(fleet.max_inflight counts them all), per pool", labels=["pool"])
        depth = GaugeMetricFamily("kvgate_queue_depth_requests", "Requests held in kvgate's gateway queue, per tier "
                                  "and pool (not best-effort requests waiting behind it: "
                                  "kvgate_best_effort_waiting_requests)", labels=["tier", "pool"])
        spare = GaugeMetricFamily("kvgate_best_effort_waiting_requests", "Requests of tenants over a protective limit "
                                  "waiting behind the gateway queue for room nobody within quota needs (served as "
                                  "best effort, or their 429 at the lowest tier's hold), per pool", labels=["pool"])
        lagging = GaugeMetricFamily("kvgate_queue_tier_lagging", "1 while a tier is lagging under shed parity "
                                    "(queue.shed_parity_gap: refused more than the gap more often than the tiers "
                                    "above it over the last minute; it then goes after each release from above), "
                                    "else 0; per tier and pool", labels=["tier", "pool"])
        refused = GaugeMetricFamily("kvgate_queue_tier_refused_ratio", "Share of a tier's requests refused over "
                                    "about the last minute as shed parity counts them (capacity 503s and quota "
                                    "429s the fleet caused, of tenants with a protective limit), per tier and "
                                    "pool; no sample with shed parity off or fewer than 20 decisions in the window",
                                    labels=["tier", "pool"])
        total = GaugeMetricFamily("kvgate_nodes_total", "vLLM nodes kvgate knows, by discovery (static | dns | "
                                  "static+dns) and pool; no sample when Envoy picks the node",
                                  labels=["discovery", "pool"])
        kv = GaugeMetricFamily("kvgate_node_kv_usage_ratio", "KV-cache usage of each node from its last probe "
                               "snapshot", labels=["node", "pool"])
        capacity = GaugeMetricFamily("kvgate_node_kv_capacity_tokens", "Tokens of KV cache each node holds (its "
                                     "probe's num_gpu_blocks x block_size): the weight of its usage in a pool of "
                                     "mixed nodes", labels=["node", "pool"])
        profile = GaugeMetricFamily("kvgate_node_profile_info", "Each node's performance profile (always 1): its "
                                    "name, and where it came from (pool | pinned | detected)",
                                    labels=["node", "pool", "profile", "source"])
        projected = GaugeMetricFamily("kvgate_node_projected_kv_usage_ratio",
                                      "KV usage of each node projected with what kvgate sent since the snapshot",
                                      labels=["node", "pool"])
        node_inflight = GaugeMetricFamily("kvgate_node_inflight_requests",
                                          "Requests kvgate has in flight on each node", labels=["node", "pool"])
        age = GaugeMetricFamily("kvgate_node_snapshot_age_seconds", "Age of each node's last good probe snapshot",
                                labels=["node", "pool"])
        breaker = GaugeMetricFamily("kvgate_node_breaker_state",
                                    "Circuit breaker per node: 0 closed, 1 half-open, 2 open", labels=["node", "pool"])
        hit = GaugeMetricFamily("kvgate_node_prefix_cache_hit_ratio", "Each node's prefix-cache hits over its "
                                "queried prompt tokens in its probe's last interval (vLLM's own counters)",
                                labels=["node", "pool"])
        follow = GaugeMetricFamily("kvgate_probe_follow_nodes", "Nodes by how kvgate follows their probe: stream "
                                   "(one long-lived GET /snapshot/stream), poll (a probe without the stream) or "
                                   "connecting (its stream is down or not up yet)", labels=["mode", "pool"])
        tombstones = GaugeMetricFamily("kvgate_tombstones", "Ends of requests never admitted that kvgate remembers "
                                       "(a decision still on its way then grants nothing); bounded, 60 s each")
        blocks = GaugeMetricFamily("kvgate_prefix_index_blocks", "Prompt blocks in each pool's prefix index "
                                   "(nodes.prefix.max_blocks bounds it)", labels=["pool"])
        modes = self._stats.follow_modes
        if st is not None:
            tombstones.add_metric([], st.tombstones)
            a = st.admission
            labels_ = {self._stats.label(t.name) for t in a.tenants()}
            per: dict[tuple[str, str], int] = {(t, p): 0 for t in labels_ for p in a.queues}
            sent: dict[str, int] = {p: 0 for p in a.queues}
            for lease in a.leases(queued=True):  # queued requests hold their tenant's slot too
                if lease.charged:
                    key = (self._stats.label(lease.tenant.name), lease.pool)
                    per[key] = per.get(key, 0) + 1
            for lease in a.leases():
                if lease.holds_slot:  # best effort holds a fleet slot, not its tenant's
                    sent[lease.pool] = sent.get(lease.pool, 0) + 1
            for (label, pool), count in sorted(per.items()):
                inflight.add_metric([label, pool], count)
            for pool, count in sent.items():
                fleet.add_metric([pool], count)
            now = st.now()
            waiting = a.spare_waiting()
            for pool, q in a.queues.items():
                spare.add_metric([pool], waiting.get(pool, 0))
                behind = q.lagging_at(now)
                for tier in q.tiers():
                    depth.add_metric([tier, pool], q.depth(tier))
                    lagging.add_metric([tier, pool], 1.0 if tier in behind else 0.0)
                    share = q.refused_share_at(tier, now)
                    if share is not None:
                        refused.add_metric([tier, pool], share)
            for pool, f in st.fleets.items():
                cfg = f.cfg
                discovery = "+".join(k for k, on in (("static", bool(cfg.static)), ("dns", bool(cfg.dns))) if on)
                total.add_metric([discovery or "static", pool], len(f.nodes))
                blocks.add_metric([pool], len(f.prefix))
                for n in f.nodes.values():
                    labels = [n.address, pool]
                    if n.snapshot is not None and n.snapshot.kv_usage is not None:
                        kv.add_metric(labels, n.snapshot.kv_usage)
                        projected.add_metric(labels, n.projected_kv() or 0.0)
                        cap = n.capacity_tokens()
                        if cap is not None:
                            capacity.add_metric(labels, cap)
                    node_inflight.add_metric(labels, n.inflight)
                    profile.add_metric([*labels, n.profile, n.profile_source], 1)
                    breaker.add_metric(labels, STATE_VALUE[n.breaker.state])
                    if n.fresh_at is not None:
                        age.add_metric(labels, max(0.0, now - n.fresh_at))
                    rate = n.snapshot.prefix_hit_rate if n.snapshot is not None else None
                    if rate is not None:
                        hit.add_metric(labels, rate)
                if modes is not None:
                    by = dict.fromkeys(FOLLOW_MODES, 0)
                    for address in f.nodes:
                        mode = modes.get(address, "connecting")  # (a node added since the follower last looked)
                        by[mode] = by.get(mode, 0) + 1
                    for mode, count in by.items():
                        follow.add_metric([mode, pool], count)
        yield from (inflight, fleet, depth, spare, lagging, refused, total, kv, capacity, profile, projected,
                    node_inflight, age, breaker, hit, follow, tombstones, blocks)
