"""Compatibility names: the kept EMAs' maths now lives in :mod:`ema_ckpt.maths`.

Every name here is the same object as the one in its new module.
"""

from __future__ import annotations

from .maths.exponential import ExponentialProfile, fold_coefficients
from .maths.power import PowerProfile
from .maths.profiles import profile_from_dict

__all__ = ["ExponentialProfile", "PowerProfile", "fold_coefficients", "profile_from_dict"]
