"""``kvgate spend``: who spent what, read from the ledger (``spendstore.py``) — chargeback for an operator.

Two readings of the store: the durable per-day record (``{<key_prefix>}:spend:day:YYYY-MM-DD``, field
``tenant|model``, money at the configured prices; UTC days, kept ``DAY_TTL_S``) for the days from
``since`` to ``until``, and each configured budget's current window (spent, reserved, limit). Rendered as
a table, JSON or CSV. No HTTP endpoint: it asks Redis directly, with the store's own credentials.
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from datetime import date, timedelta
from typing import Any

import orjson

from .config import Config
from .spendstore import SpendStore, _text


@dataclass(frozen=True, slots=True)
class DayRow:
    day: str
    tenant: str
    model: str
    spend: float


@dataclass(frozen=True, slots=True)
class BudgetRow:
    tenant: str
    budget: str
    window: str
    mode: str
    unit: str
    limit: float
    spent: float
    reserved: float


def days(since: date, until: date) -> list[date]:
    """Every day from ``since`` to ``until``, both included (none when ``until`` is earlier)."""
    return [since + timedelta(days=i) for i in range((until - since).days + 1)]


async def read(store: SpendStore, config: Config, since: date, until: date, now: float) -> tuple[list[DayRow],
                                                                                               list[BudgetRow]]:
    """The per-day record over [since, until] and every configured budget's current window."""
    rows: list[DayRow] = []
    for d in days(since, until):
        h = await store.client.hgetall(f"{store.prefix}day:{d.isoformat()}")
        for field, v in sorted((_text(k), float(_text(v))) for k, v in h.items()):
            tenant, _, model = field.partition("|")
            rows.append(DayRow(d.isoformat(), tenant, model, v))
    budgets: list[BudgetRow] = []
    for t in config.tenants:
        for b in t.budgets:
            spent, reserved = await store.state(t.name, b, now)
            budgets.append(BudgetRow(t.name, b.name, b.window, b.mode, b.unit, b.limit, spent, reserved))
    return rows, budgets


def render(rows: list[DayRow], budgets: list[BudgetRow], fmt: str) -> str:
    """``table`` (for a person), ``json`` ({"days": [...], "budgets": [...]}) or ``csv`` (the per-day rows)."""
    if fmt == "json":
        doc: dict[str, Any] = {"days": [asdict(r) for r in rows], "budgets": [asdict(b) for b in budgets]}
        return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
    if fmt == "csv":
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["day", "tenant", "model", "spend"])
        for r in rows:
            w.writerow([r.day, r.tenant, r.model, f"{r.spend:.6f}"])
        return out.getvalue().rstrip("\n")
    lines = [f"{'day':<10}  {'tenant':<20}  {'model':<30}  {'spend':>12}"]
    lines += [f"{r.day:<10}  {r.tenant:<20}  {r.model:<30}  {r.spend:>12.4f}" for r in rows]
    total = sum(r.spend for r in rows)
    lines.append(f"{'total':<10}  {'':<20}  {'':<30}  {total:>12.4f}")
    if budgets:
        lines += ["", f"{'tenant':<20}  {'budget':<16}  {'window':<8}  {'mode':<6}  {'spent':>12}  {'reserved':>10}  "
                  f"{'limit':>12}"]
        lines += [f"{b.tenant:<20}  {b.budget:<16}  {b.window:<8}  {b.mode:<6}  {b.spent:>12.4f}  {b.reserved:>10.4f}  "
                  f"{b.limit:>12.4f}" for b in budgets]
    return "\n".join(lines)
