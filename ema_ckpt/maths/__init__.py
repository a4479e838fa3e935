"""Pure float64 maths of ema-ckpt: every output is Σ cᵢ·θᵢ, with the cᵢ computed here.

Arithmetic on steps and profile parameters only: no I/O, no tensors, no command-line names.
Time is the optimizer step counted from the start of training (step 0). Every coefficient
function returns one coefficient per input, in input order, with 0.0 for inputs it does not
use (checkpoints after ``at_step``, checkpoints outside a uniform selection).

Modules, one family each (formulas in ``docs/math.md`` and ``docs/profiles.md``):

* :mod:`.exponential`: the classic EMA across gaps (per step, per checkpoint, warm-up);
* :mod:`.power`: the EDM2 power-function EMA, σ_rel ↔ γ, its decay and closed form;
* :mod:`.uniform`: plain averaging (fairseq / LAWA);
* :mod:`.merge_weights`: merge weights from a decay schedule (WSM, Megatron-LM ``weighted_merge``);
* :mod:`.posthoc`: EDM2 post-hoc reconstruction from power-EMA snapshots;
* :mod:`.stats`: what a plan amounts to, and the sparse-spacing warning;
* :mod:`.profiles`: the kept profiles as manifests record them.

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
