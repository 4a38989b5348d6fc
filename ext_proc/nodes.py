"""Which vLLM node takes a request: a datastore of node readings, filters, a score, a picker.

Shaped like the Gateway API Inference Extension's scheduler. Per request:

1. *filter* — drop nodes whose breaker is open (or half-open with its trial budget spent), nodes whose
   probe went silent beyond ``dead_after_seconds``, and nodes whose *projected* KV usage — the last
   snapshot, plus the requests vLLM had waiting then (they hold no KV yet), plus the tokens kvgate has
   sent there since — would pass ``kv_admit_threshold`` (minus the tier's ``reserve_kv``); nodes with
   a merely stale snapshot are used per ``unknown`` (default: only when no fresh node can take it);
   and nodes whose own vLLM queue is already long enough (``max_waiting_requests``, and
   ``max_prefill_tokens`` of prompts sent there and not yet prefilled), so that requests wait in
   kvgate's queue, where tenants and tiers are known, rather than in vLLM's FCFS one;
2. *score* — KV headroom left after this request, minus a little per request waiting in vLLM and per
   request kvgate has in flight there;
3. *pick* — the better of two random candidates ("power of two choices"), so that concurrent requests
   do not all herd onto the node that looked best at the last poll.

No node → a capacity rejection (503) whose Retry-After comes from how fast the fleet is draining.
Pure: time and randomness are injected; the server feeds it probe snapshots from a background poller.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_probe.snapshot import Snapshot

from .breaker import Breaker, BreakerSettings, State
from .config import Nodes

DEFAULT_BLOCK = 16


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
    pending: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(when, tokens, prompt tokens) sent since the last fresh snapshot: what it cannot show yet."""
    pending_tokens: int = 0
    """Sum of ``pending``'s tokens, kept as it changes: read on every request, for every node."""
    pending_prompt: int = 0
    requests: dict[str, tuple[int, int]] = field(default_factory=dict)
    """kvgate's requests in flight here, in dispatch order: ticket → (tokens, prompt tokens)."""
    waiting_tokens: int = 0
    """Tokens of the requests vLLM had waiting at the last snapshot: they hold no KV yet, so the KV
    reading does not show them (taken as kvgate's newest requests sent before it: vLLM is FCFS)."""
    waiting_prompt: int = 0
    drain_tokens_per_s: float | None = None
    latency: float | None = None
    """The last *new* prefill latency reading (s per 1k prompt tokens): what its peers are compared with."""
    trials: set[str] = field(default_factory=set)
    """Tickets sent here as half-open trials: a trial that ends without a verdict gives its place back."""
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
        """At a new reading: which of kvgate's requests are the ones vLLM says are waiting."""
        w = round(self.snapshot.waiting or 0.0) if self.snapshot is not None else 0
        skip = len(self.pending)  # the newest: sent after the reading was taken
        tokens = prompt = 0
        if w:
            for ticket in reversed(self.requests):
                if skip:
                    skip -= 1
                    continue
                t, pr = self.requests[ticket]
                tokens, prompt, w = tokens + t, prompt + pr, w - 1
                if not w:
                    break
        self.waiting_tokens, self.waiting_prompt = tokens, prompt

    def capacity_tokens(self) -> int | None:
        s = self.snapshot
        if s is None or not s.blocks_total:
            return None
        return s.blocks_total * (s.block_size or DEFAULT_BLOCK)

    def projected_kv(self, extra_tokens: int = 0) -> float | None:
        s = self.snapshot
        if s is None or s.kv_usage is None:
            return None
        cap = self.capacity_tokens()
        if cap is None:
            return s.kv_usage
        return s.kv_usage + (self.waiting_tokens + self.pending_tokens + extra_tokens) / cap


@dataclass(frozen=True)
class Choice:
    node: Node | None
    reason: str | None = None
    retry_after: float | None = None


def breaker_settings(cfg: Nodes) -> BreakerSettings:
    b = cfg.breaker
    return BreakerSettings(kv_threshold=b.kv_threshold, latency_multiplier=b.latency_multiplier,
                           recovery_window_s=b.recovery_window_seconds, half_open_requests=b.half_open_requests,
                           close_kv=b.close_kv, close_latency_multiplier=b.close_latency_multiplier,
                           latency_trip_readings=b.latency_trip_readings)


