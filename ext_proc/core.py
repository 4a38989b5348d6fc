"""The gateway core: one sans-IO state machine that the gRPC server and the virtual-time benchmarks drive.

Events in — a request (``decide``), the end of a request's stream (``ended``), a queued request's
client leaving (``cancel``), a probe reading (``snapshot``), the node list (``set_nodes``), a tick, a
reload (``reconfigure``), an Envoy appearing or going away (``envoy_up`` / ``envoy_down``). Effects out
— an :class:`Answer` per decided request (right away, or later through :meth:`answers` for requests
that waited in the queue), metrics in :class:`Stats`, structured log lines, and breaker transitions
through an observer. The core never blocks, never reads a clock of its own and never does I/O:
``ext_proc/server.py`` (grpc.aio) and ``kvgate/bench/scenarios/driver.py`` (virtual time) are thin shells
around it, so the benchmarks exercise exactly the glue production runs.

Every request ends exactly once. The ways a lease (a request holding its tenant's quota and a node
slot) can end, and which event ends it:

* the access log reports the stream's end with the ticket kvgate gave it (normal end, upstream
  error, client disconnect) → ``ended(ticket=...)``;
* Envoy never applied the admit reply (it gave up waiting, the client left first) → the access log
  entry carries the request id but no ticket → ``ended(ticket=None, request_id=...)``;
* the Envoy carrying it went away (its access-log connection ended and did not come back within
  ``ENVOY_GRACE_S``) → released by :meth:`tick`; with several replicas only one may hold that
  connection, so it tells the others through the store (``gone_out`` → :meth:`envoy_gone_elsewhere`);
* nothing ever came (a lost log entry) → reclaimed after ``server.lease_timeout_seconds``.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_probe.snapshot import Snapshot

from . import logs
from .admission import UNKNOWN_TENANT, Admission, Completion, Decision, Outcome, Placed, Usage
from .bounds import Expiring, shown
from .breaker import State, open_cause
from .budgets import Account
from .config import Config, Tenant
from .document import dumps
from .estimate import Estimate, Estimator
from .identity import Identifier
from .intake import Intake, charge_for
from .nodes import Fleet, Level
from .pools import NO_POOL, Router, model_id
from .prefix import chain_of
from .reasons import UNKNOWN_KEY, Invalid, Rejection, reject
from .stats import Stats
from .wire import Reply, json_reply, reject_reply

ENVOY_GRACE_S = 3.0
GONE_OUT_MAX = 256
"""How long an Envoy's access-log connection may stay away before the requests it carried are taken
as dead (an Envoy restart takes longer than this to come back; a kvgate-side blip does not)."""
RECLAIM_EVERY_S = 10.0
TOMBSTONE_S = 60.0
"""How long the end of a request that was never admitted is remembered: its decision may still be on
its way (kvgate was paused, Envoy gave up and logged the end first) and must then grant nothing."""
MAX_TOMBSTONES = 50_000
"""At most this many are remembered (~150 B each with its request id: ~7 MB), the oldest forgotten
first: every client disconnect before a decision makes one, on every replica. A decision that arrives
after its tombstone was forgotten is admitted and its lease reclaimed after
``server.lease_timeout_seconds``."""


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the shells see it."""

    path: str
    request_id: str
    authorization: str | None
    body: bytes = b""
    trusted: str | None = None
    """The trusted tenant header's value, when one is configured."""
    envoy: str = ""
    """Which Envoy carries the request (the shell's name for its connection): its leases die with it."""
    estimate: Estimate | None = None
    """Virtual time only: the request's token counts are known, there is no body to read."""
    body_bytes: int | None = None
    """With ``estimate``: the size the body would have had."""


@dataclass(frozen=True, slots=True)
class Answer:
    """kvgate's final word on one request: admit it (``reply`` None) or answer ``reply``."""

    request_id: str
    decision: Decision
    reply: Reply | None = None
    body: bytes | None = None
    """The rewritten request body, when kvgate changed it (include_usage, priority)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What Envoy's side needs (dynamic metadata ``kvgate``): ticket, endpoint, strip_usage, tenant."""
    held: str | None = None
    """For the answer to a queued request: the ticket its :class:`Held` named (admitted or not)."""
    waited_for_room: bool = False
    """For a queued request admitted: it waited for room (``Outcome.for_room``), not only behind others."""
    pool: str = NO_POOL
    """The pool the request was routed to (``none``: refused before routing)."""

    @property
    def ticket(self) -> str | None:
        return self.decision.lease.ticket if self.decision.lease is not None else None


@dataclass(frozen=True, slots=True)
class Held:
    """The request waits in the gateway queue; its :class:`Answer` comes out of :meth:`Core.answers`."""

    ticket: str
    request_id: str
    tier: str
    max_wait_s: float


@dataclass(frozen=True, slots=True)
class Borrow:
    """Several replicas: this replica's slice of the tenant's limits cannot pay for the request, the
    fleet's may. The shell borrows from the store (one round trip) and calls ``decide`` again with
    ``borrowed=True``, which then admits, queues or refuses it."""

    request: Request
    """The request with its estimate filled in: deciding it again does not parse it again."""
    tenant: str
    also: str | None = None
    """A second name to borrow for at once: the tenant's per-model budget (``tenant/model``)."""


