"""The control law: kvgate's admission signals → the replica count of a vLLM pool.

Autoscaling acts on the signal admission control already produces: **capacity rejections** (503: the
fleet could not take a request) as a share of the requests that wanted the fleet. Policy rejections
(429: a tenant over its own quota) never count — more GPUs do not fix a quota.

Per evaluation, over the signal window:

* rate > ``scale_up_threshold`` (25%) → add ``step`` (2) replicas;
* rejections concentrated in one tenant's quota — one tenant has ≥ ``concentration`` (80%) of all
  rejections, mostly 429s — is a policy problem: reported (``Verdict.policy_tenant``), and a scale-up
  is withheld when, without that tenant, the capacity reject rate would be under the threshold (its
  quota overflowing as 503s does not buy GPUs; other tenants' 503s still do);
* rate < ``scale_down_threshold`` (5%) for ``cooldown`` (10 min) → remove one, then wait another cooldown;
* in between → hold (and the cooldown starts again);
* a scale-up is not repeated while the replicas it asked for are not there yet (models take 30-90 s
  to load): rejections during a cold start are expected and must not compound;
* missing, incomplete or stale data → hold; never scale down on no data, and never answer fewer
  replicas than the signal last reported up (``observed``): a law whose own level is below what is
  running (a manual scale-up, an HPA floor) must not shrink the pool because a source went silent;
* no verdict until the first complete window (``ControlLaw.ready``): after a (re)start the law knows
  neither the window nor, maybe, the pool's size, so it says so (``Verdict.ready`` False) instead of
  guessing; the server answers KEDA with an error until then, so KEDA's own fallback applies;
* requests held in kvgate's queue with no replica at all → at least one (scale from zero);
* ``warm_pool`` replicas on top of demand; the result is clamped to [min, max].

Pure: the caller passes the time and the signals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class LawSettings:
    min_replicas: int = 1
    max_replicas: int = 10
    step: int = 2
    scale_up_threshold: float = 0.25
    scale_down_threshold: float = 0.05
    cooldown_s: float = 600.0
    warm_pool: int = 0
    concentration: float = 0.8
    stale_after_s: float = 60.0


@dataclass(frozen=True)
class Signals:
    """What every kvgate replica reported, summed, over the window ending at ``at``."""

    at: float
    admitted: dict[str, float] = field(default_factory=dict)
    """Admitted requests per tenant."""
    capacity_rejected: dict[str, float] = field(default_factory=dict)
    """Capacity (503) rejections per tenant."""
    policy_rejected: dict[str, float] = field(default_factory=dict)
    """Policy (429) rejections per tenant."""
    held: float = 0.0
    """Requests waiting in kvgate's queues now."""
    replicas: int | None = None
    """vLLM replicas kvgate currently sees (its nodes); None: unknown."""
    complete: bool = True
    """False when a kvgate replica did not answer: the sums would undercount."""

    @property
    def capacity_total(self) -> float:
        return sum(self.capacity_rejected.values())

    @property
    def demand(self) -> float:
        """Requests that wanted the fleet: admitted + capacity-rejected (policy rejections excluded)."""
        return sum(self.admitted.values()) + self.capacity_total

    @property
    def reject_rate(self) -> float | None:
        d = self.demand
        return None if d <= 0 else self.capacity_total / d


Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class Verdict:
    desired: int
    action: Action
    reason: str
    reject_rate: float | None = None
    policy_tenant: str | None = None
    missing_data: bool = False
    """Held because the data was missing, incomplete or stale (``reason`` says which)."""
    ready: bool = True
    """False until the law has seen one complete window: ``desired`` is then only a placeholder."""


