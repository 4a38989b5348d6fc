"""``kvgate up`` and ``kvgate demo``: the local stack in the foreground, and what kvgate changes.

``kvgate demo`` drives one seeded open-loop flood twice through the same simulated vLLM nodes: first
with kvgate in shadow mode (every request admitted, decisions only counted: the fleet as it is
without admission control), then with kvgate enforcing. The tenants: an interactive chatbot within
its quota, a RAG pipeline flooding far past its share with long prompts, a batch tenant, and a
client with an unknown key (shadow mode lets it through like a bare proxy; enforcing, it gets 401). It shows a
live view while each run goes (``kvgate top``'s, with each tenant's TTFT as the clients saw it) and
ends with a before/after summary per tenant; ``--json`` prints only that summary, as one JSON
document on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from ext_proc.config import DEFAULT_TIERS, load_config, load_yaml
from ext_proc.identity import hash_key

from .. import top
from . import loadgen
from .loadgen import Result, Traffic
from .stack import RedisMissing, SimPool, Stack, redis_binary


@dataclass(frozen=True)
class Client:
    traffic: Traffic
    tier: str
    role: str


CLIENTS = [
    Client(Traffic("chatbot", "sk-demo-chatbot", 3.0, 800, 24, stream=True), "interactive",
           "interactive chat, well within its quota"),
    Client(Traffic("rag", "sk-demo-rag", 18.0, 16000, 64, stream=False), "standard",
           "RAG pipeline flooding far past its share with long prompts"),
    Client(Traffic("batch", "sk-demo-batch", 1.0, 4000, 128, stream=False), "batch",
           "offline batch jobs"),
    Client(Traffic("intruder", "sk-not-a-real-key", 0.5, 100, 8, stream=False), "-",
           "a client with an unknown API key"),
]
SEED = 7
DEFAULT_NODES = 2
"""Simulated nodes ``kvgate up`` / ``demo`` start without --nodes (and without --pool)."""
DEFAULT_PROFILE = "8b-h100"


def demo_config(mode: str = "enforce") -> dict[str, Any]:
    """The demo's kvgate config; ``mode: shadow`` is the "without kvgate" run (decisions only counted,
    no gateway queue, no priority sent to vLLM)."""
    enforce = mode == "enforce"
    return {
        "mode": mode,
        # requests no node can take wait in kvgate's queue (tier order, fair shares), and the tier's
        # priority goes to vLLM (the demo's simulated nodes run --scheduling-policy priority)
        "queue": {"inject_priority": enforce},
        # a short recovery window so the demo shows breakers cycling open -> half-open -> closed
        "nodes": {"breaker": {"recovery_window_seconds": 5, "half_open_requests": 3}},
        "tenants": [
            {"name": "chatbot", "tier": "interactive", "api_key_sha256": [hash_key("sk-demo-chatbot")],
             "max_concurrent": 16, "requests_per_minute": 6000, "tokens_per_minute": 600000},
            {"name": "rag", "tier": "standard", "api_key_sha256": [hash_key("sk-demo-rag")],
             "max_concurrent": 6, "tokens_per_minute": 600000, "max_prompt_tokens": 8192},
            {"name": "batch", "tier": "batch", "api_key_sha256": [hash_key("sk-demo-batch")],
             "max_concurrent": 2, "tokens_per_minute": 100000},
        ],
    }


def _stack(a: argparse.Namespace, cfg: dict[str, Any] | None = None, workdir: Path | None = None) -> Stack:
    if a.config and not getattr(a, "pool", None):
        # fail early, naming the field (with --pool the stack checks the config with its pools added:
        # a tenant entitled to a --pool model is valid only then)
        load_config(a.config)
    if cfg is None:
        cfg = load_yaml(a.config.read_text(), str(a.config)) if a.config else demo_config()
        if a.standin and not a.config:  # the stand-in upstream is no node kvgate picks: no nodes section
            cfg = {k: v for k, v in cfg.items() if k != "nodes"}
    pools: list[SimPool] = list(getattr(a, "pool", None) or [])
    given = cfg.get("nodes") or {}
    if pools and (given.get("static") or given.get("dns")):
        print(f"kvgate: --pool: the config's top-level nodes ({len(given.get('static') or [])} static"
              f"{', DNS' if given.get('dns') else ''}) are not used: pools and nodes are exclusive; put them under "
              "a pool of the config's own to keep them", file=sys.stderr)
    # the nodes always run vLLM's priority scheduler: without priorities sent, it is first come first served
    priority = a.config is None or bool((cfg.get("queue") or {}).get("inject_priority"))
    sim_args = None if a.standin else ["--profile", a.profile or DEFAULT_PROFILE, *(
        ["--num-gpu-blocks", str(a.kv_blocks)] if a.kv_blocks else []), *(
        ["--scheduling-policy", "priority"] if priority else [])]
    return Stack((workdir or a.workdir).resolve(), cfg, upstreams=DEFAULT_NODES if a.nodes is None else a.nodes,
                 token_ms=a.token_ms, listen_port=a.port, sim_args=sim_args,
                 nodes=not a.standin, vllm_urls=a.vllm or None, replicas=getattr(a, "replicas", 1), pools=pools)


def _metrics_lines(st: Stack) -> str:
    if st.replicas == 1:
        return f"  kvgate metrics:             {st.metrics_url}\n"
    lines = "".join(f"  {name + ' metrics:':<28}{url}\n" for name, url in zip(st.replica_names, st.metrics_urls,
                                                                            strict=True))
    store = st.redis_url + " (local redis-server)" if st.uses_redis else "the store in kvgate's config"
    return (lines + f"  shared state:               {store}\n"
            f"  live view of all replicas:  kvgate top {' '.join('--metrics ' + u for u in st.metrics_urls)}\n")


def _pool_lines(st: Stack) -> str:
    """A line per pool: its name, the model(s) it serves, its nodes (and, for those this stack started,
    their profile and probes) — what a user needs to send a request to each and find its node."""
    probes = dict(zip([f"{h}:{p}" for h, p in st.envoy.upstreams], st.probe_ports, strict=False))
    lines = "  pools (the body's model picks the pool, kvgate the node):\n"
    for pool in st.kvgate_config.get("pools") or []:
        name, models = str(pool.get("name")), ", ".join(map(str, pool.get("models") or []))
        nodes = pool.get("nodes") or {}
        addrs = [str(n.get("address")) for n in nodes.get("static") or []]
        mine = name in st.pool_nodes
        where = ", ".join(f"{a} (probe {probes[a]})" if mine and a in probes else a for a in addrs)
        if nodes.get("dns"):
            where = ", ".join(x for x in (where, f"DNS {nodes['dns'].get('name')}") if x)
        profile = (nodes.get("performance") or {}).get("profile", "8b-h100")
        origin = f"{len(addrs)} x kvgate sim, {profile}" if mine else "from the config"
        lines += f"    {name:<26}model {models} [{origin}]: {where or '-'}\n"
    return lines


def _banner(st: Stack, file: TextIO | None = None) -> None:
    if st.pooled:
        nodes = _pool_lines(st)
    else:
        probes = ' (kvgate picks the node; probes on ' + ', '.join(map(str, st.probe_ports)) + ')' if st.nodes else ''
        nodes = f"  vLLM nodes:                 {', '.join(f'{h}:{p}' for h, p in st.envoy.upstreams)}{probes}\n"
    print(f"kvgate local stack is up\n  OpenAI-compatible endpoint: {st.url}/v1\n"
          f"{_metrics_lines(st)}"
          f"  Envoy admin:                http://127.0.0.1:{st.envoy.admin_port}\n"
          f"{nodes}"
          f"  logs and config:            {st.workdir}", file=file or sys.stdout, flush=True)


def up(a: argparse.Namespace) -> int:
    replicas = getattr(a, "replicas", 1)
    if replicas < 1:
        print("kvgate: --replicas must be at least 1", file=sys.stderr)
        return 2
    if replicas > 1:
        try:
            redis_binary()
        except RedisMissing as e:
            print(f"kvgate: --replicas {replicas}: {e}", file=sys.stderr)
            return 2
    st = _stack(a)
    with st:
        _banner(st)
        print("Ctrl-C stops everything.", flush=True)
        stop = False

        def _stop(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, _stop)
        with contextlib.suppress(KeyboardInterrupt):
            while not stop:
                time.sleep(0.5)
    return 0




# -- the demo: the same flood without and with kvgate ----------------------------------------------

SIDES = (("without", "shadow", "without kvgate's admission (kvgate in shadow mode: every request admitted)"),
         ("with", "enforce", "with kvgate enforcing"))


def _done(r: Result) -> bool:
    return r.e2e_s is not None or r.error is not None


def _pct(xs: list[float], p: float) -> float | None:
    return loadgen.percentile(xs, p) if xs else None


def side_summary(results: list[Result], tenant: str) -> dict[str, Any]:
    """One tenant's figures for one run: TTFT percentiles (ms, admitted requests; time to the whole
    answer for non-streaming tenants), counts by status, requests lost (ended without a status)."""
    mine = [r for r in results if r.tenant == tenant]
    ttft = [r.ttft_s for r in mine if r.status == 200 and r.ttft_s is not None]
    codes = Counter(str(r.status) for r in mine if r.status)
    retry = [float(r.retry_after_ms) / 1000 if r.retry_after_ms else float(r.retry_after or 0)
             for r in mine if r.status == 429 and (r.retry_after_ms or r.retry_after)]
    p50, p99 = _pct(ttft, 50), _pct(ttft, 99)
    return {
        "sent": len(mine),
        "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
        "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 1),
        "status": dict(sorted(codes.items())),
        "lost": sum(1 for r in mine if not r.status),
        "retry_after_s": {"p50": _pct(retry, 50), "max": max(retry)} if retry else None,
    }


def _decorate(results: list[Result], window: float = 5.0) -> Any:
    """Adds each tenant's client-side TTFT (requests sent in the last ``window`` seconds) to a view."""
    start = time.monotonic()

    def add(v: top.View) -> None:
        now = time.monotonic() - start
        v.ttft_source = f"measured by the demo's clients over their requests of the last {window:g} s"
        by: dict[str, list[float]] = {}
        for r in list(results):
            if r.status == 200 and r.ttft_s is not None and r.sent_at >= now - window:
                by.setdefault(r.tenant, []).append(r.ttft_s)
        for pool in v.pools.values():
            for tenant, xs in by.items():
                if tenant in pool.tenants:
                    pool.tenants[tenant].ttft_p50, pool.tenants[tenant].ttft_p99 = _pct(xs, 50), _pct(xs, 99)

    return add


