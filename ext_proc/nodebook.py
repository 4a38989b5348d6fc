"""The node book: what kvgate knows of each vLLM node between decisions, and what it can say of the
whole fleet at once. Node choice is split in two: this book (the data and what keeps it true) and the
picker (``picker.py``: filters, predictions, the pick), which reads it; ``nodes.Fleet`` is both.

:class:`Node` holds one node's record — its last probe reading and when it was taken, the requests
kvgate sent there (the bookings a reading cannot show yet, the ones in flight), its breaker, its
learned speed and the virtual prefill clocks per priority level.

:class:`NodeBook` keeps every node's record: the node set (discovery, reloads), probe readings (which
correct the KV projection, the prefill clocks, the speed factor and the breaker), bookings (a dispatch
by this replica or another) and completions, the fleet-wide breaker rules (how many may open on
latency, never the last closed one on KV), the prefix index (what was sent where) and the room summary.

:class:`Room` is the fleet-wide summary the gateway queue needs: *can any node take this request now*
— answered without walking the fleet. With requests waiting and the fleet full, every event (a probe
reading, a decision, a completion, a tick) asks the queue whether its heads can go now; asking node
choice meant filtering every node of a 1,000-node fleet for each tier (2.3 ms per probe reading). The
summary keeps, per node and per KV reserve in use, the largest request that might pass node choice's
filters there, and the largest of those over the fleet: a node's entry is recomputed when anything it
depends on changes (a reading, a booking, a completion, a breaker transition, the node set), so an
update costs O(reserves · log nodes) and a question O(log nodes) amortised. It is conservative —
"might" means node choice decides; "no" is exact: no node passes the filters for that request.
Pure: no I/O, time passed in.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpu_probe.snapshot import Snapshot

from .breaker import Breaker, BreakerSettings, State
from .config import Nodes, Performance
from .perf import Speed, StepModel, from_config, prefill_heavy, step_floor, step_ratio
from .prefix import PrefixIndex
from .profiles import detect

_Booked = TypeVar("_Booked", bound=tuple[Any, ...])

TOP_DUE_MAX = 64
"""At most this many of the top tier's requests waiting for their first token are remembered per node
(``Node.top_due``; the first sent go first)."""

DEFAULT_BLOCK = 16
ALONE_SLACK = 1e-9
"""Rounding room in the summary's test of whether a request alone could fit an idle node (the filter
computes it from the request's own size): too wide only asks node choice once more."""
DEFAULT_MODEL = from_config(Performance())
"""A node's model until its book sets it (every node the book makes gets its own at once)."""
LORA_DEFAULT_OUTPUT = 128
"""Output tokens taken for a node's requests when kvgate sent none there (a slot wait's estimate)."""
HARDWARE_CONFIRM = 3
"""Readings in a row that must report other hardware before a node's prior follows it. A prior change
resets the node's learned speed and latency baseline: a probe reporting another GPU on every reading
(broken, or hostile) would otherwise keep its node from ever learning a baseline, so from ever tripping
its latency breaker (review)."""
EDGE_STEPS = 2.0
"""A step boundary seen at most this many steps ago still tells the phase of the step in progress
(:meth:`Node.step_left`): steps vary in length, so an older one says little."""
ROOM_SLACK = 1.0
"""Tokens of rounding room between a node's room and the filter's own test (``projected_kv`` against the
threshold, in fractions of the cache: its rounding is far below a token)."""


