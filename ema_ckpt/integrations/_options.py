"""The training callbacks' options: :func:`ema_ckpt.accumulate`'s, checked before training starts.

Example:
    >>> callback_options(decay=0.999, half_life=None, sigma_rel=None, gamma=None, snapshot_every=None,
    ...                  warmup=False, per_checkpoint=False, dtype="float32", more={})
    {'dtype': 'float32', 'decay': 0.999}
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from ..errors import OptionError, UsageError

_NOT_OPTIONS = {"checkpoints", "out", "on_progress", "dry_run", "workers", "device", "wait_seconds"}
""":func:`~ema_ckpt.accumulate` parameters that a callback sets itself, or that are not options."""


def _accumulate_options() -> set[str]:
    from ..commands.accumulate import accumulate

    return set(inspect.signature(accumulate).parameters) - _NOT_OPTIONS


def _as_texts(value: float | str | list[Any] | tuple[Any, ...]) -> list[str]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [str(item) for item in items]


def callback_options(*, decay: float | None, half_life: float | None, sigma_rel: Any, gamma: Any,
                  snapshot_every: int | None, warmup: bool, per_checkpoint: bool, dtype: str,
                  more: dict[str, Any]) -> dict[str, Any]:
    """:func:`ema_ckpt.accumulate`'s options from the callback's arguments, checked now."""
    given = [name for name, value in (("decay", decay), ("half_life", half_life), ("sigma_rel", sigma_rel),
                                      ("gamma", gamma)) if value is not None]
    if len(given) != 1:
        raise UsageError("EmaCkptCallback needs exactly one profile: decay=, half_life=, sigma_rel= or gamma= "
                         f"(got {', '.join(given) or 'none'})")
    options: dict[str, Any] = {"dtype": dtype}
    if decay is not None:
        if not 0.0 < float(decay) < 1.0:
            raise OptionError("decay", f"must be above 0 and below 1, got {decay}", value=decay)
        options["decay"] = float(decay)
    if half_life is not None:
        if not float(half_life) > 0.0:
            raise OptionError("half_life", f"must be a number of steps above 0, got {half_life}", value=half_life)
        options["half_life"] = float(half_life)
    if sigma_rel is not None or gamma is not None:
        from ..profile_specs import power_profiles

        sigma_rels = _as_texts(sigma_rel) if sigma_rel is not None else []
        gammas = _as_texts(gamma) if gamma is not None else []
        power_profiles(sigma_rels, gammas)  # raises OptionError on a bad value
        if sigma_rels:
            options["sigma_rels"] = sigma_rels
        if gammas:
            options["gammas"] = gammas
    elif snapshot_every is not None:
        raise OptionError("snapshot_every", "is for power EMAs: give sigma_rel= or gamma= with it",
                          value=snapshot_every)
    if snapshot_every is not None:
        if not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise OptionError("snapshot_every", f"must be a whole number of steps above 0, got {snapshot_every}",
                              value=snapshot_every)
        options["snapshot_every"] = snapshot_every
    if dtype not in ("float32", "float64"):
        raise OptionError("dtype", f"must be 'float32' or 'float64', got {dtype!r}", value=dtype)
    if warmup:
        options["warmup"] = True
    if per_checkpoint:
        options["per_checkpoint"] = True
    known = _accumulate_options()
    for name, value in more.items():
        if name not in known or name in options or name in ("sigma_rels", "gammas"):
            raise OptionError(name, "is not an option of EmaCkptCallback (see ema_ckpt.accumulate's options)",
                              value=value)
        if isinstance(value, tuple):
            value = list(value)
        options[name] = value
    from ..commands.accumulate import AccumulateOptions

    try:  # accumulate's own checks too, on a stand-in folder (the checkpoints come later)
        typed: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        AccumulateOptions((Path(os.curdir),), **typed)
    except TypeError as err:
        raise UsageError(f"EmaCkptCallback: {err}") from None
    return options


__all__ = ["callback_options"]
