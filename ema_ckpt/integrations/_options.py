"""The training callbacks' options: :func:`ema_ckpt.accumulate`'s, checked before training starts.

Example:
    >>> callback_options(decay=0.999, half_life=None, sigma_rel=None, gamma=None, snapshot_every=None,
    ...                  warmup=False, per_checkpoint=False, dtype="float32", more={})
    {'dtype': 'float32', 'decay': 0.999}
"""

from __future__ import annotations

import inspect
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
    """:func:`ema_ckpt.accumulate`'s options from the callback's arguments, checked now by
    accumulate's own rules (the checkpoints come later)."""
    given = [name for name, value in (("decay", decay), ("half_life", half_life), ("sigma_rel", sigma_rel),
                                      ("gamma", gamma)) if value is not None]
    if len(given) != 1:
        raise UsageError("EmaCkptCallback needs exactly one profile: decay=, half_life=, sigma_rel= or gamma= "
                         f"(got {', '.join(given) or 'none'})")
    options: dict[str, Any] = {"dtype": dtype}
    profile = {"decay": decay, "half_life": half_life, "snapshot_every": snapshot_every,
               "sigma_rels": None if sigma_rel is None else _as_texts(sigma_rel),
               "gammas": None if gamma is None else _as_texts(gamma),
               "warmup": warmup or None, "per_checkpoint": per_checkpoint or None}
    options.update({name: value for name, value in profile.items() if value is not None})
    known = _accumulate_options()
    for name, value in more.items():
        if name not in known or name in options or name in ("sigma_rels", "gammas"):
            raise OptionError(name, "is not an option of EmaCkptCallback (see ema_ckpt.accumulate's options)",
                              value=value)
        options[name] = list(value) if isinstance(value, tuple) else value
    from ..commands.accumulate import AccumulateOptions
    from ..options import command_options

    try:
        AccumulateOptions(**command_options({"checkpoints": (), **options}))
    except TypeError as err:
        raise UsageError(f"EmaCkptCallback: {err}") from None
    return options


__all__ = ["callback_options"]
