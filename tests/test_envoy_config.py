"""Every Envoy config kvgate ships or renders is accepted by the real Envoy."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.envoy_config import ENVOY_DIR, EnvoyParams, bootstrap, dump, shipped
from kvgate.stack import envoy_binary


def validate(path: Path) -> None:
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_shipped_files_are_current() -> None:
    for path, text in shipped().items():
        assert path.read_text() == text, f"{path} is stale: run `kvgate envoy-config --write`"


def test_shipped_bootstrap_validates() -> None:
    validate(ENVOY_DIR / "bootstrap.yaml")


@pytest.mark.parametrize("params", [
    EnvoyParams(fail_open=True),
    EnvoyParams(trusted_header="x-auth-tenant", extproc_host="kvgate.kvgate.svc",
                upstreams=[("127.0.0.1", 8000), ("127.0.0.1", 8001)]),
])
def test_rendered_variants_validate(tmp_path: Path, params: EnvoyParams) -> None:
    p = tmp_path / "envoy.yaml"
    p.write_text(dump(bootstrap(params)))
    validate(p)


def merged_into_a_foreign_envoy(snip: dict[str, Any]) -> dict[str, Any]:
    """Someone else's plain Envoy (one listener, one route, a router) with kvgate's pieces merged in."""
    doc = bootstrap(EnvoyParams(), kvgate=False)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = snip["http_filters_before_router"] + hcm["http_filters"]
    hcm["access_log"] = snip["access_log"]
    hcm["local_reply_config"] = snip["local_reply_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][1]["typed_per_filter_config"] = snip[
        "typed_per_filter_config_for_bodyless_routes"]
    doc["static_resources"]["clusters"] += snip["clusters"]
    return doc


def test_snippet_merged_into_an_existing_envoy_validates(tmp_path: Path) -> None:
    snip: dict[str, Any] = yaml.safe_load((ENVOY_DIR / "ext_proc-filter.yaml").read_text())
    p = tmp_path / "merged.yaml"
    p.write_text(yaml.safe_dump(merged_into_a_foreign_envoy(snip)))
    validate(p)


def test_lua_fail_open_switch_is_rendered() -> None:
    closed = yaml.safe_load(dump(bootstrap(EnvoyParams())))
    opened = yaml.safe_load(dump(bootstrap(EnvoyParams(fail_open=True))))

    def lua(d: dict[str, Any]) -> str:
        hcm = d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return str(hcm["http_filters"][1]["typed_config"]["default_source_code"]["inline_string"])

    assert "local FAIL_OPEN = false" in lua(closed)
    assert "local FAIL_OPEN = true" in lua(opened)
