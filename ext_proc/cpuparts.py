"""Where kvgate's CPU goes, measured: ``KVGATE_CPU_PARTS=1`` in kvgate's environment (off by default,
when it costs nothing at all).

With it on, the server wraps the calls that make up its request path, and each wrapped call's own
thread CPU time (``time.thread_time_ns``), less that of the wrapped calls inside it, is added to its
part:

* ``core`` — the gateway core's decisions and completions (``Core.decide``, ``ended``, ``tick``, ...);
* ``metrics`` — updating Prometheus metrics (``Stats.decision``, ``completion``, the decision-time
  histogram);
* ``logging`` — the core's structured log calls;
* ``protobuf`` — decoding Envoy's messages and building and serialising kvgate's replies;
* ``shell`` — the rest of the server's own Python per request (reading attributes and access-log
  entries, handing answers to streams).

``/metrics`` then exports ``kvgate_cpu_part_seconds_total{part}``. What the process spends beyond
their sum is the transport (gRPC's C core and its asyncio glue, the event loop): ``kvgate bench
overhead`` reports it as the difference against the process's own CPU time. The wrappers cost a
couple of clock reads each; the bench measures the breakdown in a run of its own, apart from the
headline figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

ENV = "KVGATE_CPU_PARTS"
PARTS = ("core", "metrics", "logging", "protobuf", "shell")

F = TypeVar("F", bound=Callable[..., Any])


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0", "false", "no")


class CpuParts(Collector):
    """Accumulated thread CPU per part (nanoseconds), exported as a counter at scrape time."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = dict.fromkeys(PARTS, 0)
        self._stack: list[int] = []

    def wrap(self, part: str, fn: F) -> F:
        """``fn``, its own CPU time (less nested wrapped calls) counted to ``part``."""
        clock, stack, ns = time.thread_time_ns, self._stack, self.ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                ns[part] += elapsed - stack.pop()
                if stack:
                    stack[-1] += elapsed

        return timed  # type: ignore[return-value]

    def patch(self, obj: Any, part: str, names: Iterable[str]) -> None:
        for name in names:
            setattr(obj, name, self.wrap(part, getattr(obj, name)))

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily("kvgate_cpu_part_seconds", "kvgate's own CPU by part of its request path "
                                  f"(only with {ENV}=1; the transport is the process's CPU beyond their sum)",
                                  labels=["part"])
        for part, ns in self.ns.items():
            fam.add_metric([part], ns / 1e9)
        yield fam
