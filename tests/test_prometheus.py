"""The Prometheus path against a real Prometheus (Debian's) scraping a real kvgate behind Envoy.

The scaler's Prometheus source, the docs' KEDA trigger query (Autoscaling), the shipped recording/alert rules
(promtool) and every query of the Grafana dashboard run there and return data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack, free_port, wait_port
from scaler.signals import TRIGGER_QUERY, TRIGGER_QUERY_BY_POOL, PrometheusSource
from tests.helpers import chat, post, wait_for

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "helm" / "kvgate" / "files" / "prometheus-rules.yaml"
DASHBOARD = ROOT / "helm" / "kvgate" / "files" / "dashboard.json"
KEYS = {"app": "sk-p-app", "quota": "sk-p-quota"}

if shutil.which("prometheus") is None or shutil.which("promtool") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must have Debian's prometheus package (the Makefile installs it as root)")
    pytest.skip("prometheus/promtool not installed (apt-get install prometheus)", allow_module_level=True)


def test_the_shipped_rules_pass_promtool_and_record_the_trigger_query() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    # the recorded signal is the documented trigger, one series per pool (tests/test_scaler_pools_e2e.py
    # checks it against trigger_query(pool) on two pools)
    assert rules[0] == {"record": "kvgate:capacity_reject_ratio:rate2m", "expr": TRIGGER_QUERY_BY_POOL}
    # the alerts that aggregate keep the pool apart
    by = {x["alert"]: x["expr"] for x in rules[1:]}
    assert "by (tenant, pool)" in by["KvgateTenantOverQuota"] and "by (pool, node)" in by["KvgateBreakerOpen"]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    tmp = tmp_path_factory.mktemp("prom")
    cfg = {"fleet": {"max_inflight": 1},
           "tiers": {"standard": {"priority": 1, "max_queue_wait_ms": 300}},
           "tenants": [{"name": "app", "api_key_sha256": [hash_key(KEYS["app"])]},
                       {"name": "quota", "api_key_sha256": [hash_key(KEYS["quota"])], "requests_per_minute": 2,
                        "request_burst": 1}]}
    st = Stack(tmp / "stack", cfg, sim_args=["--num-gpu-blocks", "400", "--served-model-name", "standin-8b"],
               nodes=True)
    st.start()
    port = free_port()
    metrics = st.metrics_url.removeprefix("http://").removesuffix("/metrics")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvgate", "static_configs": [{"targets": [metrics]}]}]}))
    check = subprocess.run(["promtool", "check", "config", str(tmp / "prometheus.yml")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc=proc)
        # Prometheus answers 503 until its storage is ready, and scrapes only after its first
        # target-discovery sync (up to ~5 s)
        prom = PrometheusSource(f"http://127.0.0.1:{port}")

        def scraped_once() -> bool:
            try:
                return bool(prom.query('up{job="kvgate"} == 1'))
            except OSError:  # urllib's HTTPError (503 while starting) is one
                return False

        wait_for(scraped_once, timeout=30, what="the first scrape")
        # traffic over a few scrapes: admits, quota 429s, and 503s while one slot is held
        for _ in range(3):
            hog = threading.Thread(target=post, args=(st.url + "/v1/chat/completions",
                                                      {**chat("hog", max_tokens=120), "ignore_eos": True},
                                                      KEYS["app"]))
            hog.start()
            time.sleep(0.2)
            for _ in range(4):
                post(st.url + "/v1/chat/completions", chat("x", max_tokens=2), KEYS["app"])
                post(st.url + "/v1/chat/completions", chat("q", max_tokens=2), KEYS["quota"])
            hog.join()
            time.sleep(1.0)
        yield st, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        st.stop()


def test_the_scalers_prometheus_source_reads_kvgates_signals(scraped: tuple[Stack, str]) -> None:
    _, url = scraped
    src = PrometheusSource(url, window_s=60)

    def ready() -> bool:
        s = src.read(time.monotonic())
        return s.capacity_rejected.get("app", 0) > 0 and s.policy_rejected.get("quota", 0) > 0

    wait_for(ready, timeout=30, what="increase() over the scraped counters")
    s = src.read(time.monotonic())
    assert s.complete and s.replicas == 1  # one node, as kvgate_nodes_total says
    assert s.admitted.get("app", 0) > 0 and s.reject_rate is not None and 0 < s.reject_rate < 1
    pools = src.read_pools(time.monotonic())  # a kvgate without pools: its one pool, "default"
    assert set(pools) == {"default"} and pools.shared and pools["default"].replicas == 1
    assert pools.of("vllm").capacity_rejected.get("app", 0) > 0  # every scaler pool reads it


def test_one_reading_asks_every_query_at_the_last_whole_scrape(scraped: tuple[Stack, str]) -> None:
    """A ratio's two increase() asked each at its own now could straddle a scrape Prometheus was still
    writing (a 40% ratio read as 35%): one reading asks them all at the targets' last scrape."""
    _, url = scraped
    asked: list[tuple[str, float | None]] = []

    class Seen(PrometheusSource):
        def query(self, q: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
            asked.append((q, at))
            return super().query(q, at)

    Seen(url).read_pools(time.monotonic())
    (first_q, first_at), rest = asked[0], asked[1:]
    assert first_q == 'min(timestamp(up{job="kvgate"}))' and first_at is None
    instants = {at for _, at in rest}
    assert len(rest) >= 8 and len(instants) == 1 and None not in instants, asked
    (at,) = instants
    src = PrometheusSource(url)
    assert [v for _, v in src.query('timestamp(up{job="kvgate"})', at)] == [at]  # its one target's last scrape
    assert src.query("vector(time())", at - 30) == [({}, pytest.approx(at - 30, abs=1e-3))]  # honoured


def test_the_trigger_query_and_the_recorded_series_give_the_same_ratio(scraped: tuple[Stack, str]) -> None:
    _, url = scraped
    src = PrometheusSource(url)
    wait_for(lambda: bool(src.query("kvgate:capacity_reject_ratio:rate2m")), timeout=30, what="recording rule")
    (row,) = src.query(TRIGGER_QUERY)
    assert 0 < row[1] < 1
    (rec,) = src.query("kvgate:capacity_reject_ratio:rate2m")
    assert abs(rec[1] - row[1]) < 0.25  # the same signal (evaluated a moment apart)


def test_every_dashboard_query_runs_and_the_kvgate_ones_return_data(scraped: tuple[Stack, str]) -> None:
    _, url = scraped
    src = PrometheusSource(url)
    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            q = t["expr"].replace("$__rate_interval", "1m").replace("$pool", ".*")  # "All"
            rows = src.query(q)  # raises on a PromQL error
            if not rows:
                empty.append(panel["title"])
    # the scaler is not scraped here, no breaker or latency quantile needs data to be a valid query, and
    # this kvgate runs alone, without a shared store, and its tenants have no spend budgets
    assert set(empty) <= {"Scaler: desired replicas by pool", "Queue wait p99 by pool and tier",
                          "Replicas: shared store (up, local split, borrows/s)",
                          "Spend by tenant and model (money per hour, at the configured prices)",
                          "Spend budgets: share of each window spent"}, empty
    assert "Replicas: config version each runs" not in empty


def _promtool_reads(tmp_path: Path, kind: str, inputs: list[dict[str, str]], expected: float) -> None:
    """promtool evaluates the scaler's ``QUERIES[kind]`` over a 1-minute window of ``inputs`` (series sampled
    every 15 s, five values each), recorded as ``kvgate:<kind>``, and must read ``expected`` for pool p."""
    from scaler.signals import QUERIES

    record = f"kvgate:{kind}"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": record, "expr": QUERIES[kind].replace("%s", "1m")}]}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": inputs, "promql_expr_test": [
            {"expr": record, "eval_time": "1m",
             "exp_samples": [{"labels": f'{record}{{pool="p"}}', "value": expected}]}]}]}))
    r = subprocess.run(["promtool", "test", "rules", "test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_waited_query_counts_what_the_scrape_path_counts(tmp_path: Path) -> None:
    """review14: the scaler's waited gate reads ``kvgate_queue_waited_for_room_total`` two ways —
    ``parse_kvgate`` (DirectSource) and ``QUERIES["waited"]`` (PrometheusSource) — and both must count the
    same. promtool evaluates the query over kvgate's real series: two kvgate replicas, two tiers, the
    queue-wait histogram (which the gate no longer reads) beside."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ext_proc.stats import Stats
    from scaler.signals import parse_kvgate

    replicas = [Stats(), Stats()]

    def observe(scale: int) -> None:
        for k, st in enumerate(replicas):
            for tier, waits in (("batch", [0.0, 0.004, 0.2]), ("standard", [0.005, 0.03])):
                for w in waits * (scale + k):
                    st.queue_wait.labels(tier, "admitted", "p").observe(w)
                    if w > 0.01:  # (those a node choice refused while they waited, say)
                        st.queue_waited_for_room.labels(tier, "p").inc()
                st.queue_wait.labels(tier, "rejected", "p").observe(1.0)
            st.requests.inc(("t", "batch", "admit", "ok", "none", "p"))  # (a kvgate page for parse_kvgate)

    observe(1)
    before = [generate_latest(st.registry).decode() for st in replicas]
    observe(3)
    after = [generate_latest(st.registry).decode() for st in replicas]
    expected = sum(parse_kvgate(a).totals[("waited", "")] - parse_kvgate(b).totals[("waited", "")]
                   for a, b in zip(after, before, strict=True))
    assert expected == 2 * (3 + 4)  # the 0.2 s and 0.03 s waits of the second round (3 and 4 of each)

    def series(text: str, instance: str) -> dict[str, float]:
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "kvgate_queue_waited_for_room_total":
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted({**s.labels, "instance": instance}.items()))
                    out[f"{s.name}{{{labels}}}"] = s.value
        return out

    inputs = []
    for k, (b, a) in enumerate(zip(before, after, strict=True)):
        old, new = series(b, f"r{k}"), series(a, f"r{k}")
        assert set(old) == set(new)
        inputs += [{"series": name, "values": f"{old[name]:g} {new[name]:g} {new[name]:g} {new[name]:g} {new[name]:g}"}
                   for name in old]
    _promtool_reads(tmp_path, "waited", inputs, expected)


def test_the_prefill_query_counts_what_the_scrape_path_counts(tmp_path: Path) -> None:
    """The scale-down bound on prefill reads ``kvgate_prefill_seconds_total`` two ways — ``parse_kvgate``
    (DirectSource, differenced per replica) and ``QUERIES["prefill"]`` (PrometheusSource, evaluated here by
    promtool over two replicas' real series) — and both count the window's increase per pool."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ext_proc.stats import Stats
    from scaler.signals import parse_kvgate

    replicas = [Stats(), Stats()]
    for k, st in enumerate(replicas):
        st.requests.inc(("t", "batch", "admit", "ok", "none", "p"))  # (a kvgate page for parse_kvgate)
        st.prefill_seconds.labels("p").inc(1.5 + k)
    before = [generate_latest(st.registry).decode() for st in replicas]
    for k, st in enumerate(replicas):
        st.prefill_seconds.labels("p").inc(4.0 * (k + 1))
    after = [generate_latest(st.registry).decode() for st in replicas]
    def read(text: str) -> float:
        return parse_kvgate(text).pools["p"].totals[("prefill", "")]

    expected = sum(read(a) - read(b) for a, b in zip(after, before, strict=True))
    assert expected == pytest.approx(12.0)

    def value(text: str) -> float:
        return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                    if s.name == "kvgate_prefill_seconds_total")

    inputs = [{"series": f'kvgate_prefill_seconds_total{{instance="r{k}",pool="p"}}',
               "values": f"{value(b):g} {value(a):g} {value(a):g} {value(a):g} {value(a):g}"}
              for k, (b, a) in enumerate(zip(before, after, strict=True))]
    _promtool_reads(tmp_path, "prefill", inputs, expected)


def test_an_older_kvgate_without_the_waited_counter_is_read_as_before(tmp_path: Path) -> None:
    """review15: a scaler upgraded before kvgate finds no ``kvgate_queue_waited_for_room_total``; it reads
    every admitted release from the queue (``kvgate_queue_wait_seconds_count{outcome="admitted"}``, what
    the gate read before) rather than none — the scale-down gate would silently open. Both paths: the
    scrape (``parse_kvgate``) and the PromQL (``or``, evaluated by promtool)."""
    from prometheus_client import generate_latest

    from ext_proc.stats import Stats
    from scaler.signals import parse_kvgate

    st = Stats()
    st.requests.inc(("t", "batch", "admit", "ok", "none", "p"))
    for w in (0.0, 0.3, 2.0):
        st.queue_wait.labels("batch", "admitted", "p").observe(w)
    st.queue_wait.labels("batch", "rejected", "p").observe(1.0)
    old = "\n".join(line for line in generate_latest(st.registry).decode().splitlines()
                    if "waited_for_room" not in line) + "\n"
    assert parse_kvgate(old).pools["p"].totals[("waited", "")] == 3
    st.queue_waited_for_room.labels("batch", "p").inc()  # a kvgate with the counter: the counter alone
    assert parse_kvgate(generate_latest(st.registry).decode()).pools["p"].totals[("waited", "")] == 1

    name = 'kvgate_queue_wait_seconds_count{instance="r0",outcome="admitted",pool="p",tier="batch"}'
    _promtool_reads(tmp_path, "waited", [{"series": name, "values": "0 3 6 9 12"}], 12)


def test_the_waited_query_reads_each_replica_by_its_own_version(tmp_path: Path) -> None:
    """review16: during a rolling upgrade one pool's kvgate replicas are of both versions. ``A or B`` taken
    per pool kept the counter's sum and dropped the older replicas' admitted releases altogether (their
    pool label matches): two replicas, the new one 4 waits, the old one 12 releases, read as 4 — the
    scale-down gate opened on every old replica's queue for the whole rollout. The fallback is per replica
    (instance), as parse_kvgate's is per page: 16. A replica with both reads its counter only."""

    old = 'kvgate_queue_wait_seconds_count{instance="r0",outcome="admitted",pool="p",tier="batch"}'
    new_waits = 'kvgate_queue_wait_seconds_count{instance="r1",outcome="admitted",pool="p",tier="batch"}'
    new_room = 'kvgate_queue_waited_for_room_total{instance="r1",pool="p",tier="batch"}'
    _promtool_reads(tmp_path, "waited", [{"series": old, "values": "0 3 6 9 12"},
                                         {"series": new_waits, "values": "0 10 20 30 40"},
                                         {"series": new_room, "values": "0 1 2 3 4"}], 16)
