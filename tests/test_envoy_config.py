"""Every Envoy config kvgate ships or renders is accepted by the real Envoy."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ext_proc.config import parse_config
from ext_proc.reasons import REASONS
from ext_proc.sizes import ENVOY_MIN_BODY_BUFFER_BYTES, MAX_REQUEST_HEADERS_KB, grpc_receive_bytes
from kvgate.dev.stack import envoy_binary
from kvgate.envoy_config import ENVOY_DIR, EnvoyParams, bootstrap, dump, params_for, shipped, snippet


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
    EnvoyParams(listen_address="::", extproc_host="::1", upstreams=[("::1", 8000)]),
    EnvoyParams(listen_address="::1", extproc_host="[fd00::5]", original_dst=True),
    EnvoyParams(upstreams=[("vllm.llm.svc", 8000)], inference_paths=("/v1/chat/completions",), bodyless_paths=()),
    EnvoyParams(extproc_ports=(9001, 9002, 9003)),
])
def test_rendered_variants_validate(tmp_path: Path, params: EnvoyParams) -> None:
    p = tmp_path / "envoy.yaml"
    p.write_text(dump(bootstrap(params)))
    validate(p)


def merged_into_a_foreign_envoy(snip: dict[str, Any]) -> dict[str, Any]:
    """Someone else's plain Envoy (one listener, one route, a router) with kvgate's pieces merged in."""
    doc = bootstrap(EnvoyParams(), kvgate=False)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = snip["http_filters_first"] + snip["http_filters_before_router"] + hcm["http_filters"]
    hcm.update(snip["http_connection_manager"])
    hcm["access_log"] = snip["access_log"]
    hcm["local_reply_config"] = snip["local_reply_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = snip["routes"]
    doc["static_resources"]["clusters"][0]["circuit_breakers"] = snip["circuit_breakers_for_the_upstream_cluster"]
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
        (f,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.lua"]
        return str(f["typed_config"]["default_source_code"]["inline_string"])

    assert "local FAIL_OPEN = false" in lua(closed)
    assert "local FAIL_OPEN = true" in lua(opened)


def hcm_of(d: dict[str, Any]) -> dict[str, Any]:
    return d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def test_envoys_limits_are_derived_from_kvgates_config() -> None:
    unlimited = params_for(parse_config({}))
    assert unlimited.max_requests == 100_000
    bounded = params_for(parse_config({"fleet": {"max_inflight": 3000}, "queue": {"max_size": 2000},
                                       "tiers": {"slow": {"priority": 0, "max_queue_wait_ms": 55_000}},
                                       "identity": {"trusted_header": "x-auth-tenant"}}))
    assert bounded.max_requests > 5000  # above what kvgate holds: its limits bind, never Envoy's 1,024
    assert bounded.max_message_timeout_ms >= 55_000 + 1000  # kvgate's override: the wait + 1 s
    assert bounded.request_timeout_ms > bounded.max_message_timeout_ms
    assert bounded.trusted_header == "x-auth-tenant"
    doc = bootstrap(bounded)
    for c in doc["static_resources"]["clusters"]:
        (t,) = c["circuit_breakers"]["thresholds"]
        assert t["max_requests"] == t["max_pending_requests"] == t["max_connections"] == bounded.max_requests
    ext = next(f for f in hcm_of(doc)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext["typed_config"]["max_message_timeout"] == f"{bounded.max_message_timeout_ms / 1000:g}s"


def test_cli_derives_from_a_kvgate_config_and_takes_routes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    import argparse

    from kvgate.cli import _envoy_config

    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(yaml.safe_dump({"fleet": {"max_inflight": 100}, "queue": {"max_size": 50}}))
    ns = argparse.Namespace(write=False, check=False, listen_address="::", listen_port=10000, admin_port=9901,
                            extproc_host="[::1]", extproc_port=9001, upstream=["[::1]:8000"], fail_open=False,
                            trusted_header="x-auth-tenant", original_dst=False, config=str(cfg),
                            route=["/v1/chat/completions", "GET:/v1/models"])
    assert _envoy_config(ns) == 0
    out = capsys.readouterr().out
    doc = yaml.safe_load(out)
    routes = hcm_of(doc)["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == ["inference-buffered:/v1/chat/completions", "inference:/v1/chat/completions",
                                          "bodyless:/v1/models", "not-found"]
    assert doc["static_resources"]["clusters"][0]["circuit_breakers"]["thresholds"][0]["max_requests"] == 1324
    assert hcm_of(doc)["http_filters"][0]["name"] == "envoy.filters.http.header_mutation"
    p = tmp_path / "envoy.yaml"
    p.write_text(out)
    validate(p)


def test_the_trusted_header_is_stripped_before_any_other_filter() -> None:
    filters = hcm_of(bootstrap(EnvoyParams(trusted_header="X-Auth-Tenant")))["http_filters"]
    assert filters[0]["name"] == "envoy.filters.http.header_mutation"
    assert filters[0]["typed_config"]["mutations"]["request_mutations"] == [{"remove": "x-auth-tenant"}]
    assert snippet(EnvoyParams(trusted_header="x-t"))["http_filters_first"][0] == filters[0] | {
        "typed_config": {**filters[0]["typed_config"], "mutations": {"request_mutations": [{"remove": "x-t"}]}}}
    assert hcm_of(bootstrap(EnvoyParams()))["http_filters"][0]["name"] == "envoy.filters.http.ext_proc"


def test_local_replies_come_from_the_reasons_table() -> None:
    text = dump(bootstrap(EnvoyParams()))
    for name in ("gateway-unavailable", "upstream-unavailable", "route-not-found", "body-too-large", "missing-body"):
        r = REASONS[name]
        assert r.code in text and name in text, name
    mappers = {m["headers_to_add"][-1]["header"]["value"]: m
               for m in hcm_of(bootstrap(EnvoyParams()))["local_reply_config"]["mappers"]}
    for name, m in mappers.items():
        r = REASONS[name]
        assert m["status_code"] == r.status
        assert m["body_format_override"]["json_format"]["error"] == {
            "message": r.message, "type": r.type, "param": None, "code": r.code}


def test_several_replicas_get_an_endpoint_each_failover_and_one_port_renders_as_before() -> None:
    one = bootstrap(EnvoyParams(extproc_port=9005))
    assert bootstrap(EnvoyParams(extproc_port=1, extproc_ports=(9005,))) == one  # a list of one: unchanged
    many = bootstrap(EnvoyParams(extproc_ports=(9001, 9002)))
    (cluster,) = [c for c in many["static_resources"]["clusters"] if c["name"] == "kvgate_ext_proc"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [9001, 9002]
    assert cluster["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert cluster["health_checks"][0]["no_traffic_interval"] == cluster["health_checks"][0]["interval"]
    hcm = many["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    assert "connect-failure" in ext["typed_config"]["grpc_service"]["retry_policy"]["retry_on"]
    # the access log's long-lived stream is not retried (it would replay entries): it reconnects on its own
    assert "retry_policy" not in hcm["access_log"][0]["typed_config"]["common_config"]["grpc_service"]
    (single,) = [c for c in one["static_resources"]["clusters"] if c["name"] == "kvgate_ext_proc"]
    assert "outlier_detection" not in single and "no_traffic_interval" not in single["health_checks"][0]


def test_the_grpc_limit_covers_envoys_buffer_and_headers() -> None:
    for cap in (1, 200_000, ENVOY_MIN_BODY_BUFFER_BYTES, 16 * 1024 * 1024):
        cfg = parse_config({"limits": {"max_body_bytes": cap}})
        p = params_for(cfg, EnvoyParams())
        listener = bootstrap(p)["static_resources"]["listeners"][0]
        buffered = listener["per_connection_buffer_limit_bytes"]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert buffered >= cap
        assert hcm["max_request_headers_kb"] == MAX_REQUEST_HEADERS_KB
        assert grpc_receive_bytes(cap) > buffered + MAX_REQUEST_HEADERS_KB * 1024
