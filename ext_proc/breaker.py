"""A circuit breaker per vLLM node, driven by the node's health rather than by errors alone.

An LLM server does not fail fast: it gets slower as its KV cache fills. So the breaker trips on the
probe's readings — KV usage above ``kv_threshold`` or the node's step times running above
``latency_multiplier`` x its *learned* baseline — and on failed requests while half-open. The latency
signal is relative to the node's own performance model (``perf.py``): observed step time over what the
model predicts for the batch the node actually ran. Raw latencies measure load, not sickness (prefill
seconds of a mixed batch grew 8x on healthy busy nodes and opened their breakers); the ratio stays near
the node's baseline however big its batch, and runs away only when the node itself slows.

closed → open (trip) → half-open after ``recovery_window`` → closed once ``half_open_requests`` real
requests succeeded *and* the node reads healthy again (KV < ``close_kv``, prefill <
``close_latency_multiplier`` x baseline); any failure or a bad reading while half-open re-opens it.
A breaker a full KV cache alone opened from closed goes half-open sooner, at the first reading below
``close_kv``: a full cache is the node's load, which ends as its requests finish, and waiting out the window
then wasted a whole node's capacity for it (families ``bursty-onoff`` seed 10, kvgate+scaler: one node of four
took nothing for 30 s of a burst while the others refused 15% of the demand). Once: re-opened while
half-open, it waits the window (readings alternating about the two lines flapped it open and half-open on
every reading, attack95 F4). Only its trials' results close it: the requests running when it tripped,
finishing once its cache drained, said nothing of how it serves now (attack95 F3).
A latency trip compares a node with its own past, so it cannot tell a sick node from a fleet that is
simply loaded: the fleet lets it open only while few enough breakers are open
(``max_open_fraction``, like Envoy's outlier-detection ``max_ejection_percent``) — never the last
closed node. KV trips are facts about the node and always apply.
Pure: time comes from the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class State(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


STATE_VALUE = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}


@dataclass(frozen=True)
class BreakerSettings:
    kv_threshold: float = 0.95
    latency_multiplier: float = 3.0
    recovery_window_s: float = 30.0
    half_open_requests: int = 5
    close_kv: float = 0.85
    close_latency_multiplier: float = 1.5
    baseline_alpha: float = 0.1
    min_baseline_samples: int = 5
    latency_trip_readings: int = 3
    """Consecutive slow readings (with new latency) before a latency trip: one busy interval with a
    few unlucky requests is noise, a node that stays slow is not."""
    enabled: bool = True
    """False (``nodes.breaker.enabled``): readings never open the breaker, and one left open or half-open
    when it was switched off closes at the next reading."""


def open_cause(why: str) -> str:
    """The cause of a transition to open, from its reason: ``kv`` | ``latency`` | ``trial`` (a half-open
    node that failed its trial, had any request fail, or still read unhealthy). Results and metrics count
    opens by it."""
    if why.startswith("kv"):
        return "kv"
    if why.startswith(("prefill", "step time")):
        return "latency"
    return "trial"


class Breaker:
    def __init__(self, settings: BreakerSettings,
                 on_transition: Callable[[State, State, str], None] | None = None) -> None:
        self.s = settings
        self.state = State.CLOSED
        self.baseline: float | None = None
        self._samples = 0
        self.opened_at = 0.0
        self._trials_left = 0
        self._trial_ok = 0
        self._healthy = True
        self._slow_readings = 0
        self._kv_only = False
        """Whether the breaker is open for a full KV cache alone (it goes half-open once the cache drained)."""
        self._on_transition = on_transition

    def _go(self, new: State, why: str, now: float, kv_only: bool = False) -> None:
        old, self.state = self.state, new
        if new is State.OPEN:
            self.opened_at = now
            self._kv_only = kv_only
        if new is State.HALF_OPEN:
            self._trials_left, self._trial_ok = self.s.half_open_requests, 0
        if self._on_transition is not None:
            self._on_transition(old, new, why)

    def observe(self, kv: float | None, prefill_s: float | None, now: float, may_trip_on_latency: bool = True,
                reference: float | None = None, may_trip_on_kv: bool = True) -> None:
        """A fresh probe reading. ``prefill_s``: None when the reading has no new latency (no request
        finished since the last one). ``may_trip_on_latency``: False when the fleet already has as many
        breakers open as it allows (a slow reading then does not open this one, nor count as healthy).
        ``reference``: what the node's peers read now; a node is slow only against both its own healthy
        past and its peers, so a fleet that is merely loaded trips nothing. ``may_trip_on_kv``: False for
        the last closed node — node choice already sends it nothing while its KV is full, and opening it
        would refuse everything for a whole recovery window after its KV has drained."""
        s = self.s
        if not s.enabled:
            if self.state is not State.CLOSED:
                self._go(State.CLOSED, "breakers disabled", now)
            return
        self._tick(now)
        if self.drains and kv is not None and kv < s.close_kv:
            self._go(State.HALF_OPEN, f"kv {kv:.2f} < {s.close_kv}: drained", now)
        bar = None if self.baseline is None or self._samples < s.min_baseline_samples else (
            self.baseline if reference is None else max(self.baseline, reference))
        slow = prefill_s is not None and bar is not None and prefill_s > s.latency_multiplier * bar
        if prefill_s is not None:
            self._slow_readings = self._slow_readings + 1 if slow else 0
        if slow and self.state is State.CLOSED and self._slow_readings < s.latency_trip_readings:
            slow = False  # not yet: it has to stay slow
        if slow and self.state is State.CLOSED and not may_trip_on_latency:
            return
        full = kv is not None and kv > s.kv_threshold and (may_trip_on_kv or self.state is not State.CLOSED)
        kv_ok = kv is None or kv < s.close_kv
        self._healthy = kv_ok and (prefill_s is None or bar is None or prefill_s < s.close_latency_multiplier * bar)
        if self.state is State.CLOSED:
            if full or slow:
                against = "baseline" if reference is None or bar == self.baseline else "the peers'"
                self._go(State.OPEN, f"kv {kv:.2f} > {s.kv_threshold}" if full else
                         f"step time {prefill_s:.2f}x its model > {s.latency_multiplier} x {against} "
                         f"{bar:.2f}x", now, kv_only=full and not slow)
            elif prefill_s is not None and kv_ok and (
                    bar is None or prefill_s < s.close_latency_multiplier * (self.baseline or bar)):
                self._samples += 1
                self.baseline = prefill_s if self.baseline is None else (
                    self.baseline + s.baseline_alpha * (prefill_s - self.baseline))
        elif self.state is State.HALF_OPEN and (full or slow):
            self._go(State.OPEN, "still unhealthy while half-open", now)

    @property
    def drains(self) -> bool:
        """Open for a full KV cache alone: it goes half-open at the first reading below ``close_kv``."""
        return self.state is State.OPEN and self._kv_only

    def forget_baseline(self) -> None:
        """The latency signal changed meaning (a new performance prior): learn the baseline again."""
        self.baseline, self._samples, self._slow_readings = None, 0, 0

    def _tick(self, now: float) -> None:
        if self.state is State.OPEN and now - self.opened_at >= self.s.recovery_window_s:
            self._go(State.HALF_OPEN, f"recovery window of {self.s.recovery_window_s:g}s passed", now)

    def allows(self, now: float) -> bool:
        self._tick(now)
        if self.state is State.CLOSED:
            return True
        return self.state is State.HALF_OPEN and self._trials_left > 0

    def dispatched(self) -> bool:
        """A request was sent here; True when it is one of the half-open trials."""
        if self.state is State.HALF_OPEN and self._trials_left > 0:
            self._trials_left -= 1
            return True
        return False

    def trial_unused(self) -> None:
        """A trial ended without telling anything about the node (the client left, it was reclaimed):
        its place goes back, or a healthy node could stay half-open, taking nothing, forever."""
        if self.state is State.HALF_OPEN:
            self._trials_left = min(self.s.half_open_requests - self._trial_ok, self._trials_left + 1)

    def result(self, ok: bool, now: float, trial: bool = True) -> None:
        """A request sent to this node ended; only while half-open does it change the state: a trial's result,
        or any failure (``trial``: whether it was one of the half-open trials, ``dispatched``)."""
        if self.state is not State.HALF_OPEN:
            return
        if not ok:
            self._go(State.OPEN, "a half-open trial request failed" if trial else "a request failed while half-open",
                     now)
            return
        if not trial:
            return
        self._trial_ok += 1
        if self._trial_ok >= self.s.half_open_requests:
            if self._healthy:
                self._go(State.CLOSED, f"{self._trial_ok} trial requests succeeded and the node is healthy", now)
            else:
                self._go(State.OPEN, "trial requests succeeded but the node still reads unhealthy", now)
