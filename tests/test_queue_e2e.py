"""The gateway queue through the real Envoy and kvgate: held requests, disconnects, vLLM priority."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack
from tests.helpers import chat, metric, post, wait_for

CHAT = "/v1/chat/completions"
KEYS = {"chat": "sk-q-chat", "bulk": "sk-q-bulk"}


def config(**extra: Any) -> dict[str, Any]:
    return {
        "fleet": {"max_inflight": 1},
        "queue": {"inject_priority": True},
        "tiers": {"interactive": {"priority": 0, "max_queue_wait_ms": 8000},
                  "batch": {"priority": 5, "max_queue_wait_ms": 8000, "vllm_priority": 9}},
        "tenants": [
            {"name": "chat", "tier": "interactive", "max_concurrent": 2, "api_key_sha256": [hash_key(KEYS["chat"])]},
            {"name": "bulk", "tier": "batch", "api_key_sha256": [hash_key(KEYS["bulk"])]},
        ],
        **extra,
    }


@pytest.fixture
def one_slot(tmp_path: Path) -> Iterator[Stack]:
    """One fleet slot in front of the stand-in upstream (5 ms a token): a second request must queue."""
    st = Stack(tmp_path, config(), token_ms=5.0)
    st.start()
    try:
        yield st
    finally:
        st.stop()


def hog(st: Stack, tokens: int = 300) -> threading.Thread:
    """Hold the only slot for tokens x 5 ms."""
    t = threading.Thread(target=post, args=(st.url + CHAT, chat("hog", max_tokens=tokens), KEYS["chat"]))
    t.start()
    wait_for(lambda: metric(st.metrics_url, "kvgate_fleet_inflight_requests") == 1, what="slot taken")
    return t


def upstream_requests(st: Stack) -> list[dict[str, Any]]:
    port = st.envoy.upstreams[0][1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/requests") as r:
        return list(json.loads(r.read())["requests"])


def test_a_queued_request_outwaits_envoys_message_timeout_and_is_served(one_slot: Stack) -> None:
    st = one_slot
    h = hog(st, tokens=300)  # 1.5 s: longer than Envoy's 1 s message_timeout
    t0 = time.monotonic()
    code, _, body = post(st.url + CHAT, chat("queued", max_tokens=2), KEYS["bulk"])
    waited = time.monotonic() - t0
    h.join()
    assert code == 200, body
    assert waited > 1.0  # it was held past the 1 s message timeout, not answered 504 by Envoy
    assert metric(st.metrics_url, "kvgate_queue_wait_seconds_count", tier="batch", outcome="admitted") == 1
    assert metric(st.metrics_url, "kvgate_queue_wait_seconds_sum", tier="batch", outcome="admitted") > 0.8


def test_the_tier_priority_is_written_into_the_body_with_a_correct_length(one_slot: Stack) -> None:
    st = one_slot
    code, _, _ = post(st.url + CHAT, chat("mine", max_tokens=2, priority=-100), KEYS["bulk"])
    assert code == 200
    code, _, _ = post(st.url + CHAT, chat("chat", max_tokens=2), KEYS["chat"])
    assert code == 200
    bulk, chatty = upstream_requests(st)[-2:]
    assert json.loads(bulk["body"])["priority"] == 9  # the tier's, not the client's -100
    assert json.loads(chatty["body"])["priority"] == 0
    for seen in (bulk, chatty):
        cl = seen["headers"].get("content-length")
        assert cl is None or int(cl) == len(seen["body"].encode())  # chunked, or the new length
        assert cl is not None or seen["headers"].get("transfer-encoding") == "chunked"


def test_a_client_that_leaves_while_queued_frees_its_place_and_quota(one_slot: Stack) -> None:
    st = one_slot
    h = hog(st, tokens=300)  # chat holds 1 of its 2 concurrent
    sock = socket.create_connection(("127.0.0.1", st.envoy.listen_port))
    body = json.dumps(chat("gone", max_tokens=2)).encode()
    sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + KEYS["chat"].encode() + b"\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_for(lambda: metric(st.metrics_url, "kvgate_queue_depth_requests", tier="interactive") == 1, what="queued")
    sock.close()  # the client gives up while its request waits
    wait_for(lambda: metric(st.metrics_url, "kvgate_queue_cancelled_total", tier="interactive") == 1,
             what="cancel seen")
    h.join()
    # both of chat's concurrency slots are free again: two requests at once are both served, none 429
    results: list[int] = []
    ts = [threading.Thread(target=lambda: results.append(post(st.url + CHAT, chat("x", max_tokens=40),
                                                               KEYS["chat"])[0])) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [200, 200]
    assert metric(st.metrics_url, "kvgate_queue_depth_requests", tier="interactive") == 0
    assert metric(st.metrics_url, "kvgate_requests_total", tenant="chat", decision="reject") == 0


def test_interactive_requests_overtake_queued_batch_ones(one_slot: Stack) -> None:
    st = one_slot
    h = hog(st, tokens=400)
    done: list[str] = []
    lock = threading.Lock()

    def send(key: str, name: str) -> None:
        code, _, _ = post(st.url + CHAT, chat(name, max_tokens=20), KEYS[key])
        assert code == 200
        with lock:
            done.append(name)

    ts = [threading.Thread(target=send, args=("bulk", f"b{i}")) for i in range(3)]
    for t in ts:
        t.start()
    wait_for(lambda: metric(st.metrics_url, "kvgate_queue_depth_requests", tier="batch") == 3, what="batch queued")
    c = threading.Thread(target=send, args=("chat", "c"))
    c.start()
    wait_for(lambda: metric(st.metrics_url, "kvgate_queue_depth_requests", tier="interactive") == 1,
             what="chat queued")
    for t in (h, *ts, c):
        t.join()
    assert done[0] == "c" and sorted(done[1:]) == ["b0", "b1", "b2"]
