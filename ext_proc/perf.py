"""A performance model per vLLM node: how long its engine steps take, so when a request would get its
first token there and how much it would delay the requests already there.

A vLLM v1 engine step costs ``a + b·prefill_tokens + c·decode_seqs + d·context_tokens`` — the form
published simulators fit to vLLM (Vidur, BLIS) and kvgate's simulated node (``sim/``) runs. The four
coefficients and the step's token budget (``max_num_batched_tokens``) are a *prior* from the config
(``nodes.performance``: a profile name or the figures); online, each node learns a **speed factor**:
its observed step time (vLLM's inter-token latency: one step per decoded token) over what the prior
predicts for the batch it actually ran (vLLM's iteration-tokens histogram: tokens per step; generated
tokens: the decode part). A node on other hardware than the prior's learns its factor in a few readings;
a node whose factor runs away from its own learned baseline is sick (``breaker.py``) — a big batch is
not, because the model already accounts for it.

The factor is one scalar rather than a fresh fit of four coefficients: a probe interval gives one
aggregate reading, not per-step samples, and a scalar fit from such readings is stable where four are not.

Pure arithmetic; no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Performance
from .profiles import get_profile

MIN_FACTOR, MAX_FACTOR = 0.1, 50.0
FACTOR_ALPHA = 0.3
"""How fast the speed factor follows new readings (an EWMA): a slowed node shows within a few readings."""


@dataclass(frozen=True, slots=True)
class StepModel:
    """A step-time model in seconds, and the engine's per-step limits."""

    a: float
    """Fixed cost of a step (s)."""
    b: float
    """Per prefill token (s)."""
    c: float
    """Per decoding sequence (s)."""
    d: float
    """Per token of context attended (s)."""
    max_batched_tokens: int = 8192
    max_seqs: int = 1024
    long_prefill_token_threshold: int = 0
    """vLLM's per-request cap on new tokens in one step (0: none but the step's budget)."""

    def step(self, prefill: float, decode: float, context: float) -> float:
        return self.a + self.b * prefill + self.c * decode + self.d * context

    def chunk(self, decode: float) -> float:
        """Prefill tokens one step has room for beside ``decode`` running sequences (vLLM schedules
        running requests first: each decode takes one token of the step's budget), and no more than
        ``long_prefill_token_threshold`` when the node caps one request's share of a step (vLLM v1 caps a
        running and a waiting request alike)."""
        room = max(self.max_batched_tokens - min(decode, self.max_seqs), self.max_batched_tokens / 16)
        cap = self.long_prefill_token_threshold
        return min(room, cap) if cap > 0 else room

    def prefill(self, tokens: float, decode: float, context: float) -> float:
        """Seconds to prefill ``tokens`` with nothing ahead, beside ``decode`` sequences holding
        ``context`` tokens: chunked into steps of :meth:`chunk` tokens, each also decoding the rest."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / self.chunk(decode))
        # each step attends the running context plus what is prefilled so far (on average half the prompt)
        return steps * (self.a + self.c * decode + self.d * (context + tokens / 2)) + self.b * tokens

    def packed(self, tokens: float, decode: float, context: float) -> float:
        """Seconds ``tokens`` of prefill add to a backlog already waiting: vLLM packs waiting prompts into
        each step's budget, so a prompt behind others shares their steps and pays its share of each
        step's fixed cost (``tokens / chunk`` of a step), not a step of its own."""
        if tokens <= 0:
            return 0.0
        return tokens / self.chunk(decode) * (self.a + self.c * decode + self.d * (context + tokens / 2)) \
            + self.b * tokens


FLOOR_READINGS = 3
"""Floors (:func:`step_floor`) a node must have shown before their average may raise its speed factor..."""
FLOOR_SLACK = 1.1
"""... and by how much that average must exceed the factor. A healthy node flooded with long prompts
proves a floor of exactly 1.0, so step-time noise alone puts half its floors above it: taken one by one
and only upwards, they raised a healthy node's factor to 1.19 at 20% noise (attack54)."""
FLOOR_ALPHA = 0.2
"""How fast that average follows new floors: slower than the factor (floors of +-25% average within
the slack), fast enough that a node 3x slow is read above 2.7 within 14 floors (7 s of probes)."""