class ControlLaw:
    def __init__(self, settings: LawSettings) -> None:
        self.s = settings
        self.desired: int | None = None
        """The demand level the law moves (warm pool excluded); None until the first complete window."""
        self.observed: int | None = None
        """The replica count the signals last reported (ready vLLM nodes); None: never reported."""
        self._low_since: float | None = None

    @property
    def ready(self) -> bool:
        """Whether the law has a verdict from a complete window (since it was created)."""
        return self.desired is not None

    def decide(self, sig: Signals | None, now: float) -> Verdict:
        s = self.s
        if sig is not None and sig.replicas is not None:
            self.observed = sig.replicas
        observed = sig.replicas if sig is not None else None
        if sig is None or not sig.complete or now - sig.at > s.stale_after_s:
            self._low_since = None
            why = "no data" if sig is None else ("a kvgate replica did not answer" if not sig.complete
                                                 else f"data {now - sig.at:.0f}s old")
            return self._missing(why)
        # the demand level (what the law moves); the warm pool is added on output
        current = self.desired if self.desired is not None else (
            max(0, observed - s.warm_pool) if observed is not None else s.min_replicas)
        rate = sig.reject_rate
        quota = self._quota_problem(sig)
        if current == 0 and (sig.held > 0 or sig.demand > 0):
            self._low_since = None
            return self._out(max(1, s.min_replicas), "up", "requests are waiting and no replica is up: scale from zero",
                             rate)
        if rate is not None and rate > s.scale_up_threshold:
            self._low_since = None
            if quota is not None and _rate_without(sig, quota) <= s.scale_up_threshold:
                return self._out(current, "hold", f"rejections concentrated in tenant {quota!r}'s quota: a policy "
                                 "problem, not a capacity one", rate, quota)
            if observed is not None and observed < self._total(current):
                return self._out(current, "hold", f"waiting for the {self._total(current) - observed} replica(s) "
                                 "already asked for to come up", rate)
            return self._out(current + s.step, "up", f"capacity reject rate {rate:.0%} > {s.scale_up_threshold:.0%}",
                             rate, quota)
        if rate is None or rate < s.scale_down_threshold:
            if self._low_since is None:
                self._low_since = now
            low_for = now - self._low_since
            if low_for >= s.cooldown_s:
                self._low_since = now
                return self._out(current - 1, "down", f"capacity reject rate {0.0 if rate is None else rate:.0%} < "
                                 f"{s.scale_down_threshold:.0%} for {low_for:.0f}s", rate, quota)
            return self._out(current, "hold", f"low reject rate for {low_for:.0f}s of a {s.cooldown_s:.0f}s cooldown",
                             rate, quota)
        self._low_since = None
        return self._out(current, "hold", f"capacity reject rate {rate:.0%} between the thresholds", rate, quota)

    def _missing(self, why: str) -> Verdict:
        """Hold on missing data: the law's level, never below the replicas last observed."""
        seen = self.observed
        if self.desired is None:  # no complete window yet: no verdict, only a placeholder
            floor = max(self.s.min_replicas, seen or 0)
            return Verdict(floor, "hold", f"{why}: no verdict yet (no complete window since the start)"
                           + (f"; {seen} replica(s) observed" if seen is not None else ""),
                           missing_data=True, ready=False)
        v = self._out(self.desired, "hold", why + ": holding, never scaling down on no data", None)
        if seen is not None and seen > v.desired:
            return Verdict(seen, "hold", f"{v.reason}; not below the {seen} replica(s) last observed (the law's "
                           f"own count is {v.desired})", missing_data=True)
        return Verdict(v.desired, v.action, v.reason, missing_data=True)

    def _quota_problem(self, sig: Signals) -> str | None:
        """The tenant holding ≥ ``concentration`` of all rejections, most of them its own quota's (429)."""
        per: dict[str, float] = {}
        for d in (sig.capacity_rejected, sig.policy_rejected):
            for t, v in d.items():
                per[t] = per.get(t, 0.0) + v
        total = sum(per.values())
        if total <= 0:
            return None
        top = max(per, key=lambda t: per[t])
        if per[top] / total < self.s.concentration or sig.policy_rejected.get(top, 0.0) < per[top] / 2:
            return None
        return top

    def _out(self, desired: int, action: Action, reason: str, rate: float | None,
             tenant: str | None = None) -> Verdict:
        s = self.s
        bounded = max(s.min_replicas, min(s.max_replicas, desired))
        if bounded != desired:
            reason += f" (bounded to {bounded})"
            if bounded == (self.desired if self.desired is not None else bounded):
                action = "hold"
        self.desired = bounded
        return Verdict(self._total(bounded), action, reason, rate, tenant)

    def _total(self, demand: int) -> int:
        """Replicas to run for a demand level: plus the warm pool, within max_replicas."""
        return min(self.s.max_replicas, demand + self.s.warm_pool)


def _rate_without(sig: Signals, tenant: str) -> float:
    """The capacity reject rate of every tenant but one."""
    rej = sig.capacity_total - sig.capacity_rejected.get(tenant, 0.0)
    demand = sig.demand - sig.capacity_rejected.get(tenant, 0.0) - sig.admitted.get(tenant, 0.0)
    return 0.0 if demand <= 0 else rej / demand
