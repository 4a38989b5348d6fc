"""A tenant's usual cost of each answer shape: what the pace of its cap's stretch compares an answer with.

The stretch (``Admission._may_stretch``) grows a tenant's concurrency cap while the fleet serves it slower than
usual. Read as seconds per output token, *slower* also moved with the tenant's own shapes: long prompts with the
usual outputs, or one long answer followed by short ones, read as a slower fleet, and opened part or all of the
stretch on a healthy fleet (attack110 M1). An answer's duration on a fleet under a given load is about
``a + b·prompt computed + c·output`` — a fixed overhead, prefill linear in the prompt tokens the node computes
(those its prefix cache did not hold), decode linear in the output — so each tenant gets a fit of that line over
its own answers (least squares, weighted as its norm is: the older an answer the less it weighs, one slower than
the line weighing less again, so a slowed fleet moves the norm little), and its *pace* is its recent answers'
seconds over what the fit expected of each, a ratio of sums. A tenant that mixes or changes its shapes moves
both sums together; a slower fleet moves only the first. One answer counts at most ``MAX_WEIGHT`` times what its
shape is expected to take, so a single outlier — a stream the client held open, a shape the line does not know —
cannot read as a slowed fleet on its own.

The coefficients are non-negative (no shape is expected to take less than nothing; least squares on a few shapes
could extrapolate to that): with three of them, the non-negative fit is the best of the unconstrained fits of the
seven subsets whose coefficients all come out non-negative. Pure arithmetic; a few microseconds per answer, kept
only for tenants with a ``max_concurrent_stretch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCALE = (1.0, 1e-3, 1e-2)
"""Each feature's unit (an answer, a thousand prompt tokens computed, a hundred output tokens): values near 1, so
that ``RIDGE`` weighs them alike."""
RIDGE = 1e-3
"""Added to the fit's diagonal (the weights sum to about 1): a tenant whose shapes never vary (every prompt alike)
still has one line, and a shape ``MAX_LEVERAGE`` says its history does not cover."""
MAX_LEVERAGE = 10.0
"""A shape whose leverage on the fit (xᵀ(XᵀWX + ridge)⁻¹x, about 1-3 for the shapes the tenant sends) is over
this is outside what its answers so far tell apart: with one shape in its history the line cannot split an
answer's seconds between overhead, prompt and output, so it would guess the cost of a new shape — a long prompt
after short ones read as a slower fleet. Such an answer is left out of the pace (it still teaches the fit: after
about five of a new shape at the norm's weight, it is known)."""
MAX_WEIGHT = 3.0
"""An answer counts at most this many times its shape's expected seconds, in the pace and in the fit. With the
recent pace's weight per answer (``admission.EWMA_ALPHA``, 0.2), one such answer after usual ones reads
0.8 + 0.2 x 3 = 1.4, under the 1.5 that counts as slowed (``admission.SLOWED``)."""
MIN_EXPECTED_S = 1e-3
"""What a shape is expected to take at least (a fit of zeros expects nothing: no pace from it)."""


@dataclass(slots=True)
class ShapeFit:
    """Weighted least squares of an answer's seconds on (1, prompt computed, output tokens), each observation's
    weight given as it comes (an exponential forgetting of the older ones)."""

    xx: list[float] = field(default_factory=lambda: [0.0] * 6)
    """The weighted sums of the features' products: (0,0) (0,1) (0,2) (1,1) (1,2) (2,2)."""
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    """The weighted sums of each feature times the seconds."""
    coef: tuple[float, float, float] | None = None
    """The fitted line, in ``SCALE``'s units (None: no answer yet)."""
    inverse: list[list[float]] | None = None
    """(XᵀWX + ridge)⁻¹: a shape's leverage (``MAX_LEVERAGE``)."""

    def expect(self, prompt: float, output: float) -> float | None:
        """Seconds an answer of this shape is expected to take (None: no fit yet, a shape its history does not
        cover, or one it expects nothing of)."""
        c, inv = self.coef, self.inverse
        if c is None or inv is None:
            return None
        x1, x2 = prompt * SCALE[1], output * SCALE[2]
        r0 = inv[0][0] + inv[0][1] * x1 + inv[0][2] * x2
        r1 = inv[1][0] + inv[1][1] * x1 + inv[1][2] * x2
        r2 = inv[2][0] + inv[2][1] * x1 + inv[2][2] * x2
        if r0 + r1 * x1 + r2 * x2 > MAX_LEVERAGE:  # (xᵀ inverse x)
            return None
        e = c[0] + c[1] * x1 + c[2] * x2
        return e if e >= MIN_EXPECTED_S else None

    def observe(self, prompt: float, output: float, seconds: float, alpha: float) -> None:
        """One answer, weighing ``alpha`` against everything before it (the first: all of it), then the refit."""
        x1, x2 = prompt * SCALE[1], output * SCALE[2]
        keep, w = (0.0, 1.0) if self.coef is None else (1.0 - alpha, alpha)
        xx, xy = self.xx, self.xy
        for k, v in enumerate((1.0, x1, x2, x1 * x1, x1 * x2, x2 * x2)):
            xx[k] = keep * xx[k] + w * v
        for k, v in enumerate((seconds, x1 * seconds, x2 * seconds)):
            xy[k] = keep * xy[k] + w * v
        self._refit()

    def _refit(self) -> None:
        """The inverse (closed form: a symmetric 3x3 by its adjugate) and the non-negative least-squares line:
        the full solution where it is non-negative (the usual case), else the best of the smaller subsets' that
        are — of the unconstrained solutions of the subsets that come out non-negative, the one with the least
        weighted squared error (its constant part left out). A few microseconds, where a general solver of the
        seven took ~120."""
        a, b = self.xx, self.xy
        m00, m01, m02, m11, m12, m22 = a[0] + RIDGE, a[1], a[2], a[3] + RIDGE, a[4], a[5] + RIDGE
        c00, c01, c02 = m11 * m22 - m12 * m12, m02 * m12 - m01 * m22, m01 * m12 - m02 * m11
        c11, c12, c22 = m00 * m22 - m02 * m02, m01 * m02 - m00 * m12, m00 * m11 - m01 * m01
        det = m00 * c00 + m01 * c01 + m02 * c02
        if det <= 0.0:  # (positive-definite with the ridge: only from overflow)
            self.inverse, self.coef = None, (0.0, 0.0, 0.0)
            return
        inv = [[c00 / det, c01 / det, c02 / det], [c01 / det, c11 / det, c12 / det], [c02 / det, c12 / det, c22 / det]]
        self.inverse = inv
        w = (inv[0][0] * b[0] + inv[0][1] * b[1] + inv[0][2] * b[2],
             inv[1][0] * b[0] + inv[1][1] * b[1] + inv[1][2] * b[2],
             inv[2][0] * b[0] + inv[2][1] * b[1] + inv[2][2] * b[2])
        if min(w) >= 0.0:
            self.coef = w
            return
        full = ((m00, m01, m02), (m01, m11, m12), (m02, m12, m22))
        best: tuple[float, tuple[float, float, float]] | None = None
        for i, j in ((0, 1), (0, 2), (1, 2)):
            d = full[i][i] * full[j][j] - full[i][j] * full[i][j]
            if d <= 0.0:
                continue
            wi = (full[j][j] * b[i] - full[i][j] * b[j]) / d
            wj = (full[i][i] * b[j] - full[i][j] * b[i]) / d
            if wi >= 0.0 and wj >= 0.0:
                # wᵀAw - 2 wᵀb = -wᵀb at the subset's own optimum
                best = _better(best, -(wi * b[i] + wj * b[j]), {i: wi, j: wj})
        for i in range(3):
            wi = max(0.0, b[i] / full[i][i])
            best = _better(best, -wi * b[i], {i: wi})
        self.coef = best[1] if best is not None else (0.0, 0.0, 0.0)


def _better(best: tuple[float, tuple[float, float, float]] | None, err: float,
            w: dict[int, float]) -> tuple[float, tuple[float, float, float]]:
    """The better of ``best`` and a subset's solution ``w`` of error ``err``."""
    if best is not None and best[0] <= err:
        return best
    return err, (w.get(0, 0.0), w.get(1, 0.0), w.get(2, 0.0))