def run_side(a: argparse.Namespace, mode: str, title: str, arrivals: list[tuple[float, Traffic]],
             out: TextIO) -> list[Result]:
    """Start a stack, send the schedule through it with the live view on ``out``, stop the stack."""
    st = _stack(a, demo_config(mode), a.workdir / mode)
    results: list[Result] = []
    with st:
        print(f"\n== {title}: {a.seconds:g}s of load ==", file=out, flush=True)
        host, port = "127.0.0.1", st.envoy.listen_port
        load = threading.Thread(target=loadgen.run, daemon=True, kwargs=dict(
            host=host, port=port, traffic=[], seconds=a.seconds, arrivals=arrivals, workers=2048,
            timeout=a.request_timeout, results=results))
        load.start()
        with top.Live(out, plain_every=5.0) as live, contextlib.suppress(top.ScrapeError):
            top.watch([st.metrics_url], 1.0, lambda: not load.is_alive(), live, _decorate(results),
                      title=f"{mode}: {title}")
        load.join()
        pending = [r for r in results if not _done(r)]
        if pending:  # every request has ended by now (loadgen.run waits); this would be a bug
            print(f"warning: {len(pending)} requests had not ended", file=sys.stderr)
    return results


def summary(sides: dict[str, list[Result]]) -> dict[str, dict[str, dict[str, Any]]]:
    return {c.traffic.tenant: {side: side_summary(rs, c.traffic.tenant) for side, rs in sides.items()}
            for c in CLIENTS}


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f} ms" if x < 1000 else f"{x / 1000:.1f} s"


