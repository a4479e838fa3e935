"""Compatibility names: the planner now lives in :mod:`ema_ckpt.maths` and :mod:`ema_ckpt.profile_specs`.

Every name here is the same object as the one in its new module.
"""

from __future__ import annotations

from .maths import (
    GAMMA_MAX,
    SIGMA_REL_MAX,
    SIGMA_REL_MIN,
    PlanStats,
    PosthocPlan,
    Snapshot,
    check_gamma,
    describe_plan,
    effective_half_life,
    equivalent_step_decay,
    exponential_coefficients,
    exponential_window,
    gamma_to_sigma_rel,
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
from .profile_specs import parse_sigma_list

__all__ = [
    "GAMMA_MAX",
    "SIGMA_REL_MAX",
    "SIGMA_REL_MIN",
    "PlanStats",
    "PosthocPlan",
    "Snapshot",
    "check_gamma",
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
