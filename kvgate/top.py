"""``kvgate top``: a live view of running kvgate replicas, read from their Prometheus ``/metrics``.

Per tenant: admitted / 429 / 503 / other-rejection rates and requests in flight; per node: KV usage
and breaker state; per tier: gateway-queue depth and admission-to-completion latency. Rates come from
two scrapes (counters summed over every ``--metrics`` URL, so several replicas read as one gateway).
Where the metrics carry a ``pool`` label, every table is split by pool.

The view shows what the metrics can tell and nothing else: a column or table with no figure in it is
left out (``/metrics`` has no time to first token, so the TTFT columns appear only where a caller adds
them, as ``kvgate demo`` does), and requests refused because no known key named a tenant are counted
on their own line, not as a tenant called ``unknown`` (their metrics put them in the lowest tier only
because a label must have a value). Each frame ends with where its figures come from.

With ``rich`` on a terminal the view refreshes in place; otherwise (a pipe, a log file, ``--once``
without a terminal) it prints plain text frames. ``kvgate demo`` renders the same view with the
client-side TTFT of each tenant added.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .dev.stack import http_get

BREAKER = {0: "closed", 1: "half-open", 2: "open"}


class ScrapeError(Exception):
    pass


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Scrape:
    at: float
    samples: list[Sample]


def scrape(url: str, timeout: float = 2.0) -> Scrape:
    """One read of a kvgate /metrics endpoint; ScrapeError with the reason if it cannot be read."""
    try:
        code, body = http_get(url, timeout=timeout)
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise ScrapeError(f"{url}: cannot read metrics ({getattr(e, 'reason', e)})") from e
    if code != 200:
        raise ScrapeError(f"{url}: HTTP {code}")
    try:
        samples = [Sample(s.name, dict(s.labels), float(s.value))
                   for fam in text_string_to_metric_families(body.decode(errors="replace")) for s in fam.samples]
    except ValueError as e:
        raise ScrapeError(f"{url}: not Prometheus text ({e})") from e
    if not any(s.name.startswith("kvgate_") for s in samples):
        raise ScrapeError(f"{url}: no kvgate_* metrics there (is it kvgate's metrics_address?)")
    return Scrape(time.monotonic(), samples)


@dataclass
class TenantRow:
    admit: float = 0.0
    r429: float = 0.0
    r503: float = 0.0
    other: float = 0.0
    shadow: float = 0.0
    """Per second over the interval; shadow = would-be rejections (admitted)."""
    inflight: float = 0.0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    """Client-side TTFT in seconds (the demo knows it; /metrics does not)."""


@dataclass
class NodeRow:
    kv: float | None = None
    breaker: int = 0
    inflight: float = 0.0


@dataclass
class TierRow:
    queued: float = 0.0
    p50: float | None = None
    p99: float | None = None
    """Admission-to-completion latency over the interval (seconds, from the histogram's buckets)."""


@dataclass
class Pool:
    tenants: dict[str, TenantRow] = field(default_factory=lambda: defaultdict(TenantRow))
    nodes: dict[str, NodeRow] = field(default_factory=lambda: defaultdict(NodeRow))
    tiers: dict[str, TierRow] = field(default_factory=lambda: defaultdict(TierRow))
    unidentified: float = 0.0
    """Requests per second refused because no known API key named a tenant (``tenant="unknown"``)."""
    late: float = 0.0
    """Requests per second kvgate decided after Envoy had given up waiting (Envoy answered them 503
    ``gateway-unavailable`` itself): kvgate does not look up whose they were, so their series read
    ``tenant="unknown"``, ``tier="none"`` like callers with no known key, but their keys may be fine."""

    def empty(self) -> bool:
        return not (self.tenants or self.nodes or self.tiers or self.unidentified or self.late)


UNIDENTIFIED = "unknown"
"""The tenant label kvgate gives a request whose key names no tenant (``admission.UNKNOWN_TENANT``)."""
LATE = "decided after Envoy gave up (it answered 503 gateway-unavailable; whose is not known)"
NO_TENANT_REASONS = frozenset({"unknown-key", "invalid-authorization"})


def _unidentified(labels: dict[str, str]) -> bool:
    """A series of callers no tenant was found for: labelled ``unknown`` and either refused before
    identity (``tier="none"``) or for their key (shadow mode admits them in the lowest tier; an older
    kvgate labelled their refusals so). A configured tenant named ``unknown`` is still a tenant."""
    return labels.get("tenant") == UNIDENTIFIED and (labels.get("tier") == "none"
                                                    or labels.get("reason") in NO_TENANT_REASONS)


@dataclass
class Store:
    """Several replicas sharing a store: how many sync, how many enforce their local split, borrows/s."""

    replicas: int = 0
    up: int = 0
    local_split: int = 0
    borrows: float = 0.0
    versions: set[str] = field(default_factory=set)
    """The config versions the replicas run (more than one: a reload has not reached them all)."""


@dataclass
class View:
    pools: dict[str, Pool]
    interval: float
    sources: int
    title: str = "kvgate top"
    store: Store | None = None
    """None: no replica has a shared store."""
    ttft_source: str | None = None
    """Where the tenants' TTFT figures come from, set by whoever adds them (``kvgate demo``)."""


def _clean(labels: dict[str, str]) -> dict[str, str]:
    """Label values fit to print: ``top`` reads whatever page its URL serves, so a control character (a
    terminal escape sequence, a newline that would forge a row of the frame) becomes ``?``."""
    return {k: v if v.isprintable() else "".join(c if c.isprintable() else "?" for c in v)
            for k, v in labels.items()}


def _int(x: float, default: int = 0) -> int:
    """A gauge read as a whole number; ``default`` for NaN or an infinity (``int()`` would raise)."""
    return int(x) if math.isfinite(x) else default


def _counters(scrapes: Iterable[Scrape]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
    for i, sc in enumerate(scrapes):
        for s in sc.samples:
            if s.name in ("kvgate_requests_total", "kvgate_store_borrows_total") or \
                    s.name.startswith("kvgate_request_duration_seconds_bucket"):
                out[(s.name, (("_src", str(i)), *sorted(_clean(s.labels).items())))] += s.value
    return out


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """``histogram_quantile`` over cumulative (le, count) pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_le, lo_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return lo_le
            return lo_le + (le - lo_le) * ((rank - lo_n) / (n - lo_n) if n > lo_n else 1.0)
        lo_le, lo_n = le, n
    return lo_le


def build(prev: list[Scrape], cur: list[Scrape], title: str = "kvgate top") -> View:
    """The view from two scrapes of the same URLs (rates over the time between them)."""
    interval = max(1e-3, min(c.at - p.at for p, c in zip(prev, cur, strict=True))) if prev else 0.0
    before, after = _counters(prev), _counters(cur)
    pools: dict[str, Pool] = defaultdict(Pool)
    store = Store()
    hist: dict[tuple[str, str], dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for key, v in after.items():
        name, labels_t = key
        labels = dict(labels_t)
        d = max(0.0, v - before.get(key, 0.0)) if interval else v
        pool = labels.get("pool", "")
        if name == "kvgate_store_borrows_total":
            store.borrows += d / interval if interval else 0.0
            continue
        if name == "kvgate_requests_total":
            rate = d / interval if interval else 0.0
            if _unidentified(labels):
                if labels.get("class") == "gateway":
                    pools[pool].late += rate
                else:
                    pools[pool].unidentified += rate
                continue
            row = pools[pool].tenants[labels.get("tenant", "?")]
            decision, klass = labels.get("decision"), labels.get("class")
            if decision == "admit":
                row.admit += rate
            elif decision == "shadow_reject":
                row.shadow += rate
            elif klass == "policy":
                row.r429 += rate
            elif klass == "capacity":
                row.r503 += rate
            else:
                row.other += rate
        else:
            try:
                le = float(labels.get("le", "inf"))
            except ValueError:
                continue  # not a bucket bound: no quantile can use it
            hist[(pool, labels.get("tier", "?"))][le] += d
    for (pool, tier), b in hist.items():
        t = pools[pool].tiers[tier]
        t.p50, t.p99 = _quantile(list(b.items()), 0.5), _quantile(list(b.items()), 0.99)
    for sc in cur:
        for s in sc.samples:
            labels = _clean(s.labels)
            p = pools[labels.get("pool", "")]
            if s.name == "kvgate_inflight_requests":
                name = labels.get("tenant", "?")
                if name != UNIDENTIFIED or name in p.tenants:  # the unknown slot's gauge, unless a tenant's
                    p.tenants[name].inflight += s.value
            elif s.name == "kvgate_queue_depth_requests":
                p.tiers[labels.get("tier", "?")].queued += s.value
            elif s.name == "kvgate_node_kv_usage_ratio":
                n = p.nodes[labels.get("node", "?")]
                if math.isfinite(s.value):  # else unknown, as with no snapshot
                    n.kv = max(n.kv or 0.0, s.value)
            elif s.name == "kvgate_node_breaker_state":
                n = p.nodes[labels.get("node", "?")]
                n.breaker = max(n.breaker, _int(s.value, default=-1))  # -1: shown as "?"
            elif s.name == "kvgate_node_inflight_requests":
                p.nodes[labels.get("node", "?")].inflight += s.value
            elif s.name == "kvgate_store_up":
                store.replicas += 1
                store.up += _int(s.value)
            elif s.name == "kvgate_store_fallback":
                store.local_split += _int(s.value)
            elif s.name == "kvgate_config_info" and s.value:
                store.versions.add(labels.get("version", "?"))
    return View(_one_pool(dict(pools)), interval, len(cur), title, store if store.replicas else None)


def _one_pool(pools: dict[str, Pool]) -> dict[str, Pool]:
    """A config without pools shows as one table with no pool heading: its pool (``default``), the
    requests refused before routing (``none``) and an older kvgate's unlabelled series are one."""
    if not set(pools) <= {"", "default", "none"}:
        return {name: p for name, p in pools.items() if not p.empty()}
    one = Pool()
    for p in pools.values():
        one.unidentified += p.unidentified
        one.late += p.late
        for name, row in p.tenants.items():
            into = one.tenants[name]
            for f in fields(row):
                a, b = getattr(into, f.name), getattr(row, f.name)
                if f.name.startswith("ttft"):  # latencies do not add: the one that is known
                    setattr(into, f.name, a if a is not None else b)
                else:
                    setattr(into, f.name, a + b)
        for name, n in p.nodes.items():  # a node, or a tier's latency, belongs to one pool
            one.nodes.setdefault(name, n)
        for name, t in p.tiers.items():
            one.tiers.setdefault(name, t)
    return {"": one}


# -- rendering -------------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _bar(ratio: float | None, width: int = 20) -> str:
    if ratio is None:
        return "[" + "?" * width + "]"
    n = round(max(0.0, min(1.0, ratio)) * width)
    return "[" + "#" * n + "." * (width - n) + "]"


def _has_ttft(v: View) -> bool:
    return any(r.ttft_p50 is not None or r.ttft_p99 is not None for p in v.pools.values() for r in p.tenants.values())


def _has_latency(p: Pool) -> bool:
    return any(tr.p50 is not None or tr.p99 is not None for tr in p.tiers.values())


def sources(v: View) -> list[str]:
    """Where each figure of the frame comes from (only those the frame shows)."""
    out = [f"rates: kvgate_requests_total, difference of two scrapes {v.interval:.1f}s apart"
           + (f", summed over {v.sources} replicas" if v.sources > 1 else "")
           + "; in flight: kvgate_inflight_requests"]
    if _has_ttft(v):
        out.append(f"TTFT: {v.ttft_source or 'added by the caller'} (kvgate's /metrics has no TTFT)")
    if any(p.nodes for p in v.pools.values()):
        out.append("nodes: kvgate_node_kv_usage_ratio (each probe's last snapshot), kvgate_node_inflight_requests, "
                   "kvgate_node_breaker_state")
    if any(p.tiers for p in v.pools.values()):
        out.append("tiers: kvgate_queue_depth_requests"
                   + ("; latency: kvgate_request_duration_seconds (admission to the end of the response, "
                      "not TTFT)" if any(_has_latency(p) for p in v.pools.values()) else ""))
    if any(p.unidentified for p in v.pools.values()):
        out.append('no known key: kvgate_requests_total{tenant="unknown"} (callers, not a tenant)')
    if any(p.late for p in v.pools.values()):
        out.append('decided after Envoy gave up: kvgate_requests_total{tenant="unknown",class="gateway"}')
    return out


def text(v: View) -> str:
    """A plain-text frame (no colours, no cursor movement): for pipes, logs and tests."""
    lines = [f"{v.title}: {v.sources} source(s), rates over {v.interval:.1f}s"]
    ttft = _has_ttft(v)
    for name, p in sorted(v.pools.items()):
        ind = "  "
        if name:
            lines.append(f"pool {name}")
            ind = "    "
        if p.tenants:
            lines.append(f"{ind}{'tenant':<12}{'admit/s':>9}{'429/s':>8}{'503/s':>8}{'other/s':>9}{'shadow/s':>10}"
                         f"{'inflight':>10}" + (f"{'TTFT p50':>10}{'p99 ms':>8}" if ttft else ""))
        for t, r in sorted(p.tenants.items()):
            lines.append(f"{ind}{t:<12}{r.admit:>9.1f}{r.r429:>8.1f}{r.r503:>8.1f}{r.other:>9.1f}{r.shadow:>10.1f}"
                         f"{r.inflight:>10.0f}" + (f"{_ms(r.ttft_p50):>10}{_ms(r.ttft_p99):>8}" if ttft else ""))
        if p.unidentified:
            lines.append(f"{ind}no known key: {p.unidentified:.1f}/s (401 when enforcing; admitted in shadow mode)")
        if p.late:
            lines.append(f"{ind}{LATE}: {p.late:.1f}/s")
        for n, nr in sorted(p.nodes.items()):
            kv = "  ?" if nr.kv is None else f"{nr.kv:>4.0%}"
            lines.append(f"{ind}node {n:<22} KV {_bar(nr.kv)} {kv}  in flight {nr.inflight:>3.0f}  "
                         f"breaker {BREAKER.get(nr.breaker, '?')}")
        latency = _has_latency(p)
        for t, tr in sorted(p.tiers.items()):
            lines.append(f"{ind}tier {t:<12} queued {tr.queued:>4.0f}" + (
                f"   latency p50 {_ms(tr.p50):>6} ms  p99 {_ms(tr.p99):>6} ms (admission to end)" if latency else ""))
    if v.store is not None:
        lines.append(_store_line(v.store))
    lines += ["sources:", *(f"  {s}" for s in sources(v))]
    return "\n".join(lines)


def _store_line(st: Store) -> str:
    return (f"store: {st.up}/{st.replicas} replicas syncing, {st.local_split} on their local split, "
            f"{st.borrows:.1f} borrows/s, config {'/'.join(sorted(st.versions)) or '?'}")


def rich_view(v: View) -> Any:
    """The same frame as rich tables (imported lazily: rich is only needed on a terminal)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    # names come from the metrics page: plain Text (and escaped titles), never rich markup ("[/]" would raise)

    parts: list[Any] = [Text(f"{v.title} — {v.sources} source(s), rates over {v.interval:.1f}s", style="bold")]
    ttft = _has_ttft(v)
    for name, p in sorted(v.pools.items()):
        sfx = f" (pool {name})" if name else ""
        if p.tenants:
            t = Table(title=escape(f"tenants{sfx}"), title_justify="left", expand=False)
            cols = ["tenant", "admit/s", "429/s", "503/s", "other/s", "shadow/s", "in flight"]
            for col in cols + (["TTFT p50 ms", "TTFT p99 ms"] if ttft else []):
                t.add_column(col, justify="left" if col == "tenant" else "right")
            for tn, r in sorted(p.tenants.items()):
                t.add_row(Text(tn), f"{r.admit:.1f}", Text(f"{r.r429:.1f}", style="yellow" if r.r429 else ""),
                          Text(f"{r.r503:.1f}", style="red" if r.r503 else ""), f"{r.other:.1f}", f"{r.shadow:.1f}",
                          f"{r.inflight:.0f}", *((_ms(r.ttft_p50), _ms(r.ttft_p99)) if ttft else ()))
            parts.append(t)
        if p.unidentified:
            parts.append(Text(f"no known key{sfx}: {p.unidentified:.1f}/s "
                              "(401 when enforcing; admitted in shadow mode)"))
        if p.late:
            parts.append(Text(f"{LATE}{sfx}: {p.late:.1f}/s", style="yellow"))
        if p.nodes:
            nt = Table(title=escape(f"nodes{sfx}"), title_justify="left")
            for col in ("node", "KV", "", "in flight", "breaker"):
                nt.add_column(col)
            for nn, nr in sorted(p.nodes.items()):
                style = "red" if (nr.kv or 0) > 0.9 else "yellow" if (nr.kv or 0) > 0.7 else "green"
                state = BREAKER.get(nr.breaker, "?")
                nt.add_row(Text(nn), Text(_bar(nr.kv), style=style), "?" if nr.kv is None else f"{nr.kv:.0%}",
                           f"{nr.inflight:.0f}", Text(state, style={"closed": "green", "open": "red"}.get(state,
                                                                                                   "yellow")))
            parts.append(nt)
        if p.tiers:
            latency = _has_latency(p)
            qt = Table(title=escape(f"tiers{sfx}"), title_justify="left")
            for col in ("tier", "queued") + (("latency p50 ms", "p99 ms (admission to end)") if latency else ()):
                qt.add_column(col, justify="left" if col == "tier" else "right")
            for tn, tr in sorted(p.tiers.items()):
                qt.add_row(Text(tn), f"{tr.queued:.0f}", *((_ms(tr.p50), _ms(tr.p99)) if latency else ()))
            parts.append(qt)
    if v.store is not None:
        bad = v.store.up < v.store.replicas or v.store.local_split or len(v.store.versions) > 1
        parts.append(Text(_store_line(v.store), style="yellow" if bad else ""))
    parts.append(Text("sources: " + "\n  ".join(sources(v)), style="dim"))
    return Group(*parts)


def use_rich(stream: Any = None) -> bool:
    stream = stream if stream is not None else sys.stdout
    if not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


class Live:
    """Shows frames: in place with rich on a terminal, else plain text every ``plain_every`` seconds."""

    def __init__(self, stream: Any = None, plain_every: float = 5.0) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.fancy = use_rich(self.stream)
        self.plain_every = plain_every
        self._last = -math.inf
        self._live: Any = None

    def __enter__(self) -> Live:
        if self.fancy:
            from rich.console import Console
            from rich.live import Live as RichLive

            self._live = RichLive(console=Console(file=self.stream), auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def show(self, v: View, force: bool = False) -> None:
        if self._live is not None:
            self._live.update(rich_view(v), refresh=True)
        elif force or time.monotonic() - self._last >= self.plain_every:
            self._last = time.monotonic()
            print(text(v) + "\n", file=self.stream, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)


def watch(urls: list[str], interval: float, stop: Callable[[], bool], live: Live,
          decorate: Callable[[View], None] | None = None, title: str = "kvgate top") -> None:
    """Scrape ``urls`` every ``interval`` seconds until ``stop()``, showing each frame."""
    prev = [scrape(u) for u in urls]
    while not stop():
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not stop():
            time.sleep(0.05)
        try:
            cur = [scrape(u) for u in urls]
        except ScrapeError:
            continue  # a replica restarting: keep the last frame
        v = build(prev, cur, title)
        if decorate is not None:
            decorate(v)
        live.show(v)
        prev = cur


def main(a: argparse.Namespace) -> int:
    urls = [u if "://" in u else f"http://{u}" for u in a.metrics]
    try:
        first = [scrape(u) for u in urls]
        if a.once:
            time.sleep(a.interval if a.interval < 2 else 1.0)
            v = build(first, [scrape(u) for u in urls])
            if use_rich():
                from rich.console import Console

                Console().print(rich_view(v))
            else:
                print(text(v), flush=True)
            return 0
        with Live(plain_every=a.interval) as live:
            live.show(build([], first))
            watch(urls, a.interval, lambda: False, live)
    except ScrapeError as e:
        print(f"kvgate top: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
