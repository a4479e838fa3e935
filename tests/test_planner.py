"""The pure coefficient planner: sums, closed forms against recursions, post-hoc against quadrature."""

from __future__ import annotations

import doctest
import importlib
import math
from decimal import Decimal, localcontext
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ema_ckpt.errors import OptionError, UsageError
from ema_ckpt.maths import (
    SIGMA_REL_MAX,
    ExponentialProfile,
    PowerProfile,
    Snapshot,
    describe_plan,
    effective_half_life,
    exponential_coefficients,
    exponential_window,
    fold_coefficients,
    gamma_to_sigma_rel,
    log_power_keep,
    posthoc_coefficients,
    posthoc_plan,
    power_coefficients,
    power_update_ratio,
    power_update_weight,
    power_window,
    profile_inner_product,
    sigma_rel_to_gamma,
    spacing_warning,
    uniform_coefficients,
    uniform_selection,
)
from ema_ckpt.profile_specs import parse_sigma_list

step_lists = st.lists(st.integers(0, 2_000_000), min_size=1, max_size=40, unique=True).map(sorted)
positive_step_lists = st.lists(st.integers(1, 2_000_000), min_size=1, max_size=40, unique=True).map(sorted)


MATHS_MODULES = [
    "ema_ckpt.maths", "ema_ckpt.maths.exponential", "ema_ckpt.maths.power", "ema_ckpt.maths.uniform",
    "ema_ckpt.maths.posthoc", "ema_ckpt.maths.stats", "ema_ckpt.maths.profiles", "ema_ckpt.profile_specs",
]


def test_doctests():
    attempted = 0
    for name in MATHS_MODULES:
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
        attempted += result.attempted
    assert attempted > 40


# --------------------------------------------------------------------------- σ_rel ↔ γ


def test_paper_pairs():
    assert round(sigma_rel_to_gamma(0.05), 2) == 16.97
    assert round(sigma_rel_to_gamma(0.10), 2) == 6.94
    assert round(gamma_to_sigma_rel(16.97), 2) == 0.05
    assert round(gamma_to_sigma_rel(6.94), 2) == 0.10
    assert gamma_to_sigma_rel(0.0) == pytest.approx(SIGMA_REL_MAX, rel=1e-15)


@given(st.floats(1e-3, 0.28))
def test_sigma_gamma_round_trip(sigma):
    gamma = sigma_rel_to_gamma(sigma)
    assert gamma > 0
    assert gamma_to_sigma_rel(gamma) == pytest.approx(sigma, rel=1e-12)


@given(st.floats(0.01, 500.0))
def test_gamma_sigma_round_trip(gamma):
    assert sigma_rel_to_gamma(gamma_to_sigma_rel(gamma)) == pytest.approx(gamma, rel=1e-9)


@pytest.mark.parametrize("bad", [0.0, -0.05, SIGMA_REL_MAX, 0.3, 1.0, math.nan, math.inf, "x"])
def test_sigma_rel_out_of_range_is_refused(bad):
    with pytest.raises(OptionError, match=r"^sigma_rel ") as info:
        sigma_rel_to_gamma(bad)
    assert info.value.option == "sigma_rel" and info.value.value is bad


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_bad_gamma_is_refused(bad):
    with pytest.raises(UsageError):
        gamma_to_sigma_rel(bad)
    with pytest.raises(UsageError):
        power_coefficients([10, 20], bad)


# --------------------------------------------------------------------------- sums to one


@given(positive_step_lists, st.floats(0.0, 120.0))
def test_power_coefficients_sum_to_one(steps, gamma):
    c = power_coefficients(steps, gamma)
    assert math.fsum(c) == pytest.approx(1.0, abs=1e-12)
    assert all(v >= 0 for v in c)


@given(
    step_lists,
    st.floats(0.5, 0.99999),
    st.sampled_from(["step", "checkpoint", "warmup"]),
)
def test_exponential_coefficients_sum_to_one(steps, beta, kind):
    profile = ExponentialProfile(beta, per_checkpoint=kind == "checkpoint", warmup=kind == "warmup")
    c = exponential_coefficients(steps, profile)
    assert math.fsum(c) == pytest.approx(1.0, abs=1e-12)
    assert all(v >= 0 for v in c)


