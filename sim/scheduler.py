"""A pure mirror of one vLLM v1 scheduling step.

What it reproduces (vLLM ``vllm/v1/core/sched/scheduler.py`` and ``kv_cache_manager.py``):

* a per-step token budget (``max_num_batched_tokens``) and a cap on running sequences (``max_num_seqs``);
* running requests are scheduled first, then waiting ones; a decode costs 1 token of budget, a prefill
  as many as fit (chunked prefill: the rest of the prompt continues next step), at most
  ``long_prefill_token_threshold`` of one request in one step when that is set (> 0), running or waiting
  alike — vLLM v1's only partial-prefill knob (``max_num_partial_prefills`` / ``max_long_partial_prefills``
  are V0 scheduler settings that v1 refuses at other than 1 and later removed);
* paged KV: blocks of ``block_size`` tokens; a waiting request is admitted only when blocks for its
  whole prompt are free; a running request grows by a block every ``block_size`` tokens;
* automatic prefix caching (on by default, as in vLLM; ``kv_cache_manager.py``, ``block_pool.py``,
  ``single_type_kv_cache_manager.py``): a block is hashed (``prefix_cache``) as soon as the tokens that
  fill it are scheduled; a new or preempted request looks up the longest run of cached full blocks from
  its start, but never its last token (``num_tokens - 1`` at most, in whole blocks: a fully cached prompt
  recomputes its last block); a hit takes a reference on those blocks (out of the free queue if they were
  there), skips their prefill and allocates only the rest; freed blocks keep their hash in the free
  queue, tail first (``reversed(req_blocks)``), and allocation takes the queue's head, evicting the
  least recently freed cached block; queries and hits are counted in tokens, at admission, separately
  for preempted requests (vLLM's Prometheus counters count only the others);
* when a running request cannot grow, the lowest-priority running request (FCFS: the newest) is
  preempted — its blocks freed, its progress dropped, to be recomputed when it is scheduled again —
  and no waiting request is admitted in that step;
* FCFS or priority order (``priority`` then arrival, lower first) for the waiting queue;
* an optional cap on queued requests (``--max-num-queued-reqs``), beyond which ``add`` refuses;
* LoRA adapters (``max_loras``, off by default): a step's batch holds requests of at most ``max_loras``
  adapters; a waiting request of another adapter is skipped — it keeps its place, the requests behind
  it may go — until a slot frees (vLLM's ``scheduled_loras`` check in the waiting loop).

No clock and no I/O: the engine calls ``schedule`` and then ``finish_step`` with the step's end time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, NamedTuple

from .prefix_cache import BlankRun, Block, Prompt, extend_hashes

Policy = Literal["fcfs", "priority"]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    id: str
    prompt_tokens: int
    max_tokens: int
    """Output tokens this request will produce (the engine decides where a request 'stops')."""
    arrival: float
    priority: int = 0
    finish_reason: str = "length"
    status: Status = Status.WAITING
    num_computed: int = 0
    output_tokens: int = 0
    blocks: int = 0
    seq: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished_at: float | None = None
    prefill_done_at: float | None = None
    preemptions: int = 0
    content: Prompt | None = None
    """What the prompt holds, for prefix caching; None: only counts (never hits, caches nothing)."""
    cached_tokens: int = 0
    """Tokens found in the prefix cache when the request was last admitted (vLLM's ``num_cached_tokens``)."""
    block_hashes: list[int] = field(default_factory=list)
    """Hashes of the request's full blocks computed so far (vLLM's ``request.block_hashes``)."""
    hashed: list[Block] = field(default_factory=list)
    """The request's leading blocks that carry a hash (the rest of its ``blocks`` are blank)."""
    lora: str | None = None
    """The LoRA adapter it runs with (vLLM's ``lora_request``); None: the base model."""

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request needs: the prompt and what it has generated so far."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    num_gpu_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    policy: Policy = "fcfs"
    max_num_queued_reqs: int | None = None
    enable_prefix_caching: bool = True
    max_loras: int | None = None
    """Adapters one batch may hold (vLLM ``--max-loras``); None: LoRA off, no check."""
    long_prefill_token_threshold: int = 0
    """vLLM's ``--long-prefill-token-threshold``: the most new tokens one request gets in one step (0: no
    cap but the step's budget). A long prompt then takes several steps however empty the budget is, and
    leaves the rest of each step's budget to the requests behind it."""


@dataclass
class Plan:
    scheduled: list[tuple[Request, int]]
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    preempted: list[Request]

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class TokenEvent(NamedTuple):
    """One sampled token (a tuple: millions are made in a long simulation)."""

    request: Request
    finished: bool
    previous_token_at: float | None
    """When the request's previous token came out (None for its first): inter-token latency."""


class QueueFull(Exception):
    """The waiting queue is at ``max_num_queued_reqs`` (vLLM answers 503)."""


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.free_blocks = cfg.num_gpu_blocks
        self.running: list[Request] = []
        self._fcfs: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []
        self._seq = itertools.count()
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.caching = cfg.enable_prefix_caching
        self._cached: dict[int, list[Block]] = {}
        """Block hash → the blocks holding it (vLLM does not de-duplicate; a lookup takes the first)."""
        self._queue: OrderedDict[Block | BlankRun, None] = OrderedDict()
        """The free queue in eviction order (head first) while it holds a cached block; empty when every
        free block is blank (then ``free_blocks`` says all, and count-only runs never touch it)."""
        self._evictable = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        """Prefix-cache queries and hits, in tokens, of requests never preempted (vLLM's counters)."""
        self.preempted_prefix_queries = 0
        self.preempted_prefix_hits = 0

    # -- queue -----------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._heap) if self.cfg.policy == "priority" else len(self._fcfs)

    @property
    def used_blocks(self) -> int:
        return self.cfg.num_gpu_blocks - self.free_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.cfg.num_gpu_blocks

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, req: Request) -> None:
        if self._blocks_for(req.prompt_tokens + req.max_tokens) > self.cfg.num_gpu_blocks:
            raise ValueError(
                f"request {req.id} needs {req.prompt_tokens + req.max_tokens} tokens of KV cache; "
                f"the engine holds {self.cfg.num_gpu_blocks * self.cfg.block_size}"
            )
        cap = self.cfg.max_num_queued_reqs
        if cap is not None and self.num_waiting >= cap:
            raise QueueFull(req.id)
        req.seq = next(self._seq)
        req.status = Status.WAITING
        self._push(req)

    def _push(self, req: Request, front: bool = False) -> None:
        if self.cfg.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.seq, req))
        elif front:
            self._fcfs.appendleft(req)
        else:
            self._fcfs.append(req)

    def _peek(self) -> Request | None:
        if self.cfg.policy == "priority":
            return self._heap[0][2] if self._heap else None
        return self._fcfs[0] if self._fcfs else None

    def _pop(self) -> Request:
        if self.cfg.policy == "priority":
            return heapq.heappop(self._heap)[2]
        return self._fcfs.popleft()

    def waiting(self) -> list[Request]:
        if self.cfg.policy == "priority":
            return [r for _, _, r in sorted(self._heap, key=lambda e: (e[0], e[1]))]
        return list(self._fcfs)

    def abort(self, req: Request) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self._free(req)
        elif req.status == Status.WAITING:
            if self.cfg.policy == "priority":
                self._heap = [e for e in self._heap if e[2] is not req]
                heapq.heapify(self._heap)
            else:
                self._fcfs.remove(req)
        req.status = Status.ABORTED

    # -- one step --------------------------------------------------------------------------------

    @property
    def evictable_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (counted in ``free_blocks``, as vLLM counts them)."""
        return self._evictable

    @property
    def cached_blocks(self) -> int:
        """Blocks with a hash, in use or free."""
        return sum(len(v) for v in self._cached.values())

    def cache_hit_tokens(self, req: Request) -> int:
        """Tokens of ``req`` the prefix cache would serve if it were admitted now; changes nothing."""
        if not self.caching or req.content is None or not self._cached:
            return 0
        bs = self.cfg.block_size
        max_blocks = (req.num_tokens - 1) // bs
        # -1: the key of tokens that are the request's own, which no request in here has (seq >= 0)
        hashes = extend_hashes(req.content, [], max_blocks, bs, req.prompt_tokens, -1)
        n = 0
        for h in hashes:
            if not self._cached.get(h):
                break
            n += 1
        return n * bs

    def _free(self, req: Request) -> None:
        """Free a request's blocks as vLLM does: tail first, so its last blocks are evicted first."""
        hashed = req.hashed
        blank = req.blocks - len(hashed)
        req.blocks = 0
        self.free_blocks += blank
        q = self._queue
        if q and blank:
            last = next(reversed(q))
            if isinstance(last, BlankRun):
                last.n += blank
            else:
                q[BlankRun(blank)] = None
        if not hashed:
            return
        for b in reversed(hashed):
            b.ref -= 1
            if b.ref == 0:
                if not q and self.free_blocks:
                    q[BlankRun(self.free_blocks)] = None  # the blank blocks already free are ahead of it
                q[b] = None
                self._evictable += 1
                self.free_blocks += 1
        req.hashed = []

    def _take(self, n: int) -> None:
        """Allocate ``n`` blocks from the head of the free queue, evicting the cached ones met there."""
        self.free_blocks -= n
        q = self._queue
        if not q:
            return
        while n:
            head = next(iter(q))
            if isinstance(head, BlankRun):
                if head.n > n:
                    head.n -= n
                    break
                n -= head.n
                del q[head]
            else:
                del q[head]
                self._forget(head)
                n -= 1
        if not self._evictable:
            q.clear()

    def _forget(self, b: Block) -> None:
        self._evictable -= 1
        same = self._cached[b.hash]
        same.remove(b)
        if not same:
            del self._cached[b.hash]

    def _touch(self, hits: list[Block]) -> None:
        """A hit takes a reference on each block; a free one leaves the free queue (vLLM's ``touch``)."""
        q = self._queue
        for b in hits:
            if b.ref == 0:
                del q[b]
                self._evictable -= 1
                self.free_blocks -= 1
            b.ref += 1
        if not self._evictable:
            q.clear()

    def _hashes(self, req: Request, n_blocks: int) -> list[int]:
        have = req.block_hashes
        if len(have) < n_blocks:
            assert req.content is not None
            # seq is unique per request in this scheduler: the key of the request's own tokens
            extend_hashes(req.content, have, n_blocks, self.cfg.block_size, req.prompt_tokens, req.seq)
        return have

    def _lookup(self, req: Request) -> list[Block]:
        """The longest run of cached full blocks from the start, leaving at least the last token to compute
        (vLLM's ``get_computed_blocks`` / ``find_longest_cache_hit``)."""
        max_blocks = (req.num_tokens - 1) // self.cfg.block_size
        if max_blocks <= 0 or not self._cached:
            return []
        hits: list[Block] = []
        cached = self._cached
        for h in self._hashes(req, max_blocks)[:max_blocks]:
            same = cached.get(h)
            if not same:
                break
            hits.append(same[0])
        return hits

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Hash the request's blocks that ``num_tokens`` fill (vLLM's ``cache_blocks``, at allocation)."""
        n_full = num_tokens // self.cfg.block_size
        hashed = req.hashed
        if n_full <= len(hashed):
            return
        hashes = self._hashes(req, n_full)
        cached = self._cached
        for i in range(len(hashed), n_full):
            b = Block(hashes[i])
            hashed.append(b)
            same = cached.get(b.hash)
            if same is None:
                cached[b.hash] = [b]
            else:
                same.append(b)

    def _victim(self) -> Request:
        if self.cfg.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.seq))
        return self.running[-1]

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def schedule(self, now: float) -> Plan:
        # Hot path of every simulation: arithmetic is inlined (ceil division for blocks) on purpose.
        bs = self.cfg.block_size
        budget = self.cfg.max_num_batched_tokens
        caching = self.caching
        cap = self.cfg.long_prefill_token_threshold
        scheduled: dict[Request, int] = {}
        preempted: list[Request] = []
        running = self.running
        prefill = decode = context = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed
            remaining = req.prompt_tokens + req.output_tokens - computed
            num_new = remaining if remaining < budget else budget
            if 0 < cap < num_new:
                num_new = cap
            need = -(-(computed + num_new) // bs) - req.blocks
            if need > self.free_blocks:
                while need > self.free_blocks:
                    victim = self._victim()
                    idx = running.index(victim)
                    running.pop(idx)
                    if victim in scheduled:
                        n = scheduled.pop(victim)
                        budget += n
                        context -= victim.num_computed + n
                        if n == 1 and victim.output_tokens > 0 and victim.num_computed == victim.num_tokens - 1:
                            decode -= 1
                        else:
                            prefill -= n
                    self._free(victim)
                    victim.num_computed = 0
                    victim.status = Status.WAITING
                    victim.preemptions += 1
                    self.preemptions += 1
                    preempted.append(victim)
                    self._push(victim, front=True)
                    if idx < i:
                        i -= 1
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    continue
            if need > 0:
                self._take(need)
                req.blocks += need
            if caching and req.content is not None:
                self._cache_full_blocks(req, computed + num_new)
            scheduled[req] = num_new
            budget -= num_new
            if num_new == 1 and remaining == 1 and req.output_tokens > 0:
                decode += 1
            else:
                prefill += num_new
            context += computed + num_new
            i += 1
        if not preempted:
            loras = self._batch_loras(scheduled) if self.cfg.max_loras is not None else None
            skipped: list[Request] = []
            while budget > 0 and len(running) < self.cfg.max_num_seqs:
                req = self._peek()  # type: ignore[assignment]
                if req is None:
                    break
                if loras is not None and self._lora_blocked(req, loras):
                    skipped.append(self._pop())
                    continue
                need = -(-req.num_tokens // bs)
                if caching:
                    hits = self._lookup(req) if req.content is not None else []
                    evictable = 0
                    for b in hits:
                        if b.ref == 0:
                            evictable += 1  # leaves the free queue: as good as allocated
                    if need - len(hits) + evictable > self.free_blocks:
                        break  # admitted only when the whole prompt fits
                    self._pop()
                    if hits:
                        self._touch(hits)
                        req.hashed = hits
                    self._take(need - len(hits))
                    req.num_computed = req.cached_tokens = len(hits) * bs
                    if req.preemptions:
                        self.preempted_prefix_queries += req.num_tokens
                        self.preempted_prefix_hits += req.num_computed
                    else:
                        self.prefix_queries += req.num_tokens
                        self.prefix_hits += req.num_computed
                else:
                    if need > self.free_blocks:
                        break  # admitted only when the whole prompt fits
                    self._pop()
                    self._take(need)
                req.blocks = need
                req.status = Status.RUNNING
                if req.first_scheduled is None:
                    req.first_scheduled = now
                running.append(req)
                num_new = min(req.num_tokens - req.num_computed, budget)
                if 0 < cap < num_new:
                    num_new = cap
                if caching and req.content is not None:
                    self._cache_full_blocks(req, req.num_computed + num_new)
                scheduled[req] = num_new
                budget -= num_new
                prefill += num_new
                context += req.num_computed + num_new
                if loras is not None and req.lora is not None:
                    loras.add(req.lora)
            for req in reversed(skipped):
                self._push(req, front=True)
        return Plan(list(scheduled.items()), prefill, decode, context, preempted)

    # -- LoRA adapters (``max_loras``) ----------------------------------------------------------------

    @staticmethod
    def _batch_loras(scheduled: dict[Request, int]) -> set[str]:
        """The adapters of the running requests this step scheduled: the batch's slots in use."""
        return {r.lora for r in scheduled if r.lora is not None}

    def _lora_blocked(self, req: Request, loras: set[str]) -> bool:
        """Whether a waiting request cannot join this step's batch: its adapter is not among the batch's
        and every slot (``max_loras``) is taken."""
        return req.lora is not None and req.lora not in loras and len(loras) >= (self.cfg.max_loras or 0)

    def lora_requests(self) -> tuple[dict[str, int], dict[str, int]]:
        """(adapter → running requests, adapter → waiting requests): what vLLM's ``lora_requests_info``
        lists as ``running_lora_adapters`` and ``waiting_lora_adapters``."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for r in self.running:
            if r.lora is not None:
                running[r.lora] = running.get(r.lora, 0) + 1
        for r in self.waiting():
            if r.lora is not None:
                waiting[r.lora] = waiting.get(r.lora, 0) + 1
        return running, waiting

    def finish_step(self, plan: Plan, now: float, every_token: bool = True) -> list[TokenEvent]:
        """Apply a step's results at its end time ``now``: progress, sampled tokens, finished requests.

        Returns an event per sampled token, or with ``every_token=False`` only for finished requests
        (virtual-time runs that read timings off the requests need no more).
        """
        events: list[TokenEvent] = []
        finished = False
        generated = 0
        running = Status.RUNNING
        for req, n in plan.scheduled:
            if req.status is not running:
                continue  # aborted while the step ran
            req.num_computed += n
            if req.num_computed < req.prompt_tokens + req.output_tokens:
                continue  # a chunk of a longer prefill: no token yet
            if req.prefill_done_at is None:
                req.prefill_done_at = now
                self.prompt_tokens += req.prompt_tokens
            req.output_tokens += 1
            if req.first_token is None:
                req.first_token = now
            previous = req.last_token
            req.last_token = now
            done = req.output_tokens >= req.max_tokens
            if done:
                req.status = Status.FINISHED
                req.finished_at = now
                self._free(req)
                finished = True
            generated += 1
            if every_token or done:
                events.append(TokenEvent(req, done, previous))
        self.generation_tokens += generated
        if finished:
            self.running = [r for r in self.running if r.status is running]
        return events
