"""``kvgate up`` and ``kvgate demo``: the local stack, in the foreground, and under a mixed load.

The upstreams are simulated vLLM nodes (``kvgate sim``; ``--standin`` uses the simpler stand-in).
The demo's tenants show each kind of decision: a chatbot within its quota, a RAG pipeline flooding
with long prompts (held to its concurrency and token budget: 429s), a batch tenant in shadow mode
(would-be rejections counted, requests admitted), a client with an unknown key (401), and a fleet
cap that the sum of them reaches (503s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.config import load_config, load_yaml
from ext_proc.identity import hash_key

from .envoy_config import EnvoyParams
from .stack import Stack, http_get


@dataclass(frozen=True)
class Client:
    tenant: str
    key: str
    workers: int
    prompt_chars: int
    max_tokens: int
    stream: bool


CLIENTS = [
    Client("chatbot", "sk-demo-chatbot", 4, 200, 32, True),
    Client("rag", "sk-demo-rag", 24, 12000, 96, False),
    Client("batch", "sk-demo-batch", 4, 2000, 64, False),
    Client("intruder", "sk-not-a-real-key", 1, 100, 8, False),
]


def demo_config() -> dict[str, Any]:
    return {
        "mode": "enforce",
        # requests no node can take wait in kvgate's queue (tier order, fair shares), and the tier's
        # priority goes to vLLM (the demo's simulated nodes run --scheduling-policy priority)
        "queue": {"inject_priority": True},
        # a short recovery window so the demo shows breakers cycling open -> half-open -> closed
        "nodes": {"breaker": {"recovery_window_seconds": 5, "half_open_requests": 3}},
        "tenants": [
            {"name": "chatbot", "tier": "interactive", "api_key_sha256": [hash_key("sk-demo-chatbot")],
             "max_concurrent": 16, "requests_per_minute": 6000, "tokens_per_minute": 600000},
            {"name": "rag", "tier": "standard", "api_key_sha256": [hash_key("sk-demo-rag")],
             "max_concurrent": 24, "tokens_per_minute": 900000, "max_prompt_tokens": 8192},
            {"name": "batch", "tier": "batch", "mode": "shadow", "api_key_sha256": [hash_key("sk-demo-batch")],
             "max_concurrent": 1, "tokens_per_minute": 100000},
        ],
    }


def _stack(a: argparse.Namespace) -> Stack:
    if a.config:
        load_config(a.config)  # fail early, naming the field
    cfg = load_yaml(a.config.read_text(), str(a.config)) if a.config else demo_config()
    priority = bool((cfg.get("queue") or {}).get("inject_priority"))
    sim_args = None if a.standin else ["--profile", a.profile, *(
        ["--num-gpu-blocks", str(a.kv_blocks)] if a.kv_blocks else []), *(
        ["--scheduling-policy", "priority"] if priority else [])]
    return Stack(a.workdir.resolve(), cfg, upstreams=a.nodes, token_ms=a.token_ms,
                 envoy=EnvoyParams(listen_port=a.port), sim_args=sim_args, nodes=not a.standin,
                 vllm_urls=a.vllm or None)


def _banner(st: Stack) -> None:
    print(f"kvgate local stack is up\n  OpenAI-compatible endpoint: {st.url}/v1\n"
          f"  kvgate metrics:             {st.metrics_url}\n"
          f"  Envoy admin:                http://127.0.0.1:{st.envoy.admin_port}\n"
          f"  vLLM nodes:                 {', '.join(f'{h}:{p}' for h, p in st.envoy.upstreams)}"
          f"{' (kvgate picks the node; probes on ' + ', '.join(map(str, st.probe_ports)) + ')' if st.nodes else ''}\n"
          f"  logs and config:            {st.workdir}", flush=True)


def up(a: argparse.Namespace) -> int:
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


class Tally:
    def __init__(self) -> None:
        self.codes: dict[str, Counter[str]] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)

    def table(self, title: str) -> str:
        rows = [title, f"  {'tenant':<10}{'sent':>7}{'200':>7}{'429':>7}{'503':>7}{'401':>7}{'other':>7}"
                       f"{'p50 ms':>9}{'p99 ms':>9}"]
        for c in CLIENTS:
            k = self.codes[c.tenant]
            lat = sorted(self.latency[c.tenant])
            p50 = f"{lat[len(lat) // 2] * 1e3:.0f}" if lat else "-"
            p99 = f"{lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3:.0f}" if lat else "-"
            other = sum(v for code, v in k.items() if code not in ("200", "429", "503", "401"))
            rows.append(f"  {c.tenant:<10}{sum(k.values()):>7}{k['200']:>7}{k['429']:>7}{k['503']:>7}"
                        f"{k['401']:>7}{other:>7}{p50:>9}{p99:>9}")
        return "\n".join(rows)


async def _load(st: Stack, seconds: float, tally: Tally) -> None:
    rng = random.Random(7)
    until = time.monotonic() + seconds

    async def worker(c: Client, session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            body = {"max_tokens": c.max_tokens, "stream": c.stream, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "x" * int(c.prompt_chars * rng.uniform(0.5, 1.5))}]}
            t = time.monotonic()
            try:
                async with session.post(f"{st.url}/v1/chat/completions", json=body,
                                        headers={"authorization": f"Bearer {c.key}"}) as r:
                    await r.read()
                    code = str(r.status)
                    wait_ms = float(r.headers.get("retry-after-ms", "0"))
            except aiohttp.ClientError:
                code, wait_ms = "error", 100.0
            tally.codes[c.tenant][code] += 1
            if code == "200":
                tally.latency[c.tenant].append(time.monotonic() - t)
            elif wait_ms:
                await asyncio.sleep(min(wait_ms, 2000) / 1000)  # what OpenAI SDKs do with retry-after-ms
            else:
                await asyncio.sleep(0.5)

    async def report() -> None:
        start = time.monotonic()
        while time.monotonic() < until:
            await asyncio.sleep(5)
            print(tally.table(f"after {time.monotonic() - start:.0f}s:"), flush=True)
            print("  " + _gauges(st), flush=True)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [worker(c, session) for c in CLIENTS for _ in range(c.workers)]
        await asyncio.gather(report(), *tasks)


def _gauges(st: Stack) -> str:
    _, text = http_get(st.metrics_url)
    inflight: dict[str, float] = {}
    nodes: dict[str, dict[str, float]] = defaultdict(dict)
    queued: dict[str, float] = {}
    shadow = 0.0
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == "kvgate_inflight_requests":
                inflight[s.labels["tenant"]] = s.value
            elif s.name == "kvgate_queue_depth_requests":
                queued[s.labels["tier"]] = s.value
            elif s.name == "kvgate_requests_total" and s.labels.get("decision") == "shadow_reject":
                shadow += s.value
            elif s.name in ("kvgate_node_kv_usage_ratio", "kvgate_node_breaker_state", "kvgate_node_inflight_requests"):
                nodes[s.labels["node"]][s.name] = s.value
    line = (f"in flight now: {', '.join(f'{t}={v:.0f}' for t, v in sorted(inflight.items()))}; "
            f"queued in kvgate: {', '.join(f'{t}={v:.0f}' for t, v in queued.items()) or 'none'}; "
            f"shadow would-be rejections: {shadow:.0f}")
    states = {0: "closed", 1: "half-open", 2: "open"}
    for node, v in sorted(nodes.items()):
        line += (f"\n  node {node}: KV {v.get('kvgate_node_kv_usage_ratio', 0):.0%}, "
                 f"in flight {v.get('kvgate_node_inflight_requests', 0):.0f}, "
                 f"breaker {states.get(int(v.get('kvgate_node_breaker_state', 0)), '?')}")
    return line


def demo(a: argparse.Namespace) -> int:
    st = _stack(a)
    with st:
        _banner(st)
        print(f"running a {a.seconds:g}s multi-tenant load...", flush=True)
        tally = Tally()
        asyncio.run(_load(st, a.seconds, tally))
        time.sleep(0.5)
        print(tally.table("\nsummary (status codes as clients saw them):"))
        print("  " + _gauges(st))
        _, text = http_get(st.metrics_url)
        print("\nkvgate's own count (kvgate_requests_total):")
        for line in text.decode().splitlines():
            if line.startswith("kvgate_requests_total{"):
                print("  " + line)
        print("\nEvery 429 is a tenant over its own quota; every 503 is the fleet at capacity "
              "(only these would scale the fleet).")
    return 0


