"""Envoy configuration for kvgate, generated from one place.

``envoy/bootstrap.yaml`` (a complete local Envoy) and ``envoy/ext_proc-filter.yaml`` (the pieces to
add to an existing Envoy) are rendered from this module and committed; a test checks that they are
current and that Envoy itself accepts them (``envoy --mode validate``). ``kvgate envoy-config``
renders a bootstrap with other ports, or derived from a kvgate config file (``--config``).

The design, and why:

* routes are an allowlist: the OpenAI inference routes (POST: chat/completions, completions,
  embeddings, responses) skip the ext_proc headers message and send one buffered body message
  carrying the attributes kvgate needs — one gRPC round trip per request instead of two; GET
  /v1/models and /health send headers only, so they are authenticated too; every other path is
  Envoy's own 404 (``route-not-found``) and never reaches a node (a tenant key cannot read vLLM's
  /metrics through the gateway);
* a Lua filter strips client x-kvgate-* headers, refuses requests kvgate never saw, and copies the
  response's token usage into dynamic metadata (no per-chunk Python work);
* the gRPC access log delivers that metadata to kvgate when each admitted stream ends (normally, on
  upstream error or on client disconnect): that is where slots are released and tokens reconciled;
  local 5xx replies on inference routes are logged too (an admit Envoy never applied: kvgate
  releases it by request id);
* ext_proc failures (kvgate down: 500, too slow: 504) and upstream connection failures become
  503 + Retry-After with an OpenAI-shaped body, so clients retry instead of failing. Every local
  reply's status, type, code and message come from ``ext_proc/reasons.py``;
* Envoy's own limits never undercut kvgate's: both clusters' circuit breakers are sized from
  kvgate's queue and fleet limits, the filter's ``max_message_timeout`` covers the longest queue
  wait, and the connection manager's ``request_timeout`` covers that plus the body upload;
* slow clients are cut (``request_headers_timeout``, ``request_timeout``); a hung node is cut by a
  first-byte timeout and an idle timeout per try, never by a total timeout (long streams live);
* several kvgate replicas (``EnvoyParams.extproc_ports``) are endpoints of one ext_proc cluster; each
  request's stream is balanced on its own, a stream that reaches no live replica is retried on
  another, and a dead replica is ejected on its first failure (see :func:`extproc_cluster`).
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ext_proc.reasons import REASONS
from ext_proc.sizes import ENVOY_MIN_BODY_BUFFER_BYTES, MAX_REQUEST_HEADERS_KB, envoy_body_buffer_bytes

if TYPE_CHECKING:
    from ext_proc.config import Config

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"
LUA_PATH = ENVOY_DIR / "kvgate.lua"
EXTPROC_CLUSTER = "kvgate_ext_proc"
UPSTREAM_CLUSTER = "llm_upstream"
HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
META_NS = "kvgate"

INFERENCE_PATHS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""POST routes whose buffered body kvgate decides on."""
BODYLESS_PATHS: tuple[str, ...] = ("/v1/models", "/health")
"""GET routes sent to kvgate headers-only (identity, no quota)."""
BODYLESS_PREFIXES: tuple[str, ...] = ("/v1/models/",)
"""GET routes by prefix, the same way: ``/v1/models/{model}`` (OpenAI's retrieve)."""
UNLIMITED_MAX_REQUESTS = 100_000
"""The circuit breakers' size when kvgate's own config sets no fleet-wide bound."""


