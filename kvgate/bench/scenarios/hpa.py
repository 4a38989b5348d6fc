"""The ``autoscale-only`` baseline's autoscaler: Kubernetes' HorizontalPodAutoscaler (what KEDA drives) on
vLLM's queue depth, with the HPA's own replica rules, pure and in virtual time.

A baseline is only worth beating if it is the one a careful operator would deploy. A bare
``ceil(waiting / target)`` that follows the metric down drops a fleet to one node as soon as vLLM's
queue empties — which it does at the day's peak, when every request fits in the running batch — and
then serves worse than a static fleet at a multiple of its GPU-hours. So this module applies what the
HPA controller (``pkg/controller/podautoscaler``) does between the metric and the Deployment, with the
defaults of ``autoscaling/v2`` ``HorizontalPodAutoscalerBehavior`` (API reference, ``HPAScalingRules``,
Kubernetes 1.23-1.36):

* **tolerance** — no change while the metric is within 10% of its target (``|usage / (target x
  replicas) - 1| <= 0.1``, the controller's older comparison — in floating point an exact 1.1 reads
  0.10000000000000009 and is applied, where current Kubernetes' ``1 - tol <= ratio <= 1 + tol`` ignores it,
  as ``chart_metric`` does; the cluster-wide default ``--horizontal-pod-autoscaler-tolerance``);
* **stabilisation** — scale-up: 0 s (no stabilisation); scale-down: 300 s, *the highest recommendation
  of the last 300 s is used*;
* **step limits** (``policies``, ``selectPolicy: Max``: the policy allowing the larger change wins) —
  scale-up: *allow doubling the number of pods, or an absolute change of 4 pods in a 15 s window*
  (``Percent 100 / 15 s`` and ``Pods 4 / 15 s``); scale-down: *allow all pods to be removed in a 15 s
  window* (``Percent 100 / 15 s``). A policy's window counts the changes already made in it, as the
  controller's ``getReplicasChangePerPeriod`` does: the limit is from the replicas at the window's start;
* **bounds** — ``minReplicas`` / ``maxReplicas`` last; the bench sets ``minReplicas`` to the fleet the run
  starts with (a tuned deployment never scales below its provisioned baseline; see ``driver._scale``).

Pure: the caller passes the time; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ScalingPolicy:
    """One ``HPAScalingPolicy``: at most ``value`` pods (``Pods``) or ``value`` percent of the replicas at
    the window's start (``Percent``) changed within any ``period_s``."""

    kind: Literal["Pods", "Percent"]
    value: int
    period_s: float


@dataclass(frozen=True)
class ScalingRules:
    """One direction's ``HPAScalingRules``."""

    stabilization_s: float
    policies: tuple[ScalingPolicy, ...]
    select: Literal["Max", "Min"] = "Max"
    """``Max``: the policy that allows the larger change; ``Min``: the smaller."""


DEFAULT_SCALE_UP = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0)))
"""``autoscaling/v2`` default scale-up: no stabilisation; double, or add 4 pods, per 15 s, whichever is more."""
DEFAULT_SCALE_DOWN = ScalingRules(300.0, (ScalingPolicy("Percent", 100, 15.0),))
"""``autoscaling/v2`` default scale-down: 300 s stabilisation (highest recommendation); then all pods may go
within 15 s (down to ``minReplicas``)."""
DEFAULT_TOLERANCE = 0.1
"""The controller's default ``--horizontal-pod-autoscaler-tolerance``."""


@dataclass(frozen=True)
class HpaSettings:
    """One HPA (one ScaledObject): its bounds, tolerance and behaviour (defaults: Kubernetes')."""

    min_replicas: int
    max_replicas: int
    tolerance: float = DEFAULT_TOLERANCE
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas: must be between 1 and max_replicas ({self.max_replicas}), "
                             f"got {self.min_replicas}")
        if self.tolerance < 0:
            raise ValueError(f"tolerance: must be >= 0, got {self.tolerance}")


