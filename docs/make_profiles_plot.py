"""Draw the averaging profiles implied by ``ema_ckpt.maths`` into ``docs/profiles.png``.

Every plan is Σ cᵢ·θᵢ. With "hold" semantics checkpoint i stands for the steps (tᵢ₋₁, tᵢ],
so its weight per step is cᵢ/(tᵢ − tᵢ₋₁): the staircases below. Smooth curves are the
continuous profiles the plans approximate. Post-hoc plans combine whole power profiles,
so their curve is Σ xᵢ·p(τ; tᵢ, γᵢ) against the target p(τ; T, γ).

Run:  .venv/bin/python docs/make_profiles_plot.py   (needs matplotlib, a docs-only extra)
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from ema_ckpt.maths import (
    ExponentialProfile,
    Snapshot,
    exponential_coefficients,
    posthoc_plan,
    power_coefficients,
    sigma_rel_to_gamma,
    uniform_coefficients,
)

T = 100_000
EVERY = 2_000
STEPS = list(range(EVERY, T + 1, EVERY))
TAU = np.linspace(0.0, T, 4001)


def staircase(ax, steps, coeffs, **kw):
    """Weight per step: cᵢ spread over (tᵢ₋₁, tᵢ]."""
    edges = [0, *steps]
    heights = [c / (b - a) for (a, b), c in zip(itertools.pairwise(edges), coeffs, strict=True)]
    ax.stairs(heights, edges, **kw)


def power_profile(tau, t, gamma):
    """p(τ; t, γ) = (γ+1)τ^γ / t^(γ+1) on [0, t]."""
    return np.where(tau <= t, (gamma + 1) * (tau / t) ** gamma / t, 0.0)


def main() -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)

    ax = axes[0, 0]
    for beta in (0.9999, 0.99995):
        profile = ExponentialProfile(beta)
        c = exponential_coefficients(STEPS, profile)
        staircase(ax, STEPS, c, label=f"β = {beta} per step, checkpoints every {EVERY}")
        dens = -math.log(beta) * beta ** (T - TAU)
        ax.plot(TAU, dens, lw=1, ls="--", color="k")
    ax.set_title("classic EMA with gaps\ncᵢ = β^(T−tᵢ)(1 − β^Δᵢ); the first checkpoint keeps β^(T−t₁)")
    ax.annotate("start-value weight\n(ema₁ = θ₁)", xy=(EVERY, 0), xytext=(8000, 2e-5),
                arrowprops={"arrowstyle": "->"})

    ax = axes[0, 1]
    for sigma in (0.05, 0.10, 0.20):
        gamma = sigma_rel_to_gamma(sigma)
        staircase(ax, STEPS, power_coefficients(STEPS, gamma), label=f"σ_rel {sigma} (γ = {gamma:.2f})")
        ax.plot(TAU, power_profile(TAU, T, gamma), lw=1, ls="--", color="k")
    ax.set_title("power EMA (EDM2) from raw checkpoints\ncᵢ = (tᵢ/T)^(γ+1) − (tᵢ₋₁/T)^(γ+1)")

    ax = axes[1, 0]
    staircase(ax, STEPS, uniform_coefficients(STEPS, last=10), label="last 10 checkpoints (1/10 each)")
    staircase(ax, STEPS, uniform_coefficients(STEPS, from_step=50_000), label="from step 50k")
    ax.set_title("uniform averaging (fairseq / LAWA)\n1/k on the selection")

    ax = axes[1, 1]
    snaps = [Snapshot.from_sigma_rel(t, s) for t in range(4000, T + 1, 4000) for s in (0.05, 0.10)]
    for sigma in (0.07, 0.15, 0.03):
        plan = posthoc_plan(snaps, sigma_rel_to_gamma(sigma))
        recon = sum(c * power_profile(TAU, s.step, s.gamma) for c, s in zip(plan.coefficients, snaps, strict=True))
        label = f"σ_rel {sigma}: rel. L2 error {plan.rel_error:.1e}, cond {plan.condition:.1e}"
        ax.plot(TAU, recon, label=label)
        ax.plot(TAU, power_profile(TAU, T, plan.target_gamma), lw=1, ls="--", color="k")
    ax.set_title(
        f"post-hoc (EDM2) from {len(snaps)} snapshots\n"
        "σ_rel 0.05 and 0.10 every 4000 steps; x = A⁻¹b, Σx = 1"
    )

    for ax in axes.flat:
        ax.set_xlabel("training step τ")
        ax.set_ylabel("weight per step")
        ax.set_xlim(0, T * 1.01)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Averaging profiles at T = {T:,} (dashed: continuous profile or target)")
    out = Path(__file__).with_name("profiles.png")
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main()