@dataclass(slots=True)
class Speed:
    """A node's speed factor: observed step time over the model's, smoothed."""

    factor: float = 1.0
    readings: int = 0
    floor: float = 0.0
    """The floors of its mostly-prefill intervals, smoothed (up and down, from the factor)."""
    floors: int = 0

    def observe(self, ratio: float) -> None:
        ratio = min(MAX_FACTOR, max(MIN_FACTOR, ratio))
        self.factor = ratio if self.readings == 0 else self.factor + FACTOR_ALPHA * (ratio - self.factor)
        self.readings += 1

    def bound(self, floor: float) -> None:
        """A floor the node's speed is proved to be at or above: averaged with the earlier ones, and once
        there are :data:`FLOOR_READINGS`, an average more than :data:`FLOOR_SLACK` x the factor is
        observed as a reading (a node 3x slow proves 2.99 every interval, and is read near it)."""
        floor = min(MAX_FACTOR, max(MIN_FACTOR, floor))
        start = self.factor if self.floors == 0 else self.floor  # (not the first floor raw: one noisy one)
        self.floor = start + FLOOR_ALPHA * (floor - start)
        self.floors += 1
        if self.floors >= FLOOR_READINGS and self.floor > FLOOR_SLACK * self.factor:
            self.observe(self.floor)


def step_ratio(model: StepModel, step_s: float | None, step_tokens: float | None, step_decode: float | None,
               running: float | None, context: float | None) -> float | None:
    """Observed over modelled step time for one probe interval, or None when the interval says nothing
    (no decode step). ``step_s``: the mean inter-token latency; ``step_tokens``/``step_decode``: tokens
    and decode tokens per step (None from a vLLM without the iteration-tokens histogram: then the batch is
    taken as the running sequences decoding); ``context``: tokens held in the KV cache."""
    if step_s is None or step_s <= 0:
        return None
    decode, prefill = _batch(step_tokens, step_decode, running)
    modelled = model.step(prefill, decode, context or 0.0)
    return step_s / modelled if modelled > 0 else None


def prefill_heavy(model: StepModel, step_tokens: float | None, step_decode: float | None,
                  running: float | None, context: float | None) -> bool:
    """Whether the interval's steps were mostly prefill. vLLM observes inter-token latency on decoding
    steps only, and the iteration histogram averages the batch over every step: when prefill dominates
    (one long prompt, then short decode steps), the modelled step is too long for the steps that were
    timed and the ratio reads low (0.2-0.5 on a healthy node). Such a reading is trusted only when it
    reads *slow* (past the breaker's bar); below it, what it proves is :func:`step_floor`."""
    decode, prefill = _batch(step_tokens, step_decode, running)
    return model.b * prefill > model.step(0.0, decode, context or 0.0)


def step_floor(model: StepModel, step_s: float | None, step_tokens: float | None, step_decode: float | None,
               running: float | None, context: float | None) -> float | None:
    """The least speed factor a mostly-prefill interval proves: its mean inter-token latency over the
    modelled time of a step that prefills a whole step budget beside the interval's decodes. No step can
    have prefilled more (a step's tokens, decodes included, never exceed ``max_num_batched_tokens``), so
    however the interval's prefill fell among its steps, the node is at least this slow — as far as the
    linear step model holds and the prior's budget is the node's (see docs/known-limits.md).

    Why a bound rather than :func:`step_ratio`: vLLM times decoding steps only and the iteration histogram
    averages over every step, so a mostly-prefill interval's ratio reads low on a healthy node when its
    prefill ran in steps without decodes, and high when it ran beside them (1.3 on a healthy node whose
    first interval had two steps). A node slowed 3x under a flood of long prompts read 2.99 every
    interval, below the breaker's bar (3 x baseline), so it was never learned at all. The bound is tight
    when the flood fills every step (2.99 there) and says nothing (well under 1) when it does not."""
    if step_s is None or step_s <= 0 or (step_tokens is not None and step_tokens > model.max_batched_tokens):
        # (a mean step above the prior's budget: the node's budget is larger, and so could its steps be —
        # a healthy node flooded with long prompts read 3.2 against a prior of 2,048 tokens for 8,192)
        return None
    decode, _ = _batch(step_tokens, step_decode, running)
    full = model.step(float(model.max_batched_tokens), decode, context or 0.0)
    return step_s / full if full > 0 else None


def _batch(step_tokens: float | None, step_decode: float | None, running: float | None) -> tuple[float, float]:
    """(decode sequences, prefill tokens) of an interval's mean step."""
    if step_tokens is not None and step_decode is not None:
        return step_decode, max(0.0, step_tokens - step_decode)
    return (running or 0.0), 0.0


def from_config(p: Performance, profile: str | None = None) -> StepModel:
    """The prior of ``nodes.performance``: its profile's figures (or ``profile``'s: a node's own, pinned
    or detected), each overridden where given."""
    prof = get_profile(profile or p.profile)

    def pick(v: float | None, default: float) -> float:
        return (v if v is not None else default) / 1000.0

    return StepModel(pick(p.a_ms, prof.a_ms), pick(p.b_ms_per_prefill_token, prof.b_ms_per_prefill_token),
                     pick(p.c_ms_per_decode_seq, prof.c_ms_per_decode_seq),
                     pick(p.d_ms_per_context_token, prof.d_ms_per_context_token),
                     p.max_num_batched_tokens or prof.max_num_batched_tokens, p.max_num_seqs or prof.max_num_seqs,
                     p.long_prefill_token_threshold)