@dataclass(frozen=True)
class EnvoyParams:
    listen_address: str = "0.0.0.0"
    listen_port: int = 10000
    admin_port: int = 9901
    extproc_host: str = "127.0.0.1"
    extproc_port: int = 9001
    extproc_ports: tuple[int, ...] = ()
    """Several kvgate replicas on ``extproc_host``: one ext_proc endpoint per port (empty: just
    ``extproc_port``). With more than one, Envoy retries a decision whose stream could not reach a
    replica on another one, and ejects a replica after its first connection failure (see
    :func:`extproc_cluster`); with one, the rendered config is the single-replica one."""
    upstreams: list[tuple[str, int]] = field(default_factory=lambda: [("127.0.0.1", 8000)])
    fail_open: bool = False
    message_timeout_ms: int = 1000
    max_message_timeout_ms: int = 60_000
    """Ceiling of the per-request ``override_message_timeout`` kvgate sends for a queued request (its
    tier's max_queue_wait_ms + a margin); must be at least that."""
    max_body_bytes: int = ENVOY_MIN_BODY_BUFFER_BYTES
    trusted_header: str | None = None
    strip_trusted_header: bool = True
    """Remove the client's copy of ``trusted_header`` first in the filter chain (the operator's authn
    filter, which sets it, goes after that removal). Only the local test stack turns it off."""
    access_log_buffer_bytes: int = 0
    """0 (the default): each completion reaches kvgate at once, so a slot frees as its response ends.
    Above 0 (``kvgate envoy-config --access-log-batch BYTES``): Envoy batches entries up to this many
    bytes or 50 ms (``buffer_flush_interval``), whichever comes first — one gRPC message carries many
    (kvgate's CPU per request about -80 us on 2 cores), but a slot frees up to 50 ms late: a tenant at
    its ``max_concurrent`` that sends its next request the moment a response ends may get a 429."""
    original_dst: bool = False
    """True: kvgate picks the node; the upstream cluster sends each request to the host:port kvgate put
    in x-gateway-destination-endpoint (ORIGINAL_DST), as the Gateway API Inference Extension does."""
    max_requests: int = UNLIMITED_MAX_REQUESTS
    """Circuit-breaker thresholds (max_requests, max_pending_requests, max_connections) of the
    ext_proc and the upstream cluster: above what kvgate itself admits and queues (see
    :func:`params_for`), so kvgate's limits bind, never Envoy's default 1,024."""
    inference_paths: tuple[str, ...] = INFERENCE_PATHS
    bodyless_paths: tuple[str, ...] = BODYLESS_PATHS
    bodyless_prefixes: tuple[str, ...] = BODYLESS_PREFIXES
    request_headers_timeout_ms: int = 10_000
    """A client must have sent all its request headers within this (slowloris)."""
    request_timeout_ms: int = 70_000
    """A client must have sent its whole request (headers and body) and kvgate must have decided
    within this; disarmed once the request is upstream or the response starts (streams are fine)."""
    first_byte_timeout_ms: int = 60_000
    buffered_timeout_ms: int = 600_000
    """First-byte and idle timeout of a request whose response is not streamed (kvgate tells the Lua
    helper, which moves it to the ``inference-buffered`` route): its first byte is its whole answer, so the
    streaming timeouts would cut long healthy generations."""
    """Inference routes: the node must start its response within this once it has the request."""
    idle_timeout_ms: int = 60_000
    """Inference routes: the node may go this long without sending a byte (a hung node)."""


def params_for(cfg: Config, base: EnvoyParams | None = None) -> EnvoyParams:
    """``base`` with the limits that must sit above kvgate's own, derived from kvgate's config."""
    base = base or EnvoyParams()
    # every pool has its own gateway queue (``pools[i].queue.max_size``, default ``queue.max_size``)
    queued = sum(p.queue.max_size or cfg.queue.max_size for p in cfg.pools) if cfg.pools else cfg.queue.max_size
    queued = queued if cfg.queue.enabled else 0
    if cfg.fleet.max_inflight is None:
        max_requests = max(base.max_requests, UNLIMITED_MAX_REQUESTS)
    else:
        # twice what kvgate itself holds, plus room for requests being decided or refused and bodyless routes
        max_requests = 2 * (queued + cfg.fleet.max_inflight) + 1024
    longest_wait = max(t.max_queue_wait_ms for t in cfg.tiers.values())
    max_message = max(base.max_message_timeout_ms, longest_wait + 5_000)
    return replace(
        base,
        max_requests=max_requests,
        max_message_timeout_ms=max_message,
        request_timeout_ms=max(base.request_timeout_ms, max_message + 10_000),
        max_body_bytes=max(base.max_body_bytes, envoy_body_buffer_bytes(cfg.limits.max_body_bytes)),
        trusted_header=cfg.identity.trusted_header or base.trusted_header,
    )


