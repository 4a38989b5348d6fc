"""Spend budgets' Prometheus metrics, read from the ledger at scrape time (``budgets.BudgetBook``).

Every label comes from the config: ``tenant`` (through ``Stats.label``, so at most
``metrics.max_tenant_labels`` of them), ``budget`` (a budget's name), ``model`` (the ``prices`` key that
priced the request) — never from a request, so the cardinality is bounded by the config. The chart's
PrometheusRule alerts on ``kvgate_budget_window_spend / kvgate_budget_limit`` against
``kvgate_budget_alert_threshold``; its Grafana dashboard plots ``kvgate_spend_total`` by tenant and model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .budgets import BudgetBook


class BudgetCollector(Collector):
    """The spend families; ``book`` gives the ledger to read (None: not bound yet), ``label`` a tenant's label."""

    def __init__(self, book: Callable[[], BudgetBook | None], label: Callable[[str], str],
                 now: Callable[[], float]) -> None:
        self._book, self._label, self._now = book, label, now

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self._book()))

    def _families(self, book: BudgetBook | None) -> Iterator[Metric]:
        spend = CounterMetricFamily("kvgate_spend", "Money charged for completed requests since start, by tenant and "
                                    "model (the prices key), at the configured prices", labels=["tenant", "model"])
        reserved = GaugeMetricFamily("kvgate_spend_reserved", "Money held by requests in flight (their worst case), "
                                     "by tenant and model", labels=["tenant", "model"])
        charged = CounterMetricFamily("kvgate_budget_charged", "What each spend budget was charged since start, in "
                                      "its unit", labels=["tenant", "budget"])
        window = GaugeMetricFamily("kvgate_budget_window_spend", "What each spend budget's current window has "
                                   "spent here, in its unit", labels=["tenant", "budget", "window"])
        held = GaugeMetricFamily("kvgate_budget_reserved", "What requests in flight hold of each spend budget",
                                 labels=["tenant", "budget"])
        limit = GaugeMetricFamily("kvgate_budget_limit", "Each spend budget's limit per window, in its unit",
                                  labels=["tenant", "budget", "mode"])
        alert = GaugeMetricFamily("kvgate_budget_alert_threshold", "Fractions of the limit at which each budget "
                                  "alerts (its alert_at)", labels=["tenant", "budget", "threshold"])
        refused = CounterMetricFamily("kvgate_budget_refusals", "Requests a spend budget refused (mode hard) or "
                                      "would have refused (mode shadow)", labels=["tenant", "budget", "mode"])
        if book is not None:
            now = self._now()
            for (tenant, model), v in sorted(book.spent_by.items()):
                spend.add_metric([self._label(tenant), model], v)
            for (tenant, model), v in sorted(book.reserved_by.items()):
                reserved.add_metric([self._label(tenant), model], v)
            for accounts in book.accounts.values():
                for a in accounts:
                    t, b = self._label(a.tenant), a.budget
                    a.roll(now)
                    charged.add_metric([t, b.name], a.total_spent)
                    window.add_metric([t, b.name, b.window], a.spent)
                    held.add_metric([t, b.name], a.reserved)
                    limit.add_metric([t, b.name, b.mode], b.limit)
                    for f in b.alert_at:
                        alert.add_metric([t, b.name, f"{f:g}"], f)
                    refused.add_metric([t, b.name, b.mode], a.would_refuse if b.mode == "shadow" else a.refused)
        yield from (spend, reserved, charged, window, held, limit, alert, refused)
