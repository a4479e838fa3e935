"""Pure float64 maths of ema-ckpt: every output is Σ cᵢ·θᵢ, with the cᵢ computed here.

No I/O, no tensors, no command-line names; time is the optimizer step from the start of
training. Every coefficient function returns one coefficient per input, in input order, 0.0
for inputs it does not use. One formula family per module (``docs/math.md``).

Example:
    >>> from ema_ckpt.maths import power_coefficients, sigma_rel_to_gamma
    >>> [round(c, 4) for c in power_coefficients([100, 200], gamma=1.0)]
    [0.25, 0.75]
    >>> round(sigma_rel_to_gamma(0.10), 2)
    6.94
"""

from __future__ import annotations

from .exponential import (
    ExponentialProfile,
    effective_half_life,
    equivalent_step_decay,
    exponential_coefficients,
    exponential_window,
    fold_coefficients,
)
from .merge_weights import NAMED_SCHEDULES, coefficients_from_decay, rate_schedule_weights, schedule_weights
from .posthoc import PosthocPlan, Snapshot, posthoc_coefficients, posthoc_plan, profile_inner_product
from .power import (
    GAMMA_MAX,
    SIGMA_REL_MAX,
    SIGMA_REL_MIN,
    PowerProfile,
    check_gamma,
    check_sigma_rel,
    gamma_to_sigma_rel,
    log_power_keep,
    power_coefficients,
    power_update_ratio,
    power_update_weight,
    power_window,
    sigma_rel_to_gamma,
)
from .profiles import Profile, profile_from_dict
from .stats import PlanStats, SparseCheckpoints, describe_plan, spacing_warning, sparse_checkpoints
from .uniform import uniform_coefficients, uniform_selection

__all__ = [
    "GAMMA_MAX",
    "NAMED_SCHEDULES",
    "SIGMA_REL_MAX",
    "SIGMA_REL_MIN",
    "ExponentialProfile",
    "PlanStats",
    "PosthocPlan",
    "PowerProfile",
    "Profile",
    "Snapshot",
    "SparseCheckpoints",
    "check_gamma",
    "check_sigma_rel",
    "coefficients_from_decay",
    "describe_plan",
    "effective_half_life",
    "equivalent_step_decay",
    "exponential_coefficients",
    "exponential_window",
    "fold_coefficients",
    "gamma_to_sigma_rel",
    "log_power_keep",
    "posthoc_coefficients",
    "posthoc_plan",
    "power_coefficients",
    "power_update_ratio",
    "power_update_weight",
    "power_window",
    "profile_from_dict",
    "profile_inner_product",
    "rate_schedule_weights",
    "schedule_weights",
    "sigma_rel_to_gamma",
    "spacing_warning",
    "sparse_checkpoints",
    "uniform_coefficients",
    "uniform_selection",
]
