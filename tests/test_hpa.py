"""The autoscale-only baseline's HPA model (``kvgate/bench/scenarios/hpa.py``): Kubernetes' replica rules,
pure, with the time passed in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.bench.scenarios.driver import Autoscaling, PoolSize
from kvgate.bench.scenarios.hpa import Hpa, HpaSettings, metric_replicas


def test_the_metric_asks_for_ceil_total_over_target_outside_the_tolerance() -> None:
    assert metric_replicas(17, 4, 2) == 5  # 17 waiting at 4 per node
    assert metric_replicas(0, 4, 6) == 0
    assert metric_replicas(21, 4, 5) == 5  # 21 / (4 x 5) = 1.05: within 10%, no change
    assert metric_replicas(23, 4, 5) == 6  # 1.15: outside


def test_scale_up_is_at_most_double_or_four_pods_per_15_s() -> None:
    h = Hpa(HpaSettings(1, 100))
    assert h.decide(0.0, 1, 50) == 5  # max(1 + 4, 2 x 1)
    assert h.decide(5.0, 5, 50) == 5  # the 15 s window already holds +4 from 1: nothing more yet
    assert h.decide(15.0, 5, 50) == 10  # a new window: max(5 + 4, 2 x 5)
    assert h.decide(30.0, 10, 50) == 20


def test_scale_down_waits_for_the_stabilisation_window_then_may_drop_all_at_once() -> None:
    h = Hpa(HpaSettings(2, 100))
    assert h.decide(0.0, 10, 10) == 10
    for t in range(15, 300, 15):  # the metric asks for 1 from here on: the window still holds the 10
        assert h.decide(float(t), 10, 1) == 10
    # at 300 s the recommendation of t=0 is no longer *after* the cut-off (the controller's
    # ``timestamp.After``): out of the window, and 100% per 15 s goes straight to minReplicas
    assert h.decide(300.0, 10, 1) == 2


def test_a_short_dip_does_not_scale_down_and_the_floor_is_min_replicas() -> None:
    h = Hpa(HpaSettings(3, 8))
    assert h.decide(0.0, 3, 1) == 3  # never below minReplicas
    assert h.decide(15.0, 3, 8) == 7  # up by max(4, 100%)
    assert h.decide(30.0, 7, 2) == 7  # a dip: the window's highest recommendation (8) holds
    assert h.decide(45.0, 7, 20) == 8  # never above maxReplicas


def test_the_bench_hpa_never_goes_below_the_fleet_it_starts_with() -> None:
    s = Autoscaling().hpa(PoolSize("default", 4, min_nodes=1, max_nodes=12))
    assert (s.min_replicas, s.max_replicas, s.scale_down.stabilization_s) == (4, 12, 300.0)
    with pytest.raises(ValueError, match="min_replicas"):
        HpaSettings(5, 4)


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=40))
def test_replicas_stay_in_bounds_and_within_the_step_limits(steps: list[tuple[int, int]]) -> None:
    h = Hpa(HpaSettings(2, 30))
    now, current = 0.0, 2
    for gap, desired in steps:
        now += 15.0 + gap
        nxt = h.decide(now, current, desired)
        assert 2 <= nxt <= 30
        assert nxt <= max(2 * current, current + 4)  # each sync at least 15 s apart: one window each
        current = nxt
