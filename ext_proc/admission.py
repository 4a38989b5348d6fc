"""The admission decision: where every 400/413, 429 and 503 of kvgate is decided.

The rule is fixed and the order of checks follows from it:

1. *invalid* — a request that can never be served (body, prompt or context over its cap, or a
   cost larger than the tenant's whole token bucket): 400/413, retrying cannot help;
2. *policy* — the tenant is over its own quota (concurrency, requests/min, tokens/min): 429;
3. *capacity* — the fleet cannot take it now (``fleet.max_inflight``, then no node can): the request
   waits in the gateway queue (``queue.py``) for a node to have room, or gets 503 when it cannot make
   its tier's deadline, the queue is full, or the queue is off.

Policy is checked before capacity, so a tenant over its quota never counts as fleet demand: only
503s drive the autoscaler. Nothing is taken from any budget unless every check passes; a queued
request holds its tenant's quota (concurrency, tokens) and gives it back if it is rejected later.

``decide`` answers at once or says the request is queued; ``pump`` releases what fits and rejects what
timed out, and is called whenever room may have appeared (a completion, a probe reading, a tick).

Pure: no I/O, no asyncio. Time comes from an injected clock and jitter from an injected RNG; the
gRPC server and the virtual-time benchmarks drive this same class.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import NamedTuple, cast

from .budgets import BudgetBook, Refusal
from .config import Config, Mode, ModelBudget, ProtectiveLimit, Tenant
from .estimate import Estimate
from .limits import Credit, TokenBucket, default_burst
from .pools import DEFAULT_POOL, PoolSpec, Router, pools_of
from .prices import Spent
from .queue import Entry, FairQueue, TierSpec
from .quota import Bucket, LeasedQuota, Limit, LocalQuota, Quota, ShareReport, SplitQuota, whole_tokens
from .reasons import PROTECTIVE, UNKNOWN_KEY, BudgetView, RateLimitView, Rejection, reject

__all__ = ["UNKNOWN_KEY", "RateLimitView", "Rejection"]

UNKNOWN_TENANT = "unknown"
_UNKNOWN_SLOT = "\x00unknown"
"""Where callers without a known key are accounted: not a name a tenant can have, so a configured
tenant called ``unknown`` keeps its own quota."""
EWMA_ALPHA = 0.2
MIN_HOLD_S = 0.05
"""The least a request is held in the gateway queue for room (about a pump of the queue)."""
BACKFILL_TRIES = 8
"""How many requests behind a tier's head that cannot go the pump tries in its place (``_backfill``)."""
BACKFILL_WINDOW = 32
"""How many requests behind such a head it looks at (those larger than a KV room refused are not tried)."""
BACKFILL_PER_TENANT = 8
"""Of which at most this many of any one tenant."""
BACKFILL_TRIES_PER_TENANT = 4
"""Of the tries, at most this many of any one tenant until every other tenant's requests in the window were
tried (the tries left then go to the rest of its own, in order: review16): a tenant's own queue of prompts
no node can take (each a little smaller than the last, so each is tried) used every try and hid another
tenant's short requests behind them — 71 of 100 waited, and each read as waiting for room kept the scaler's scale-down
gate shut (review15). Four, not two: half of :data:`BACKFILL_TRIES`, the least that left the families'
runs as they were (two moved the bursty-onoff family's seed 1 under kvgate+scaler from 0.64 GPU-h and 88.8%
within SLO to 0.45 and 83.3%)."""
NORM_ALPHA = 0.02
"""How slowly a tenant's *norm* request duration follows: about its last 50 requests, against the
recent mean's last 5 — a fleet that slowed down shows as the recent mean pulling away from the norm."""
NORM_RISE_ALPHA = 0.002
"""How slowly the norm *rises* (about a tenant's last 500 requests; it falls at ``NORM_ALPHA``): the norm is
the tenant's duration on a healthy fleet. Rising as fast as it falls, a fleet slowed for a few dozen of
the tenant's requests became its norm — a bursty trace where slow, busy nodes held every request longer
refused 14% as concurrency 429s that no longer counted as the fleet's doing, and the scaler never
scaled (issue 30 §4). Only while the recent mean is past ``NORM_HELD`` x the norm (``_norm_alpha``): chosen by
each answer's own side of the norm, the norm settled at a low expectile instead of the mean, and answers
varying as LLM requests do (lognormal, sigma 0.35) opened the stretch on a healthy fleet after about a quarter
of them (review112 H3; about 1% now, a fleet slowed 2x still read within a few answers). With shapes that vary
too, the duration alone — what the fleet-caused 429 reads — still reads 1.5x after 2-12% of them (83-87%
before: review113 M3). The price: a fleet that slows gradually, within 1.2x of the norm per fifty answers or
so, is taken into the norm and not read (attack113)."""
NORM_HELD = 1.2
"""A recent mean past this many times its norm holds the norm to ``NORM_RISE_ALPHA`` (a slowdown must not become
the norm); below it the norm follows at ``NORM_ALPHA`` either way."""
FLEET_CAP = "\x00fleet.max_inflight"
"""``_room_refused``'s key for refusals by the cap over every pool (no pool's name: names are DNS labels)."""
SPARE_TRIES = 8
"""Refused node choices one pump spends on the best-effort requests waiting in one pool (``_pump_spare``), half
of them at most on one tenant's: at most ``max_size`` may wait, and a flood of them must not cost a node choice
each at every event (as many as :data:`BACKFILL_TRIES`; 4 missed one more of issue 30's checks over the
families' seeds 1-12: 57 against 56)."""
ROOM_QUIET_S = 1.0
"""How long after a request of a pool was refused for capacity (a 503) best effort stays off that pool: a
request refused at the door for want of room (a ``queue-deadline`` on arrival) never waits in the queue,
so an empty queue alone did not mean nobody within quota needed the room (mixed seed 10: a batch tenant
over its cap served as best effort while a standard tenant's requests were refused; the worst minute's
Jain index 0.88 -> 0.83)."""
AS_HELD_S = 1e-6
"""The least a best-effort request is placed as having waited: node choice then asks its first token within
the lowest tier's TTFT target, not within its max wait (``core.Core._pick``); ``_spare_waited`` asks more."""
SLOWED = 1.5
"""Recent mean over norm at which a tenant's concurrency-cap 429s count as the fleet's doing."""
STRETCH_SLOWED = 1.3
"""The slowdown (``_may_stretch``'s, the smaller of its two ratios) past which a tenant's cap stretches — by that
slowdown, so a false reading costs little — below ``SLOWED``, at which a concurrency 429 counts as the fleet's
doing and scales it. With norms that stay near the mean (``NORM_RISE_ALPHA``), 1.3 is about where 1.5 was on the
low norms before; answers varying as LLM requests do (lognormal, sigma 0.35) read it on a healthy fleet after
0.6-1% of them (25% before, at 1.5), a fleet slowed 2x within a few."""
STRETCH_RATE_TAU_S = 10.0
"""Time constant of a tenant's arrival rate (``max_concurrent_stretch``): whether it sends faster than its cap
allows at its usual request duration is judged over about the last ten seconds."""
STRETCH_STALE_S = 60.0
"""A tenant's slowdown (``max_concurrent_stretch``) older than this — no answered request since — is no evidence
of the fleet now: a tenant back after an hour starts on its cap, not on last hour's stretch."""


@dataclass(slots=True, eq=False)
class TenantState:
    config: Tenant
    mode: Mode
    requests: Bucket | None
    tokens: Bucket | None
    inflight: int = 0
    """Charged requests in flight or queued: what ``max_concurrent`` caps."""
    on_stretch: dict[str, Lease] = field(default_factory=dict)
    """Charged requests in flight or queued past ``max_concurrent`` on its stretch (``Lease.stretched``), by
    ticket: they hold no slot (not in ``inflight``, never reported to the shared store)."""
    sent: int = 0
    """Of ``inflight``, the slot holders sent to a node (``orphanable``)."""
    heir_set: set[str] = field(default_factory=set)
    """The slot holders sent while on the cap's stretch, by ticket (``heirs``; kept as slots change hands in
    ``_untake``; always empty for a per-model budget, whose cap does not stretch)."""
    arrival_rate: float = 0.0
    arrival_at: float | None = None
    """Requests per second decided for the tenant (an exponentially decayed count, ``STRETCH_RATE_TAU_S``),
    and when it last changed; kept only for a tenant with a ``max_concurrent_stretch``."""
    paced: tuple[float, float] | None = None
    norm_paced: tuple[float, float] | None = None
    paced_at: float = -math.inf
    """(seconds, output tokens) of its answered requests, each an average, recent and usual (the alphas of
    ``mean_seconds`` / ``norm_seconds``), and when they last moved: their ratio is its *pace* (``mean_pace``,
    ``norm_pace``), with the duration whether the fleet serves the tenant slower than usual
    (``max_concurrent_stretch``). A ratio of averages, not an average of each request's ratio: one short answer
    moved that by its own pace (a 1-token answer lasting 0.5 s is 0.5 s a token), and on a healthy fleet answers
    of 1-200 tokens opened the stretch after one completion in nine (recheck108 F1)."""
    slots: int | None = None
    """With several replicas: this replica's slice of ``max_concurrent`` (``share.py``); None: all of it."""
    fleet_free: int = 0
    """Slots nobody held fleet-wide at the last sync: whether borrowing one is worth a round trip."""
    fleet_running: int | None = None
    """Requests in flight fleet-wide as the store last answered (each replica's last report; None: not
    known): fewer than the cap while every slot is held means a slot idles at another replica."""
    record: int = 0
    """What the store has on record as this replica's slots (at least ``slots``): until it is 0 the
    replica keeps reporting, so that what it no longer uses goes back."""
    peak: int = 0
    refused: int = 0
    spent_tokens: float = 0.0
    spent_requests: float = 0.0
    rate_tokens: float = 0.0
    rate_requests: float = 0.0
    """Spend per second here (EWMA over syncs): the credit a replica keeps in hand follows it."""
    largest: float = 0.0
    last_seen: float = -math.inf
    """Demand since the last sync (peak in flight, refusals for want of a slot, spend) and the last
    request: what this replica asks the store for."""
    leases: dict[str, Lease] = field(default_factory=dict)
    """Charged leases in start order: the first is the one expected to end first."""
    mean_seconds: float | None = None
    norm_seconds: float | None = None
    """The tenant's usual request duration (a slow EWMA): what ``mean_seconds`` is compared with."""
    fleet_seconds: tuple[float, float] | None = None
    """``mean_seconds`` and ``norm_seconds`` timed to the node's last byte, without the client's tail
    (``Ended.tail_s``): what the fleet took, which ``_slowed`` and the stretch read. The others are how long a slot
    was held (a client that holds its stream open holds its slot), which Retry-After and Little's law read."""
    mean_output: float | None = None
    """Output tokens per request, as reported: the fair-share counters charge this, not max_tokens."""
    model: str | None = None
    """For a per-model budget (``tenants[i].model_budgets``): its key; the state is named ``tenant/key``."""
    reads: TokenBucket | None = None
    """Bodies this replica read and refused as invalid (``intake.py``), at the tenant's request rate: a
    bucket of this replica's own in every quota mode — reading costs this replica's CPU, and the
    request credit leased from the store is no place to charge it (review: with a store, every hostile
    body was read). None: no ``requests_per_minute``, no charge."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def stretched(self) -> int:
        """Requests on its cap's stretch (``on_stretch``)."""
        return len(self.on_stretch)

    @property
    def mean_pace(self) -> float | None:
        """Recent seconds per output token (``paced``)."""
        return None if self.paced is None else self.paced[0] / self.paced[1]

    @property
    def norm_pace(self) -> float | None:
        """Usual seconds per output token (``norm_paced``)."""
        return None if self.norm_paced is None else self.norm_paced[0] / self.norm_paced[1]

    @property
    def orphanable(self) -> int:
        """Of ``inflight``, what stays taken in the shared store if this replica dies, until the completions other
        replicas forward give it back: the slot holders sent to a node (``sent``). One still queued here dies with
        the replica — no completion will ever name it (attack109 M1). A count kept as leases go and end: a walk
        of the leases cost ~1 ms per borrow at 10,000 in flight (attack110 M3)."""
        return self.sent

    @property
    def heirs(self) -> frozenset[str]:
        """Tickets of the slot holders sent while on the cap's stretch (``Lease.tagged``): their access logs say
        ``stretched``, so a completion forwarded for this replica, dead, gives their slot back only if the shared
        store lists them as heirs (``store.py``, review108 N1 / attack109 H1)."""
        return frozenset(self.heir_set)

    @property
    def bounded(self) -> bool:
        """It has a protective limit (a concurrency cap, a per-minute budget): shed parity counts its requests
        (``Admission.tally``)."""
        c = self.config
        return c.max_concurrent is not None or c.requests_per_minute is not None or c.tokens_per_minute is not None