def metric_replicas(total: float, target: float, current: int, tolerance: float = DEFAULT_TOLERANCE) -> int:
    """The replicas an ``AverageValue`` external metric asks for (KEDA's default target type):
    ``ceil(total / target)``, or ``current`` while ``total / (target x current)`` is within ``tolerance``
    of 1 (the controller's ``GetExternalPerPodMetricReplicas``)."""
    if target <= 0:
        raise ValueError(f"target: must be above 0, got {target}")
    if current > 0 and abs(total / (target * current) - 1.0) <= tolerance:
        return current
    return math.ceil(total / target - 1e-9)


def chart_metric(desired: int, current: int, tolerance: float) -> int:
    """What the chart's HPA makes of the law's count (an ``AverageValue`` metric, target 1): the count, or
    ``current`` while their ratio is within ``tolerance`` of 1, the bounds included — current Kubernetes'
    ``1 - tolerance <= ratio <= 1 + tolerance``, under which 11 of 10 is ignored (``metric_replicas``'s
    ``|ratio - 1| <= tolerance`` reads 0.10000000000000009 there and lets it through; kept for the
    ``autoscale-only`` baseline, whose figures it made)."""
    if current > 0 and 1.0 - tolerance <= desired / current <= 1.0 + tolerance:
        return current
    return desired


@dataclass
class Hpa:
    """The controller's state for one HPA: past recommendations (stabilisation) and past scale events
    (step limits). ``decide`` is one sync period."""

    settings: HpaSettings
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, metric recommendation) of earlier syncs, as long as a stabilisation window looks back."""
    events: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, replicas added (> 0) or removed (< 0)) by earlier syncs, as long as a policy looks back."""

    def decide(self, now: float, current: int, desired: int) -> int:
        """The replicas to set at ``now``, with ``current`` replicas and the metric asking for ``desired``
        (``metric_replicas``): stabilised, then step-limited, then bounded. The change is recorded."""
        s = self.settings
        up_cut, down_cut = now - s.scale_up.stabilization_s, now - s.scale_down.stabilization_s
        keep = max(s.scale_up.stabilization_s, s.scale_down.stabilization_s)
        while self.recommendations and self.recommendations[0][0] < now - keep:
            self.recommendations.popleft()
        # stabilisation (``stabilizeRecommendationWithBehaviors``): going up, the lowest recommendation of
        # the up window; going down, the highest of the down window
        up_rec = min([desired, *(r for t, r in self.recommendations if t > up_cut)])
        down_rec = max([desired, *(r for t, r in self.recommendations if t > down_cut)])
        self.recommendations.append((now, desired))
        target = min(max(current, up_rec), down_rec)
        if target > current:
            target = min(target, self._up_limit(now, current))
        elif target < current:
            target = max(target, self._down_limit(now, current))
        target = max(s.min_replicas, min(s.max_replicas, target))
        period = max([p.period_s for p in (*s.scale_up.policies, *s.scale_down.policies)] or [0.0])
        while self.events and self.events[0][0] <= now - period:
            self.events.popleft()
        if target != current:
            self.events.append((now, target - current))
        return target

    def _changed(self, now: float, period_s: float, up: bool) -> int:
        """Replicas added (``up``) or removed within the last ``period_s``."""
        return sum(abs(d) for t, d in self.events if t > now - period_s and (d > 0) == up)

    def _up_limit(self, now: float, current: int) -> int:
        rules = self.settings.scale_up
        limits = []
        for p in rules.policies:
            start = current - self._changed(now, p.period_s, up=True)
            limits.append(start + p.value if p.kind == "Pods" else math.ceil(start * (1 + p.value / 100)))
        if not limits:
            return current
        return max(limits) if rules.select == "Max" else min(limits)

    def _down_limit(self, now: float, current: int) -> int:
        rules = self.settings.scale_down
        limits = []
        for p in rules.policies:
            start = current + self._changed(now, p.period_s, up=False)
            limits.append(start - p.value if p.kind == "Pods" else math.ceil(start * (1 - p.value / 100)))
        if not limits:
            return current
        return min(limits) if rules.select == "Max" else max(limits)
