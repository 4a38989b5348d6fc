"""The noisy-neighbour case end to end: real Envoy, kvgate, probe and a simulated vLLM node, real time.

An interactive tenant ("chat": short prompts, streamed) shares one node with two standard-tier tenants:
"docs" within its share, and "rag" flooding at about ten times its share with 2k-token prompts and over
its own request quota. The same stack first serves chat alone (the control run), then all three.

What must hold on any machine, however busy — outcomes, and latency only *relative to the control run on
the same machine in the same test* (no wall-clock threshold: on a loaded 2-core CI runner every figure
stretches, the ratio far less):

* chat's TTFT under the flood is within a generous factor of its TTFT alone (without admission control
  the flood's prefills queue ahead of it and its TTFT grows to seconds: orders of magnitude, not a factor);
* chat gets no 429 and no 503; docs is (nearly) all served;
* rag is held to its own quota (``max_concurrent``) — 429s with a usable Retry-After — yet some of it
  is served (work-conserving);
* every request ends with a status, and once all have ended nothing is left in flight.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ext_proc.identity import hash_key
from kvgate.dev import loadgen
from kvgate.dev.loadgen import Result, Traffic
from kvgate.dev.stack import Stack
from tests.helpers import metric, wait_for

CONTROL_SECONDS = 8.0
FLOOD_SECONDS = 16.0
CHAT = Traffic("chat", "sk-chat", 6.0, prompt_chars=200, max_tokens=8)
P50_FACTOR = 6.0
"""chat's median TTFT under the flood / alone. Measured 1.4-1.7x, also with both cores kept busy by other
processes (a chat request batched with a rag prefill chunk waits for that step)."""
P90_FACTOR = 20.0
"""The same for the 90th percentile: measured 3.5-4x (the tail is one or two 2k-token prefill steps)."""


def config() -> dict[str, object]:
    return {
        "queue": {"inject_priority": True},
        "tiers": {"interactive": {"priority": 0, "max_queue_wait_ms": 1000, "ttft_target_ms": 200},
                  "standard": {"priority": 1, "max_queue_wait_ms": 5000, "reserve_kv": 0.10}},
        "nodes": {"max_waiting_requests": 2},
        "tenants": [
            {"name": "chat", "tier": "interactive", "api_key_sha256": [hash_key("sk-chat")]},
            {"name": "docs", "tier": "standard", "api_key_sha256": [hash_key("sk-docs")]},
            # rag may have 4 requests in flight (or queued): the rest of its flood is over its own quota
            {"name": "rag", "tier": "standard", "api_key_sha256": [hash_key("sk-rag")],
             "max_concurrent": 4},
        ],
    }


def ttfts(rs: list[Result]) -> list[float]:
    return [r.ttft_s for r in rs if r.ttft_s is not None]


def check_every_request_ended(results: list[Result]) -> None:
    """Nothing lost: every request ended with a status; every refusal is retryable and says when."""
    assert all(r.error is None and r.status in (200, 429, 503) for r in results), \
        [r for r in results if r.error or r.status not in (200, 429, 503)][:3]
    for r in results:
        if r.status != 200:
            assert r.retry_after is not None and int(r.retry_after) >= 1, r
            assert r.retry_after_ms is not None and 100 <= int(r.retry_after_ms) <= 61_000, r


def test_a_flooding_tenant_does_not_take_the_interactive_tenants_latency(tmp_path: Path) -> None:
    sim = ["--num-gpu-blocks", "1000", "--max-num-batched-tokens", "2048", "--scheduling-policy", "priority"]
    with Stack(tmp_path, config(), sim_args=sim, nodes=True) as st:
        host, port = "127.0.0.1", st.envoy.listen_port
        node_metrics = "http://{}:{}/metrics".format(*st.envoy.upstreams[0])
        loadgen.run(host, port, [CHAT], 1.0, seed=1)  # warm up every process on the path

        alone = loadgen.run(host, port, [CHAT], CONTROL_SECONDS, seed=3)
        check_every_request_ended(alone)
        assert all(r.status == 200 for r in alone), Counter((r.status, r.reason) for r in alone)

        results = loadgen.run(host, port, [
            CHAT,
            Traffic("docs", "sk-docs", 2.0, prompt_chars=4000, max_tokens=32),
            Traffic("rag", "sk-rag", 40.0, prompt_chars=8000, max_tokens=64),
        ], FLOOD_SECONDS, seed=7)
        by: dict[str, list[Result]] = {}
        for r in results:
            by.setdefault(r.tenant, []).append(r)
        summary = {t: Counter((r.status, r.reason) for r in rs) for t, rs in by.items()}
        print("outcomes:", summary)
        check_every_request_ended(results)

        # the interactive tenant: never refused, and its latency relative to its own, alone
        chat = by["chat"]
        assert all(r.status == 200 for r in chat), summary["chat"]
        base, flood = ttfts(alone), ttfts(chat)
        assert len(base) == len(alone) and len(flood) == len(chat)  # every one streamed a first token
        ratios = {p: loadgen.percentile(flood, p) / loadgen.percentile(base, p) for p in (50, 90)}
        print("chat TTFT ms, alone / under the flood: "
              + ", ".join(f"p{p} {loadgen.percentile(base, p) * 1000:.0f} / {loadgen.percentile(flood, p) * 1000:.0f}"
                          for p in (50, 90, 99))
              + f"; ratios p50 {ratios[50]:.1f}x, p90 {ratios[90]:.1f}x")
        assert ratios[50] <= P50_FACTOR and ratios[90] <= P90_FACTOR, ratios

        # the tenant within its share gets (nearly) all of it
        docs_ok = sum(r.status == 200 for r in by["docs"]) / len(by["docs"])
        # the flooding tenant: over its own quota (429 + Retry-After), held back, but not starved
        rag = by["rag"]
        rag_429 = [r for r in rag if r.status == 429]
        served_rag = sum(r.status == 200 for r in rag)
        print(f"served: docs {docs_ok:.0%}, rag {served_rag} of {len(rag)} ({len(rag_429)} x 429)")
        assert docs_ok >= 0.8
        assert len(rag_429) >= len(rag) // 5 and all(r.reason == "tenant-concurrency" for r in rag_429)
        assert served_rag <= len(rag) // 2  # the flood is held back ...
        assert served_rag > 0  # ... but the node is not left idle: work-conserving

        # once every request has ended, nothing is left in flight: kvgate released every slot
        # exactly once, and the node holds nothing
        wait_for(lambda: metric(st.metrics_url, "kvgate_fleet_inflight_requests") == 0
                 and metric(st.metrics_url, "kvgate_inflight_requests") == 0, what="kvgate in-flight back to 0")
        wait_for(lambda: metric(node_metrics, "vllm:num_requests_running") == 0
                 and metric(node_metrics, "vllm:num_requests_waiting") == 0, what="the node idle")
        # kvgate's own count agrees with the clients'
        assert metric(st.metrics_url, "kvgate_requests_total", tenant="rag", decision="admit") == served_rag
        assert metric(st.metrics_url, "kvgate_requests_total", tenant="rag", reason="tenant-concurrency") \
            == len(rag_429)
