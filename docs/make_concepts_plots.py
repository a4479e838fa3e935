"""Draw the figures of ``docs/concepts.md`` from ``ema_ckpt.maths``.

Writes ``docs/gaps.png``, ``docs/power.png`` and ``docs/posthoc.png``. Every curve is
computed by the library itself (the same functions ``--dry-run`` prints), so the figures
show what ema-ckpt does, not a re-derivation.

With "hold" semantics checkpoint i stands for the steps (tᵢ₋₁, tᵢ], so a plan's weight per
training step is cᵢ/(tᵢ − tᵢ₋₁): the staircases below. Dashed curves are the continuous
profiles the plans approximate.

Run:  .venv/bin/python docs/make_concepts_plots.py   (needs matplotlib: pip install matplotlib)
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from make_profiles_plot import power_profile, staircase  # beside this script

from ema_ckpt.maths import (
    ExponentialProfile,
    Snapshot,
    describe_plan,
    equivalent_step_decay,
    exponential_coefficients,
    exponential_window,
    gamma_to_sigma_rel,
    posthoc_plan,
    power_coefficients,
    sigma_rel_to_gamma,
    spacing_warning,
)

HERE = Path(__file__).resolve().parent
DPI = 90


def exponential_density(tau, beta, t):
    """The per-step weight of an EMA updated at every step, at step t: −ln β · β^(t−τ)."""
    return np.where(tau <= t, -math.log(beta) * beta ** (t - tau), 0.0)


def _save(fig: plt.Figure, name: str) -> Path:
    out = HERE / name
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def gaps() -> Path:
    """Classic EMA across irregular gaps: per-step decay vs per-checkpoint decay; spacing."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)

    ax = axes[0]
    steps = [1000, 2000, 3000, 3500, 4000, 4500, 7000, 7500, 8000, 9500, 10000]
    beta = 0.9995
    tau = np.linspace(0, steps[-1], 2001)
    per_step = ExponentialProfile(beta)
    staircase(ax, steps, exponential_coefficients(steps, per_step), lw=2,
              label=f"--decay {beta} (per step): β^gap across each gap")
    # the per-checkpoint decay that has the same mean window over these checkpoints
    mean_gap = (steps[-1] - steps[0]) / (len(steps) - 1)
    beta_ckpt = beta ** mean_gap
    per_ckpt = ExponentialProfile(beta_ckpt, per_checkpoint=True)
    assert abs(equivalent_step_decay(steps, per_ckpt) - beta) < 1e-12
    staircase(ax, steps, exponential_coefficients(steps, per_ckpt), lw=1.5, ls="-.",
              label=f"--decay {beta_ckpt:.3f} --per-checkpoint: β whatever the gap")
    ax.plot(tau, exponential_density(tau, beta, steps[-1]), lw=1, ls="--", color="k",
            label="EMA updated at every step")
    for s in steps:
        ax.axvline(s, color="0.85", lw=0.6, zorder=0)
    ax.set_title("irregular checkpoints (grey lines), same mean window\n"
                 "per-step decay follows the every-step EMA; per-checkpoint decay does not")
    ax.set_xlim(0, steps[-1] * 1.01)

    ax = axes[1]
    beta = 0.999
    profile = ExponentialProfile(beta)
    t_end = 10_000
    tau = np.linspace(0, t_end, 4001)
    for every in (40, 1000):
        s = list(range(every, t_end + 1, every))
        stats = describe_plan(s, exponential_coefficients(s, profile), profile=profile)
        warned = spacing_warning(s, exponential_window(s, profile)) is not None
        staircase(ax, s, exponential_coefficients(s, profile), lw=1.5,
                  label=f"checkpoint every {every} steps: N_eff {stats.n_eff:.1f}"
                        + (" (spacing warning)" if warned else ""))
    ax.plot(tau, exponential_density(tau, beta, t_end), lw=1, ls="--", color="k",
            label="EMA updated at every step")
    ax.set_xlim(6000, t_end * 1.002)
    ax.set_title(f"spacing: --decay {beta} (window 1/(1−β) = {1 / (1 - beta):.0f} steps)\n"
                 "gaps above window/20 turn the EMA into a coarse average")

    for ax in axes:
        ax.set_xlabel("training step τ")
        ax.set_ylabel("weight per step")
        ax.legend(fontsize=8, loc="upper left")
    return _save(fig, "gaps.png")