@dataclass(eq=False)
class Node:
    address: str
    probe: str
    threshold: float
    """The node's KV admit threshold: its own override, else the fleet default."""
    breaker: Breaker
    override: float | None = None
    """The per-node ``kv_admit_threshold`` as configured (None: follow the fleet default)."""
    snapshot: Snapshot | None = None
    fresh_at: float | None = None
    pending: deque[tuple[float, int, int, int]] = field(default_factory=deque)
    """(when, tokens, prompt tokens, priority level) sent since the last fresh snapshot: what it cannot show yet."""
    pending_tokens: int = 0
    """Sum of ``pending``'s tokens, kept as it changes: read on every request, for every node."""
    pending_prompt: int = 0
    sent_own: deque[float] = field(default_factory=deque)
    """When this replica sent each of its requests in ``pending`` (the rest are other replicas'):
    ``_count_waiting`` skips that many of its own, the newest, as sent after the reading."""
    requests: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """kvgate's requests in flight here, in dispatch order: ticket → (tokens, prompt tokens, vLLM priority)."""
    added: dict[str, dict[int, float]] = field(default_factory=dict)
    """Ticket → what its booking added to each level's clock: a less urgent level with a backlog gains only
    its packed share, not its own full prefill, and gives back no more when it ends (``completed``)."""
    waiting_tokens: int = 0
    """Tokens of the requests vLLM had waiting at the last snapshot: they hold no KV yet, so the KV
    reading does not show them (taken as kvgate's newest requests sent before it: vLLM is FCFS)."""
    waiting_prompt: int = 0
    drain_tokens_per_s: float | None = None
    latency: float | None = None
    """The last step-time reading relative to the node's model (observed / modelled): the breaker's signal."""
    trials: set[str] = field(default_factory=set)
    """Tickets sent here as half-open trials: a trial that ends without a verdict gives its place back."""
    speed: Speed = field(default_factory=Speed)
    busy: dict[int, float] = field(default_factory=dict)
    """vLLM priority level → when the prefill booked here at that level or a more urgent one is done (a
    virtual clock: every dispatch advances it, every probe reading corrects it)."""
    running_low: deque[tuple[float, float, int, str]] = field(default_factory=deque)
    """(start, end, level, ticket) of the less urgent prefills booked here, in order: the one running at a
    given time holds every step's budget until its end, whatever arrives (vLLM runs running requests first)."""
    prefills: deque[tuple[float, float, int, str, float]] = field(default_factory=deque)
    """(start, end, level, ticket, sent) of every prefill booked here, in booking order: one that started —
    or was sent before the last reading and is not waiting in it (``_correct``) — and has not reached its
    end is still running."""
    waiting_by_level: dict[int, int] = field(default_factory=dict)
    """Prompt tokens vLLM had waiting at the last reading, by priority level (kvgate's requests)."""
    waiting_tickets: frozenset[str] = frozenset()
    """Which of kvgate's requests those are (``_count_waiting``): the others sent before the reading run."""
    model: StepModel = DEFAULT_MODEL
    """The node's performance prior (``perf.py``): its own profile's — pinned, detected from what its
    probe reports, else the pool's ``nodes.performance`` — so a pool may mix GPUs."""
    profile: str = ""
    """The profile ``model`` comes from."""
    profile_source: str = "pool"
    """Where that profile came from: pool (``nodes.performance.profile``) | pinned | detected."""
    hardware: tuple[str | None, int | None, str | None] | None = None
    """(GPU name, GPU count, served model) the prior was detected from; None before the first reading."""
    hardware_next: tuple[str | None, int | None, str | None] | None = None
    """Other hardware the last readings reported, not yet taken (:data:`HARDWARE_CONFIRM`)."""
    hardware_streak: int = 0
    """Readings in a row that reported ``hardware_next``."""
    loras: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """The LoRA adapters the node is taken to hold in its GPU slots, least recently used first: vLLM keeps
    the last ``max_loras`` adapters it ran (an LRU), so the last that many seen running there (its
    ``lora_requests_info``) or sent there by kvgate."""
    lora_sent: OrderedDict[str, float] = field(default_factory=OrderedDict)
    """Adapter → when kvgate last sent a request for it, of those sent since the last reading (least recently
    sent first): running there soon, though the reading does not say so yet. One entry an adapter, not one a
    request: with the probe silent every adapter request's node choice went over all of them."""
    _last_completion: float | None = None
    top_due: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=TOP_DUE_MAX))
    """(predicted first token, latest first token within its target) of the top tier's requests sent
    here, until the predicted time passes: a less urgent prompt booked beside one shares its engine step (vLLM
    packs every waiting prompt into a step's token budget) and makes that step, so that first token,
    later (``Picker._keep_one_ready``)."""
    edge: float | None = None
    """When a request last ended here: vLLM returns a request's last token at the end of an engine step,
    so this is a step boundary — the phase of the node's step clock (``Picker.predict``)."""

    @property
    def inflight(self) -> int:
        return len(self.requests)

    def shed_pending(self, until: float) -> None:
        """Forget what was sent at or before ``until``: a reading taken then shows it, or (``until`` a
        ``dead_after_seconds`` ago) no reading came since and the node is dead — what it was sent means
        nothing for a node that gives no readings, and booking on (another replica's dispatches) must
        not grow without end."""
        pending = self.pending
        while pending and pending[0][0] <= until:
            _, tokens, prompt, _ = pending.popleft()
            self.pending_tokens -= tokens
            self.pending_prompt -= prompt
        own = self.sent_own
        while own and own[0] <= until:
            own.popleft()

    def step_left(self, step: float, now: float) -> float:
        """What is left of the engine step in progress: from the last step boundary seen (a request's
        end) when it is recent, steps of ``step`` seconds since; else half a step (a request arrives on
        average halfway through one)."""
        edge = self.edge
        if edge is None or step <= 0.0 or now - edge > EDGE_STEPS * step:
            return step / 2
        return step - (now - edge) % step

    def waiting(self) -> int:
        """Requests waiting inside vLLM: its last reading, plus what was sent since if it had a queue
        then (with no queue, and KV room, vLLM starts new requests at its next step)."""
        w = round(self.snapshot.waiting or 0.0) if self.snapshot is not None else 0
        return w + len(self.pending) if w else 0

    def prefill_tokens(self) -> int:
        """Prompt tokens not yet prefilled: those waiting in vLLM at the last reading and those sent since."""
        return self.waiting_prompt + self.pending_prompt

    def _count_waiting(self) -> None:
        """At a new reading: which of kvgate's requests are the ones vLLM says are waiting — the newest
        sent before the reading, least urgent first (vLLM's queue is FCFS within a priority level)."""
        w = round(self.snapshot.waiting or 0.0) if self.snapshot is not None else 0
        tokens = prompt = 0
        by_level: dict[int, int] = {}
        tickets: list[str] = []
        if w:
            # the newest: sent after the reading was taken — its own only (``pending`` also holds other
            # replicas' bookings, which are not in ``requests``: counting them skipped its newest requests
            # and named older ones waiting; review18 F4)
            skip = len(self.sent_own)
            sent = list(self.requests.items())
            sent = sent[:max(0, len(sent) - skip)] if skip else sent
            order = sorted(range(len(sent)), key=lambda i: (-sent[i][1][2], -i))
            for i in order[:w]:
                ticket, (t, pr, level) = sent[i]
                tokens, prompt = tokens + t, prompt + pr
                by_level[level] = by_level.get(level, 0) + pr
                tickets.append(ticket)
        self.waiting_tokens, self.waiting_prompt, self.waiting_by_level = tokens, prompt, by_level
        self.waiting_tickets = frozenset(tickets)

    def capacity_tokens(self) -> int | None:
        s = self.snapshot
        if s is None or not s.blocks_total:
            return None
        return s.blocks_total * (s.block_size or DEFAULT_BLOCK)

    def projected_kv(self, extra_tokens: int = 0) -> float | None:
        s = self.snapshot
        if s is None:
            return None
        usage, blocks = s.kv_usage, s.blocks_total
        if usage is None or not blocks:
            return usage
        # (capacity_tokens inline: asked for every node a decision filters)
        return usage + (self.waiting_tokens + self.pending_tokens + extra_tokens) / (blocks * (s.block_size or
                                                                                             DEFAULT_BLOCK))


