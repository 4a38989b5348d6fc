"""Every answer kvgate (or the Envoy config it generates) gives besides "admit", in one table.

A reader looking for "where is the 429 decided" finds the decisions in ``admission.py``; what each
reason *means* to a client — HTTP status, class, OpenAI error type and code, default message — is
here and nowhere else. ``wire.py`` renders a :class:`Rejection` from this table; the Envoy config
renders its own local replies (``gateway-unavailable``, ``route-not-found``, ...) from it too.

Classes, and why they matter: ``invalid`` (400/404/413) and ``auth`` (401/403) can never succeed by
retrying and are never 5xx; ``policy`` (429) is the tenant over its own quota and never scales the
fleet; ``capacity`` (503) is the fleet out of room: the autoscaling signal. ``gateway`` (503) is
Envoy's own answer when kvgate or a node cannot be reached, and kvgate's when its shared quota store
cannot be asked (``quota-unavailable``: no claim about the tenant, and no autoscaling signal either).

Pure: no I/O, no protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import ProtectiveLimit

Klass = Literal["invalid", "auth", "policy", "capacity", "gateway"]


@dataclass(frozen=True, slots=True)
class Reason:
    name: str
    status: int
    klass: Klass
    type: str
    """OpenAI ``error.type``."""
    code: str
    """OpenAI ``error.code``."""
    message: str
    """The default message; decisions usually say more (the limit, the figure)."""


_RETRY = "; please retry after the indicated time."

_TABLE: tuple[Reason, ...] = (
    # -- auth: who is asking ------------------------------------------------------------------------
    Reason("unknown-key", 401, "auth", "invalid_request_error", "invalid_api_key",
           "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."),
    Reason("invalid-authorization", 401, "auth", "invalid_request_error", "invalid_api_key",
           "The Authorization header is malformed. Send exactly one 'Authorization: Bearer <key>' header "
           "with a printable ASCII key."),
    # -- invalid: the request can never succeed as it is -------------------------------------------
    Reason("body-too-large", 413, "invalid", "invalid_request_error", "request_too_large",
           "The request body is larger than this gateway accepts."),
    Reason("invalid-body", 400, "invalid", "invalid_request_error", "invalid_request_body",
           "The request body is not a valid OpenAI request."),
    Reason("invalid-json", 400, "invalid", "invalid_request_error", "invalid_json",
           "The request body is not valid JSON."),
    Reason("body-too-complex", 400, "invalid", "invalid_request_error", "request_too_complex",
           "The request body has more JSON elements than any request this gateway serves needs."),
    Reason("invalid-parameter", 400, "invalid", "invalid_request_error", "invalid_value",
           "A request parameter has an invalid value."),
    Reason("missing-body", 400, "invalid", "invalid_request_error", "missing_body",
           "This endpoint needs a JSON request body."),
    Reason("prompt-too-long", 400, "invalid", "invalid_request_error", "context_length_exceeded",
           "The prompt is longer than this tenant may send."),
    Reason("context-too-long", 400, "invalid", "invalid_request_error", "context_length_exceeded",
           "The prompt plus the requested output does not fit the model's context."),
    Reason("exceeds-token-budget", 400, "invalid", "invalid_request_error", "request_too_large",
           "This request costs more tokens than the tenant's whole token budget."),
    Reason("invalid-http", 400, "invalid", "invalid_request_error", "invalid_request",
           "The request is not valid HTTP (e.g. a control character in a header); Envoy refused it."),
    Reason("headers-too-large", 431, "invalid", "invalid_request_error", "request_too_large",
           "The request headers are larger than this gateway accepts."),
    Reason("not-implemented", 501, "invalid", "invalid_request_error", "unsupported_protocol",
           "The request uses an HTTP feature this gateway does not implement (e.g. a transfer encoding "
           "other than chunked)."),
    Reason("http-version", 426, "invalid", "invalid_request_error", "unsupported_protocol",
           "This gateway speaks HTTP/1.1 and HTTP/2; HTTP/1.0 is not supported."),
    Reason("route-not-found", 404, "invalid", "invalid_request_error", "unknown_url",
           "Unknown request URL. This gateway serves the OpenAI inference routes only."),
    Reason("model-not-found", 404, "invalid", "invalid_request_error", "model_not_found",
           "The model does not exist on this gateway: no pool serves it."),
    Reason("model-not-allowed", 403, "auth", "invalid_request_error", "model_not_allowed",
           "This API key may not use this model."),
    # -- policy: the tenant is over its own quota (429) ---------------------------------------------
    Reason("tenant-concurrency", 429, "policy", "concurrency", "rate_limit_exceeded",
           "Too many concurrent requests for this tenant."),
    Reason("tenant-requests", 429, "policy", "requests", "rate_limit_exceeded",
           "Rate limit reached for requests."),
    Reason("tenant-tokens", 429, "policy", "tokens", "rate_limit_exceeded",
           "Rate limit reached for tokens."),
    Reason("tenant-budget", 429, "policy", "budget", "budget_exceeded",
           "The tenant's spend budget for the current window is exhausted; it resets at the indicated "
           "time (which can be days away)."),
    # -- capacity: the fleet cannot take it now (503) -----------------------------------------------
    Reason("fleet-inflight", 503, "capacity", "server_error", "fleet_at_capacity",
           "The inference fleet is at capacity" + _RETRY),
    Reason("fleet-kv", 503, "capacity", "server_error", "fleet_kv",
           "No inference node has KV-cache room for this request now" + _RETRY),
    Reason("fleet-queue", 503, "capacity", "server_error", "fleet_queue",
           "Every inference node already has too much work queued to serve this request in time" + _RETRY),
    Reason("fleet-breakers-open", 503, "capacity", "server_error", "fleet_breakers_open",
           "Every inference node is out of service (circuit breaker open)" + _RETRY),
    Reason("fleet-no-healthy-node", 503, "capacity", "server_error", "fleet_no_healthy_node",
           "No inference node is reachable now" + _RETRY),
    Reason("queue-deadline", 503, "capacity", "server_error", "queue_deadline",
           "The inference fleet is saturated: this request would not be served within its tier's "
           "queueing deadline" + _RETRY),
    Reason("queue-timeout", 503, "capacity", "server_error", "queue_timeout",
           "The inference fleet stayed saturated for this request's whole queueing deadline" + _RETRY),
    Reason("queue-evicted", 503, "capacity", "server_error", "queue_evicted",
           "The gateway queue is full and this request made room for a more urgent one" + _RETRY),
    Reason("queue-full", 503, "capacity", "server_error", "queue_full", "The gateway queue is full" + _RETRY),
    Reason("queue-ahead", 503, "capacity", "server_error", "queue_ahead",
           "Requests of this tier are already waiting for capacity" + _RETRY),
    # -- gateway: kvgate could not reach what it needs to decide (503, retry) ----------------------
    Reason("quota-unavailable", 503, "gateway", "server_error", "quota_unavailable",
           "This gateway could not confirm the tenant's quota with its shared store (its share here is in "
           "use; the tenant may be within its quota)" + _RETRY),
    # -- gateway: Envoy's own answers (rendered into its local_reply_config) ------------------------
    Reason("gateway-unavailable", 503, "gateway", "server_error", "gateway_unavailable",
           "The admission service is unavailable" + _RETRY),
    Reason("upstream-unavailable", 503, "gateway", "server_error", "upstream_unavailable",
           "The inference node could not be reached" + _RETRY),
)

REASONS: dict[str, Reason] = {r.name: r for r in _TABLE}


def reason(name: str) -> Reason:
    """The table's entry; an unknown name is a programming error, not a client's."""
    return REASONS[name]


@dataclass(frozen=True, slots=True)
class RateLimitView:
    """What the OpenAI-style ``x-ratelimit-*`` headers report for one budget."""

    limit: int
    remaining: int
    reset_seconds: float


@dataclass(frozen=True, slots=True)
class BudgetView:
    """A spend budget as the ``x-ratelimit-*-budget`` headers report it: limit and remaining in its unit
    (currency or weighted tokens, not whole numbers), reset when its window resets."""

    name: str
    limit: float
    remaining: float
    reset_seconds: float


@dataclass(frozen=True, slots=True)
class Rejection:
    status: int
    reason: str
    """A key of :data:`REASONS`."""
    klass: str
    """policy (429) | capacity (503) | invalid (400/404/413) | auth (401/403) | gateway (Envoy's 503)."""
    message: str
    retry_after: float | None = None
    requests: RateLimitView | None = None
    tokens: RateLimitView | None = None
    param: str | None = None
    """The request parameter at fault (OpenAI ``error.param``), for invalid requests."""
    budget: BudgetView | None = None
    """A spend budget's refusal (``tenant-budget``): what its ``x-ratelimit-*-budget`` headers say."""
    fleet_caused: bool = False
    """A policy (429) rejection the fleet caused rather than the tenant: a concurrency-cap 429 for a
    tenant inside its request and token budgets whose requests now last clearly longer than its own
    norm (a slower fleet holds each request longer). The scaler counts these as unmet demand."""


PROTECTIVE: dict[str, ProtectiveLimit] = {"tenant-concurrency": "concurrency", "tenant-requests": "requests",
                              "tenant-tokens": "tokens"}
"""The 429 reasons of a *protective* limit → its kind (``config.ProtectiveLimit``): a tenant over one may
be served as best effort (``tenants[i].over_limit``). A reason not here is hard: a limit that is a contract
(a billed spend budget) must never be added to this table."""


def reject(name: str, message: str | None = None, retry_after: float | None = None, *,
           param: str | None = None, requests: RateLimitView | None = None,
           tokens: RateLimitView | None = None) -> Rejection:
    """A rejection for ``name``, with the table's status and class; ``message`` overrides the default."""
    r = REASONS[name]
    return Rejection(r.status, name, r.klass, message or r.message, retry_after, requests, tokens, param)


class Invalid(Exception):
    """Raised by the pure request parsers (``estimate.py``, ``identity.py``) for a request that can
    never succeed as it is; the core answers it with :meth:`rejection` and takes nothing."""

    def __init__(self, name: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        assert REASONS[name].klass in ("invalid", "auth"), name
        self.name = name
        self.message = message
        self.param = param

    def rejection(self) -> Rejection:
        return reject(self.name, self.message, param=self.param)


UNKNOWN_KEY = reject("unknown-key")