@dataclass(slots=True, eq=False)
class Lease:
    ticket: str
    tenant: TenantState
    request_id: str
    reserved_tokens: int
    prompt_estimate: int
    started: float
    charged: bool
    """False for a request admitted in shadow mode that enforcement would have rejected: it holds no
    quota, so the shadow counters show what enforcing would do."""
    tier: str = ""
    node: str | None = None
    """The vLLM node (host:port) kvgate sent the request to, when kvgate chooses nodes."""
    queued_at: float | None = None
    """When it entered the gateway queue (None: never queued)."""
    service: float = 0.0
    """Weighted tokens charged to the tenant's fair-share counter at dispatch (reconciled at the end)."""
    predicted_ttft: float | None = None
    """Seconds to the first token kvgate predicted on its node when it dispatched it (None: no prediction)."""
    slo_miss: bool = False
    """Dispatched although the prediction says it misses its tier's TTFT target: unmet demand for the scaler."""
    pool: str = DEFAULT_POOL
    """The pool it was routed to: its queue, its fair-share counters, its nodes."""
    budget: TenantState | None = None
    """The tenant's per-model budget it also holds (``model_budgets``), if one applies."""
    on_split: bool = False
    """Charged while this replica enforced its local split (``quota.SplitQuota``): only such a lease's
    return or refund changes what the split spent (what the store debits on rejoining)."""
    best_effort: bool = False
    """Admitted as best effort (its tenant over a protective limit, the fleet with room nobody within
    quota needs): it holds a fleet slot but no quota — nothing taken from any bucket or slot, its own
    tenant's or another's — runs at the lowest tier's vLLM priority and is never scaling demand. Always
    ``charged`` False."""

    stretched: bool = False
    """Admitted past its tenant's ``max_concurrent`` on the cap's stretch (``tenants[i].max_concurrent_stretch``:
    the fleet holds the tenant's requests longer than usual): an ordinary request of its tier, its budgets
    charged, that is in ``TenantState.on_stretch`` instead of taking a slot — until a slot of the tenant frees
    (``_untake``: it takes that one over)."""
    tagged: bool = False
    """Sent while ``stretched``: Envoy's access log carries ``stretched: true`` for it (``core.py``), which no
    later handover of a slot can change (``TenantState.heirs``)."""

    @property
    def holds_slot(self) -> bool:
        """Whether it counts in :attr:`Admission.inflight` (a fleet slot): charged or best effort."""
        return self.charged or self.best_effort


@dataclass(frozen=True, slots=True)
class Decision:
    tenant: str
    tier: str
    lease: Lease | None
    rejection: Rejection | None
    queued: bool = False
    """Not decided yet: held in the gateway queue, or waiting behind it as best effort (``best_effort`` set;
    ``lease`` is the held request); ``pump`` decides it."""
    borrow: bool = False
    """Not decided yet: this replica's slice of the tenant's limits cannot pay for it but the fleet's
    may; the shell borrows from the store (one round trip) and decides again."""
    borrow_also: str | None = None
    """With ``borrow``: the tenant's per-model budget is short here too (both are borrowed at once: a
    second decision could not borrow again)."""
    identified: bool = True
    """False for a request refused before any tenant was found (no known key, a malformed
    ``Authorization``): ``tenant`` is then ``unknown`` and ``tier`` only the lowest, a placeholder."""
    best_effort: Rejection | None = None
    """Admitted as best effort, or waiting for room as such (``queued``): the 429 it would have had (which
    protective limit the tenant is over)."""

    @property
    def admitted(self) -> bool:
        return self.lease is not None and not self.queued

    @property
    def shadow(self) -> bool:
        """Admitted although a check failed (shadow mode)."""
        return self.lease is not None and self.rejection is not None

    @property
    def waited(self) -> float | None:
        """Seconds spent in the gateway queue, for a request that was queued."""
        lease = self.lease
        if lease is None or lease.queued_at is None:
            return None
        return lease.started - lease.queued_at


@dataclass(frozen=True, slots=True)
class Outcome:
    """The end of a queued request's wait: ``decision`` admits it or rejects it (503; a best-effort request
    that waited for room in vain: its 429)."""

    ticket: str
    decision: Decision
    waited: float
    pool: str = DEFAULT_POOL
    for_room: bool = False
    """It waited for room: a node choice refused it at least once while it was queued (not only queued
    behind others and released by the pass that found it room: ``kvgate_queue_waited_for_room_total``)."""


@dataclass(slots=True, eq=False)
class _Held:
    lease: Lease
    estimate: Estimate
    entry: Entry
    refused: bool = False
    """A node choice refused it (at arrival or in a pump) since it was queued: ``Outcome.for_room``."""
    short_at: int = 0
    """Its queue's ``short_passes`` of its tier when it was queued: a pass that left its tier (or every tier)
    without a node since then means it waited for room too (``Outcome.for_room``)."""
    capped: bool = False
    """``fleet.max_inflight`` refused it while it waited: dropped, it keeps best effort off every pool
    (``FLEET_CAP``)."""