class Room:
    """Whether any node might take a request of a given size and KV reserve (see the module's docstring).

    Per node and per reserve ``r`` in use, the most tokens a request could have and still pass node
    choice's filters there — its *room*:

    * none (-inf) for a node never read (node choice skips it until a reading), one found dead (until
      its next reading, :meth:`dead`) and one whose breaker is open with its recovery window not over
      (``allows`` stays false until then; the earliest end of an open breaker's window is kept, and
      from it on every question says "might");
    * unbounded (+inf) for a node without a KV reading, and an idle node with
      enough free KV that a request too large for the threshold alone could go there
      (``Picker._alone_fits``);
    * else what its projected KV leaves below its threshold less ``r``, in tokens.

    A question is a look at the largest room (a heap per reserve, stale entries skipped), with a token
    of slack for rounding: "no" is exact, "might" hands the question to node choice. Reserves are
    learned as asked (a tier's ``reserve_kv``: a few)."""

    def __init__(self) -> None:
        self._reserves: list[float] = []
        self._rooms: dict[int, tuple[float, ...]] = {}
        """id(node) → its room per reserve in ``_reserves``."""
        self._heaps: list[list[tuple[float, int]]] = []
        """Per reserve: (-bound, id(node)), a heap. A node's entry is a bound on its room, pushed only when
        the room grows past it (a booking only shrinks it: no push); an entry on top whose node has less
        room now is replaced by the room (:meth:`might_fit`) — the largest room on top, in amortised
        O(log nodes)."""
        self._bounds: list[dict[int, float]] = []
        """Per reserve: id(node) → its entry's bound in the heap (absent: none; older entries are skipped)."""
        self._open: dict[int, float] = {}
        """id(node) → when its open breaker's recovery window ends (nodes whose breaker is open)."""
        self._wakes: list[tuple[float, int]] = []
        """(window end, id(node)) of ``_open``, a heap; entries no longer in ``_open`` are skipped."""
        self._nodes: list[Node] = []
        self._dead_seen = -math.inf
        """The latest time node choice found a node dead (``dead``): a question about an earlier time
        cannot trust those entries."""

    def reset(self, nodes: list[Node]) -> None:
        """The node set changed (or what the filters mean did: thresholds, a reload): start over."""
        self._nodes = list(nodes)
        self._rooms.clear()
        self._open.clear()
        self._wakes.clear()
        self._heaps = [[] for _ in self._reserves]
        self._bounds = [{} for _ in self._reserves]
        for n in self._nodes:
            self.update(n)

    def update(self, n: Node) -> None:
        """Something ``n``'s room depends on changed: recompute it."""
        self._set(id(n), self._judge(n))
        br = n.breaker
        key = id(n)
        if br.state is State.OPEN:
            # (a hair early: from then on node choice itself looks, and its own test decides)
            wake = br.opened_at + br.s.recovery_window_s - 1e-6
            if self._open.get(key) != wake:
                self._open[key] = wake
                heapq.heappush(self._wakes, (wake, key))
        else:
            self._open.pop(key, None)

    def dead(self, n: Node, now: float) -> None:
        """Node choice found ``n`` silent past ``dead_after_seconds`` at ``now``: it passes nothing until
        its next reading (time only makes it older), whatever its last reading said — a node that died
        with room would otherwise keep every question answered "might"."""
        old = self._rooms.get(id(n))
        if old is None or max(old, default=-math.inf) == -math.inf:
            return
        self._dead_seen = max(self._dead_seen, now)
        self._set(id(n), (-math.inf,) * len(old))

    def might_fit(self, reserve: float, now: float, tokens: int = 0) -> bool:
        """False only when no node can pass node choice's filters for a request of ``tokens`` with KV
        reserve ``reserve`` at ``now``."""
        wakes = self._wakes
        while wakes and self._open.get(wakes[0][1]) != wakes[0][0]:
            heapq.heappop(wakes)
        if (wakes and wakes[0][0] <= now) or now < self._dead_seen:
            return True
        try:
            i = self._reserves.index(reserve)
        except ValueError:
            i = self._learn(reserve)
        heap, bounds, rooms = self._heaps[i], self._bounds[i], self._rooms
        while heap:
            bound, key = -heap[0][0], heap[0][1]
            if bounds.get(key) != bound:
                heapq.heappop(heap)  # superseded by a larger bound, or the node left
                continue
            room = rooms[key][i]
            if room >= bound:
                return bound > tokens - ROOM_SLACK
            # the node has less room than its entry says: the entry becomes its room
            if room > -math.inf:
                bounds[key] = room
                heapq.heapreplace(heap, (-room, key))
            else:
                del bounds[key]
                heapq.heappop(heap)
        return False

    def _set(self, key: int, rooms: tuple[float, ...]) -> None:
        self._rooms[key] = rooms
        for heap, bounds, room in zip(self._heaps, self._bounds, rooms, strict=True):
            if room > bounds.get(key, -math.inf):
                bounds[key] = room
                heapq.heappush(heap, (-room, key))
        if self._heaps and len(self._heaps[0]) > 4 * len(self._nodes) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps from the rooms now: superseded entries pile up (a room that grows pushes a
        new one; only entries on top are ever popped)."""
        for i in range(len(self._heaps)):
            bounds = self._bounds[i] = {k: r[i] for k, r in self._rooms.items() if r[i] > -math.inf}
            heap = self._heaps[i] = [(-b, k) for k, b in bounds.items()]
            heapq.heapify(heap)

    def _learn(self, reserve: float) -> int:
        """A reserve not asked about before: every node's room gains it."""
        self._reserves.append(reserve)
        self.reset(self._nodes)
        return len(self._reserves) - 1

    def _judge(self, n: Node) -> tuple[float, ...]:
        reserves = self._reserves
        if n.fresh_at is None:
            return (-math.inf,) * len(reserves)
        state = n.breaker.state
        if state is State.OPEN:
            return (-math.inf,) * len(reserves)  # until its window ends (``might_fit``)
        s = n.snapshot
        cap = n.capacity_tokens()
        if s is None or s.kv_usage is None or cap is None:
            return (math.inf,) * len(reserves)
        # (a half-open breaker's node is judged as a closed one's: node choice filters it on KV all the same, and
        # its trial slots only make it stricter. Unbounded, one half-open node in a full fleet sent every question
        # to node choice, which then filtered the whole fleet: review103 M5)
        thr, usage = n.threshold, s.kv_usage
        room = (thr - usage) * cap - n.waiting_tokens - n.pending_tokens  # (``ROOM_SLACK`` covers the rounding)
        if n.inflight or n.pending or n.waiting():
            return tuple(room - r * cap for r in reserves)
        return tuple(math.inf if thr - r <= 1.0 - usage + ALONE_SLACK else room - r * cap for r in reserves)