def _dur(ms: int) -> str:
    return f"{ms / 1000:g}s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _addr(host: str, port: int) -> dict[str, Any]:
    host = host.strip("[]")
    sa: dict[str, Any] = {"address": host, "port_value": port}
    if host == "::":
        sa["ipv4_compat"] = True  # "::" listens on IPv4 too, as "0.0.0.0" users expect
    return {"socket_address": sa}


def error_body(name: str) -> dict[str, Any]:
    """The OpenAI error object for one of ``ext_proc/reasons.py``'s reasons."""
    r = REASONS[name]
    return {"error": {"message": r.message, "type": r.type, "param": None, "code": r.code}}


def lua_source(fail_open: bool) -> str:
    src = LUA_PATH.read_text()
    marker = "local FAIL_OPEN = false"
    assert marker in src, "envoy/kvgate.lua lost its FAIL_OPEN line"
    src = src.replace(marker, f"local FAIL_OPEN = {'true' if fail_open else 'false'}")
    body_marker = "local MISSING_BODY = nil"
    assert body_marker in src, "envoy/kvgate.lua lost its MISSING_BODY line"
    body = json.dumps(error_body("missing-body"), separators=(",", ":"))
    src = src.replace(body_marker, f"local MISSING_BODY = {_lua_string(body)}")
    status_marker = "local MISSING_STATUS = nil"
    assert status_marker in src, "envoy/kvgate.lua lost its MISSING_STATUS line"
    return src.replace(status_marker, f"local MISSING_STATUS = \"{REASONS['missing-body'].status}\"")


def _lua_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _json_error(name: str) -> dict[str, Any]:
    return {"json_format": error_body(name), "content_type": "application/json"}


def _has_key(key: str) -> dict[str, Any]:
    return {"filter": META_NS, "path": [{"key": key}], "value": {"present_match": True}}


def _status(code: int, op: str = "EQ") -> dict[str, Any]:
    value = {"default_value": code, "runtime_key": "kvgate.na"}
    return {"status_code_filter": {"comparison": {"op": op, "value": value}}}


def _add(header: str, value: str) -> dict[str, Any]:
    return {"header": {"key": header, "value": value}, "append_action": "ADD_IF_ABSENT"}


def _put(header: str, value: str) -> dict[str, Any]:
    return {"header": {"key": header, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def header_strip_filter(p: EnvoyParams) -> dict[str, Any] | None:
    """First in the chain: removes the client's copy of the trusted identity header, so only a filter
    placed after this one (the operator's authn) can set it."""
    if not (p.trusted_header and p.strip_trusted_header):
        return None
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": p.trusted_header.lower()}]},
        },
    }


def extproc_ports(p: EnvoyParams) -> list[int]:
    """The ports of the kvgate replicas Envoy's ext_proc cluster has endpoints for."""
    return list(p.extproc_ports) or [p.extproc_port]


def extproc_grpc_service(p: EnvoyParams) -> dict[str, Any]:
    """The ext_proc filter's gRPC service. With several replicas a stream that got no answer from one
    (connection refused: the replica died and Envoy has not taken it out yet; stream refused; reset
    before any answer; UNAVAILABLE from a replica shutting down) is retried, up to twice, each time on
    a replica not tried before: the ext_proc filter keeps its one message for that when a retry policy
    is set (``setBufferBodyForRetry``), so no decision is lost to a dead replica. A replica that was reset
    may have admitted the request already; that admit died with it (a Redis lease expires).

    The access log keeps its own plain service: its stream is long-lived (one per Envoy worker,
    pinned to one replica), and replaying it would log entries twice; when its replica dies Envoy
    opens a new stream to another on the next entry."""
    svc: dict[str, Any] = {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}}
    if len(extproc_ports(p)) > 1:
        svc["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset,unavailable",
            "num_retries": 2,
            "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                                 "PreviousHostsPredicate"},
            }],
            "host_selection_retry_max_attempts": 5,
        }
    return svc


