"""The admission decision: where every 400/413, 429 and 503 of kvgate is decided.

The rule is fixed and the order of checks follows from it:

1. *invalid* — a request that can never be served (body, prompt or context over its cap, or a
   cost larger than the tenant's whole token bucket): 400/413, retrying cannot help;
2. *policy* — the tenant is over its own quota (concurrency, requests/min, tokens/min): 429;
3. *capacity* — the fleet cannot take it now (``fleet.max_inflight``): 503.

Policy is checked before capacity, so a tenant over its quota never counts as fleet demand: only
503s drive the autoscaler. Nothing is taken from any budget unless every check passes.

Pure: no I/O, no asyncio. Time comes from an injected clock and jitter from an injected RNG; the
gRPC server and the virtual-time benchmarks drive this same class.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import Config, Mode, Tenant
from .estimate import Estimate
from .limits import TokenBucket

UNKNOWN_TENANT = "unknown"
EWMA_ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class RateLimitView:
    """What the OpenAI-style ``x-ratelimit-*`` headers report for one budget."""

    limit: int
    remaining: int
    reset_seconds: float


@dataclass(frozen=True, slots=True)
class Rejection:
    status: int
    reason: str
    """Machine-readable: tenant-concurrency, tenant-requests, tenant-tokens, fleet-inflight, ..."""
    klass: str
    """policy (429) | capacity (503) | invalid (400/413) | auth (401)."""
    message: str
    retry_after: float | None = None
    requests: RateLimitView | None = None
    tokens: RateLimitView | None = None


UNKNOWN_KEY = Rejection(
    401, "unknown-key", "auth", "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
)


@dataclass(slots=True, eq=False)
class TenantState:
    config: Tenant
    mode: Mode
    requests: TokenBucket | None
    tokens: TokenBucket | None
    inflight: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)
    """Charged leases in start order: the first is the one expected to end first."""
    mean_seconds: float | None = None

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(slots=True, eq=False)
class Lease:
    ticket: str
    tenant: TenantState
    request_id: str
    reserved_tokens: int
    prompt_estimate: int
    started: float
    charged: bool
    node: str | None = None
    """The vLLM node (host:port) kvgate sent the request to, when kvgate chooses nodes."""
    """False for a request admitted in shadow mode that enforcement would have rejected: it holds no
    quota, so the shadow counters show what enforcing would do."""


@dataclass(frozen=True, slots=True)
class Decision:
    tenant: str
    tier: str
    lease: Lease | None
    rejection: Rejection | None

    @property
    def admitted(self) -> bool:
        return self.lease is not None

    @property
    def shadow(self) -> bool:
        """Admitted although a check failed (shadow mode)."""
        return self.lease is not None and self.rejection is not None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Completion:
    lease: Lease
    charged_tokens: int
    """Tokens finally debited: the real usage, or the reservation when usage is unknown."""
    usage: Usage | None
    seconds: float


def _bucket(per_minute: float | None, burst: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    return TokenBucket(per_minute, burst if burst is not None else per_minute, now)


class Admission:
    def __init__(self, config: Config, clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._tenants: dict[str, TenantState] = {}
        self._leases: dict[str, Lease] = {}
        self._uncertain: dict[str, str] = {}
        self._seq = 0
        self._boot = f"{self._rng.getrandbits(32):08x}"
        self.inflight = 0
        self._mean_seconds: float | None = None
        self.config = config
        self.reconfigure(config)

    # -- configuration ---------------------------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """Swap in a new config, keeping in-flight leases and what each tenant has already spent."""
        now = self._clock()
        old = self._tenants
        tenants: dict[str, TenantState] = {}
        for t in config.tenants:
            state = old.get(t.name)
            mode: Mode = t.mode or config.mode
            if state is None:
                state = TenantState(
                    t,
                    mode,
                    _bucket(t.requests_per_minute, t.request_burst, now),
                    _bucket(t.tokens_per_minute, t.token_burst, now),
                )
            else:
                state.config, state.mode = t, mode
                state.requests = _retuned(state.requests, t.requests_per_minute, t.request_burst, now)
                state.tokens = _retuned(state.tokens, t.tokens_per_minute, t.token_burst, now)
            tenants[t.name] = state
        unknown = old.get(UNKNOWN_TENANT)
        if unknown is None:
            unknown = TenantState(Tenant(name=UNKNOWN_TENANT, tier="none"), config.mode, None, None)
        unknown.mode = config.mode
        tenants.setdefault(UNKNOWN_TENANT, unknown)
        self._tenants = tenants
        self.config = config

    def tenant_state(self, name: str) -> TenantState | None:
        return self._tenants.get(name)

    # -- the decision ----------------------------------------------------------------------------

    def decide(
        self, tenant: Tenant | None, request_id: str, estimate: Estimate, body_bytes: int,
        pick: Picker | None = None,
    ) -> Decision:
        """Decide one request. ``pick`` chooses the node once every other check passed (a capacity
        check: it returns the node, or why no node can take the request and when one may)."""
        now = self._clock()
        if tenant is None:
            state = self._tenants[UNKNOWN_TENANT]
            rejection: Rejection | None = UNKNOWN_KEY
        else:
            state = self._tenants.get(tenant.name) or self._tenants[UNKNOWN_TENANT]
            rejection = self._check(state, estimate, body_bytes, now)
        node: str | None = None
        if pick is not None and (rejection is None or state.mode == "shadow"):
            if rejection is None:
                node, why, wait = pick(estimate, False)
                if node is None:
                    rejection = self.no_node(why, wait)
            if node is None and state.mode == "shadow":
                node = pick(estimate, True)[0]  # shadow: admitted all the same, on the least bad node
        if rejection is not None and (state.mode == "enforce" or (pick is not None and node is None)):
            return Decision(state.name, state.config.tier, None, rejection)
        lease = self._grant(state, request_id, estimate, now, charged=rejection is None)
        lease.node = node
        return Decision(state.name, state.config.tier, lease, rejection)

    def _check(self, s: TenantState, est: Estimate, body_bytes: int, now: float) -> Rejection | None:
        q = s.config
        limits = self.config.limits
        if body_bytes > limits.max_body_bytes:
            return Rejection(
                413, "body-too-large", "invalid",
                f"Request body is {body_bytes} bytes; the limit is {limits.max_body_bytes} bytes.",
            )
        if q.max_prompt_tokens is not None and est.prompt_tokens > q.max_prompt_tokens:
            return Rejection(
                400, "prompt-too-long", "invalid",
                f"The prompt is about {est.prompt_tokens} tokens; this tenant's limit is "
                f"{q.max_prompt_tokens} tokens. Shorten the prompt.",
            )
        if q.max_context_tokens is not None and est.total > q.max_context_tokens:
            return Rejection(
                400, "context-too-long", "invalid",
                f"The prompt (about {est.prompt_tokens} tokens) plus the requested output "
                f"({est.output_tokens} tokens) exceeds this tenant's context limit of "
                f"{q.max_context_tokens} tokens. Lower max_tokens or shorten the prompt.",
            )
        if s.tokens is not None and est.total > s.tokens.capacity:
            return Rejection(
                400, "exceeds-token-budget", "invalid",
                f"This request would cost about {est.total} tokens, more than this tenant's whole "
                f"token budget of {int(s.tokens.capacity)}; it can never be admitted as it is.",
            )
        if q.max_concurrent is not None and s.inflight >= q.max_concurrent:
            wait = self._expected_free(s.leases, s.mean_seconds, now)
            return self._policy(
                s, "tenant-concurrency",
                f"Too many concurrent requests for this tenant (limit {q.max_concurrent}).", wait, est, now,
            )
        if s.requests is not None:
            wait = s.requests.seconds_until(1, now)
            if wait > 0:
                return self._policy(
                    s, "tenant-requests",
                    f"Rate limit reached for requests (limit {int(s.requests.rate * 60)}/min).", wait, est, now,
                )
        if s.tokens is not None:
            wait = s.tokens.seconds_until(est.total, now)
            if wait > 0:
                return self._policy(
                    s, "tenant-tokens",
                    f"Rate limit reached for tokens (limit {int(s.tokens.rate * 60)}/min; this request "
                    f"reserves about {est.total}).", wait, est, now,
                )
        cap = self.config.fleet.max_inflight
        if cap is not None and self.inflight >= cap:
            wait = self._expected_free(self._leases, self._mean_seconds, now)
            return Rejection(
                503, "fleet-inflight", "capacity",
                "The inference fleet is at capacity; please retry after the indicated time.",
                self.jittered(wait),
            )
        return None

    def _policy(
        self, s: TenantState, reason: str, message: str, wait: float, est: Estimate, now: float
    ) -> Rejection:
        return Rejection(
            429, reason, "policy", message, self.jittered(wait),
            _view(s.requests, now), _view(s.tokens, now),
        )

    def _expected_free(self, leases: dict[str, Lease], mean: float | None, now: float) -> float:
        """When the oldest charged lease is expected to end, from the mean request duration."""
        expected = mean if mean is not None else self.config.retry.default_request_seconds
        for lease in leases.values():
            if lease.charged:
                return max(0.0, lease.started + expected - now)
        return expected

    def no_node(self, reason: str | None, wait: float | None) -> Rejection:
        """The capacity rejection when node choice finds no node (``wait``: when one may have room)."""
        return Rejection(
            503, reason or "fleet-no-healthy-node", "capacity",
            "No inference node can take this request now; please retry after the indicated time.",
            self.jittered(wait if wait is not None else self.config.retry.default_request_seconds),
        )

    def jittered(self, seconds: float) -> float:
        """A Retry-After: at least retry.min_ms, stretched by up to retry.jitter."""
        r = self.config.retry
        seconds = max(seconds, r.min_ms / 1000.0)
        return seconds * (1.0 + self._rng.uniform(0.0, r.jitter))

    def _grant(self, s: TenantState, request_id: str, est: Estimate, now: float, charged: bool) -> Lease:
        self._seq += 1
        lease = Lease(f"{self._boot}-{self._seq}", s, request_id, est.total, est.prompt_tokens, now, charged)
        self._leases[lease.ticket] = lease
        if charged:
            s.inflight += 1
            s.leases[lease.ticket] = lease
            self.inflight += 1
            if s.requests is not None:
                s.requests.take(1, now)
            if s.tokens is not None:
                s.tokens.take(est.total, now)
        return lease

    # -- completion ------------------------------------------------------------------------------

    def complete(self, ticket: str, usage: Usage | None, responded: bool) -> Completion | None:
        """Release a lease exactly once and reconcile its tokens.

        ``responded``: the upstream produced a response, so tokens were spent even if no usage was
        reported (a stream cut by the client): then the whole reservation is charged, so cutting a
        stream never makes a request cheaper. With no response at all nothing is charged.
        Returns None for a ticket that is unknown or already released.
        """
        lease = self._leases.pop(ticket, None)
        if lease is None:
            return None
        now = self._clock()
        self._uncertain.pop(lease.request_id, None)
        charged_tokens = usage.total if usage is not None else (lease.reserved_tokens if responded else 0)
        s = lease.tenant
        if lease.charged:
            s.inflight -= 1
            s.leases.pop(ticket, None)
            self.inflight -= 1
            if s.tokens is not None:
                s.tokens.give(lease.reserved_tokens - charged_tokens, now)
        seconds = now - lease.started
        if responded:
            s.mean_seconds = _ewma(s.mean_seconds, seconds)
            self._mean_seconds = _ewma(self._mean_seconds, seconds)
        return Completion(lease, charged_tokens, usage, seconds)

    def mark_uncertain(self, ticket: str) -> None:
        """The admit reply was sent but its stream broke: Envoy may not have applied it.

        If the request never went upstream, its access-log entry carries the request id but no
        ticket; ``complete_request_id`` then releases the lease.
        """
        lease = self._leases.get(ticket)
        if lease is not None:
            self._uncertain[lease.request_id] = ticket

    def complete_request_id(self, request_id: str) -> Completion | None:
        ticket = self._uncertain.pop(request_id, None)
        return None if ticket is None else self.complete(ticket, None, responded=False)

    def reclaim_expired(self) -> list[Completion]:
        """Release leases whose completion never arrived (lost access log): the last line of defence."""
        horizon = self._clock() - self.config.server.lease_timeout_seconds
        expired = [t for t, lease in self._leases.items() if lease.started < horizon]
        out = []
        for t in expired:
            c = self.complete(t, None, responded=True)
            if c is not None:
                out.append(c)
        return out

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def tenants(self) -> list[TenantState]:
        return list(self._tenants.values())


Picker = Callable[[Estimate, bool], tuple[str | None, str | None, float | None]]
"""(estimate, shadow) → (node, reason when none, seconds until one may have room). In shadow mode the
picker must return a node whenever any is alive, whatever its load."""


def _ewma(prev: float | None, x: float) -> float:
    return x if prev is None else prev + EWMA_ALPHA * (x - prev)


def _retuned(b: TokenBucket | None, per_minute: float | None, burst: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if b is None:
        return _bucket(per_minute, burst, now)
    b.retune(per_minute, burst if burst is not None else per_minute, now)
    return b


def _view(b: TokenBucket | None, now: float) -> RateLimitView | None:
    if b is None:
        return None
    return RateLimitView(int(b.rate * 60), max(0, math.floor(b.available(now))), b.seconds_until_full(now))