@dataclass(slots=True, eq=False)
class _Spare:
    """A best-effort request waiting for room nobody within quota needs (``Admission._best_effort``)."""

    lease: Lease
    estimate: Estimate
    over: Rejection
    """The 429 it would have had: its answer if no room comes before ``deadline``."""
    deadline: float


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from the node's prefix cache (``usage.prompt_tokens_details.cached_tokens``):
    spend budgets charge them at the cached price."""
    reasoning_tokens: int = 0
    """Of the completion tokens, reasoning ones (``usage.completion_tokens_details.reasoning_tokens``)."""

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
    service: float = 0.0
    """Weighted tokens the tenant finally received (its fair-share counters count this)."""


class Admission:
    def __init__(
        self, config: Config, clock: Callable[[], float], rng: random.Random | None = None,
        pick: Picker | None = None, wall: Callable[[], float] | None = None,
    ) -> None:
        self._clock = clock
        self._wall = wall or clock
        """Epoch seconds, for spend budgets' calendar windows (the decision clock may be monotonic or
        virtual; by default the same clock)."""
        self.spend = BudgetBook({}, {}, self._wall())
        """Spend budgets (``budgets.py``): reserved with the decision, settled at completion."""
        self._rng = rng or random.Random()
        self.pick = pick
        """Node choice (``nodes.Fleet.place``), or None when Envoy's own cluster picks the node."""
        self.floor: Callable[[Estimate], float] | None = None
        """With node choice: the least time to a first token any node could give a request."""
        self._tenants: dict[str, TenantState] = {}
        self._leases: dict[str, Lease] = {}
        self._held: dict[str, _Held] = {}
        self._spare: dict[str, _Spare] = {}
        """Best-effort requests waiting, oldest first: tried only when their pool's gateway queue is empty."""
        self._spare_due: list[tuple[float, str]] = []
        """Their deadlines, a heap (a cancelled one stays until it comes up, then is skipped)."""
        self._spare_per_pool: Counter[str] = Counter()
        self._room_refused: dict[str, float] = {}
        """When each pool last refused a request for capacity (``tally``, and ``_drop`` within a pump), and
        when any was refused for ``fleet.max_inflight`` (:data:`FLEET_CAP`): best effort waits ``ROOM_QUIET_S``."""
        self._spare_config: Config | None = None
        """The config ``_pump_spare`` last checked the waiting best-effort requests against."""
        self._outbox: list[Outcome] = []
        self._seq = 0
        self._boot = f"{self._rng.getrandbits(32):08x}"
        self.inflight = 0
        """Requests holding a fleet slot (sent to a node, not yet completed)."""
        self._mean_seconds: float | None = None
        self.shared = config.store.redis is not None
        """Several replicas share the tenants' limits through a store: budgets are leased credit."""
        self.leased = LeasedQuota(self.states)
        """How quotas are shared while the store answers (what ``store.py`` talks to)."""
        self.quota: Quota = self.leased if self.shared else LocalQuota()
        """How quotas are enforced now: one replica's own | leased from the store | a local split while
        the store is out of reach (``quota.py``). Every quota question of the decision goes here."""
        self.service_out: dict[str, float] = {}
        """Fair-share service given here since the last sync, by tenant: the other replicas add it to theirs."""
        self.dispatch_out: list[tuple[str, int, int, str]] = []
        """(node, tokens, prompt tokens, tier) of requests sent since the last sync: the other replicas
        book them on their view of the node."""
        self.queues: dict[str, FairQueue] = {}
        """The gateway queue of each pool: a flooded pool's backlog never holds another pool's requests."""
        self._pools: dict[str, PoolSpec] = {}
        self._model_budgets: dict[str, TenantState] = {}
        """Per-model budgets, by ``tenant/key`` (``model_budgets``): checked and charged besides the tenant's."""
        self.config = config
        self.reconfigure(config)

    # -- configuration ---------------------------------------------------------------------------

    def reconfigure(self, config: Config, pools: Sequence[PoolSpec] | None = None) -> None:
        """Swap in a new config, keeping in-flight leases and what each tenant has already spent."""
        now = self._clock()
        old = {**self._tenants, **self._model_budgets}
        tenants: dict[str, TenantState] = {}
        budgets: dict[str, TenantState] = {}
        wanted: list[tuple[Tenant, str | None, Mode]] = [(t, None, t.mode or config.mode) for t in config.tenants]
        wanted += [(_budget_tenant(t, key, b), key, t.mode or config.mode)
                   for t in config.tenants for key, b in t.model_budgets.items()]
        for t, model, mode in wanted:
            state = old.get(t.name)
            quota = self.quota
            if state is None:
                state = TenantState(
                    t,
                    mode,
                    quota.bucket(t.requests_per_minute, t.request_burst, now),
                    quota.bucket(t.tokens_per_minute, t.token_burst, now),
                    slots=0 if self.shared else None,
                    fleet_free=t.max_concurrent or 0,
                )
            else:
                old_cap = state.config.max_concurrent
                if t.max_concurrent is None:
                    state.slots, state.record = (0 if self.shared else None), 0
                if state.slots and old_cap and t.max_concurrent and t.max_concurrent < old_cap:
                    # a lower cap: this replica's slice shrinks in proportion until the store answers
                    state.slots = state.slots * t.max_concurrent // old_cap
                state.config, state.mode = t, mode
                state.requests = _retuned(quota, state.requests, t.requests_per_minute, t.request_burst, now)
                state.tokens = _retuned(quota, state.tokens, t.tokens_per_minute, t.token_burst, now)
            state.model = model
            (tenants if model is None else budgets)[t.name] = state
        unknown = old.get(_UNKNOWN_SLOT)
        if unknown is None:
            unknown = TenantState(Tenant(name=UNKNOWN_TENANT, tier=config.lowest_tier), config.mode, None, None)
        unknown.mode = config.mode
        unknown.config = Tenant(name=UNKNOWN_TENANT, tier=config.lowest_tier)
        tenants[_UNKNOWN_SLOT] = unknown
        self._tenants = tenants
        self._model_budgets = budgets
        self.config = config
        self._spare_config = None  # (the best-effort requests waiting are checked against it at the next pump)
        self.spend.configure(config.prices, {t.name: t.budgets for t in config.tenants if t.budgets}, self._wall())
        if isinstance(self.quota, SplitQuota):
            self.quota.split(now)  # new limits, split the same way
        self._pools = {p.name: p for p in (pools if pools is not None else pools_of(config))}
        tiers = [TierSpec(n, t.priority, t.max_queue_wait_ms / 1000.0) for n, t in config.tiers.items()]
        for p in self._pools.values():
            q = self.queues.get(p.name)
            if q is None:
                q = self.queues[p.name] = FairQueue([], p.queue_max_size, config.queue.starvation_guard)
            q.max_size, q.starvation_guard = p.queue_max_size, config.queue.starvation_guard
            q.share_lower = config.queue.lower_tiers == "share"
            q.parity_gap = config.queue.shed_parity_gap
            q.set_tiers(tiers)
            for st in tenants.values():
                q.set_weight(st.name, st.config.weight)
        for name in [n for n, q in self.queues.items() if n not in self._pools and not len(q)]:
            del self.queues[name]  # a pool removed by a reload (what waited there is refused at the next pump)

    def _pools_queues(self) -> list[FairQueue]:
        return [q for name, q in self.queues.items() if name in self._pools]

    @property
    def queue(self) -> FairQueue:
        """The first pool's gateway queue (the only one without ``pools``); never a removed pool's."""
        return self.queues[next(iter(self._pools))]

    def queue_of(self, pool: str) -> FairQueue:
        """A pool's gateway queue; an unknown pool (another replica's older config): the first pool's."""
        q = self.queues.get(pool)  # (not ``or``: an empty queue is falsy)
        return q if q is not None else self.queue

    def tenant_state(self, name: str) -> TenantState | None:
        """A tenant's state, or a per-model budget's (``tenant/key``)."""
        return self._tenants.get(name) or self._model_budgets.get(name)

    def states(self) -> list[TenantState]:
        """Tenants and per-model budgets: what the store shares among replicas."""
        return [*self._tenants.values(), *self._model_budgets.values()]

    # -- the decision ----------------------------------------------------------------------------

    def decide(self, tenant: Tenant | None, request_id: str, estimate: Estimate, body_bytes: int,
               borrowed: bool = False, refused: Rejection | None = None) -> Decision:
        """Decide one request now, or queue it (``Decision.queued``) until ``pump`` can decide it, or
        (several replicas) say that its tenant's slice here is short (``Decision.borrow``): decided again
        with ``borrowed`` once the shell has borrowed from the store. ``refused``: what the core already
        refuses it for (a model the tenant may not use) — a shadow-mode tenant is admitted all the same."""
        now = self._clock()
        if tenant is None:
            state = self._tenants[_UNKNOWN_SLOT]
            rejection: Rejection | None = UNKNOWN_KEY
        else:
            state = self._tenants.get(tenant.name) or self._tenants[_UNKNOWN_SLOT]
            state.last_seen = now
            if not borrowed and state.config.max_concurrent_stretch > 1.0:
                _arrived(state, now)
            # shadow mode admits anyway: a round trip would only change what its counters say
            may_borrow = self.shared and not borrowed and state.mode == "enforce"
            rejection = refused or self._check(state, estimate, body_bytes, now, may_borrow)
            budget = self._budget_of(state, estimate.model) if self._model_budgets and refused is None else None
            if budget is not None and (rejection is None or rejection is BORROW):
                budget.last_seen = now
                short = self._check(budget, estimate, body_bytes, now, may_borrow)
                if rejection is BORROW and short is BORROW:  # both short here: one borrow for the two
                    return Decision(state.name, state.config.tier, None, None, borrow=True, borrow_also=budget.name)
                if short is BORROW:
                    return Decision(budget.name, state.config.tier, None, None, borrow=True)
                if short is not None:
                    rejection = short  # the model's budget refuses it fleet-wide: no borrow would help
            if rejection is BORROW:
                return Decision(state.name, state.config.tier, None, None, borrow=True)
        tier = state.config.tier
        held: str | None = None
        if rejection is None and tenant is not None and self.spend.accounts:
            held = self._ticket()
            rejection = self._reserve(state, held, estimate)
        if rejection is not None:
            if state.mode == "enforce":
                return self._best_effort(state, request_id, estimate, rejection, now) or \
                    Decision(state.name, tier, None, rejection)
            return self._shadow(state, request_id, estimate, rejection, now)
        ticket = held or self._ticket()
        d = self._admit(state, ticket, request_id, estimate, now, held)
        if held is not None and d.lease is None:
            self.spend.release(held)  # refused for capacity: its spend reservation goes back
        return d

    def _reserve(self, s: TenantState, ticket: str, est: Estimate) -> Rejection | None:
        """Reserve the request's worst-case spend on the tenant's budgets (``budgets.py``): a hard budget
        that cannot pay it refuses it (429 ``tenant-budget``, Retry-After until the window resets)."""
        got = self.spend.reserve(ticket, s.name, est.model, est.pool, est.prompt_tokens, est.output_tokens,
                                 self._wall())
        if not isinstance(got, Refusal):
            return None
        a = got.account
        view = BudgetView(a.budget.name, a.budget.limit, got.left, got.retry_after)
        return replace(reject("tenant-budget", got.message, got.retry_after), budget=view)

    def wall(self) -> float:
        """Epoch seconds now (the clock spend budgets' windows are counted in)."""
        return self._wall()

    def budget_left(self, tenant: str) -> str | None:
        """What is left of each of ``tenant``'s spend budgets, as ``name=left`` pairs joined by ``, ``
        (the ``x-kvgate-budget-remaining`` response header); None: it has none."""
        got = self.spend.remaining(tenant, self._wall())
        return ", ".join(f"{a.budget.name}={left:.6g}" for a, left in got) if got else None

    def _admit(self, state: TenantState, ticket: str, request_id: str, estimate: Estimate, now: float,
               held: str | None) -> Decision:
        """Past every policy check: dispatch it now, queue it, or refuse it for capacity. ``held``: the
        ticket its spend reservation is under (a shadow admission keeps it; None: a fresh ticket, as before
        budgets existed)."""
        tier = state.config.tier
        placed: Placed | None = None
        if not (self.config.queue.enabled and self.queue_of(estimate.pool).waiting_at_or_above(tier)):
            placed, capacity = self._place(estimate, ticket, tier, now)
            if capacity is None:
                lease = self._grant(state, ticket, request_id, estimate, now, placed.node)
                self._predicted(lease, placed, 0.0, estimate)
                if self.config.queue.enabled and len(q := self.queue_of(estimate.pool)):
                    q.passed(tier, self._service(state, estimate))  # (the tiers below that wait: their guard counts it)
                return Decision(state.name, tier, lease, None)
            if state.mode == "shadow":
                return self._shadow(state, request_id, estimate, capacity, now, held)
            if not self.config.queue.enabled:
                return Decision(state.name, tier, None, capacity)
        elif state.mode == "shadow":
            return self._shadow(state, request_id, estimate, self._queue_rejection(state, "queue-ahead", 0.0), now,
                                held)
        return self._enqueue(state, ticket, request_id, estimate, now, placed)

    def _best_effort(self, s: TenantState, request_id: str, est: Estimate, rejection: Rejection,
                     now: float) -> Decision | None:
        """Serve a tenant over a protective limit as best effort, or None (it gets its 429).

        Only for a limit its config lets be exceeded (``tenants[i].over_limit``; ``reasons.PROTECTIVE``:
        never a contract), and only when serving it costs nobody within quota: kvgate chooses nodes (so
        there is a prediction to trust), nobody waits in the pool's gateway queue, a fleet slot is free and
        a node takes it *as the lowest tier* — that tier's KV reserve, its vLLM priority, its first token
        predicted within its TTFT target — so it goes only where the lowest tier would have room. It takes
        no quota (``Lease.best_effort``) and is never scaling demand.

        When that room is not there now (requests within quota wait, or no node would take it), it waits
        for it *behind* the whole gateway queue, up to the lowest tier's hold (``_pump_spare``), and gets
        its 429 if the room does not come: a burst's over-limit requests were refused outright while the
        queue ahead drained within a second (bursty-mmpp seed 7: a batch tenant's 281 concurrency 429s, its
        SLO 85% against kv-shed's 97%)."""
        kind = PROTECTIVE.get(rejection.reason)
        if kind is None or not self._may_exceed(s, kind) or self._over_hard(s, est, now):
            return None
        if self._crowds_top(est):
            return None
        ticket = self._ticket()
        if self.spend.accounts:
            # spend budgets are contracts: best effort pays them as any admission does (reserved now,
            # charged at completion under this ticket), and one that cannot pay gets that 429 instead
            over = self._reserve(s, ticket, est)
            if over is not None:
                return Decision(s.name, s.config.tier, None, over)
        lease = Lease(ticket, s, request_id, est.total, est.prompt_tokens, now, False, s.config.tier,
                      None, pool=est.pool or DEFAULT_POOL, best_effort=True)
        q = self.queue_of(est.pool)
        if not self._spare_per_pool[lease.pool] and self._spare_ok(lease.pool, now):
            # (not while others of the pool wait: they go first, at the pump this decision is followed by)
            # placed as if it had already waited (``_spare_waited``): only where its first token is predicted
            # within the top tier's target — a new arrival of the lowest tier may go up to its max wait (30 s
            # for batch), and even seconds within its target is no spare room
            placed, capacity = self._place(est, ticket, self.config.lowest_tier, now, self._spare_waited(0.0))
            if capacity is None:
                return self._send_spare(lease, est, placed, rejection, now)
        if not self.config.queue.enabled or self._spare_per_pool[lease.pool] >= q.max_size:
            self.spend.release(ticket)  # (no hold: nothing)
            return None
        lease.queued_at = now
        deadline = now + self._hold_s(self.config.lowest_tier, est)
        self._spare[ticket] = _Spare(lease, est, rejection, deadline)
        self._spare_per_pool[lease.pool] += 1
        heapq.heappush(self._spare_due, (deadline, ticket))
        if len(self._spare_due) > 2 * len(self._spare) + 64:
            # those sent or cancelled stay until their deadline: clients that send and cancel at once
            # must not grow it without bound
            self._spare_due = [(w.deadline, t) for t, w in self._spare.items()]
            heapq.heapify(self._spare_due)
        return Decision(s.name, s.config.tier, lease, None, queued=True, best_effort=rejection)

    def _pump_spare(self, now: float, out: list[Outcome]) -> None:
        """Best-effort requests waiting (``_best_effort``): past its hold — or no longer allowed best
        effort (a reload: the switch, the tenant's ``over_limit``, its pool, the queue; or the tenant now
        over a limit it may not exceed) — its 429; oldest first, while ``_spare_ok``, sent where a node
        takes it as the lowest tier within the top tier's target (``_spare_waited``) — at most
        :data:`SPARE_TRIES` refused node choices per pool and pump, half of them for one tenant."""
        due = self._spare_due
        while due and due[0][0] <= now:
            _, ticket = heapq.heappop(due)
            if ticket in self._spare:
                self._drop_spare(ticket, now, out)
        refused: Counter[str] = Counter()
        tried: Counter[tuple[str, str]] = Counter()
        ok: dict[str, bool] = {}  # (a dispatch changes neither a queue nor when a pool last refused)
        full = False  # ``fleet.max_inflight`` reached: no pool's can go
        reloaded, self._spare_config = self._spare_config is not self.config, self.config
        for ticket in list(self._spare):
            w = self._spare[ticket]
            lease = w.lease
            if reloaded and not self._still_best_effort(w):
                self._drop_spare(ticket, now, out)
                continue
            pool, tenant = lease.pool, lease.tenant.name
            if full or refused[pool] >= SPARE_TRIES or 2 * tried[pool, tenant] >= SPARE_TRIES:
                continue
            if pool not in ok:
                ok[pool] = self._spare_ok(pool, now)
            if not ok[pool]:
                continue
            if self._over_hard(lease.tenant, w.estimate, now) or self._crowds_top(w.estimate):
                # (checked only for those tried: the hot path; the fastest node's prefill time moves with
                # the nodes, no reload needed)
                self._drop_spare(ticket, now, out)
                continue
            as_held = self._spare_waited(now - lease.started)
            placed, capacity = self._place(w.estimate, ticket, self.config.lowest_tier, now, as_held)
            if capacity is not None:
                full = capacity.reason == "fleet-inflight"
                refused[pool] += 1
                tried[pool, tenant] += 1
                continue
            self._unspare(ticket)
            waited = now - (lease.queued_at or now)
            d = self._send_spare(lease, w.estimate, placed, w.over, now)
            if self.config.fleet.max_inflight is not None:
                ok.clear()  # (under one cap over every pool, a slot taken changes what the others may leave)
            out.append(Outcome(ticket, d, waited, lease.pool))

    def _send_spare(self, lease: Lease, est: Estimate, placed: Placed, over: Rejection, now: float) -> Decision:
        """Send a best-effort request to the node ``placed`` chose, at once or after waiting for room."""
        lease.node, lease.started, lease.predicted_ttft = placed.node, now, placed.ttft
        self._dispatch(lease, est, now)
        return Decision(lease.tenant.name, lease.tier, lease, None, best_effort=over)

    def _still_best_effort(self, w: _Spare) -> bool:
        """Whether a waiting best-effort request may still be served so under the config now in force
        (asked once after each reload)."""
        s = w.lease.tenant
        kind = PROTECTIVE.get(w.over.reason)
        return (kind is not None and self.config.queue.enabled and w.lease.pool in self._pools
                and self._tenants.get(s.name) is s and self._may_exceed(s, kind))

    def _spare_ok(self, pool: str, now: float) -> bool:
        """Whether best effort may look for room in ``pool`` now: nobody within quota waits in its gateway
        queue, and none of its requests was refused for capacity in the last ``ROOM_QUIET_S``. With
        ``fleet.max_inflight`` (one cap over every pool), also: the fleet slots left outnumber the requests
        waiting in the other pools' queues, and none was refused for that cap in the last ``ROOM_QUIET_S``."""
        if len(self.queue_of(pool)) or now - self._room_refused.get(pool, -math.inf) < ROOM_QUIET_S:
            return False
        cap = self.config.fleet.max_inflight
        if cap is None:
            return True
        # one cap over every pool: the fleet slots left must outnumber what waits in the other pools' queues,
        # and no request was refused for that cap lately (another pool's own full nodes are its own affair)
        others = sum(len(q) for name, q in self.queues.items() if name != pool)
        return cap - self.inflight > others and now - self._room_refused.get(FLEET_CAP, -math.inf) >= ROOM_QUIET_S

    def _spare_waited(self, waited: float) -> float:
        """What a best-effort request is placed as having waited: node choice then asks its first token
        within what is left of the lowest tier's target, and no later than the top tier's target — it
        starts about as soon as a top-tier request would. Sent with seconds to go, it would sit in vLLM's
        queue, where (first come, first served without priority injection) every top-tier request arriving
        after it waits behind it: mixed seed 9 lost 3 points of interactive SLO and 90 ms of its TTFT p99
        to waiting best effort sent that way. Held in kvgate instead, it costs nobody."""
        lowest, top = self.config.tiers[self.config.lowest_tier], self.config.tiers[self.config.top_tier]
        if lowest.ttft_target_ms is not None and top.ttft_target_ms is not None:
            waited = max(waited, (lowest.ttft_target_ms - top.ttft_target_ms) / 1000.0)
        return max(waited, AS_HELD_S)

    def _unspare(self, ticket: str) -> _Spare:
        w = self._spare.pop(ticket)
        self._spare_per_pool[w.lease.pool] -= 1
        return w

    def _drop_spare(self, ticket: str, now: float, out: list[Outcome]) -> None:
        """A waiting best-effort request's answer: the 429 it would have had on arrival, its Retry-After
        less the time it waited (at least a second)."""
        w = self._unspare(ticket)
        self.spend.release(ticket)
        waited = now - (w.lease.queued_at or now)
        over = w.over
        if over.retry_after is not None:
            over = replace(over, retry_after=max(1.0, over.retry_after - waited))
        out.append(Outcome(ticket, Decision(w.lease.tenant.name, w.lease.tier, None, over), waited, w.lease.pool))

    def spare_waiting(self) -> Mapping[str, int]:
        """Best-effort requests waiting for room, per pool (``kvgate_best_effort_waiting_requests``)."""
        return self._spare_per_pool

    def spare_deadline(self, ticket: str) -> float | None:
        """When a waiting best-effort request gets its answer at the latest (None: not one)."""
        w = self._spare.get(ticket)
        return None if w is None else w.deadline

    def _crowds_top(self, est: Estimate) -> bool:
        """Whether the request's prefill alone, on the fastest node, is longer than the top tier's TTFT
        target: vLLM runs a running prefill's chunks before any waiting request whatever its priority,
        so a top-tier request arriving behind it would miss its target *because of it*. Such a request
        is never best effort (on the families, best effort without this cost the interactive tier 2-7
        points for a few points of batch SLO)."""
        top = self.config.tiers[self.config.top_tier]
        if top.ttft_target_ms is None or self.floor is None:
            return False
        return self.floor(est) > top.ttft_target_ms / 1000.0

    def _over_hard(self, s: TenantState, est: Estimate, now: float) -> bool:
        """Whether the tenant is also over a limit it may *not* exceed (``_check`` stops at the first it
        is over: over its concurrency cap, which it may exceed, it may still be over a token budget that
        refuses), its per-model budget's included."""
        budget = self._budget_of(s, est.model) if self._model_budgets else None
        for b in (s, budget):
            if b is None:
                continue
            cap = b.config.max_concurrent
            if cap is not None and b.inflight >= cap and not self._may_exceed(s, "concurrency"):
                return True
            for kind, bucket, need in (("requests", b.requests, 1.0), ("tokens", b.tokens, float(est.total))):
                if bucket is not None and bucket.seconds_until(need, now) > 0 and \
                        not self._may_exceed(s, cast(ProtectiveLimit, kind)):
                    return True
        return False

    def _may_exceed(self, s: TenantState, kind: ProtectiveLimit) -> bool:
        """Whether ``s`` over its ``kind`` limit may be served as best effort: best effort is on, its
        config says so for that limit, and kvgate chooses nodes (without a prediction there is no
        telling spare room from none: it is refused)."""
        cfg = self.config.best_effort
        return cfg.enabled and self.pick is not None and s.config.over_limit_for(kind, cfg.default) == "best-effort"

    def _budget_of(self, s: TenantState, model: str | None) -> TenantState | None:
        """The tenant's per-model budget that applies to ``model`` (None: none does)."""
        if not s.config.model_budgets:
            return None
        key = Router.budget_key(s.config, model)
        return None if key is None else self._model_budgets.get(f"{s.name}/{key}")

    def _predicted(self, lease: Lease, placed: Placed, waited: float, est: Estimate) -> None:
        """Note the node's prediction on the lease, and whether it says the tier's target is missed
        (counting the time already spent in the gateway queue): unmet demand the scaler acts on — but only
        a miss more nodes could have prevented. A prompt whose own prefill, alone on the fastest node,
        already takes longer than its target misses it on any fleet: counting it made the scaler add
        nodes that changed nothing (shared-prefix seed 1: 12.6 GPUs on average instead of 8, every
        request's outcome the same)."""
        lease.predicted_ttft = placed.ttft
        tier = self.config.tiers.get(lease.tier)
        if placed.ttft is not None and tier is not None and tier.ttft_target_ms is not None:
            target = tier.ttft_target_ms / 1000.0
            lease.slo_miss = waited + placed.ttft > target and (self.floor is None or self.floor(est) <= target)

    def _shadow(self, s: TenantState, request_id: str, est: Estimate, rejection: Rejection, now: float,
                ticket: str | None = None) -> Decision:
        """Shadow mode: admitted all the same, holding no quota, on the least bad live node."""
        ticket = ticket or self._ticket()
        node = None
        if self.pick is not None:
            node = self.pick(est, True, ticket, s.config.tier, 0.0, False).node
            if node is None:  # no live node at all: nothing to send it to
                return Decision(s.name, s.config.tier, None, rejection)
        lease = self._grant(s, ticket, request_id, est, now, node, charged=False)
        return Decision(s.name, s.config.tier, lease, rejection)

    def _place(self, est: Estimate, ticket: str, tier_name: str, now: float,
               waited: float = 0.0, guarded: bool = False) -> tuple[Placed, Rejection | None]:
        """The capacity check: a fleet slot, then a node (which the picker books for ``ticket``).
        ``guarded``: a release the starvation guard owes its tier (placed without the tier's KV reserve)."""
        cap = self.config.fleet.max_inflight
        if cap is not None and self.inflight >= cap:
            wait = self._expected_free(self._leases, self._mean_seconds, now)
            return Placed(None, "fleet-inflight", wait), reject("fleet-inflight", retry_after=self.jittered(wait))
        if self.pick is None:
            return Placed(None), None
        p = self.pick(est, False, ticket, tier_name, waited, guarded)
        return (p, None) if p.node is not None else (p, self.no_node(p.reason, p.wait))

    # -- the gateway queue -----------------------------------------------------------------------

    def _service(self, s: TenantState, est: Estimate) -> float:
        """What a request is expected to cost in the fair-share counters (weighted tokens)."""
        out = est.output_tokens if s.mean_output is None else min(est.output_tokens, s.mean_output)
        return est.prompt_tokens + self.config.queue.output_token_weight * out

    def _enqueue(self, s: TenantState, ticket: str, request_id: str, est: Estimate, now: float,
                 placed: Placed | None = None) -> Decision:
        tier = s.config.tier
        q = self.queue_of(est.pool)
        cost = self._service(s, est)
        max_wait = self._hold_s(tier, est)
        if placed is not None and placed.reason == "fleet-queue" and placed.ttft is not None:
            # no node is predicted to give it a first token within its tier's max wait (and its TTFT
            # target, below the top tier while the top tier is active): refuse it now
            return Decision(s.name, tier, None, self._queue_rejection(s, "queue-deadline", placed.wait))
        target_ms = self.config.tiers[tier].ttft_target_ms
        allowed = max_wait if target_ms is None else min(max_wait, target_ms / 1000.0)
        q.backfill = self.pick is not None  # (node choice may come or go with a reload of the core)
        predicted = q.predicted_wait(s.name, tier, cost, allowed)
        if predicted is not None and predicted > max_wait:
            return Decision(s.name, tier, None, self._queue_rejection(s, "queue-deadline", predicted - max_wait))
        if len(q) >= q.max_size:
            # over the size (a reload shrank it): no eviction, the queue drains down to it
            victim = q.victim(tier) if len(q) == q.max_size else None
            if victim is None:
                return Decision(s.name, tier, None, self._queue_rejection(s, "queue-full", predicted))
            self._drop(victim, "queue-evicted", now, queue=q)
        lease = self._grant(s, ticket, request_id, est, now, None, queued=True)
        # due by its TTFT target (where kvgate does not choose nodes the hold is the longer max wait: sharing
        # the lower tiers held a standard request 2.6 s of its 5 s before it went first, attack56 F1)
        entry = Entry(ticket, s.name, tier, cost, now, now + max_wait, due=now + allowed)
        self._held[ticket] = _Held(lease, est, entry, refused=placed is not None, short_at=q.short_passes(tier),
                                   capped=placed is not None and placed.reason == "fleet-inflight")
        q.push(entry, now)
        return Decision(s.name, tier, lease, None, queued=True)

    def _hold_s(self, tier_name: str, est: Estimate) -> float:
        """How long a request of this tier may wait in the gateway queue: its ``max_queue_wait_ms``, and
        with kvgate choosing nodes, no longer than its TTFT target — past it the request can no longer
        make its target (its own prefill still has to run: the target minus the least time any node
        would take), and serving it late takes the place of one that could (under a sustained overload a
        queue held to the max wait served every request late: 25% of a standard tier met its target
        where shedding at the door met 77%). A request already predicted past its target on arrival is
        still sent at once when a node can start it within the max wait (``picker.py``; below the top
        tier while the top tier is active, only one whose own prefill alone outlasts its target, for the
        work ahead of it within the target): holding it would not make it sooner."""
        tier = self.config.tiers[tier_name]
        hold = tier.max_queue_wait_ms / 1000.0
        if self.pick is not None and tier.ttft_target_ms is not None:
            floor = self.floor(est) if self.floor is not None else 0.0
            hold = min(hold, max(tier.ttft_target_ms / 1000.0 - floor, MIN_HOLD_S))
        return hold

    def _queue_rejection(self, s: TenantState, reason: str, excess: float | None) -> Rejection:
        """503 for a request the queue cannot hold or serve in time. Retry-After: ``excess``, when the
        backlog ahead should have drained enough for a new request to make its deadline (a predicted wait,
        or for a ``queue-timeout`` the hold it waited)."""
        tier = self.config.tiers.get(s.config.tier)
        max_wait = tier.max_queue_wait_ms / 1000.0 if tier else self.config.retry.default_request_seconds
        if excess is None or not math.isfinite(excess):
            excess = max_wait
        # by the tier's own max wait the whole queue has turned over: a longer Retry-After would only
        # echo a poor estimate of the drain rate
        excess = min(excess, max(max_wait, 1.0))
        return reject(reason, retry_after=self.jittered(min(60.0, excess)))

    def pump(self) -> list[Outcome]:
        """Decide what the queue can decide now: time out what is past (or can no longer make) its
        deadline, then release in queue order while a node has room. Also hands over evictions."""
        now = self._clock()
        out, self._outbox = self._outbox, []
        if not self._held and not self._spare:
            return out
        for name, q in list(self.queues.items()):
            if len(q):
                self._pump_queue(q, now, out)
            if name not in self._pools and not len(q):
                del self.queues[name]
        if self._spare:
            self._pump_spare(now, out)
        return out

    def _pump_queue(self, q: FairQueue, now: float, out: list[Outcome]) -> None:
        q.refresh(now)
        if q not in self._pools_queues():
            # its pool went away in a reload: nothing will ever serve what waits there
            while (gone := q.peek()) is not None:
                self._drop(gone, "fleet-no-healthy-node", now, out, queue=q)
            return
        for e in q.expired(now):
            self._drop(e, "queue-timeout", now, out, queue=q)
        q.backfill = self.pick is not None
        for e in q.doomed(now):
            self._drop(e, "queue-deadline", now, out, queue=q)
        blocked: set[str] = set()
        owed: set[str] = set()
        while True:
            for tier in [t for t in blocked if t not in owed and q.guarded(t)]:
                # blocked earlier in this pass, it has since waited out the starvation guard: its owed
                # release goes without its KV reserve, so it may fit now (once a pass; with
                # ``lower_tiers: share`` the least served tier is tried first, before it is owed)
                blocked.discard(tier)
                owed.add(tier)
            if (head := q.peek(blocked, now)) is None:
                break
            h = self._held[head.key]
            # a tier that waited out the starvation guard goes without its KV reserve: the tiers above keep
            # each node at their own, higher limit, so with it the release the guard owes would never fit
            # (diurnal seed 1: a batch tenant sending 2% of the tokens was served 11% of them in the worst
            # minute, Jain 0.74 against kv-shed's 0.89; 1.00 with this)
            guarded = q.guarded(head.tier)
            placed, capacity = self._place(h.estimate, head.key, head.tier, now, now - head.arrived, guarded)
            nxt = head
            if capacity is not None:
                h.refused = True
                if capacity.reason == "fleet-inflight":
                    h.capped = True
                    q.short_pass(None)
                    break  # no tier can go
                if placed.reason == "fleet-queue" and placed.ttft is not None:
                    # it cannot make it: say so now
                    self._drop(head, "queue-deadline", now, out, placed.wait, queue=q)
                    continue
                # this tier's head cannot be placed (its KV reserve, its size, its target): a smaller
                # request behind it may be, else the other tiers may
                found = self._backfill(q, head, h.estimate.total, now, guarded)
                if found is None:
                    blocked.add(head.tier)
                    if guarded:
                        owed.add(head.tier)  # (it was tried as owed already: not again this pass)
                    q.short_pass(head.tier)
                    continue
                nxt, h, placed = found
            q.take(nxt, now)
            del self._held[nxt.key]
            lease = h.lease
            lease.node, lease.started = placed.node, now
            self._predicted(lease, placed, now - nxt.arrived, h.estimate)
            self._dispatch(lease, h.estimate, now)
            out.append(Outcome(nxt.key, Decision(lease.tenant.name, lease.tier, lease, None), now - nxt.arrived,
                               lease.pool, h.refused or q.short_passes(nxt.tier) > h.short_at))

    def _backfill(self, q: FairQueue, head: Entry, size: int, now: float,
                  guarded: bool) -> tuple[Entry, _Held, Placed] | None:
        """A request of ``head``'s tier that can go now although ``head`` cannot: of the next
        :data:`BACKFILL_WINDOW` behind it in queue order (at most :data:`BACKFILL_PER_TENANT` of any one
        tenant), the first a node takes, trying at most :data:`BACKFILL_TRIES` and, after a refusal for
        KV room, only smaller ones. Without it a tier waited behind a head too large for any node's room
        (a 4k-token prefill against 5 % of KV left) while short requests behind it timed out in the
        queue: on the bursty-onoff family's seed 1 the queue admitted 130 fewer standard requests than
        no queue at all. A request larger than one KV room already refused is passed over without a
        node choice; one refused for another reason (its target: it has waited longer) does not bound
        the rest. The per-tenant caps (looked at; tried: :data:`BACKFILL_TRIES_PER_TENANT` of one tenant,
        its others only with the tries the other tenants' requests left) and counting only what is tried
        keep one tenant's queue of long prompts from hiding another tenant's short request (review;
        review15) and from hiding its own (review16). The head keeps its place and its deadline."""
        tried = 0
        tenants: dict[str, int] = {}
        later: list[Entry] = []
        window = q.behind(head, BACKFILL_WINDOW, BACKFILL_PER_TENANT)
        for i, e in enumerate(chain(window, later)):
            h = self._held[e.key]
            if h.estimate.total >= size:
                continue
            if i < len(window) and tenants.get(e.tenant, 0) >= BACKFILL_TRIES_PER_TENANT:
                # the other tenants' requests first; the tries they leave still go to this one's (one
                # tenant's tier, three prompts no node can take at its front: its short requests behind
                # them never tried, the whole tier held for their max wait — review16)
                later.append(e)
                continue
            placed, capacity = self._place(h.estimate, e.key, e.tier, now, now - e.arrived, guarded)
            if capacity is None:
                return e, h, placed
            h.refused = True
            if capacity.reason == "fleet-inflight":
                h.capped = True
                return None
            if capacity.reason == "fleet-kv":
                size = h.estimate.total
            tried += 1
            tenants[e.tenant] = tenants.get(e.tenant, 0) + 1
            if tried >= BACKFILL_TRIES:
                break
        return None

    def _drop(self, e: Entry, reason: str, now: float, out: list[Outcome] | None = None,
              excess: float | None = None, *, queue: FairQueue) -> None:
        """Reject a queued request (503) and give back the quota it held. ``excess``: the predicted wait
        until it could be served (the Retry-After), when known; for a ``queue-timeout``, the hold it waited
        (at least a second, or its tier's max wait if shorter)."""
        queue.remove(e, now)
        h = self._held.pop(e.key)
        s = h.lease.tenant
        self._refund(h.lease, now)
        self._room_refused[h.lease.pool] = now  # (``tally`` books it too, after the pump: best effort must
        # not take the room in this same pump)
        cap = self.config.fleet.max_inflight
        if cap is not None and (h.capped or self.inflight >= cap):
            self._room_refused[FLEET_CAP] = now  # (it waited for a slot under the cap over every pool)
        if reason == "queue-timeout":
            # it waited its whole hold and was not served: by another hold the queue ahead of it has turned
            # over (the prediction already proved too hopeful for it). The hold, not the tier's max wait:
            # with node choice a batch request is held to about its 5 s target, and a Retry-After of the
            # 30 s max wait told its client to stay away six times as long as it waited (attack62 F3). At
            # least a second (or the max wait, if shorter): a long prompt's hold is its target less its own
            # prefill, down to MIN_HOLD_S, and a hint of a tenth of a second, right after the fleet failed
            # to serve it, invited a retry storm (attack66 M3: 0.125 s for a 15,000-token batch prompt)
            max_wait = self.config.tiers[e.tier].max_queue_wait_ms / 1000.0 if e.tier in self.config.tiers else 1.0
            excess = max(e.deadline - e.arrived, min(max_wait, 1.0))
        elif excess is None:
            p = queue.predicted_wait(s.name, e.tier, e.cost, e.allowed)
            excess = None if p is None else p - (e.deadline - e.arrived)
        d = Decision(s.name, e.tier, None, self._queue_rejection(s, reason, excess))
        (self._outbox if out is None else out).append(Outcome(e.key, d, now - e.arrived, h.lease.pool))

    def _refund(self, lease: Lease, now: float) -> None:
        """A queued request that never went: everything it took goes back, its budget's too."""
        self.spend.release(lease.ticket)
        for s in (lease.tenant, lease.budget):
            if s is None:
                continue
            if lease.on_split:
                self.quota.refunded(s, lease.reserved_tokens)
            _untake(s, lease)
            if s.requests is not None:
                s.requests.give(1, now)
            if s.tokens is not None:
                s.tokens.give(lease.reserved_tokens, now)

    def cancel(self, ticket: str) -> bool:
        """The client went away while its request was queued: drop it silently, give its quota back.
        False when it was no longer queued (already released: then it may be on its way upstream)."""
        h = self._held.pop(ticket, None)
        if h is None:
            if ticket not in self._spare:
                return False
            self._unspare(ticket)
            self.spend.release(ticket)  # best effort takes no quota: only a spend reservation to give back
            return True
        now = self._clock()
        self.queue_of(h.lease.pool).remove(h.entry, now)
        self._refund(h.lease, now)
        return True

    @property
    def queued(self) -> int:
        """Requests waiting for a decision: in the gateway queues, and best effort waiting for room."""
        return len(self._held) + len(self._spare)

    @property
    def has_outcomes(self) -> bool:
        """Decisions made outside ``pump`` (evictions) wait to be handed over."""
        return bool(self._outbox)

    def held_tier(self, ticket: str) -> str | None:
        h = self._held.get(ticket)
        if h is None:
            w = self._spare.get(ticket)
            return None if w is None else w.lease.tier
        return h.entry.tier

    def _check(self, s: TenantState, est: Estimate, body_bytes: int, now: float,
               may_borrow: bool = False) -> Rejection | None:
        cfg = s.config
        limits = self.config.limits
        if body_bytes > limits.max_body_bytes:
            return reject(
                "body-too-large",
                f"Request body is {body_bytes} bytes; the limit is {limits.max_body_bytes} bytes.",
            )
        if cfg.max_prompt_tokens is not None and est.prompt_tokens > cfg.max_prompt_tokens:
            return reject(
                "prompt-too-long",
                f"The prompt is about {est.prompt_tokens} tokens; this tenant's limit is "
                f"{cfg.max_prompt_tokens} tokens. Shorten the prompt.",
            )
        if cfg.max_context_tokens is not None and est.total > cfg.max_context_tokens:
            return reject(
                "context-too-long",
                f"The prompt (about {est.prompt_tokens} tokens) plus the requested output "
                f"({est.output_tokens} tokens) exceeds this tenant's context limit of "
                f"{cfg.max_context_tokens} tokens. Lower max_tokens or shorten the prompt.",
            )
        on = f" on model {s.model}" if s.model is not None else ""
        whole = whole_tokens(cfg)
        if whole is not None and est.total > whole:
            return reject(
                "exceeds-token-budget",
                f"This request would cost about {est.total} tokens, more than this tenant's whole "
                f"token budget{on} of {int(whole)}; it can never be admitted as it is.",
            )
        cap = cfg.max_concurrent
        if cap is not None and s.inflight >= _slot_limit(s, cap):
            short = self.quota.short(s, "slots", 1.0, now, may_borrow)
            if short == "borrow":
                return BORROW
            wait = self._slot_free(s, now)
            if short == "unknown":
                return self._unknown(s, "slots", wait)
            if not self._may_stretch(s, cap, now):
                if isinstance(self.quota, LeasedQuota) and self.quota.idle_elsewhere(s):
                    # every slot is held, but the store's word is that fewer than the cap run fleet-wide: a
                    # slot sits idle at another replica — not over quota (a 429 would be a false claim)
                    return reject("quota-unavailable", f"All {cap} concurrent slots of this tenant{on} are held "
                                  f"by kvgate replicas, {s.inflight} of them in use here; the tenant is within "
                                  "its limit: a slot idle at another replica moves to where the requests are "
                                  "within about a sync of the shared store. Retry after the indicated time.",
                                  self.jittered(self.config.store.redis.sync_interval_ms / 1000.0
                                                if self.config.store.redis is not None else wait))
                message = f"Too many concurrent requests for this tenant{on} (limit {cap})."
                r = self._policy(s, "tenant-concurrency", message, wait, est, now)
                return replace(r, fleet_caused=True) if self._fleet_caused(s, est, now) else r
            # within the cap's stretch: on to the budgets (``_grant`` puts it in ``on_stretch``)
        budgets: tuple[tuple[Limit, Bucket | None, float], ...] = (
            ("requests", s.requests, 1.0), ("tokens", s.tokens, float(est.total)))
        for limit, b, need in budgets:
            wait = b.seconds_until(need, now) if b is not None else 0.0
            if b is None or wait <= 0:
                continue
            short = self.quota.short(s, limit, need, now, may_borrow)
            if short == "borrow":
                return BORROW
            if short == "unknown":
                return self._unknown(s, limit, wait)
            if limit == "requests":
                message = f"Rate limit reached for requests{on} (limit {int(b.rate * 60)}/min)."
            else:
                message = (f"Rate limit reached for tokens{on} (limit {int(b.rate * 60)}/min; this request "
                           f"reserves about {est.total}).")
            return self._policy(s, f"tenant-{limit}", message, wait, est, now)
        return None

    def _unknown(self, s: TenantState, limit: Limit, wait: float) -> Rejection:
        """503 ``quota-unavailable``: this replica's share of a limit cannot pay and the shared store
        could not be asked whether the fleet's can — not a claim that the tenant is over its quota."""
        what = {"slots": "concurrent requests", "requests": "requests per minute", "tokens": "tokens per minute"}
        why = ("the shared quota store cannot be reached: this replica enforces only its split of the "
               "tenant's limits" if isinstance(self.quota, SplitQuota) else
               "the shared quota store could not be asked in time")
        return reject("quota-unavailable", f"This gateway replica's share of the tenant's {what[limit]} is in "
                      f"use and {why}; the tenant may be within its quota. Retry after the indicated time.",
                      self.jittered(wait if math.isfinite(wait) else self.config.retry.default_request_seconds))

    def precheck(self, tenant: Tenant, body_bytes: int, *, charge: int = 0) -> Rejection | None:
        """The gates that need no body (``intake.py``), peeked before the body is parsed: the body's
        size, the concurrency cap, the request bucket — in ``_check``'s order, with its messages and
        Retry-After. A rejection only where :meth:`decide` would certainly refuse for that reason
        (enforce mode; no borrow from the store could help; a concurrency 429 that is not the fleet's
        doing, which needs the request's pool to tell); takes nothing. None: parse it and decide.

        With several replicas only what this replica alone proves is refused here: the whole
        ``max_concurrent`` in flight here (over the cap fleet-wide, whatever the store says). A short
        slice or bucket may be borrowed into, or be the store's silence (``quota.py``): parse and decide.

        And one gate of its own: a tenant whose bodies this replica read and refused as invalid at its
        request rate (``TenantState.reads``) is not read again until that bucket refills (429).

        ``charge``: the body it let by was then refused as invalid (a 400 from the parse): take that
        many requests from the tenant's reading bucket (``intake.charge_for``), check nothing."""
        s = self._tenants.get(tenant.name)
        if s is None or s.mode != "enforce":
            return None
        now = self._clock()
        reads = self._reads(s, now)
        if charge:
            if reads is not None:
                reads.take(charge, now)
            return None
        s.last_seen = now
        if body_bytes > self.config.limits.max_body_bytes:
            return self._check(s, _NOTHING, body_bytes, now)
        cap = s.config.max_concurrent
        if cap is not None and s.inflight >= cap:
            # (a tenant that may be served as best effort over it is read and decided: the fleet may have room)
            if _slowed(s) or self._may_exceed(s, "concurrency"):
                return None
            refused = self._check(s, _NOTHING, 0, now)
            if refused is not None and s.config.max_concurrent_stretch > 1.0:
                _arrived(s, now)  # (refused unread, it never reaches ``decide``: its rate counts it here)
            return refused
        if isinstance(self.quota, LocalQuota) and s.requests is not None and s.requests.seconds_until(1, now) > 0:
            return None if self._may_exceed(s, "requests") else self._check(s, _NOTHING, 0, now)
        if reads is not None and (wait := reads.seconds_until(1, now)) > 0:
            return self._policy(s, "tenant-requests", "Rate limit reached for requests: this tenant's recent "
                                f"request bodies were refused as invalid (limit {int(reads.rate * 60)}/min, "
                                "each 64 KiB read counting as one request).", wait, _NOTHING, now)
        return None

    @staticmethod
    def _reads(s: TenantState, now: float) -> TokenBucket | None:
        """The tenant's bucket of bodies read and refused here (:attr:`TenantState.reads`), kept at its
        request rate across reloads."""
        per_minute, burst = s.config.requests_per_minute, s.config.request_burst
        if per_minute is None:
            s.reads = None
        elif s.reads is None or s.reads.rate != per_minute / 60.0:
            s.reads = TokenBucket(per_minute, default_burst(per_minute, burst), now)
        return s.reads

    def tally(self, d: Decision, pool: str, now: float) -> None:
        """Shed parity's ledger (``FairQueue.tally``): a final decision of a request routed to ``pool`` —
        served (a lease: admitted, best effort or shadow), or refused for capacity or by a quota the fleet
        caused. Not counted: a tenant's own excess (a 429 it was not slowed into), a bad request, a
        contract's 429, a ``queue-full`` where the arrival's own tier holds half the queue (its own flood),
        and anything of a tenant without a protective limit (``max_concurrent``, ``requests_per_minute``,
        ``tokens_per_minute``) — its demand has no bound, and counted, a lower tier's tenant that floods the
        fleet made its own tier lagging and took the turns of the tiers above (attack14's flood of batch
        prompts: the interactive tier predicted late 26% against 18%). ``model_budgets`` alone do not make
        a tenant bounded: they bound its requests for some models, not what it sends to the others."""
        if d.lease is None and (r := d.rejection) is not None and r.klass == "capacity":
            self._room_refused[pool] = now
            if r.reason == "fleet-inflight":
                self._room_refused[FLEET_CAP] = now
        q = self.queues.get(pool)
        if q is None or q.parity_gap is None:
            return
        s = self._tenants.get(d.tenant)
        if s is None or not s.bounded:
            return
        if d.lease is not None:
            q.tally(d.tier, False, now)
        elif (r := d.rejection) is not None and (r.klass == "capacity" or r.fleet_caused) and \
                not (r.reason == "queue-full" and 2 * q.depth(d.tier) >= q.max_size):
            # (``queue-full`` where the arrival's own tier holds half the queue or more: what a tier's own
            # flood meets, not the tiers above — attack90 F2; a queue full of the tiers above still counts,
            # review92 L1)
            q.tally(d.tier, True, now)

    @staticmethod
    def _fleet_caused(s: TenantState, est: Estimate, now: float) -> bool:
        """A concurrency-cap 429 the fleet caused: the tenant is inside its request and token budgets and
        its requests now last clearly longer than its own norm — a slower fleet holds each request longer
        (Little's law), so the same traffic hits the same cap. Demand for capacity, not excess."""
        if not _slowed(s):
            return False
        pool = est.pool or DEFAULT_POOL
        if any(lease.pool != pool for lease in s.leases.values()):
            return False  # its slots are held (and slowed) elsewhere too: not this pool's demand to claim
        if s.requests is not None and s.requests.seconds_until(1, now) > 0:
            return False
        return s.tokens is None or s.tokens.seconds_until(est.total, now) <= 0

    @staticmethod
    def _may_stretch(s: TenantState, cap: int, now: float) -> bool:
        """Whether one more request of ``s`` may go past its slots on its cap's stretch
        (``tenants[i].max_concurrent_stretch``).

        A cap sized by Little's law (rate x usual duration) refuses the same traffic once the fleet holds
        every request longer; that 429 is the fleet's doing, not the tenant's excess. So while the fleet
        serves the tenant more than ``STRETCH_SLOWED`` x slower than usual, and the tenant sends no faster than its
        cap allows at its usual duration, the cap grows by the slowdown, up to the configured factor.

        *Slower* is judged on two signals that must agree, each recent over its norm: the request duration
        (``_slowed``'s) and the *pace*, seconds per output token. Duration alone also grows when the tenant
        sends longer requests (its own doing: on the ``mixed`` family, whose tenants' long share shifts, it
        stretched caps where the fleet was not slower, at the interactive tier's cost); pace alone also
        grows when the tenant asks for shorter answers (one answered 1-token request made it 10x,
        attack106 F1). Both are timed to the node's last byte, not the client's: a client that holds its stream
        open lengthens only its own request (``Ended.tail_s``; attack110 M1: one answer held 30 s opened the whole
        stretch). The slowdown is the smaller of the two, and none counts that no answered request
        has renewed for ``STRETCH_STALE_S``. *No faster*: its arrival rate (about the last 10 s) x its usual
        duration below the cap — or this replica's slice of it, with several replicas, each of which sees
        only its own arrivals (attack106 F4): a tenant whose own burst is over its cap gets no more of it.

        The bound is on all it runs here, slots and stretch together (a reload that lowered the cap below
        what runs gives no stretch until that drains). Only the tenant's own cap stretches, not a per-model
        budget's. What goes on the stretch is an ordinary request of its tier — queued, placed, refused for
        capacity (503) when the fleet cannot serve it, so it is scaling demand as the fleet-caused 429 was.
        On the families, a cap refused a batch tenant's requests in slowed bursts that shedding at 90% KV
        served (bursty-onoff seed 2: 54 concurrency 429s, batch SLO 98.0% against kv-shed's 100%)."""
        factor = s.config.max_concurrent_stretch
        if factor <= 1.0 or s.model is not None or now - s.paced_at > STRETCH_STALE_S:
            return False
        f = s.fleet_seconds
        if s.mean_pace is None or s.norm_pace is None or f is None or s.norm_seconds is None:
            return False
        slowdown = min(s.mean_pace / s.norm_pace, f[0] / f[1])
        limit = _slot_limit(s, cap)
        if slowdown <= STRETCH_SLOWED or _arrival_rate(s, now) * s.norm_seconds >= limit:
            return False
        return s.inflight + s.stretched < int(limit * min(factor, slowdown))

    def _policy(
        self, s: TenantState, reason: str, message: str, wait: float, est: Estimate, now: float
    ) -> Rejection:
        return reject(reason, message, self.jittered(wait), requests=_view(s.requests, now),
                      tokens=_view(s.tokens, now))

    def _slot_free(self, s: TenantState, now: float) -> float:
        """When one of the tenant's slots is expected to free: the soonest expected end among its
        requests in flight. A request already older than the mean still runs a while (LLM request
        durations have long tails): it is given a quarter of its age or the mean, whichever is longer. Queued
        requests hold slots too; with nothing in flight, the mean itself."""
        mean = s.mean_seconds if s.mean_seconds is not None else self.config.retry.default_request_seconds
        soonest = None
        for lease in s.leases.values():
            if lease.charged:
                age = now - lease.started
                left = max(mean - age, max(mean, age) / 4)
                soonest = left if soonest is None else min(soonest, left)
        return soonest if soonest is not None else mean

    def _expected_free(self, leases: dict[str, Lease], mean: float | None, now: float) -> float:
        """When the oldest charged lease is expected to end, from the mean request duration."""
        expected = mean if mean is not None else self.config.retry.default_request_seconds
        for lease in leases.values():
            if lease.charged:
                return max(0.0, lease.started + expected - now)
        return expected

    def no_node(self, reason: str | None, wait: float | None) -> Rejection:
        """The capacity rejection when node choice finds no node (``wait``: when one may have room)."""
        return reject(reason or "fleet-no-healthy-node",
                      retry_after=self.jittered(wait if wait is not None else
                                                self.config.retry.default_request_seconds))

    def jittered(self, seconds: float) -> float:
        """A Retry-After: at least retry.min_ms, stretched by up to retry.jitter."""
        r = self.config.retry
        seconds = max(seconds, r.min_ms / 1000.0)
        return seconds * (1.0 + self._rng.uniform(0.0, r.jitter))

    def _ticket(self) -> str:
        self._seq += 1
        return f"{self._boot}-{self._seq}"

    def _grant(
        self, s: TenantState, ticket: str, request_id: str, est: Estimate, now: float, node: str | None,
        charged: bool = True, queued: bool = False,
    ) -> Lease:
        """Take the tenant's quota; unless ``queued``, also the fleet slot (the request goes to a node)."""
        lease = Lease(ticket, s, request_id, est.total, est.prompt_tokens, now, charged, s.config.tier, node,
                      queued_at=now if queued else None, pool=est.pool or DEFAULT_POOL)
        if charged:
            lease.on_split = isinstance(self.quota, SplitQuota)
            lease.budget = self._budget_of(s, est.model) if self._model_budgets else None
            # past its slots only as ``_check`` let it be, on the cap's stretch: counted apart, holding no slot
            lease.stretched = _over_slots(s)
            for b in (s, lease.budget):
                if b is not None:
                    self._take(b, est.total, now, slot=not (lease.stretched and b is s))
            if lease.stretched:
                s.on_stretch[ticket] = lease
        if not queued:
            self._dispatch(lease, est, now)
        return lease

    def runs_as(self, lease: Lease) -> str:
        """The tier whose vLLM priority a lease runs at: the lowest for best effort, else its own."""
        return self.config.lowest_tier if lease.best_effort else lease.tier

    def _take(self, s: TenantState, tokens: int, now: float, slot: bool = True) -> None:
        """Charge one request of ``tokens`` to a tenant (or a per-model budget); ``slot`` False: on its cap's
        stretch (the caller notes it in ``on_stretch``)."""
        if slot:
            s.inflight += 1
        if s.requests is not None:
            s.requests.take(1, now)
        if s.tokens is not None:
            s.tokens.take(tokens, now)
        self.quota.took(s, tokens)

    def _dispatch(self, lease: Lease, est: Estimate, now: float) -> None:
        """The request leaves kvgate for a node: it holds a fleet slot and counts as service received."""
        self._leases[lease.ticket] = lease
        s = lease.tenant
        if lease.charged:
            s.leases[lease.ticket] = lease
            if not lease.stretched:
                s.sent += 1
            if lease.budget is not None:
                lease.budget.leases[lease.ticket] = lease
                lease.budget.sent += 1
        if lease.holds_slot:
            self.inflight += 1
        lease.service = self._service(s, est)
        q = self.queue_of(lease.pool)
        q.charge(s.name, lease.service, now)
        if self.shared:
            key = _service_key(lease.pool, s.name)
            self.service_out[key] = self.service_out.get(key, 0.0) + lease.service
            if lease.node is not None:
                self.dispatch_out.append((lease.node, est.total, est.prompt_tokens, self.runs_as(lease)))
        if lease.queued_at is None:
            q.note_dispatch(lease.service, now)

    # -- completion ------------------------------------------------------------------------------

    def complete(self, ticket: str, usage: Usage | None, responded: bool, tail_s: float = 0.0) -> Completion | None:
        """Release a lease exactly once and reconcile its tokens.

        ``responded``: the upstream produced a response, so tokens were spent even if no usage was
        reported (a stream cut by the client): then the whole reservation is charged, so cutting a
        stream never makes a request cheaper. With no response at all nothing is charged.
        Returns None for a ticket that is unknown or already released. ``tail_s``: how long the client took
        to take the answer after the node's last byte (``Ended.tail_s``): what the fleet served the tenant at
        (``fleet_seconds``, the pace) is timed without it.
        """
        lease = self._leases.pop(ticket, None)
        if lease is None:
            return None
        now = self._clock()
        if not responded:
            self.spend.release(ticket)
        elif self.spend.accounts:
            used = None if usage is None else Spent(usage.prompt_tokens, usage.completion_tokens,
                                                    usage.cached_tokens, usage.reasoning_tokens)
            self.spend.settle(ticket, used, self._wall())
        charged_tokens = usage.total if usage is not None else (lease.reserved_tokens if responded else 0)
        s = lease.tenant
        if lease.holds_slot:
            self.inflight -= 1
        if lease.charged:
            for b in (s, lease.budget):
                if b is None:
                    continue
                _untake(b, lease)
                b.leases.pop(ticket, None)
                if b.tokens is not None:
                    b.tokens.give(lease.reserved_tokens - charged_tokens, now)
                if lease.on_split:
                    self.quota.settled(b, lease.reserved_tokens - charged_tokens)
        seconds = now - lease.started
        if responded:
            self._served(s, lease, usage, seconds, tail_s, now)
        w_out = self.config.queue.output_token_weight
        if usage is not None:
            served = usage.prompt_tokens + w_out * usage.completion_tokens
            s.mean_output = _ewma(s.mean_output, usage.completion_tokens)
        elif responded:
            served = lease.prompt_estimate + w_out * (lease.reserved_tokens - lease.prompt_estimate)
        else:
            served = 0.0
        self.queue_of(lease.pool).charge(s.name, served - lease.service, now, given=lease.started)
        if self.shared:
            key = _service_key(lease.pool, s.name)
            self.service_out[key] = self.service_out.get(key, 0.0) + served - lease.service
        return Completion(lease, charged_tokens, usage, seconds, served)

    def _served(self, s: TenantState, lease: Lease, usage: Usage | None, seconds: float, tail_s: float,
                now: float) -> None:
        """An answered request: how long its slot was held (the tenant's durations: its Retry-After, its arrival
        rate's Little's law) and how long the fleet took (``fleet_seconds`` and the pace: whether the fleet
        serves it slower than usual) — the same less the client's tail after the node's last byte. A tail as long
        as the time here says nothing of the fleet: nothing of it is taught (attack112 L2)."""
        s.mean_seconds, s.norm_seconds = _durations(s.mean_seconds, s.norm_seconds, seconds)
        if lease.budget is not None:  # its Retry-After when its own cap refuses
            lease.budget.mean_seconds = _ewma(lease.budget.mean_seconds, seconds)
        self._mean_seconds = _ewma(self._mean_seconds, seconds)
        if tail_s > 0.0:
            if seconds <= tail_s:
                return
            seconds -= tail_s
        fleet_mean, fleet_norm = s.fleet_seconds or (None, None)
        s.fleet_seconds = _durations(fleet_mean, fleet_norm, seconds)
        if usage is not None and usage.completion_tokens > 0 and s.config.max_concurrent_stretch > 1.0:
            tokens = float(usage.completion_tokens)
            norm = s.norm_pace
            if now - s.paced_at > STRETCH_STALE_S:
                # back after a quiet spell: what was recent then says nothing of the fleet now — one answer
                # at the usual speed reopened last hour's slowdown (attack106 F7)
                s.paced = s.norm_paced
            alpha = _norm_alpha(s.mean_pace, norm, seconds / tokens)
            s.paced = _ewma2(s.paced, seconds, tokens, EWMA_ALPHA)
            s.norm_paced = _ewma2(s.norm_paced, seconds, tokens, alpha)
            s.paced_at = now

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

    def leases(self, queued: bool = False) -> list[Lease]:
        """Every open lease (sent to a node, not completed), in start order; ``queued``: and the
        requests held in the queue."""
        out = list(self._leases.values())
        if queued:
            out += [h.lease for h in self._held.values()]
        return out

    def owns(self, ticket: str) -> bool:
        """Whether this process gave out ``ticket`` (a ticket names its replica: ``<replica>-<n>``)."""
        return ticket.startswith(self.replica + "-")

    @property
    def replica(self) -> str:
        """This process's name among the replicas: random at start, the first part of its tickets."""
        return self._boot

    # -- several replicas (``share.py`` for the arithmetic, ``store.py`` for the I/O) ------------

    def share_report(self, replicas: int, interval: float) -> list[ShareReport]:
        """What this replica asks the store for, tenant by tenant (``LeasedQuota.report``)."""
        return self.leased.report(replicas, interval, self._clock())

    def share_slots(self, tenant: str, slots: int, free: int, record: int | None = None,
                    running: int | None = None) -> None:
        """The store's answer for one tenant's concurrency (``LeasedQuota.slots``); ignored on a split."""
        s = self.tenant_state(tenant)
        if s is not None and not self.local_split:
            self.leased.slots(s, slots, free, record, running)

    def share_credit(self, tenant: str, budget: str, granted: float, fleet_level: float) -> None:
        """The store's answer for one budget (``LeasedQuota.credit``); ignored on a split."""
        s = self.tenant_state(tenant)
        if s is not None and not self.local_split:
            self.leased.credit(s, budget, granted, fleet_level, self._clock())

    def share_local(self, replicas: Sequence[str], me: str, holdings: Mapping[str, Mapping[str, int]]) -> None:
        """The store is out of reach: enforce an even split of every limit among ``replicas`` (all of
        them, this one included: the live ones last seen, padded to the replicas expected to run),
        corrected for what the others held (``quota.SplitQuota``). Applied again after a reload."""
        split = SplitQuota(self.states, replicas, me, holdings)
        self.quota = split
        split.split(self._clock())

    def share_adopt(self, names: Sequence[str], ticket: str) -> bool:
        """A completion for another replica's ``ticket`` (charged to the budgets ``names``) reached
        here: on a local split, take its slot over (``SplitQuota.adopt``). False when not split or
        nothing grew."""
        if not isinstance(self.quota, SplitQuota):
            return False
        states = [s for s in (self.tenant_state(n) for n in names if n) if s is not None]
        return self.quota.adopt(states, ticket)

    def share_rejoin(self) -> dict[str, tuple[float, float]]:
        """The store answers again: budgets are leased credit again, keeping only debts. Returns the
        (requests, tokens) each budget spent meanwhile, for the store to debit."""
        split, self.quota = self.quota, self.leased
        return split.rejoin(self._clock()) if isinstance(split, SplitQuota) else {}

    @property
    def local_split(self) -> int:
        """While the store is out of reach: the replicas the split divides among (0: the store is
        reachable, or there is none)."""
        return self.quota.replicas if isinstance(self.quota, SplitQuota) else 0


