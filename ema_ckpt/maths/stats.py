"""What a plan amounts to (``docs/math.md``): Σc, effective σ_rel, mean age, N_eff, the spacing warning."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from ..errors import UsageError
from ._steps import check_steps
from .exponential import ExponentialProfile, effective_half_life, equivalent_step_decay

__all__ = ["PlanStats", "SparseCheckpoints", "describe_plan", "spacing_warning", "sparse_checkpoints"]


@dataclass(frozen=True, slots=True)
class PlanStats:
    """What a coefficient vector over raw checkpoints amounts to.

    Attributes:
        total: Σ cᵢ (should be 1 up to rounding).
        at_step: T, the newest step with a non-zero coefficient.
        sigma_rel: std of the point masses cᵢ at tᵢ (normalised by Σc) over T; NaN when
            negative weights make the variance negative.
        mean_age: T − Σ cᵢtᵢ/Σ cᵢ, in steps.
        n_eff: 1/Σ cᵢ² (the number of equally weighted checkpoints with the same variance).
        max_abs: max |cᵢ|.
        half_life: effective half-life in steps (exponential plans, when a profile is given).
        step_decay: equivalent per-step β (exponential plans, when a profile is given).
    """

    total: float
    at_step: int
    sigma_rel: float
    mean_age: float
    n_eff: float
    max_abs: float
    half_life: float | None = None
    step_decay: float | None = None


def describe_plan(
    steps: Sequence[int], coeffs: Sequence[float], *, profile: ExponentialProfile | None = None
) -> PlanStats:
    """Σc, effective σ_rel (of point masses at tᵢ), mean age, N_eff and max |c| of Σ cᵢ·θᵢ;
    with ``profile``, an exponential plan's half-life and per-step β too.

    Example:
        >>> s = describe_plan([10, 20, 30, 40], [0.0, 0.0, 0.5, 0.5])
        >>> s.total, s.at_step, s.mean_age, s.n_eff, s.max_abs, round(s.sigma_rel, 4)
        (1.0, 40, 5.0, 2.0, 0.5, 0.125)
    """
    ts = check_steps(steps)
    cs = [float(c) for c in coeffs]
    if len(cs) != len(ts):
        raise UsageError(f"{len(cs)} coefficients for {len(ts)} checkpoints")
    if not all(math.isfinite(c) for c in cs):
        raise UsageError("coefficients must be finite")
    nonzero = [i for i, c in enumerate(cs) if c != 0.0]
    if not nonzero:
        raise UsageError("every coefficient is zero")
    big_t = ts[nonzero[-1]]
    total = math.fsum(cs)
    sq = math.fsum(c * c for c in cs)
    if total != 0.0:
        mean = math.fsum(c * t for c, t in zip(cs, ts, strict=True)) / total
        var = math.fsum(c * (t - mean) ** 2 for c, t in zip(cs, ts, strict=True)) / total
        sigma_rel = math.sqrt(var) / big_t if var >= 0 and big_t > 0 else math.nan
        mean_age = big_t - mean
    else:
        sigma_rel = mean_age = math.nan
    half_life = step_decay = None
    if profile is not None:
        used = ts[: nonzero[-1] + 1]
        step_decay = equivalent_step_decay(used, profile)
        half_life = effective_half_life(used, profile)
    return PlanStats(
        total=total,
        at_step=big_t,
        sigma_rel=sigma_rel,
        mean_age=mean_age,
        n_eff=1.0 / sq,
        max_abs=max(abs(c) for c in cs),
        half_life=half_life,
        step_decay=step_decay,
    )


@dataclass(frozen=True, slots=True)
class SparseCheckpoints:
    """Checkpoints too sparse for an averaging window: the numbers behind the spacing warning.

    Attributes:
        gap: the largest gap between consecutive checkpoints, in steps (k).
        after, before: the steps on either side of that gap.
        window: the averaging window in steps (1/(1 − β), or σ_rel·T).
        in_window: how many checkpoints fall within the last ``window`` steps.
        rel_error: the relative error to expect, ≈ sqrt(k/window).
    """

    gap: int
    after: int
    before: int
    window: float
    in_window: int
    rel_error: float


def sparse_checkpoints(steps: Sequence[int], window: float) -> SparseCheckpoints | None:
    """The numbers of :func:`spacing_warning`, or None when spacing is fine (gaps ≤ window/20).

    Example:
        >>> s = sparse_checkpoints([0, 1000, 1100], window=10_000)
        >>> s.gap, s.after, s.before, s.in_window, round(s.rel_error, 3)
        (1000, 0, 1000, 3, 0.316)
    """
    ts = check_steps(steps)
    if not (window > 0):
        raise UsageError(f"the averaging window must be positive, got {window!r}")
    if len(ts) < 2:
        return None
    gaps = [b - a for a, b in pairwise(ts)]
    k = max(gaps)
    if k <= window / 20.0 * (1 + 1e-9):  # 1/(1 − 0.999) is 999.99…: a spacing of 50 is fine for it
        return None
    i = gaps.index(k)
    recent = sum(1 for t in ts if t > ts[-1] - window)
    return SparseCheckpoints(k, ts[i], ts[i + 1], window, recent, math.sqrt(k / window))


def spacing_warning(steps: Sequence[int], window: float) -> str | None:
    """A message when the largest gap between consecutive checkpoints exceeds window/20.

    window = 1/(1 − β) for a classic EMA, σ_rel·T for a power EMA. Sparse checkpoints make the
    output LAWA-like averaging: relative error ≈ sqrt(k/window).

    Example:
        >>> spacing_warning([0, 100, 200], window=10_000) is None
        True
        >>> spacing_warning([0, 1000], window=10_000)[:32]
        'checkpoint spacing of 1000 steps'
    """
    sparse = sparse_checkpoints(steps, window)
    if sparse is None:
        return None
    return (
        f"checkpoint spacing of {sparse.gap} steps (between steps {sparse.after} and {sparse.before}) exceeds "
        f"1/20 of the averaging window ({window:.4g} steps): the result is an average of sparse "
        f"checkpoints rather than the online EMA; expect a relative error near "
        f"sqrt(k/window) ≈ {sparse.rel_error:.2g}"
    )