def before_after(doc: dict[str, dict[str, dict[str, Any]]], seconds: float,
                 fleet: str = "the same two simulated vLLM nodes") -> str:
    rows = [f"Before/after: the same {seconds:g}s open-loop schedule (seed {SEED}) through {fleet}.",
            f"  {'tenant':<9}{'kvgate':<9}{'sent':>6}{'200':>6}{'429':>6}{'503':>6}{'401':>6}{'other':>6}"
            f"{'lost':>6}{'TTFT p50':>10}{'p99':>9}{'target':>8}  Retry-After (429)"]
    for c in CLIENTS:
        t = c.traffic.tenant
        tier = DEFAULT_TIERS.get(c.tier)
        target = f"{tier.ttft_target_ms} ms" if tier and tier.ttft_target_ms else "-"
        for side, label in (("without", "without"), ("with", "with")):
            d = doc[t][side]
            st = d["status"]
            other = sum(v for k, v in st.items() if k not in ("200", "429", "503", "401"))
            ra = d["retry_after_s"]
            retry = "-" if ra is None else f"p50 {ra['p50']:g}s, max {ra['max']:g}s"
            rows.append(f"  {t if side == 'without' else '':<9}{label:<9}{d['sent']:>6}{st.get('200', 0):>6}"
                        f"{st.get('429', 0):>6}{st.get('503', 0):>6}{st.get('401', 0):>6}{other:>6}{d['lost']:>6}"
                        f"{_ms(d['ttft_p50_ms']):>10}{_ms(d['ttft_p99_ms']):>9}{target:>8}  "
                        f"{retry}")
    cb, rag = doc["chatbot"], doc["rag"]
    lost = sum(doc[c.traffic.tenant][s]["lost"] for c in CLIENTS for s in ("without", "with"))
    r503 = sum(doc[c.traffic.tenant]["with"]["status"].get("503", 0) for c in CLIENTS)
    rows += ["",
             f"chatbot TTFT p99: {_ms(cb['without']['ttft_p99_ms'])} without kvgate, "
             f"{_ms(cb['with']['ttft_p99_ms'])} with it (its tier's target: "
             f"{DEFAULT_TIERS['interactive'].ttft_target_ms} ms).",
             f"rag, far over its share: {rag['with']['status'].get('429', 0)} of {rag['with']['sent']} answered 429"
             " with Retry-After: its own quota (max_concurrent, tokens_per_minute), not a fleet problem.",
             f"503s (fleet at capacity, the scaling signal): {r503} with kvgate. "
             f"Requests lost (no status at all): {lost}.",
             "TTFT is measured by the client: to the first streamed token (chatbot), to the whole answer "
             "(non-streaming tenants)."]
    return "\n".join(rows)


