"""How a rejection looks to the client: status, headers and an OpenAI-shaped JSON body.

OpenAI SDKs (Python, Node), LangChain and most HTTP clients retry 429 and 5xx honouring
``retry-after-ms`` first, then ``retry-after``; kvgate sends both, computed from when the budget or
slot actually frees up. Pure: no protobuf here, the server turns these into Envoy messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

from .reasons import REASONS, RateLimitView, Rejection

REASON_HEADER = "x-kvgate-reject-reason"
BUDGET_HEADER = "x-kvgate-budget"
"""The spend budget a ``tenant-budget`` 429 names."""
REMAINING_HEADER = "x-kvgate-budget-remaining"
"""On admitted responses: ``name=left`` for each of the tenant's budgets (set by the Envoy Lua filter
from the ``budget_remaining`` metadata kvgate attaches)."""

@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def json_reply(status: int, doc: object) -> Reply:
    """An answer kvgate gives itself (GET /v1/models with several pools)."""
    return Reply(status, [("content-type", "application/json")], orjson.dumps(doc))


def reject_reply(r: Rejection) -> Reply:
    entry = REASONS.get(r.reason)
    type_, code = (entry.type, entry.code) if entry else ("server_error", r.reason.replace("-", "_"))
    headers = [("content-type", "application/json"), (REASON_HEADER, r.reason)]
    if r.retry_after is not None and math.isfinite(r.retry_after):
        headers.append(("retry-after", str(max(1, math.ceil(r.retry_after)))))
        headers.append(("retry-after-ms", str(max(1, math.ceil(r.retry_after * 1000)))))
    if r.status == 401:
        headers.append(("www-authenticate", 'Bearer realm="kvgate"'))
    for kind, view in (("requests", r.requests), ("tokens", r.tokens)):
        if view is not None:
            headers.extend(ratelimit_headers(kind, view))
    if r.budget is not None:
        b = r.budget
        headers += [(BUDGET_HEADER, b.name), ("x-ratelimit-limit-budget", f"{b.limit:.6g}"),
                    ("x-ratelimit-remaining-budget", f"{max(0.0, b.remaining):.6g}"),
                    ("x-ratelimit-reset-budget", format_duration(b.reset_seconds))]
    return Reply(r.status, headers, error_body(r.message, type_, code, r.param))


def ratelimit_headers(kind: str, v: RateLimitView) -> list[tuple[str, str]]:
    return [
        (f"x-ratelimit-limit-{kind}", str(v.limit)),
        (f"x-ratelimit-remaining-{kind}", str(v.remaining)),
        (f"x-ratelimit-reset-{kind}", format_duration(v.reset_seconds)),
    ]


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"
