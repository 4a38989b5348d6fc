"""Exactly once at every seam, through the real Envoy: restarts of kvgate and of Envoy, decisions Envoy
gave up on, bytes that are not UTF-8, config files being written. Each test asserts outcomes (status
codes, counts, gauges), never a latency."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack
from kvgate.envoy_config import EnvoyParams
from tests.conftest import KEYS, tenants
from tests.helpers import chat, metric, post, wait_for

CHAT = "/v1/chat/completions"


def stream(url: str, key: str, max_tokens: int, out: dict[str, Any], timeout: float = 60.0) -> None:
    """A streaming chat request read to its end; ``out`` gets its status, events and whether [DONE] came."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = json.dumps(chat(max_tokens=max_tokens, stream=True))
    try:
        conn.request("POST", CHAT, body, {"content-type": "application/json", "authorization": f"Bearer {key}"})
        r = conn.getresponse()
        out["status"] = r.status
        out["started"] = True
        data = b""
        while chunk := r.read1(65536):
            data += chunk
        events = [e for e in data.decode().split("\n\n") if e.startswith("data:")]
        out["events"] = len(events)
        out["done"] = bool(events) and events[-1].strip() == "data: [DONE]"
    except (OSError, http.client.HTTPException) as e:
        out["error"] = repr(e)
    finally:
        conn.close()


def test_a_kvgate_crash_never_cuts_an_admitted_stream(tmp_path: Path) -> None:
    """The ext_proc stream closes right after the decision: kill -9 kvgate mid-stream and the admitted
    stream still ends with all its tokens and [DONE]."""
    with Stack(tmp_path, {"tenants": tenants()}, token_ms=10.0) as st:
        out: dict[str, Any] = {}
        t = threading.Thread(target=stream, args=(st.url, KEYS["open"], 300, out))
        t.start()
        wait_for(lambda: out.get("started", False), what="the stream's first bytes")
        st.stop_process("kvgate", signal.SIGKILL)
        t.join(60)
        assert out.get("status") == 200 and out.get("done") is True, out
        assert out["events"] >= 300  # every token arrived
        st.start_kvgate()
        wait_for(lambda: post(st.url + CHAT, chat(), KEYS["open"])[0] == 200, what="kvgate back")


def test_envoy_killed_and_restarted_gives_back_the_slots_it_held(tmp_path: Path) -> None:
    """Requests that died with an Envoy can never report their end: kvgate releases them once Envoy's
    access-log connection is gone, so a tenant at its cap is served again within seconds, not after
    lease_timeout_seconds (900 s by default)."""
    cfg = {"tenants": [*tenants(), {"name": "cap", "api_key_sha256": [hash_key(KEYS["cap"])],
                                    "max_concurrent": 2}]}
    with Stack(tmp_path, cfg, token_ms=50.0) as st:
        # one short request first, so that the Envoy has opened its access-log stream
        assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200
        outs: list[dict[str, Any]] = [{}, {}]
        threads = [threading.Thread(target=stream, args=(st.url, KEYS["cap"], 2000, o, 120)) for o in outs]
        for t in threads:
            t.start()
        wait_for(lambda: all(o.get("started") for o in outs), what="two long streams")
        assert metric(st.metrics_url, "kvgate_inflight_requests", tenant="cap") == 2
        code, h, _ = post(st.url + CHAT, chat(), KEYS["cap"])
        assert code == 429 and h["x-kvgate-reject-reason"] == "tenant-concurrency"
        st.stop_process("envoy", signal.SIGKILL)
        for t in threads:
            t.join(10)
        st.start_envoy()
        # released within seconds of the access-log connection ending
        wait_for(lambda: metric(st.metrics_url, "kvgate_inflight_requests", tenant="cap") == 0, timeout=10,
                 what="the dead Envoy's leases released")
        assert post(st.url + CHAT, chat(), KEYS["cap"])[0] == 200
        assert metric(st.metrics_url, "kvgate_completions_total", tenant="cap", outcome="envoy_gone") == 2
        wait_for(lambda: metric(st.metrics_url, "kvgate_fleet_inflight_requests") == 0, what="all slots back")


def test_a_decision_envoy_gave_up_on_grants_nothing(fresh_stack: Stack) -> None:
    """kvgate paused past Envoy's message timeout: the client gets a retryable 503 and, once kvgate
    runs again, no slot stays held for the request Envoy abandoned."""
    st = fresh_stack.start()
    kv = st.procs["kvgate"]
    assert post(st.url + CHAT, chat(), KEYS["tight"])[0] == 200
    kv.send_signal(signal.SIGSTOP)
    try:
        code, h, _ = post(st.url + CHAT, chat(), KEYS["tight"])
    finally:
        kv.send_signal(signal.SIGCONT)
    assert code == 503 and h["x-kvgate-reject-reason"] == "gateway-unavailable"
    # tight has max_concurrent 1: had the abandoned decision kept its slot, this would be 429
    wait_for(lambda: metric(st.metrics_url, "kvgate_inflight_requests", tenant="tight") == 0,
             what="no slot held for the abandoned request")
    assert post(st.url + CHAT, chat(), KEYS["tight"])[0] == 200


