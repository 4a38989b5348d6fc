"""The simulated node over real HTTP: vLLM's API, its errors, its metrics — and the openai SDK."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.profiles import PROFILES
from kvgate.dev.stack import free_port, wait_port
from tests.helpers import get, metric, post, wait_for

REFERENCE = Path(__file__).resolve().parent / "fixtures" / "vllm-metrics-sample.txt"
MODEL = PROFILES["8b-h100"].model_name


class Sim:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "sim", "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_port(self.port, proc=self.proc)  # type: ignore[arg-type]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    s = Sim("--num-gpu-blocks", "64", "--max-num-seqs", "2", "--max-num-queued-reqs", "2", "--mean-output-tokens", "20")
    yield s
    s.stop()


def completion(url: str, **body: object) -> tuple[int, dict[str, str], bytes]:
    return post(url + "/v1/completions", {"model": MODEL, "prompt": "hello world", **body})


def test_models_and_health(sim: Sim) -> None:
    code, _, body = get(sim.url + "/v1/models")
    assert code == 200 and json.loads(body)["data"][0]["id"] == MODEL
    assert get(sim.url + "/health")[0] == 200


def test_ignore_eos_fixes_the_output_length_and_usage_reports_it(sim: Sim) -> None:
    code, _, body = post(sim.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 7, "ignore_eos": True})
    assert code == 200
    doc = json.loads(body)
    assert doc["usage"] == {"prompt_tokens": 104, "completion_tokens": 7, "total_tokens": 111,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert doc["choices"][0]["finish_reason"] == "length"
    code, _, body = completion(sim.url, prompt=[1, 2, 3, 4, 5], max_tokens=2, ignore_eos=True)
    assert json.loads(body)["usage"]["prompt_tokens"] == 5


def test_usage_reports_the_prompt_tokens_its_prefix_cache_served(sim: Sim) -> None:
    """As vLLM does (``usage.prompt_tokens_details.cached_tokens``): spend budgets price them apart."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "cached " * 300}], "max_tokens": 2,
            "ignore_eos": True}
    first = json.loads(post(sim.url + "/v1/chat/completions", body)[2])["usage"]
    again = json.loads(post(sim.url + "/v1/chat/completions", body)[2])["usage"]
    assert again["prompt_tokens"] == first["prompt_tokens"]
    # whole blocks of the same prompt, never its last token
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]


def test_without_ignore_eos_requests_stop_at_a_natural_length(sim: Sim) -> None:
    reasons = {json.loads(completion(sim.url, max_tokens=100)[2])["choices"][0]["finish_reason"]
               for _ in range(6)}
    assert "stop" in reasons  # mean natural length 20 < 100: most stop on their own


def test_vllm_errors(sim: Sim) -> None:
    code, _, body = completion(sim.url, priority=3, max_tokens=1)
    assert code == 400 and "Priority scheduling is not enabled" in json.loads(body)["error"]["message"]
    code, _, body = completion(sim.url, model="other-model")
    assert code == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    code, _, _ = post(sim.url + "/v1/completions", None, raw=b"{nope")
    assert code == 400
    code, _, body = completion(sim.url, prompt="x" * 8000, max_tokens=1, ignore_eos=True)  # > 64 blocks of KV
    assert code == 400 and "KV cache" in json.loads(body)["error"]["message"]


def chat_body(content: object = "hi", **body: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **body}


BAD_REQUESTS = [
    pytest.param("chat", chat_body([["hi"]]), "messages[0].content[0]", id="content: a nested list"),
    pytest.param("chat", chat_body(42), "messages[0].content", id="content: a number"),
    pytest.param("chat", chat_body({"type": "text", "text": "hi"}), "messages[0].content", id="content: an object"),
    pytest.param("chat", chat_body(["hi"]), "messages[0].content[0]", id="content: a list of strings"),
    pytest.param("chat", chat_body([{"text": "hi"}]), "content[0].type", id="part without a type"),
    pytest.param("chat", chat_body([{"type": 1, "text": "hi"}]), "content[0].type", id="part with a non-string type"),
    pytest.param("chat", chat_body([{"type": "text"}]), "content[0].text", id="text part without text"),
    pytest.param("chat", chat_body([{"type": "text", "text": ["hi"]}]), "content[0].text", id="text not a string"),
    pytest.param("chat", {"model": MODEL, "messages": ["hi"]}, "messages[0]", id="message not an object"),
    pytest.param("chat", chat_body(n=0), "n must be at least 1", id="n 0"),
    pytest.param("chat", chat_body(n=-2), "n must be at least 1", id="n negative"),
    pytest.param("chat", chat_body(n=1.5), "n: Input should be a valid integer", id="n fractional"),
    pytest.param("chat", chat_body(n="2"), "n: Input should be a valid integer", id="n a string"),
    pytest.param("chat", chat_body(n=True), "n: Input should be a valid integer", id="n a bool"),
    pytest.param("chat", chat_body(max_tokens=0), "max_tokens must be at least 1", id="max_tokens 0"),
    pytest.param("chat", chat_body(max_tokens=2.5), "max_tokens: Input should be a valid integer",
                 id="max_tokens fractional"),
    pytest.param("chat", chat_body(max_tokens=[5]), "max_tokens: Input should be a valid integer",
                 id="max_tokens a list"),
    pytest.param("chat", chat_body(max_completion_tokens=0), "max_completion_tokens must be at least 1",
                 id="max_completion_tokens 0"),
    pytest.param("completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens must be at least 1",
                 id="completions: max_tokens negative"),
    pytest.param("completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n must be at least 1",
                 id="completions: n 0"),
]