def ext_proc_filter(p: EnvoyParams) -> dict[str, Any]:
    attrs = ["request.id", "request.path", "request.headers['authorization']"]
    if p.trusted_header:
        attrs.append(f"request.headers['{p.trusted_header.lower()}']")
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": extproc_grpc_service(p),
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
            "max_message_timeout": _dur(p.max_message_timeout_ms),
            "metadata_options": {"receiving_namespaces": {"untyped": [META_NS]}},
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


def kvgate_disabled() -> dict[str, Any]:
    """Per-route config for routes kvgate must not see (Envoy's own 404)."""
    return {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        },
        "envoy.filters.http.lua": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute",
            "disabled": True,
        },
    }


def access_log() -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {
            "or_filter": {
                "filters": [
                    # an admitted request ended (its ticket is in the metadata)
                    # (match_if_key_not_found defaults to true: without false every request was logged)
                    {"metadata_filter": {"matcher": _has_key("ticket"), "match_if_key_not_found": False}},
                    # the client went away (maybe while kvgate held it in its queue)
                    {"response_flag_filter": {"flags": ["DC"]}},
                    # Envoy answered an inference request itself with a 5xx that is not one of kvgate's
                    # rejections: kvgate's admit was never applied (message timeout, broken stream);
                    # kvgate releases it by request.request_id
                    {"and_filter": {"filters": [
                        _status(500, "GE"),
                        {"header_filter": {"header": {"name": ":method", "string_match": {"exact": "POST"}}}},
                        {"metadata_filter": {"matcher": {**_has_key("rejected"), "invert": True},
                                             "match_if_key_not_found": True}},
                    ]}},
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
    tc = al["typed_config"]
    tc["common_config"]["buffer_size_bytes"] = p.access_log_buffer_bytes
    # What identifies the request: an entry without a ticket (the client left before kvgate's decision)
    # leaves a tombstone only when that decision could admit it — not for a caller whose key names no
    # tenant. The log name tells kvgate which headers come (an older config sends none: unknown).
    headers = ["authorization", *([p.trusted_header.lower()] if p.trusted_header else [])]
    tc["common_config"]["log_name"] = "kvgate;headers=" + ",".join(headers)
    tc["additional_request_headers_to_log"] = headers
    return al


def _retryable(name: str) -> dict[str, Any]:
    r = REASONS[name]
    return {
        "status_code": r.status,
        "headers_to_add": [_add("retry-after", "1"), _add("retry-after-ms", "1000"),
                           _add("x-kvgate-reject-reason", name)],
        "body_format_override": _json_error(name),
    }


def local_reply_config() -> dict[str, Any]:
    return {
        "mappers": [
            {  # no upstream could take the connection, or the node hung (first-byte timeout: UT)
                "filter": {"response_flag_filter": {"flags": ["UF", "UH", "UO", "URX", "UC", "UT"]}},
                **_retryable("upstream-unavailable"),
            },
            {  # kvgate unreachable (500) or too slow (504): fail closed, but retryable
                "filter": {"or_filter": {"filters": [_status(500), _status(504)]}},
                **_retryable("gateway-unavailable"),
            },
            # Envoy's own refusals, plain text by default: every refusal a client can get is OpenAI-shaped
            # JSON. A body over Envoy's buffer limit, refused before kvgate saw it (kvgate's own 413 gets
            # the same answer), protocol errors (kvgate never answers 431, 426 or 501 itself)
            *(_envoys_own(name, flt) for name, flt in (
                ("body-too-large", {"and_filter": {"filters": [_status(413), _not_kvgates()]}}),
                ("headers-too-large", _status(431)),
                ("http-version", _status(426)),
                # a 400 for a request whose headers Envoy never finished reading (a codec error): kvgate's
                # and the Lua helper's own 400s come after a complete request (kvgate's metadata tag is
                # not set yet when Envoy sends an immediate response: it cannot tell them apart)
                ("invalid-http", {"and_filter": {"filters": [_status(400), {"header_filter": {"header": {
                    "name": ":path", "present_match": True, "invert_match": True}}}]}}),
                ("not-implemented", _status(501)),
            )),
        ]
    }


def _not_kvgates() -> dict[str, Any]:
    """A local reply kvgate (or its Lua helper) did not give: no ``rejected`` in kvgate's metadata."""
    return {"metadata_filter": {"matcher": {**_has_key("rejected"), "invert": True}, "match_if_key_not_found": True}}


def _envoys_own(name: str, flt: dict[str, Any]) -> dict[str, Any]:
    """A local-reply mapper giving one of Envoy's own refusals kvgate's body and reason header."""
    return {
        "filter": flt,
        "status_code": REASONS[name].status,
        "headers_to_add": [_add("x-kvgate-reject-reason", name)],
        "body_format_override": _json_error(name),
    }


def _path(path: str) -> dict[str, Any]:
    return {"path": path}


def _method(m: str) -> list[dict[str, Any]]:
    return [{"name": ":method", "string_match": {"exact": m}}]


def inference_route_action(p: EnvoyParams, buffered: bool = False) -> dict[str, Any]:
    """No total timeout (long streams live); a first-byte and an idle timeout per try (a hung node).
    ``buffered``: for responses that are not streamed, whose first byte comes with the whole answer."""
    first, idle = (p.buffered_timeout_ms, p.buffered_timeout_ms) if buffered else (
        p.first_byte_timeout_ms, p.idle_timeout_ms)
    return {
        "cluster": UPSTREAM_CLUSTER,
        "timeout": "0s",
        "retry_policy": {
            "num_retries": 0,
            "per_try_timeout": _dur(first),
            "per_try_idle_timeout": _dur(idle),
        },
    }


BUFFERED_HEADER = "x-kvgate-buffered"
"""Set by the Lua helper (after it strips clients' x-kvgate-* headers) when kvgate says the response will
not be streamed; the route cache is then cleared so the ``inference-buffered`` route applies."""


def not_found_route() -> dict[str, Any]:
    r = REASONS["route-not-found"]
    return {
        "name": "not-found",
        "match": {"prefix": "/"},
        "direct_response": {"status": r.status,
                            "body": {"inline_string": json.dumps(error_body("route-not-found"))}},
        "response_headers_to_add": [_put("content-type", "application/json"),
                                    _put("x-kvgate-reject-reason", "route-not-found")],
        "typed_per_filter_config": kvgate_disabled(),
    }


def routes(p: EnvoyParams, kvgate: bool = True) -> list[dict[str, Any]]:
    """The allowlist: inference routes, bodyless routes, Envoy's 404 for everything else."""
    out: list[dict[str, Any]] = []
    for path in p.inference_paths:
        out.append({"name": f"inference-buffered:{path}",
                    "match": {**_path(path), "headers": [*_method("POST"), {"name": BUFFERED_HEADER,
                                                                            "present_match": True}]},
                    "route": inference_route_action(p, buffered=True),
                    "request_headers_to_remove": [BUFFERED_HEADER]})  # the node never sees it
        out.append({"name": f"inference:{path}", "match": {**_path(path), "headers": _method("POST")},
                    "route": inference_route_action(p)})
    bodyless = [(path, _path(path)) for path in p.bodyless_paths]
    bodyless += [(prefix + "*", {"prefix": prefix}) for prefix in p.bodyless_prefixes]
    for name, match in bodyless:
        r: dict[str, Any] = {"name": f"bodyless:{name}", "match": {**match, "headers": _method("GET")},
                             "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "60s"}}
        if kvgate:
            r["typed_per_filter_config"] = headers_only_override()
        out.append(r)
    nf = not_found_route()
    if not kvgate:
        del nf["typed_per_filter_config"]
    out.append(nf)
    return out


def hcm_settings(p: EnvoyParams) -> dict[str, Any]:
    """HttpConnectionManager fields kvgate needs (slow clients are cut; long streams are not)."""
    return {
        "request_headers_timeout": _dur(p.request_headers_timeout_ms),
        "request_timeout": _dur(p.request_timeout_ms),
        "stream_idle_timeout": "300s",
        # kvgate's gRPC receive limit counts on it (ext_proc/sizes.py): raise both together
        "max_request_headers_kb": MAX_REQUEST_HEADERS_KB,
        # dot segments and doubled slashes resolved before routing (red team: /v1/models/../../metrics
        # reached the node as sent); escaped slashes stay as they are (/v1/models/meta-llama%2FLlama-3)
        "normalize_path": True,
        "merge_slashes": True,
    }


def http_filters(p: EnvoyParams) -> list[dict[str, Any]]:
    strip = header_strip_filter(p)
    return ([strip] if strip else []) + [ext_proc_filter(p), lua_filter(p)]


def bootstrap(p: EnvoyParams, kvgate: bool = True) -> dict[str, Any]:
    """A complete Envoy; ``kvgate=False`` gives the same proxy without kvgate (the benchmark baseline)."""
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "kvgate",
        "use_remote_address": True,
        "generate_request_id": True,
        **hcm_settings(p),
        "route_config": {
            "name": "llm",
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": routes(p, kvgate)}],
        },
        "access_log": [access_log_for(p)],
        "local_reply_config": local_reply_config(),
        "http_filters": [*http_filters(p), router],
    }
    if not kvgate:
        for key in ("access_log", "local_reply_config"):
            del hcm[key]
        hcm["http_filters"] = [router]
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


def circuit_breakers(p: EnvoyParams) -> dict[str, Any]:
    n = p.max_requests
    return {"thresholds": [{"priority": "DEFAULT", "max_requests": n, "max_pending_requests": n,
                            "max_connections": n}]}


def extproc_cluster(p: EnvoyParams) -> dict[str, Any]:
    """kvgate's gRPC cluster: one endpoint per replica, checked with gRPC health checks (a draining
    replica answers NOT_SERVING). Every HTTP request opens its own ext_proc stream, load-balanced
    (round robin) on its own, so a dead replica only costs the streams sent to it before it is taken
    out. With several replicas that window is closed twice over: outlier detection ejects a replica on
    its first local-origin failure (connection refused, reset, timeout) instead of waiting for the
    next health check (every 2 s), and a passing health check brings it back; the retry policy of
    :func:`extproc_grpc_service` re-sends the streams that failed meanwhile."""
    ports = extproc_ports(p)
    cluster: dict[str, Any] = {
        "name": EXTPROC_CLUSTER,
        "type": "STATIC" if _is_ip(p.extproc_host) else "STRICT_DNS",
        "connect_timeout": "0.25s",
        "circuit_breakers": circuit_breakers(p),
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
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(p.extproc_host, port)}}
                                            for port in ports]}],
        },
    }
    if len(ports) > 1:
        # Envoy health-checks a cluster that has not made a connection yet at no_traffic_interval (60 s
        # by default) and keeps that schedule until the next check: for the first minute after Envoy
        # starts a dead replica would stay "healthy". Check at the normal interval from the start.
        cluster["health_checks"][0]["no_traffic_interval"] = cluster["health_checks"][0]["interval"]
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        }
    return cluster


