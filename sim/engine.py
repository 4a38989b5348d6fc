"""The simulated engine: the scheduler, the step-time model and a clock.

``Engine`` is clock-agnostic: ``begin_step(now)`` plans a step and says how long it takes,
``end_step(at)`` applies it. ``simulate`` drives it in virtual time (as fast as the CPU allows);
``sim.server`` drives the very same object in real time behind vLLM's HTTP API.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ext_proc.profiles import Profile

from .scheduler import Plan, Policy, Request, Scheduler, SchedulerConfig, TokenEvent


@dataclass
class EngineOptions:
    policy: Policy = "fcfs"
    max_num_queued_reqs: int | None = None
    noise: float = 0.0
    """Relative standard deviation of step time (lognormal), 0 for the exact model."""
    seed: int = 0
    num_gpu_blocks: int | None = None
    """Override the profile's KV capacity (tests, small scenarios)."""
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    prefix_caching: bool = True
    """vLLM's automatic prefix caching, on by default as in vLLM (``--no-enable-prefix-caching``)."""
    max_loras: int | None = None
    """LoRA adapters one batch may hold (vLLM ``--max-loras``); None: LoRA off."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (vLLM ``--max-cpu-loras``; default, as vLLM's: ``max_loras``)."""
    lora_load_ms: float = 150.0
    """Loading an adapter that is not in host memory (read from disk, set up): added to the step that first
    runs it. A ~40 MB rank-16 adapter of an 8B model; kvgate's own prior is ``nodes.lora.load_seconds``."""
    lora_swap_ms: float = 2.0
    """Copying an adapter held in host memory into a free GPU slot (PCIe)."""
    long_prefill_token_threshold: int = 0
    """vLLM's ``--long-prefill-token-threshold``: the most prompt tokens one request prefills per step (0: off,
    vLLM's default)."""


@dataclass
class Engine:
    profile: Profile
    options: EngineOptions = field(default_factory=EngineOptions)
    on_tokens: Callable[[list[TokenEvent], float], None] | None = None
    on_step: Callable[[Plan, float], None] | None = None
    every_token: bool = True

    def __post_init__(self) -> None:
        p, o = self.profile, self.options
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=o.num_gpu_blocks or p.num_gpu_blocks,
            block_size=p.block_size,
            max_num_batched_tokens=o.max_num_batched_tokens or p.max_num_batched_tokens,
            max_num_seqs=o.max_num_seqs or p.max_num_seqs,
            policy=o.policy,
            max_num_queued_reqs=o.max_num_queued_reqs,
            enable_prefix_caching=o.prefix_caching,
            max_loras=o.max_loras,
            long_prefill_token_threshold=o.long_prefill_token_threshold,
        ))
        self._rng = random.Random(o.seed)
        self._plan: Plan | None = None
        self._began = 0.0
        self.steps = 0
        self.step_tokens = 0
        """Tokens scheduled over all steps (vLLM's iteration-tokens histogram's sum; ``steps`` its count)."""
        self.itl_sum = 0.0
        self.itl_count = 0
        self.gpu_loras: OrderedDict[str, None] = OrderedDict()
        """Adapters in GPU slots, least recently used first (vLLM's LRU adapter cache, ``max_loras`` slots)."""
        self.cpu_loras: OrderedDict[str, None] = OrderedDict()
        """Adapters in host memory, least recently used first (``max_cpu_loras``)."""
        self.lora_loads = 0
        """Adapters loaded into host memory (from disk): the costly loads."""
        self.lora_swaps = 0
        """Adapters copied into a GPU slot (every load, and every return of an evicted one)."""
        """Inter-token latency as vLLM observes it, summed per decode token: each step's duration once per
        sequence it decoded (the cheap equivalent of observing every token)."""

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort(self, req: Request) -> None:
        self.scheduler.abort(req)

    def begin_step(self, now: float) -> float | None:
        """Plan the next step; its duration in seconds, or None when there is nothing to run."""
        if self._plan is not None:
            raise RuntimeError("a step is already in progress")
        plan = self.scheduler.schedule(now)
        if plan.empty:
            return None
        self._plan = plan
        self._began = now
        ms = self.profile.step_ms(plan.prefill_tokens, plan.decode_seqs, plan.context_tokens)
        if self.options.max_loras is not None:
            ms += self._activate_loras(plan)
        if self.options.noise:
            sigma = self.options.noise
            ms *= self._rng.lognormvariate(-sigma * sigma / 2, sigma)
        return ms / 1000.0

    def _activate_loras(self, plan: Plan) -> float:
        """Make the step's adapters resident (vLLM's ``set_active_adapters`` before the forward pass):
        each one not in a GPU slot is copied in, evicting the least recently used; one not in host memory
        is loaded from disk first. Returns the milliseconds it adds to the step."""
        o = self.options
        slots = o.max_loras or 0
        host = o.max_cpu_loras or slots
        ms = 0.0
        for lora in dict.fromkeys(r.lora for r, _ in plan.scheduled if r.lora is not None):
            for cache, size in ((self.cpu_loras, host), (self.gpu_loras, slots)):
                if lora in cache:
                    cache.move_to_end(lora)
                    continue
                if cache is self.cpu_loras:
                    self.lora_loads += 1
                    ms += o.lora_load_ms
                else:
                    self.lora_swaps += 1
                    ms += o.lora_swap_ms
                cache[lora] = None
                while len(cache) > size:
                    cache.popitem(last=False)
        return ms

    def end_step(self, at: float) -> list[TokenEvent]:
        """Apply the step at its end time. Without an ``on_tokens`` listener and with
        ``every_token`` off, only finishing requests produce events (the fast path of long runs)."""
        plan, self._plan = self._plan, None
        if plan is None:
            raise RuntimeError("no step in progress")
        self.steps += 1
        self.step_tokens += plan.prefill_tokens + plan.decode_seqs
        if plan.decode_seqs:
            self.itl_sum += (at - self._began) * plan.decode_seqs
            self.itl_count += plan.decode_seqs
        events = self.scheduler.finish_step(plan, at, self.every_token or self.on_tokens is not None)
        if self.on_step is not None:
            self.on_step(plan, at)
        if self.on_tokens is not None and events:
            self.on_tokens(events, at)
        return events


def simulate(engine: Engine, arrivals: Iterable[Request], until: float | None = None) -> list[Request]:
    """Run requests through one engine in virtual time; returns them with their timings filled in.

    Arrivals are admitted between steps, as vLLM's engine loop does.
    """
    pending = sorted(arrivals, key=lambda r: r.arrival)
    done: list[Request] = list(pending)
    i, now = 0, 0.0
    while True:
        while i < len(pending) and pending[i].arrival <= now:
            engine.add(pending[i])
            i += 1
        if until is not None and now >= until:
            break
        dt = engine.begin_step(now)
        if dt is None:
            if i >= len(pending):
                break
            now = pending[i].arrival  # idle: jump to the next arrival
            continue
        now += dt
        engine.end_step(now)
    return done
