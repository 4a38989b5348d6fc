"""The control law: kvgate's admission signals → the replica count of a vLLM pool.

Autoscaling acts on **unmet demand**: requests the fleet could not serve within their SLO, as a share
of the requests that wanted the fleet. Unmet, per window:

* capacity rejections (503: the fleet could not take a request);
* fleet-caused 429s: a concurrency-cap 429 for a tenant inside its request and token budgets whose
  requests last clearly longer than its own norm (a slower fleet holds every request longer, so the
  same traffic hits the cap; kvgate marks these, ``kvgate_fleet_caused_rejections_total``);
* predicted SLO misses: requests kvgate admitted although its prediction says they miss their tier's
  TTFT target (``kvgate_predicted_slo_misses_total``; a held request that cannot make its deadline
  leaves the queue as a ``queue-deadline`` 503, counted above);
* every other concurrency 429 too when rejections are *spread*: ≥ ``spread_tenants`` (half) of the
  active tenants have rejections, together ≥ ``spread_share`` (30%) of their requests, and no tenant
  holds ≥ ``concentration`` of them (the field guide's rule: 30% across all tenants is a capacity
  signal, not a quota one).

A tenant over its own request or token budget never scales the fleet: those 429s never count, and
none of that tenant's other 429s count under the spread rule. Demand = admitted + capacity-rejected +
the 429s counted. Per evaluation, over the signal window:

* unmet rate > ``scale_up_threshold``, or the rate projected over a cold start (its trend over the
  last ``trend_window_s`` × ``cold_start_s``) above it → scale up, by the shortfall: ``replicas ×
  u / (1 − u)`` (u: the larger of the two, at most 75%), at least ``step``;
* rejections concentrated in one tenant's quota — one tenant has ≥ ``concentration`` (80%) of all
  rejections, mostly 429s of its own (not fleet-caused) — is a policy problem: reported
  (``Verdict.policy_tenant``), and the law acts on the unmet rate without that tenant (its quota
  overflowing as 503s does not buy GPUs; other tenants' unmet demand still does);
* a scale-up is not repeated while the replicas it asked for are not there yet (models take 30-90 s
  to load): unmet demand during a cold start is expected and must not compound;
* scale down by one when the unmet rate (and its projection) stayed under ``scale_down_threshold``
  for ``cooldown_s``, the last scale-up is older than ``cooldown_s``, and — once the law has seen the
  fleet full (a window with the unmet rate over the threshold: its admitted requests per replica) —
  one replica fewer would carry at most ``scale_down_utilisation`` of that load each (the warm pool
  not counted as carrying any); then wait another cooldown. Never while unmet demand is present;
* in between → hold (and the cooldown starts again);
* missing, incomplete or stale data → hold; never scale down on no data, and never answer fewer
  replicas than the signal last reported up (``observed``): a law whose own level is below what is
  running (a manual scale-up, an HPA floor) must not shrink the pool because a source went silent;
* no verdict until the first complete window (``ControlLaw.ready``): after a (re)start the law knows
  neither the window nor, maybe, the pool's size, so it says so (``Verdict.ready`` False) instead of
  guessing; the server answers KEDA with an error until then, so KEDA's own fallback applies;
* requests held in kvgate's queue with no replica at all → at least one (scale from zero);
* ``warm_pool`` replicas on top of demand; the result is clamped to [min, max].

Every verdict's reason names the numbers it acted on (the unmet rate split by cause, the projection,
the utilisation). Pure: the caller passes the time and the signals.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

MAX_SIZING_SHARE = 0.75
"""The unmet share a scale-up is sized on is capped here (at most 3 × the replicas up are added at once)."""


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
    cold_start_s: float = 60.0
    """A replica's model-load time: how far ahead the unmet rate's trend is projected."""
    trend_window_s: float = 60.0
    """The evaluations the trend is fitted over."""
    spread_share: float = 0.30
    """Rejections spread over the tenants at this share of their requests count every 429 (a capacity signal)."""
    spread_tenants: float = 0.5
    """... when at least this share of the active tenants (and at least two) have rejections."""
    scale_down_utilisation: float = 0.6
    """Scale down only if one replica fewer would each carry at most this share of the load per replica
    seen when the fleet was last full."""
    window_s: float = 60.0
    """The signal window (a load-per-replica sample needs the same replicas up for a whole window)."""


@dataclass(frozen=True)
class Signals:
    """What every kvgate replica reported, summed, over the window ending at ``at``."""

    at: float
    admitted: dict[str, float] = field(default_factory=dict)
    """Admitted requests per tenant."""
    capacity_rejected: dict[str, float] = field(default_factory=dict)
    """Capacity (503) rejections per tenant."""
    policy_rejected: dict[str, float] = field(default_factory=dict)
    """Policy (429) rejections per tenant (all of them: budgets, concurrency, fleet-caused)."""
    held: float = 0.0
    """Requests waiting in kvgate's queues now."""
    replicas: int | None = None
    """vLLM replicas kvgate currently sees (its nodes); None: unknown."""
    complete: bool = True
    """False when a kvgate replica did not answer: the sums would undercount."""
    fleet_caused: dict[str, float] = field(default_factory=dict)
    """Of ``policy_rejected``: concurrency 429s the fleet caused (the tenant inside its budgets, its
    requests lasting clearly longer than its norm). Absent (an older kvgate): none."""
    budget_rejected: dict[str, float] = field(default_factory=dict)
    """Of ``policy_rejected``: 429s for the tenant's own request or token budget."""
    slo_missed: dict[str, float] = field(default_factory=dict)
    """Of ``admitted``: requests admitted although predicted to miss their tier's TTFT target. Absent: none."""

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

    def tenants(self) -> set[str]:
        """Tenants with any request in the window."""
        return {t for d in (self.admitted, self.capacity_rejected, self.policy_rejected) for t, v in d.items()
                if v > 0}


