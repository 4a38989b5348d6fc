"""The noisy-neighbour case end to end: real Envoy, kvgate, probe and a simulated vLLM node, real time.

An interactive tenant (short prompts, streamed) shares one node with two standard-tier tenants: "docs"
within its share and "rag" flooding at about ten times its share with 2k-token prompts. kvgate must
keep the interactive tenant's TTFT p99 inside its tier's target, give "docs" what it asks for, hold
"rag" to what is left and answer the rest with 503 + a usable Retry-After — and lose nothing.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ext_proc.identity import hash_key
from kvgate import loadgen
from kvgate.loadgen import Traffic
from kvgate.stack import Stack
from tests.helpers import metric

TTFT_TARGET_MS = 200  # the default interactive tier's target
SECONDS = 30.0


def config() -> dict[str, object]:
    return {
        "queue": {"inject_priority": True},
        "tiers": {"interactive": {"priority": 0, "max_queue_wait_ms": 1000, "ttft_target_ms": TTFT_TARGET_MS},
                  "standard": {"priority": 1, "max_queue_wait_ms": 5000, "reserve_kv": 0.10}},
        "nodes": {"max_waiting_requests": 2},
        "tenants": [{"name": n, "tier": tier, "api_key_sha256": [hash_key(f"sk-{n}")]}
                    for n, tier in (("chat", "interactive"), ("docs", "standard"), ("rag", "standard"))],
    }


def test_a_flooding_tenant_does_not_take_the_interactive_tenants_latency(tmp_path: Path) -> None:
    sim = ["--num-gpu-blocks", "1000", "--max-num-batched-tokens", "2048", "--scheduling-policy", "priority"]
    with Stack(tmp_path, config(), sim_args=sim, nodes=True) as st:
        traffic = [
            Traffic("chat", "sk-chat", 6.0, prompt_chars=200, max_tokens=8),
            Traffic("docs", "sk-docs", 2.0, prompt_chars=4000, max_tokens=32),
            Traffic("rag", "sk-rag", 40.0, prompt_chars=8000, max_tokens=64),
        ]
        results = loadgen.run("127.0.0.1", st.envoy.listen_port, traffic, SECONDS, seed=7)
        by: dict[str, list[loadgen.Result]] = {}
        for r in results:
            by.setdefault(r.tenant, []).append(r)
        summary = {t: Counter((r.status, r.reason) for r in rs) for t, rs in by.items()}
        print("outcomes:", summary)
        # nothing lost: every request ended with a status; every refusal is retryable and says when
        assert all(r.error is None and r.status in (200, 429, 503) for r in results), \
            [r for r in results if r.error or r.status not in (200, 429, 503)][:3]
        for r in results:
            if r.status != 200:
                assert r.retry_after is not None and int(r.retry_after) >= 1, r
                assert r.retry_after_ms is not None and 100 <= int(r.retry_after_ms) <= 61_000, r
        chat = by["chat"]
        ttfts = [r.ttft_s for r in chat if r.ttft_s is not None]
        p99 = loadgen.percentile(ttfts, 99) * 1000
        print(f"chat TTFT p50 {loadgen.percentile(ttfts, 50) * 1000:.0f} ms, p99 {p99:.0f} ms "
              f"({len(ttfts)} of {len(chat)} served)")
        assert all(r.status == 200 for r in chat)
        assert p99 <= TTFT_TARGET_MS
        docs_ok = sum(r.status == 200 for r in by["docs"]) / len(by["docs"])
        rag_ok = sum(r.status == 200 for r in by["rag"]) / len(by["rag"])
        print(f"served: docs {docs_ok:.0%}, rag {rag_ok:.0%} of {len(by['rag'])}")
        assert docs_ok >= 0.9  # within its share: (nearly) all of it
        assert rag_ok <= 0.5  # the flood is held to what is left
        served_rag = sum(r.status == 200 for r in by["rag"])
        assert served_rag > 0  # ... but the node is not left idle: work-conserving
        # kvgate's own count agrees with the clients'
        assert metric(st.metrics_url, "kvgate_requests_total", tenant="rag", decision="admit") == served_rag
        assert metric(st.metrics_url, "kvgate_queue_rejections_total", reason="queue-deadline") > 0