_NOTHING = Estimate(0, 0, parsed=True)
"""What ``_check`` is asked about by :meth:`Admission.precheck`: the gates before any token count."""


def _slowed(s: TenantState) -> bool:
    """The tenant's requests now last clearly longer than its own norm on the fleet (a slower fleet holds each
    longer; timed to the node's last byte: ``TenantState.fleet_seconds``)."""
    f = s.fleet_seconds
    return f is not None and f[0] > SLOWED * f[1]


def _slot_limit(s: TenantState, cap: int) -> int:
    """The slots the tenant may use here: its ``max_concurrent``, or this replica's slice of it with several
    replicas."""
    return cap if s.slots is None else min(s.slots, cap)


def _over_slots(s: TenantState) -> bool:
    """Whether every slot the tenant may use here is taken (``_slot_limit``)."""
    cap = s.config.max_concurrent
    return cap is not None and s.inflight >= _slot_limit(s, cap)


def _untake(s: TenantState, lease: Lease) -> None:
    """Give back what ``Admission._take`` counted for ``lease`` in ``s``: its place on the stretch, or its slot —
    which a request on the tenant's stretch then takes over, if one runs or waits: the stretch drains first,
    and no slot goes back to the shared store (for another replica to stretch in turn) while requests beyond
    it still run here (attack106 F2). Only the tenant's own state stretches, not a per-model budget."""
    if s is lease.tenant and lease.stretched:
        del s.on_stretch[lease.ticket]
        return
    if lease.ticket in s.leases:  # (``complete`` forgets it right after)
        s.sent -= 1
        s.heir_set.discard(lease.ticket)
    if s is lease.tenant and s.on_stretch:
        # an heir not sent yet first: its access log will say it holds the slot, so no list of heirs in the
        # shared store has to (``TenantState.heirs``)
        ticket = next((t for t, h in s.on_stretch.items() if not h.tagged), None)
        heir = s.on_stretch.pop(ticket) if ticket is not None else s.on_stretch.popitem()[1]
        heir.stretched = False
        if heir.ticket in s.leases:
            s.sent += 1
            if heir.tagged:
                s.heir_set.add(heir.ticket)
        return
    s.inflight -= 1