@pytest.mark.parametrize(("route", "body", "says"), BAD_REQUESTS)
def test_malformed_requests_get_vllms_400(sim: Sim, route: str, body: dict[str, object], says: str) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    code, headers, raw = post(sim.url + path, body)
    assert code == 400, raw
    assert headers.get("content-type", headers.get("Content-Type", "")).startswith("application/json")
    err = json.loads(raw)["error"]  # vLLM's nested error, as for its other 400s
    assert (err["type"], err["code"], err["param"]) == ("BadRequestError", 400, None)
    assert says in err["message"], err["message"]


@pytest.mark.parametrize("body", [
    pytest.param(chat_body(None), id="content null"),
    pytest.param(chat_body([]), id="content an empty list"),
    pytest.param(chat_body([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]),
                 id="typed parts, a text and an image"),
    pytest.param(chat_body(n=1, max_tokens=2.0), id="integral numbers"),
    pytest.param(chat_body(n=None, max_tokens=None), id="nulls take the defaults"),
])
def test_well_formed_requests_are_served(sim: Sim, body: dict[str, object]) -> None:
    code, _, raw = post(sim.url + "/v1/chat/completions", body)
    assert code == 200, raw


def test_queue_cap_answers_503_and_kv_usage_is_exported(sim: Sim) -> None:
    results: list[int] = []

    def one() -> None:
        results.append(completion(sim.url, prompt="y" * 200, max_tokens=150, ignore_eos=True)[0])

    url = sim.url + "/metrics"
    threads = []

    def start(n: int) -> None:
        for _ in range(n):
            threads.append(threading.Thread(target=one))
            threads[-1].start()

    start(2)  # fill the two running slots (max_num_seqs 2)
    wait_for(lambda: metric(url, "vllm:num_requests_running") == 2, what="two running")
    assert metric(url, "vllm:kv_cache_usage_perc") > 0
    start(2)  # fill the queue (max_num_queued_reqs 2)
    wait_for(lambda: metric(url, "vllm:num_requests_waiting") == 2, what="two waiting")
    start(2)  # refused
    for t in threads:
        t.join()
    assert sorted(results) == [200, 200, 200, 200, 503, 503]
    assert metric(sim.url + "/metrics", "vllm:kv_cache_usage_perc") == 0


def _families(text: str) -> dict[str, tuple[str, frozenset[str], tuple[float, ...]]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
        buckets = tuple(sorted({float(s.labels["le"]) for s in fam.samples if "le" in s.labels}))
        out[fam.name] = (fam.type, labels, buckets)
    return out


def test_metrics_match_the_real_vllm_exposition(sim: Sim) -> None:
    completion(sim.url, max_tokens=3, ignore_eos=True)
    ours = _families(get(sim.url + "/metrics")[2].decode())
    ref = _families(REFERENCE.read_text())
    assert set(ref) <= set(ours), set(ref) - set(ours)
    for name, (typ, labels, buckets) in ref.items():
        assert ours[name] == (typ, labels, buckets), name
    assert "vllm:request_prefill_time_seconds" in ours and "vllm:gpu_cache_usage_perc" not in ours


def test_legacy_metric_name_switch() -> None:
    s = Sim("--legacy-kv-metric")
    try:
        fams = _families(get(s.url + "/metrics")[2].decode())
        assert "vllm:gpu_cache_usage_perc" in fams and "vllm:kv_cache_usage_perc" not in fams
    finally:
        s.stop()


def test_priority_policy_accepts_priority_and_serves_the_urgent_first() -> None:
    s = Sim("--scheduling-policy", "priority", "--max-num-seqs", "1")
    try:
        order: list[str] = []
        url = s.url + "/metrics"

        def one(name: str, prio: int) -> None:
            code = completion(s.url, max_tokens=60, ignore_eos=True, priority=prio)[0]
            assert code == 200
            order.append(name)

        ts = []
        for name, prio, running, waiting in (("first", 0, 1, 0), ("low", 9, 1, 1), ("high", -1, 1, 2)):
            ts.append(threading.Thread(target=one, args=(name, prio)))
            ts[-1].start()
            wait_for(lambda r=running, w=waiting: metric(url, "vllm:num_requests_running") == r
                     and metric(url, "vllm:num_requests_waiting") == w, what=f"{name} queued")
        for t in ts:
            t.join()
        assert order == ["first", "high", "low"]
    finally:
        s.stop()


def test_the_openai_sdk_streams_from_it(sim: Sim) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_client_that_goes_away_is_aborted(sim: Sim) -> None:
    import socket

    before = metric(sim.url + "/metrics", "vllm:request_success_total", finished_reason="abort")
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True})
    c = socket.create_connection(("127.0.0.1", sim.port))
    c.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    c.recv(4096)
    c.close()
    wait_for(lambda: metric(sim.url + "/metrics", "vllm:request_success_total", finished_reason="abort")
             == before + 1, what="abort counted")
    wait_for(lambda: metric(sim.url + "/metrics", "vllm:num_requests_running") == 0, what="engine freed")
