"""Three kvgate replicas behind one Envoy, sharing a real ``redis-server``: the limits hold fleet-wide,
counted at the simulated node, through a replica killed with -9, Redis killed, and Redis restarted empty."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ext_proc.identity import hash_key
from ext_proc.profiles import PROFILES
from kvgate.dev.stack import Stack
from tests.helpers import metric, post, wait_for

from .redis_server import RedisServer

MODEL = PROFILES["8b-h100"].model_name
CAP_KEY, TOK_KEY = "sk-rep-cap", "sk-rep-tok"
TOK_BURST = 2000


def config() -> dict[str, Any]:
    return {
        "tenants": [
            {"name": "cap", "api_key_sha256": [hash_key(CAP_KEY)], "max_concurrent": 4},
            {"name": "tok", "api_key_sha256": [hash_key(TOK_KEY)], "tokens_per_minute": 1,
             "token_burst": TOK_BURST},
        ],
        "queue": {"enabled": False},
    }


def stream(st: Stack, key: str, tokens: int) -> tuple[int, dict[str, str]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True}
    code, headers, raw = post(st.url + "/v1/chat/completions", body, key, timeout=60)
    if code == 200:
        assert raw.rstrip().endswith(b"data: [DONE]"), "an admitted stream is never cut"
    return code, headers


def node_metric(st: Stack, name: str) -> float:
    return metric(f"http://127.0.0.1:{st.envoy.upstreams[0][1]}/metrics", name)


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    RedisServer(tmp_path)  # skips without redis-server
    st = Stack(tmp_path, config(), replicas=3, sim_args=["--num-gpu-blocks", "4096"])
    try:
        st.start()
        yield st
    finally:
        st.stop()


def test_a_concurrency_cap_and_a_token_budget_hold_across_three_replicas(stack: Stack) -> None:
    st = stack
    # every replica has joined the store before the flood
    wait_for(lambda: all(metric(u, "kvgate_store_replicas") == 3 for u in st.metrics_urls), 15,
             "three replicas in the store")
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda _: stream(st, CAP_KEY, 250), range(40)))
    codes = [c for c, _ in results]
    assert node_metric(st, "sim_open_requests_peak") == 4, "exactly the cap in flight at the node at its peak"
    assert codes.count(200) >= 4 and set(codes) <= {200, 429}
    assert all(h.get("retry-after") for c, h in results if c == 429)
    # several replicas decided (Envoy spreads the streams), and their shared cap was the tenant's whole cap
    decided = [metric(u, "kvgate_requests_total", tenant="cap") for u in st.metrics_urls]
    assert sum(1 for d in decided if d > 0) >= 2, decided

    # a token budget: what the tenant gets, across replicas, stays within its bucket plus at most one
    # reservation per replica
    spent = 0
    admitted = 0
    reservation = 0.0
    for _ in range(60):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "y" * 200}], "max_tokens": 60,
                "ignore_eos": True}
        code, _, raw = post(st.url + "/v1/chat/completions", body, TOK_KEY)
        assert code in (200, 429)
        if code == 200:
            admitted += 1
            spent += json.loads(raw)["usage"]["total_tokens"]
    reserved = sum(metric(u, "kvgate_tokens_total", tenant="tok", kind="reserved") for u in st.metrics_urls)
    reservation = reserved / max(1, admitted)
    assert admitted > 0
    assert spent <= TOK_BURST + 3 * reservation, f"{spent} tokens spent of a {TOK_BURST} budget"

    # a reload reaches every replica (they watch one file), and each says which config it runs
    versions = {config_version(u) for u in st.metrics_urls}
    assert len(versions) == 1
    new = config()
    new["tenants"][0]["max_concurrent"] = 5
    st.write_config(new)
    wait_for(lambda: {config_version(u) for u in st.metrics_urls} - versions and
             len({config_version(u) for u in st.metrics_urls}) == 1, 20, "every replica on the new config")


def config_version(url: str) -> str:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "kvgate_config_info" and sample.value == 1:
                return sample.labels["version"]
    return ""


def test_a_killed_replica_a_killed_redis_and_an_empty_redis_lose_no_request_and_keep_the_cap(
        stack: Stack) -> None:
    st = stack
    wait_for(lambda: all(metric(u, "kvgate_store_replicas") == 3 for u in st.metrics_urls), 15,
             "three replicas in the store")
    stop = threading.Event()
    codes: list[int] = []
    errors: list[str] = []

    def load() -> None:
        while not stop.is_set():
            try:
                codes.append(stream(st, CAP_KEY, 60)[0])
            except Exception as e:  # a request that ends without a status
                errors.append(f"{type(e).__name__}: {e}")
            time.sleep(0.02)

    threads = [threading.Thread(target=load) for _ in range(10)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        st.stop_process("kvgate1", signal.SIGKILL)
        time.sleep(2)
        st.stop_redis(signal.SIGKILL)
        live = [u for i, u in enumerate(st.metrics_urls) if i != 1]
        wait_for(lambda: all(metric(u, "kvgate_store_fallback") == 1 for u in live), 10, "the local split")
        time.sleep(1)
        st.start_redis()  # empty
        wait_for(lambda: all(metric(u, "kvgate_store_up") == 1 and metric(u, "kvgate_store_fallback") == 0
                             for u in live), 10, "rejoined")
        before = len(codes)
        wait_for(lambda: 200 in codes[before:], 30, "the tenant served again once Redis is back")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    assert set(codes) <= {200, 429, 503}, set(codes)
    assert node_metric(st, "sim_open_requests_peak") <= 4, "the cap held through every fault"


IN_KEY, FLOOD_KEY = "sk-rep-in", "sk-rep-flood"


def in_quota_config() -> dict[str, Any]:
    return {
        "tenants": [
            {"name": "in", "api_key_sha256": [hash_key(IN_KEY)], "tokens_per_minute": 10_000_000},
            {"name": "flood", "api_key_sha256": [hash_key(FLOOD_KEY)], "tokens_per_minute": 600,
             "token_burst": 300},
        ],
        "queue": {"enabled": False},
    }


def in_quota_codes(st: Stack) -> list[int]:
    """40 requests of a tenant far inside its budget (about 45 tokens each, a few per second), each
    after three of a tenant that floods its own small budget: the in-quota tenant's status codes."""
    codes = []
    for i in range(40):
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda _: post(st.url + "/v1/chat/completions",
                                         {"model": "standin-8b", "messages": [{"role": "user", "content": "f" * 200}],
                                          "max_tokens": 60}, FLOOD_KEY), range(3)))
        code, _, _ = post(st.url + "/v1/chat/completions",
                          {"model": "standin-8b", "messages": [{"role": "user", "content": f"hello {i} " * 4}],
                           "max_tokens": 20}, IN_KEY)
        codes.append(code)
        time.sleep(0.25)  # a few of the replicas' 100 ms syncs between two requests
    return codes


