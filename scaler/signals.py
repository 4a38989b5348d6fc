"""Where the scaler's signals come from: every kvgate replica's /metrics, or a Prometheus that scrapes them.

Both give the same ``Signals``, one per model pool (``PoolSignals``): per-tenant admitted and
capacity-rejected requests over the window, policy rejections (and, of those, the ones for a tenant's
own request or token budget and the ones the fleet caused), admitted requests predicted to miss their
SLO and admitted requests released from kvgate's queue, requests held in kvgate's queues now, the vLLM
replicas kvgate sees and their mean KV-cache usage.
Shadow-mode would-be rejections are admits (they reached the fleet). A kvgate of an older version
exports no fleet-caused or predicted-miss counters: read as none.

Pools: every series is grouped by its ``pool`` label, so that each scaler pool acts on its own pool's
demand and replicas, not on the whole fleet's. A series without the label (a kvgate older than pools)
belongs to pool ``default``, the one pool of a kvgate without ``pools`` in its config; ``pool="none"``
labels requests refused before routing (no key, a bad body, a model no pool serves): they never wanted
any pool's capacity, so they count nowhere, not even in the fleet-wide sums. (A model the tenant may not
use is labelled with the pool that serves it; its 403 is class ``auth``, never demand.)

The PromQL of ``TRIGGER_QUERY`` (fleet-wide) and ``trigger_query(pool)`` (one pool) is what docs/operator/autoscaling.md
offers as a KEDA Prometheus trigger, for users who want no scaler service; ``TRIGGER_QUERY_BY_POOL`` is
the shipped recording rule ``kvgate:capacity_reject_ratio:rate2m`` (one series per pool).
"""

from __future__ import annotations

import json
import re
import socket
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ext_proc.addresses import join_hostport

from .law import Signals

# what one kvgate replica reports, cumulative
Totals = dict[tuple[str, str], float]
"""(kind, tenant) → count; kind: admitted | capacity | policy | budget (of policy: a tenant's own request
or token budget) | fleet (of policy: caused by the fleet) | slo_miss (of admitted: predicted to miss) |
waited (of admitted: waited in kvgate's gateway queue for room, :data:`WAITED_FOR_ROOM`; no tenant label,
tenant "") | prefill (seconds of prefill kvgate sent the pool's nodes, :data:`PREFILL_SECONDS`; tenant "")."""

KINDS = ("admitted", "capacity", "policy", "budget", "fleet", "slo_miss", "waited", "prefill")
BUDGET_REASONS = ("tenant-requests", "tenant-tokens")
"""The 429 reasons of a tenant over its own budget: never a scaling signal."""
FLEET_CAUSED = "kvgate_fleet_caused_rejections_total"
PREDICTED_MISSES = "kvgate_predicted_slo_misses_total"
WAITED_FOR_ROOM = "kvgate_queue_waited_for_room_total"
"""Admissions that waited in kvgate's queue for room (a node choice refused them, or a pass found their tier
no node, while they waited). Not every release from the queue: requests queued only because one of their
tier waited ahead, and released by the pass that found them room, wait for nothing — one unplaceable
prompt, re-sent, kept the scale-down gate shut when they counted (review11 F4); nor a wait's length, which
in a live kvgate includes an event-loop turn (review14). A kvgate older than the counter: every admitted
release from its queue (:data:`QUEUE_WAITS`, what the gate read before), so that a scaler upgraded first
keeps the gate (review15)."""
QUEUE_WAITS = "kvgate_queue_wait_seconds_count"
PREFILL_SECONDS = "kvgate_prefill_seconds_total"
"""Prefill compute kvgate sent each pool's nodes (seconds, by each node's performance model): its rate over
the window is the prefill load the scale-down bound reads. Absent from an older kvgate: 0, no bound."""

