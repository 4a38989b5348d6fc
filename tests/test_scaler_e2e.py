"""`kvgate scaler` over real gRPC, asked the way KEDA asks, fed by a real kvgate behind Envoy."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack, free_port, wait_port
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.helpers import chat, post, wait_for

KEYS = {"app": "sk-sc-app", "quota": "sk-sc-quota"}
REF = pb.ScaledObjectRef(name="vllm-8b", namespace="llm", scalerMetadata={"pool": "gpu"})
METRIC = "s0-kvgate-desired-replicas-gpu"


def hpa_desired(current: int, value: float, target: float, metric_type: str) -> int:
    """The HPA's arithmetic for an external metric, with its default 10% tolerance."""
    if metric_type == "AverageValue":
        ratio = value / (target * current) if current else math.inf
        return current if abs(ratio - 1) <= 0.1 else math.ceil(value / target)
    ratio = value / target
    return current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)


@contextlib.contextmanager
def scaler_over_kvgate(tmp_path: Path, interval_s: float) -> Iterator[tuple[Stack, pb_grpc.ExternalScalerStub]]:
    """A real kvgate behind Envoy and `kvgate scaler` reading its metrics, asked over real gRPC."""
    cfg = {"fleet": {"max_inflight": 1}, "queue": {"enabled": False}, "tenants": [
        {"name": "app", "api_key_sha256": [hash_key(KEYS["app"])]},
        {"name": "quota", "api_key_sha256": [hash_key(KEYS["quota"])], "requests_per_minute": 2,
         "request_burst": 1}]}
    st = Stack(tmp_path / "stack", cfg, token_ms=10.0)
    st.start()
    port = free_port()
    (tmp_path / "scaler.yaml").write_text(yaml.safe_dump({
        "grpc_address": f"127.0.0.1:{port}", "metrics_address": f"127.0.0.1:{free_port()}",
        "source": {"kvgate": [st.metrics_url]}, "window_seconds": 30, "interval_seconds": interval_s,
        "pools": {"gpu": {"min_replicas": 1, "max_replicas": 6, "step": 2}}}))
    log = open(tmp_path / "scaler.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "scaler", "--config", str(tmp_path / "scaler.yaml")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc=proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield st, pb_grpc.ExternalScalerStub(ch)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        st.stop()


def answers(stub: Any) -> bool:
    """Whether the scaler has its first verdict (before it, KEDA's calls fail with UNAVAILABLE)."""
    try:
        stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName=METRIC))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return False
    return True


@pytest.fixture
def scaled(tmp_path: Path) -> Iterator[tuple[Stack, pb_grpc.ExternalScalerStub]]:
    with scaler_over_kvgate(tmp_path, interval_s=0.2) as (st, stub):
        wait_for(lambda: answers(stub), what="the scaler's first verdict")
        yield st, stub


def desired(stub: Any, spec: Any) -> float:
    r = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="s0-" + spec.metricName))
    (v,) = r.metricValues
    assert v.metricValue == int(v.metricValueFloat)  # KEDA reads either field
    return float(v.metricValueFloat)


def test_keda_sees_capacity_rejections_as_replicas_and_quota_rejections_as_nothing(
        scaled: tuple[Stack, Any]) -> None:
    st, stub = scaled
    (spec,) = stub.GetMetricSpec(REF).metricSpecs
    assert spec.metricName == "kvgate-desired-replicas-gpu"
    assert spec.targetSize == 1 and spec.targetSizeFloat == 1.0
    wait_for(lambda: not stub.IsActive(REF).result, what="inactive without traffic")
    assert desired(stub, spec) == 1  # min_replicas

    # a tenant over its own quota: 429s, which must not buy GPUs
    codes = [post(st.url + "/v1/chat/completions", chat("q", max_tokens=1), KEYS["quota"])[0] for _ in range(15)]
    assert codes.count(429) >= 13
    time.sleep(1.0)
    assert desired(stub, spec) == 1

    # the fleet is full (one slot, held): 503s for everyone else -> scale up by at least a step, sized by
    # the shortfall (10 of 11 requests unmet on 1 replica: far more than a step), within max_replicas
    hog = threading.Thread(target=post, args=(st.url + "/v1/chat/completions", chat("hog", max_tokens=300),
                                              KEYS["app"]))
    hog.start()
    time.sleep(0.3)
    codes = [post(st.url + "/v1/chat/completions", chat("x", max_tokens=1), KEYS["app"])[0] for _ in range(10)]
    assert codes.count(503) >= 8
    wait_for(lambda: desired(stub, spec) >= 3, what="desired replicas >= 3")
    up = desired(stub, spec)
    assert 3 <= up <= 6
    assert hpa_desired(1, up, spec.targetSizeFloat, "AverageValue") == up
    assert stub.IsActive(REF).result
    hog.join()


def test_stream_is_active_pushes_changes_and_stays_open(scaled: tuple[Stack, Any]) -> None:
    st, stub = scaled
    stream = stub.StreamIsActive(REF)
    got: list[bool] = []

    def follow() -> None:
        with contextlib.suppress(grpc.RpcError):  # CANCELLED, when the test ends the stream
            got.extend(m.result for m in stream)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    wait_for(lambda: False in got, what="inactive (no traffic) pushed")
    post(st.url + "/v1/chat/completions", chat("x", max_tokens=1), KEYS["app"])
    wait_for(lambda: True in got[got.index(False):], what="active pushed after the traffic")
    time.sleep(1.0)
    assert t.is_alive()  # the stream stays open, as KEDA expects
    stream.cancel()


def test_an_unknown_pool_is_a_clear_not_found(scaled: tuple[Stack, Any]) -> None:
    _, stub = scaled
    with pytest.raises(grpc.RpcError) as e:
        stub.GetMetricSpec(pb.ScaledObjectRef(name="x", namespace="y", scalerMetadata={"pool": "tpu"}))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "pools: gpu" in (e.value.details() or "")


def test_keda_gets_unavailable_until_the_first_verdict_then_the_replica_count(tmp_path: Path) -> None:
    # a (re)started scaler: its first read of kvgate's counters spans kvgate's whole life, not a window,
    # so it has no verdict until the next read, one interval later. Meanwhile KEDA must get an error
    # (its fallback applies), never a guess such as min_replicas.
    with scaler_over_kvgate(tmp_path, interval_s=3.0) as (_, stub):
        started = time.monotonic()
        for call in (lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName=METRIC)),
                     lambda: stub.IsActive(REF)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no verdict yet" in (e.value.details() or "")
        assert time.monotonic() - started < 2.5, "too slow to catch the scaler before its first verdict"
        wait_for(lambda: answers(stub), timeout=15, what="the scaler's first verdict")
        (v,) = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName=METRIC)).metricValues
        assert v.metricValue == 1  # kvgate picks no nodes here (Envoy does): min_replicas
        assert stub.IsActive(REF).result is False
