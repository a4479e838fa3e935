"""EDM2 post-hoc EMA: a new power profile as a least-squares combination of stored snapshots.

Karras et al. 2024 (EDM2, arXiv 2312.02696), §3 and Appendix C: the target profile q is
projected in L2 onto the span of the snapshots' power profiles p(τ; t, γ) = (γ+1)τ^γ/t^(γ+1)
(``docs/posthoc.md``, ``docs/math.md``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import OptionError, UsageError
from ._steps import as_step, option_step
from .power import gamma_problem, gamma_to_sigma_rel, sigma_rel_to_gamma

if TYPE_CHECKING:
    import numpy as np

__all__ = ["PosthocPlan", "Snapshot", "posthoc_coefficients", "posthoc_plan", "profile_inner_product"]

#: Above this condition number the post-hoc solve falls back to least squares.
_COND_LSTSQ = 1e14
#: Above this condition number the post-hoc plan carries a warning.
_COND_WARN = 1e10
#: Above this relative L2 fit error the post-hoc plan carries a warning (EDM2's grids give ~0.004).
_FIT_WARN = 0.05


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
        step = as_step(self.step, "snapshot step")
        if step == 0:
            raise UsageError("a power-EMA snapshot at step 0 has no profile (it is the initial weights)")
        gamma, problem = gamma_problem(self.gamma)
        if problem is not None:
            raise UsageError(f"snapshot gamma {problem}")
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "gamma", gamma)

    @classmethod
    def from_sigma_rel(cls, step: int, sigma_rel: float) -> Snapshot:
        return cls(step, sigma_rel_to_gamma(sigma_rel))

    @property
    def sigma_rel(self) -> float:
        return gamma_to_sigma_rel(self.gamma)


def profile_inner_product(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """⟨p_a, p_b⟩ = ∫ p(τ; t_a, γ_a)·p(τ; t_b, γ_b) dτ
    = (γ_a+1)(γ_b+1) / ((γ_a+γ_b+1)·t_b) · (t_a/t_b)^γ_b for t_a ≤ t_b (swapped otherwise).

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
    import numpy as np

    swap = us[:, None] > us[None, :]
    u_lo = np.where(swap, us[None, :], us[:, None])
    u_hi = np.where(swap, us[:, None], us[None, :])
    g_lo = np.where(swap, gs[None, :], gs[:, None])
    g_hi = np.where(swap, gs[:, None], gs[None, :])
    gram: np.ndarray = (g_lo + 1.0) * (g_hi + 1.0) / ((g_lo + g_hi + 1.0) * u_hi) \
        * np.exp(g_hi * np.log(u_lo / u_hi))
    return gram


def posthoc_plan(
    snapshots: Sequence[Snapshot], target_gamma: float, at_step: int | None = None
) -> PosthocPlan:
    """EDM2 post-hoc EMA: the L2 projection of the target profile q onto the snapshots' profiles.

    q = p(·; T, γ_target), T = ``at_step`` (a snapshot step) or the newest; snapshots after T
    are unused. Solves A x = b (A_ij = T·⟨p_i, p_j⟩, b_i = T·⟨p_i, q⟩; ``lstsq`` when A is
    singular or cond(A) > 1e14), x normalised to sum 1 (coefficients may be negative).

    Example:
        >>> snaps = [Snapshot(t, g) for t in (1000, 2000) for g in (6.94, 16.97)]
        >>> plan = posthoc_plan(snaps, target_gamma=16.97)
        >>> [abs(round(c, 6)) for c in plan.coefficients], plan.rel_error < 1e-6
        ([0.0, 0.0, 0.0, 1.0], True)
    """
    import numpy as np  # here: only a post-hoc solve needs it

    snaps = list(snapshots)
    if not snaps:
        raise UsageError("post-hoc reconstruction needs at least one power-EMA snapshot")
    for s in snaps:
        if not isinstance(s, Snapshot):
            raise UsageError(f"expected Snapshot objects, got {s!r}")
    gq, problem = gamma_problem(target_gamma)
    if problem is not None:
        raise UsageError(f"target gamma {problem}")
    first = min(s.step for s in snaps)
    if at_step is None:
        big_t = max(s.step for s in snaps)
    else:
        big_t = option_step(at_step, "at_step")
        if big_t < first:
            raise OptionError("at_step", f"{big_t} is before the first snapshot (step {first})", value=big_t)
        grid = sorted({s.step for s in snaps})
        if big_t not in grid:
            # Between snapshots the fit is poor (EDM2's reference refuses it too): never a silent guess.
            before = max(s for s in grid if s <= big_t)
            after = [s for s in grid if s > big_t]
            raise OptionError(
                "at_step",
                f"{big_t} is not a snapshot step; a post-hoc EMA ends at one: step {before}"
                + (f" or {after[0]}" if after else ""),
                value=big_t,
            )
    used = [i for i, s in enumerate(snaps) if s.step <= big_t]
    us = np.array([snaps[i].step / big_t for i in used], dtype=np.float64)
    gs = np.array([snaps[i].gamma for i in used], dtype=np.float64)

    a = _gram(us, gs)
    b = (gs + 1.0) * (gq + 1.0) / (gs + gq + 1.0) * np.exp(gq * np.log(us))
    qq = (gq + 1.0) ** 2 / (2.0 * gq + 1.0)

    condition = float(np.linalg.cond(a))
    x = None
    if math.isfinite(condition) and condition <= _COND_LSTSQ:
        with contextlib.suppress(np.linalg.LinAlgError):
            x = np.linalg.solve(a, b)
    solver = "solve" if x is not None else "lstsq"
    if x is None:
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
    for i, c in zip(used, x.tolist(), strict=True):
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
