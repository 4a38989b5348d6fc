"""Two model pools through the real Envoy, kvgate, probes and simulated vLLM nodes (issue 15), started
the way ``kvgate up --pool`` starts them: each model's requests reach only its own pool's nodes (counted
at the nodes), an unknown model is a 404 and a model the tenant may not use a 403 (reason header and
OpenAI body), GET /v1/models lists the caller's models, a saturated pool answers 503 while the other
admits, and kvgate's metrics carry the pool. No timing thresholds: waits poll with generous timeouts."""

from __future__ import annotations

import http.client
import itertools
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.identity import hash_key
from ext_proc.reasons import REASONS
from kvgate.dev.stack import SimPool, Stack, free_port, http_get
from tests.helpers import get, metric, post, wait_for

SMALL = SimPool("llama-8b", "8b-h100", 2)
BIG = SimPool("CodeLlama-34B", "34b-h100", 1)
"""The big model's pool: one node of the 34B profile, whose KV cache (40,592 tokens) a few long
requests fill, so a flood saturates it while the 8B pool's two nodes (436,896 tokens each) stay idle.
Its name is sanitised to the pool name 'codellama-34b'."""
FULL, SMALL_ONLY = "sk-pools-full", "sk-pools-small"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def config() -> dict[str, Any]:
    return {
        # no gateway queue: a request the pool has no room for is a 503 at once, not after a wait
        "queue": {"enabled": False},
        "tenants": [
            {"name": "full", "api_key_sha256": [hash_key(FULL)]},
            {"name": "smallonly", "api_key_sha256": [hash_key(SMALL_ONLY)], "models": [SMALL.model]},
        ],
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(tmp_path_factory.mktemp("pools"), config(), pools=[SMALL, BIG], sim_args=[])
    st.start()
    try:
        # every node read by kvgate before any request: choices are made on readings, not guesses
        nodes = [address(u) for urls in st.pool_nodes.values() for u in urls]
        wait_for(lambda: all(node_series(st, "kvgate_node_kv_usage_ratio", n) for n in nodes), 30,
                 "kvgate reading every node")
        yield st
    finally:
        st.stop()


def address(url: str) -> str:
    return url.split("://", 1)[1]


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    code, body = http_get(url, timeout=5)
    assert code == 200, url
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(body.decode())
            for s in fam.samples]


def node_series(st: Stack, name: str, node: str) -> list[dict[str, str]]:
    """The label sets of kvgate's ``name`` samples for one node."""
    return [labels for n, labels, _ in scrape(st.metrics_url) if n == name and labels.get("node") == node]


def served(st: Stack, pool: SimPool) -> list[float]:
    """Completions each of the pool's nodes finished (vLLM's own counter, read at the node)."""
    return [metric(u + "/metrics", "vllm:request_success_total") for u in st.pool_nodes[pool.name]]


_SEQ = itertools.count()


def body(model: str, prompt_chars: int = 40, tokens: int = 3, **extra: Any) -> dict[str, Any]:
    """A completion request; every prompt its own from its first characters, so no node holds any of
    it in its prefix cache and its KV is all its own."""
    head = f"request {next(_SEQ)}: "
    return {"model": model, "prompt": head + "x" * max(0, prompt_chars - len(head)), "max_tokens": tokens,
            "ignore_eos": True, **extra}


def requests_total(st: Stack, **labels: str) -> float:
    return metric(st.metrics_url, "kvgate_requests_total", **labels)


def test_the_stack_started_each_pool_on_its_own_nodes(stack: Stack) -> None:
    st = stack
    assert list(st.pool_nodes) == ["llama-8b", "codellama-34b"]
    assert [len(st.pool_nodes[p.name]) for p in (SMALL, BIG)] == [2, 1]
    for pool in (SMALL, BIG):
        for url in st.pool_nodes[pool.name]:  # each node serves its pool's model, and only that one
            code, raw = http_get(url + "/v1/models")
            assert code == 200 and [m["id"] for m in json.loads(raw)["data"]] == [pool.model]
            code, _, _ = post(url + COMPLETIONS, body("some-other-model"))
            assert code == 404


def test_each_model_reaches_only_its_own_pools_nodes(stack: Stack) -> None:
    st = stack
    small0, big0 = served(st, SMALL), served(st, BIG)
    for i in range(8):
        code, _, raw = post(st.url + COMPLETIONS, body(SMALL.model), FULL)
        assert code == 200, raw
        assert json.loads(raw)["model"] == SMALL.model
        if i < 3:
            code, _, raw = post(st.url + CHAT, {"model": BIG.model, "max_tokens": 3, "ignore_eos": True,
                                                "messages": [{"role": "user", "content": "hi"}]}, FULL)
            assert code == 200, raw
            assert json.loads(raw)["model"] == BIG.model
    wait_for(lambda: sum(served(st, SMALL)) - sum(small0) == 8 and sum(served(st, BIG)) - sum(big0) == 3, 10,
             "the nodes counting what they served")
    assert sum(served(st, SMALL)) - sum(small0) == 8, "every 8B request on an 8B node"
    assert sum(served(st, BIG)) - sum(big0) == 3, "every 34B request on the 34B node, and nothing else there"


