"""The simulated engine: the scheduler, the step-time model and a clock.

``Engine`` is clock-agnostic: ``begin_step(now)`` plans a step and says how long it takes,
``end_step(at)`` applies it. ``simulate`` drives it in virtual time (as fast as the CPU allows);
``sim.server`` drives the very same object in real time behind vLLM's HTTP API.
"""

from __future__ import annotations

import random
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
        if self.options.noise:
            sigma = self.options.noise
            ms *= self._rng.lognormvariate(-sigma * sigma / 2, sigma)
        return ms / 1000.0

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