def test_in_quota_traffic_gets_the_same_decisions_through_one_and_three_replicas(tmp_path: Path) -> None:
    """Issue 29 bug 1: beside a flooding tenant, 6 of 40 requests of a tenant inside its budget got
    429 tenant-tokens through 3 replicas and none through one. A 429 means over quota fleet-wide: the
    same traffic gets the same answers, all 200, with one replica or three."""
    RedisServer(tmp_path)  # skips without redis-server
    answers = {}
    for n in (1, 3):
        st = Stack(tmp_path / f"r{n}", in_quota_config(), replicas=n)
        try:
            st.start()
            if n > 1:
                wait_for(lambda st=st: all(metric(u, "kvgate_store_replicas") == 3 for u in st.metrics_urls), 15,
                         "three replicas in the store")
            answers[n] = in_quota_codes(st)
        finally:
            st.stop()
    assert answers[1] == answers[3] == [200] * 40, answers


def test_an_envoy_killed_gives_back_its_requests_at_every_replica(stack: Stack) -> None:
    """Issue 29: Envoy SIGKILLed with 3 replicas gave back only the slots of the replica holding its
    access-log connection (2 of 6 within 20 s); the others held theirs for ``lease_timeout_seconds``.
    That replica now tells the others through the store, and every one releases what Envoy carried."""
    st = stack
    wait_for(lambda: all(metric(u, "kvgate_store_replicas") == 3 for u in st.metrics_urls), 15,
             "three replicas in the store")

    def held() -> float:
        return sum(metric(u, "kvgate_inflight_requests", tenant="cap") for u in st.metrics_urls)

    def open_one() -> None:
        try:
            stream(st, CAP_KEY, 5000)  # long: still running when Envoy dies
        except Exception:  # Envoy is killed under it
            return

    assert stream(st, CAP_KEY, 5)[0] == 200  # one short request first: Envoy opens its access-log stream
    threads = [threading.Thread(target=open_one, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # spread over the replicas by Envoy's round robin
    wait_for(lambda: held() == 4, 20, "the cap in flight")
    st.stop_process("envoy", signal.SIGKILL)
    wait_for(lambda: held() == 0, 20, "every replica released what the killed Envoy carried")



@pytest.mark.xfail(strict=True, reason="issue 29, open: a replica whose completions reach another replica "
                   "cannot learn them while Redis is away (10 of 16 refused before and after the split's "
                   "slot take-over, which helps only the replica receiving them)")
def test_a_tenant_far_under_its_cap_is_served_while_redis_is_away(stack: Stack) -> None:
    """Issue 29: during a Redis outage a tenant with one request open at a time (cap 4) was refused on
    5 to 11 of 16 requests: the completions of one replica's requests reach the replica holding Envoy's
    access-log connection and wait there for Redis, so the first replica's split fills with requests
    that have ended."""
    st = stack
    wait_for(lambda: all(metric(u, "kvgate_store_replicas") == 3 for u in st.metrics_urls), 15,
             "three replicas in the store")
    assert stream(st, CAP_KEY, 5)[0] == 200  # Envoy opens its access-log stream
    st.stop_redis(signal.SIGKILL)
    wait_for(lambda: all(metric(u, "kvgate_store_fallback") == 1 for u in st.metrics_urls), 10, "the local split")
    codes = []
    for _ in range(16):
        codes.append(stream(st, CAP_KEY, 5)[0])
        time.sleep(0.3)  # its access-log entry arrives
    assert codes.count(200) == 16, codes
