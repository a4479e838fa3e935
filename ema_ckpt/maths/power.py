"""The EDM2 power-function EMA: σ_rel ↔ γ, its per-update decay and its closed form over checkpoints.

Source: Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion Models"
(EDM2, CVPR 2024, arXiv 2312.02696), §3 and Appendix C; ``docs/math.md`` derives the rest.

* profile at time t:  p(τ; t, γ) = (γ+1)·τ^γ / t^(γ+1) on [0, t] (integrates to 1, self-similar in t);
* width (EDM2 eq. 3):  σ_rel(γ) = sqrt((γ+1) / ((γ+2)²(γ+3)));
* per-step decay (EDM2 §3):  β(t) = (1 − 1/t)^(γ+1), whose product over the steps
  t_prev+1 … t_new telescopes to r = (t_prev/t_new)^(γ+1).

Time is the optimizer step counted from the start of training (step 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import OptionError, UsageError
from ._steps import as_step, check_pair, check_steps, used_count

__all__ = [
    "GAMMA_MAX",
    "SIGMA_REL_MAX",
    "SIGMA_REL_MIN",
    "PowerProfile",
    "check_gamma",
    "check_sigma_rel",
    "gamma_problem",
    "gamma_to_sigma_rel",
    "log_power_keep",
    "power_coefficients",
    "power_update_ratio",
    "power_update_weight",
    "power_window",
    "sigma_rel_to_gamma",
]

#: σ_rel of γ = 0 (the uniform mean over [0, T]): 1/√12. Valid σ_rel lie in (0, 1/√12).
SIGMA_REL_MAX = 1.0 / math.sqrt(12.0)
GAMMA_MAX = 1e6
"""The largest γ accepted (σ_rel ≈ 1e-6): beyond it (t/T)^γ underflows float64 for all but the last checkpoint."""
SIGMA_REL_MIN = 1e-6
"""The narrowest σ_rel accepted (γ ≈ :data:`GAMMA_MAX`)."""


def gamma_problem(gamma: object) -> tuple[float, str | None]:
    """γ as a float and what is wrong with it (worded after its name), or None when it is valid."""
    try:
        g = float(gamma)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan, f"must be a number, got {gamma!r}"
    if not (0.0 <= g <= GAMMA_MAX):
        return g, f"(the power-EMA exponent γ) must lie between 0 and {GAMMA_MAX:g}, got {gamma!r}"
    return g, None


def check_gamma(gamma: object, option: str = "gamma") -> float:
    """γ as a float in [0, GAMMA_MAX], else ``OptionError`` on ``option`` stating the range.

    Example:
        >>> check_gamma("6.94")
        6.94
    """
    g, problem = gamma_problem(gamma)
    if problem is not None:
        raise OptionError(option, problem, value=gamma)
    return g


def check_sigma_rel(sigma_rel: object, option: str = "sigma_rel") -> float:
    """σ_rel as a float in [SIGMA_REL_MIN, 1/√12), else ``OptionError`` on ``option``."""
    try:
        s = float(sigma_rel)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise OptionError(option, f"must be a number, got {sigma_rel!r}", value=sigma_rel) from None
    if not (SIGMA_REL_MIN <= s < SIGMA_REL_MAX):
        raise OptionError(
            option,
            f"must lie between {SIGMA_REL_MIN:.1e} and 1/√12 ≈ {SIGMA_REL_MAX:.4f} "
            f"(a relative width of the averaging window, not γ), got {sigma_rel!r}",
            value=sigma_rel,
        )
    return s


def gamma_to_sigma_rel(gamma: float) -> float:
    """σ_rel(γ) = sqrt((γ+1) / ((γ+2)²(γ+3))), EDM2 eq. 3: the profile's std over its end time.

    Example:
        >>> round(gamma_to_sigma_rel(16.97), 4), round(gamma_to_sigma_rel(6.94), 4)
        (0.05, 0.1)
    """
    g = check_gamma(gamma)
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """γ(σ_rel): the largest real root of γ³ + 7γ² + (16 − s)γ + (12 − s) = 0, s = σ_rel⁻² (EDM2 eq. 3).

    Example:
        >>> round(sigma_rel_to_gamma(0.05), 2), round(sigma_rel_to_gamma(0.10), 2)
        (16.97, 6.94)
    """
    import numpy as np  # here: importing the maths (a manifest's profile) must not load numpy

    s = check_sigma_rel(sigma_rel) ** -2
    roots = np.roots((1.0, 7.0, 16.0 - s, 12.0 - s))
    real = [r.real for r in roots if abs(r.imag) <= 1e-7 * max(1.0, abs(r))]
    g = float(max(real))
    for _ in range(3):  # Newton polish: numpy.roots (eigenvalues) loses a few ulps
        f = ((g + 7.0) * g + 16.0 - s) * g + 12.0 - s
        df = (3.0 * g + 14.0) * g + 16.0 - s
        if df == 0.0:
            break
        g -= f / df
    return g


def log_power_keep(t_prev: int, t_new: int, gamma: float) -> float:
    """log r = (γ+1)·log(t_prev/t_new), the log of the weight a power EMA keeps over (t_prev, t_new].

    Near ratio 1 it is (γ+1)·log1p(−Δ/t_new) (the ratio rounded first would lose a small gap's
    digits). −inf when t_prev ≤ 0: the first update replaces the average. Steps are not checked.

    Example:
        >>> log_power_keep(100, 200, 1.0) == 2 * math.log(0.5)
        True
    """
    if t_prev <= 0:
        return -math.inf
    ratio = t_prev / t_new
    log_ratio = math.log1p(-(t_new - t_prev) / t_new) if ratio > 0.5 else math.log(ratio)
    return (gamma + 1.0) * log_ratio


def power_update_ratio(t_prev: int, t_new: int, gamma: float) -> float:
    """r = (t_prev/t_new)^(γ+1): the weight an incremental power EMA keeps (acc ← r·acc + (1 − r)·θ_new).

    Example:
        >>> power_update_ratio(100, 200, gamma=1.0)
        0.25
    """
    a, b = check_pair(t_prev, t_new)
    return math.exp(log_power_keep(a, b, check_gamma(gamma)))


def power_update_weight(t_prev: int, t_new: int, gamma: float) -> float:
    """1 − r, computed with ``expm1`` (no cancellation when t_new − t_prev ≪ t_new).

    Example:
        >>> power_update_weight(0, 10, gamma=5.0), power_update_weight(100, 200, gamma=1.0)
        (1.0, 0.75)
    """
    a, b = check_pair(t_prev, t_new)
    return -math.expm1(log_power_keep(a, b, check_gamma(gamma)))


def power_coefficients(steps: Sequence[int], gamma: float, at_step: int | None = None) -> list[float]:
    """Power-function EMA from raw checkpoints: cᵢ = (tᵢ/T)^(γ+1) − (tᵢ₋₁/T)^(γ+1), t₀ = 0.

    Each checkpoint carries the profile's mass on (tᵢ₋₁, tᵢ]; Σ cᵢ = 1. Evaluated as
    (tᵢ/T)^(γ+1)·(1 − rᵢ) with ``exp``/``expm1`` (no overflow, no cancellation). T is the newest
    step at or before ``at_step``; later checkpoints get 0.

    Example:
        >>> [round(c, 4) for c in power_coefficients([100, 200, 300], gamma=1.0, at_step=250)]
        [0.25, 0.75, 0.0]
    """
    ts = check_steps(steps)
    g = check_gamma(gamma)
    n = used_count(ts, at_step)
    big_t = ts[n - 1]
    if big_t == 0:
        raise UsageError("a power EMA needs a checkpoint after step 0 (its profile at T = 0 is empty)")
    out = [0.0] * len(ts)
    prev = 0
    for i in range(n):
        t = ts[i]
        if t > 0:
            scale = math.exp((g + 1.0) * math.log(t / big_t))
            out[i] = scale * -math.expm1(log_power_keep(prev, t, g))
        prev = t
    return out


def power_window(gamma: float, at_step: int) -> float:
    """Averaging window in steps of a power EMA at step T: σ_rel(γ)·T.

    Example:
        >>> round(power_window(sigma_rel_to_gamma(0.05), 100_000))
        5000
    """
    return gamma_to_sigma_rel(gamma) * as_step(at_step, "at_step")


@dataclass(frozen=True, slots=True)
class PowerProfile:
    """A power-function EMA kept incrementally; ``label`` is γ as the user typed it (output names).

    Example:
        >>> p = PowerProfile(gamma=1.0, label="1")
        >>> p.update_weight(100, 200), round(p.sigma_rel, 4)
        (0.75, 0.2357)
    """

    gamma: float
    label: str

    def __post_init__(self) -> None:
        check_gamma(self.gamma)

    @property
    def sigma_rel(self) -> float:
        """σ_rel(γ), EDM2 eq. 3 (:func:`gamma_to_sigma_rel`)."""
        return gamma_to_sigma_rel(self.gamma)

    def log_keep_factor(self, prev_step: int, step: int) -> float:
        """log r over (prev_step, step] (:func:`log_power_keep`); −inf for the first checkpoint."""
        if step <= prev_step:
            raise UsageError(f"steps must increase: {prev_step} then {step}")
        return log_power_keep(prev_step, step, self.gamma)

    def update_weight(self, prev_step: int, step: int) -> float:
        """1 − (t_prev/t_new)^(γ+1); 1 for the first checkpoint (t_prev = 0)."""
        return -math.expm1(self.log_keep_factor(prev_step, step))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "power", "gamma": self.gamma, "sigma_rel": self.sigma_rel}

    def describe(self) -> str:
        return f"power-function EMA, sigma_rel {self.sigma_rel:.4g} (gamma {self.gamma:.4g})"
