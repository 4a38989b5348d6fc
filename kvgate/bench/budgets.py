"""``kvgate bench budgets``: what spend budgets add to one decision that pays no store round trip.

The same request stream is decided and completed by the pure decision core (``Admission``) twice: a tenant
without budgets, and the same tenant with three (a monthly currency budget, a daily one on its model, a
rolling weighted-token one). The difference of the two p50s is what reserving the worst case and settling
the real cost add — the fast path of every replica (with ``store.redis`` a replica also pays one Redis
round trip per admitted request of a budgeted tenant: ``ext_proc/spendgate.py``; not measured here).
Figures are printed, never asserted: they depend on the machine.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from ext_proc.admission import Admission, Usage
from ext_proc.config import parse_config
from ext_proc.estimate import Estimate

BUDGETS: list[dict[str, Any]] = [
    {"name": "monthly", "limit": 1e12},
    {"name": "daily-70b", "limit": 1e12, "window": "day", "timezone": "Europe/Paris", "models": ["llama-70b"]},
    {"name": "tokens", "limit": 1e15, "unit": "tokens", "window": "rolling", "rolling_seconds": 3600},
]


def _run(budgets: list[dict[str, Any]], n: int, seed: int) -> list[float]:
    cfg = parse_config({"prices": {"llama-70b": {"prompt": 0.6, "cached_prompt": 0.15, "completion": 2.4}},
                        "tenants": [{"name": "t", "budgets": budgets}]})
    t = [1_765_000_000.0]

    def clock() -> float:
        t[0] += 1e-3
        return t[0]

    a = Admission(cfg, clock, random.Random(seed))
    tenant = cfg.tenant("t")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        est = Estimate(rng.randint(20, 4000), rng.randint(8, 512), parsed=True, model="llama-70b")
        t0 = time.perf_counter()
        d = a.decide(tenant, f"r{i}", est, 100)
        assert d.lease is not None
        a.complete(d.lease.ticket, Usage(est.prompt_tokens, est.output_tokens // 2, est.prompt_tokens // 2),
                   responded=True)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def budgets(n: int = 20_000, quiet: bool = False) -> dict[str, float]:
    """p50 of decide + complete without and with budgets (µs), and what the budgets add."""
    _run([], 2000, 0)  # warm up
    _run(BUDGETS, 2000, 0)
    without = statistics.median(_run([], n, 1))
    with_ = statistics.median(_run(BUDGETS, n, 1))
    result = {"requests": n, "p50_us_without_budgets": without, "p50_us_with_3_budgets": with_,
              "p50_us_added": with_ - without}
    if not quiet:
        print(f"kvgate bench budgets: decide + complete in the decision core, {n} requests, no store round trip")
        print(f"  p50 without budgets       {without:8.2f} µs")
        print(f"  p50 with 3 budgets        {with_:8.2f} µs")
        print(f"  added by reserve+settle   {with_ - without:8.2f} µs  (target: <= 20 µs)")
    return result