@given(step_lists, st.integers(1, 50))
def test_uniform_coefficients_sum_to_one(steps, last):
    c = uniform_coefficients(steps, last=last)
    assert math.fsum(c) == pytest.approx(1.0, abs=1e-12)
    assert sum(v > 0 for v in c) == min(last, len(steps))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 100_000), min_size=1, max_size=12, unique=True),
    st.lists(st.floats(0.03, 0.2), min_size=1, max_size=2),
    st.floats(0.03, 0.25),
)
def test_posthoc_coefficients_sum_to_one(steps, sigmas, target):
    snaps = [Snapshot.from_sigma_rel(t, s) for t in steps for s in sigmas]
    c = posthoc_coefficients(snaps, sigma_rel_to_gamma(target))
    assert math.fsum(c) == pytest.approx(1.0, abs=1e-9)


# --------------------------------------------------------------------------- power EMA


def _hold(trajectory: np.ndarray, steps: list[int]) -> np.ndarray:
    """Per-step values (steps 1…T): the value at step τ is that of the next checkpoint."""
    values = np.empty(steps[-1] + 1)
    prev = 0
    for t, x in zip(steps, trajectory, strict=False):
        values[prev + 1 : t + 1] = x
        prev = t
    values[0] = trajectory[0]
    return values


@pytest.mark.parametrize("gamma", [0.0, 1.0, sigma_rel_to_gamma(0.10), sigma_rel_to_gamma(0.05), 60.0])
def test_power_closed_form_matches_incremental_and_per_step_recursions(gamma):
    rng = np.random.default_rng(0)
    steps = sorted(rng.choice(np.arange(1, 3000), size=25, replace=False).tolist())
    theta = np.cumsum(rng.normal(size=len(steps)))  # a random-walk trajectory of scalars

    closed = float(np.dot(power_coefficients(steps, gamma), theta))

    acc, prev = 0.0, 0
    for t, x in zip(steps, theta, strict=False):
        r = power_update_ratio(prev, t, gamma)
        assert 1.0 - r == pytest.approx(power_update_weight(prev, t, gamma), rel=1e-12, abs=1e-300)
        acc = r * acc + (1.0 - r) * x
        prev = t

    held = _hold(theta, steps)
    per_step = 0.0
    for t in range(1, steps[-1] + 1):
        beta_t = (1.0 - 1.0 / t) ** (gamma + 1.0)  # β₁ = 0: the first update replaces
        per_step = beta_t * per_step + (1.0 - beta_t) * held[t]

    assert acc == pytest.approx(closed, rel=1e-12, abs=1e-12)
    assert per_step == pytest.approx(closed, rel=1e-9, abs=1e-9)


def test_power_coefficients_are_profile_masses_and_scale_free():
    c = power_coefficients([100, 200, 400], 2.0)
    assert c == pytest.approx([(1 / 4) ** 3, (1 / 2) ** 3 - (1 / 4) ** 3, 1 - (1 / 2) ** 3], rel=1e-14)
    assert power_coefficients([1, 2, 4], 2.0) == pytest.approx(c, rel=1e-14)


def test_power_coefficients_large_gamma_and_small_gaps():
    steps = [10**9 - 3, 10**9 - 2, 10**9 - 1, 10**9]
    c = power_coefficients(steps, 100.0)  # raw powers would overflow: (1e9)^101
    assert all(math.isfinite(v) for v in c)
    assert math.fsum(c) == pytest.approx(1.0, abs=1e-12)
    assert c[-1] == pytest.approx(101e-9, rel=1e-6)  # no cancellation: 1 − (1 − 1e-9)^101


def test_power_at_step_uses_newest_checkpoint_at_or_before():
    steps = [100, 200, 300]
    assert power_coefficients(steps, 1.0, at_step=250) == [*power_coefficients([100, 200], 1.0), 0.0]
    assert power_coefficients(steps, 1.0, at_step=300) == power_coefficients(steps, 1.0)
    # never labelled a step it is not
    with pytest.raises(OptionError, match="after the newest checkpoint") as info:
        power_coefficients(steps, 1.0, at_step=10**6)
    assert info.value.option == "at_step" and info.value.value == 10**6
    with pytest.raises(OptionError, match=r"^at_step 99 is before the first checkpoint \(step 100\)$"):
        power_coefficients(steps, 1.0, at_step=99)


def test_power_checkpoint_at_step_zero_gets_zero_weight():
    assert power_coefficients([0, 10], 3.0) == [0.0, 1.0]
    with pytest.raises(UsageError):
        power_coefficients([0], 3.0)


