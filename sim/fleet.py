"""Several simulated nodes on one virtual clock: the driver for fleet-level benchmarks.

Each node is an ``Engine``; the only events are request arrivals and step ends, kept in one heap,
so an idle fleet costs nothing and a busy one costs one scheduler step per node step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .engine import Engine
from .scheduler import QueueFull, Request

Router = Callable[[list[Engine], Request], int]


def least_outstanding(engines: list[Engine], _: Request) -> int:
    """Plain Envoy's LEAST_REQUEST, with full knowledge: the node with the fewest requests on it."""
    best, best_load = 0, None
    for i, e in enumerate(engines):
        load = len(e.scheduler.running) + e.scheduler.num_waiting
        if best_load is None or load < best_load:
            best, best_load = i, load
    return best


def simulate_fleet(engines: list[Engine], arrivals: Iterable[Request], route: Router = least_outstanding,
                   on_reject: Callable[[Request, int], None] | None = None) -> list[Request]:
    pending = sorted(arrivals, key=lambda r: r.arrival)
    for e in engines:
        if e.on_tokens is None:
            e.every_token = False  # timings are read off the requests
    steps: list[tuple[float, int]] = []
    busy = [False] * len(engines)

    def kick(i: int, now: float) -> None:
        dt = engines[i].begin_step(now)
        busy[i] = dt is not None
        if dt is not None:
            heapq.heappush(steps, (now + dt, i))

    for req in pending:
        while steps and steps[0][0] <= req.arrival:
            t, i = heapq.heappop(steps)
            engines[i].end_step(t)
            kick(i, t)
        i = route(engines, req)
        try:
            engines[i].add(req)
        except (QueueFull, ValueError):
            if on_reject is not None:
                on_reject(req, i)
            continue
        if not busy[i]:
            kick(i, req.arrival)
    while steps:
        t, i = heapq.heappop(steps)
        engines[i].end_step(t)
        kick(i, t)
    return pending