DEFAULT_POOL = "default"
"""The one pool of a kvgate without ``pools``, and of series without a pool label (ext_proc.pools.DEFAULT_POOL;
spelled out here so that the scaler reads kvgate's exposition format, not kvgate's code)."""
NO_POOL = "none"
"""``pool="none"``: requests refused before routing (ext_proc.pools.NO_POOL). Never a pool's demand."""
POOL_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
"""A pool's name, as kvgate's and the scaler's configs spell it (also what makes it safe inside PromQL)."""
POOLED = frozenset({"kvgate_requests_total", FLEET_CAUSED, PREDICTED_MISSES, WAITED_FOR_ROOM, QUEUE_WAITS,
                    PREFILL_SECONDS,
                    "kvgate_queue_depth_requests",
                    "kvgate_nodes_total", "kvgate_node_kv_usage_ratio", "kvgate_fleet_inflight_requests",
                    "kvgate_node_kv_capacity_tokens"})
"""The families whose ``pool`` label says which pools a kvgate reports (the gauges exist for every pool
from the start; the counters once a request came)."""


def pool_of(labels: Mapping[str, str]) -> str | None:
    """The pool a series counts for: its ``pool`` label, ``default`` without one; None for ``none``."""
    pool = labels.get("pool") or DEFAULT_POOL
    return None if pool == NO_POOL else pool


@dataclass(frozen=True)
class Reading:
    totals: Totals
    held: float
    nodes: int | None
    """vLLM nodes this replica knows; None when it does not choose nodes (Envoy does)."""
    kv_usage: float | None = None
    """The mean KV-cache usage of the nodes this replica probes; None: no node reading."""
    pools: Mapping[str, Reading] = field(default_factory=dict)
    """The same, per pool this replica reports (the fields above are their sums; pool ``none`` is in neither)."""


