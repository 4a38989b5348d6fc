"""Repeated refusals are folded into one log line per interval (a flood of 429s must not write a line
each), while the metrics count every refusal and no refusal goes unaccounted in the log either."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ext_proc.config import parse_config
from ext_proc.core import Core, Request
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from ext_proc.logs import Sampler
from tests.helpers import FakeClock

KEYS = st.sampled_from([("reject", "a", "tenant-tokens"), ("reject", "b", "tenant-tokens"), ("reject", "a", "x")])


@given(st.lists(st.tuples(KEYS, st.floats(0, 3)), max_size=60), st.floats(0, 2))
def test_every_event_is_a_line_or_counted_in_exactly_one_line(events: list[Any], interval: float) -> None:
    s = Sampler(interval)
    now = 0.0
    written: dict[tuple[str, ...], int] = {}
    seen: dict[tuple[str, ...], int] = {}
    last_line: dict[tuple[str, ...], float] = {}
    for key, dt in events:
        now += dt
        seen[key] = seen.get(key, 0) + 1
        folded = s.take(key, now)
        if folded is not None:
            written[key] = written.get(key, 0) + 1 + folded
            if key in last_line:
                assert now - last_line[key] >= interval  # at most one line per interval and key
            last_line[key] = now
        for k, n in s.due(now):
            assert n > 0
            written[k] = written.get(k, 0) + n
    for k, n in s.due(now + interval + 1):
        written[k] = written.get(k, 0) + n
    assert written == seen


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **kw: None


def test_a_flood_of_refusals_writes_a_few_lines_and_counts_them_all() -> None:
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "requests_per_minute": 1}]})
    log = _Log()
    core = Core(cfg, clock, log=log)
    for i in range(1001):
        core.decide(Request("/v1/chat/completions", f"r{i}", "Bearer k", estimate=Estimate(10, 10, parsed=True),
                            body_bytes=10))
        clock.advance(0.001)  # 1,000 refusals in a second
    clock.advance(1.0)
    core.tick()
    rejects = [kw for e, kw in log.lines if e == "reject"]
    folded = [kw for e, kw in log.lines if e == "reject_folded"]
    assert len(rejects) <= 2 and len(folded) == 1
    assert len(rejects) + sum(kw.get("folded", 0) for kw in rejects) + folded[0]["folded"] == 1000
    samples = [line for line in generate_latest(core.stats.registry).decode().splitlines()
               if line.startswith("kvgate_requests_total{") and 'reason="tenant-requests"' in line]
    assert len(samples) == 1 and samples[0].endswith(" 1000.0")  # the metrics count every one


def test_interval_zero_logs_every_refusal() -> None:
    clock = FakeClock()
    cfg = parse_config({"logs": {"reject_interval_seconds": 0},
                        "tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "requests_per_minute": 1}]})
    log = _Log()
    core = Core(cfg, clock, log=log)
    for i in range(11):
        core.decide(Request("/v1/chat/completions", f"r{i}", "Bearer k", estimate=Estimate(10, 10, parsed=True),
                            body_bytes=10))
    assert len([e for e, _ in log.lines if e == "reject"]) == 10
