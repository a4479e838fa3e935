"""The training callbacks' options: :func:`ema_ckpt.accumulate`'s, checked before training starts.

Example:
    >>> callback_options({"decay": 0.999, "half_life": None, "sigma_rel": None, "gamma": None, "include": ()})
    {'decay': 0.999, 'include': []}
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..watching import fold_options

_NOT_OPTIONS = {"self", "__class__", "out", "strict", "folder"}
"""A callback's own arguments, beside accumulate's options."""


def callback_options(args: dict[str, Any]) -> dict[str, Any]:
    """:func:`ema_ckpt.accumulate`'s options from a callback's arguments (``sigma_rel`` and ``gamma``
    one value or several), as JSON for the fold worker, checked now by accumulate's own rules."""
    given = [name for name in ("decay", "half_life", "sigma_rel", "gamma") if args[name] is not None]
    if len(given) != 1:
        raise UsageError("EmaCkptCallback needs exactly one profile: decay=, half_life=, sigma_rel= or gamma= "
                         f"(got {', '.join(given) or 'none'})")
    options: dict[str, Any] = {}
    for name, value in args.items():
        if name in ("sigma_rel", "gamma") and value is not None:
            options[name + "s"] = [str(item) for item in (value if isinstance(value, (list, tuple)) else [value])]
        elif name not in _NOT_OPTIONS and value is not None:
            options[name] = list(value) if isinstance(value, (list, tuple)) else value
    fold_options(options)
    return options


__all__ = ["callback_options"]
