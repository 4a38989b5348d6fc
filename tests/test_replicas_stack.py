"""Several kvgate replicas behind one Envoy (``Stack(replicas=N)``, ``kvgate up --replicas N``): every
replica is an endpoint of Envoy's ext_proc cluster, they share one config file and a local redis-server,
and one of them dying does not take requests down. Real processes throughout; no timing thresholds,
only polling with generous timeouts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvgate.dev.stack import Stack, free_port

from .conftest import KEYS, tenants
from .helpers import chat, metric, post, wait_for

CHAT = "/v1/chat/completions"
NO_REDIS = "redis-server is not installed (apt-get install redis-server; make test installs it)"


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(NO_REDIS)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Stack]:
    _need_redis()
    st = Stack(tmp_path, {"tenants": tenants()}, token_ms=2.0, replicas=2)
    try:
        yield st.start()
    finally:
        st.stop()


def admits(url: str) -> float:
    return metric(url, "kvgate_requests_total", tenant="open", decision="admit")


def all_ok(st: Stack, n: int = 5) -> bool:
    return all(post(st.url + CHAT, chat(), KEYS["open"])[0] == 200 for _ in range(n))


def test_two_replicas_share_the_traffic_and_a_killed_one_is_routed_around(two: Stack) -> None:
    st = two
    assert st.replica_names == ["kvgate0", "kvgate1"] and len(set(st.extproc_ports)) == 2
    assert st.extproc_health() == {p: "healthy" for p in st.extproc_ports}
    doc = yaml.safe_load(st.config_path.read_text())  # the one file both replicas read
    assert doc["store"]["redis"]["url"] == st.redis_url
    for _ in range(10):
        assert post(st.url + CHAT, chat(), KEYS["open"])[0] == 200
    per_replica = [admits(u) for u in st.metrics_urls]
    assert sum(per_replica) == 10 and all(n > 0 for n in per_replica), per_replica  # round robin over both

    assert st.stop_process("kvgate1", signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: all_ok(st), timeout=30, what="requests succeeding through the surviving replica")
    dead = st.extproc_ports[1]
    wait_for(lambda: st.extproc_health().get(dead) != "healthy", timeout=30, what="Envoy taking kvgate1 out")
    assert all_ok(st, 10)
    assert st.extproc_health()[st.extproc_ports[0]] == "healthy"

    st.start_replica(1)  # same ports, same config file
    st.wait_ready(timeout=30)
    wait_for(lambda: all_ok(st, 2) and admits(st.metrics_urls[1]) > 0, timeout=30,
             what="the restarted replica deciding again")


def test_redis_restart_reuses_its_port_empty(two: Stack) -> None:
    import redis

    st = two
    port = st.redis_port
    r = redis.Redis(port=port)
    r.set("kvgate-test-marker", "1")
    st.stop_redis(signal.SIGKILL)
    st.start_redis()
    assert st.redis_port == port
    r = redis.Redis(port=port)
    assert r.get("kvgate-test-marker") is None  # nothing saved, nothing loaded
    r.close()
    wait_for(lambda: all_ok(st), timeout=30, what="requests succeeding once Redis is back")


def kvgate(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def test_up_with_replicas_and_no_redis_server_is_a_one_line_error(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path))  # no redis-server on it
    r = kvgate("up", "--replicas", "2", "--standin", "--workdir", str(tmp_path / "run"), env=env)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "apt-get install redis-server" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()  # nothing was started


def test_up_with_two_replicas_prints_the_endpoint_then_each_replicas_metrics(tmp_path: Path) -> None:
    _need_redis()
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "up", "--replicas", "2", "--standin", "--nodes", "1",
                          "--port", str(port), "--workdir", str(tmp_path / "run")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    out = p.stdout
    lines: list[str] = []

    def read() -> None:
        for ln in out:
            lines.append(ln.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_for(lambda: "Ctrl-C stops everything." in lines or p.poll() is not None, timeout=90, what="the banner")
        assert "Ctrl-C stops everything." in lines, "\n".join(lines)
        labels = [ln.split(":", 1)[0].strip() for ln in lines if ln.startswith("  ")]
        assert labels[:3] == ["OpenAI-compatible endpoint", "kvgate0 metrics", "kvgate1 metrics"], lines
        urls = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(("  kvgate0 ", "  kvgate1 "))]
        assert next(ln for ln in lines if "OpenAI-compatible endpoint" in ln).endswith(f"http://127.0.0.1:{port}/v1")
        assert len(set(urls)) == 2 and all(u.endswith("/metrics") for u in urls)
        code, _, body = post(f"http://127.0.0.1:{port}{CHAT}", chat(), "sk-demo-chatbot")
        assert code == 200, body
        assert sum(metric(u, "kvgate_requests_total", tenant="chatbot", decision="admit") for u in urls) == 1
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert p.returncode == 0


def test_bench_overhead_with_replicas_adds_store_and_replica_figures() -> None:
    _need_redis()
    r = kvgate("bench", "overhead", "--replicas", "2", "--seconds", "1", "--connections", "4", "--json",
               "--no-breakdown",
               timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    for path in ("plain_envoy", "envoy_kvgate"):  # the single-replica figures are all still there
        assert doc[path]["rps"] > 0 and doc[path]["errors"] == 0
    assert doc["envoy_kvgate"]["kvgate_cpu_us_per_request"] > 0 and doc["ratio_rps"] > 0
    store, reps = doc["store"], doc["replicas"]
    assert store["memory"]["kvgate_cpu_us_per_request"] == doc["envoy_kvgate"]["kvgate_cpu_us_per_request"]
    assert store["redis"]["kvgate_cpu_us_per_request"] > 0 and store["redis"]["redis_cpu_us_per_request"] >= 0
    assert store["redis"]["replicas"] == 1 and reps["one"] == store["redis"]
    assert reps["n"] == 2 and reps["many"]["replicas"] == 2 and reps["many"]["rps"] > 0 and reps["ratio_rps"] > 0


def test_the_config_of_n_replicas_expects_n_replicas_while_redis_is_away(tmp_path: Path) -> None:
    """Issue 29 bug 2: ``kvgate up --replicas 3`` wrote ``expected_replicas`` 1, so a replica that never
    reached Redis enforced the whole cap (cap 4 -> 12 admitted). A config naming its own store keeps its
    own figure."""
    st = Stack(tmp_path / "a", {"tenants": tenants()}, replicas=3)
    st.write_config()
    assert yaml.safe_load(st.config_path.read_text())["store"]["redis"]["expected_replicas"] == 3
    own = {"tenants": tenants(), "store": {"redis": {"url": "redis://127.0.0.1:1/0", "expected_replicas": 5}}}
    st = Stack(tmp_path / "b", own, replicas=2)
    st.write_config()
    assert yaml.safe_load(st.config_path.read_text())["store"]["redis"]["expected_replicas"] == 5
