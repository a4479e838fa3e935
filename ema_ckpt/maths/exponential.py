"""The classic EMA across checkpoint gaps: decay factors and the coefficients they imply.

An EMA folded over checkpoints θ₁…θₙ at steps s₁ < … < sₙ is the recursion

    ema₁ = θ₁,   emaₖ = bₖ·emaₖ₋₁ + (1 − bₖ)·θₖ,

where bₖ is the weight the old average keeps across the gap (sₖ₋₁, sₖ] (``docs/math.md``):

* per-step decay β:  bₖ = β^(sₖ − sₖ₋₁) (Composer's ``2^(−interval/half_life)``);
* half-life h steps: β = 2^(−1/h), since β^h = 1/2;
* per-checkpoint decay: bₖ = β whatever the gap;
* warm-up (the TF ``num_updates`` rule): the decay at step n is min(β, (1 + n)/(10 + n)),
  and bₖ is its product over the steps of the gap, in closed form: the product telescopes,
  Π_{n=a}^{b} (n+1)/(n+10) = Π_{j=1}^{9} (a+j)/(b+1+j).

Unrolled, the recursion is a weighted sum Σ cᵢ·θᵢ with cᵢ = (1 − bᵢ)·Π_{j>i} bⱼ and
b₁ = 0, so Σ cᵢ = 1.

Example:
    >>> p = ExponentialProfile(decay=0.5)
    >>> round(p.keep_factor(10, 12), 6)
    0.25
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import OptionError, UsageError
from ._steps import check_steps, used_count

__all__ = [
    "ExponentialProfile",
    "effective_half_life",
    "equivalent_step_decay",
    "exponential_coefficients",
    "exponential_window",
    "fold_coefficients",
]


@dataclass(frozen=True, slots=True)
class ExponentialProfile:
    """A classic EMA: β in (0, 1) kept per optimizer step, or per checkpoint whatever the gap;
    ``warmup``: min(β, (1 + n)/(10 + n)) at step n (TF-style)."""

    decay: float
    per_checkpoint: bool = False
    warmup: bool = False

    def __post_init__(self) -> None:
        if not (0.0 < self.decay < 1.0) or math.isnan(self.decay):
            raise OptionError("decay", f"must lie strictly between 0 and 1, got {self.decay}",
                              value=self.decay)
        if self.per_checkpoint and self.warmup:
            raise OptionError("warmup", "{warmup} counts optimizer steps; it cannot be combined with "
                              "{per_checkpoint}", value=True, mentions=("per_checkpoint",))

    @classmethod
    def from_half_life(cls, half_life: float, *, warmup: bool = False) -> ExponentialProfile:
        """β = 2^(−1/h) for a half-life of ``h`` steps.

        Example:
            >>> round(ExponentialProfile.from_half_life(693.0).decay, 4)
            0.999
        """
        if not (half_life > 0) or math.isinf(half_life):
            raise OptionError("half_life", f"must be a positive number of steps, got {half_life}",
                              value=half_life)
        return cls(decay=2.0 ** (-1.0 / half_life), warmup=warmup)

    @property
    def half_life(self) -> float:
        """Steps (or checkpoints) for a weight to halve: ln 2 / −ln β."""
        return math.log(2.0) / -math.log(self.decay)

    def log_keep_factor(self, prev_step: int, step: int) -> float:
        """log bₖ for the gap (prev_step, step]."""
        if step <= prev_step:
            raise UsageError(f"steps must increase: {prev_step} then {step}")
        log_beta = math.log(self.decay)
        if self.per_checkpoint:
            return log_beta
        if not self.warmup:
            return (step - prev_step) * log_beta
        return _log_warmup_product(prev_step + 1, step, self.decay)

    def keep_factor(self, prev_step: int, step: int) -> float:
        """bₖ: the weight the old average keeps across (prev_step, step]."""
        return math.exp(self.log_keep_factor(prev_step, step))

    def update_weight(self, prev_step: int, step: int) -> float:
        """1 − bₖ, computed without cancellation (``-expm1``) for decays near 1."""
        return -math.expm1(self.log_keep_factor(prev_step, step))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "exponential", **asdict(self)}

    def describe(self) -> str:
        unit = "checkpoint" if self.per_checkpoint else "step"
        text = f"EMA, decay {self.decay:.10g} per {unit} (half-life {self.half_life:.4g} {unit}s)"
        return text + (", TF warm-up" if self.warmup else "")


def _log_warmup_product(first: int, last: int, beta: float) -> float:
    """Σ_{n=first}^{last} log min(β, (1+n)/(10+n)), in closed form."""
    # (1+n)/(10+n) increases with n; it reaches β from n* = (10β − 1)/(1 − β) on.
    switch = max(first, math.ceil((10.0 * beta - 1.0) / (1.0 - beta)))
    total = 0.0
    ramp_last = min(last, switch - 1)
    if ramp_last >= first:
        # Π_{n=a}^{b} (n+1)/(n+10) telescopes to Π_{j=1}^{9} (a+j)/(b+1+j): nine exact terms.
        a, b = first, ramp_last
        total += math.fsum(math.log1p((a - b - 1) / (b + 1 + j)) for j in range(1, 10))
    flat_first = max(first, switch)
    if last >= flat_first:
        total += (last - flat_first + 1) * math.log(beta)
    return total


def fold_coefficients(update_weights: Sequence[float]) -> list[float]:
    """The weights cᵢ = wᵢ·Π_{j>i}(1 − wⱼ) of Σ cᵢ·θᵢ produced by a lerp fold with wᵢ = 1 − bᵢ.

    Example:
        >>> [round(c, 6) for c in fold_coefficients([1.0, 0.5, 0.5])]
        [0.25, 0.25, 0.5]
    """
    coefficients = [0.0] * len(update_weights)
    keep = 1.0
    for i in range(len(update_weights) - 1, -1, -1):
        coefficients[i] = update_weights[i] * keep
        keep *= 1.0 - update_weights[i]
    return coefficients


def exponential_coefficients(
    steps: Sequence[int], profile: ExponentialProfile, at_step: int | None = None
) -> list[float]:
    """The classic EMA across gaps as weights: cᵢ = (1 − bᵢ)·Π_{j>i} bⱼ, b₁ = 0, as ``accumulate``
    folds it; checkpoints after ``at_step`` get 0.

    Example:
        >>> exponential_coefficients([10, 11, 12], ExponentialProfile(decay=0.5))
        [0.25, 0.25, 0.5]
    """
    ts = check_steps(steps)
    n = used_count(ts, at_step)
    weights = [1.0] + [profile.update_weight(ts[i - 1], ts[i]) for i in range(1, n)]
    return fold_coefficients(weights) + [0.0] * (len(ts) - n)


def equivalent_step_decay(steps: Sequence[int], profile: ExponentialProfile) -> float:
    """The per-step β that the profile amounts to at the newest step.

    Per checkpoint: β^(1/k̄), k̄ the mean gap (NaN with one checkpoint); warm-up:
    min(β, (1+T)/(10+T)) at the newest step T.

    Example:
        >>> round(equivalent_step_decay([0, 10, 20], ExponentialProfile(0.99, per_checkpoint=True)), 6)
        0.998995
    """
    ts = check_steps(steps)
    if profile.per_checkpoint:
        if len(ts) < 2:
            return math.nan
        mean_gap = (ts[-1] - ts[0]) / (len(ts) - 1)
        return math.exp(math.log(profile.decay) / mean_gap)
    if profile.warmup:
        return min(profile.decay, (1.0 + ts[-1]) / (10.0 + ts[-1]))
    return profile.decay


def effective_half_life(steps: Sequence[int], profile: ExponentialProfile) -> float:
    """Half-life in steps, ln 2 / −ln β, of ``equivalent_step_decay``.

    Example:
        >>> round(effective_half_life([0, 10], ExponentialProfile(0.999)), 1)
        692.8
        >>> round(effective_half_life([0, 10, 20], ExponentialProfile(0.999, per_checkpoint=True)), 1)
        6928.0
    """
    beta = equivalent_step_decay(steps, profile)
    return math.log(2.0) / -math.log(beta) if not math.isnan(beta) else math.nan


def exponential_window(steps: Sequence[int], profile: ExponentialProfile) -> float:
    """Averaging window in steps, 1/(1 − β), of ``equivalent_step_decay``.

    Example:
        >>> round(exponential_window([0, 10], ExponentialProfile(0.999)))
        1000
    """
    beta = equivalent_step_decay(steps, profile)
    return 1.0 / -math.expm1(math.log(beta)) if not math.isnan(beta) else math.nan