@dataclass(frozen=True)
class Level:
    """A vLLM priority level the tiers map to, and the TTFT target of its most urgent tier (seconds)."""

    priority: int
    target: float | None


def breaker_settings(cfg: Nodes) -> BreakerSettings:
    b = cfg.breaker
    return BreakerSettings(kv_threshold=b.kv_threshold, latency_multiplier=b.latency_multiplier,
                           recovery_window_s=b.recovery_window_seconds, half_open_requests=b.half_open_requests,
                           close_kv=b.close_kv, close_latency_multiplier=b.close_latency_multiplier,
                           latency_trip_readings=b.latency_trip_readings, enabled=b.enabled)


class NodeBook:
    """Every node's record and what keeps it true (see the module's docstring). Pure: time is passed in."""

    def __init__(self, cfg: Nodes, on_transition: Callable[[str, State, State, str], None] | None = None) -> None:
        self.cfg = cfg
        self._pins = _pins(cfg)
        self.nodes: dict[str, Node] = {}
        self._on_transition = on_transition
        self.model: StepModel = from_config(cfg.performance)
        """The pool's prior: a node's model unless its own profile (pinned or detected) differs."""
        self._models: dict[str, StepModel] = {cfg.performance.profile: self.model}
        self.levels: tuple[Level, ...] = (Level(0, None),)
        """The priority levels requests arrive at (``set_levels``), most urgent first."""
        self._order: list[Node] = []
        self._not_closed: int | None = None
        """Breakers not closed, counted once and then kept by every transition (``_hook``): every reading
        asks whether another may open, and at 1,000 nodes counting them each time cost more than the
        rest of the reading. None: count again (the node set changed)."""
        self._max_cap: int | None = None
        self._max_cap_known = False
        """``max_capacity_tokens``, kept until a reading changes a node's capacity or the node set
        changes: every request asks for it."""
        self.prefix = PrefixIndex(cfg.prefix.max_blocks_per_node, cfg.prefix.ttl_seconds, cfg.prefix.max_blocks)
        self.adapters: frozenset[str] = frozenset()
        """The pool's LoRA adapter names (``pools[].adapters``): a request naming one prefers its holders."""
        self.room = Room()
        """Whether any node might take a request now (:class:`Room`): kept by every change below."""
        self.set_nodes([(n.address, n.probe, n.kv_admit_threshold) for n in cfg.static])

    def _nodes_changed(self) -> None:
        """The node set changed (the picker shuffles its scan ring again)."""

    def set_levels(self, levels: list[Level]) -> None:
        """The vLLM priority levels of the tiers (one level 0 when kvgate writes no priority into bodies:
        vLLM is then FCFS) and each level's tightest TTFT target."""
        merged: dict[int, float | None] = {}
        for lv in levels:
            old = merged.get(lv.priority, lv.target)
            merged[lv.priority] = lv.target if old is None else (old if lv.target is None else min(old, lv.target))
        self.levels = tuple(Level(p, merged[p]) for p in sorted(merged)) or (Level(0, None),)

    def reconfigure(self, cfg: Nodes) -> None:
        if not cfg.prefix.enabled:
            self.prefix.clear()
        self.cfg = cfg
        self._pins = _pins(cfg)
        self.prefix.max_blocks, self.prefix.ttl = cfg.prefix.max_blocks_per_node, cfg.prefix.ttl_seconds
        self.prefix.max_total = cfg.prefix.max_blocks
        self.model = from_config(cfg.performance)
        self._models = {cfg.performance.profile: self.model}
        settings = breaker_settings(cfg)
        for n in self.nodes.values():
            n.breaker.s = settings
        self.set_nodes([(n.address, n.probe, n.kv_admit_threshold) for n in cfg.static] if cfg.static else
                       [(n.address, n.probe, n.override) for n in self.nodes.values()])
        for n in self.nodes.values():
            self._set_prior(n)

    def _model_of(self, profile: str) -> StepModel:
        """The step model of ``profile`` with the pool's figures over it, made once per profile."""
        m = self._models.get(profile)
        if m is None:
            m = self._models[profile] = from_config(self.cfg.performance, profile)
        return m

    def _set_prior(self, n: Node) -> None:
        """Give ``n`` its prior: a profile pinned in the config (its ``nodes.static`` entry, else
        ``nodes.dns.profile``), else the one its probe's GPU and model match (``performance.detect``),
        else the pool's. A node whose prior changes starts over: its speed factor and latency baseline
        are relative to the prior, and learned against the old one they would skew every prediction (or
        read as sickness) until relearned."""
        cfg = self.cfg
        pin = self._pins.get(n.address)
        if pin is None and cfg.dns is not None:
            pin = cfg.dns.profile
        name, source = cfg.performance.profile, "pool"
        if pin is not None:
            name, source = pin, "pinned"
        elif cfg.performance.detect and n.hardware is not None:
            found = detect(cfg.performance.profile, *n.hardware)
            if found is not None and found != name:
                name, source = found, "detected"
        model = self._model_of(name)
        if model != n.model and n.profile:
            n.speed = Speed()
            n.breaker.forget_baseline()
        n.model, n.profile, n.profile_source = model, name, source

    def set_nodes(self, entries: list[tuple[str, str, float | None]]) -> None:
        """The discovered node list; known nodes keep their readings and breakers."""
        nodes = {}
        for address, probe, override in entries:
            threshold = override if override is not None else self.cfg.kv_admit_threshold
            n = self.nodes.get(address)
            if n is None:
                n = Node(address, probe, threshold, Breaker(breaker_settings(self.cfg), self._hook(address)))
            n.probe, n.threshold, n.override = probe, threshold, override
            nodes[address] = n
            if not n.profile:
                self._set_prior(n)
        for gone in set(self.nodes) - set(nodes):
            self.prefix.forget(gone)
        self.nodes = nodes
        self._order = list(nodes.values())
        self.room.reset(self._order)
        self._nodes_changed()
        self._not_closed = None
        self._max_cap_known = False

    def _hook(self, address: str) -> Callable[[State, State, str], None]:
        def transition(old: State, new: State, why: str) -> None:
            if self._not_closed is not None and (old is State.CLOSED) != (new is State.CLOSED):
                self._not_closed += 1 if old is State.CLOSED else -1
            n = self.nodes.get(address)
            if n is not None:
                self.room.update(n)
            cb = self._on_transition
            if cb is not None:
                cb(address, old, new, why)

        return transition

    # -- readings --------------------------------------------------------------------------------

    def on_snapshot(self, address: str, snap: Snapshot, now: float, age_s: float = 0.0) -> None:
        """A probe answered. ``age_s``: how old the reading already was when it arrived."""
        n = self.nodes.get(address)
        if n is None:
            return
        if not snap.ok:
            return  # a failed reading says nothing new: the node ages towards unknown / dead
        repeat = n.snapshot is not None and n.snapshot.at == snap.at  # polled again before the probe's next reading
        if n.fresh_at is not None and now - n.fresh_at > self.cfg.dead_after_seconds:
            self.prefix.forget(address)  # back from the dead: a restarted vLLM's prefix cache is empty
        if self._max_cap_known and (n.snapshot is None or n.snapshot.blocks_total != snap.blocks_total
                                    or n.snapshot.block_size != snap.block_size):
            self._max_cap_known = False
        n.snapshot = snap
        hw = (snap.gpu_name, snap.gpu_count, snap.model)
        if hw != n.hardware:
            if hw == n.hardware_next:
                n.hardware_streak += 1
            else:
                n.hardware_next, n.hardware_streak = hw, 1
            if n.hardware is None or n.hardware_streak >= HARDWARE_CONFIRM:  # (the first reading: at once)
                n.hardware, n.hardware_next, n.hardware_streak = hw, None, 0
                self._set_prior(n)
        elif n.hardware_next is not None:
            n.hardware_next, n.hardware_streak = None, 0
        n.fresh_at = now - age_s
        n.shed_pending(now - age_s)
        if snap.lora_running is not None or n.lora_sent:
            self._lora_reading(n, snap, now - age_s)
        n._count_waiting()
        ratio = None
        if snap.step_fresh is not False and not repeat:
            context = self._context(n)
            ratio = step_ratio(n.model, snap.itl_s, snap.step_tokens, snap.step_decode, snap.running, context)
            # a mostly-prefill interval reads low on a healthy node: trusted only to say "slow" ...
            if ratio is not None and ratio < n.breaker.s.latency_multiplier * (n.breaker.baseline or 1.0) \
                    and prefill_heavy(n.model, snap.step_tokens, snap.step_decode, snap.running, context):
                ratio = None
                # ... yet it proves a floor (a preemption's recompute gap is in the latency, not a step)
                floor = None if snap.preemptions_per_s else step_floor(
                    n.model, snap.itl_s, snap.step_tokens, snap.step_decode, snap.running, context)
                if floor is not None:
                    n.speed.bound(floor)  # (the speed only: the breaker judges whole readings)
        if ratio is not None:
            n.latency = ratio
            n.speed.observe(ratio)
        # (what only a trip of a closed breaker consults is asked only then: each walks the fleet)
        closed = n.breaker.state is State.CLOSED
        n.breaker.observe(snap.kv_usage, ratio, now, self._may_open_another() if closed and ratio is not None else True,
                          may_trip_on_kv=self._another_closed(n, now) if closed and snap.kv_usage is not None
                          and snap.kv_usage > n.breaker.s.kv_threshold else True)
        self._correct(n, now, now - age_s)
        self.room.update(n)

    def _context(self, n: Node) -> float:
        """Tokens in the node's KV cache at its last reading."""
        s = n.snapshot
        if s is None or s.kv_usage is None or not s.blocks_total:
            return 0.0
        return s.kv_usage * (s.blocks_total * (s.block_size or DEFAULT_BLOCK))

    def _load(self, n: Node) -> tuple[float, float]:
        """(sequences decoding, context tokens) the node's steps carry now: the last reading plus what
        was sent since."""
        s = n.snapshot
        running = (s.running or 0.0) if s is not None else float(n.inflight)
        return min(running + len(n.pending), float(n.model.max_seqs)), self._context(n) + n.pending_tokens

    def _correct(self, n: Node, now: float, taken: float) -> None:
        """A reading (``taken`` then) shows what vLLM really has waiting: the virtual clocks become that
        backlog's predicted prefill time (by level), plus what was sent since; booked work the reading no
        longer shows as waiting is running or done — a prefill that started runs to its booked end, the
        rest at most a chunk."""
        m, f = n.model, n.speed.factor
        decode, context = self._load(n)
        chunk_s = (m.step(m.chunk(decode), decode, context)) * f
        snap = n.snapshot
        if snap is not None and snap.running == 0 and snap.waiting == 0 and not n.pending:
            # the node is idle: whatever was booked has run (or never needed to: a cached prefix, a
            # request that failed at once) — nothing is ahead of the next request
            n.prefills.clear()
            n.running_low.clear()
            n.busy.clear()
            n.top_due.clear()  # (nor is a top-tier request waiting for its first token here)
            return
        while n.prefills and n.prefills[0][1] <= now:
            n.prefills.popleft()
        # a prefill that started holds every step's budget until it is done (running requests first): one
        # the reading saw (sent before it was taken) and does not show waiting started, whatever its booked
        # start said — vLLM admits a waiting request into any step with budget left. Judged on the booked
        # start alone, a 6,000-token prompt booked behind a short one and read at once as not waiting was
        # taken for done: the next interactive request was predicted 71 ms on that node and waited 321
        # (mixed-gpus). One the reading shows waiting is in that backlog instead
        # — though at most its own cost from the reading: the chain booked ahead of it may have gone faster
        # than booked (a prefix-cache hit, a faster GPU), which a reading cannot tell (attack18: a burst of
        # 40 long prompts kept a node's clock 3.9 s ahead of readings that showed nothing waiting)
        waiting = n.waiting_tickets
        running_end = max((e if s <= now else min(e, taken + (e - s)) for s, e, _, t, sent in n.prefills
                           if s <= now or (sent <= taken and t not in waiting)), default=now)
        behind: float = 0.0
        pending_by_level: dict[int, int] = {}
        for _, _, pr, level in n.pending:
            pending_by_level[level] = pending_by_level.get(level, 0) + pr
        for lv in self.levels:
            behind += n.waiting_by_level.get(lv.priority, 0) + pending_by_level.get(lv.priority, 0)
            seen = now + m.prefill(behind, decode, context) * f if behind else now
            old = n.busy.get(lv.priority, now)
            n.busy[lv.priority] = max(seen, min(old, max(now + chunk_s, running_end)))

    # -- LoRA adapters ---------------------------------------------------------------------------

    def _lora_slots(self, n: Node) -> int:
        """Adapters one batch holds on ``n``: what it reports (``max_lora``), else ``nodes.lora.max_loras``."""
        s = n.snapshot
        return (s.max_lora if s is not None and s.max_lora else None) or self.cfg.lora.max_loras

    def _lora_use(self, n: Node, adapter: str) -> None:
        """``adapter`` runs on ``n`` now: the most recently used of its slots (the least recent leaves)."""
        loras = n.loras
        loras[adapter] = None
        loras.move_to_end(adapter)
        slots = self._lora_slots(n)
        while len(loras) > slots:
            loras.popitem(last=False)

    def _lora_reading(self, n: Node, snap: Snapshot, taken: float) -> None:
        """A reading's adapters: those running are in slots; what was sent before it is in the reading."""
        sent = n.lora_sent
        while sent and next(iter(sent.values())) <= taken:
            sent.popitem(last=False)
        for adapter in snap.lora_running or ():
            self._lora_use(n, adapter)
        for adapter in sent:  # sent since: used after what the reading shows
            self._lora_use(n, adapter)

    def lora_cost(self, n: Node, adapter: str) -> float:
        """Seconds an ``adapter`` request's first token on ``n`` takes beyond what ``predict`` says: a load
        when the node does not hold it (``nodes.lora.load_seconds``), and, when every slot runs another
        adapter, the wait for one to free (vLLM skips such a request until a batch has room for its
        adapter): about half what the node's requests still have to decode."""
        if adapter in n.loras:
            return 0.0
        cost = self.cfg.lora.load_seconds
        s = n.snapshot
        running = set(s.lora_running or ()) if s is not None else set()
        running.update(n.lora_sent)
        if len(running) >= self._lora_slots(n):
            outputs = [t - p for t, p, _ in n.requests.values()]
            left = (sum(outputs) / len(outputs) if outputs else LORA_DEFAULT_OUTPUT) / 2
            decode, context = self._load(n)
            cost += left * n.model.step(0, decode, context) * n.speed.factor
        return cost

    def _another_closed(self, node: Node, now: float) -> bool:
        """Whether another live node is closed: a KV trip never opens the last one."""
        return any(n is not node and n.breaker.state is State.CLOSED and self.status(n, now) != "dead"
                   for n in self.nodes.values())

    def _may_open_another(self) -> bool:
        """Whether one more breaker may open on latency (``breaker.max_open_fraction``)."""
        total = len(self.nodes)
        not_closed = self._not_closed
        if not_closed is None:
            not_closed = self._not_closed = sum(1 for n in self.nodes.values() if n.breaker.state is not State.CLOSED)
        return not_closed + 1 < total and (not_closed + 1) <= self.cfg.breaker.max_open_fraction * total

    def status(self, n: Node, now: float) -> str:
        if n.fresh_at is None:
            return "dead"
        age = now - n.fresh_at
        if age > self.cfg.dead_after_seconds:
            return "dead"
        return "unknown" if age > self.cfg.stale_after_seconds else "fresh"

    def max_capacity_tokens(self) -> int | None:
        """The largest KV cache of any known node in tokens (None before any reading): a request
        larger than this can never run anywhere."""
        if not self._max_cap_known:
            caps = [c for n in self.nodes.values() if (c := n.capacity_tokens()) is not None]
            self._max_cap, self._max_cap_known = (max(caps) if caps else None), True
        return self._max_cap

    def _own(self, n: Node, prompt_tokens: int, load: tuple[float, float] | None = None) -> float:
        """A request's own prefill on ``n``, nothing ahead of it (``load``: ``_load(n)``, when known)."""
        decode, context = load if load is not None else self._load(n)
        return n.model.prefill(prompt_tokens, decode, context) * n.speed.factor

    def _lora_load(self, n: Node, adapter: str) -> float:
        """Seconds loading ``adapter`` onto ``n`` takes (0 where the node holds it)."""
        return 0.0 if adapter in n.loras else self.cfg.lora.load_seconds

    def _own_with_load(self, n: Node, prompt_tokens: int, adapter: str | None) -> float:
        """A request's own part of its first token on ``n``: its prefill and, for an ``adapter`` the node
        does not hold, the adapter's load — neither is work ahead of it, and neither shrinks by waiting (a
        request refused never loads its adapter: counted as work ahead, a LoRA request whose prefill and
        load together pass its target was refused on every retry on an idle node, attack68 H1)."""
        own = self._own(n, prompt_tokens)
        if adapter is not None and self.cfg.lora.enabled:
            own += self._lora_load(n, adapter)
        return own

    # -- request life ----------------------------------------------------------------------------

    def dispatched(self, address: str, ticket: str, tokens: int, prompt_tokens: int, now: float,
                   priority: int = 0, ttft: float | None = None, adapter: str | None = None) -> None:
        n = self.nodes.get(address)
        if n is None:
            return
        if adapter is not None:
            self._lora_use(n, adapter)
            sent = n.lora_sent
            sent[adapter] = now
            sent.move_to_end(adapter)
        n.requests[ticket] = (tokens, prompt_tokens, priority)
        added: dict[int, float] = {}
        start, cost = self._book(n, tokens, prompt_tokens, priority, now, added)
        n.sent_own.append(now)
        n.added[ticket] = added
        if start <= now:  # nothing ahead at its level: it starts with the next step
            decode, context = self._load(n)
            start = now + n.step_left(n.model.step(0, decode, context) * n.speed.factor, now)
        if priority != self.levels[0].priority:
            n.running_low.append((start, start + cost, priority, ticket))
        n.prefills.append((start, start + cost, priority, ticket, now))
        if n.breaker.dispatched():
            n.trials.add(ticket)
        self.room.update(n)

    def booked_elsewhere(self, address: str, tokens: int, prompt_tokens: int, priority: int, now: float) -> None:
        """Another replica sent a request here: it counts in the KV projection and the prefill clocks
        like this replica's own until a reading taken after it shows it (its completion goes to the
        other replica, so nothing is kept per request)."""
        n = self.nodes.get(address)
        if n is None or tokens < 0 or prompt_tokens < 0:
            return
        self._book(n, tokens, prompt_tokens, priority, now)
        self.room.update(n)

    def _book(self, n: Node, tokens: int, prompt_tokens: int, priority: int, now: float,
              added: dict[int, float] | None = None) -> tuple[float, float]:
        """A request sent to ``n``, by this replica or another: it counts in the KV projection until a
        reading taken after it shows it, and its prefill runs ahead of everything booked at less urgent
        levels (their clocks advance). Returns (when its prefill starts, what it costs)."""
        if n.pending and n.pending[0][0] <= now - self.cfg.dead_after_seconds:
            n.shed_pending(now - self.cfg.dead_after_seconds)  # (a live node's reading took these already)
        n.pending.append((now, tokens, prompt_tokens, priority))
        n.pending_tokens += tokens
        n.pending_prompt += prompt_tokens
        start = max(n.busy.get(priority, now), now)
        decode, context = self._load(n)
        packed = n.model.packed(prompt_tokens, decode, context) * n.speed.factor
        cost = packed if start > now else self._own(n, prompt_tokens, (decode, context))
        for lv in self.levels:
            if lv.priority >= priority:
                clock = n.busy.get(lv.priority, now)
                # behind others, it packs into their steps (vLLM fills each step's budget with what waits)
                n.busy[lv.priority] = (clock + packed) if clock > now else now + cost
                if added is not None:
                    added[lv.priority] = packed if clock > now else cost
        return start, cost

    def completed(self, address: str, ticket: str, tokens: int, ok: bool | None, now: float,
                  step_end: bool | None = None) -> None:
        """A request sent to ``address`` ended; ``ok`` None: no verdict on the node (never reached it).
        ``step_end``: whether it ended with its last token, at the end of an engine step (its final usage
        came) — not a client that left mid-stream, nor a 4xx vLLM's API server answered without a step
        (review12: those moved ``Node.edge``); None: as ``ok``."""
        n = self.nodes.get(address)
        if n is None:
            return
        added = n.added.pop(ticket, None)
        if n.requests.pop(ticket, None) is not None:
            # it ended: its prefill is behind it, whatever was booked for it (it may have failed at once,
            # or hit vLLM's prefix cache) — what is left of the booking comes off the clocks, each in the
            # proportion the booking added to it (a less urgent backlog gained only its packed share)
            for start, end, level, t, _ in n.prefills:
                if t == ticket and end > now:
                    left = end - max(now, start)
                    cost = end - start
                    for lv in self.levels:
                        if lv.priority >= level and lv.priority in n.busy:
                            share = left
                            if added is not None and cost > 0.0 and lv.priority in added:
                                share = min(left, left * added[lv.priority] / cost)
                            n.busy[lv.priority] = max(now, n.busy[lv.priority] - share)
            _drop(n.prefills, ticket)
            _drop(n.running_low, ticket)
        trial = ticket in n.trials
        n.trials.discard(ticket)
        if ok is None:
            if trial:  # no verdict (the client left, the lease was reclaimed): another request may try
                n.breaker.trial_unused()
        else:  # (only a trial's success counts: attack95 F3; a transition re-judges its room: ``_hook``)
            n.breaker.result(ok, now, trial)
        if not n.requests:
            self.room.update(n)  # idle now: a request too large for the threshold alone may go there
        if ok is None:
            return
        if ok and (step_end is None or step_end):
            n.edge = now
        if ok and n._last_completion is not None and now > n._last_completion:
            rate = tokens / (now - n._last_completion) if n.inflight else None
            if rate is not None:
                n.drain_tokens_per_s = rate if n.drain_tokens_per_s is None else (
                    0.8 * n.drain_tokens_per_s + 0.2 * rate)
        n._last_completion = now


def _pins(cfg: Nodes) -> dict[str, str]:
    """Node address → the profile its ``nodes.static`` entry pins: looked up per node on every prior
    change, so built once per config (a scan per node cost O(N²) per reload at 1,000 nodes)."""
    return {e.address: e.profile for e in cfg.static if e.profile is not None}


def _drop(booked: deque[_Booked], ticket: str) -> None:
    """Take a ticket's entries out of a booking queue (ticket fourth), in place, keeping the order."""
    if any(e[3] == ticket for e in booked):
        kept = [e for e in booked if e[3] != ticket]
        booked.clear()
        booked.extend(kept)
