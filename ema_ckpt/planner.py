"""Coefficient planner: every output is Σ cᵢ·θᵢ, with the cᵢ computed here in float64.

Pure arithmetic on steps and profile parameters: no I/O, no tensors. The executor reads
each checkpoint once and adds ``cᵢ·θᵢ`` into the output; this module decides the cᵢ and
explains them (``describe_plan``, ``spacing_warning``).

Time is the optimizer step counted from the start of training (step 0). Every function
returns one coefficient per input, in input order, with 0.0 for inputs it does not use
(checkpoints after ``at_step``, checkpoints outside a uniform selection).

Families (formulas in ``docs/math.md`` and ``docs/profiles.md``):

* classic EMA across gaps: ``exponential_coefficients`` (via ``schedules.fold_coefficients``);
* EDM2 power-function EMA from raw checkpoints: ``power_coefficients``;
* plain averaging (fairseq / LAWA): ``uniform_coefficients``;
* EDM2 post-hoc reconstruction from power-EMA snapshots: ``posthoc_plan``.

Example:
    >>> [round(c, 4) for c in power_coefficients([100, 200], gamma=1.0)]
    [0.25, 0.75]
    >>> round(sigma_rel_to_gamma(0.10), 2)
    6.94
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from numbers import Integral

import numpy as np

from .errors import UsageError
from .schedules import ExponentialProfile, fold_coefficients

__all__ = [
    "SIGMA_REL_MAX",
    "PlanStats",
    "PosthocPlan",
    "Snapshot",
    "describe_plan",
    "effective_half_life",
    "equivalent_step_decay",
    "exponential_coefficients",
    "exponential_window",
    "gamma_to_sigma_rel",
    "parse_sigma_list",
    "posthoc_coefficients",
    "posthoc_plan",
    "power_coefficients",
    "power_update_ratio",
    "power_update_weight",
    "power_window",
    "profile_inner_product",
    "sigma_rel_to_gamma",
    "spacing_warning",
    "uniform_coefficients",
    "uniform_selection",
]

#: σ_rel of γ = 0 (the uniform mean over [0, T]): 1/√12. Valid σ_rel lie in (0, 1/√12).
SIGMA_REL_MAX = 1.0 / math.sqrt(12.0)

#: Above this condition number the post-hoc solve falls back to least squares.
_COND_LSTSQ = 1e14
#: Above this condition number the post-hoc plan carries a warning.
_COND_WARN = 1e10
#: Above this relative L2 fit error the post-hoc plan carries a warning (EDM2's grids give ~0.004).
_FIT_WARN = 0.05


# --------------------------------------------------------------------------- σ_rel ↔ γ


GAMMA_MAX = 1e6
"""The largest power-EMA exponent accepted (σ_rel ≈ 1e-6): beyond it the profile's powers of
t/T underflow float64 for every checkpoint but the last, and the window is below one step."""


def check_gamma(gamma: float, what: str = "--gamma") -> float:
    """γ as a float in [0, GAMMA_MAX], else ``UsageError`` stating the range."""
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise UsageError(f"{what} must be a number, got {gamma!r}") from None
    if not (0.0 <= g <= GAMMA_MAX):
        raise UsageError(f"{what} (the power-EMA exponent γ) must lie between 0 and {GAMMA_MAX:g}, got {gamma!r}")
    return g


_check_gamma = check_gamma


def _check_sigma_rel(sigma_rel: float) -> float:
    try:
        s = float(sigma_rel)
    except (TypeError, ValueError):
        raise UsageError(f"--sigma-rel must be a number, got {sigma_rel!r}") from None
    if not (SIGMA_REL_MIN <= s < SIGMA_REL_MAX):
        raise UsageError(
            f"--sigma-rel must lie between {SIGMA_REL_MIN:.1e} and 1/√12 ≈ {SIGMA_REL_MAX:.4f} "
            f"(a relative width of the averaging window, not γ), got {sigma_rel!r}"
        )
    return s


def gamma_to_sigma_rel(gamma: float) -> float:
    """σ_rel(γ) = sqrt((γ+1) / ((γ+2)²(γ+3))): the std of the power profile over its end time.

    EDM2 (Karras et al. 2024), eq. 3. γ = 0 (uniform mean) gives 1/√12.

    Example:
        >>> round(gamma_to_sigma_rel(16.97), 4), round(gamma_to_sigma_rel(6.94), 4)
        (0.05, 0.1)
    """
    g = _check_gamma(gamma)
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


SIGMA_REL_MIN = 1e-6
"""The narrowest σ_rel accepted (γ ≈ 1e6, :data:`GAMMA_MAX`)."""


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """γ(σ_rel): the largest real root of γ³ + 7γ² + (16 − s)γ + (12 − s) = 0, s = σ_rel⁻².

    The cubic is σ_rel(γ)² = 1/s rearranged. Solved with ``numpy.roots`` and
    polished by Newton steps in float64. Valid for 0 < σ_rel < 1/√12, else ``UsageError``.

    Example:
        >>> round(sigma_rel_to_gamma(0.05), 2), round(sigma_rel_to_gamma(0.10), 2)
        (16.97, 6.94)
    """
    s = _check_sigma_rel(sigma_rel) ** -2
    coeffs = (1.0, 7.0, 16.0 - s, 12.0 - s)
    roots = np.roots(coeffs)
    real = [r.real for r in roots if abs(r.imag) <= 1e-7 * max(1.0, abs(r))]
    g = max(real)
    for _ in range(3):  # Newton polish: numpy.roots (eigenvalues) loses a few ulps
        f = ((g + 7.0) * g + 16.0 - s) * g + 12.0 - s
        df = (3.0 * g + 14.0) * g + 16.0 - s
        if df == 0.0:
            break
        g -= f / df
    return float(g)


# --------------------------------------------------------------------------- validation


def _as_step(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise UsageError(f"{what} must be an integer step, got {value!r}")
    step = int(value)
    if step < 0:
        raise UsageError(f"{what} must be ≥ 0 (steps count from the start of training), got {step}")
    return step


def _check_steps(steps: Sequence[int]) -> list[int]:
    out = [_as_step(s, "checkpoint step") for s in steps]
    if not out:
        raise UsageError("no checkpoints to combine")
    for a, b in zip(out, out[1:]):
        if b <= a:
            what = "appears twice" if a == b else f"comes after step {a}"
            raise UsageError(f"checkpoint steps must strictly increase: step {b} {what}")
    return out


def _used_count(steps: list[int], at_step: int | None) -> int:
    """How many checkpoints lie at or before ``at_step`` (all of them when it is None)."""
    if at_step is None:
        return len(steps)
    t = _as_step(at_step, "--at-step")
    n = bisect.bisect_right(steps, t)
    if n == 0:
        raise UsageError(f"--at-step {t} is before the first checkpoint (step {steps[0]})")
    if t > steps[-1]:
        raise UsageError(f"--at-step {t} is after the newest checkpoint (step {steps[-1]}): "
                         "nothing after it is known")
    return n


# --------------------------------------------------------------------------- power EMA


def _log_power_keep(t_prev: int, t_new: int, gamma: float) -> float:
    """log r = (γ+1)·log(t_prev/t_new), via log1p for small gaps; −inf when t_prev = 0."""
    if t_prev == 0:
        return -math.inf
    return (gamma + 1.0) * math.log1p(-(t_new - t_prev) / t_new)


def _check_pair(t_prev: int, t_new: int) -> tuple[int, int]:
    a, b = _as_step(t_prev, "t_prev"), _as_step(t_new, "t_new")
    if b <= a:
        raise UsageError(f"steps must increase: {a} then {b}")
    return a, b


def power_update_ratio(t_prev: int, t_new: int, gamma: float) -> float:
    """r = (t_prev/t_new)^(γ+1): the weight an incremental power EMA keeps.

    The update is acc ← r·acc + (1 − r)·θ_new. It is the product of the
    per-step decays (1 − 1/t)^(γ+1) over t = t_prev+1 … t_new, which telescopes.

    Example:
        >>> power_update_ratio(100, 200, gamma=1.0)
        0.25
    """
    a, b = _check_pair(t_prev, t_new)
    return math.exp(_log_power_keep(a, b, _check_gamma(gamma)))


def power_update_weight(t_prev: int, t_new: int, gamma: float) -> float:
    """1 − r, computed with ``expm1`` (no cancellation when t_new − t_prev ≪ t_new).

    Example:
        >>> power_update_weight(0, 10, gamma=5.0), power_update_weight(100, 200, gamma=1.0)
        (1.0, 0.75)
    """
    a, b = _check_pair(t_prev, t_new)
    return -math.expm1(_log_power_keep(a, b, _check_gamma(gamma)))


def power_coefficients(steps: Sequence[int], gamma: float, at_step: int | None = None) -> list[float]:
    """EDM2 power-function EMA from raw checkpoints: cᵢ = (tᵢ/T)^(γ+1) − (tᵢ₋₁/T)^(γ+1), t₀ = 0.

    Each checkpoint carries the mass of the profile p(τ) = (γ+1)τ^γ/T^(γ+1) on (tᵢ₋₁, tᵢ]
    ("hold": the weights at step τ are those of the next checkpoint), the first one [0, t₁];
    Σ cᵢ = 1 exactly. Evaluated as (tᵢ/T)^(γ+1)·(1 − (tᵢ₋₁/tᵢ)^(γ+1)) with
    ``exp``/``expm1``/``log1p``: no overflow for γ ≈ 100, no cancellation for small gaps.

    T is the newest checkpoint step at or before ``at_step`` (the newest of all when it is
    None): raw checkpoints stand for the steps up to them, so nothing after the newest
    usable checkpoint is known and the profile ends there. Later checkpoints get 0.

    Example:
        >>> [round(c, 4) for c in power_coefficients([100, 200, 300], gamma=1.0, at_step=250)]
        [0.25, 0.75, 0.0]
    """
    ts = _check_steps(steps)
    g = _check_gamma(gamma)
    n = _used_count(ts, at_step)
    big_t = ts[n - 1]
    if big_t == 0:
        raise UsageError("a power EMA needs a checkpoint after step 0 (its profile at T = 0 is empty)")
    out = [0.0] * len(ts)
    prev = 0
    for i in range(n):
        t = ts[i]
        if t > 0:
            scale = math.exp((g + 1.0) * math.log(t / big_t))
            out[i] = scale * -math.expm1(_log_power_keep(prev, t, g))
        prev = t
    return out


# --------------------------------------------------------------------------- classic EMA


def exponential_coefficients(
    steps: Sequence[int], profile: ExponentialProfile, at_step: int | None = None
) -> list[float]:
    """The classic EMA across gaps as weights: cᵢ = (1 − bᵢ)·Π_{j>i} bⱼ, b₁ = 0.

    bᵢ is ``profile.keep_factor`` over (tᵢ₋₁, tᵢ] (β^Δ per step, β per checkpoint, or the
    warm-up product); the first checkpoint initialises the average (ema₁ = θ₁), exactly as
    ``accumulate`` folds it (``docs/math.md``). Checkpoints after ``at_step`` get 0.

    Example:
        >>> exponential_coefficients([10, 11, 12], ExponentialProfile(decay=0.5))
        [0.25, 0.25, 0.5]
    """
    ts = _check_steps(steps)
    n = _used_count(ts, at_step)
    weights = [1.0] + [profile.update_weight(ts[i - 1], ts[i]) for i in range(1, n)]
    return fold_coefficients(weights) + [0.0] * (len(ts) - n)


def equivalent_step_decay(steps: Sequence[int], profile: ExponentialProfile) -> float:
    """The per-step β that the profile amounts to at the newest step.

    Per step: β itself. Per checkpoint: β^(1/k̄), k̄ the mean gap (t_n − t₁)/(n − 1) (``docs/math.md``:
    a fixed β every k steps is a per-step β^(1/k)); NaN with a single checkpoint. Warm-up:
    min(β, (1+T)/(10+T)) at the newest step T.

    Example:
        >>> round(equivalent_step_decay([0, 10, 20], ExponentialProfile(0.99, per_checkpoint=True)), 6)
        0.998995
    """
    ts = _check_steps(steps)
    if profile.per_checkpoint:
        if len(ts) < 2:
            return math.nan
        mean_gap = (ts[-1] - ts[0]) / (len(ts) - 1)
        return math.exp(math.log(profile.decay) / mean_gap)
    if profile.warmup:
        return min(profile.decay, (1.0 + ts[-1]) / (10.0 + ts[-1]))
    return profile.decay


def effective_half_life(steps: Sequence[int], profile: ExponentialProfile) -> float:
    """Half-life in steps, ln 2 / −ln β, of ``equivalent_step_decay`` (``docs/math.md``).

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