class Fleet:
    def __init__(self, cfg: Nodes, rng: random.Random | None = None,
                 on_transition: Callable[[str, State, State, str], None] | None = None) -> None:
        self.cfg = cfg
        self._rng = rng or random.Random()
        self.nodes: dict[str, Node] = {}
        self._on_transition = on_transition
        self.set_nodes([(n.address, n.probe, n.kv_admit_threshold) for n in cfg.static])

    def reconfigure(self, cfg: Nodes) -> None:
        self.cfg = cfg
        settings = breaker_settings(cfg)
        for n in self.nodes.values():
            n.breaker.s = settings
        self.set_nodes([(n.address, n.probe, n.kv_admit_threshold) for n in cfg.static] if cfg.static else
                       [(n.address, n.probe, n.override) for n in self.nodes.values()])

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
        self.nodes = nodes

    def _hook(self, address: str) -> Callable[[State, State, str], None] | None:
        cb = self._on_transition
        if cb is None:
            return None
        return lambda old, new, why: cb(address, old, new, why)

    # -- readings --------------------------------------------------------------------------------

    def on_snapshot(self, address: str, snap: Snapshot, now: float, age_s: float = 0.0) -> None:
        """A probe answered. ``age_s``: how old the reading already was when it arrived."""
        n = self.nodes.get(address)
        if n is None:
            return
        if not snap.ok:
            return  # a failed reading says nothing new: the node ages towards unknown / dead
        n.snapshot = snap
        n.fresh_at = now - age_s
        taken = now - age_s
        while n.pending and n.pending[0][0] <= taken:
            _, tokens, prompt = n.pending.popleft()
            n.pending_tokens -= tokens
            n.pending_prompt -= prompt
        n._count_waiting()
        latency = snap.prefill_s_per_ktok if snap.latency_fresh is not False else None
        if latency is not None:
            n.latency = latency
        n.breaker.observe(snap.kv_usage, latency, now, self._may_open_another(), self._peer_latency(n, now),
                          self._another_closed(n, now))

    def _peer_latency(self, node: Node, now: float) -> float | None:
        """The median recent prefill latency of the other fresh, closed nodes: what this node is
        compared with, besides its own past."""
        xs = sorted(n.latency for n in self.nodes.values() if n is not node and n.latency is not None
                    and n.breaker.state is State.CLOSED and self.status(n, now) == "fresh")
        if not xs:
            return None
        m = len(xs) // 2
        return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2

    def _another_closed(self, node: Node, now: float) -> bool:
        """Whether another live node is closed: a KV trip never opens the last one."""
        return any(n is not node and n.breaker.state is State.CLOSED and self.status(n, now) != "dead"
                   for n in self.nodes.values())

    def _may_open_another(self) -> bool:
        """Whether one more breaker may open on latency (``breaker.max_open_fraction``)."""
        total = len(self.nodes)
        not_closed = sum(1 for n in self.nodes.values() if n.breaker.state is not State.CLOSED)
        return not_closed + 1 < total and (not_closed + 1) <= self.cfg.breaker.max_open_fraction * total

    def status(self, n: Node, now: float) -> str:
        if n.fresh_at is None:
            return "dead"
        age = now - n.fresh_at
        if age > self.cfg.dead_after_seconds:
            return "dead"
        return "unknown" if age > self.cfg.stale_after_seconds else "fresh"

    # -- choice ----------------------------------------------------------------------------------

    def place(
        self, tokens: int, prompt_tokens: int, ticket: str, now: float, force: bool = False, reserve: float = 0.0,
        queue_caps: bool = True,
    ) -> Choice:
        """Choose a node and book the request there (what ``Admission`` calls)."""
        c = self.choose(tokens, now, force, prompt_tokens, reserve, queue_caps)
        if c.node is not None:
            self.dispatched(c.node.address, ticket, tokens, prompt_tokens, now)
        return c

    def choose(
        self, tokens: int, now: float, force: bool = False, prompt_tokens: int = 0, reserve: float = 0.0,
        queue_caps: bool = True,
    ) -> Choice:
        """``force``: any live node, whatever its load or breaker (shadow mode, bodyless routes).
        ``reserve``: KV fraction to leave free below each node's threshold (for more important tiers).
        ``queue_caps``: whether ``max_waiting_requests`` / ``max_prefill_tokens`` apply."""
        if force:
            live = [n for n in self.nodes.values() if self.status(n, now) != "dead"]
            if not live:
                return Choice(None, "fleet-no-healthy-node", 1.0)
            return Choice(max(live, key=lambda n: self._score(n, tokens)))
        fresh: list[Node] = []
        unknown: list[Node] = []
        kv_full = broken = queue_full = 0
        max_waiting, max_prefill = (self.cfg.max_waiting_requests, self.cfg.max_prefill_tokens) if queue_caps else (
            None, None)
        for n in self.nodes.values():
            st = self.status(n, now)
            if st == "dead":
                continue
            if not n.breaker.allows(now):
                broken += 1
                continue
            kv = n.projected_kv(tokens)
            if kv is not None and kv >= n.threshold - reserve and not self._alone_fits(n, tokens, reserve):
                kv_full += 1
                continue
            if max_waiting is not None and n.waiting() >= max_waiting:
                queue_full += 1
                continue
            if max_prefill is not None:
                pf = n.prefill_tokens()
                if pf and pf + prompt_tokens > max_prefill:  # an alone-too-large prompt still goes to an idle node
                    queue_full += 1
                    continue
            (fresh if st == "fresh" else unknown).append(n)
        policy = self.cfg.unknown
        candidates = fresh + unknown if policy == "serve" else (fresh or (unknown if policy == "fallback" else []))
        if not candidates:
            reason = ("fleet-kv" if kv_full else "fleet-queue" if queue_full else
                      "fleet-breakers-open" if broken else "fleet-no-healthy-node")
            return Choice(None, reason, self._retry_after(tokens, now))
        if len(candidates) == 1:
            return Choice(candidates[0])
        a, b = self._rng.sample(candidates, 2)
        return Choice(a if self._score(a, tokens) >= self._score(b, tokens) else b)

    @staticmethod
    def _alone_fits(n: Node, tokens: int, reserve: float) -> bool:
        """A request too large for the admit threshold by itself still goes to an idle node whose KV
        cache holds it: else it could never run anywhere, and would wait for a 503 forever."""
        cap, s = n.capacity_tokens(), n.snapshot
        if cap is None or s is None or n.inflight or n.pending or n.waiting():
            return False
        return tokens / cap >= n.threshold - reserve and (s.kv_usage or 0.0) + tokens / cap <= 1.0

    def max_capacity_tokens(self) -> int | None:
        """The largest KV cache of any known node in tokens (None before any reading): a request
        larger than this can never run anywhere."""
        caps = [c for n in self.nodes.values() if (c := n.capacity_tokens()) is not None]
        return max(caps) if caps else None

    def _score(self, n: Node, tokens: int) -> float:
        kv = n.projected_kv(tokens)
        headroom = n.threshold - (kv if kv is not None else n.threshold / 2)
        waiting = (n.snapshot.waiting or 0.0) if n.snapshot else 0.0
        return headroom - 0.01 * waiting - 0.005 * n.inflight

    def _retry_after(self, tokens: int, now: float) -> float:
        """When the first node is expected to have room: its excess KV over its drain rate; or when
        the first open breaker goes half-open."""
        best: float | None = None
        for n in self.nodes.values():
            if self.status(n, now) == "dead":
                continue
            if n.breaker.state is State.OPEN:
                wait = n.breaker.opened_at + n.breaker.s.recovery_window_s - now
            else:
                kv, cap = n.projected_kv(tokens), n.capacity_tokens()
                if kv is None or cap is None or not n.drain_tokens_per_s:
                    continue
                wait = (kv - n.threshold) * cap / n.drain_tokens_per_s
            best = wait if best is None else min(best, wait)
        return min(30.0, max(0.0, best if best is not None else 1.0))

    # -- request life ----------------------------------------------------------------------------

    def dispatched(self, address: str, ticket: str, tokens: int, prompt_tokens: int, now: float) -> None:
        n = self.nodes.get(address)
        if n is None:
            return
        n.pending.append((now, tokens, prompt_tokens))
        n.pending_tokens += tokens
        n.pending_prompt += prompt_tokens
        n.requests[ticket] = (tokens, prompt_tokens)
        if n.breaker.dispatched():
            n.trials.add(ticket)

    def completed(self, address: str, ticket: str, tokens: int, ok: bool | None, now: float) -> None:
        """A request sent to ``address`` ended; ``ok`` None: no verdict on the node (never reached it)."""
        n = self.nodes.get(address)
        if n is None:
            return
        n.requests.pop(ticket, None)
        trial = ticket in n.trials
        n.trials.discard(ticket)
        if ok is None:
            if trial:  # no verdict (the client left, the lease was reclaimed): another request may try
                n.breaker.trial_unused()
            return
        n.breaker.result(ok, now)
        if ok and n._last_completion is not None and now > n._last_completion:
            rate = tokens / (now - n._last_completion) if n.inflight else None
            if rate is not None:
                n.drain_tokens_per_s = rate if n.drain_tokens_per_s is None else (
                    0.8 * n.drain_tokens_per_s + 0.2 * rate)
        n._last_completion = now