@dataclass
class _Acc:
    """One pool's running sums while a page is parsed."""

    totals: Totals = field(default_factory=dict)
    held: float = 0.0
    nodes: int | None = None
    kv: list[float] = field(default_factory=list)
    kv_of: dict[str, float] = field(default_factory=dict)
    """Node → its KV usage (``kvgate_node_kv_usage_ratio``)."""
    capacity: dict[str, float] = field(default_factory=dict)
    """Node → its KV cache in tokens (``kvgate_node_kv_capacity_tokens``; absent from an older kvgate)."""
    released: float = 0.0
    """Admitted releases from the queue (:data:`QUEUE_WAITS`): ``waited`` on a page without
    :data:`WAITED_FOR_ROOM`."""

    def add(self, key: tuple[str, str], v: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + v

    def reading(self) -> Reading:
        return Reading(self.totals, self.held, self.nodes, self.kv_usage())

    def kv_usage(self) -> float | None:
        """The pool's KV usage: used tokens over held tokens when every node says its size — a pool of
        mixed nodes (an 80 GB card beside a 40 GB one) is as full as its tokens, not as the mean of its
        nodes' ratios —, else the mean ratio (as before the capacity gauge existed)."""
        if self.kv_of and all(self.capacity.get(n) for n in self.kv_of):
            held = sum(self.capacity[n] for n in self.kv_of)
            return sum(u * self.capacity[n] for n, u in self.kv_of.items()) / held
        return sum(self.kv) / len(self.kv) if self.kv else None


def parse_kvgate(text: str) -> Reading:
    """One replica's exposition → cumulative counts, per pool and summed (raises ValueError on text that is
    not one)."""
    acc: dict[str, _Acc] = {}
    seen = room = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("kvgate_requests_total", "kvgate_fleet_inflight_requests"):
                seen = True
            if s.name not in POOLED:
                continue
            pool = pool_of(s.labels)
            if pool is None:  # refused before routing: no pool's demand, nor the fleet's
                continue
            a = acc.setdefault(pool, _Acc())
            tenant = s.labels.get("tenant", "")
            if s.name == "kvgate_requests_total":
                dec, cls = s.labels.get("decision"), s.labels.get("class")
                kind = ("admitted" if dec in ("admit", "shadow_reject") else
                        "capacity" if cls == "capacity" else "policy" if cls == "policy" else None)
                if kind is not None:
                    a.add((kind, tenant), s.value)
                if kind == "policy" and s.labels.get("reason") in BUDGET_REASONS:
                    a.add(("budget", tenant), s.value)
            elif s.name in (FLEET_CAUSED, PREDICTED_MISSES):
                a.add(("fleet" if s.name == FLEET_CAUSED else "slo_miss", tenant), s.value)
            elif s.name == WAITED_FOR_ROOM:
                room = True
                if s.value:  # (kvgate writes each tier's and pool's at 0 from the start)
                    a.add(("waited", ""), s.value)
            elif s.name == PREFILL_SECONDS:
                a.add(("prefill", ""), s.value)
            elif s.name == QUEUE_WAITS:
                if s.labels.get("outcome") == "admitted":
                    a.released += s.value
            elif s.name == "kvgate_queue_depth_requests":
                a.held += s.value
            elif s.name == "kvgate_nodes_total":
                a.nodes = (a.nodes or 0) + int(s.value)
            elif s.name == "kvgate_node_kv_usage_ratio":
                a.kv.append(s.value)
                a.kv_of[s.labels.get("node", "")] = s.value
            elif s.name == "kvgate_node_kv_capacity_tokens":
                a.capacity[s.labels.get("node", "")] = s.value
    if not seen:
        raise ValueError("not a kvgate metrics page (no kvgate_requests_total / kvgate_fleet_inflight_requests)")
    if not room:  # an older kvgate
        for a in acc.values():
            if a.released:
                a.add(("waited", ""), a.released)
    whole = _Acc()
    for a in acc.values():
        for k, v in a.totals.items():
            whole.add(k, v)
        whole.held += a.held
        if a.nodes is not None:
            whole.nodes = (whole.nodes or 0) + a.nodes
        whole.kv += a.kv
        whole.kv_of.update(a.kv_of)
        whole.capacity.update(a.capacity)
    r = whole.reading()
    return Reading(r.totals, r.held, r.nodes, r.kv_usage, {p: a.reading() for p, a in acc.items()})


def _signals(at: float, delta: Totals, held: float, nodes: int | None, complete: bool,
             kv_usage: float | None = None) -> Signals:
    by: dict[str, dict[str, float]] = {k: {} for k in KINDS}
    for (kind, tenant), v in delta.items():
        by[kind][tenant] = by[kind].get(tenant, 0.0) + v
    return Signals(at, by["admitted"], by["capacity"], by["policy"], held, nodes, complete,
                   fleet_caused=by["fleet"], budget_rejected=by["budget"], slo_missed=by["slo_miss"],
                   kv_usage=kv_usage, waited=sum(by["waited"].values()),
                   prefill_seconds=sum(by["prefill"].values()))


def _summed(dicts: Iterable[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


@dataclass(frozen=True)
class PoolSignals(Mapping[str, Signals]):
    """The signals of every pool kvgate reports, read together at ``at`` (a mapping pool → ``Signals``).

    ``complete`` is the read's: one kvgate replica not answering undercounts every pool alike."""

    at: float
    pools: Mapping[str, Signals] = field(default_factory=dict)
    complete: bool = True

    def __getitem__(self, pool: str) -> Signals:
        return self.pools[pool]

    def __iter__(self) -> Iterator[str]:
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)

    @property
    def shared(self) -> bool:
        """Whether kvgate reports no pool but ``default``: a kvgate without ``pools`` (or older than pools)
        has one fleet, and every scaler pool reads its signal, as before pools existed — so that a scaler
        config written then (a pool named after its Deployment) keeps scaling on it."""
        return set(self.pools) <= {DEFAULT_POOL}

    def of(self, pool: str) -> Signals:
        """What scaler pool ``pool`` acts on: kvgate's pool of that name; with a ``shared`` signal, the
        fleet's; otherwise, a pool kvgate does not report, nothing: zero demand and no replicas seen —
        a complete read that saw no request for the pool is not missing data."""
        sig = self.pools.get(DEFAULT_POOL if self.shared else pool)
        return sig if sig is not None else Signals(self.at, complete=self.complete)

    def reported(self, pool: str) -> bool:
        """Whether kvgate reports series for scaler pool ``pool`` (else it reads zero demand)."""
        return pool in self.pools or (self.shared and DEFAULT_POOL in self.pools)

    def fleet(self) -> Signals:
        """Every pool's signals summed (replicas added; KV-cache usage averaged over their replicas)."""
        sigs = list(self.pools.values())
        replicas = [s.replicas for s in sigs if s.replicas is not None]
        kv = [(s.kv_usage, s.replicas) for s in sigs if s.kv_usage is not None]
        weight = sum(n or 0 for _, n in kv)
        kv_usage = (None if not kv else sum(u * (n or 0) for u, n in kv) / weight if weight
                    else sum(u for u, _ in kv) / len(kv))
        return Signals(self.at, _summed(s.admitted for s in sigs), _summed(s.capacity_rejected for s in sigs),
                       _summed(s.policy_rejected for s in sigs), sum(s.held for s in sigs),
                       sum(replicas) if replicas else None, self.complete,
                       fleet_caused=_summed(s.fleet_caused for s in sigs),
                       budget_rejected=_summed(s.budget_rejected for s in sigs),
                       slo_missed=_summed(s.slo_missed for s in sigs), kv_usage=kv_usage,
                       waited=sum(s.waited for s in sigs), prefill_seconds=sum(s.prefill_seconds for s in sigs))

    @classmethod
    def single(cls, sig: Signals) -> PoolSignals:
        """Fleet-wide signals (a source that knows no pools) as the one pool ``default``: every scaler pool
        reads them."""
        return cls(sig.at, {DEFAULT_POOL: sig}, sig.complete)


@dataclass
class DirectSource:
    """Scrapes every kvgate replica and differences its counters over ``window_s`` itself.

    Replicas: fixed ``urls``, and/or every address ``dns`` ("name:port" of a headless Service)
    resolves to at each read."""

    urls: list[str]
    window_s: float = 60.0
    timeout_s: float = 2.0
    dns: str | None = None
    _history: dict[str, deque[tuple[float, dict[str, Totals]]]] = field(default_factory=dict)

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
        """Every pool's signals summed (``read_pools(now).fleet()``): one read, as the scaler did before pools."""
        return self.read_pools(now).fleet()

    def read_pools(self, now: float) -> PoolSignals:
        delta: dict[str, Totals] = {}
        held: dict[str, float] = {}
        nodes: dict[str, int] = {}
        kv: dict[str, list[float]] = {}
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
            for pool, r in reading.pools.items():
                held[pool] = held.get(pool, 0.0) + r.held
                if r.nodes is not None:  # every replica sees the same pool: the largest view
                    nodes[pool] = max(nodes.get(pool, 0), r.nodes)
                if r.kv_usage is not None:
                    kv.setdefault(pool, []).append(r.kv_usage)
            h = self._history.get(url)
            if h is None:
                h = self._history[url] = deque()
                # A replica that appears later is new: all its counts fall in the window. On the scaler's
                # own first read the replicas' totals span their whole lives, not a window: no verdict yet.
                complete = complete and not first
            h.append((now, {pool: r.totals for pool, r in reading.pools.items()}))
            while len(h) > 2 and h[1][0] <= now - self.window_s:
                h.popleft()
            base = h[0][1] if len(h) > 1 else {}
            for pool, r in reading.pools.items():
                was, d = base.get(pool, {}), delta.setdefault(pool, {})
                for k, v in r.totals.items():
                    before = was.get(k, 0.0)
                    d[k] = d.get(k, 0.0) + (v - before if v >= before else v)  # a counter reset: it restarted
        return PoolSignals(now, {pool: _signals(now, d, held.get(pool, 0.0), nodes.get(pool), complete,
                                                sum(kv[pool]) / len(kv[pool]) if pool in kv else None)
                                 for pool, d in delta.items()}, complete)


QUERIES = {
    "admitted": 'sum by (tenant, pool) (increase(kvgate_requests_total{decision=~"admit|shadow_reject"}[%s]))',
    "capacity": 'sum by (tenant, pool) (increase(kvgate_requests_total{decision="reject",class="capacity"}[%s]))',
    "policy": 'sum by (tenant, pool) (increase(kvgate_requests_total{decision="reject",class="policy"}[%s]))',
    "budget": 'sum by (tenant, pool) (increase(kvgate_requests_total{decision="reject",class="policy",'
              f'reason=~"{"|".join(BUDGET_REASONS)}"}}[%s]))',
    # absent from an older kvgate: no series, an empty answer, none counted
    "fleet": f"sum by (tenant, pool) (increase({FLEET_CAUSED}[%s]))",
    "slo_miss": f"sum by (tenant, pool) (increase({PREDICTED_MISSES}[%s]))",
    # (an older kvgate, without the counter: every admitted release from its queue, as the gate read before;
    # chosen per replica, as parse_kvgate does per page — per pool, a rolling upgrade's newer replica hid
    # every older one's releases: review16)
    "waited": f"sum by (pool) (sum by (instance, pool) (increase({WAITED_FOR_ROOM}[%s])) or "
              f'sum by (instance, pool) (increase({QUEUE_WAITS}{{outcome="admitted"}}[%s])))',
    "prefill": f"sum by (pool) (increase({PREFILL_SECONDS}[%s]))",
    "held": "sum by (pool) (kvgate_queue_depth_requests)",
    # per kvgate replica (instance): the largest view of each pool is taken after pool-less series join "default"
    "nodes": "sum by (instance, pool) (kvgate_nodes_total)",
    "kv_sum": "sum by (pool) (kvgate_node_kv_usage_ratio)",
    "kv_count": "count by (pool) (kvgate_node_kv_usage_ratio)",
    # a pool of mixed nodes: used over held tokens (none from a kvgate without the capacity gauge)
    "kv_tokens": "sum by (pool) (kvgate_node_kv_usage_ratio * on (instance, node, pool) "
                 "kvgate_node_kv_capacity_tokens)",
    "kv_capacity": "sum by (pool) (kvgate_node_kv_capacity_tokens and on (instance, node, pool) "
                   "kvgate_node_kv_usage_ratio)",
    "pools": "count by (pool) (kvgate_fleet_inflight_requests)",
    "replicas_up": 'count(up{job="%s"} == 1)',
    "replicas_all": 'count(up{job="%s"})',
    "scraped": 'min(timestamp(up{job="%s"}))',  # (PrometheusSource.instant)
}

_CAPACITY = 'kvgate_requests_total{%sdecision="reject",class="capacity"}'
_ADMITTED = 'kvgate_requests_total{%sdecision=~"admit|shadow_reject"}'


def _ratio(selector: str) -> str:
    cap = f"(sum(rate({_CAPACITY % selector}[2m])) or vector(0))"
    adm = f"(sum(rate({_ADMITTED % selector}[2m])) or vector(0))"
    return f"{cap} / clamp_min({adm} + {cap}, 1e-9)"


TRIGGER_QUERY = _ratio("")
"""The simple path (docs, Autoscaling): the capacity reject ratio as a KEDA Prometheus trigger, metricType Value.
Fleet-wide: for a kvgate without pools (every series its pool ``default``, labelled or not)."""


def trigger_query(pool: str) -> str:
    """``TRIGGER_QUERY`` of one pool (``{pool="<name>"}`` selectors): the trigger of that pool's
    ScaledObject, so that a flood on one model scales only the Deployment serving it."""
    if not POOL_NAME.match(pool) or pool == NO_POOL:
        raise ValueError(f"pool {pool!r}: not a pool name (^[a-z0-9][a-z0-9_.-]{{0,62}}$, not {NO_POOL!r})")
    return _ratio(f'pool="{pool}",')


_CAP_BY_POOL = f"sum by (pool) (rate({_CAPACITY % ''}[2m]))"
_ADM_BY_POOL = f"sum by (pool) (rate({_ADMITTED % ''}[2m]))"
TRIGGER_QUERY_BY_POOL = (f"({_CAP_BY_POOL} or {_ADM_BY_POOL} * 0) / "
                         f"clamp_min(({_ADM_BY_POOL} or {_CAP_BY_POOL} * 0) + ({_CAP_BY_POOL} or {_ADM_BY_POOL} * 0), "
                         "1e-9)")
"""The capacity reject ratio of every pool at once, one series per ``pool`` (a pool without 503s — no such
series yet — reads 0, not nothing): the shipped rule records it as ``kvgate:capacity_reject_ratio:rate2m``,
so ``kvgate:capacity_reject_ratio:rate2m{pool="<name>"}`` is ``trigger_query(name)``."""


@dataclass
class PrometheusSource:
    """Asks a Prometheus (instant queries over ``window_s``); ``job`` is kvgate's scrape job."""

    url: str
    job: str = "kvgate"
    window_s: float = 60.0
    timeout_s: float = 2.0

    def query(self, q: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query's vector; ``at``: the evaluation time (Unix seconds), Prometheus's now if None."""
        params = {"query": q} if at is None else {"query": q, "time": f"{at:.3f}"}
        u = self.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(u, timeout=self.timeout_s) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise ValueError(f"prometheus: {doc.get('error', doc)}")
        return [(x.get("metric", {}), float(x["value"][1])) for x in doc["data"]["result"]]

    def instant(self) -> float | None:
        """The moment one reading asks every query at: the oldest of the kvgate targets' last scrapes
        (None: no target). Asked each at its own now, a ratio's two ``increase()`` could straddle a scrape
        that Prometheus was still writing — one query with its samples, the next without, extrapolated
        differently: a 40% reject ratio read as 35% in 2 of 49 readings. A scrape is written whole, and
        no target's next scrape is older than its last, so at this moment every sample is in."""
        rows = self.query(QUERIES["scraped"] % self.job)
        return rows[0][1] if rows else None

    def read(self, now: float) -> Signals:
        """Every pool's signals summed (``read_pools(now).fleet()``)."""
        return self.read_pools(now).fleet()

    def read_pools(self, now: float) -> PoolSignals:
        w = f"{int(self.window_s)}s"
        seen: set[str] = set()

        def rows(q: str) -> Iterator[tuple[str, dict[str, str], float]]:
            for labels, v in self.query(q, at):
                pool = pool_of(labels)
                if pool is not None:
                    seen.add(pool)
                    yield pool, labels, v

        try:
            at = self.instant()
            delta: dict[str, Totals] = {}
            for kind in KINDS:
                for pool, labels, v in rows(QUERIES[kind].replace("%s", w)):  # (the window, wherever named)
                    d, key = delta.setdefault(pool, {}), (kind, labels.get("tenant", ""))
                    d[key] = d.get(key, 0.0) + v  # pool-less and pool="default" rows: one pool
            held = _by_pool(rows(QUERIES["held"]))
            per_instance: dict[tuple[str, str], float] = {}
            for pool, labels, v in rows(QUERIES["nodes"]):
                key = (pool, labels.get("instance", ""))
                per_instance[key] = per_instance.get(key, 0.0) + v
            nodes: dict[str, int] = {}
            for (pool, _), v in per_instance.items():
                nodes[pool] = max(nodes.get(pool, 0), int(v))
            kv_sum = _by_pool(rows(QUERIES["kv_sum"]))
            kv_count = _by_pool(rows(QUERIES["kv_count"]))
            kv_tokens = _by_pool(rows(QUERIES["kv_tokens"]))
            kv_held = _by_pool(rows(QUERIES["kv_capacity"]))
            for pool, held_tokens in kv_held.items():
                if held_tokens > 0:  # weighted by each node's size; the plain mean where no node says it
                    kv_sum[pool], kv_count[pool] = kv_tokens.get(pool, 0.0), held_tokens
            for _ in rows(QUERIES["pools"]):
                pass
            up = sum(v for _, v in self.query(QUERIES["replicas_up"] % self.job, at))
            total = sum(v for _, v in self.query(QUERIES["replicas_all"] % self.job, at))
        except (OSError, ValueError, KeyError) as e:
            raise SourceError(f"prometheus at {self.url}: {e}") from e
        if total == 0:
            raise SourceError(f"prometheus at {self.url}: no scrape target in job {self.job!r}")
        complete = up == total
        return PoolSignals(now, {pool: _signals(now, delta.get(pool, {}), held.get(pool, 0.0), nodes.get(pool),
                                                complete, kv_sum[pool] / kv_count[pool] if kv_count.get(pool)
                                                else None)
                                 for pool in seen}, complete)


def _by_pool(rows: Iterable[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """A query's rows summed per pool (pool-less and pool="default" rows: one pool)."""
    out: dict[str, float] = {}
    for pool, _, v in rows:
        out[pool] = out.get(pool, 0.0) + v
    return out


class SourceError(Exception):
    """The signal source could not be read: the law holds."""