def power_window(gamma: float, at_step: int) -> float:
    """Averaging window in steps of a power EMA at step T: σ_rel(γ)·T.

    Example:
        >>> round(power_window(sigma_rel_to_gamma(0.05), 100_000))
        5000
    """
    return gamma_to_sigma_rel(gamma) * _as_step(at_step, "at_step")


# --------------------------------------------------------------------------- uniform


def uniform_selection(
    steps: Sequence[int],
    *,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
) -> list[int]:
    """Indices averaged by ``uniform_coefficients``: steps in [from_step, to_step], then the last k.

    Both bounds are inclusive; ``last`` keeps the newest k of what the bounds leave.

    Example:
        >>> uniform_selection([10, 20, 30, 40, 50], last=2, to_step=40)
        [2, 3]
    """
    ts = _check_steps(steps)
    lo = _as_step(from_step, "--from-step") if from_step is not None else None
    hi = _as_step(to_step, "--to-step") if to_step is not None else None
    if lo is not None and hi is not None and lo > hi:
        raise UsageError(f"--from-step {lo} is after --to-step {hi}")
    picked = [i for i, t in enumerate(ts) if (lo is None or t >= lo) and (hi is None or t <= hi)]
    if last is not None:
        if isinstance(last, bool) or not isinstance(last, Integral) or last < 1:
            raise UsageError(f"--last must be a positive number of checkpoints, got {last!r}")
        picked = picked[-int(last):]
    if not picked:
        bounds = f"[{lo if lo is not None else ts[0]}, {hi if hi is not None else ts[-1]}]"
        raise UsageError(f"no checkpoint in the selected steps {bounds} (checkpoints span {ts[0]}–{ts[-1]})")
    return picked