def demo_traffic(pools: list[SimPool]) -> list[Traffic]:
    """The clients' traffic; with pools, each asks for a model (with several pools no request may leave
    it out): the RAG flood for the last pool's, everyone else for the first pool's — so with two pools
    the flood lands on its own pool, and the chatbot's pool stays healthy beside it."""
    if not pools:
        return [c.traffic for c in CLIENTS]
    return [replace(c.traffic, model=(pools[-1] if c.traffic.tenant == "rag" else pools[0]).model) for c in CLIENTS]


def _fleet_text(pools: list[SimPool]) -> str:
    if not pools:
        return "the same two simulated vLLM nodes"
    return "the same simulated pools (" + ", ".join(f"{p.name}: {p.nodes} x {p.profile}" for p in pools) + ")"


def demo(a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    out: TextIO = sys.stderr if a.json else sys.stdout
    pools: list[SimPool] = list(getattr(a, "pool", None) or [])
    traffic = demo_traffic(pools)
    arrivals = loadgen.schedule(traffic, a.seconds, SEED)
    print(f"kvgate demo: {len(arrivals)} requests on one seeded open-loop schedule, sent twice — without and "
          "with kvgate's admission.", file=out)
    for c, t in zip(CLIENTS, traffic, strict=True):
        print(f"  {t.tenant:<9} {t.rate:>4g} req/s, {t.prompt_chars // 4:>5} prompt tokens, {t.max_tokens:>4} out"
              f"{' (streaming)' if t.stream else ''}{f', model {t.model}' if t.model else ''}: {c.role}", file=out)
    sides: dict[str, list[Result]] = {}
    for side, mode, title in SIDES:
        sides[side] = run_side(a, mode, title, arrivals, out)
    doc = summary(sides)
    if a.json:
        print(f"demo took {time.monotonic() - t0:.0f}s", file=out)
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n" + before_after(doc, a.seconds, _fleet_text(pools)), flush=True)
        print(f"(the demo took {time.monotonic() - t0:.0f}s; logs and configs in {a.workdir.resolve()})")
    return 0
