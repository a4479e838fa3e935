"""Merge weights derived from a learning-rate decay schedule (WSM; Megatron-LM ``weighted_merge``).

Averaging checkpoints θ₀ … θ_{N−1} (oldest first) of a run trained at a constant learning
rate is the same as having decayed that rate over the window (WSM, Tian et al. 2025,
arXiv:2507.17634, Theorem 3.1): with gᵢ the update between θᵢ₋₁ and θᵢ,

    Σⱼ cⱼ θⱼ = θ₀ − Σᵢ wᵢ gᵢ,    wᵢ = Σ_{j≥i} cⱼ,

so a decay schedule 1 ≥ w₁ ≥ … ≥ w_{N−1} ≥ 0 is the merge
c₀ = 1 − w₁, cⱼ = wⱼ − wⱼ₊₁, c_{N−1} = w_{N−1}.

Named schedules f on [0, 1] (f(0) = 1, f(1) = 0) are sampled as Megatron-LM's
``tools/checkpoint/weighted_merge.py`` samples them, wᵢ = f(i/N), so
cⱼ = f(j/N) − f((j+1)/N):

* ``linear``: f(x) = 1 − x, cⱼ = 1/N (the plain mean, as WSM notes);
* ``minus-sqrt`` (WSM's "1−sqrt"): f(x) = 1 − √x, cⱼ = √((j+1)/N) − √(j/N), the oldest heaviest;
* ``cosine``: f(x) = (1 + cos πx)/2.

A schedule of (step, learning rate) points is step-aware: wᵢ is the mean rate between
checkpoints i−1 and i over the largest rate.

Example:
    >>> [round(c, 4) for c in schedule_weights("minus-sqrt", 4)]
    [0.5, 0.2071, 0.1589, 0.134]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from ..errors import OptionError

__all__ = ["NAMED_SCHEDULES", "coefficients_from_decay", "rate_schedule_weights", "schedule_weights"]

NAMED_SCHEDULES: dict[str, Callable[[float], float]] = {
    "linear": lambda x: 1.0 - x,
    "minus-sqrt": lambda x: 1.0 - math.sqrt(x),
    "cosine": lambda x: 0.5 * (1.0 + math.cos(math.pi * x)),
}
"""Decay schedules by name: f(0) = 1, f(1) = 0, non-increasing."""


def coefficients_from_decay(multipliers: Sequence[float]) -> list[float]:
    """WSM's Theorem 3.1: the merge weights of N checkpoints whose N−1 updates are scaled by
    ``multipliers`` (w₁ … w_{N−1}, non-increasing, in [0, 1]). They sum to 1.

    Example:
        >>> coefficients_from_decay([0.5])
        [0.5, 0.5]
    """
    w = [float(m) for m in multipliers]
    if any(not (0.0 <= m <= 1.0) or math.isnan(m) for m in w):
        raise OptionError("weights", "a decay schedule's multipliers must lie in [0, 1]")
    if any(b > a for a, b in itertools.pairwise(w)):
        raise OptionError("weights", "a decay schedule must not increase over the checkpoints")
    bounds = [1.0, *w, 0.0]
    return [bounds[j] - bounds[j + 1] for j in range(len(w) + 1)]


def schedule_weights(name: str, count: int) -> list[float]:
    """Merge weights of ``count`` checkpoints (oldest first) for a named decay schedule.

    Example:
        >>> schedule_weights("linear", 4)
        [0.25, 0.25, 0.25, 0.25]
    """
    if name not in NAMED_SCHEDULES:
        raise OptionError("weights", f"unknown schedule {name!r} (one of {', '.join(NAMED_SCHEDULES)})", value=name)
    if count < 1:
        return []
    if name == "linear":
        return [1.0 / count] * count  # exactly the mean, not 1 − x differences rounded
    return coefficients_from_decay([NAMED_SCHEDULES[name](i / count) for i in range(1, count)])


def rate_schedule_weights(steps: Sequence[int], points: Sequence[tuple[float, float]]) -> list[float]:
    """Merge weights of checkpoints at ``steps`` (oldest first) that emulate the learning-rate
    schedule ``points`` ((step, rate) pairs, piecewise linear, constant past either end).

    Example:
        >>> rate_schedule_weights([0, 10, 20], [(0, 1.0), (20, 0.0)])
        [0.25, 0.5, 0.25]
    """
    if len(points) < 1:
        raise OptionError("weights", "a learning-rate schedule needs at least one (step, rate) point")
    xs = [float(s) for s, _ in points]
    ys = [float(r) for _, r in points]
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise OptionError("weights", "a learning-rate schedule's steps must increase")
    if any(not math.isfinite(r) or r < 0 for r in ys) or max(ys) <= 0:
        raise OptionError("weights", "learning rates must be finite, non-negative, and not all zero")
    peak = max(ys)
    multipliers = [_mean_rate(xs, ys, a, b) / peak for a, b in itertools.pairwise(steps)]
    return coefficients_from_decay([min(1.0, max(0.0, m)) for m in multipliers])


def _rate_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    lo = hi - 1
    t = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + t * (ys[hi] - ys[lo])


def _mean_rate(xs: Sequence[float], ys: Sequence[float], a: float, b: float) -> float:
    """The mean of the piecewise-linear schedule over [a, b] (exact: trapezoids between knots)."""
    if b <= a:
        return _rate_at(xs, ys, b)
    cuts = [a, *(x for x in xs if a < x < b), b]
    area = sum((c1 - c0) * (_rate_at(xs, ys, c0) + _rate_at(xs, ys, c1)) / 2 for c0, c1 in itertools.pairwise(cuts))
    return area / (b - a)