def uniform_coefficients(
    steps: Sequence[int],
    *,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
) -> list[float]:
    """Plain averaging (fairseq ``average_checkpoints``, LAWA): 1/k on each selected checkpoint.

    Selection as in ``uniform_selection``; an empty selection is a ``UsageError``.

    Example:
        >>> uniform_coefficients([10, 20, 30, 40], last=2)
        [0.0, 0.0, 0.5, 0.5]
    """
    picked = uniform_selection(steps, last=last, from_step=from_step, to_step=to_step)
    out = [0.0] * len(steps)
    for i in picked:
        out[i] = 1.0 / len(picked)
    return out


# --------------------------------------------------------------------------- post-hoc (EDM2)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A stored power-function EMA: its profile is p(τ; t, γ) = (γ+1)τ^γ/t^(γ+1) on [0, t].

    Example:
        >>> s = Snapshot.from_sigma_rel(4096, 0.05)
        >>> s.step, round(s.gamma, 2), round(s.sigma_rel, 3)
        (4096, 16.97, 0.05)
    """

    step: int
    gamma: float

    def __post_init__(self) -> None:
        step = _as_step(self.step, "snapshot step")
        if step == 0:
            raise UsageError("a power-EMA snapshot at step 0 has no profile (it is the initial weights)")
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "gamma", _check_gamma(self.gamma, "snapshot gamma"))

    @classmethod
    def from_sigma_rel(cls, step: int, sigma_rel: float) -> Snapshot:
        return cls(step, sigma_rel_to_gamma(sigma_rel))

    @property
    def sigma_rel(self) -> float:
        return gamma_to_sigma_rel(self.gamma)


def profile_inner_product(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """⟨p_a, p_b⟩ = ∫ p(τ; t_a, γ_a)·p(τ; t_b, γ_b) dτ, in closed form.

    For t_a ≤ t_b (swap otherwise) the product is non-zero on [0, t_a] only, and

        ∫₀^{t_a} (γ_a+1)(γ_b+1) τ^(γ_a+γ_b) / (t_a^(γ_a+1) t_b^(γ_b+1)) dτ
          = (γ_a+1)(γ_b+1) / ((γ_a+γ_b+1)·t_b) · (t_a/t_b)^γ_b.

    It scales as 1/t: only ratios of times matter (EDM2's post-hoc EMA; checked by quadrature in tests).

    Example:
        >>> profile_inner_product(1.0, 0.0, 1.0, 0.0)   # ‖uniform on [0, 1]‖² = 1
        1.0
        >>> profile_inner_product(2.0, 1.0, 1.0, 0.0)   # ∫₀¹ 1·(2τ/4) dτ
        0.25
    """
    if t_a > t_b:
        t_a, gamma_a, t_b, gamma_b = t_b, gamma_b, t_a, gamma_a
    if not t_a > 0:
        raise UsageError(f"profile end times must be positive, got {t_a}")
    ratio = math.exp(gamma_b * math.log(t_a / t_b)) if gamma_b > 0 else 1.0
    return (gamma_a + 1.0) * (gamma_b + 1.0) / ((gamma_a + gamma_b + 1.0) * t_b) * ratio


@dataclass(frozen=True, slots=True)
class PosthocPlan:
    """A post-hoc reconstruction: coefficients over the snapshots and how good they are.

    Attributes:
        coefficients: one per input snapshot (input order), summing to 1; 0 for unused ones.
        at_step: T, the end time of the target profile.
        target_gamma: γ of the target; ``target_sigma_rel`` its σ_rel.
        used: indices of the snapshots with step ≤ T.
        condition: 2-norm condition number of the Gram matrix A.
        rel_error: ‖Σ xᵢpᵢ − q‖ / ‖q‖ from the closed-form inner products (cancellation
            limits it to about 1e-8; smaller values are reported as that floor or 0).
        sigma_rel: σ_rel of the reconstructed profile Σ xᵢpᵢ (from its first two moments).
        mean_age: T − mean of the reconstructed profile, in steps.
        solver: "solve" or "lstsq" (singular or ill-conditioned A).
        warnings: human-readable caveats (extrapolation, conditioning).
    """

    coefficients: list[float]
    at_step: int
    target_gamma: float
    target_sigma_rel: float
    used: list[int]
    condition: float
    rel_error: float
    sigma_rel: float
    mean_age: float
    solver: str
    warnings: tuple[str, ...] = ()


def _gram(us: np.ndarray, gs: np.ndarray) -> np.ndarray:
    """A_ij = T·⟨p_i, p_j⟩ with end times as ratios u = t/T (vectorised ``profile_inner_product``)."""
    swap = us[:, None] > us[None, :]
    u_lo = np.where(swap, us[None, :], us[:, None])
    u_hi = np.where(swap, us[:, None], us[None, :])
    g_lo = np.where(swap, gs[None, :], gs[:, None])
    g_hi = np.where(swap, gs[:, None], gs[None, :])
    return (g_lo + 1.0) * (g_hi + 1.0) / ((g_lo + g_hi + 1.0) * u_hi) * np.exp(g_hi * np.log(u_lo / u_hi))


def posthoc_plan(
    snapshots: Sequence[Snapshot], target_gamma: float, at_step: int | None = None
) -> PosthocPlan:
    """EDM2 post-hoc EMA: the L2 projection of the target profile q onto the snapshots' profiles.

    q = p(·; T, γ_target), T = ``at_step`` (any step at or after the first snapshot) or the
    newest snapshot step; only snapshots with step ≤ T are used. With A_ij = ⟨p_i, p_j⟩ and
    b_i = ⟨p_i, q⟩ (``profile_inner_product``, scaled by T so entries are O(1)), solve A x = b
    in float64 (``numpy.linalg.solve``; ``lstsq`` if A is singular or cond(A) > 1e14), then
    normalise x to sum 1. Coefficients may be negative.

    Example:
        >>> snaps = [Snapshot(t, g) for t in (1000, 2000) for g in (6.94, 16.97)]
        >>> plan = posthoc_plan(snaps, target_gamma=16.97)
        >>> [abs(round(c, 6)) for c in plan.coefficients], plan.rel_error < 1e-6
        ([0.0, 0.0, 0.0, 1.0], True)
    """
    snaps = list(snapshots)
    if not snaps:
        raise UsageError("post-hoc reconstruction needs at least one power-EMA snapshot")
    for s in snaps:
        if not isinstance(s, Snapshot):
            raise UsageError(f"expected Snapshot objects, got {s!r}")
    gq = _check_gamma(target_gamma, "target gamma")
    first = min(s.step for s in snaps)
    if at_step is None:
        big_t = max(s.step for s in snaps)
    else:
        big_t = _as_step(at_step, "--at-step")
        if big_t < first:
            raise UsageError(f"--at-step {big_t} is before the first snapshot (step {first})")
        grid = sorted({s.step for s in snaps})
        if big_t not in grid:
            # Between snapshots the fit is poor (EDM2's reference refuses it too): never a silent guess.
            before = max(s for s in grid if s <= big_t)
            after = [s for s in grid if s > big_t]
            raise UsageError(
                f"--at-step {big_t} is not a snapshot step; a post-hoc EMA ends at one: step {before}"
                + (f" or {after[0]}" if after else "")
            )
    used = [i for i, s in enumerate(snaps) if s.step <= big_t]
    us = np.array([snaps[i].step / big_t for i in used], dtype=np.float64)
    gs = np.array([snaps[i].gamma for i in used], dtype=np.float64)

    a = _gram(us, gs)
    b = (gs + 1.0) * (gq + 1.0) / (gs + gq + 1.0) * np.exp(gq * np.log(us))
    qq = (gq + 1.0) ** 2 / (2.0 * gq + 1.0)

    condition = float(np.linalg.cond(a))
    solver = "solve"
    x = None
    if math.isfinite(condition) and condition <= _COND_LSTSQ:
        try:
            x = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            x = None
    if x is None:
        solver = "lstsq"
        x = np.linalg.lstsq(a, b, rcond=None)[0]
    total = math.fsum(x.tolist())
    if not math.isfinite(total) or abs(total) < 1e-12:
        raise UsageError(
            f"post-hoc reconstruction of γ = {gq:.6g} at step {big_t} is degenerate (Σx = {total:.3g})"
        )
    x = x / total

    # ‖Σ xᵢpᵢ − q‖² = xᵀAx − 2xᵀb + ‖q‖², all in units of 1/T.
    err2 = math.fsum([float(x @ a @ x), -2.0 * float(x @ b), qq])
    rel_error = math.sqrt(max(err2, 0.0) / qq)

    # Moments of p(·; t, γ): E τ = t(γ+1)/(γ+2), E τ² = t²(γ+1)/(γ+3); they combine linearly.
    m1 = math.fsum((x * us * (gs + 1.0) / (gs + 2.0)).tolist())
    m2 = math.fsum((x * us**2 * (gs + 1.0) / (gs + 3.0)).tolist())
    var = m2 - m1 * m1
    sigma_rel = math.sqrt(var) if var >= 0 else math.nan

    coefficients = [0.0] * len(snaps)
    for i, c in zip(used, x.tolist()):
        coefficients[i] = c

    warnings: list[str] = []
    target_sigma = gamma_to_sigma_rel(gq)
    narrowest = min(gamma_to_sigma_rel(float(g)) for g in gs)
    if target_sigma < narrowest * (1 - 1e-9):
        warnings.append(
            f"target σ_rel {target_sigma:.4g} is narrower than every snapshot (narrowest {narrowest:.4g}): "
            f"extrapolating; expect large coefficients (max |c| = {float(np.max(np.abs(x))):.3g})"
        )
    if rel_error > _FIT_WARN:
        warnings.append(
            f"the snapshots fit the target profile poorly (relative fit error {rel_error:.3g}; "
            f"on a good grid it is below {_FIT_WARN:g}): add snapshots, or choose a σ_rel within theirs"
        )
    if condition > _COND_WARN:
        warnings.append(
            f"the snapshot Gram matrix is ill-conditioned (cond {condition:.3g}); "
            f"{'solved by least squares' if solver == 'lstsq' else 'coefficients may be sensitive'}"
        )
    return PosthocPlan(
        coefficients=coefficients,
        at_step=big_t,
        target_gamma=gq,
        target_sigma_rel=target_sigma,
        used=used,
        condition=condition,
        rel_error=rel_error,
        sigma_rel=sigma_rel,
        mean_age=big_t * (1.0 - m1),
        solver=solver,
        warnings=tuple(warnings),
    )


def posthoc_coefficients(
    snapshots: Sequence[Snapshot], target_gamma: float, at_step: int | None = None
) -> list[float]:
    """The coefficients of ``posthoc_plan`` alone (one per snapshot, summing to 1).

    Example:
        >>> snaps = [Snapshot(1000, 6.94), Snapshot(1000, 16.97)]
        >>> c = posthoc_coefficients(snaps, sigma_rel_to_gamma(0.07))
        >>> round(sum(c), 12), all(0 < v < 1 for v in c)
        (1.0, True)
    """
    return posthoc_plan(snapshots, target_gamma, at_step).coefficients


# --------------------------------------------------------------------------- diagnostics


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
    """Σc, effective σ_rel, mean age, N_eff and max |c| of Σ cᵢ·θᵢ over raw checkpoints.

    The checkpoints are point masses at tᵢ: σ_rel here is that discrete spread, which
    approaches the profile's σ_rel only when checkpoints are dense. Pass the
    ``ExponentialProfile`` of an exponential plan to get its half-life and per-step β.

    Example:
        >>> s = describe_plan([10, 20, 30, 40], [0.0, 0.0, 0.5, 0.5])
        >>> s.total, s.at_step, s.mean_age, s.n_eff, s.max_abs, round(s.sigma_rel, 4)
        (1.0, 40, 5.0, 2.0, 0.5, 0.125)
    """
    ts = _check_steps(steps)
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
        mean = math.fsum(c * t for c, t in zip(cs, ts)) / total
        var = math.fsum(c * (t - mean) ** 2 for c, t in zip(cs, ts)) / total
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


def spacing_warning(steps: Sequence[int], window: float) -> str | None:
    """A message when the largest gap between consecutive checkpoints exceeds window/20.

    window = 1/(1 − β) for a classic EMA (``exponential_window``), σ_rel·T for a power EMA
    (``power_window``). Sparse checkpoints make the output LAWA-like averaging rather than
    the online EMA: relative error ≈ sqrt(k/window). None when spacing is fine.

    Example:
        >>> spacing_warning([0, 100, 200], window=10_000) is None
        True
        >>> spacing_warning([0, 1000], window=10_000)[:32]
        'checkpoint spacing of 1000 steps'
    """
    ts = _check_steps(steps)
    if not (window > 0):
        raise UsageError(f"the averaging window must be positive, got {window!r}")
    if len(ts) < 2:
        return None
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    k = max(gaps)
    if k <= window / 20.0:
        return None
    i = gaps.index(k)
    return (
        f"checkpoint spacing of {k} steps (between steps {ts[i]} and {ts[i + 1]}) exceeds "
        f"1/20 of the averaging window ({window:.4g} steps): the result is an average of sparse "
        f"checkpoints rather than the online EMA; expect a relative error near "
        f"sqrt(k/window) ≈ {math.sqrt(k / window):.2g}"
    )


# --------------------------------------------------------------------------- σ_rel lists

_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_MAX_LIST = 10_000


def _decimal(text: str, item: str) -> Decimal:
    if not _NUMBER.fullmatch(text):
        raise UsageError(f"--sigma-rel: {item!r} is not a number or a start:stop:step range")
    try:
        return Decimal(text)
    except InvalidOperation:  # pragma: no cover - the regex already filters
        raise UsageError(f"--sigma-rel: {item!r} is not a number") from None


def parse_sigma_list(text: str) -> list[tuple[str, float]]:
    """Parse ``--sigma-rel`` values: comma lists and EDM2 ranges ``start:stop:step`` (inclusive).

    Returns (text, value) pairs, the text as typed (ranges: printed with the most decimals
    among start, stop and step), so outputs can be named ``sigma_rel_<text>``. Every value
    must lie in (0, 1/√12); duplicates are refused (their outputs would collide).

    Example:
        >>> parse_sigma_list("0.05, 0.10")
        [('0.05', 0.05), ('0.10', 0.1)]
        >>> [t for t, _ in parse_sigma_list("0.010:0.025:0.005")]
        ['0.010', '0.015', '0.020', '0.025']
    """
    if not isinstance(text, str) or not text.strip():
        raise UsageError("--sigma-rel needs at least one value")
    out: list[tuple[str, float]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise UsageError(f"--sigma-rel: empty entry in {text!r}")
        parts = [p.strip() for p in item.split(":")]
        if len(parts) == 1:
            value = _decimal(parts[0], item)
            out.append((parts[0], _check_sigma_rel(float(value))))
            continue
        if len(parts) != 3:
            raise UsageError(f"--sigma-rel: range {item!r} must be start:stop:step")
        start, stop, step = (_decimal(p, item) for p in parts)
        if step <= 0:
            raise UsageError(f"--sigma-rel: range {item!r} needs a positive step")
        if stop < start:
            raise UsageError(f"--sigma-rel: range {item!r} ends before it starts")
        count = int((stop - start) // step) + 1
        if count > _MAX_LIST or len(out) + count > _MAX_LIST:
            raise UsageError(f"--sigma-rel: range {item!r} has {count} values (at most {_MAX_LIST})")
        quantum = Decimal(1).scaleb(min(d.as_tuple().exponent for d in (start, stop, step)))
        for k in range(count):
            value = (start + k * step).quantize(quantum)
            out.append((format(value, "f"), _check_sigma_rel(float(value))))
    seen: dict[float, str] = {}
    for label, value in out:
        if value in seen:
            raise UsageError(f"--sigma-rel: {label} is listed twice (also as {seen[value]})")
        seen[value] = label
    return out
