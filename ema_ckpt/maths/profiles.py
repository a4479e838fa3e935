"""The profiles an ``accumulate`` output keeps, and how manifests record them.

Example:
    >>> profile_from_dict(ExponentialProfile(0.999, warmup=True).to_dict())
    ExponentialProfile(decay=0.999, per_checkpoint=False, warmup=True)
"""

from __future__ import annotations

from typing import Any, TypeAlias

from .exponential import ExponentialProfile
from .power import PowerProfile

__all__ = ["Profile", "profile_from_dict"]

Profile: TypeAlias = ExponentialProfile | PowerProfile
"""A kept EMA: classic (exponential) or power-function."""


def profile_from_dict(data: dict[str, Any]) -> Profile:
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