@pytest.mark.parametrize("steps", [[], [5, 5], [7, 3], [-1, 2], [1.5, 3], [True, 3]])
def test_bad_step_lists_are_refused(steps):
    with pytest.raises(UsageError):
        power_coefficients(steps, 1.0)


# --------------------------------------------------------------------------- classic EMA


def test_exponential_matches_the_closed_form_with_gaps():
    beta, steps = 0.99, [3, 7, 20, 21, 30]
    c = exponential_coefficients(steps, ExponentialProfile(beta))
    big_t = steps[-1]
    expected = [beta ** (big_t - steps[0])] + [
        beta ** (big_t - t) * (1 - beta ** (t - s)) for s, t in pairwise(steps)
    ]
    assert c == pytest.approx(expected, rel=1e-12)


def test_exponential_at_step_and_half_life():
    p = ExponentialProfile(0.9)
    assert exponential_coefficients([1, 2, 5], p, at_step=4) == [*exponential_coefficients([1, 2], p), 0.0]
    assert effective_half_life([0, 10], ExponentialProfile.from_half_life(693.0)) == pytest.approx(693.0)
    per_ckpt = ExponentialProfile(0.999, per_checkpoint=True)
    assert effective_half_life([0, 50, 100], per_ckpt) == pytest.approx(50 * math.log(2) / -math.log(0.999))
    assert exponential_window([0, 10], ExponentialProfile(0.999)) == pytest.approx(1000.0)
    warm = ExponentialProfile(0.9999, warmup=True)
    assert effective_half_life([0, 90], warm) == pytest.approx(math.log(2) / -math.log(91 / 100))


# --------------------------------------------------------------------------- uniform


def test_uniform_selections():
    steps = [10, 20, 30, 40, 50]
    assert uniform_selection(steps) == [0, 1, 2, 3, 4]
    assert uniform_selection(steps, last=2) == [3, 4]
    assert uniform_selection(steps, from_step=20, to_step=40) == [1, 2, 3]
    assert uniform_selection(steps, from_step=15, to_step=45, last=2) == [2, 3]
    assert uniform_coefficients(steps, from_step=50) == [0.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [{"from_step": 60}, {"to_step": 5}, {"from_step": 21, "to_step": 29}, {"from_step": 40, "to_step": 20},
     {"last": 0}, {"last": -1}],
)
def test_empty_uniform_selection_is_refused(kwargs):
    with pytest.raises(UsageError):
        uniform_coefficients([10, 20, 30, 40, 50], **kwargs)


# --------------------------------------------------------------------------- post-hoc


def _profile_on(grid: np.ndarray, t: float, gamma: float) -> np.ndarray:
    return np.where(grid <= t, (gamma + 1) * (grid / t) ** gamma / t, 0.0)


def _numeric_inner(ta: float, ga: float, tb: float, gb: float, n: int = 200_001) -> float:
    """Trapezoid rule on [0, min(ta, tb)], where both profiles are smooth (no jump inside)."""
    grid = np.linspace(0.0, min(ta, tb), n)
    return float(np.trapezoid(_profile_on(grid, ta, ga) * _profile_on(grid, tb, gb), grid))



@pytest.mark.parametrize(
    ("ta", "ga", "tb", "gb"),
    [(1.0, 0.0, 1.0, 0.0), (0.5, 3.0, 1.0, 7.0), (1.0, 7.0, 0.5, 3.0), (0.9, 16.97, 1.0, 6.94),
     (0.7, 6.94, 0.95, 16.97), (0.3, 40.0, 0.31, 2.0)],
)
def test_inner_product_matches_quadrature(ta, ga, tb, gb):
    numeric = _numeric_inner(ta, ga, tb, gb)
    assert profile_inner_product(ta, ga, tb, gb) == pytest.approx(numeric, rel=1e-5)
    # 1/t scaling: only ratios matter
    assert profile_inner_product(10 * ta, ga, 10 * tb, gb) == pytest.approx(numeric / 10, rel=1e-5)


