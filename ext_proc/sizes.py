"""Every size limit on a request's way through Envoy to kvgate, derived from one place.

A request crosses three limits: Envoy's buffer for the body (the listener's
``per_connection_buffer_limit_bytes``: a larger body is Envoy's own 413), Envoy's limit on the request
headers (``max_request_headers_kb``: larger headers are Envoy's own 431), and kvgate's gRPC server, which
receives the buffered body *plus* the request attributes it asked for (path, request id, the
Authorization header and the trusted tenant header — all headers, so together within Envoy's header
limit). If the gRPC server's limit sat below the sum, a body Envoy accepted would be refused by gRPC
before kvgate saw it: fail-closed a retryable ``503 gateway-unavailable`` for a request that can never
succeed, fail-open a request reaching the node without any decision. So the gRPC limit is derived from
the other two, with room for the message's own framing, and every caller (the Envoy config generator,
the gRPC server, the body cap's check at reload) asks this module.
"""

from __future__ import annotations

ENVOY_MIN_BODY_BUFFER_BYTES = 4 * 1024 * 1024
"""Envoy's body buffer is at least this (kvgate's own ``limits.max_body_bytes`` may be lower: a body
between the two reaches kvgate and gets kvgate's 413, which names the limit)."""

MAX_REQUEST_HEADERS_KB = 60
"""Envoy's request header limit, set explicitly in the generated config (Envoy's default)."""

FRAMING_BYTES = 64 * 1024
"""Room for the ext_proc message's own fields (protobuf framing, attribute names, the metadata)."""


def envoy_body_buffer_bytes(max_body_bytes: int) -> int:
    """The body buffer Envoy is configured with for kvgate's body cap."""
    return max(ENVOY_MIN_BODY_BUFFER_BYTES, max_body_bytes)


def grpc_receive_bytes(max_body_bytes: int) -> int:
    """The largest ext_proc message kvgate's gRPC server must accept: the largest body Envoy buffers
    plus every header Envoy lets through plus framing."""
    return envoy_body_buffer_bytes(max_body_bytes) + MAX_REQUEST_HEADERS_KB * 1024 + FRAMING_BYTES
