"""Spend budgets' configuration and the price arithmetic: what a request costs, worst case and real.

Kept apart from ``config.py`` (which only refers to these models) so that the budget code is one place
(``budgets.py`` holds the ledger). A budget is a *contract* limit — money (or weighted tokens) over a
billing window — unlike the per-minute *protective* limits: it stays hard whatever else relaxes.

Prices are per million tokens, per model or pool (``prices:`` in the config, keyed by a model name, a
pattern, or a pool name). Reasoning tokens are part of ``completion_tokens`` in OpenAI's usage, so a
completion's cost is ``(completion - reasoning) * completion + reasoning * reasoning`` price, and the
worst case of ``n`` output tokens is ``n * max(completion, reasoning)``. Cached prompt tokens (vLLM's
``usage.prompt_tokens_details.cached_tokens``) are part of ``prompt_tokens`` and cost their own price;
the worst case assumes none is cached.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NonNegative = Annotated[float, Field(ge=0)]
Window = Literal["hour", "day", "week", "month", "rolling"]
BudgetMode = Literal["hard", "soft", "shadow"]
Unit = Literal["currency", "tokens"]
MILLION = 1_000_000.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Price(_Strict):
    """A model's (or pool's) price per million tokens, in the configured currency."""

    prompt: NonNegative = Field(description="price per million prompt tokens that were not in the prefix cache")
    cached_prompt: NonNegative | None = Field(
        default=None, description="price per million prompt tokens served from the prefix cache "
        "(usage.prompt_tokens_details.cached_tokens); default: the prompt price")
    completion: NonNegative = Field(description="price per million completion (output) tokens")
    reasoning: NonNegative | None = Field(
        default=None, description="price per million reasoning tokens (counted inside completion_tokens "
        "when the server reports them); default: the completion price")


UNIT_WEIGHTS = Price(prompt=MILLION, completion=MILLION)
"""Weighted-token budgets without ``weights``: every token counts 1."""


class SpendBudget(_Strict):
    """One spend budget of a tenant (``tenants[i].budgets[j]``)."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")] = Field(
        description="the budget's name: in the 429's message, the headers' suffix, the metrics' label")
    limit: Annotated[float, Field(gt=0)] = Field(description="the most the tenant may spend in one window, in `unit`")
    unit: Unit = Field(default="currency", description="currency: priced with `prices`; tokens: weighted tokens "
                       "(weights from `weights`, default 1 per token)")
    window: Window = Field(default="month", description="hour | day | week (from Monday) | month (calendar) in "
                           "`timezone`, or rolling (the last `rolling_seconds`)")
    rolling_seconds: Annotated[int, Field(ge=60)] | None = Field(
        default=None, description="the length of a rolling window (required with window: rolling)")
    timezone: str = Field(default="UTC", description="IANA time zone in which hour/day/week/month windows start")
    models: list[Annotated[str, Field(pattern=r"^[^\s\x00-\x1f\x7f]{1,256}$")]] | None = Field(
        default=None, description="only requests for these models, patterns or pools count (None: every model)")
    mode: BudgetMode = Field(default="hard", description="hard: refuse (429 tenant-budget); soft: alert only; "
                             "shadow: count and log what would be refused, refuse nothing")
    alert_at: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [0.8, 1.0], description="fractions of the limit at which alerts fire "
        "(exported as kvgate_budget_alert_threshold; the chart's PrometheusRule alerts on them)")
    weights: Price | None = Field(default=None, description="with unit: tokens, the weight of each kind of "
                                  "token per million (default: 1 per token)")

    @field_validator("timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError) as e:
            raise ValueError(f"unknown time zone {v!r} (an IANA name such as 'UTC' or 'Europe/Paris')") from e
        return v

    @model_validator(mode="after")
    def _rolling(self) -> SpendBudget:
        if self.window == "rolling" and self.rolling_seconds is None:
            raise ValueError("rolling_seconds: required when window is 'rolling'")
        if self.window != "rolling" and self.rolling_seconds is not None:
            raise ValueError("rolling_seconds: only with window: rolling")
        if self.weights is not None and self.unit != "tokens":
            raise ValueError("weights: only with unit: tokens (currency budgets are priced with `prices`)")
        return self


@dataclass(frozen=True, slots=True)
class Spent:
    """What a request used, as the usage reports it (cached and reasoning tokens are included in
    prompt and completion)."""

    prompt: int
    completion: int
    cached: int = 0
    reasoning: int = 0


_RATES: dict[int, tuple[Price, tuple[float, float, float, float]]] = {}


def _rates(p: Price) -> tuple[float, float, float, float]:
    """(prompt, cached prompt, completion, reasoning) prices with the defaults applied, computed once per
    price object (the request path settles with them)."""
    got = _RATES.get(id(p))
    if got is not None and got[0] is p:
        return got[1]
    r = (p.prompt, p.prompt if p.cached_prompt is None else p.cached_prompt, p.completion,
         p.completion if p.reasoning is None else p.reasoning)
    if len(_RATES) > 4096:  # prices come from configs; reloads make new ones: forget the old
        _RATES.clear()
    _RATES[id(p)] = (p, r)  # (keeps p alive, so its id is not reused while cached)
    return r


def cost(p: Price, used: Spent) -> float:
    """The real cost of ``used`` at ``p`` (cached prompt and reasoning tokens at their own prices)."""
    prompt_price, cached_price, completion_price, reasoning_price = _rates(p)
    prompt, completion = used.prompt, used.completion
    cached = used.cached if 0 <= used.cached <= prompt else (0 if used.cached < 0 else prompt)
    reasoning = used.reasoning if 0 <= used.reasoning <= completion else (0 if used.reasoning < 0 else completion)
    return ((prompt - cached) * prompt_price + cached * cached_price
            + (completion - reasoning) * completion_price + reasoning * reasoning_price) / MILLION


def worst_cost(p: Price, prompt: int, output_cap: int) -> float:
    """The most a request of ``prompt`` tokens with ``output_cap`` output tokens can cost: no prompt
    token cached (or every one, if cached tokens cost more), every output token at the dearer of
    completion and reasoning."""
    prompt_price, cached_price, completion_price, reasoning_price = _rates(p)
    return (prompt * (prompt_price if prompt_price >= cached_price else cached_price)
            + output_cap * (completion_price if completion_price >= reasoning_price else reasoning_price)) / MILLION
