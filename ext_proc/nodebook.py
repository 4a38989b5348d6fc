"""The node book: what kvgate knows of each vLLM node between decisions, and what it can say of the
whole fleet at once.

:class:`Node` holds one node's record — its last probe reading and when it was taken, the requests
kvgate sent there (the bookings a reading cannot show yet, the ones in flight), its breaker, its
learned speed and the virtual prefill clocks per priority level. ``nodes.Fleet`` writes it (readings,
dispatches, completions) and its picker reads it (filters, predictions, the pick).

:class:`Room` is the fleet-wide summary the gateway queue needs: *can any node take a request of a tier
now* — answered without walking the fleet. With requests waiting and the fleet full, every event (a
probe reading, a decision, a completion, a tick) asks the queue whether its heads can go now; asking
node choice meant filtering every node of a 1,000-node fleet for each tier (2.3 ms per probe reading).
The summary keeps, per node, whether it *might* pass node choice's filters for each KV reserve in use,
and the count of such nodes per reserve: a node's entry is recomputed when anything it depends on
changes (a reading, a booking, a completion, a breaker transition, the node set), so a question costs
O(1) and an update O(reserves). It is conservative — "might" means node choice decides; "no" is exact:
no node passes the filters, whatever the request (its tokens only add to a node's projected KV).
Pure: no I/O, time passed in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from gpu_probe.snapshot import Snapshot

from .breaker import Breaker, State
from .perf import Speed

DEFAULT_BLOCK = 16
ALONE_SLACK = 1e-9
"""Rounding room in the summary's test of whether a request alone could fit an idle node (the filter
computes it from the request's own size): too wide only asks node choice once more."""


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
    requests: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """kvgate's requests in flight here, in dispatch order: ticket → (tokens, prompt tokens, vLLM priority)."""
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
    prefills: deque[tuple[float, float, int, str]] = field(default_factory=deque)
    """(start, end, level, ticket) of every prefill booked here, in booking order: one that started and
    has not reached its end is still running."""
    waiting_by_level: dict[int, int] = field(default_factory=dict)
    """Prompt tokens vLLM had waiting at the last reading, by priority level (kvgate's requests)."""
    _last_completion: float | None = None

    @property
    def inflight(self) -> int:
        return len(self.requests)

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
        if w:
            skip = len(self.pending)  # the newest: sent after the reading was taken
            sent = list(self.requests.values())
            sent = sent[:max(0, len(sent) - skip)] if skip else sent
            order = sorted(range(len(sent)), key=lambda i: (-sent[i][2], -i))
            for i in order[:w]:
                t, pr, level = sent[i]
                tokens, prompt = tokens + t, prompt + pr
                by_level[level] = by_level.get(level, 0) + pr
        self.waiting_tokens, self.waiting_prompt, self.waiting_by_level = tokens, prompt, by_level

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
    """Whether any node might take a request with a given KV reserve (see the module's docstring).

    A node *might* pass node choice's filters for reserve ``r`` unless it is certain not to:

    * never read (``fresh_at`` None): node choice skips it until a reading;
    * its breaker open and its recovery window not yet over (``allows`` stays false until then; the
      earliest end of an open breaker's window is kept, and from it on every question says "might");
    * its projected KV (no request added) at or above its threshold less ``r`` — a request only adds
      to it —, unless the node is idle and holds enough free KV that a request too large for the
      threshold alone could go there (``Fleet._alone_fits``).

    A half-open breaker or a node without a KV reading always might; so does a node gone silent, until
    node choice finds it dead (:meth:`dead`). Reserves are learned as asked (a tier's ``reserve_kv``: a few)."""

    def __init__(self) -> None:
        self._reserves: list[float] = []
        self._counts: list[int] = []
        """Per reserve in ``_reserves``: the nodes that might pass."""
        self._might: dict[int, tuple[bool, ...]] = {}
        """id(node) → per reserve, whether it might pass (what ``_counts`` counts)."""
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
        self._might.clear()
        self._open.clear()
        self._wakes.clear()
        self._counts = [0] * len(self._reserves)
        for n in self._nodes:
            self.update(n)

    def update(self, n: Node) -> None:
        """Something ``n``'s entry depends on changed: recompute it."""
        key = id(n)
        old = self._might.get(key)
        new = self._judge(n)
        if old != new:
            counts = self._counts
            for i, was in enumerate(old) if old is not None else ():
                counts[i] -= was
            for i, now in enumerate(new):
                counts[i] += now
            self._might[key] = new
        br = n.breaker
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
        old = self._might.get(id(n))
        if old is None or not any(old):
            return
        self._dead_seen = max(self._dead_seen, now)
        for i, was in enumerate(old):
            self._counts[i] -= was
        self._might[id(n)] = (False,) * len(old)

    def forget(self, n: Node) -> None:
        """``n`` left the fleet."""
        old = self._might.pop(id(n), None)
        for i, was in enumerate(old) if old is not None else ():
            self._counts[i] -= was
        self._open.pop(id(n), None)

    def might_fit(self, reserve: float, now: float) -> bool:
        """False only when no node can pass node choice's filters for a request with KV reserve
        ``reserve`` at ``now``, whatever its size."""
        wakes = self._wakes
        while wakes and self._open.get(wakes[0][1]) != wakes[0][0]:
            heapq.heappop(wakes)
        if (wakes and wakes[0][0] <= now) or now < self._dead_seen:
            return True
        try:
            i = self._reserves.index(reserve)
        except ValueError:
            i = self._learn(reserve)
        return self._counts[i] > 0

    def _learn(self, reserve: float) -> int:
        """A reserve not asked about before: every node's entry gains it."""
        self._reserves.append(reserve)
        self._counts.append(0)
        self.reset(self._nodes)
        return len(self._reserves) - 1

    def _judge(self, n: Node) -> tuple[bool, ...]:
        reserves = self._reserves
        if n.fresh_at is None:
            return (False,) * len(reserves)
        state = n.breaker.state
        if state is State.OPEN:
            return (False,) * len(reserves)  # until its window ends (``might_fit``)
        kv = n.projected_kv()
        if state is not State.CLOSED or kv is None:
            return (True,) * len(reserves)
        s, thr = n.snapshot, n.threshold
        alone = s is not None and not (n.inflight or n.pending or n.waiting()) and n.capacity_tokens() is not None
        usage = (s.kv_usage or 0.0) if s is not None else 0.0
        return tuple(kv < thr - r or (alone and thr - r <= 1.0 - usage + ALONE_SLACK) for r in reserves)
