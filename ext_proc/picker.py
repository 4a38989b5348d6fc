"""The picker: which vLLM node takes a request, from what the node book (``nodebook.py``) knows.

Shaped like the Gateway API Inference Extension's scheduler. Per request:

1. *filter* — drop nodes whose breaker is open (or half-open with its trial budget spent), nodes whose
   probe went silent beyond ``dead_after_seconds``, and nodes whose *projected* KV usage — the last
   snapshot, plus the requests vLLM had waiting then (they hold no KV yet), plus the tokens kvgate has
   sent there since — would pass ``kv_admit_threshold`` (minus the tier's ``reserve_kv``); nodes with
   a merely stale snapshot are used per ``unknown`` (default: only when no fresh node can take it);
2. *predict* — each candidate's time to this request's first token, from the node's performance model
   (``perf.py``: step-time prior times the node's learned speed factor) and the work ahead of it there:
   prefill booked at each vLLM priority level (a virtual clock per level, advanced by every dispatch and
   corrected by every probe reading), a low-priority chunk already running (vLLM schedules running
   requests first), half a step in progress. Candidates are bounded (``MAX_CANDIDATES``: a sample plus
   the last best), and a large fleet is filtered only until that many pass (``SCAN_LIMIT``), so a
   decision costs the same at 8 nodes and at 1,000;
3. *pick* — the top tier, and any prefill too short to cost a top-tier request its target, goes where
   its first token comes soonest. A *long* prefill (one that alone would) goes to the fullest node that
   still meets its own target (best fit), joins the long prefills already booked where it can, and
   never takes the last node without one while the top tier has traffic: long prefills gather, the
   top tier goes where nothing long is running — prefill isolation emerges from the predictions rather
   than from a fixed split of nodes. That rule reads vLLM priority levels; with one level (kvgate writes
   no priorities: vLLM is first come, first served) a less urgent request instead goes only where a
   top-tier request would still be quick — of those, preferably not beside a top-tier request its share
   of the step would make late (``Picker._late_beside``); where no ready node spares the top-tier
   requests waiting there or makes its target and two or more are ready, a node not ready where it makes
   none late and still makes its own TTFT target with the queue ahead counted twice —, and never takes
   the last such node of two or more (``Picker._keep_one_ready``) — else it is held in the gateway queue
   (``fleet-queue``, no prediction). A top-tier prompt whose own prefill alone is longer than its target
   (late wherever it goes) goes, within its limit, to the soonest node where it makes none of the
   top-tier requests waiting there late (``Picker._late_anyway``).

A new request no node can give a first token within its tier's max wait (``limit``) → ``fleet-queue``
with the predicted wait until one could meet its target: waiting would not help (the backlog ahead
drains as fast as the wait runs), so the gateway refuses it at once. With the gateway queue on and the
top tier active (``TOP_RECENT_S``), a new request of a tier below it is held to its TTFT target as well
(sent late, it would take the place of one that can make its own). A request that waited in the
gateway queue goes only while it can still make its target. No node passes the filters → a capacity
answer (the request waits in the gateway queue for room) whose Retry-After comes from how fast the
fleet is draining.
Before any of it, the book's room summary (``nodebook.Room``) may already say that no node can pass the
filters: the same capacity answer, without filtering the fleet.
Pure: time and randomness are injected.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from .breaker import State
from .config import Nodes
from .nodebook import Level, Node, NodeBook

MAX_CANDIDATES = 8
"""Nodes whose prediction a decision computes: all of a small fleet; of a large one a random sample
plus the node that was best last time."""
SCAN_LIMIT = 4 * MAX_CANDIDATES
"""A fleet larger than this is filtered in scan order (the last best, the holders of the prompt's
longest held prefix, then every node from a random place), stopping at MAX_CANDIDATES passing nodes or
at SCAN_LIMIT looked at with one passing: the filters cost per node too. Only when none of those passes
does the scan go on, to the whole fleet before a capacity answer."""
TOP_RECENT_S = 10.0
"""The top tier counts as active (it keeps a node free of long prefills, and a lower tier's new arrival is held
to its TTFT target) this long after this fleet was last asked to place a request of it (placed or refused; each
replica and pool keeps its own)."""
OWED_HOLD_S = 1.0
"""The release the gateway queue's starvation guard owes a less urgent tier waits for a node ready for the
top tier like any other (``Picker._keep_one_ready``), but only while one was ready within this many seconds:
a top tier that keeps every node busy longer would otherwise hold the tiers below to their deadlines
(review11 F3), and one that leaves a node ready now and then keeps its nodes (a release that skipped the
hold every time was a steady channel past it: interactive's predicted misses 14% -> 39%, attack14)."""
READY_SHARE = 0.5
"""A node is ready for the top tier (``Picker._keep_one_ready``) while a request of it arriving now would wait
at most this share of its TTFT target before its own prefill (the rest is for that prefill)."""
HORIZON_STEPS = 0.5
"""A less urgent prefill booked to start within this many full steps from now counts as running on its node:
vLLM admits it into the step that runs the last chunk of the one booked before it, up to a step before its
booked start, and a request arriving now comes after what the step in progress — begun on average half a
step ago — admitted. (A whole step, the most, ranked better on the 8,192-token budgets of the families but
worse on 2,048-token ones: noisy-neighbour's interactive p99 413 -> 462 ms, and a 34B A100 trace admitted
165 interactive requests instead of 217; half a step: 428 ms and 221.)"""


@dataclass(frozen=True)
class Choice:
    node: Node | None
    reason: str | None = None
    retry_after: float | None = None
    ttft: float | None = None
    """The predicted seconds to the first token on the chosen node (or, with no node meeting the target,
    on the best one)."""
    hit: int = 0
    """Prompt tokens the chosen node is expected to hold in its prefix cache (``prefix.py``)."""


def _within(t: float, own: float, lim: float) -> bool:
    """Whether a first token predicted at ``t`` (its own prefill ``own`` of it) is within the limit ``lim``:
    ``t`` itself, or for a prompt whose own prefill alone is longer, the work ahead of it (such a prompt
    is not refused for its own length, only for what waits ahead of it)."""
    return t <= lim or (own > lim and t - own <= lim)


def _fits(t: float, own: float, lim: float, wide: float | None) -> bool:
    """The refusal rule (``_within``) against the request's limit and, where that was narrowed to its TTFT
    target, its max wait ``wide`` too (``Picker._choose``)."""
    return _within(t, own, lim) and (wide is None or wide == lim or _within(t, own, wide))


def _wait_to_fit(t: float, own: float, target: float, lim: float, wide: float | None) -> float:
    """A refusal's Retry-After, as the backlog drains. A request that can make its TTFT target (its own
    prefill ``own`` within it) is told when its first token ``t`` would be within the target. A new arrival
    whose own prefill alone outlasts the target is told when the refusal would let it go: its first token
    within each limit — or, against a limit its prefill outlasts, the work ahead of it (read as the wait
    until its first token met the target, that was too long by the whole prefill, review69 L1; and when
    its limit is its max wait, the target does not enter it, review70 M2). A request held in the gateway
    queue (``wide`` its target: what is left of it) keeps the first reading — its retry has the whole
    target again, so that is too long by the hold, never too short (read as a new arrival's, a held
    prompt was told to come back before it could go, review70 M1)."""
    if wide is None or wide <= target or own <= target:
        return max(0.0, t - target)
    return max(0.0, *((t - x if own <= x else t - own - x) for x in (lim, wide)))


class Picker(NodeBook):
    """Filters, predictions and the pick, as methods over the node book it extends: the records are the
    book's, the scan ring, the last best node and when the top tier was last seen are the picker's own
    (``nodes.Fleet`` adds ``place``: choose, then book)."""

    def __init__(self, cfg: Nodes, rng: random.Random | None = None,
                 on_transition: Callable[[str, State, State, str], None] | None = None) -> None:
        self._rng = rng or random.Random()
        self._best: Node | None = None
        self._ring: list[Node] | None = None
        """The nodes in random order, for :meth:`_scan_order` (None: shuffle again, the node set changed)."""
        self._top_seen = -math.inf
        self._ready_seen = -math.inf
        """When a less urgent request last found a node ready for the top tier (``OWED_HOLD_S``)."""
        super().__init__(cfg, on_transition)

    def _nodes_changed(self) -> None:
        self._ring = None

    # -- choice ----------------------------------------------------------------------------------

    def hits(self, prefix: tuple[int, ...], prompt_tokens: int, now: float,
             among: list[Node] | None = None) -> dict[str, int]:
        """Node → prompt tokens it is expected to hold in its prefix cache (never the whole prompt: vLLM
        computes at least its last block); of the nodes ``among`` only, when given."""
        if not prefix or not self.cfg.prefix.enabled:
            return {}
        per_block = self.cfg.prefix.block_tokens
        cap = max(0, prompt_tokens - per_block)
        held = self.prefix.match(prefix, now, None if among is None else [n.address for n in among])
        return {a: min(cap, b * per_block) for a, b in held.items()}

    def choose(
        self, tokens: int, now: float, force: bool = False, prompt_tokens: int = 0, reserve: float = 0.0,
        queue_caps: bool = True, priority: int = 0, target: float | None = None, limit: float | None = None,
        prefix: tuple[int, ...] = (), retry: bool = True, adapter: str | None = None, urgent: bool | None = None,
        owed: bool = False,
    ) -> Choice:
        """``force``: any live node, whatever its load or breaker (shadow mode, bodyless routes).
        ``reserve``: KV fraction to leave free below each node's threshold (for more important tiers).
        ``queue_caps``: whether the deprecated ``max_waiting_requests`` / ``max_prefill_tokens`` apply.
        ``priority``: the vLLM priority level the request runs at; ``target``: seconds to its first token
        its tier's TTFT target leaves from now (None: no target — the soonest node); ``limit``: the latest
        first token still worth serving, in seconds from now (the tier's max wait; default ``target``).
        ``retry`` False: a no-node answer needs no Retry-After (the gateway queue's pump only learns from
        it that the tier cannot go yet) — it would walk the whole fleet. ``adapter``: the LoRA adapter the
        request runs with — each node's prediction counts loading it where the node does not hold it
        (``lora_cost``), so a holder wins unless its first token is later by more than a load costs.
        ``urgent``: whether the request is of the most urgent tier (None: whether it runs at the top
        priority level — the same thing when kvgate writes priorities into bodies). ``owed``: a release the
        gateway queue's starvation guard owes a less urgent tier — with one vLLM level it may take the last
        node ready for the top tier, and goes to the soonest node when none has been ready for
        ``OWED_HOLD_S`` (the guard's promise is that it goes; review11 F3); with several, placed as any."""
        if force:
            return self._any_live(tokens, now)
        if not self.room.might_fit(reserve, now, tokens):
            # no node can pass the filters for this request (a full fleet, requests waiting: every
            # event asks again): the answer the filters would give, without filtering every node. A large
            # fleet still draws the scan's random start, so that every later choice is the one it was
            if len(self._order) > SCAN_LIMIT:
                self._ring_start()
            return self._none_fit(tokens, now, retry)
        if len(self._order) > SCAN_LIMIT:
            # a large fleet: the last best, the nodes holding most of the prompt's prefix, then the rest in
            # random order, filtered until MAX_CANDIDATES pass (at least SCAN_LIMIT looked at before one
            # that passes is enough; the whole fleet before "none fits"). Prefix holdings are matched for
            # those candidates only: a prompt every node was sent (a common system prompt) is held by the
            # whole fleet, and matching it against every node was most of a decision at 1,000 nodes
            return self._choose(self._scan_order(prefix, now), tokens, now, prompt_tokens, reserve, queue_caps,
                                priority, target, limit, None, prefix, retry, adapter, urgent, owed)
        return self._choose(self._order, tokens, now, prompt_tokens, reserve, queue_caps, priority, target, limit,
                            self.hits(prefix, prompt_tokens, now), retry=retry, adapter=adapter, urgent=urgent,
                            owed=owed)

    def _any_live(self, tokens: int, now: float) -> Choice:
        """Any live node, the roomiest of those looked at (shadow decisions, bodyless routes): a small
        fleet all of it; a large one in scan order until MAX_CANDIDATES live nodes were scored — every
        bodyless request and shadow decision scored the whole fleet (review: 392 µs at 1,000 nodes) —
        and the whole ring before "no node is live"."""
        best: Node | None = None
        best_score = 0.0
        seen = 0
        order: Iterable[Node] = self._scan_order((), now) if len(self._order) > SCAN_LIMIT else self._order
        for n in order:
            if self.status(n, now) == "dead":
                continue
            score = self._score(n, tokens)
            if best is None or score > best_score:
                best, best_score = n, score
            seen += 1
            if seen >= MAX_CANDIDATES and len(self._order) > SCAN_LIMIT:
                break
        return Choice(best) if best is not None else Choice(None, "fleet-no-healthy-node", 1.0)

    def _none_fit(self, tokens: int, now: float, retry: bool = True) -> Choice:
        """``_choose``'s answer when ``room`` says no node passes: every live node whose breaker lets a request
        through (closed, or half-open with a trial left) fails on KV (``fleet-kv``), else a live one is open or
        out of trials (``fleet-breakers-open``), else none is live."""
        dead_s = self.cfg.dead_after_seconds
        reason = "fleet-no-healthy-node"
        for n in self._order:
            if n.fresh_at is None or now - n.fresh_at > dead_s:
                continue  # (``room`` already judges it: it passes nothing)
            if n.breaker.allows(now):
                reason = "fleet-kv"
                break
            reason = "fleet-breakers-open"
        return Choice(None, reason, self._retry_after(tokens, now) if retry else None)

    def _ring_start(self) -> tuple[list[Node], int]:
        """The ring of a large fleet's nodes (shuffled again after the node set changed) and a random
        place in it: where a scan starts."""
        ring = self._ring
        if ring is None:
            ring = self._ring = self._order[:]
            self._rng.shuffle(ring)
        return ring, self._rng.randrange(len(ring))

    def _scan_order(self, prefix: tuple[int, ...], now: float) -> Iterator[Node]:
        """A large fleet's nodes in the order a decision filters them: the last best, up to half of
        MAX_CANDIDATES nodes holding the longest run of the prompt's prefix, then a ring of every node in
        random order (shuffled when the node set changes) from a random place — one random draw per
        decision, not one per node (``random.sample`` was a tenth of a decision at 1,000 nodes)."""
        head: list[Node] = []
        best = self._best
        if best is not None and self.nodes.get(best.address) is best:
            head.append(best)
        if prefix and self.cfg.prefix.enabled:
            for address in self.prefix.deepest(prefix, now, MAX_CANDIDATES // 2):
                n = self.nodes.get(address)
                if n is not None and n is not best:
                    head.append(n)
        yield from head
        ring, start = self._ring_start()
        size = len(ring)
        for k in range(start, start + size):
            n = ring[k % size]
            if n not in head:
                yield n

    def _choose(
        self, pool: Iterable[Node], tokens: int, now: float, prompt_tokens: int, reserve: float, queue_caps: bool,
        priority: int, target: float | None, limit: float | None, hits: dict[str, int] | None = None,
        prefix: tuple[int, ...] | None = None, retry: bool = True, adapter: str | None = None,
        urgent: bool | None = None, owed: bool = False,
    ) -> Choice:
        """The filters, the predictions and the pick. ``hits``: prompt tokens each node is expected to hold
        in its prefix cache — that much less to prefill there, that much less new KV. ``prefix`` instead
        (a large fleet, ``pool`` in scan order): filter only until MAX_CANDIDATES nodes pass (or
        SCAN_LIMIT were looked at and one passed), then match the prefix for those."""
        scan = prefix is not None
        fresh: list[Node] = []
        unknown: list[Node] = []
        kv_full = broken = queue_full = 0
        max_waiting, max_prefill = (self.cfg.max_waiting_requests, self.cfg.max_prefill_tokens) if queue_caps else (
            None, None)
        dead_s, stale_s = self.cfg.dead_after_seconds, self.cfg.stale_after_seconds
        policy = self.cfg.unknown
        looked = usable = 0
        for n in pool:
            if scan and usable and looked >= SCAN_LIMIT:
                break
            looked += 1
            # (``status`` and a closed breaker's ``allows`` inline: this loop runs for every node filtered)
            if n.fresh_at is None:
                continue
            age = now - n.fresh_at
            if age > dead_s:
                self.room.dead(n, now)
                continue
            br = n.breaker
            if br.state is not State.CLOSED and not br.allows(now):
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
            (unknown if age > stale_s else fresh).append(n)
            if scan:
                usable = len(fresh) + len(unknown) if policy == "serve" else len(fresh) or (
                    len(unknown) if policy == "fallback" else 0)
                if usable >= MAX_CANDIDATES:
                    break
        candidates = fresh + unknown if policy == "serve" else (fresh or (unknown if policy == "fallback" else []))
        if scan:
            candidates = candidates[:MAX_CANDIDATES]
            hits = self.hits(prefix or (), prompt_tokens, now, candidates)
        hits = hits or {}
        if not candidates:
            reason = ("fleet-kv" if kv_full else "fleet-queue" if queue_full else
                      "fleet-breakers-open" if broken else "fleet-no-healthy-node")
            return Choice(None, reason, self._retry_after(tokens, now) if retry else None)
        if len(candidates) > MAX_CANDIDATES:
            # the nodes holding the prompt's prefix (the longest held first, up to half) always, a
            # sample of the rest, and the last best
            keep = sorted((n for n in candidates if hits.get(n.address)), key=lambda n: -hits[n.address])
            keep = keep[:MAX_CANDIDATES // 2]
            rest = [n for n in candidates if n not in keep]
            sample = keep + self._rng.sample(rest, min(len(rest), MAX_CANDIDATES - 1 - len(keep)))
            best = self._best
            if best is not None and best in candidates and best not in sample:
                sample.append(best)
            candidates = sample
        scored = [(self.predict(n, prompt_tokens - hits.get(n.address, 0), priority, now), n) for n in candidates]
        if adapter is not None and self.cfg.lora.enabled:
            loads = {n.address: self.lora_cost(n, adapter) for _, n in scored}
            scored = [(t + loads[n.address], n) for t, n in scored]
        else:
            loads = {}
        soonest, first = self._soonest(scored, tokens)
        self._best = first
        lim = wide = limit if limit is not None else target
        top = self.levels[0]
        is_top = (priority == top.priority) if urgent is None else urgent
        if (urgent is False and target is not None and wide is not None and wide > target
                and top.target is not None and now - self._top_seen < TOP_RECENT_S):
            # A new arrival of a tier below the top (with the gateway queue on: ``urgent`` False) while the
            # top tier has traffic (``top.target``: the top level's, with one vLLM level the tightest
            # target of all tiers): it goes only where it can still make its own TTFT target, as a held
            # request does. Sent late, it would take the place of requests that can make theirs (holding
            # it would not help: the work ahead drains as fast as the wait runs). Its max wait (``wide``)
            # still bounds it too: a prompt whose own prefill alone is longer than its target goes for the
            # work ahead of it within the target, never past its max wait (review68 M1). With the top
            # tier quiet, or without the gateway queue (kv-shed's rule), it goes within its max wait.
            lim = target

        if is_top:
            self._top_seen = now
        elif priority == top.priority:
            if top.target is not None and now - self._top_seen < TOP_RECENT_S:
                kept = self._keep_one_ready(scored, prompt_tokens, hits, top, lim, tokens, now, owed, target)
                if kept is None and owed and now - self._ready_seen > OWED_HOLD_S:
                    # the guard's release, and no node has been ready for the top tier for a while:
                    # holding it would only move the top tier's loss onto the tiers below
                    kept = scored, soonest, first
                if kept is None:
                    if target is not None and lim is not None and soonest > lim:
                        own = self._own_with_load(first, prompt_tokens - hits.get(first.address, 0), adapter)
                        if not _fits(soonest, own, lim, wide):
                            # no node at all can make its limit: refused at once, as below (waiting for a
                            # ready node would not help: review11)
                            return Choice(None, "fleet-queue", _wait_to_fit(soonest, own, target, lim, wide), soonest)
                    return Choice(None, "fleet-queue", self._retry_after(tokens, now) if retry else None)
                scored, soonest, first = kept
        elif (top.target is not None and now - self._top_seen < TOP_RECENT_S and len(scored) > 1
              and self._long(first, prompt_tokens - hits.get(first.address, 0), top)):
            # A long, less urgent prefill while the top tier has traffic: a long prefill running on a node
            # delays every request there by its chunks (vLLM runs running requests first, whatever their
            # priority), so the top tier keeps the last node with none booked.
            # It joins the long prefills already booked where it can still make its limit (its max wait;
            # its target, for a new arrival held to it), else takes a node of its own — never the last one
            # without. (Joined within its max wait alone, a new arrival held to its target went where the
            # refusal below then turned it away: a healthy 34B fleet at 65% load served 94.6% of its
            # requests instead of 97.1%)
            booked = [self._low_booked(n, now) for _, n in scored]
            busy = [x for x, b in zip(scored, booked, strict=True) if b]
            clear = len(scored) - len(busy)
            if busy and (clear == 1 or lim is None or min(t for t, _ in busy) <= lim):
                scored = busy
            soonest, first = self._soonest(scored, tokens)
        if target is None or lim is None:
            return Choice(first, ttft=soonest, hit=hits.get(first.address, 0))
        own = self._own_with_load(first, prompt_tokens - hits.get(first.address, 0), adapter)
        if not _fits(soonest, own, lim, wide):
            # no node can give it its first token within what it may wait (its max wait, or for a
            # request already held, what is left of its target): waiting does not change that (the
            # backlog drains as fast as the wait runs), so the gateway refuses it now. A prompt whose
            # own prefill alone is longer is not refused for that: only for the work ahead of it
            return Choice(None, "fleet-queue", _wait_to_fit(soonest, own, target, lim, wide), soonest)
        if is_top and own > target and len(scored) > 1:
            soonest, first = self._late_anyway(scored, soonest, first, prompt_tokens, hits, lim, tokens, now, adapter)
        if priority == top.priority or not self._long(first, prompt_tokens - hits.get(first.address, 0), top):
            # the soonest: for the top tier, and for a prefill too short to cost a top-tier request its
            # target when it runs beside it
            return Choice(first, ttft=soonest, hit=hits.get(first.address, 0))
        # a long prefill goes to the fullest node that still meets its target — or, its target lost, its
        # max wait (a new arrival held to its target too: that hold decides whether it goes, not where;
        # read against the target, the fullest node of all took it, an 11 s first token where another node
        # gave 0.5 s: review68 H1) — (best fit), where the booking keeps what waits behind it within its own
        # target: long prefills gather, the rest of the fleet stays quick for the top tier. Late beyond
        # that everywhere (a prompt whose own prefill alone outlasts its target and max wait), the fullest
        # node where the refusal above would let it go (its work ahead within them: not an 11 s first
        # token where another node gives 0.5 s, review69 M2); with none, the fullest of all
        bound = wide if wide is not None else target
        meets = ([(t, n) for t, n in scored if t <= target] or [(t, n) for t, n in scored if t <= bound]
                 or [(t, n) for t, n in scored
                     if _fits(t, self._own_with_load(n, prompt_tokens - hits.get(n.address, 0), adapter), lim, wide)]
                 or scored)
        kind = [(t, n) for t, n in meets
                if self._keeps_targets(n, prompt_tokens - hits.get(n.address, 0), priority, now)] or meets
        t, n = self._best_fit(kind, hits, tokens, loads)
        return Choice(n, ttft=t, hit=hits.get(n.address, 0))

    def _best_fit(self, fit: list[tuple[float, Node]], hits: dict[str, int], tokens: int,
                  loads: dict[str, float]) -> tuple[float, Node]:
        """Where a long prefill goes of the nodes it may take, in this order: the node holding the most of
        its prefix (it computes less there, whatever fits best); a node holding its LoRA adapter (``loads``:
        seconds of adapter load or slot wait per node, 0 for a holder); the fullest — the latest predicted
        first token, without that load or wait; the most headroom. A load it would add is no sign of a full
        node: ranked by it, a long adapter prompt went past the idle holder to load its adapter on another
        node (review47 F1: first token 0.26 s -> 0.41 s), and ranked by its size (a slot wait grows with a
        node's decoding requests) the emptiest node won (review48 F1)."""

        def key(x: tuple[float, Node]) -> tuple[int, bool, float, float]:
            load = loads.get(x[1].address, 0.0)
            return hits.get(x[1].address, 0), load == 0.0, x[0] - load, self._score(x[1], tokens)

        return max(fit, key=key)

    def _keep_one_ready(self, scored: list[tuple[float, Node]], prompt_tokens: int, hits: dict[str, int], top: Level,
                        lim: float | None, tokens: int, now: float,
                        owed: bool = False, target: float | None = None,
                        ) -> tuple[list[tuple[float, Node]], float, Node] | None:
        """A less urgent request that runs at the top tier's vLLM level (kvgate writes no priorities:
        vLLM is first come, first served) while the top tier has traffic. Everything booked on a node
        then runs before a top-tier request that arrives after it, and the gateway queue is the only
        place where tiers are put in order: so it goes only to a node whose queue ahead of it is short
        (a top-tier request arriving now would wait at most ``READY_SHARE`` of its target there), and
        not to the last such node if it would leave none (with two nodes or more to choose from: a lone
        candidate is not held); of those it prefers the nodes where it makes no top-tier request waiting
        for its first token late (``_late_beside``). Where no ready node spares the top-tier requests
        waiting there or makes its target and two or more are ready, it goes to a node not ready where it
        makes none late, if one still gives it its first token within its TTFT target (a tier without one:
        never) with the queue ahead counted twice: the ready nodes
        stay as they were (on the mixed-gpus scenario over seeds 1-20, with ``_late_beside`` counting
        every waiting top-tier request: late interactive requests 164 -> 56, kv-shed's 171; the
        families' interactive SLO +74 points summed over seeds 1-12).
        None: no node ready now —
        it waits in the gateway queue, where a top-tier arrival passes it. Without it, with every tier at
        one level, nothing kept a node ready: on the bursty-mmpp family's seed 1 a burst of long standard and batch
        prompts put 2-3 s of prefill on all four nodes at 15-40 % KV, and the interactive tenant got
        10 of its 34 requests refused in that minute."""
        assert top.target is not None
        if len(scored) < 2:
            # one node: nothing to keep apart — holding would only leave it idle between pumps (two-pools'
            # 70B pool, one node at a fifth of its load, refused a prompt the drain-rate estimate doomed)
            return scored, *self._soonest(scored, tokens)
        ready_s = READY_SHARE * top.target
        waits = [(self.predict(n, 0, top.priority, now), t, n) for t, n in scored]
        short = [(w, t, n) for w, t, n in waits if w <= ready_s]
        ready = len(short)  # (a node steered away from below, for a top-tier request there, is ready still)
        if ready:
            self._ready_seen = now
        if not owed:
            # steered to a ready node that spares the top-tier requests waiting there and still gives it its
            # first token within its target (a held request is placed again only while it can make that:
            # ``Core._pick``; review18/19) — never held for them: with none, it goes as without the rule
            afford = target if target is not None else lim
            spared = [(w, t, n) for w, t, n in short if (afford is None or t <= afford)
                      and self._spares(n, prompt_tokens, hits, now)]
            if not spared and ready >= 2 and target is not None:
                # No ready node spares them (or makes its target): a node not ready where it makes none
                # late and still makes its own target with the queue ahead of it counted twice takes it,
                # and the ready nodes stay as they are. Not with one node ready: the top tier then needs
                # the busy nodes back soon, and a prompt put on one keeps it busy longer (attack14's two
                # nodes under a flood of batch: interactive's predicted misses 18% -> 26% without this
                # bound, 17% with it). The queue counted twice: a prediction behind a queue runs late by
                # a share of it, and sent on its bare prediction a prompt missed its own target (attack52
                # A1: 8 nodes, a batch flood, 11 -> 73 past their 5 s target; 1 with the margin). Not
                # without a target to make (review52 F2). (The ready nodes failed above: not again.)
                spared = [(w, t, n) for w, t, n in waits if w > ready_s and t + w <= target
                          and self._spares(n, prompt_tokens, hits, now)]
            if spared:
                short = spared
        if not short:
            return None
        if ready == 1 and not owed:  # (the guard's owed release may take the last ready node)
            w, _, n = short[0]
            if w + self._own(n, prompt_tokens - hits.get(n.address, 0)) > ready_s:
                return None
        kept = [(t, n) for _, t, n in short if lim is None or t <= lim]
        if not kept:
            if lim is not None and any(t <= lim for t, _ in scored):
                # a node not ready now would make its limit (one it may not take yet: a single node ready,
                # too far behind, or a top-tier request there it would make late): wait for it
                # rather than be refused (or sent past its limit) for what the ready nodes alone predict
                # (review11)
                return None
            kept = [(t, n) for _, t, n in short]
        s, f = self._soonest(kept, tokens)
        return kept, s, f

    def _late_anyway(self, scored: list[tuple[float, Node]], soonest: float, first: Node, prompt_tokens: int,
                     hits: dict[str, int], lim: float, tokens: int, now: float,
                     adapter: str | None = None) -> tuple[float, Node]:
        """Where a top-tier prompt goes whose own prefill alone is longer than (what is left of) its target:
        it misses the target wherever it goes, but packed into the step of the top-tier requests still
        waiting for their first token on the soonest node it makes them miss theirs too (bursty-mmpp seed
        3: a 4,396-token chat prompt, sent to the soonest node, made three 300-token ones waiting there get
        their first token at 0.71 s, predicted 0.15 s). So it goes to the soonest node within its limit (as
        the refusal rule reads it: ``_within``) where it makes none of them late (``_late_beside``); with
        none, to the soonest. On the families' seeds 1-12: the interactive tier's SLO +21 points summed
        (better on 28 seeds, worse on 16), all tiers +7, interactive TTFT p99 0.5 s worse summed (within
        the check wherever it was met), 23 -> 21 misses of issue 30's checks. It has a cost where the node
        it takes was the one short top-tier prompts arriving next would have had (noisy-neighbour, two
        nodes: 31 chat requests gained their target and 49 lost it; chat SLO 79.3% -> 77.4%, p99 361 ->
        327 ms). Bounded to the soonest + its target, it kept little of the families' gain."""
        if self._spares(first, prompt_tokens, hits, now):
            return soonest, first
        spared = [(t, n) for t, n in scored
                  if _within(t, self._own_with_load(n, prompt_tokens - hits.get(n.address, 0), adapter), lim)
                  and self._spares(n, prompt_tokens, hits, now)]
        return self._soonest(spared, tokens) if spared else (soonest, first)

    def _spares(self, n: Node, prompt_tokens: int, hits: dict[str, int], now: float) -> bool:
        """Whether a prompt booked on ``n`` (less what ``n`` holds of it in its prefix cache) makes no
        top-tier request waiting there late (``_late_beside``)."""
        return not self._late_beside(n, prompt_tokens - hits.get(n.address, 0), now)

    def _late_beside(self, n: Node, prompt_tokens: int, now: float) -> bool:
        """Whether this prompt (a less urgent one, or a top-tier one late anyway: ``_late_anyway``), booked on
        ``n`` now, would make a top-tier request there miss its target. vLLM packs every waiting prompt
        into each engine step's token budget: a prompt booked beside a top-tier request still waiting for
        its first token makes that step longer by its share (its tokens that fit the budget, at the node's
        per-token cost), and the top-tier request's first token comes at the end of that step. On the
        mixed-gpus scenario each of the 7 late interactive requests (201-232 ms against 200) had a
        standard prompt booked onto its node just after it. ``_keep_one_ready`` steers away from such a
        node, never holds for it: held in the gateway queue, a prompt waited for each new top-tier request
        in turn (review17 F0: every 8,000-token prompt under a stream of 100-token ones refused) or,
        bounded, was refused later, and the families lost two checks. Every top-tier request waiting there
        counts, those sent after the prompt arrived too: the node packs whatever waits, whoever came first
        to the gateway (weighing only those sent before it — a bound from when the rule held — left a
        prompt held in the gateway queue free to make later ones late)."""
        due = n.top_due
        while due and due[0][0] <= now:
            due.popleft()
        # only one it would make late: one already predicted past its target misses it whatever runs beside
        # it (steered off for it, even a prompt of a few tokens was held until that first token)
        if not any(now < p <= d for p, d in due):
            return False
        extra = self._extra(n, prompt_tokens)
        return any(now < p <= d < p + extra for p, d in due)

    def _extra(self, n: Node, prompt_tokens: int) -> float:
        """Seconds a prompt booked on ``n`` adds to the engine step it is packed into: its tokens that fit
        the step's budget, at the node's per-token cost."""
        decode, _ = self._load(n)
        return n.model.b * min(prompt_tokens, n.model.chunk(decode)) * n.speed.factor

    def _packed_beside(self, n: Node, prompt_tokens: int, now: float) -> None:
        """A less urgent prompt (or a top-tier one predicted past its target) was booked on ``n``: the
        top-tier requests there still waiting for their first token share its step, so each comes later by
        its share — the next prompt is weighed against what is left of their targets, not against the
        whole (review17: two prompts that each fit it made one late together). The same shift for all
        keeps them in order."""
        extra = self._extra(n, prompt_tokens)
        if extra > 0.0:
            shifted = [(p + extra, d) if p > now else (p, d) for p, d in n.top_due]
            n.top_due.clear()
            n.top_due.extend(shifted)

    def _soonest(self, scored: list[tuple[float, Node]], tokens: int) -> tuple[float, Node]:
        """The soonest predicted first token, ties to the most headroom (the first of equals): the
        headroom is scored only for ties, not for every candidate."""
        soonest = min(t for t, _ in scored)
        tied = [n for t, n in scored if t == soonest]
        return soonest, tied[0] if len(tied) == 1 else max(tied, key=lambda n: self._score(n, tokens))

    def floor_ttft(self, prompt_tokens: int) -> float:
        """The least time to a first token for this prompt on any node: its prefill alone, at the
        fastest node's speed (0 with no node)."""
        if not self._order:
            return 0.0
        if len(self._order) > SCAN_LIMIT:
            # a large pool: the fastest of the profiles its nodes were given (a handful), not a walk of
            # every node — the pool's own profile alone missed the faster GPUs of a mixed pool (review12)
            return min(m.prefill(prompt_tokens, 0, 0) for m in self._models.values())
        return min(n.model.prefill(prompt_tokens, 0, 0) * n.speed.factor for n in self._order)

    def predict(self, n: Node, prompt_tokens: int, priority: int, now: float) -> float:
        """Seconds until a request of ``prompt_tokens`` at ``priority`` gets its first token on ``n``:
        the prefill booked ahead of it at its level or a more urgent one, the rest of the step in
        progress — or, when a less urgent prefill is running, the rest of it: it keeps every step's
        budget until it is done (vLLM runs running requests first) —, and its own prefill, all at the
        node's learned speed."""
        m, f = n.model, n.speed.factor
        decode, context = self._load(n)
        busy = n.busy
        ahead = below = 0.0
        if busy:  # (nothing booked: nothing ahead — most nodes, most of the time)
            ahead = busy.get(priority, now) - now
            ahead = ahead if ahead > 0.0 else 0.0
            below = max(busy.values()) - now - ahead
            below = below if below > 0.0 else 0.0
        step = m.step(0, decode, context) * f
        # a less urgent prefill already running keeps the steps' budget until it is done; else a request
        # arrives on average halfway through the step in progress
        low = n.running_low
        full = step + m.b * m.chunk(decode) * f
        running = None
        if low and self._low_booked(n, now):
            running = self._running_low_end(low, now, now + HORIZON_STEPS * full, priority)
        if running is not None:
            current = running - now  # (one at its own level or a more urgent one is in ``ahead``)
        else:
            current = (n.step_left(min(below, full), now) if below else n.step_left(step, now) if decode or ahead
                       else 0.0)
        return ahead + current + m.prefill(prompt_tokens, decode, context) * f

    @staticmethod
    def _running_low_end(low: Iterable[tuple[float, float, int, str]], now: float, horizon: float,
                         priority: int) -> float | None:
        """When the less urgent prefill vLLM is already running on a node is done, or None when none is.
        The book starts each prefill when the one before it ends, but vLLM admits a waiting request into
        any step with budget left, whatever waits behind it: into the step that runs the last chunk of the
        one before, up to a full step earlier than booked. So every less urgent prefill booked to start
        before ``horizon`` (``HORIZON_STEPS``) is running when this request reaches vLLM's queue, and all
        of it goes ahead of it (running requests first, whatever their priority)."""
        end = None
        for s, e, level, _ in low:
            if s <= horizon and level > priority and e > now and (end is None or e > end):
                end = e
        return end

    def _low_booked(self, n: Node, now: float) -> bool:
        """Whether less urgent prefill is booked on ``n`` beyond now."""
        low = n.running_low
        while low and low[0][1] <= now:
            low.popleft()
        return bool(low)

    def _long(self, n: Node, prompt_tokens: int, top: Level) -> bool:
        """A prefill long enough that a top-tier request arriving behind it would miss its target."""
        return top.target is not None and self._own(n, prompt_tokens) > top.target

    def _keeps_targets(self, n: Node, prompt_tokens: int, priority: int, now: float) -> bool:
        """Whether booking this prefill on ``n`` keeps the work queued behind it (at its own and less
        urgent levels) within those levels' targets; a node with nothing booked always does."""
        cost = self._own(n, prompt_tokens)
        for lv in self.levels:
            if lv.priority < priority or lv.target is None:
                continue
            booked = n.busy.get(lv.priority, now)
            if booked > now and booked + cost - now > lv.target:
                return False
        return True

    @staticmethod
    def _alone_fits(n: Node, tokens: int, reserve: float) -> bool:
        """A request too large for the admit threshold by itself still goes to an idle node whose KV
        cache holds it: else it could never run anywhere, and would wait for a 503 forever."""
        cap, s = n.capacity_tokens(), n.snapshot
        if cap is None or s is None or n.inflight or n.pending or n.waiting():
            return False
        return tokens / cap >= n.threshold - reserve and (s.kv_usage or 0.0) + tokens / cap <= 1.0

    def _score(self, n: Node, tokens: int) -> float:
        kv = n.projected_kv(tokens)
        headroom = n.threshold - (kv if kv is not None else n.threshold / 2)
        waiting = (n.snapshot.waiting or 0.0) if n.snapshot else 0.0
        return headroom - 0.01 * waiting - 0.005 * n.inflight

    def _retry_after(self, tokens: int, now: float) -> float:
        """When the first node is expected to have room: its excess KV over its drain rate; or when
        the first open breaker goes half-open (one its full cache alone opened: once that drained below
        ``close_kv``, when the drain rate says so sooner — review96 #3)."""
        best: float | None = None
        for n in self.nodes.values():
            if self.status(n, now) == "dead":
                continue
            br = n.breaker
            if br.state is State.OPEN:
                wait = br.opened_at + br.s.recovery_window_s - now
                kv, cap = n.snapshot.kv_usage if n.snapshot is not None else None, n.capacity_tokens()
                fresh = n.fresh_at is not None and now - n.fresh_at <= self.cfg.stale_after_seconds
                if br.drains and fresh and kv is not None and cap is not None and n.drain_tokens_per_s:
                    # (from a fresh reading only: a stale one would promise the same drain again and again —
                    # review97 #7)
                    wait = min(wait, (kv - br.s.close_kv) * cap / n.drain_tokens_per_s)
            else:
                kv, cap = n.projected_kv(tokens), n.capacity_tokens()
                if kv is None or cap is None or not n.drain_tokens_per_s:
                    continue
                wait = (kv - n.threshold) * cap / n.drain_tokens_per_s
            best = wait if best is None else min(best, wait)
        return min(30.0, max(0.0, best if best is not None else 1.0))