def _raw_post(url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=15)
    try:
        conn.putrequest("POST", CHAT)
        for k, v in headers:
            conn.putheader(k, v)
        conn.putheader(b"content-length", str(len(body)).encode())
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_authorization_that_is_not_utf8_is_401_even_fail_open(tmp_path: Path) -> None:
    body = json.dumps(chat()).encode()
    for fail_open in (False, True):
        with Stack(tmp_path / str(fail_open), {"tenants": tenants()}, envoy=EnvoyParams(fail_open=fail_open)) as st:
            code, h, raw = _raw_post(st.url, [(b"content-type", b"application/json"),
                                              (b"authorization", b"Bearer sk-\xff\xfe\xc3")], body)
            assert code == 401, raw
            assert h["x-kvgate-reject-reason"] == "invalid-authorization"
            assert json.loads(raw)["error"]["code"] == "invalid_api_key"
            assert "Traceback" not in st.log("kvgate")
            assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200  # and the next request is fine


def _leave_mid_body(url: str, key: str) -> None:
    """Headers and half a body, then the connection closes: Envoy logs a disconnect without a ticket."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=15)
    conn.putrequest("POST", CHAT)
    conn.putheader("content-type", "application/json")
    conn.putheader("authorization", f"Bearer {key}")
    conn.putheader("content-length", "1000")
    conn.endheaders(b'{"model": "x", "mess')
    time.sleep(0.2)
    conn.close()


def test_a_caller_without_a_valid_key_that_leaves_before_its_decision_leaves_no_tombstone(
        fresh_stack: Stack) -> None:
    """Every ticketless access-log entry made a tombstone (and, with several replicas, one on each):
    Envoy now logs the Authorization header, and an end whose key names no tenant makes none — its
    decision, were it still on its way, is a 401."""
    st = fresh_stack.start()
    _leave_mid_body(st.url, KEYS["open"])
    wait_for(lambda: metric(st.metrics_url, "kvgate_tombstones") == 1, what="a tenant's abandoned request")
    for _ in range(5):
        _leave_mid_body(st.url, "sk-nobody")
    _leave_mid_body(st.url, KEYS["open"])
    wait_for(lambda: metric(st.metrics_url, "kvgate_tombstones") >= 2, what="the second tenant one")
    time.sleep(1.0)  # (entries from several Envoy workers may come in any order: let the last ones land)
    assert metric(st.metrics_url, "kvgate_tombstones") == 2, "none for the five callers without a valid key"


def test_an_emptied_or_half_written_config_is_never_applied(fresh_stack: Stack) -> None:
    st = fresh_stack.start()
    assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200
    st.config_path.write_text("")
    wait_for(lambda: metric(st.metrics_url, "kvgate_config_reloads_total", result="error") >= 1,
             what="the empty file refused")
    assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200  # the running config is kept
    # a file written slowly, in pieces: never read half-way (a prefix of it would drop tenants)
    st.write_config()
    wait_for(lambda: metric(st.metrics_url, "kvgate_config_reloads_total", result="ok") >= 1, what="a reload")
    errors = metric(st.metrics_url, "kvgate_config_reloads_total", result="error")
    text = st.config_path.read_text()
    with st.config_path.open("w") as f:
        for i in range(0, len(text), max(1, len(text) // 4)):
            f.write(text[i:i + max(1, len(text) // 4)])
            f.flush()
            time.sleep(0.3)
    time.sleep(2.5)
    assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200
    # no prefix of the file was ever read (each would have been a failed or a wrong reload)
    assert metric(st.metrics_url, "kvgate_config_reloads_total", result="error") == errors


def test_a_hung_node_frees_the_slot_but_a_long_unstreamed_answer_is_not_cut(tmp_path: Path) -> None:
    """First-byte and idle timeouts cut a hung (SIGSTOPped) node — 503 upstream-unavailable, the tenant's
    slot back — while a healthy answer that is not streamed (its first byte is the whole answer) and
    takes longer than the streaming first-byte timeout still arrives whole."""
    envoy = EnvoyParams(first_byte_timeout_ms=1500, idle_timeout_ms=1500, buffered_timeout_ms=30_000)
    with Stack(tmp_path, {"tenants": tenants()}, token_ms=10.0, envoy=envoy) as st:
        code, _, body = post(st.url + CHAT, chat(max_tokens=300), KEYS["tight"], timeout=30)  # ~3 s, whole
        assert code == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 300
        # its slot comes back with Envoy's access-log entry, a moment after the answer: wait for it, or the
        # next request meets the tenant's own cap (a 429) on a busy machine
        wait_for(lambda: metric(st.metrics_url, "kvgate_inflight_requests", tenant="tight") == 0,
                 what="the first answer's slot back")
        node = st.procs["upstream0"]
        node.send_signal(signal.SIGSTOP)
        try:
            out: dict[str, Any] = {}
            stream(st.url, KEYS["tight"], 50, out, timeout=20)
            assert out.get("status") == 503, out
            wait_for(lambda: metric(st.metrics_url, "kvgate_inflight_requests", tenant="tight") == 0,
                     what="the hung request's slot back")
            assert metric(st.metrics_url, "kvgate_completions_total", tenant="tight", outcome="upstream_error") == 1
        finally:
            node.send_signal(signal.SIGCONT)
        assert post(st.url + CHAT, chat(), KEYS["tight"])[0] == 200