def test_posthoc_solve_matches_quadrature():
    snaps = [Snapshot.from_sigma_rel(t, s) for t in (3000, 6000, 8000) for s in (0.05, 0.10)]
    target = sigma_rel_to_gamma(0.07)
    big_t = 8000
    a = np.array([[_numeric_inner(p.step, p.gamma, r.step, r.gamma) for r in snaps] for p in snaps])
    b = np.array([_numeric_inner(p.step, p.gamma, big_t, target) for p in snaps])
    for i, si in enumerate(snaps):
        assert b[i] == pytest.approx(profile_inner_product(si.step, si.gamma, big_t, target), rel=1e-5)
        for j, sj in enumerate(snaps):
            closed = profile_inner_product(si.step, si.gamma, sj.step, sj.gamma)
            assert a[i, j] == pytest.approx(closed, rel=1e-5)
    x = np.linalg.solve(a, b)
    x /= x.sum()

    plan = posthoc_plan(snaps, target)
    assert plan.solver == "solve"
    assert plan.coefficients == pytest.approx(x.tolist(), rel=1e-3, abs=1e-4)
    # the residual jumps at each snapshot step: integrate piece by piece between them
    knots = [0, 3000, 6000, 8000]
    total = norm = 0.0
    for lo, hi in pairwise(knots):
        grid = np.linspace(lo, hi, 100_001)
        # snapshot s covers this piece entirely when hi ≤ s.step, and not at all otherwise
        pieces = [(s.gamma + 1) * (grid / s.step) ** s.gamma / s.step * (hi <= s.step) for s in snaps]
        q = (target + 1) * (grid / big_t) ** target / big_t
        residual = sum(c * p for c, p in zip(plan.coefficients, pieces, strict=False)) - q
        total += np.trapezoid(residual**2, grid)
        norm += np.trapezoid(q**2, grid)
    numeric_error = math.sqrt(total / norm)
    assert plan.rel_error == pytest.approx(numeric_error, rel=1e-3)


def test_posthoc_reconstruction_between_snapshot_widths_is_accurate():
    snaps = [Snapshot.from_sigma_rel(k * 1000, s) for k in range(1, 33) for s in (0.05, 0.10)]
    plan = posthoc_plan(snaps, sigma_rel_to_gamma(0.07))
    assert plan.at_step == 32_000
    assert plan.rel_error < 2e-3
    assert plan.sigma_rel == pytest.approx(0.07, rel=1e-3)
    assert plan.mean_age == pytest.approx(32_000 / (sigma_rel_to_gamma(0.07) + 2), rel=1e-3)
    assert 1e3 < plan.condition < 1e8
    assert not plan.warnings
    assert math.fsum(plan.coefficients) == pytest.approx(1.0, abs=1e-12)


def test_posthoc_of_a_stored_profile_is_one_hot():
    snaps = [Snapshot.from_sigma_rel(k * 1000, s) for k in range(1, 9) for s in (0.05, 0.10)]
    index = 9  # step 5000, σ 0.10
    plan = posthoc_plan(snaps, snaps[index].gamma, at_step=snaps[index].step)
    expected = [0.0] * len(snaps)
    expected[index] = 1.0
    assert plan.coefficients == pytest.approx(expected, abs=1e-6)
    assert plan.used == list(range(10))  # later snapshots are not used
    assert plan.rel_error < 1e-6


def test_posthoc_extrapolation_warns_and_grows():
    snaps = [Snapshot.from_sigma_rel(k * 1000, s) for k in range(1, 17) for s in (0.05, 0.10)]
    plan = posthoc_plan(snaps, sigma_rel_to_gamma(0.02))
    assert any("narrower" in w for w in plan.warnings)
    assert max(abs(c) for c in plan.coefficients) > 2


def test_posthoc_singular_falls_back_to_lstsq():
    snaps = [Snapshot(1000, 5.0), Snapshot(1000, 5.0), Snapshot(2000, 5.0)]
    plan = posthoc_plan(snaps, 5.0)
    assert plan.solver == "lstsq"
    assert plan.coefficients[2] == pytest.approx(1.0, abs=1e-9)
    assert plan.rel_error < 1e-6


def test_posthoc_at_step_between_snapshots_and_refusals():
    snaps = [Snapshot(t, 6.94) for t in (1000, 2000, 3000)]
    plan = posthoc_plan(snaps, 6.94, at_step=2000)
    assert plan.at_step == 2000 and plan.used == [0, 1] and plan.coefficients[2] == 0.0
    assert math.fsum(plan.coefficients) == pytest.approx(1.0)
    # Off the snapshot grid the fit error is large (EDM2's reference refuses it): refused, not mislabelled.
    ends = "not a snapshot step; a post-hoc EMA ends at one: step 2000 or 3000"
    with pytest.raises(OptionError, match=ends) as info:
        posthoc_plan(snaps, 6.94, at_step=2500)
    assert info.value.option == "at_step" and info.value.value == 2500
    with pytest.raises(OptionError, match=r"^at_step 999 is before the first snapshot"):
        posthoc_plan(snaps, 6.94, at_step=999)
    with pytest.raises(UsageError):
        posthoc_plan([], 6.94)
    with pytest.raises(UsageError):
        Snapshot(0, 6.94)
    with pytest.raises(UsageError):
        Snapshot(10, -2.0)


