"""Envoy configuration for kvgate, generated from one place.

``envoy/bootstrap.yaml`` (a complete local Envoy) and ``envoy/ext_proc-filter.yaml`` (the pieces to
add to an existing Envoy) are rendered from this module and committed; a test checks that they are
current and that Envoy itself accepts them (``envoy --mode validate``). ``kvgate envoy-config``
renders a bootstrap with other ports.

The design, and why:

* inference routes (POST) skip the ext_proc headers message and send one buffered body message
  carrying the attributes kvgate needs — one gRPC round trip per request instead of two;
* other routes (GET /v1/models...) send headers only, so they are authenticated too;
* a Lua filter strips client x-kvgate-* headers, refuses requests kvgate never saw, and copies the
  response's token usage into dynamic metadata (no per-chunk Python work);
* the gRPC access log delivers that metadata to kvgate when each admitted stream ends (normally, on
  upstream error or on client disconnect): that is where slots are released and tokens reconciled;
* ext_proc failures (kvgate down: 500, too slow: 504) and upstream connection failures become
  503 + Retry-After with an OpenAI-shaped body, so clients retry instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"
LUA_PATH = ENVOY_DIR / "kvgate.lua"
EXTPROC_CLUSTER = "kvgate_ext_proc"
UPSTREAM_CLUSTER = "llm_upstream"
HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True)
class EnvoyParams:
    listen_address: str = "0.0.0.0"
    listen_port: int = 10000
    admin_port: int = 9901
    extproc_host: str = "127.0.0.1"
    extproc_port: int = 9001
    upstreams: list[tuple[str, int]] = field(default_factory=lambda: [("127.0.0.1", 8000)])
    fail_open: bool = False
    message_timeout_ms: int = 1000
    max_body_bytes: int = 4 * 1024 * 1024
    trusted_header: str | None = None
    access_log_buffer_bytes: int = 0
    """0: each completion reaches kvgate at once (slots free promptly); more batches entries."""
    original_dst: bool = False
    """True: kvgate picks the node; the upstream cluster sends each request to the host:port kvgate put
    in x-gateway-destination-endpoint (ORIGINAL_DST), as the Gateway API Inference Extension does."""


def _dur(ms: int) -> str:
    return f"{ms / 1000:g}s"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def lua_source(fail_open: bool) -> str:
    src = LUA_PATH.read_text()
    marker = "local FAIL_OPEN = false"
    assert marker in src, "envoy/kvgate.lua lost its FAIL_OPEN line"
    return src.replace(marker, f"local FAIL_OPEN = {'true' if fail_open else 'false'}")


def _json_error(code: str, kind: str) -> dict[str, Any]:
    return {
        "json_format": {"error": {"message": "%LOCAL_REPLY_BODY%", "type": kind, "code": code}},
        "content_type": "application/json",
    }


def _has_key(key: str) -> dict[str, Any]:
    return {"filter": "kvgate", "path": [{"key": key}], "value": {"present_match": True}}


def _status(code: int) -> dict[str, Any]:
    value = {"default_value": code, "runtime_key": "kvgate.na"}
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": value}}}


def _add(header: str, value: str) -> dict[str, Any]:
    return {"header": {"key": header, "value": value}, "append_action": "ADD_IF_ABSENT"}


def ext_proc_filter(p: EnvoyParams) -> dict[str, Any]:
    attrs = ["request.id", "request.path", "request.headers['authorization']"]
    if p.trusted_header:
        attrs.append(f"request.headers['{p.trusted_header}']")
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
            "failure_mode_allow": p.fail_open,
            "processing_mode": {
                "request_header_mode": "SKIP",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            "request_attributes": attrs,
            "message_timeout": _dur(p.message_timeout_ms),
            "max_message_timeout": "60s",
            "metadata_options": {"receiving_namespaces": {"untyped": ["kvgate"]}},
        },
    }


def lua_filter(p: EnvoyParams) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua_source(p.fail_open)},
        },
    }


def headers_only_override() -> dict[str, Any]:
    """Per-route ext_proc override for routes without a body to buffer."""
    return {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "request_body_mode": "NONE",
                    "response_header_mode": "SKIP",
                    "response_body_mode": "NONE",
                }
            },
        }
    }


def access_log() -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {
            "or_filter": {
                "filters": [
                    {
                        "metadata_filter": {
                            "matcher": _has_key("ticket")
                        }
                    },
                    {"response_flag_filter": {"flags": ["DC"]}},
                ]
            }
        },
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "kvgate",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
                "buffer_size_bytes": 0,
                "buffer_flush_interval": "0.05s",
            },
        },
    }


def access_log_for(p: EnvoyParams) -> dict[str, Any]:
    al = access_log()
    al["typed_config"]["common_config"]["buffer_size_bytes"] = p.access_log_buffer_bytes
    return al


def local_reply_config() -> dict[str, Any]:
    unavailable = {
        "status_code": 503,
        "headers_to_add": [_add("retry-after", "1"), _add("retry-after-ms", "1000"),
                           _add("x-kvgate-reject-reason", "gateway-unavailable")],
        "body_format_override": _json_error("gateway_unavailable", "server_error"),
    }
    return {
        "mappers": [
            {  # kvgate unreachable (500) or too slow (504): fail closed, but retryable
                "filter": {
                    "or_filter": {
                        "filters": [
                            _status(500),
                            _status(504),
                        ]
                    }
                },
                **unavailable,
            },
            {  # no upstream could take the connection
                "filter": {"response_flag_filter": {"flags": ["UF", "UH", "UO", "URX", "UC"]}},
                "headers_to_add": [_add("retry-after", "1"), _add("retry-after-ms", "1000"),
                                   _add("x-kvgate-reject-reason", "upstream-unavailable")],
                "body_format_override": _json_error("upstream_unavailable", "server_error"),
            },
            {  # a body over Envoy's buffer limit, refused before kvgate saw it (kvgate's own 413s are tagged)
                "filter": {
                    "and_filter": {
                        "filters": [
                            _status(413),
                            {"metadata_filter": {
                                "matcher": {**_has_key("rejected"), "invert": True},
                                "match_if_key_not_found": True,
                            }},
                        ]
                    }
                },
                "headers_to_add": [_add("x-kvgate-reject-reason", "body-too-large")],
                "body_format_override": _json_error("request_too_large", "invalid_request_error"),
            },
        ]
    }


def bootstrap(p: EnvoyParams, kvgate: bool = True) -> dict[str, Any]:
    """A complete Envoy; ``kvgate=False`` gives the same proxy without kvgate (the benchmark baseline)."""
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "kvgate",
        "use_remote_address": True,
        "generate_request_id": True,
        "stream_idle_timeout": "300s",
        "route_config": {
            "name": "llm",
            "virtual_hosts": [
                {
                    "name": "llm",
                    "domains": ["*"],
                    "routes": [
                        {
                            "name": "inference",
                            "match": {"prefix": "/", "headers": [{"name": ":method",
                                                                   "string_match": {"exact": "POST"}}]},
                            "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "0s"},
                        },
                        {
                            "name": "other",
                            "match": {"prefix": "/"},
                            "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "60s"},
                            "typed_per_filter_config": headers_only_override(),
                        },
                    ],
                }
            ],
        },
        "access_log": [access_log_for(p)],
        "local_reply_config": local_reply_config(),
        "http_filters": [
            ext_proc_filter(p),
            lua_filter(p),
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    if not kvgate:
        for key in ("access_log", "local_reply_config"):
            del hcm[key]
        hcm["http_filters"] = hcm["http_filters"][-1:]
        del hcm["route_config"]["virtual_hosts"][0]["routes"][1]["typed_per_filter_config"]
    clusters = [extproc_cluster(p), upstream_cluster(p)] if kvgate else [upstream_cluster(p)]
    return {
        "admin": {"address": _addr("127.0.0.1", p.admin_port)},
        "overload_manager": {
            "resource_monitors": [{
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3."
                    "DownstreamConnectionsConfig",
                    "max_active_downstream_connections": 10000,
                },
            }]
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "kvgate_ingress",
                    "address": _addr(p.listen_address, p.listen_port),
                    "per_connection_buffer_limit_bytes": p.max_body_bytes,
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                    "typed_config": hcm}]}],
                }
            ],
            "clusters": clusters,
        },
    }


def extproc_cluster(p: EnvoyParams) -> dict[str, Any]:
    return {
        "name": EXTPROC_CLUSTER,
        "type": "STATIC" if p.extproc_host.replace(".", "").isdigit() else "STRICT_DNS",
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "health_checks": [{
            "timeout": "1s", "interval": "2s", "unhealthy_threshold": 1, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": HEALTH_SERVICE},
        }],
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(p.extproc_host, p.extproc_port)}}]}],
        },
    }


DESTINATION_HEADER = "x-gateway-destination-endpoint"


def upstream_cluster(p: EnvoyParams) -> dict[str, Any]:
    if p.original_dst:
        return {
            "name": UPSTREAM_CLUSTER,
            "type": "ORIGINAL_DST",
            "connect_timeout": "1s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        }
    return {
        "name": UPSTREAM_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": UPSTREAM_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(h, port)}}
                                            for h, port in p.upstreams]}],
        },
    }


def snippet(p: EnvoyParams) -> dict[str, Any]:
    """What an existing Envoy needs: two HTTP filters before the router, the access log, the local
    reply mapping, the per-route override for bodyless routes and the ext_proc cluster."""
    return {
        "http_filters_before_router": [ext_proc_filter(p), lua_filter(p)],
        "access_log": [access_log_for(p)],
        "local_reply_config": local_reply_config(),
        "typed_per_filter_config_for_bodyless_routes": headers_only_override(),
        "clusters": [extproc_cluster(p)],
    }


HEADER = "# Generated by `kvgate envoy-config` from kvgate/envoy_config.py; do not edit by hand.\n"
SNIPPET_HEADER = HEADER + (
    "# Pieces to merge into an existing Envoy's HttpConnectionManager and static_resources:\n"
    "# put http_filters_before_router ahead of envoy.filters.http.router, add the access_log and\n"
    "# local_reply_config entries, set typed_per_filter_config_for_bodyless_routes on routes that\n"
    "# carry no body (GET), and add the cluster (point it at kvgate's gRPC port).\n"
)


def dump(doc: dict[str, Any], header: str = HEADER) -> str:
    return header + yaml.safe_dump(doc, sort_keys=False, width=120)


HELM_FILES = ENVOY_DIR.parent / "helm" / "kvgate" / "files"
HELM_HOST, HELM_PORT = "KVGATE_EXTPROC_HOST", 19001
"""Sentinels in the chart's copy of the snippet: the chart puts its Service name and gRPC port there."""


def shipped() -> dict[Path, str]:
    """The files committed under envoy/ (and the chart's copy of the snippet), rendered with default
    parameters."""
    p = EnvoyParams()
    return {
        ENVOY_DIR / "bootstrap.yaml": dump(bootstrap(p)),
        ENVOY_DIR / "ext_proc-filter.yaml": dump(snippet(p), SNIPPET_HEADER),
        HELM_FILES / "envoy-snippet.yaml": dump(snippet(replace(p, extproc_host=HELM_HOST, extproc_port=HELM_PORT)),
                                                SNIPPET_HEADER),
    }