Cause = Literal["capacity", "fleet_caused", "slo_miss", "spread"]
CAUSES: tuple[Cause, ...] = ("capacity", "fleet_caused", "slo_miss", "spread")
_CAUSE_TEXT = {"capacity": "503 capacity", "fleet_caused": "fleet-caused 429", "slo_miss": "predicted SLO miss",
               "spread": "429 spread over tenants"}


@dataclass(frozen=True)
class Unmet:
    """Unmet demand over one window, by cause (request counts), and the demand it is a share of."""

    demand: float = 0.0
    admitted: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)
    """Cause → requests."""
    spread: bool = False
    """Whether the spread rule counted every 429."""

    @property
    def total(self) -> float:
        return sum(self.counts.values())

    @property
    def rate(self) -> float | None:
        return None if self.demand <= 0 else self.total / self.demand

    def share(self, cause: str) -> float:
        return 0.0 if self.demand <= 0 else self.counts.get(cause, 0.0) / self.demand

    def describe(self) -> str:
        if self.demand <= 0:
            return "no demand in the window"
        parts = [f"{_CAUSE_TEXT[c]} {self.share(c):.0%}" for c in CAUSES if self.counts.get(c)]
        return (f"unmet demand {self.total / self.demand:.0%} of {self.demand:.0f} requests"
                + (f" ({', '.join(parts)})" if parts else ""))


def unmet_demand(sig: Signals, s: LawSettings, without: str | None = None) -> Unmet:
    """The unmet demand of the window (every tenant but ``without``)."""
    def get(d: dict[str, float], t: str) -> float:
        return 0.0 if t == without else max(0.0, d.get(t, 0.0))

    tenants = sig.tenants() - ({without} if without else set())
    admitted = sum(get(sig.admitted, t) for t in tenants)
    capacity = {t: get(sig.capacity_rejected, t) for t in tenants}
    policy = {t: get(sig.policy_rejected, t) for t in tenants}
    fleet = {t: min(get(sig.fleet_caused, t), policy[t]) for t in tenants}
    # a tenant over its own budget in the window: none of its other 429s may count
    own = {t: 0.0 if get(sig.budget_rejected, t) > 0 else policy[t] - fleet[t] for t in tenants}
    rej = {t: capacity[t] + fleet[t] + own[t] for t in tenants}
    total_rej = sum(rej.values())
    rejected = [t for t in tenants if rej[t] > 0]
    spread = (total_rej > 0 and total_rej / (admitted + total_rej) >= s.spread_share
              and len(rejected) >= max(2, math.ceil(s.spread_tenants * len(tenants) - 1e-9))
              and max(rej.values()) < s.concentration * total_rej)
    counts = {"capacity": sum(capacity.values()), "fleet_caused": sum(fleet.values()),
              "slo_miss": sum(min(get(sig.slo_missed, t), get(sig.admitted, t)) for t in tenants),
              "spread": sum(own.values()) if spread else 0.0}
    demand = admitted + counts["capacity"] + counts["fleet_caused"] + counts["spread"]
    return Unmet(demand, admitted, counts, spread)


Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class Verdict:
    desired: int
    action: Action
    reason: str
    reject_rate: float | None = None
    """The unmet-demand rate the law acted on (``unmet.rate``, without a quota tenant's own)."""
    policy_tenant: str | None = None
    missing_data: bool = False
    """Held because the data was missing, incomplete or stale (``reason`` says which)."""
    ready: bool = True
    """False until the law has seen one complete window: ``desired`` is then only a placeholder."""
    unmet: Unmet | None = None
    """The window's unmet demand by cause (every tenant)."""
    projected: float | None = None
    """The unmet rate projected one cold start ahead (its trend × ``cold_start_s``)."""
    utilisation: float | None = None
    """Demand per demand-level replica / the load per replica seen when the fleet was last full."""


