"""The usual cost of a tenant's answer shapes (``ext_proc/pace.py``): the line the stretch's pace compares
answers with."""

from __future__ import annotations

import random

from ext_proc.pace import MAX_LEVERAGE, ShapeFit


def test_a_line_of_varied_shapes_is_recovered() -> None:
    fit = ShapeFit()
    rng = random.Random(3)
    for _ in range(300):
        p, o = rng.randint(0, 8000), rng.randint(1, 500)
        fit.observe(p, o, 0.3 + 0.0002 * p + 0.02 * o, 0.02)
    for p, o in ((0, 1), (4000, 250), (8000, 500)):
        e = fit.expect(p, o)
        assert e is not None and abs(e - (0.3 + 0.0002 * p + 0.02 * o)) < 0.02 * e


def test_a_shape_the_history_does_not_cover_is_expected_nothing() -> None:
    """One shape alone cannot split its seconds between overhead, prompt and output: a new shape's cost would
    be a guess (a long prompt after short ones read as a slower fleet). It is None until seen a few times."""
    fit = ShapeFit()
    for _ in range(100):
        fit.observe(100, 50, 1.4, 0.02)
    e = fit.expect(100, 50)
    assert e is not None and abs(e - 1.4) < 0.01
    assert fit.expect(12500, 50) is None and fit.expect(100, 5) is None
    seen = 0
    while fit.expect(12500, 50) is None:
        fit.observe(12500, 50, 3.9, 0.02)
        seen += 1
    assert 1 <= seen <= 10
    e = fit.expect(12500, 50)
    assert e is not None and 3.0 < e < 4.2  # (learnt, near its cost)
    assert MAX_LEVERAGE > 1.0


def test_no_shape_is_expected_to_cost_less_than_the_overhead() -> None:
    """Least squares over answers whose longer prompts happened to be faster (a prefix cache, noise) gives the
    prompt a negative cost, and a longer prompt would be expected to take less than nothing; the fit is kept
    non-negative."""
    fit = ShapeFit()
    for i in range(200):
        fit.observe(0 if i % 2 else 1000, 100, 2.0 if i % 2 else 1.8, 0.02)
    assert fit.coef is not None and min(fit.coef) >= 0.0
    e = fit.expect(2000, 100)
    assert e is not None and e >= 1.8