# --------------------------------------------------------------------------- diagnostics


def test_describe_power_plan_approaches_the_profile_sigma():
    gamma = sigma_rel_to_gamma(0.10)
    steps = list(range(10, 100_001, 10))
    stats = describe_plan(steps, power_coefficients(steps, gamma))
    assert stats.total == pytest.approx(1.0)
    assert stats.sigma_rel == pytest.approx(0.10, rel=1e-3)
    assert stats.mean_age == pytest.approx(100_000 / (gamma + 2), rel=1e-3)
    assert stats.at_step == 100_000


def test_describe_exponential_plan():
    profile = ExponentialProfile(0.999)
    steps = list(range(0, 20_001, 100))
    stats = describe_plan(steps, exponential_coefficients(steps, profile), profile=profile)
    assert stats.half_life == pytest.approx(692.8, abs=0.1)
    assert stats.step_decay == 0.999
    assert stats.mean_age == pytest.approx(0.999 / 0.001, rel=0.06)  # hold: lags by ~k/2
    assert stats.n_eff > 1
    assert stats.max_abs == pytest.approx(1 - 0.999**100)


def test_describe_uniform_and_negative_plans():
    stats = describe_plan([1, 2, 3, 4], uniform_coefficients([1, 2, 3, 4]))
    assert stats.n_eff == pytest.approx(4.0)
    assert stats.mean_age == pytest.approx(1.5)
    neg = describe_plan([1, 2, 3], [-1.0, 1.0, 1.0])
    assert neg.total == 1.0 and neg.max_abs == 1.0 and neg.n_eff == pytest.approx(1 / 3)
    with pytest.raises(UsageError):
        describe_plan([1, 2], [1.0])
    with pytest.raises(UsageError):
        describe_plan([1, 2], [0.0, 0.0])


def test_spacing_warning():
    gamma = sigma_rel_to_gamma(0.05)
    window = power_window(gamma, 65_536)  # ≈ 3277 steps
    assert spacing_warning(list(range(0, 65_537, 128)), window) is None
    message = spacing_warning(list(range(0, 65_537, 256)), window)
    assert message is not None and "256 steps" in message
    classic = exponential_window([0, 1], ExponentialProfile(0.999))
    assert spacing_warning([0, 40, 80], classic) is None
    assert spacing_warning([0, 40, 200], classic) is not None
    assert spacing_warning([5], classic) is None


# --------------------------------------------------------------------------- σ_rel lists


def test_parse_sigma_list():
    assert parse_sigma_list("0.05,0.10") == [("0.05", 0.05), ("0.10", 0.10)]
    edm2 = parse_sigma_list("0.010:0.250:0.005")
    assert len(edm2) == 49
    assert edm2[0] == ("0.010", 0.01) and edm2[-1] == ("0.250", 0.25) and edm2[1] == ("0.015", 0.015)
    mixed = parse_sigma_list(" 0.05 , 0.1:0.2:0.05, 5e-3")
    assert [t for t, _ in mixed] == ["0.05", "0.10", "0.15", "0.20", "5e-3"]
    assert parse_sigma_list("0.1:0.12:0.03") == [("0.10", 0.1)]


@pytest.mark.parametrize(
    "text",
    ["", " ", "0.05,", "abc", "0.05,0.050", "0.3", "0", "-0.1", "nan", "inf", "0.1:0.2",
     "0.1:0.2:0", "0.2:0.1:0.01", "0.01:0.25:0.000001", "1_0", "0.05;0.1"],
)
def test_parse_sigma_list_refusals(text):
    with pytest.raises(OptionError, match=r"^sigma_rels[ :]") as info:
        parse_sigma_list(text)
    assert info.value.option == "sigma_rels" and info.value.value is not None


# --------------------------------------------------------------------------- one formula, float64 references

gap_pairs = st.tuples(st.integers(1, 10**12), st.integers(1, 10**6)).map(lambda p: (p[0], p[0] + p[1]))


