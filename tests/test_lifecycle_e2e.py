"""kvgate down, fail-open vs fail-closed, hot reload and drain — through the real Envoy."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack
from kvgate.envoy_config import EnvoyParams
from tests.conftest import KEYS, tenants
from tests.helpers import chat, metric, post, wait_for

CHAT = "/v1/chat/completions"


def test_kvgate_down_fails_closed_with_a_retryable_503(fresh_stack: Stack) -> None:
    st = fresh_stack.start()
    assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200
    st.stop_process("kvgate")
    code, h, body = post(st.url + CHAT, chat(), KEYS["open"])
    assert code == 503
    assert h["retry-after"] == "1" and h["retry-after-ms"] == "1000"
    assert h["x-kvgate-reject-reason"] == "gateway-unavailable"
    assert json.loads(body)["error"]["code"] == "gateway_unavailable"
    st.start_kvgate()
    wait_for(lambda: post(st.url + CHAT, chat(), KEYS["open"])[0] == 200, what="recovery once kvgate is back")


def test_kvgate_down_fails_open_when_configured(tmp_path: Path) -> None:
    st = Stack(tmp_path, {"tenants": tenants()}, envoy=EnvoyParams(fail_open=True))
    with st:
        assert post(st.url + CHAT, chat(), "sk-nope")[0] == 401  # kvgate up: still enforcing
        st.stop_process("kvgate")
        code, _, body = post(st.url + CHAT, chat(), "sk-nope")
        assert code == 200, body  # kvgate down: traffic flows, unaccounted


def test_config_file_change_is_picked_up_and_a_bad_one_is_refused(fresh_stack: Stack) -> None:
    st = fresh_stack.start()
    assert post(st.url + CHAT, chat(), "sk-new-customer")[0] == 401
    cfg = {"tenants": [*tenants(), {"name": "newco", "api_key_sha256": [hash_key("sk-new-customer")]}]}
    st.write_config(cfg)
    wait_for(lambda: post(st.url + CHAT, chat(), "sk-new-customer")[0] == 200, what="reload on file change")
    assert metric(st.metrics_url, "kvgate_config_reloads_total", result="ok") >= 1
    st.config_path.write_text("tenants:\n  - name: newco\n    max_concurrent: -1\n")
    st.procs["kvgate"].send_signal(signal.SIGHUP)
    wait_for(lambda: metric(st.metrics_url, "kvgate_config_reloads_total", result="error") >= 1, what="bad reload")
    assert post(st.url + CHAT, chat(), "sk-new-customer")[0] == 200  # old config kept
    log = st.log("kvgate")
    assert "config_reload_failed" in log and "tenants[0].max_concurrent" in log
    assert "sk-new-customer" not in log and "sk-test-" not in log  # keys never logged


def test_sigterm_drains_and_exits_cleanly(fresh_stack: Stack) -> None:
    st = fresh_stack.start()
    assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200
    t0 = time.monotonic()
    code = st.stop_process("kvgate", signal.SIGTERM, timeout=15)
    assert code == 0
    assert time.monotonic() - t0 < 10
    log = st.log("kvgate")
    assert log.index('"draining"') < log.index('"stopped"')


def test_trusted_header_only_names_configured_tenants(tmp_path: Path) -> None:
    cfg = {"identity": {"trusted_header": "x-auth-tenant"},
           "tenants": [{"name": "a", "api_key_sha256": [hash_key("sk-a")]}, {"name": "b"}]}
    with Stack(tmp_path, cfg) as st:
        assert post(st.url + CHAT, chat(), headers={"x-auth-tenant": "b"})[0] == 200
        assert metric(st.metrics_url, "kvgate_requests_total", tenant="b", decision="admit") == 1
        assert post(st.url + CHAT, chat(), headers={"x-auth-tenant": "nosuch"})[0] == 401
        assert post(st.url + CHAT, chat(), "sk-a", headers={"x-auth-tenant": "nosuch"})[0] == 200
        assert metric(st.metrics_url, "kvgate_requests_total", tenant="a", decision="admit") == 1


def test_kvgate_too_slow_becomes_a_retryable_503(fresh_stack: Stack) -> None:
    st = fresh_stack.start()
    kv = st.procs["kvgate"]
    kv.send_signal(signal.SIGSTOP)  # alive but answering nothing: Envoy's message_timeout (1 s) fires
    try:
        t0 = time.monotonic()
        code, h, body = post(st.url + CHAT, chat(), KEYS["open"])
        waited = time.monotonic() - t0
    finally:
        kv.send_signal(signal.SIGCONT)
    assert code == 503 and h["x-kvgate-reject-reason"] == "gateway-unavailable" and "retry-after" in h
    assert json.loads(body)["error"]["type"] == "server_error"
    assert waited < 5
    wait_for(lambda: post(st.url + CHAT, chat(), KEYS["open"])[0] == 200, what="recovery after SIGCONT")
