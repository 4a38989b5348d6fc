"""structlog JSON logs. API keys never reach a log line: only tenant names and request ids do."""

from __future__ import annotations

import logging
import sys

import structlog


def setup(level: str = "info") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]


class Sampler:
    """Folds repeated log lines of one kind (a tenant's refusals for one reason) into one line per
    interval, so a flood of refusals costs a few lines a second, not one each (~310 bytes a refusal:
    ~27 GB a day per replica at 1,000 refusals/s). The metrics still count every one.

    ``take(key, now)`` says whether to write this line, and how many of the same key were folded into
    it since the last line written (``0``: none); ``due(now)`` hands back the keys whose folded lines
    have waited an interval with nothing after them, for one closing line each. Keys are what the caller
    makes of bounded labels (tenant, reason, pool), so the table stays as small as the metrics."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, ...], float] = {}
        self._folded: dict[tuple[str, ...], int] = {}

    def take(self, key: tuple[str, ...], now: float) -> int | None:
        last = self._last.get(key)
        if self.interval_s <= 0 or last is None or now - last >= self.interval_s:
            self._last[key] = now
            return self._folded.pop(key, 0)
        self._folded[key] = self._folded.get(key, 0) + 1
        return None

    def due(self, now: float) -> list[tuple[tuple[str, ...], int]]:
        """Folded lines an interval old with no line since: (key, how many), each handed back once."""
        if not self._folded:
            return []
        out = [(k, n) for k, n in self._folded.items() if now - self._last[k] >= self.interval_s]
        for k, _ in out:
            del self._folded[k]
            self._last[k] = now
        return out
