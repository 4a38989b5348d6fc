"""Node choice, KV gating and breakers through the real Envoy, kvgate, probes and simulated nodes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack
from tests.helpers import metric, post, wait_for

KEY = "sk-nodes"


def config(**extra: Any) -> dict[str, Any]:
    return {"tenants": [{"name": "t", "api_key_sha256": [hash_key(KEY)]}],
            "nodes": {"kv_admit_threshold": 0.5, "stale_after_seconds": 1.0, "dead_after_seconds": 2.5,
                      "breaker": {"recovery_window_seconds": 1.0, "half_open_requests": 2}}, **extra}


def node_url(st: Stack, i: int) -> str:
    return f"http://127.0.0.1:{st.envoy.upstreams[i][1]}"


def served(st: Stack, i: int) -> float:
    return metric(node_url(st, i) + "/metrics", "vllm:request_success_total")


def occupy(st: Stack, i: int, prompt_chars: int, tokens: int) -> threading.Thread:
    """A long request sent straight to node i, around kvgate: KV pressure kvgate did not cause."""
    body = {"prompt": "x" * prompt_chars, "max_tokens": tokens, "ignore_eos": True}
    t = threading.Thread(target=post, args=(node_url(st, i) + "/v1/completions", body))
    t.start()
    wait_for(lambda: metric(node_url(st, i) + "/metrics", "vllm:num_requests_running") >= 1, what="occupied")
    return t


def via_kvgate(st: Stack, tokens: int = 3) -> tuple[int, dict[str, str], bytes]:
    return post(st.url + "/v1/completions", {"prompt": "hi", "max_tokens": tokens, "ignore_eos": True}, KEY)


def seen_by_kvgate(st: Stack, i: int, pred: Any) -> None:
    addr = "{}:{}".format(*st.envoy.upstreams[i])
    wait_for(lambda: pred(metric(st.metrics_url, "kvgate_node_kv_usage_ratio", node=addr)), what="probe reading")


def _nodes(tmp_path: Path, *sim_args: str, **cfg: Any) -> Iterator[Stack]:
    st = Stack(tmp_path, config(**cfg), upstreams=2, sim_args=["--num-gpu-blocks", "100", *sim_args], nodes=True)
    st.start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[Stack]:
    yield from _nodes(tmp_path)


@pytest.fixture(params=["queue-off", "queue-on"])
def two_nodes_queue(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    queue = {"queue": {"enabled": False}} if request.param == "queue-off" else {
        "tiers": {"standard": {"priority": 1, "max_queue_wait_ms": 400}}}
    yield from _nodes(tmp_path, **queue)


def test_a_node_under_kv_pressure_gets_no_new_requests(two_nodes: Stack) -> None:
    st = two_nodes
    hog = occupy(st, 0, prompt_chars=4000, tokens=500)  # ~1000 prompt tokens: kv > 0.6 for ~3 s
    seen_by_kvgate(st, 0, lambda v: v > 0.5)
    before = (served(st, 0), served(st, 1))
    codes = [via_kvgate(st)[0] for _ in range(8)]
    assert codes == [200] * 8
    assert served(st, 0) == before[0] and served(st, 1) == before[1] + 8
    assert hog.is_alive()  # the pressure lasted the whole time
    hog.join()


def test_all_nodes_saturated_is_a_503_with_retry_after(two_nodes_queue: Stack) -> None:
    """Queue off: 503 at once. Queue on: held for the tier's 0.4 s, then 503 (the hogs last ~3 s)."""
    st = two_nodes_queue
    queued = st.kvgate_config.get("queue", {}).get("enabled", True)
    hogs = [occupy(st, i, prompt_chars=4000, tokens=500) for i in (0, 1)]
    for i in (0, 1):
        seen_by_kvgate(st, i, lambda v: v > 0.5)
    t0 = time.monotonic()
    code, h, body = via_kvgate(st)
    waited = time.monotonic() - t0
    reason = "queue-timeout" if queued else "fleet-kv"
    assert code == 503 and h["x-kvgate-reject-reason"] == reason
    assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 100
    assert b"retry" in body
    assert metric(st.metrics_url, "kvgate_requests_total", reason=reason, **{"class": "capacity"}) == 1
    if queued:
        assert waited >= 0.4
        assert metric(st.metrics_url, "kvgate_queue_rejections_total", tier="standard", reason=reason) == 1
        assert all(t.is_alive() for t in hogs)  # answered while the fleet was still full
    for t in hogs:
        t.join()


@pytest.fixture
def slow_nodes(tmp_path: Path) -> Iterator[Stack]:
    """Nodes with a 34B/A100's step times, so a short burst of KV pressure lasts long enough for the
    probe -> kvgate polling (0.2 s + 0.2 s) to see it on any machine."""
    yield from _nodes(tmp_path, "--profile", "34b-a100")


def test_breaker_opens_half_opens_and_closes_as_the_node_recovers(slow_nodes: Stack) -> None:
    st = slow_nodes
    addr = "{}:{}".format(*st.envoy.upstreams[0])
    hog = occupy(st, 0, prompt_chars=6200, tokens=30)  # ~1550 tokens: kv ~0.97 > 0.95 for ~2 s -> trips
    wait_for(lambda: metric(st.metrics_url, "kvgate_node_breaker_state", node=addr) == 2, what="breaker open")
    hog.join()  # the node drains
    wait_for(lambda: metric(st.metrics_url, "kvgate_node_breaker_state", node=addr) == 1, what="half-open")
    # trial requests reach node 0 (node 1 is full for a while, so node 0 is the only candidate)
    hog1 = occupy(st, 1, prompt_chars=4000, tokens=60)  # ~3.5 s
    seen_by_kvgate(st, 1, lambda v: v > 0.5)
    assert [via_kvgate(st)[0] for _ in range(2)] == [200, 200]
    wait_for(lambda: metric(st.metrics_url, "kvgate_node_breaker_state", node=addr) == 0, what="closed")
    def moves(a: str, b: str) -> float:
        return metric(st.metrics_url, "kvgate_node_breaker_transitions_total", node=addr, **{"from": a, "to": b})

    # (a half-open probe while the node was still full re-opens it: that cycle may repeat)
    assert moves("closed", "open") == 1 and moves("half_open", "closed") == 1
    assert moves("open", "half_open") == moves("half_open", "open") + 1
    assert "breaker_transition" in st.log("kvgate")
    hog1.join()


def test_a_killed_probe_and_a_killed_node_lose_no_request(two_nodes: Stack) -> None:
    st = two_nodes
    st.stop_process("probe0")  # node 0 goes unknown, then dead: traffic moves to node 1
    results: list[int] = []
    for _ in range(10):
        results.append(via_kvgate(st)[0])
    st.stop_process("upstream1")  # now the only node with a live probe dies too
    for _ in range(30):
        code, h, _ = via_kvgate(st)
        results.append(code)
        if code != 200:
            assert code == 503 and "retry-after" in h  # rejected with a status, retryable
    assert len(results) == 40 and set(results) <= {200, 503}
    assert results[:10] == [200] * 10
