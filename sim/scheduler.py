"""A pure mirror of one vLLM v1 scheduling step.

What it reproduces (vLLM ``vllm/v1/core/sched/scheduler.py`` and ``kv_cache_manager.py``):

* a per-step token budget (``max_num_batched_tokens``) and a cap on running sequences (``max_num_seqs``);
* running requests are scheduled first, then waiting ones; a decode costs 1 token of budget, a prefill
  as many as fit (chunked prefill: the rest of the prompt continues next step);
* paged KV: blocks of ``block_size`` tokens; a waiting request is admitted only when blocks for its
  whole prompt are free; a running request grows by a block every ``block_size`` tokens;
* when a running request cannot grow, the lowest-priority running request (FCFS: the newest) is
  preempted — its blocks freed, its progress dropped, to be recomputed when it is scheduled again —
  and no waiting request is admitted in that step;
* FCFS or priority order (``priority`` then arrival, lower first) for the waiting queue;
* an optional cap on queued requests (``--max-num-queued-reqs``), beyond which ``add`` refuses.

No clock and no I/O: the engine calls ``schedule`` and then ``finish_step`` with the step's end time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Literal, NamedTuple

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

    def _free(self, req: Request) -> None:
        self.free_blocks += req.blocks
        req.blocks = 0

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
                self.free_blocks -= need
                req.blocks += need
            scheduled[req] = num_new
            budget -= num_new
            if num_new == 1 and remaining == 1 and req.output_tokens > 0:
                decode += 1
            else:
                prefill += num_new
            context += computed + num_new
            i += 1
        if not preempted:
            while budget > 0 and len(running) < self.cfg.max_num_seqs:
                req = self._peek()  # type: ignore[assignment]
                if req is None:
                    break
                need = -(-req.num_tokens // bs)
                if need > self.free_blocks:
                    break  # admitted only when the whole prompt fits
                self._pop()
                self.free_blocks -= need
                req.blocks = need
                req.status = Status.RUNNING
                if req.first_scheduled is None:
                    req.first_scheduled = now
                running.append(req)
                num_new = min(req.num_tokens - req.num_computed, budget)
                scheduled[req] = num_new
                budget -= num_new
                prefill += num_new
                context += req.num_computed + num_new
        return Plan(list(scheduled.items()), prefill, decode, context, preempted)

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
                self.free_blocks += req.blocks
                req.blocks = 0
                finished = True
            generated += 1
            if every_token or done:
                events.append(TokenEvent(req, done, previous))
        self.generation_tokens += generated
        if finished:
            self.running = [r for r in self.running if r.status is running]
        return events
