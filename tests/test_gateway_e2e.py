"""Through the real Envoy binary, the real kvgate process and a real upstream on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from typing import Any

import orjson
import pytest

from kvgate.dev.stack import Stack
from tests.conftest import KEYS
from tests.helpers import chat, get, metric, post, wait_for

CHAT = "/v1/chat/completions"


def upstream_requests(st: Stack) -> list[dict[str, Any]]:
    port = st.envoy.upstreams[0][1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/requests") as r:
        return list(json.loads(r.read())["requests"])


def inflight(st: Stack, tenant: str) -> float:
    return metric(st.metrics_url, "kvgate_inflight_requests", tenant=tenant)


def test_admitted_request_reaches_upstream_unchanged_and_usage_is_debited(stack: Stack) -> None:
    before = metric(stack.metrics_url, "kvgate_tokens_total", tenant="open", kind="completion")
    body = chat("hello there", max_tokens=6)
    raw = orjson.dumps(body)
    code, _, resp = post(stack.url + CHAT, None, KEYS["open"], raw=raw,
                               headers={"x-kvgate-tenant": "tight", "x-kvgate-internal": "1"})
    assert code == 200, resp
    doc = json.loads(resp)
    assert doc["usage"]["completion_tokens"] == 6
    seen = upstream_requests(stack)[-1]
    assert seen["body"].encode() == raw  # non-streaming bodies are not touched
    assert not [h for h in seen["headers"] if h.startswith("x-kvgate-")]
    wait_for(lambda: metric(stack.metrics_url, "kvgate_tokens_total", tenant="open", kind="completion") == before + 6,
             what="completion tokens accounted")
    assert inflight(stack, "open") == 0


def _sse_events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]


def test_stream_gets_usage_added_upstream_and_stripped_for_the_client(stack: Stack) -> None:
    before = metric(stack.metrics_url, "kvgate_tokens_total", tenant="open", kind="completion")
    code, headers, raw = post(stack.url + CHAT, chat("stream me", max_tokens=5, stream=True), KEYS["open"])
    assert code == 200 and headers["content-type"].startswith("text/event-stream")
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5
    assert all("usage" not in c and c["choices"] for c in chunks)  # exactly what the client would have seen
    seen = json.loads(upstream_requests(stack)[-1]["body"])
    assert seen["stream_options"] == {"include_usage": True}
    wait_for(lambda: metric(stack.metrics_url, "kvgate_tokens_total", tenant="open", kind="completion") == before + 5,
             what="usage from the stripped chunk accounted")


def test_stream_that_asked_for_usage_keeps_it(stack: Stack) -> None:
    code, _, raw = post(stack.url + CHAT, chat(max_tokens=3, stream=True, stream_options={"include_usage": True}),
                        KEYS["open"])
    assert code == 200
    last = json.loads(_sse_events(raw)[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_unknown_key_is_401_everywhere(stack: Stack) -> None:
    for code, headers, body in (post(stack.url + CHAT, chat(), "sk-nope"), post(stack.url + CHAT, chat()),
                                get(stack.url + "/v1/models", "sk-nope")):
        assert code == 401
        assert headers["x-kvgate-reject-reason"] == "unknown-key"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(stack.url + "/v1/models", KEYS["open"])[0] == 200


def test_post_without_body_never_reaches_upstream(stack: Stack) -> None:
    n = len(upstream_requests(stack))
    code, headers, body = post(stack.url + CHAT, None, KEYS["open"], raw=b"")
    assert code == 400 and headers["x-kvgate-reject-reason"] == "missing-body"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert json.loads(body)["error"]["code"] == "missing_body"  # not rewritten by Envoy's invalid-http mapper
    assert len(upstream_requests(stack)) == n


@pytest.mark.parametrize("raw,words", [
    (b'{"messages": [oops', "not valid JSON"),
    # Python's json (vLLM's parser) reads this one: passed on, it would skip max_n and max_output_tokens
    (b'\xef\xbb\xbf{"messages":[{"role":"user","content":"hi"}],"max_tokens":100000,"n":16,"stream":true}',
     "byte order mark"),
])
def test_a_body_that_is_not_json_is_400_invalid_json_and_never_reaches_upstream(
        stack: Stack, raw: bytes, words: str) -> None:
    n = len(upstream_requests(stack))
    before = metric(stack.metrics_url, "kvgate_unparsed_bodies_total")
    code, headers, body = post(stack.url + CHAT, None, KEYS["open"], raw=raw)
    assert code == 400 and headers["x-kvgate-reject-reason"] == "invalid-json"
    error = json.loads(body)["error"]
    assert words in error["message"] and error["code"] == "invalid_json"
    assert len(upstream_requests(stack)) == n
    assert metric(stack.metrics_url, "kvgate_unparsed_bodies_total") == before  # nothing decided on size
    assert inflight(stack, "open") == 0


def test_oversized_requests_get_a_clear_4xx(stack: Stack) -> None:
    code, h, body = post(stack.url + CHAT, chat("x" * 9000), KEYS["open"])  # ~2250 tokens > 2000
    assert code == 400 and h["x-kvgate-reject-reason"] == "prompt-too-long"
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    code, h, _ = post(stack.url + CHAT, chat("x" * 400, max_tokens=3990), KEYS["open"])
    assert code == 400 and h["x-kvgate-reject-reason"] == "context-too-long"
    code, h, body = post(stack.url + CHAT, chat("x" * 250_000), KEYS["tight"])  # over max_body_bytes
    assert code == 413 and h["x-kvgate-reject-reason"] == "body-too-large"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    code, h, body = post(stack.url + CHAT, chat("x" * 5_000_000), KEYS["tight"])  # over Envoy's buffer
    assert code == 413 and h["x-kvgate-reject-reason"] == "body-too-large"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert "retry-after" not in h


def _slow(st: Stack, key: str, tokens: int = 100) -> threading.Thread:
    t = threading.Thread(target=post, args=(st.url + CHAT, chat(max_tokens=tokens), key))
    t.start()
    return t


def test_concurrency_cap_is_429_with_usable_retry_after(stack: Stack) -> None:
    holder = _slow(stack, KEYS["tight"], 400)  # ~2 s
    wait_for(lambda: inflight(stack, "tight") == 1, what="first request in flight")
    code, h, body = post(stack.url + CHAT, chat(), KEYS["tight"])
    holder.join()
    assert code == 429
    assert h["x-kvgate-reject-reason"] == "tenant-concurrency"
    assert int(h["retry-after"]) >= 1 and 100 <= int(h["retry-after-ms"]) <= 10_000
    assert {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"} <= set(h)
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and set(err) == {"message", "type", "param", "code"}
    wait_for(lambda: inflight(stack, "tight") == 0, what="slot released")
    assert post(stack.url + CHAT, chat(), KEYS["tight"])[0] == 200


def test_token_budget_is_429_tenant_tokens(stack: Stack) -> None:
    codes = [post(stack.url + CHAT, chat(max_tokens=90), KEYS["tokens"]) for _ in range(4)]
    statuses = [c for c, _, _ in codes]
    assert statuses[0] == 200 and 429 in statuses
    rejected = next(h for c, h, _ in codes if c == 429)
    assert rejected["x-kvgate-reject-reason"] == "tenant-tokens"
    assert rejected["x-ratelimit-limit-tokens"] == "600"


def test_shadow_tenant_is_admitted_but_counted(stack: Stack) -> None:
    before = metric(stack.metrics_url, "kvgate_requests_total", tenant="shadowed", decision="shadow_reject")
    holder = _slow(stack, KEYS["shadowed"], 400)
    wait_for(lambda: inflight(stack, "shadowed") == 1, what="first request in flight")
    code, _, _ = post(stack.url + CHAT, chat(), KEYS["shadowed"])
    holder.join()
    assert code == 200
    assert metric(stack.metrics_url, "kvgate_requests_total", tenant="shadowed", decision="shadow_reject",
                  reason="tenant-concurrency") == before + 1
    assert '"shadow_reject"' in stack.log("kvgate")


def test_upstream_error_releases_the_slot_and_charges_nothing(stack: Stack) -> None:
    before = metric(stack.metrics_url, "kvgate_completions_total", tenant="tight", outcome="upstream_error")
    code, _, _ = post(stack.url + CHAT, {**chat(), "model": "fail-500"}, KEYS["tight"])
    assert code == 500
    wait_for(lambda: metric(stack.metrics_url, "kvgate_completions_total", tenant="tight",
                            outcome="upstream_error") == before + 1, what="upstream error accounted")
    assert inflight(stack, "tight") == 0
    assert post(stack.url + CHAT, chat(), KEYS["tight"])[0] == 200


def test_client_cutting_an_sse_stream_halfway_releases_the_slot(stack: Stack) -> None:
    before = metric(stack.metrics_url, "kvgate_completions_total", tenant="tight", outcome="disconnect")
    body = json.dumps(chat(max_tokens=400, stream=True)).encode()
    s = socket.create_connection(("127.0.0.1", stack.envoy.listen_port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEYS["tight"].encode() + b"\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.settimeout(10)  # a refusal (no stream) must fail the test, not hang it
    got = b""
    while got.count(b"data: ") < 3:
        chunk = s.recv(65536)
        assert chunk and not got.startswith(b"HTTP/1.1 4"), got[:300]
        got += chunk
    assert inflight(stack, "tight") == 1
    s.close()  # ~2 s of stream left
    wait_for(lambda: inflight(stack, "tight") == 0, timeout=5, what="slot released after disconnect")
    assert metric(stack.metrics_url, "kvgate_completions_total", tenant="tight", outcome="disconnect") == before + 1
    assert metric(stack.metrics_url, "kvgate_fleet_inflight_requests") == 0


def test_no_request_is_lost_under_a_concurrent_burst(stack: Stack) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        code = post(stack.url + CHAT, chat(max_tokens=20), KEYS["tight"])[0]
        with lock:
            results.append(code)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12 and set(results) <= {200, 429} and 200 in results and 429 in results
    wait_for(lambda: inflight(stack, "tight") == 0, what="all slots back")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_unchanged(stack: Stack, stream: bool) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEYS["open"], max_retries=0)
    if stream:
        chunks = list(client.chat.completions.create(model="standin-8b", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, stream=True))
        assert len(chunks) == 4 and all(c.choices for c in chunks)
    else:
        r = client.chat.completions.create(model="standin-8b", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        assert r.usage is not None and r.usage.completion_tokens == 4
    models = client.models.list()
    assert [m.id for m in models] == ["standin-8b"]


def test_openai_sdk_retries_honour_retry_after(stack: Stack) -> None:
    openai = pytest.importorskip("openai")
    before = metric(stack.metrics_url, "kvgate_requests_total", tenant="tight", reason="tenant-concurrency")
    holder = _slow(stack, KEYS["tight"], 100)  # holds the only slot for ~0.5 s
    wait_for(lambda: inflight(stack, "tight") == 1, what="slot held")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEYS["tight"], max_retries=5)
    t0 = time.monotonic()
    r = client.chat.completions.create(model="standin-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    holder.join()
    assert r.choices[0].message.content
    rejected = metric(stack.metrics_url, "kvgate_requests_total", tenant="tight", reason="tenant-concurrency") - before
    assert rejected >= 1  # it was refused at least once and succeeded by retrying
    assert time.monotonic() - t0 < 8  # the SDK waited what kvgate said (~0.5 s), not its own long backoff
    with pytest.raises(openai.RateLimitError) as e:
        holder = _slow(stack, KEYS["tight"], 400)
        wait_for(lambda: inflight(stack, "tight") == 1, what="slot held")
        openai.OpenAI(base_url=stack.url + "/v1", api_key=KEYS["tight"], max_retries=0).chat.completions.create(
            model="standin-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    holder.join()
    assert e.value.response.headers["retry-after-ms"]
