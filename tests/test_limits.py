import math

import pytest

from ext_proc.limits import TokenBucket, default_burst


def test_refill_and_cap() -> None:
    b = TokenBucket(per_minute=600, capacity=100, now=0.0)  # 10/s
    b.take(100, 0.0)
    assert b.available(0.0) == 0
    assert b.available(3.0) == pytest.approx(30)
    assert b.available(1000.0) == 100


def test_seconds_until() -> None:
    b = TokenBucket(per_minute=600, capacity=100, now=0.0)
    b.take(95, 0.0)
    assert b.seconds_until(5, 0.0) == 0
    assert b.seconds_until(25, 0.0) == pytest.approx(2.0)
    assert math.isinf(b.seconds_until(101, 0.0))


def test_debt_is_carried() -> None:
    b = TokenBucket(per_minute=60, capacity=10, now=0.0)  # 1/s
    b.take(10, 0.0)
    b.give(-5, 0.0)  # real usage was 5 more than reserved
    assert b.available(0.0) == -5
    assert b.seconds_until(1, 0.0) == pytest.approx(6.0)


def test_retune_keeps_what_was_spent() -> None:
    b = TokenBucket(per_minute=60, capacity=100, now=0.0)
    b.take(30, 0.0)
    b.retune(per_minute=120, capacity=50, now=0.0)
    assert b.available(0.0) == 50
    b.retune(per_minute=120, capacity=200, now=0.0)
    assert b.available(0.0) == 50
    assert b.seconds_until_full(0.0) == pytest.approx(75.0)


def test_default_burst_is_at_least_one() -> None:
    assert default_burst(0.5, None) == 1.0
    assert default_burst(600, None) == 600
    assert default_burst(0.5, 3) == 3  # a configured burst is kept
    b = TokenBucket(per_minute=0.5, capacity=default_burst(0.5, None), now=0.0)
    assert b.seconds_until(1, 0.0) == 0  # the first request goes through
    b.take(1, 0.0)
    assert b.seconds_until(1, 0.0) == pytest.approx(120.0)  # the next one after two minutes
    assert b.seconds_until(1, 120.0) == 0
