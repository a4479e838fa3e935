"""Pure EMA maths: decay factors across checkpoint gaps and the coefficients they imply.

No I/O and no tensors: everything is float64 arithmetic on steps, so plans can be
printed, tested and compared before a byte is read.

An EMA folded over checkpoints θ₁…θₙ at steps s₁ < … < sₙ is the recursion

    ema₁ = θ₁,   emaₖ = bₖ·emaₖ₋₁ + (1 − bₖ)·θₖ,

where bₖ is the weight the old average keeps across the gap (sₖ₋₁, sₖ]:

* per-step decay β:  bₖ = β^(sₖ − sₖ₋₁)  (each checkpoint stands for the steps since the
  previous one; the identity behind Composer's ``2^(−interval/half_life)``);
* half-life h steps: β = 2^(−1/h), since β^h = 1/2;
* per-checkpoint decay: bₖ = β whatever the gap;
* warm-up (the TF ``num_updates`` rule): the decay at step n is min(β, (1 + n)/(10 + n)),
  and bₖ is its product over the steps of the gap, in closed form: the product telescopes,
  Π_{n=a}^{b} (n+1)/(n+10) = Π_{j=1}^{9} (a+j)/(b+1+j).

Unrolled, the recursion is a weighted sum Σ cᵢ·θᵢ with cᵢ = (1 − bᵢ)·Π_{j>i} bⱼ and
b₁ = 0, so Σ cᵢ = 1 (see ``docs/math.md``).

Example:
    >>> p = ExponentialProfile(decay=0.5)
    >>> round(p.keep_factor(10, 12), 6)
    0.25
    >>> fold_coefficients([1.0, 0.75])
    [0.25, 0.75]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .errors import UsageError


@dataclass(frozen=True, slots=True)
class ExponentialProfile:
    """A classic EMA: decay per optimizer step (default) or per checkpoint.

    Attributes:
        decay: β in (0, 1): the weight the average keeps per step (or per checkpoint).
        per_checkpoint: apply β once per checkpoint, whatever the gap in steps.
        warmup: use min(β, (1 + n)/(10 + n)) at step n (TF-style warm-up).
    """

    decay: float
    per_checkpoint: bool = False
    warmup: bool = False

    def __post_init__(self) -> None:
        if not (0.0 < self.decay < 1.0) or math.isnan(self.decay):
            raise UsageError(f"--decay must lie strictly between 0 and 1, got {self.decay}")
        if self.per_checkpoint and self.warmup:
            raise UsageError("--warmup counts optimizer steps; it cannot be combined with --per-checkpoint")

    @classmethod
    def from_half_life(cls, half_life: float, *, warmup: bool = False) -> ExponentialProfile:
        """β = 2^(−1/h) for a half-life of ``h`` steps.

        Example:
            >>> round(ExponentialProfile.from_half_life(693.0).decay, 4)
            0.999
        """
        if not (half_life > 0) or math.isinf(half_life):
            raise UsageError(f"--half-life must be a positive number of steps, got {half_life}")
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
    """The weights cᵢ of Σ cᵢ·θᵢ produced by a lerp fold with weights wᵢ = 1 − bᵢ.

    The first weight is normally 1 (the first checkpoint initialises the average).

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


def profile_from_dict(data: dict[str, Any]) -> ExponentialProfile | PowerProfile:
    """Inverse of ``to_dict`` (used to read manifests)."""
    if data.get("kind") == "power":
        return PowerProfile(gamma=float(data["gamma"]), label=str(data.get("sigma_rel")))
    if data.get("kind") != "exponential":
        raise ValueError(f"unknown profile kind {data.get('kind')!r}")
    return ExponentialProfile(
        decay=float(data["decay"]),
        per_checkpoint=bool(data.get("per_checkpoint", False)),
        warmup=bool(data.get("warmup", False)),
    )


@dataclass(frozen=True, slots=True)
class PowerProfile:
    """A power-function EMA (EDM2, Karras et al. 2024, eq. for p(τ; t) ∝ τ^γ on [0, t]).

    Kept incrementally: acc ← r·acc + (1 − r)·θ with r = (t_prev/t_new)^(γ+1), time being
    the training step from 0. ``label`` is the value as the user typed it (output names).
    """

    gamma: float
    label: str

    def __post_init__(self) -> None:
        if not (self.gamma >= 0) or math.isinf(self.gamma):
            raise UsageError(f"--gamma must be a non-negative number, got {self.gamma}")

    @property
    def sigma_rel(self) -> float:
        """σ_rel(γ) = sqrt((γ+1) / ((γ+2)²(γ+3)))."""
        g = self.gamma
        return math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))

    def log_keep_factor(self, prev_step: int, step: int) -> float:
        if step <= prev_step:
            raise UsageError(f"steps must increase: {prev_step} then {step}")
        if prev_step <= 0:
            return -math.inf
        return (self.gamma + 1.0) * math.log(prev_step / step)

    def update_weight(self, prev_step: int, step: int) -> float:
        """1 − (t_prev/t_new)^(γ+1); 1 for the first checkpoint (t_prev = 0)."""
        return -math.expm1(self.log_keep_factor(prev_step, step))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "power", "gamma": self.gamma, "sigma_rel": self.sigma_rel}

    def describe(self) -> str:
        return f"power-function EMA, sigma_rel {self.sigma_rel:.4g} (gamma {self.gamma:.4g})"