def _arrival_rate(s: TenantState, now: float) -> float:
    """The tenant's arrival rate now (``STRETCH_RATE_TAU_S``): its count decayed to ``now``."""
    if s.arrival_at is None:
        return 0.0
    return s.arrival_rate * math.exp(-max(0.0, now - s.arrival_at) / STRETCH_RATE_TAU_S)


def _arrived(s: TenantState, now: float) -> None:
    """Count one request in the tenant's arrival rate."""
    s.arrival_rate = _arrival_rate(s, now) + 1.0 / STRETCH_RATE_TAU_S
    s.arrival_at = now


class Placed(NamedTuple):
    """What node choice answers: the node booked (None: none), why none, the seconds until one may have
    room (or, for ``fleet-queue``, until one is predicted to meet the tier's target), the predicted
    seconds to the first token there."""

    node: str | None
    reason: str | None = None
    wait: float | None = None
    ttft: float | None = None


Picker = Callable[[Estimate, bool, str, str, float, bool], Placed]
"""(estimate, shadow, ticket, tier, seconds it already waited in the gateway queue) → :class:`Placed`.
A node it returns is booked for that ticket. In
shadow mode it must return a node whenever any is alive, whatever its load."""


BORROW = reject("tenant-concurrency", "borrow from the store")
"""What ``_check`` says when this replica's slice is short and the fleet's may not be (never sent)."""


