"""ema-ckpt: EMAs and averages of sharded PyTorch checkpoints, computed offline.

The whole library in twelve functions (each also a CLI command; the same options as keyword
arguments, results as dataclasses, errors as :class:`~ema_ckpt.errors.EmaCkptError`):

========================  ==================================================================
:func:`accumulate`        fold new checkpoints into running EMAs kept on disk (cron-safe)
:func:`watch`             fold each checkpoint as soon as it is complete (a sidecar; the callbacks' engine)
:func:`posthoc`           post-hoc power-function EMAs (EDM2) at any σ_rel, after training
:func:`average`           an average of a selection of checkpoints: uniform, or weighted by a decay schedule
:func:`select`            the best of many averages by the user's own evaluation (post-hoc EMAs, latest-K, soups)
:func:`consolidate`       any checkpoint → safetensors, the HF sharded layout, or a torch file
:func:`reshard`           any checkpoint → a DCP checkpoint laid out for N ranks
:func:`inspect`           what a checkpoint holds: format, step, keys, shapes, dtypes
:func:`inspect_folder`    what a folder of checkpoints holds: each entry taken (its step) or left, and why
:func:`verify`            check an output against its manifest (sizes, CRC-32s, loadability)
:func:`diff`              compare two checkpoints key by key, across formats
:func:`open_checkpoint`   a reader for any supported checkpoint (boxes of tensors on demand)
========================  ==================================================================

Example:
    >>> import ema_ckpt
    >>> result = ema_ckpt.accumulate("ckpts/", decay=0.999)              # doctest: +SKIP
    >>> ema_ckpt.consolidate(result.out, "ema.safetensors", dtype="bfloat16")  # doctest: +SKIP

Importing ``ema_ckpt`` is cheap: each function's module (and torch) loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .commands.accumulate import accumulate
    from .commands.averaging import average, posthoc
    from .commands.consolidate import consolidate
    from .commands.diff import diff
    from .commands.inspect import inspect_checkpoint as inspect
    from .commands.inspect import inspect_folder
    from .commands.reshard import reshard
    from .commands.select import select
    from .commands.verify import verify
    from .formats import open_checkpoint
    from .watching import watch

_PUBLIC = {
    "accumulate": ("ema_ckpt.commands.accumulate", "accumulate"),
    "posthoc": ("ema_ckpt.commands.averaging", "posthoc"),
    "average": ("ema_ckpt.commands.averaging", "average"),
    "select": ("ema_ckpt.commands.select", "select"),
    "consolidate": ("ema_ckpt.commands.consolidate", "consolidate"),
    "reshard": ("ema_ckpt.commands.reshard", "reshard"),
    "inspect": ("ema_ckpt.commands.inspect", "inspect_checkpoint"),
    "inspect_folder": ("ema_ckpt.commands.inspect", "inspect_folder"),
    "verify": ("ema_ckpt.commands.verify", "verify"),
    "diff": ("ema_ckpt.commands.diff", "diff"),
    "open_checkpoint": ("ema_ckpt.formats", "open_checkpoint"),
    "watch": ("ema_ckpt.watching", "watch"),
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ema_ckpt' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = ["__version__", "accumulate", "average", "consolidate", "diff", "inspect", "inspect_folder",
           "open_checkpoint", "posthoc", "reshard", "select", "verify", "watch"]
