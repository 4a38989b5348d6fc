"""The user-facing commands run end to end (figures are printed, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ext_proc.identity import hash_key


def kvgate(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_overhead_reports_both_paths() -> None:
    r = kvgate("bench", "overhead", "--seconds", "2", "--connections", "8", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for path in ("plain_envoy", "envoy_kvgate"):
        assert doc[path]["rps"] > 0 and doc[path]["errors"] == 0 and doc[path]["p99_ms"] >= doc[path]["p50_ms"]
    assert doc["envoy_kvgate"]["kvgate_cpu_us_per_request"] > 0
    assert 0 < doc["ratio_rps"] < 5
    # side by side: the transport floor, where kvgate's CPU goes (measured), the latency at half its maximum
    floor = doc["transport_floor"]
    assert floor["rps"] > 0 and floor["errors"] == 0 and floor["kvgate_cpu_us_per_request"] > 0
    parts = doc["cpu_breakdown_us_per_request"]
    assert set(parts) >= {"core", "metrics", "logging", "protobuf", "shell", "transport", "total",
                          "transport_floor"}
    assert parts["core"] > 0 and parts["protobuf"] > 0 and parts["metrics"] > 0
    assert sum(parts[p] for p in ("core", "metrics", "logging", "protobuf", "shell", "transport")) == \
        pytest.approx(parts["total"])
    half = doc["half_rate"]
    assert half["rate"] == pytest.approx(doc["envoy_kvgate"]["rps"] / 2)
    for path in ("plain_envoy", "envoy_kvgate"):
        assert half[path]["errors"] == 0 and 0 < half[path]["rps"] <= doc[path]["rps"] * 1.5
    assert half["added_p50_ms"] == pytest.approx(half["envoy_kvgate"]["p50_ms"] - half["plain_envoy"]["p50_ms"])


def test_hash_key_and_check_config(tmp_path: Path) -> None:
    r = kvgate("hash-key", "sk-abc")
    assert r.stdout.strip() == hash_key("sk-abc")
    good = tmp_path / "good.yaml"
    good.write_text(f"tenants:\n  - name: a\n    api_key_sha256: [{hash_key('sk-abc')}]\n")
    assert kvgate("check-config", str(good)).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: a\n    tokens_per_minute: lots\n")
    r = kvgate("check-config", str(bad))
    assert r.returncode == 2
    assert "tenants[0].tokens_per_minute" in r.stderr and "Traceback" not in r.stderr


def test_bench_nodes_reports_every_fleet_size() -> None:
    r = kvgate("bench", "nodes", "--sizes", "8", "100", "--ops", "200", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["nodes"] for row in rows] == [8, 100]
    # the predictions are a part of the whole choice, and both were measured
    assert all(row["predict_us"] > 0 and row["place_us"] > 0 for row in rows)


def test_bench_intake_refuses_every_hostile_kind_and_reports_the_victim_beside_it() -> None:
    r = kvgate("bench", "intake", "--reps", "1", "--seconds", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    answers = {row["kind"]: row["answer"] for row in out["kinds"]}
    assert answers["tools: [{}] * n"] == "400 body-too-complex"
    assert answers["BOM + n=16, stream"] == "400 invalid-json"
    assert answers["tools: [{}] * n, tenant over quota"] == "429 tenant-concurrency"
    assert all(v == "admitted" for k, v in answers.items() if k.startswith(("legit", "at the caps", "at the budget")))
    assert sum(k.startswith("at the budget") for k in answers) == 6
    assert answers["two caps: 16k lists of ids, 32k distinct keys"] == "400 body-too-complex"
    # past the cost budget, not any single cap
    assert answers["4 MB of escaped quotes, 70 messages"] == "400 body-too-complex"
    assert answers["4,096 ids beside a 3 MB string of escapes"] == "400 body-too-complex"
    v = out["victim"]
    assert v["alone"]["victim_decisions"] == v["beside_hostile"]["victim_decisions"] > 0
    assert v["beside_hostile"]["hostile_answers"]["tenant-requests"] > 0  # most never reached the parser


def test_bench_queue_reports_every_size() -> None:
    r = kvgate("bench", "queue", "--sizes", "0", "200", "2000", "--ops", "300", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["queued"] for row in rows] == [0, 200, 2000]
    assert all(row["enqueue_us"] > 0 and row["pump_us"] > 0 for row in rows)
    assert rows[1]["release_us"] > 0  # the release loop ran (it asserts one release per freed slot)