DESTINATION_HEADER = "x-gateway-destination-endpoint"


def upstream_cluster(p: EnvoyParams) -> dict[str, Any]:
    if p.original_dst:
        return {
            "name": UPSTREAM_CLUSTER,
            "type": "ORIGINAL_DST",
            "connect_timeout": "1s",
            "lb_policy": "CLUSTER_PROVIDED",
            "circuit_breakers": circuit_breakers(p),
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        }
    return {
        "name": UPSTREAM_CLUSTER,
        "type": "STATIC" if all(_is_ip(h) for h, _ in p.upstreams) else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": circuit_breakers(p),
        "load_assignment": {
            "cluster_name": UPSTREAM_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(h, port)}}
                                            for h, port in p.upstreams]}],
        },
    }


LUA_NAME = "kvgate"


def scoped(p: EnvoyParams) -> dict[str, Any]:
    """For an Envoy whose routes kvgate does not own (an Istio gateway): the filters are off by default
    and switched on only on the routes named for them, so kvgate never sees other traffic."""
    ext = ext_proc_filter(p)
    ext["disabled"] = True
    lua = lua_filter(p)
    lua["typed_config"]["source_codes"] = {LUA_NAME: lua["typed_config"].pop("default_source_code")}

    def on(override: dict[str, Any]) -> dict[str, Any]:
        return {
            "envoy.filters.http.ext_proc": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                                            "disabled": False, "config": override},
            "envoy.filters.http.lua": {"@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute",
                                       "name": LUA_NAME},
        }

    buffered = {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": {}}
    action = inference_route_action(p)
    del action["cluster"]
    return {
        "http_filters_before_router": [ext, lua],
        "typed_per_filter_config_for_inference_routes": on(buffered),
        "route_action_for_inference_routes": action,
        "typed_per_filter_config_for_bodyless_routes": on(headers_only_override()["envoy.filters.http.ext_proc"]),
    }


def snippet(p: EnvoyParams) -> dict[str, Any]:
    """What an existing Envoy needs: see SNIPPET_HEADER."""
    strip = header_strip_filter(p)
    return {
        "http_filters_first": [strip] if strip else [],
        "http_filters_before_router": [ext_proc_filter(p), lua_filter(p)],
        "http_connection_manager": hcm_settings(p),
        "access_log": [access_log_for(p)],
        "local_reply_config": local_reply_config(),
        "routes": routes(p),
        "typed_per_filter_config_for_bodyless_routes": headers_only_override(),
        "typed_per_filter_config_for_other_routes": kvgate_disabled(),
        "circuit_breakers_for_the_upstream_cluster": circuit_breakers(p),
        "clusters": [extproc_cluster(p)],
        "scoped": scoped(p),
    }


HEADER = "# Generated by `kvgate envoy-config` from kvgate/envoy_config.py; do not edit by hand.\n"
SNIPPET_HEADER = HEADER + (
    "# Pieces to merge into an existing Envoy's HttpConnectionManager and static_resources:\n"
    "# put http_filters_first at the very start of the filter chain (it strips the client's copy of the\n"
    "# trusted identity header; your authn filter that sets it goes after it), http_filters_before_router\n"
    "# ahead of envoy.filters.http.router; set the http_connection_manager fields, add the access_log and\n"
    "# local_reply_config entries; use `routes` as the route list (an allowlist: the inference routes,\n"
    "# the bodyless routes with typed_per_filter_config_for_bodyless_routes, a JSON 404 for the rest) or\n"
    "# give your own routes the same per-route configs; routes that must bypass kvgate get\n"
    "# typed_per_filter_config_for_other_routes; give your upstream cluster the circuit breakers; add the\n"
    "# cluster (point it at kvgate's gRPC port). `scoped` is the variant for an Envoy whose routes are not\n"
    "# yours to replace (Istio): filters off by default, switched on per inference / bodyless route.\n"
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