def _exact_log_keep(t_prev: int, t_new: int, gamma: float) -> float:
    """(γ+1)·ln(t_prev/t_new) with 50 significant digits, rounded once to float64."""
    with localcontext() as ctx:
        ctx.prec = 50
        return float((Decimal(gamma) + 1) * (Decimal(t_prev) / Decimal(t_new)).ln())


@given(gap_pairs, st.floats(0.0, 1000.0))
def test_power_decay_is_within_a_few_ulps_of_the_exact_value(pair, gamma):
    t_prev, t_new = pair
    exact = _exact_log_keep(t_prev, t_new, gamma)
    assert log_power_keep(t_prev, t_new, gamma) == pytest.approx(exact, rel=1e-14, abs=1e-300)


@given(gap_pairs, st.floats(0.0, 1000.0))
def test_power_decay_agrees_with_the_plain_float64_formula(pair, gamma):
    """The log1p form and EDM2's (γ+1)·log(t_prev/t_new) agree; only the rounding of the ratio differs."""
    t_prev, t_new = pair
    plain = (gamma + 1.0) * math.log(t_prev / t_new)  # the ratio's rounding: up to (γ+1)·2⁻⁵³ absolute
    assert log_power_keep(t_prev, t_new, gamma) == pytest.approx(plain, rel=1e-12, abs=(gamma + 1.0) * 2e-16)


def test_power_decay_keeps_digits_the_ratio_form_loses():
    t_prev, t_new, gamma = 10**12, 10**12 + 1, 6.94
    exact = _exact_log_keep(t_prev, t_new, gamma)
    assert log_power_keep(t_prev, t_new, gamma) == pytest.approx(exact, rel=1e-15)
    assert abs((gamma + 1.0) * math.log(t_prev / t_new) / exact - 1) > 1e-6  # the ratio rounds first


def test_sigma_rel_matches_a_decimal_reference():
    with localcontext() as ctx:
        ctx.prec = 40
        for gamma in (0.0, 1.0, 6.94, 16.97, 97.0, 1e5):
            g = Decimal(gamma)
            exact = float(((g + 1) / ((g + 2) ** 2 * (g + 3))).sqrt())
            assert gamma_to_sigma_rel(gamma) == pytest.approx(exact, rel=1e-15)
            assert PowerProfile(gamma, "x").sigma_rel == gamma_to_sigma_rel(gamma)


@given(positive_step_lists, st.floats(0.0, 120.0))
def test_the_incremental_fold_equals_the_closed_form(steps, gamma):
    """accumulate folds with PowerProfile.update_weight; posthoc plans with power_coefficients."""
    profile = PowerProfile(gamma, "x")
    weights = [profile.update_weight(a, b) for a, b in zip([0, *steps[:-1]], steps, strict=True)]
    assert weights[0] == 1.0
    folded = fold_coefficients(weights)
    assert folded == pytest.approx(power_coefficients(steps, gamma), rel=1e-9, abs=1e-15)
    assert [power_update_weight(a, b, gamma) for a, b in zip([0, *steps[:-1]], steps, strict=True)] == weights


@given(step_lists, st.floats(0.5, 0.99999), st.sampled_from(["step", "checkpoint", "warmup"]))
def test_exponential_coefficients_are_the_fold_of_the_update_weights(steps, beta, kind):
    profile = ExponentialProfile(beta, per_checkpoint=kind == "checkpoint", warmup=kind == "warmup")
    weights = [1.0] + [profile.update_weight(a, b) for a, b in pairwise(steps)]
    assert exponential_coefficients(steps, profile) == fold_coefficients(weights)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 24), st.integers(100, 10_000), st.sampled_from([0, 1]), st.data())
def test_a_stored_profile_is_reconstructed_from_a_regular_grid(count, spacing, which, data):
    """Where the Gram matrix is well-conditioned, a snapshot's own profile comes back one-hot."""
    sigmas = (0.05, 0.10)
    snaps = [Snapshot.from_sigma_rel(k * spacing, s) for k in range(1, count + 1) for s in sigmas]
    index = data.draw(st.integers(0, count - 1)) * 2 + which
    plan = posthoc_plan(snaps, snaps[index].gamma, at_step=snaps[index].step)
    assert plan.condition < 1e10
    assert math.fsum(plan.coefficients) == pytest.approx(1.0, abs=1e-12)
    assert plan.coefficients[index] == pytest.approx(1.0, abs=1e-6)
    assert plan.rel_error < 1e-6