def power() -> Path:
    """Power EMAs: the window grows with training; σ_rel ↔ γ."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)

    ax = axes[0]
    sigma = 0.10
    gamma = sigma_rel_to_gamma(sigma)
    t_max = 100_000
    every = 1000
    steps = list(range(every, t_max + 1, every))
    tau = np.linspace(0, t_max, 4001)
    for t in (25_000, 50_000, 100_000):
        coeffs = power_coefficients(steps, gamma, at_step=t)
        staircase(ax, steps, coeffs, lw=1.5, label=f"σ_rel {sigma} at T = {t:,}: window σ_rel·T = {sigma * t:,.0f}")
        ax.plot(tau, power_profile(tau, t, gamma), lw=1, ls="--", color="k")
    beta = 1.0 - 1.0 / (sigma * t_max)
    coeffs = exponential_coefficients(steps, ExponentialProfile(beta))
    staircase(ax, steps, coeffs, lw=1, color="0.5",
              label=f"classic EMA β = {beta:.4f} (same width at T = {t_max:,} only)")
    ax.set_xlim(0, t_max * 1.01)
    ax.set_xlabel("training step τ")
    ax.set_ylabel("weight per step")
    ax.set_title(f"power EMA, σ_rel {sigma} (γ = {gamma:.2f}), checkpoints every {every} steps\n"
                 "its window is a fixed fraction of training so far")
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1]
    gammas = np.geomspace(0.05, 300, 400)
    ax.plot(gammas, [gamma_to_sigma_rel(g) for g in gammas], color="k", lw=1.5)
    for s in (0.01, 0.05, 0.10, 0.20):
        g = sigma_rel_to_gamma(s)
        ax.plot([g], [s], "o")
        ax.annotate(f"σ_rel {s} ↔ γ {g:.2f}", (g, s), textcoords="offset points", xytext=(8, 4), fontsize=9)
    ax.axhline(1 / math.sqrt(12), color="0.6", ls=":", lw=1, label="1/√12 (γ = 0): the plain mean of all training")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("γ (--gamma)")
    ax.set_ylabel("σ_rel (--sigma-rel)")
    ax.set_title("σ_rel(γ) = sqrt((γ+1) / ((γ+2)²(γ+3)))")
    return _save(fig, "power.png")


def posthoc() -> Path:
    """Post-hoc reconstruction from σ_rel 0.05 / 0.10 snapshots: coefficients and error."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    t_end = 100_000
    stored = (0.05, 0.10)

    ax = axes[0]
    every = 5000
    snaps = [Snapshot.from_sigma_rel(t, s) for t in range(every, t_end + 1, every) for s in stored]
    for target, color in ((0.07, "C0"), (0.03, "C3")):
        plan = posthoc_plan(snaps, sigma_rel_to_gamma(target))
        for s, marker in zip(stored, ("o", "s"), strict=True):
            idx = [i for i, snap in enumerate(snaps) if abs(snap.sigma_rel - s) < 1e-9]
            ax.plot([snaps[i].step for i in idx], [plan.coefficients[i] for i in idx], marker=marker,
                    ls="-", lw=0.8, ms=5, color=color, mfc="none" if s == stored[1] else color,
                    label=f"target {target}, weights on the σ_rel {s} snapshots")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("snapshot step")
    ax.set_ylabel("coefficient xᵢ")
    ax.set_title(f"coefficients over {len(snaps)} snapshots (every {every:,} steps)\n"
                 "Σx = 1; negative entries are normal, large ones mean extrapolation")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_xlim(t_end * 0.5, t_end * 1.02)

    ax = axes[1]
    targets = np.linspace(0.015, 0.28, 300)
    for count in (10, 20, 50, 100):
        every = t_end // count
        snaps = [Snapshot.from_sigma_rel(t, s) for t in range(every, t_end + 1, every) for s in stored]
        errors = [max(posthoc_plan(snaps, sigma_rel_to_gamma(x)).rel_error, 1e-6) for x in targets]
        ax.plot(targets, errors, label=f"snapshot every {every:,} steps ({count} of each)")
    for s in stored:
        ax.axvline(s, color="0.6", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_ylim(1e-6, 1)
    ax.set_xlabel("target σ_rel")
    ax.set_ylabel("relative L2 error of the profile fit")
    ax.set_title(f"fit error at T = {t_end:,} (dotted: the stored σ_rel)\n"
                 "between them the fit is close; below 0.05 it degrades fast")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, "posthoc.png")


def main() -> None:
    for draw in (gaps, power, posthoc):
        print(draw())


if __name__ == "__main__":
    main()