def test_a_model_no_pool_serves_is_a_404_model_not_found(stack: Stack) -> None:
    st = stack
    small0, big0 = served(st, SMALL), served(st, BIG)
    before = requests_total(st, reason="model-not-found")
    code, h, raw = post(st.url + COMPLETIONS, body("gpt-4o"), FULL)
    assert code == 404, raw
    assert h["x-kvgate-reject-reason"] == "model-not-found"
    err = json.loads(raw)["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    # refused before routing: labelled pool "none", class invalid (never capacity), and no node saw it
    wait_for(lambda: requests_total(st, reason="model-not-found") == before + 1, 10, "the 404 counted")
    assert requests_total(st, reason="model-not-found", pool="none", **{"class": "invalid"}) >= 1
    assert served(st, SMALL) == small0 and served(st, BIG) == big0


def test_a_model_the_tenant_may_not_use_is_a_403_model_not_allowed(stack: Stack) -> None:
    st = stack
    big0 = served(st, BIG)
    code, h, raw = post(st.url + COMPLETIONS, body(BIG.model), SMALL_ONLY)
    assert code == 403, raw
    assert h["x-kvgate-reject-reason"] == "model-not-allowed"
    err = json.loads(raw)["error"]
    assert err["code"] == "model_not_allowed" and err["type"] == "invalid_request_error"
    assert served(st, BIG) == big0
    code, _, raw = post(st.url + COMPLETIONS, body(SMALL.model), SMALL_ONLY)  # its own model: served
    assert code == 200, raw
    wait_for(lambda: requests_total(st, tenant="smallonly", reason="model-not-allowed", **{"class": "auth"}) == 1,
             10, "the 403 counted as auth")


def test_get_models_answers_the_callers_models(stack: Stack) -> None:
    st = stack
    for key, want in ((FULL, [SMALL.model, BIG.model]), (SMALL_ONLY, [SMALL.model])):
        code, _, raw = get(st.url + "/v1/models", key)
        assert code == 200, raw
        doc = json.loads(raw)
        assert doc["object"] == "list" and [m["id"] for m in doc["data"]] == want
        assert all(m["object"] == "model" for m in doc["data"])
    code, h, _ = get(st.url + "/v1/models", "sk-nobody")
    assert code == 401 and h["x-kvgate-reject-reason"] == "unknown-key"


def test_per_pool_metrics_carry_the_pool(stack: Stack) -> None:
    st = stack
    admits = {p.name: requests_total(st, decision="admit", pool=p.name) for p in (SMALL, BIG)}
    for pool, n in ((SMALL, 3), (BIG, 2)):
        for _ in range(n):
            assert post(st.url + COMPLETIONS, body(pool.model), FULL)[0] == 200
    wait_for(lambda: requests_total(st, decision="admit", pool=SMALL.name) == admits[SMALL.name] + 3
             and requests_total(st, decision="admit", pool=BIG.name) == admits[BIG.name] + 2, 10,
             "admissions counted per pool")
    assert metric(st.metrics_url, "kvgate_nodes_total", pool=SMALL.name) == 2
    assert metric(st.metrics_url, "kvgate_nodes_total", pool=BIG.name) == 1
    for pool in (SMALL, BIG):
        for url in st.pool_nodes[pool.name]:  # each node's gauges under its own pool
            assert [s.get("pool") for s in node_series(st, "kvgate_node_kv_usage_ratio", address(url))] == [pool.name]
    wait_for(lambda: metric(st.metrics_url, "kvgate_tokens_total", tenant="full", kind="completion",
                            pool=BIG.name) > 0, 10, "tokens counted per pool")
    pools = {labels.get("pool") for name, labels, _ in scrape(st.metrics_url) if name == "kvgate_requests_total"}
    assert {SMALL.name, BIG.name} <= pools and pools <= {SMALL.name, BIG.name, "none"}


class Held:
    """A streamed completion held open: admitted, it keeps its KV on the node until closed."""

    def __init__(self, st: Stack, model: str, prompt_chars: int, tokens: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", st.envoy.listen_port, timeout=60)
        self.conn.request("POST", COMPLETIONS, json.dumps(body(model, prompt_chars, tokens, stream=True)),
                          {"content-type": "application/json", "authorization": f"Bearer {FULL}"})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.reason = self.resp.getheader("x-kvgate-reject-reason")
        if self.status != 200:
            self.resp.read()
            self.conn.close()

    def close(self) -> None:
        self.conn.close()


def test_a_saturated_pool_answers_503_while_the_other_admits(stack: Stack) -> None:
    st = stack
    big_node = st.pool_nodes[BIG.name][0] + "/metrics"
    small0 = served(st, SMALL)
    capacity0 = {p.name: requests_total(st, pool=p.name, **{"class": "capacity"}) for p in (SMALL, BIG)}
    # 12,000 prompt tokens (+ 2,000 out) each: two of them take 59% of the 34B node's KV cache by their
    # prompts alone, so no third one fits below the threshold (0.92, less the standard tier's 0.05),
    # whether kvgate counts what it booked or what the node reports; each would decode for a minute,
    # so the admitted ones hold their KV until closed
    with ThreadPoolExecutor(8) as ex:
        flood = list(ex.map(lambda _: Held(st, BIG.model, 48_000, 2_000), range(8)))
    held = [h for h in flood if h.status == 200]
    try:
        refused = [h for h in flood if h.status != 200]
        assert held, "the pool admits what fits"
        assert refused and all(h.status == 503 for h in refused), [h.status for h in flood]
        assert all(h.reason is not None and REASONS[h.reason].klass == "capacity" for h in refused)
        wait_for(lambda: metric(big_node, "sim_open_requests") == len(held), 10, "the admitted streams at the node")
        # and kvgate reading their prompts in the node's KV cache: a reading taken after kvgate sent a
        # request but before it reached the node shows neither its KV nor it waiting, and until the next
        # reading a third would fit beside what kvgate then counts
        node = address(st.pool_nodes[BIG.name][0])
        wait_for(lambda: metric(st.metrics_url, "kvgate_node_kv_usage_ratio", node=node, pool=BIG.name)
                 >= 0.29 * len(held), 20, "kvgate reading the held prompts' KV")
        # meanwhile: the 34B pool still has no room, the 8B pool admits
        for _ in range(3):
            code, h, raw = post(st.url + COMPLETIONS, body(BIG.model, 48_000, 2_000), FULL)
            assert code == 503 and REASONS[h["x-kvgate-reject-reason"]].klass == "capacity", raw
            code, _, raw = post(st.url + COMPLETIONS, body(SMALL.model, 400, 8), FULL)
            assert code == 200, raw
        assert metric(big_node, "sim_open_requests") == len(held), "the 34B pool was full throughout"
        wait_for(lambda: sum(served(st, SMALL)) - sum(small0) == 3, 10, "the 8B nodes serving")
        wait_for(lambda: requests_total(st, pool=BIG.name, **{"class": "capacity"})
                 == capacity0[BIG.name] + len(refused) + 3, 10, "the 503s counted on the 34B pool")
        assert requests_total(st, pool=SMALL.name, **{"class": "capacity"}) == capacity0[SMALL.name]
    finally:
        for stream in held:
            stream.close()
    wait_for(lambda: metric(big_node, "sim_open_requests") == 0, 30, "the node freeing the closed streams")
    wait_for(lambda: metric(st.metrics_url, "kvgate_inflight_requests", tenant="full") == 0, 30,
             "kvgate seeing the streams end")
    wait_for(lambda: post(st.url + COMPLETIONS, body(BIG.model), FULL)[0] == 200, 30, "the 34B pool admitting again")


def test_kvgate_up_with_two_pools_lists_them_and_serves_both_models(tmp_path: Path) -> None:
    """The command itself: the banner names each pool, its model and its nodes, and a request for each
    model lands on the node the banner lists for its pool."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "up", "--pool", "llama-8b=8b-h100:1",
                          "--pool", "Qwen/Qwen2.5-7B=8b-a100:1", "--port", str(port), "--workdir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    out = p.stdout
    lines: list[str] = []

    def read() -> None:
        for ln in out:
            lines.append(ln.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_for(lambda: "Ctrl-C stops everything." in lines or p.poll() is not None, 120, "the banner")
        assert "Ctrl-C stops everything." in lines, "\n".join(lines)
        rows = {ln.split()[0]: ln for ln in lines if ln.startswith("    ")}
        assert set(rows) == {"llama-8b", "qwen-qwen2.5-7b"}, lines
        assert "model llama-8b [1 x kvgate sim, 8b-h100]" in rows["llama-8b"]
        assert "model Qwen/Qwen2.5-7B [1 x kvgate sim, 8b-a100]" in rows["qwen-qwen2.5-7b"]
        for pool, model in (("llama-8b", "llama-8b"), ("qwen-qwen2.5-7b", "Qwen/Qwen2.5-7B")):
            node = rows[pool].split("]: ", 1)[1].split()[0]
            before = metric(f"http://{node}/metrics", "vllm:request_success_total")
            code, _, raw = post(f"http://127.0.0.1:{port}{COMPLETIONS}", body(model), "sk-demo-chatbot")
            assert code == 200, raw
            url = f"http://{node}/metrics"
            wait_for(lambda: metric(url, "vllm:request_success_total") == before + 1, 10,  # noqa: B023 (waited on here)
                     f"{model} served at {node}")
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert p.returncode == 0