class ControlLaw:
    def __init__(self, settings: LawSettings) -> None:
        self.s = settings
        self.desired: int | None = None
        """The demand level the law moves (warm pool excluded); None until the first complete window."""
        self.observed: int | None = None
        """The replica count the signals last reported (ready vLLM nodes); None: never reported."""
        self.full_per_replica: float | None = None
        """Admitted requests per replica over a window in which the fleet was full (unmet over the threshold)."""
        self._low_since: float | None = None
        self._last_up: float | None = None
        self._rates: deque[tuple[float, float]] = deque()
        self._demand: deque[tuple[float, float]] = deque()
        self._seen: deque[tuple[float, int]] = deque()
        """(time, replicas observed): a load-per-replica sample needs them steady for a window."""

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
            self._rates.clear()
            self._demand.clear()
            why = "no data" if sig is None else ("a kvgate replica did not answer" if not sig.complete
                                                 else f"data {now - sig.at:.0f}s old")
            return self._missing(why)
        # the demand level (what the law moves); the warm pool is added on output
        current = self.desired if self.desired is not None else (
            max(0, observed - s.warm_pool) if observed is not None else s.min_replicas)
        u = unmet_demand(sig, s)
        quota = self._quota_problem(sig)
        acted = unmet_demand(sig, s, without=quota) if quota is not None else u
        rate = acted.rate
        projected, slope = self._project(self._rates, now, rate)
        # the load on the fleet: every admitted request (a quota tenant's too: it runs on the fleet) and the
        # rejections counted as unmet
        load = u.admitted + sum(acted.counts.get(c, 0.0) for c in ("capacity", "fleet_caused", "spread"))
        demand_ahead, _ = self._project(self._demand, now, load if u.demand > 0 else None)
        mean_up = self._mean_up(now, observed)
        full = self._learn(mean_up, u, rate)
        what = u.describe() + (f"; without {quota!r} (its own quota) {rate or 0.0:.0%}" if quota else "")
        trend = (f"; projected {projected:.0%} in {s.cold_start_s:.0f}s (trend {slope * 100:+.2f}%/s)"
                 if projected is not None and slope else "")
        v = _Ctx(u, projected, quota, rate)
        thr = s.scale_up_threshold
        over = (rate is not None and rate > thr) or (projected is not None and projected > thr)
        if current == 0 and (sig.held > 0 or sig.demand > 0 or u.demand > 0) and (
                not over or (observed or 0) < self._total(current)):
            self._low_since = None
            return self._out(max(1, s.min_replicas), "up", f"{what}: requests are waiting and no replica is up "
                             "beyond the warm pool: scale from zero", v, now)
        if over:  # (from zero too, when the replicas up are short: sized like any other scale-up)
            self._low_since = None
            if observed is not None and observed < self._total(current):
                return self._out(current, "hold", f"{what}{trend} > {thr:.0%}, but waiting for the "
                                 f"{self._total(current) - observed} replica(s) already asked for to come up", v)
            # the window's fleet served 1 - u of its demand: it needed base / (1 - u) replicas
            share = min(MAX_SIZING_SHARE, max(rate or 0.0, projected or 0.0))
            up = observed if observed is not None else self._total(current)
            base = mean_up if mean_up is not None else float(up)
            need = math.ceil(base / (1.0 - share) - 1e-9)
            if need <= up and base < up:
                return self._out(current, "hold", f"{what}{trend} > {thr:.0%}, but the {up} replica(s) up now cover "
                                 f"it (the window saw {base:.1f} on average, short by {share:.0%}: {need} needed)", v)
            add = max(s.step, need - up)
            why = (f"{what}{trend} > {thr:.0%}: +{add} replica(s) (max(step {s.step}, {base:.1f} up over the window "
                   f"/ {1 - share:.0%} served = {need} needed, {up} up))")
            return self._out(current + add, "up", why, v, now)
        if full is not None and current > 0 and (demand_ahead or 0.0) > current * full:
            self._low_since = None
            need = math.ceil((demand_ahead or 0.0) / full - 1e-9)
            why = (f"{what}: the warm pool is being used up: a load of {load:.0f} requests/window ({demand_ahead:.0f} "
                   f"on its trend) needs {need} replica(s) at {full:.0f} per replica (the load seen at saturation), "
                   f"{current} + {s.warm_pool} warm up")
            if observed is not None and observed < self._total(current):
                return self._out(current, "hold", f"{why}; waiting for the {self._total(current) - observed} "
                                 "replica(s) already asked for to come up", v)
            return self._out(need, "up", why, v, now)
        if quota is not None and u.rate is not None and u.rate > thr:
            self._low_since = None
            return self._out(current, "hold", f"{what}: rejections concentrated in tenant {quota!r}'s quota: a "
                             "policy problem, not a capacity one", v)
        low = max(rate or 0.0, projected or 0.0)
        if low < s.scale_down_threshold:
            if self._low_since is None:
                self._low_since = now
            low_for = now - self._low_since
            if low_for < s.cooldown_s:
                return self._out(current, "hold", f"{what}{trend}: low for {low_for:.0f}s of a {s.cooldown_s:.0f}s "
                                 "cooldown", v)
            if self._last_up is not None and now - self._last_up < s.cooldown_s:
                return self._out(current, "hold", f"{what}: low for {low_for:.0f}s, but the last scale-up was "
                                 f"{now - self._last_up:.0f}s ago (< {s.cooldown_s:.0f}s cooldown)", v)
            after = max(1, current - 1)
            util = None if full is None else (demand_ahead or 0.0) / after / full
            v = _Ctx(u, projected, quota, rate, util)
            if util is not None and util > s.scale_down_utilisation:
                return self._out(current, "hold", f"{what}: low for {low_for:.0f}s, but {after} replica(s) would "
                                 f"each carry {util:.0%} of the load per replica seen at saturation ({full:.0f} "
                                 f"requests/window; demand {acted.demand:.0f}, {demand_ahead:.0f} on its trend) > "
                                 f"{s.scale_down_utilisation:.0%}", v)
            self._low_since = now
            load = "" if util is None else f"; {after} replica(s) would carry {util:.0%} of the saturation load each"
            return self._out(current - 1, "down", f"{what} < {s.scale_down_threshold:.0%} for {low_for:.0f}s{load}",
                             v)
        self._low_since = None
        return self._out(current, "hold", f"{what}{trend}: between the thresholds", v)

    def _project(self, series: deque[tuple[float, float]], now: float, value: float | None) -> tuple[float | None,
                                                                                                      float]:
        """``value`` one cold start ahead, on its least-squares trend over ``trend_window_s`` (rising only),
        and the trend per second."""
        s = self.s
        if value is None:
            series.clear()
            return None, 0.0
        series.append((now, value))
        while series and series[0][0] < now - s.trend_window_s:
            series.popleft()
        slope = max(0.0, _slope(series))
        return value + slope * s.cold_start_s, slope

    def _mean_up(self, now: float, observed: int | None) -> float | None:
        """Replicas up over the signal window, time-weighted (the fleet that produced the window's counts)."""
        s = self.s
        if observed is None:
            self._seen.clear()
            return None
        self._seen.append((now, observed))
        while len(self._seen) > 1 and self._seen[1][0] <= now - s.window_s:
            self._seen.popleft()
        start = max(self._seen[0][0], now - s.window_s)
        span = now - start
        if span <= 0:
            return float(observed)
        pts = list(self._seen)
        return sum(n * (min(now, pts[i + 1][0] if i + 1 < len(pts) else now) - max(start, t))
                   for i, (t, n) in enumerate(pts)) / span

    def _learn(self, mean_up: float | None, u: Unmet, rate: float | None) -> float | None:
        """The load per replica when the fleet is full: requests served within their SLO (admitted less
        predicted misses) per replica up (time-weighted over the window), from a window with the unmet
        rate over the threshold. The latest such window wins; a window without unmet demand (under
        ``scale_down_threshold``) at a higher load per replica raises it (the sample was a transient's)."""
        s = self.s
        served = u.admitted - u.counts.get("slo_miss", 0.0)
        if mean_up is None or mean_up <= 0 or served <= 0 or rate is None:
            return self.full_per_replica
        per = served / mean_up
        if rate > s.scale_up_threshold:
            self.full_per_replica = per
        elif rate < s.scale_down_threshold and self.full_per_replica is not None and per > self.full_per_replica:
            self.full_per_replica = per
        return self.full_per_replica

    def _missing(self, why: str) -> Verdict:
        """Hold on missing data: the law's level, never below the replicas last observed."""
        seen = self.observed
        if self.desired is None:  # no complete window yet: no verdict, only a placeholder
            floor = max(self.s.min_replicas, seen or 0)
            return Verdict(floor, "hold", f"{why}: no verdict yet (no complete window since the start)"
                           + (f"; {seen} replica(s) observed" if seen is not None else ""),
                           missing_data=True, ready=False)
        v = self._out(self.desired, "hold", why + ": holding, never scaling down on no data", _Ctx())
        if seen is not None and seen > v.desired:
            return Verdict(seen, "hold", f"{v.reason}; not below the {seen} replica(s) last observed (the law's "
                           f"own count is {v.desired})", missing_data=True)
        return Verdict(v.desired, v.action, v.reason, missing_data=True)

    def _quota_problem(self, sig: Signals) -> str | None:
        """The tenant holding ≥ ``concentration`` of all rejections, most of them its own quota's 429s
        (not fleet-caused)."""
        per: dict[str, float] = {}
        for d in (sig.capacity_rejected, sig.policy_rejected):
            for t, v in d.items():
                per[t] = per.get(t, 0.0) + v
        total = sum(per.values())
        if total <= 0:
            return None
        top = max(per, key=lambda t: per[t])
        own = sig.policy_rejected.get(top, 0.0) - min(sig.fleet_caused.get(top, 0.0), sig.policy_rejected.get(top, 0.0))
        if per[top] / total < self.s.concentration or own < per[top] / 2:
            return None
        return top

    def _out(self, desired: int, action: Action, reason: str, ctx: _Ctx, now: float | None = None) -> Verdict:
        s = self.s
        bounded = max(s.min_replicas, min(s.max_replicas, desired))
        if bounded != desired:
            reason += f" (bounded to {bounded})"
            if bounded == (self.desired if self.desired is not None else bounded):
                action = "hold"
        if action == "up" and now is not None:
            self._last_up = now
        self.desired = bounded
        return Verdict(self._total(bounded), action, reason, ctx.rate, ctx.quota, unmet=ctx.unmet,
                       projected=ctx.projected, utilisation=ctx.utilisation)

    def _total(self, demand: int) -> int:
        """Replicas to run for a demand level: plus the warm pool, within max_replicas."""
        return min(self.s.max_replicas, demand + self.s.warm_pool)


@dataclass(frozen=True)
class _Ctx:
    """What a verdict reports besides its count and reason."""

    unmet: Unmet | None = None
    projected: float | None = None
    quota: str | None = None
    rate: float | None = None
    utilisation: float | None = None


def _slope(series: deque[tuple[float, float]]) -> float:
    """Least-squares slope of (time, value) points; 0 with fewer than three."""
    n = len(series)
    if n < 3:
        return 0.0
    mt = sum(t for t, _ in series) / n
    mv = sum(v for _, v in series) / n
    var = sum((t - mt) ** 2 for t, _ in series)
    return 0.0 if var <= 0 else sum((t - mt) * (v - mv) for t, v in series) / var