@dataclass(frozen=True, slots=True)
class Ended:
    """A request's stream ended (Envoy's access log)."""

    ticket: str | None
    request_id: str
    status: int = 0
    usage: Usage | None = None
    upstream_answered: bool = False
    """The node sent a first byte."""
    disconnected: bool = False
    """The client went away (Envoy's DC flag)."""
    credentials: tuple[str | None, str | None] | None = field(default=None, repr=False)
    """(Authorization, trusted header) of the request as Envoy's access log saw them; None: not known
    (an Envoy config that does not log them, an end another replica forwarded)."""
    tail_s: float = 0.0
    """Seconds between the node's last byte and the client's (Envoy's time to its last byte sent downstream less
    its time to the last byte received upstream): a client that reads its stream slowly, or holds it open,
    holds its slot longer (the tenant's durations count it) but is not the fleet's time, which its
    ``fleet_seconds`` and pace read without it (attack110 M1)."""


@dataclass(slots=True)
class _Waiting:
    request_id: str
    estimate: Estimate
    envoy: str
    chain: tuple[int, ...] | None = None
    """Its prompt's prefix chain, once a placement attempt computed it (``Core._chain``)."""


Observer = Callable[[str, State, State, str], None]


class Core:
    def __init__(self, config: Config, clock: Callable[[], float], rng: random.Random | None = None,
                 stats: Stats | None = None, log: Any = None, on_transition: Observer | None = None,
                 wall: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self.log = log if log is not None else logs.get("kvgate.core")
        self.stats = stats if stats is not None else Stats(max_tenant_labels=config.metrics.max_tenant_labels)
        self._observer = on_transition
        self.admission = Admission(config, clock, rng=random.Random(self._rng.getrandbits(32)), wall=wall)
        self.fleets: dict[str, Fleet] = {}
        """Each pool's nodes (``pools.py``), by pool name; none for a pool whose nodes Envoy picks."""
        self.router = Router(config, random.Random(self._rng.getrandbits(32)))
        self._waiting: dict[str, _Waiting] = {}
        """Queued requests: ticket → what their answer needs."""
        self._outbox: list[Answer] = []
        self._by_request: dict[str, str] = {}
        """Request id → ticket of every open lease: an access-log entry without a ticket names it."""
        self._envoy_of: dict[str, str] = {}
        """Ticket → the Envoy that carries it."""
        self._envoys: dict[str, int] = {}
        """Envoys with an open access-log connection → how many."""
        self._gone: dict[str, float] = {}
        """Envoys whose access-log connections all ended → when."""
        self.gone_out: deque[str] = deque(maxlen=GONE_OUT_MAX)
        """Envoys found gone here, for the store to tell the other replicas (they may hold requests it
        carried but not its access-log connection); bounded, as nothing drains it with one replica."""
        self._next_reclaim = clock() + RECLAIM_EVERY_S
        self._ambiguous: set[str] = set()
        """Request ids more than one open lease carried (ids chosen by clients): never released by id."""
        self._fresh: tuple[str, tuple[int, ...]] | None = None
        """The prefix chain a placement attempt of the request being decided computed (``_chain``)."""
        self._tombstones: Expiring[str] = Expiring(TOMBSTONE_S, MAX_TOMBSTONES)
        """Request ids whose end arrived before any lease: Envoy gave up on them."""
        self._reject_log = logs.Sampler(config.logs.reject_interval_seconds)
        """Repeated refusals folded into one log line per interval (the metrics count each)."""
        self._pumping = False
        """The gateway queue is being pumped: a no-node answer's Retry-After goes nowhere (``_pump``)."""
        self._later: Callable[[Callable[[], None]], None] | None = None
        """Set by :meth:`pump_once_per_turn`: how a pump is put off to the end of the loop turn."""
        self.prefill_seconds: dict[str, float] = {}
        """Pool → prefill seconds sent to its nodes so far (``kvgate_prefill_seconds_total``; the
        virtual-time benchmarks' scaler reads it here)."""
        self._prefill_counters: dict[str, Any] = {}
        """Pool → its ``kvgate_prefill_seconds_total`` child (made once per pool, not per request)."""
        self._pump_due = False
        """A put-off pump is scheduled and has not run yet."""
        self.breaker_opens: dict[str, int] = {}
        """Breaker opens by cause (kv | latency | trial): what the benchmarks report."""
        self.admission.spend.on_shadow = self._budget_shadow
        self.stats.bind(self)
        self.reconfigure(config)

    # -- configuration ---------------------------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """Swap in a new config; leases, spent budgets, queued requests and node readings stay."""
        self.config = config
        self._reject_log.interval_s = config.logs.reject_interval_seconds
        before = self._addresses()
        self.identifier = Identifier(config)
        self.estimator = Estimator(config.estimation, config.limits)
        self.intake = Intake(config, self.identifier, self.estimator, self.admission.precheck)
        self.router = Router(config, self.router.rng)
        self.admission.reconfigure(config, self.router.pools)
        fleets: dict[str, Fleet] = {}
        levels = [Level(self._level(name), t.ttft_target_ms / 1000.0 if t.ttft_target_ms else None)
                  for name, t in config.tiers.items()]
        for pool in self.router.pools:
            if pool.nodes is None:
                continue
            f = self.fleets.get(pool.name)
            if f is None:
                f = Fleet(pool.nodes, rng=random.Random(self._rng.getrandbits(32)),
                          on_transition=self._observer_for(pool.name))
            else:
                f.reconfigure(pool.nodes)
            f.set_levels(levels)
            f.adapters = frozenset(pool.adapters)
            fleets[pool.name] = f
            for warning in pool.nodes.deprecations():
                self.log.warning("config_deprecated", pool=pool.name, note=warning)
        self.fleets = fleets
        self._fleet_of: dict[str, Fleet] = {a: f for f in fleets.values() for a in f.nodes}
        """Node address → its pool's fleet (addresses are unique across pools)."""
        for address, pool_name in before - self._addresses():
            self.stats.forget_node(address, pool_name)
        self.admission.pick = self._pick if fleets else None
        self.admission.floor = self._floor if fleets else None
        self.stats.set_tenants([t.name for t in config.tenants], config.metrics.max_tenant_labels)
        if config.queue.enabled:
            # the scaler reads this counter with PromQL's increase(), which misses a series' first
            # increment: each tier and pool starts at 0 (review15)
            for pool in self.router.pools:
                for tier in config.tiers:
                    self.stats.queue_waited_for_room.labels(tier, pool.name)
        for name in fleets:  # (the same for the prefill the scaler's scale-down bound reads: review51 F3)
            self._prefill_counter(name)
        self._pump()

    def _addresses(self) -> set[tuple[str, str]]:
        """(node address, pool) of every node known now."""
        return {(a, p) for p, f in self.fleets.items() for a in f.nodes}

    @property
    def fleet(self) -> Fleet | None:
        """The first pool's nodes (the only pool's, without ``pools``): what single-pool callers read."""
        return next(iter(self.fleets.values()), None)

    def pool_fleet(self, pool: str) -> Fleet | None:
        return self.fleets.get(pool)

    def _node_fleet(self, address: str) -> Fleet | None:
        f = self._fleet_of.get(address)
        if f is None or address not in f.nodes:
            f = next((f for f in self.fleets.values() if address in f.nodes), None)
            if f is not None:
                self._fleet_of[address] = f
        return f

    # -- the decision ----------------------------------------------------------------------------

    def decide(self, req: Request, borrowed: bool = False) -> Answer | Held | Borrow:
        """Decide one inference request now, or hold it in the queue (its answer comes later), or
        (several replicas) ask the shell to borrow from the store first (:class:`Borrow`)."""
        if self._tombstones and req.request_id in self._tombstones:
            # Envoy already gave up on it (and said so): whatever kvgate answers goes nowhere
            return self._final(self._refusal(None, reject("gateway-unavailable",
                                                          "Envoy gave up waiting for this decision.")), req.request_id)
        size = req.body_bytes if req.body_bytes is not None else len(req.body)
        # identity → the gates that need no body → the bounded parse (``intake.py``)
        taken = self.intake.take(req.authorization, req.trusted, req.path, req.body, size, req.estimate)
        tenant, est = taken.tenant, taken.estimate
        if est is None:
            # a quota refusal at the gates is labelled with the pool when that needs no body (one pool);
            # with several, the body's model would say which: "none", as for a request refused unread
            pool_name = self.router.pools[0].name if taken.gated and self.router.single else None
            return self._final(self._refusal(tenant, taken.rejection), req.request_id, pool=pool_name)
        pool = self.router.route(est.model)
        if pool is None:
            return self._read_refused(req, tenant, size, self._final(self._refusal(tenant, self._unrouted(est)),
                                                                     req.request_id))
        refused = None
        if not self.router.allowed(tenant, est.model):
            refused = reject("model-not-allowed", f"This API key may not use the model {shown(est.model or '')}.",
                             param="model")
        if est.pool != pool.name:
            # (the constructor, not ``dataclasses.replace``: a third of the cost, once per request)
            est = Estimate(est.prompt_tokens, est.output_tokens, est.parsed, est.stream, est.include_usage,
                           est.document, est.continuous_usage, est.route, est.prefix, est.model, pool.name)
        never = self._never_fits(est)
        if never is not None:
            return self._read_refused(req, tenant, size,
                                      self._final(self._refusal(tenant, never), req.request_id, pool=pool.name))
        if not est.parsed:
            self.stats.unparsed_bodies.inc()
            self.log.info("body_not_json", request_id=req.request_id, bytes=size,
                          note="decided on request size alone")
        self._fresh = None
        d = self.admission.decide(tenant, req.request_id, est, size, borrowed, refused)
        fresh, self._fresh = self._fresh, None
        if d.borrow:
            return Borrow(replace(req, body=b"", estimate=est, body_bytes=size), d.tenant, d.borrow_also)
        if d.queued:
            assert d.lease is not None
            ticket = d.lease.ticket
            self._waiting[ticket] = _Waiting(req.request_id, est, req.envoy,
                                             fresh[1] if fresh is not None and fresh[0] == ticket else None)
            self.log.debug("queued", request_id=req.request_id, tenant=d.tenant, tier=d.tier,
                           queued=self.admission.queued)
            self._pump()  # an eviction it caused
            tier = self.config.tiers.get(d.tier)
            until = self.admission.spare_deadline(ticket)
            if until is not None:  # best effort waiting: answered by its hold (the lowest tier's), not its tier's
                return Held(ticket, req.request_id, d.tier, max(0.0, until - self._clock()))
            return Held(ticket, req.request_id, d.tier, tier.max_queue_wait_ms / 1000.0 if tier else 5.0)
        return self._read_refused(req, tenant, size, self._final(d, req.request_id, est, req.envoy))

    def _read_refused(self, req: Request, tenant: Tenant | None, size: int, a: Answer) -> Answer:
        """A body read and then refused as one that can never succeed (too long for the tenant or any
        node, a model nobody serves or it may not use): the reading is charged to the sender, as a
        refusal inside intake is (``intake.charge_for``) — or a tenant could make this replica parse
        4 MB bodies without end (red team: 674 in 9 s, 11 ms each, none counted)."""
        r = a.decision.rejection
        if r is not None and tenant is not None and req.estimate is None and r.klass in ("invalid", "auth") \
                and not a.decision.admitted:
            self.admission.precheck(tenant, size, charge=charge_for(size))
        return a

    def _unrouted(self, est: Estimate) -> Rejection:
        """No pool serves the request: 404 for a model nobody serves, 400 for a request naming none
        (with several pools kvgate cannot tell where it goes). Never a 503: it can never succeed."""
        if est.model is not None:
            return reject("model-not-found", f"The model {shown(est.model)} does not exist on this gateway.",
                          param="model")
        if not est.parsed:
            return reject("invalid-body", "The request body is not JSON: this gateway serves several models "
                          "and routes each request by its 'model'.")
        return reject("invalid-parameter", "'model' is required (a string naming the model): this gateway "
                      "serves several models.", param="model")

    def _refusal(self, tenant: Tenant | None, rejection: Rejection | None) -> Decision:
        """A decision taken before the admission core (who is asking, what the request is), accounted
        to the tenant when it is known and to ``unknown`` in the lowest tier when not."""
        if tenant is None:
            return Decision(UNKNOWN_TENANT, self.config.lowest_tier, None, rejection, identified=False)
        return Decision(tenant.name, tenant.tier, None, rejection)

    def _never_fits(self, est: Estimate) -> Rejection | None:
        """A request larger than the KV cache of every node can never run: 400, not a 503 the clients
        and the scaler would take for demand."""
        f = self.fleets.get(est.pool)
        if f is None:
            return None
        cap = f.max_capacity_tokens()
        if cap is None or est.total <= cap:
            return None
        return reject("context-too-long",
                      f"The prompt (about {est.prompt_tokens} tokens) plus the requested output "
                      f"({est.output_tokens} tokens) is larger than the KV cache of any inference node "
                      f"({cap} tokens). Lower max_tokens or shorten the prompt.",
                      param="max_tokens" if est.prompt_tokens <= cap else "messages")

    def _final(self, d: Decision, request_id: str, est: Estimate | None = None, envoy: str = "",
               pool: str | None = None) -> Answer:
        """Account a final decision and build its answer."""
        if pool is None:
            pool = est.pool if est is not None and est.pool else NO_POOL
        self.stats.decision(d, pool)
        self.admission.tally(d, pool, self._clock())
        r = d.rejection
        if r is not None:
            event = "shadow_reject" if d.admitted else "reject"
            folded = self._reject_log.take((event, d.tenant, r.reason, pool), self._clock())
            if folded is not None:
                self.log.info(event, request_id=request_id, tenant=d.tenant, tier=d.tier, status=r.status,
                              reason=r.reason, cls=r.klass, pool=pool,
                              retry_after_s=None if r.retry_after is None else round(r.retry_after, 3),
                              estimated_tokens=est.total if est is not None else None,
                              **({"folded": folded} if folded else {}))
        over = d.best_effort
        if over is not None:
            # its own line (and decision label): a tenant over its limit that the fleet's spare room served
            n = self._reject_log.take(("best_effort", d.tenant, over.reason, pool), self._clock())
            if n is not None:
                self.log.info("best_effort", request_id=request_id, tenant=d.tenant, tier=d.tier, over=over.reason,
                              pool=pool, runs_as=self.config.lowest_tier, **({"folded": n} if n else {}))
        lease = d.lease
        if lease is None:
            assert r is not None
            return Answer(request_id, d, reject_reply(r), pool=pool)
        if request_id:
            # two open requests with one id (an id the client chose): neither is released by id
            if request_id in self._by_request:
                self._by_request[request_id] = ""
                self._ambiguous.add(request_id)
            else:
                self._by_request[request_id] = lease.ticket
        if envoy:
            self._envoy_of[lease.ticket] = envoy
        body, strip = self._rewrite(est, self.admission.runs_as(lease))
        meta: dict[str, Any] = {"ticket": lease.ticket, "strip_usage": strip, "tenant": d.tenant, "tier": d.tier}
        if lease.budget is not None:
            meta["budget"] = lease.budget.name  # another replica's access log gives its slot back too
        if est is not None and est.parsed and not est.stream:
            meta["buffered"] = True  # the answer comes whole: Envoy's longer first-byte timeout applies
        if lease.best_effort:
            meta["best_effort"] = True
        elif lease.stretched:
            meta["stretched"] = True  # on its tenant's cap's stretch: it holds no slot of the tenant's
            lease.tagged = True  # what the access log will say, whatever slot it takes over later
        if lease.node is not None:
            meta["endpoint"] = lease.node  # the Lua helper turns it into the ORIGINAL_DST header
        if self.admission.spend.accounts and (left := self.admission.budget_left(d.tenant)) is not None:
            meta["budget_remaining"] = left  # the Lua helper puts it on the response
        return Answer(request_id, d, None, body, meta, pool=pool)

    def _budget_shadow(self, a: Account, need: float, left: float) -> None:
        """A shadow spend budget would have refused a request (it was admitted): logged, folded per
        tenant and budget like the other refusals (``kvgate_budget_refusals_total`` counts each)."""
        # (the key's shape is the other refusals': event, tenant, reason — here the budget —, pool)
        folded = self._reject_log.take(("budget_shadow_reject", a.tenant, a.budget.name, NO_POOL), self._clock())
        if folded is not None:
            self.log.info("budget_shadow_reject", tenant=a.tenant, budget=a.budget.name, worst_case=round(need, 6),
                          left=round(left, 6), limit=a.budget.limit, **({"folded": folded} if folded else {}))

    def _rewrite(self, est: Estimate | None, tier_name: str) -> tuple[bytes | None, bool]:
        """The body kvgate sends on: usage asked for (so completions can be reconciled) and the tier's
        vLLM priority. None when nothing changes (the body passes through untouched)."""
        doc = est.document if est is not None else None
        if doc is None or est is None:
            return None, False
        strip = est.stream and not est.include_usage
        mutated = False
        if strip:
            opts = doc.get("stream_options")
            new = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
            if new.get("continuous_usage_stats"):
                # vLLM sends continuous usage only with include_usage: the client would get usage on every
                # chunk it never asked for
                new["continuous_usage_stats"] = False
            doc["stream_options"] = new
            mutated = True
        tier = self.config.tiers.get(tier_name)
        if self.config.queue.inject_priority and tier is not None:
            doc["priority"] = tier.vllm_priority if tier.vllm_priority is not None else tier.priority
            mutated = True
        cap = self.config.limits.max_output_tokens
        if cap is not None and est.route in _OUTPUT_CAPS and all(doc.get(k) is None for k in _OUTPUT_CAPS[est.route]):
            # no output cap in the body: vLLM would generate up to the model's context, past the
            # gateway's limits.max_output_tokens (red team: 4,700 tokens past a cap of 4,096)
            doc[_OUTPUT_CAPS[est.route][0]] = cap
            mutated = True
        return (dumps(doc) if mutated else None), strip

    def headers(self, authorization: str | None, trusted: str | None = None, path: str = "") -> Answer:
        """Bodyless routes (GET /v1/models, /health): identity only, no quota; a live node when kvgate
        chooses nodes. With several pools kvgate answers GET /v1/models itself: the models the caller
        may use (a node knows only its own)."""
        try:
            tenant = self.identifier.resolve(authorization, trusted).tenant
        except Invalid as e:
            return Answer("", self._refusal(None, e.rejection()), reject_reply(e.rejection()))
        if tenant is None and self.config.mode == "enforce":
            return Answer("", self._refusal(None, UNKNOWN_KEY), reject_reply(UNKNOWN_KEY))
        d = self._refusal(tenant, None)
        bare = path.split("?", 1)[0].rstrip("/")
        name = ""
        if bare.startswith("/v1/models") and bare != "/v1/models":
            # the name cap holds whoever answers, kvgate or the node (red team: with one pool a
            # 300-character id was passed on)
            got = model_id(bare, self.config.limits.max_model_name_chars)
            if isinstance(got, Rejection):
                return Answer("", self._refusal(tenant, got), reject_reply(got))
            name = got
        if bare.startswith("/v1/models") and (not self.router.single or (tenant is not None and tenant.models)):
            # kvgate knows which models the caller may use (a node knows only its own, and all of them)
            if bare == "/v1/models":
                return Answer("", d, json_reply(200, self.router.listing(tenant)))
            model = self.router.model_entry(tenant, name)
            if model is None:
                r = reject("model-not-found", "The model does not exist on this gateway.", param="model")
                return Answer("", self._refusal(tenant, r), reject_reply(r))
            return Answer("", d, json_reply(200, model))
        meta: dict[str, Any] = {"tenant": d.tenant}
        chosen = None
        for f in self.fleets.values():  # any pool with a live node answers /health
            chosen = f.choose(0, self._clock(), force=True)
            if chosen.node is not None:
                break
        if chosen is not None:
            if chosen.node is None:
                r = self.admission.no_node(chosen.reason, chosen.retry_after)
                return Answer("", self._refusal(tenant, r), reject_reply(r))
            meta["endpoint"] = chosen.node.address
        return Answer("", d, None, None, meta)

    # -- the queue -------------------------------------------------------------------------------

    def answers(self) -> list[Answer]:
        """Answers for queued requests decided since the last call."""
        out, self._outbox = self._outbox, []
        return out

    def pump_once_per_turn(self, later: Callable[[Callable[[], None]], None]) -> None:
        """Pump the gateway queue at most once per event-loop turn: ``later(run)`` must call ``run``
        after the events at hand (the live shell passes ``loop.call_soon``), and every event that would
        pump asks for one scheduled run instead.

        Why: with requests waiting, every event — a probe reading, a decision, a completion — may free
        room, and a pump runs a node choice per tier. Under load, events arrive in bursts that one loop
        turn handles together (a thousand probes' readings, a batch of access-log entries); one pump
        after the burst sees all of them and decides the same requests for a fraction of the CPU. The
        virtual-time driver does not call this: it pumps after each event, as before, so its runs stay
        reproducible event by event. Answers a put-off pump decides are in :meth:`answers` once ``run``
        returned."""
        self._later = later

    def _pump(self) -> None:
        if self._later is not None:
            if not self._pump_due and (self.admission.queued or self.admission.has_outcomes):
                self._pump_due = True
                self._later(self._pump_later)
            return
        self._pump_now()

    def _pump_later(self) -> None:
        self._pump_due = False
        self._pump_now()

    def _pump_now(self) -> None:
        if self.admission.queued or self.admission.has_outcomes:
            # (while the queue is pumped, a request no node can take only blocks its tier: no Retry-After
            # is asked of node choice, which would walk the whole fleet for it — ``_pick``)
            self._pumping = True
            try:
                outcomes = self.admission.pump()
            finally:
                self._pumping = False
            self._deliver(outcomes)

    def _deliver(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            d = o.decision
            self.stats.queue_wait.labels(d.tier, "admitted" if d.admitted else "rejected", o.pool).observe(o.waited)
            if d.admitted and o.for_room:
                self.stats.queue_waited_for_room.labels(d.tier, o.pool).inc()
            if d.rejection is not None and d.rejection.status == 503:
                # (a best-effort request that waited for room in vain gets its 429: the tenant's excess,
                # not the queue's refusal)
                self.stats.queue_rejections.labels(d.tier, d.rejection.reason, o.pool).inc()
            w = self._waiting.pop(o.ticket, None)
            if w is None:
                continue
            a = replace(self._final(d, w.request_id, w.estimate, w.envoy), held=o.ticket,
                        waited_for_room=d.admitted and o.for_room)
            if a.decision.admitted and w.request_id in self._tombstones:
                # its end was already reported (the client left while it waited): nothing will end it
                self._release(o.ticket, None, False, "aborted", None)
            self._outbox.append(a)

    def cancel(self, ticket: str) -> None:
        """The stream of a queued request ended before its answer (the client or Envoy gave up)."""
        w = self._waiting.pop(ticket, None)
        tier = self.admission.held_tier(ticket)
        pool = w.estimate.pool if w is not None and w.estimate.pool else NO_POOL
        if self.admission.cancel(ticket):
            self.stats.queue_cancelled.labels(tier or "unknown", pool).inc()
            self.log.info("queued_request_cancelled", ticket=ticket,
                          request_id=w.request_id if w else None, note="the client went away while queued")
            self._pump()

    # -- completions -----------------------------------------------------------------------------

    def ended(self, e: Ended) -> Completion | None:
        """A request's stream ended; releases its lease exactly once (None: nothing to release)."""
        if e.ticket:
            ticket: str | None = e.ticket
            responded = e.upstream_answered and 200 <= e.status < 300
            if e.usage is not None:
                outcome = "ok"
            elif e.disconnected:
                outcome = "disconnect"
            elif responded:
                outcome = "no_usage"
            else:
                outcome = "upstream_error"
            # the node's verdict for its breaker: it answered (below 500), it failed, or we cannot tell
            verdict: bool | None
            if e.upstream_answered:
                verdict = e.status < 500
            else:
                verdict = None if e.disconnected else False
        else:
            # no ticket: Envoy never applied an admit reply (it gave up waiting, or the client left first)
            ticket = (self._by_request.get(e.request_id) or None) if e.request_id else None
            responded, outcome, verdict = False, "aborted", None
            if ticket is None and e.request_id and self._may_admit(e.credentials):
                self._tombstones.add(e.request_id, self._clock())
        if ticket is None:
            return None
        c = self._release(ticket, e.usage if e.ticket else None, responded, outcome, verdict, e.tail_s)
        if c is not None:
            self.log.debug("complete", ticket=ticket, tenant=c.lease.tenant.name, outcome=outcome,
                           tokens=c.charged_tokens, seconds=round(c.seconds, 4), status=e.status)
        return c

    def _may_admit(self, credentials: tuple[str | None, str | None] | None) -> bool:
        """Whether a decision still on its way for a request with these credentials could admit it
        (and so needs a tombstone to grant nothing). Not when, enforcing, they name no tenant: that
        decision is a 401 whatever happens — no tombstone, none forwarded to every replica (every
        unauthenticated client that leaves before its body is read made one)."""
        if credentials is None or self.config.mode != "enforce":
            return True
        try:
            return self.identifier.resolve(*credentials).tenant is not None
        except Invalid:
            return False

    def tombstoned(self, request_id: str) -> bool:
        """Whether the end of ``request_id`` is remembered as that of a request never admitted."""
        return request_id in self._tombstones

    def _release(self, ticket: str, usage: Usage | None, responded: bool, outcome: str,
                 verdict: bool | None, tail_s: float = 0.0) -> Completion | None:
        c = self.admission.complete(ticket, usage, responded, tail_s)
        if c is None:
            return None
        self._settle(c, outcome, verdict)
        self._pump()
        return c

    def _settle(self, c: Completion, outcome: str, verdict: bool | None) -> None:
        """What follows a released lease, however it ended: its indexes, metrics, its node."""
        ticket = c.lease.ticket
        if self._by_request.get(c.lease.request_id) == ticket:
            del self._by_request[c.lease.request_id]
        self._envoy_of.pop(ticket, None)
        self.stats.completion(c, outcome)
        if c.lease.node is not None:
            f = self.fleets.get(c.lease.pool) or self._node_fleet(c.lease.node)
            if f is not None:
                f.completed(c.lease.node, ticket, c.charged_tokens, verdict, self._clock(), step_end=outcome == "ok")

    # -- Envoys ----------------------------------------------------------------------------------

    def envoy_up(self, envoy: str) -> None:
        """An access-log connection from ``envoy`` opened."""
        self._envoys[envoy] = self._envoys.get(envoy, 0) + 1
        self._gone.pop(envoy, None)

    def envoy_down(self, envoy: str) -> None:
        """An access-log connection from ``envoy`` ended: if none comes back within ``ENVOY_GRACE_S``,
        the requests it carried died with it (their completions can never come)."""
        n = self._envoys.get(envoy, 0) - 1
        if n > 0:
            self._envoys[envoy] = n
            return
        self._envoys.pop(envoy, None)
        self._gone[envoy] = self._clock()

    def _release_gone_envoys(self, now: float) -> None:
        dead = [e for e, at in self._gone.items() if now - at >= ENVOY_GRACE_S]
        if not dead:
            return
        for envoy in dead:
            del self._gone[envoy]
        self.gone_out.extend(dead)
        self._release_envoys(set(dead), "its access-log connection ended and did not come back")

    def envoy_gone_elsewhere(self, envoy: str) -> None:
        """Another replica found ``envoy`` gone (its access-log connections there all ended a grace ago):
        the requests it carried from here died with it too — unless it still has an access-log
        connection open here (then it lives, and its completions come here)."""
        if envoy in self._envoys:
            return
        self._gone.pop(envoy, None)
        self._release_envoys({envoy}, "another replica saw its access-log connection end and not come back")

    def _release_envoys(self, gone: set[str], why: str) -> None:
        tickets = [t for t, e in self._envoy_of.items() if e in gone]
        for t in tickets:
            self._release(t, None, True, "envoy_gone", None)
        if tickets:
            self.log.warning("envoy_gone", envoys=sorted(gone), released=len(tickets), note=why)

    # -- nodes -----------------------------------------------------------------------------------

    def _pick(self, est: Estimate, shadow: bool, ticket: str, tier_name: str, waited: float,
              guarded: bool = False) -> Placed:
        """Node choice for one request of ``tier_name`` that already waited ``waited`` s in the gateway
        queue: its KV reserve (none for a release the queue's starvation guard owes its tier:
        ``guarded``), the vLLM priority level it runs at, what is left of its TTFT target and of its max
        wait."""
        fleet = self.fleets.get(est.pool)
        if fleet is None:  # its pool went away in a reload while it waited
            return Placed(None, "fleet-no-healthy-node")
        cfg = self.config
        tier = cfg.tiers.get(tier_name)
        reserve = tier.reserve_kv if tier is not None and not guarded else 0.0
        # with the tier's priority written into the body, vLLM runs the top tier ahead of whatever
        # waits there, so the (deprecated) caps on its own queue would only hold it back
        caps = not (cfg.queue.inject_priority and tier_name == cfg.top_tier)
        target = limit = None
        if tier is not None and tier.ttft_target_ms is not None:
            target_s, max_wait = tier.ttft_target_ms / 1000.0, tier.max_queue_wait_ms / 1000.0
            target = target_s - waited
            # ``limit``: the latest first token worth sending it for. A new arrival goes at once if a node
            # can give it one within its max wait (holding it would not make it sooner; the picker narrows
            # that to its target for a tier below the top while the top tier is active); one that was held
            # goes only while it can still make its target — it waited for room, and sending it late would
            # take the place of one that can (refused, it may retry when the fleet has room)
            limit = max(max_wait, target_s) if waited <= 0 else target
        prefix = est.prefix
        if not prefix and est.document is not None and est.output_tokens and fleet.cfg.prefix.enabled:
            prefix = self._chain(ticket, est.document, fleet)
        adapter = est.model if est.model is not None and est.model in fleet.adapters else None
        now = self._clock()
        c = fleet.place(est.total, est.prompt_tokens, ticket, now, force=shadow, reserve=reserve,
                        queue_caps=caps, priority=self._level(tier_name), target=target, limit=limit,
                        prefix=prefix, retry=not self._pumping, adapter=adapter,
                        urgent=tier_name == cfg.top_tier if cfg.queue.enabled else None, owed=guarded)
        if c.node is not None:
            self._prefill_sent(est.pool, c.node.model.b * max(0, est.prompt_tokens - c.hit) * c.node.speed.factor)
        return Placed(c.node.address if c.node else None, c.reason, c.retry_after, c.ttft)

    def _prefill_sent(self, pool: str, seconds: float) -> None:
        """Prefill compute sent to one of ``pool``'s nodes, by that node's model and speed: what the scaler
        bounds a scale-down by (a fleet of long prompts on a large model runs out of compute before KV)."""
        self.prefill_seconds[pool] = self.prefill_seconds.get(pool, 0.0) + seconds
        self._prefill_counter(pool).inc(seconds)

    def _prefill_counter(self, pool: str) -> Any:
        """``pool``'s ``kvgate_prefill_seconds_total`` child, made once (each pool's series exists from the
        start at 0: PromQL's increase() misses a series' first increment)."""
        child = self._prefill_counters.get(pool)
        if child is None:
            child = self._prefill_counters[pool] = self.stats.prefill_seconds.labels(pool)
        return child

    def _chain(self, ticket: str, document: dict[str, Any], fleet: Fleet) -> tuple[int, ...]:
        """The prompt's prefix chain, computed at placement: only for requests the quota gates let by
        (a request its token bucket or a per-model budget refuses never pays for it). A queued request
        keeps it for its next attempts (on its :class:`_Waiting`; the one being decided now, in
        ``_fresh`` until ``decide`` knows whether it waits)."""
        w = self._waiting.get(ticket)
        if w is not None and w.chain is not None:
            return w.chain
        pc = fleet.cfg.prefix
        chain = chain_of(document, pc.block_chars, pc.max_blocks_per_request)
        if w is not None:
            w.chain = chain
        else:
            self._fresh = (ticket, chain)
        return chain

    def _floor(self, est: Estimate) -> float:
        """The least time to a first token any node could give this request (its prefill alone on the
        fastest node): a held request that cannot be sent before its target minus this is refused."""
        fleet = self.fleets.get(est.pool)
        return fleet.floor_ttft(est.prompt_tokens) if fleet is not None else 0.0

    def _level(self, tier_name: str) -> int:
        """The vLLM priority a tier's requests run at: the one kvgate writes into their bodies, or 0 for
        all when it writes none (vLLM then serves them first come, first served)."""
        cfg = self.config
        tier = cfg.tiers.get(tier_name)
        if not cfg.queue.inject_priority or tier is None:
            return 0
        return tier.vllm_priority if tier.vllm_priority is not None else tier.priority

    def _observer_for(self, pool: str) -> Callable[[str, State, State, str], None]:
        return lambda node, old, new, why: self._transition(node, old, new, why, pool)

    def _transition(self, node: str, old: State, new: State, why: str, pool: str = NO_POOL) -> None:
        if new is State.OPEN:
            cause = open_cause(why)
            self.breaker_opens[cause] = self.breaker_opens.get(cause, 0) + 1
        self.stats.node_transitions.labels(node, old.value, new.value, pool).inc()
        self.log.warning("breaker_transition", node=node, pool=pool, old=old.value, new=new.value, why=why)
        if self._observer is not None:
            self._observer(node, old, new, why)

    def set_nodes(self, entries: list[tuple[str, str, float | None]], pool: str | None = None) -> None:
        """The nodes of ``pool`` (default: the first pool) now: from DNS discovery, or a benchmark's autoscaler."""
        f = self.fleet if pool is None else self.fleets.get(pool)
        if f is not None:
            # a node serves one pool: an address another pool already has (DNS answering with another
            # pool's node) is left out, or readings and bookings would go to one copy of it only
            taken = {a for other in self.fleets.values() if other is not f for a in other.nodes}
            clash = [e for e in entries if e[0] in taken]
            if clash:
                self.log.warning("node_in_two_pools", pool=pool, nodes=[e[0] for e in clash],
                                 note="left out: it already serves another pool")
                entries = [e for e in entries if e[0] not in taken]
            before = set(f.nodes)
            f.set_nodes(entries)
            name = next(p for p, other in self.fleets.items() if other is f)
            for gone in before - set(f.nodes):  # (pods churn: what each left behind goes with it)
                if self._fleet_of.get(gone) is f:
                    del self._fleet_of[gone]
                self.stats.forget_node(gone, name)
            for a in f.nodes:
                self._fleet_of[a] = f
            self._pump()

    def snapshot(self, address: str, snap: Snapshot, age_s: float = 0.0) -> None:
        """A probe reading arrived (``age_s``: how old it already was)."""
        f = self._node_fleet(address)
        if f is None:
            return
        if not math.isfinite(age_s) or age_s < 0:
            age_s = 0.0
        f.on_snapshot(address, snap, self._clock(), age_s)
        self._pump()

    # -- other replicas ------------------------------------------------------------------------------

    def owns(self, ticket: str) -> bool:
        return self.admission.owns(ticket)

    def remote(self, service: dict[str, float], dispatched: list[tuple[str, int, int, str]]) -> None:
        """What the other replicas did since their last sync: fair-share service they gave each tenant
        (added to this replica's counters: fairness holds across replicas) and requests they sent to
        nodes (booked on this replica's view of each node until a reading shows them)."""
        adm = self.admission
        now = self._clock()
        for key, delta in service.items():
            pool, _, tenant = key.rpartition("/")  # "pool/tenant"; a bare tenant: the first pool
            if adm.tenant_state(tenant) is not None and math.isfinite(delta):
                adm.queue_of(pool).charge(tenant, delta, now)
        if self.fleets and dispatched:
            for node, tokens, prompt, tier in dispatched:
                f = self._node_fleet(node)
                if f is not None:
                    f.booked_elsewhere(node, tokens, prompt, self._level(tier), now)
        self._pump()

    def shares_changed(self) -> None:
        """The store granted or took back slices: requests queued here may go now."""
        self._pump()

    def node_failed(self, address: str, why: str) -> None:
        """A probe could not be read or made no sense: the node ages towards unknown, nothing else."""
        self.log.debug("probe_failed", node=address, error=why)

    # -- time ------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Deadlines, Envoys gone, reclaim: what no other event triggers."""
        now = self._clock()
        self._pump()
        if self._gone:
            self._release_gone_envoys(now)
        for (event, tenant, reason, pool), n in self._reject_log.due(now):
            self.log.info(f"{event}_folded", tenant=tenant, reason=reason, pool=pool, folded=n,
                          note=f"{n} more like the last '{event}' line, not logged one by one")
        if now >= self._next_reclaim:
            self._next_reclaim = now + RECLAIM_EVERY_S
            self._tombstones.sweep(now)
            if self._ambiguous:
                live = {lease.request_id for lease in self.admission.leases()}
                for rid in [r for r in self._ambiguous if r not in live]:
                    self._ambiguous.discard(rid)
                    self._by_request.pop(rid, None)
            for c in self.admission.reclaim_expired():
                self._settle(c, "reclaimed", None)
                self.log.warning("lease_reclaimed", ticket=c.lease.ticket, tenant=c.lease.tenant.name,
                                 age_s=round(c.seconds, 1), note="no completion arrived from Envoy's access log")
            self._pump()

    # -- what the metrics read at scrape time ----------------------------------------------------

    def now(self) -> float:
        return self._clock()

    @property
    def queued(self) -> int:
        return self.admission.queued

    @property
    def tombstones(self) -> int:
        return len(self._tombstones)

    @property
    def open_leases(self) -> int:
        return self.admission.open_leases


_OUTPUT_CAPS: dict[str, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",),
    "responses": ("max_output_tokens",)}
"""Per generating route, the body fields that cap its output (the first is the one kvgate writes)."""


class _NullLogger:
    """Drops everything: virtual-time runs make millions of decisions."""

    def _drop(self, *args: Any, **kw: Any) -> None:
        return None

    debug = info = warning = error = exception = _drop


def null_logger() -> Any:
    return _NullLogger()