def _budget_tenant(t: Tenant, key: str, b: ModelBudget) -> Tenant:
    """A per-model budget as the tenant-shaped limits the checks read; named ``tenant/key`` (a name no
    tenant can have: '/' is not allowed in tenant names)."""
    return Tenant.model_construct(name=f"{t.name}/{key}", tier=t.tier, weight=t.weight, mode=t.mode,
                                  **b.model_dump())


def _service_key(pool: str, tenant: str) -> str:
    """How fair-share service is keyed between replicas: ``pool/tenant`` (tenant and pool names have no '/')."""
    return f"{pool}/{tenant}"


def _ewma(prev: float | None, x: float, alpha: float = EWMA_ALPHA) -> float:
    return x if prev is None else prev + alpha * (x - prev)


def _durations(mean: float | None, norm: float | None, x: float) -> tuple[float, float]:
    """A recent mean and a norm of durations moved by one (``_norm_alpha``)."""
    return _ewma(mean, x), _ewma(norm, x, _norm_alpha(mean, norm, x))


def _norm_alpha(recent: float | None, norm: float | None, x: float) -> float:
    """How far one answer ``x`` moves a norm: ``NORM_ALPHA``, or ``NORM_RISE_ALPHA`` for one above the norm while
    the recent mean reads past ``NORM_HELD`` x it — a slowdown must not become the norm (``NORM_RISE_ALPHA``)."""
    held = recent is not None and norm is not None and recent > NORM_HELD * norm and x > norm
    return NORM_RISE_ALPHA if held else NORM_ALPHA


def _ewma2(prev: tuple[float, float] | None, x: float, y: float, alpha: float) -> tuple[float, float]:
    """Two averages moved together by one observation (a ratio of averages: ``TenantState.paced``)."""
    return (x, y) if prev is None else (prev[0] + alpha * (x - prev[0]), prev[1] + alpha * (y - prev[1]))


def _retuned(quota: Quota, b: Bucket | None, per_minute: float | None, burst: int | None,
             now: float) -> Bucket | None:
    """A budget after a reload: the same bucket retuned (what was spent stays spent), or a new one
    when the limit is new or the mode's kind of bucket changed."""
    if per_minute is None:
        return None
    if b is None or isinstance(b, Credit) != (quota.mode == "leased"):
        return quota.bucket(per_minute, burst, now)
    b.retune(per_minute, default_burst(per_minute, burst), now)
    return b


def _view(b: Bucket | None, now: float) -> RateLimitView | None:
    if b is None:
        return None
    return RateLimitView(int(b.rate * 60), max(0, math.floor(b.available(now))), b.seconds_until_full(now))
