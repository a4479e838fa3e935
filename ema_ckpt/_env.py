"""Settings read from the environment (``EMA_CKPT_*``), each refused in one line when malformed.

Example:
    >>> seconds("EMA_CKPT_LOCK_LEASE", 60.0, {})
    60.0
    >>> whole_number("EMA_CKPT_REMOTE_CONCURRENCY", 8, "requests", {"EMA_CKPT_REMOTE_CONCURRENCY": "4"})
    4
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from .errors import OptionError, UsageError

_N = TypeVar("_N", int, float)


def seconds(variable: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """A number of seconds above 0 (``default`` when unset)."""
    return _setting(variable, default, env, float, lambda v: 0 < v < 1e7, "a number of seconds above 0")


def whole_number(variable: str, default: int, what: str, env: Mapping[str, str] | None = None) -> int:
    """A whole number of ``what`` (``"requests"``, ``"MiB"``), at least 1 (``default`` when unset)."""
    return _setting(variable, default, env, int, lambda v: v >= 1, f"a whole number of {what}, at least 1")


def _setting(variable: str, default: _N, env: Mapping[str, str] | None, parse: Callable[[str], _N],
             ok: Callable[[_N], bool], wanted: str) -> _N:
    text = (os.environ if env is None else env).get(variable, "").strip()
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise OptionError(variable, f"must be {wanted}, got {text!r}", value=text)
    return value


def check_working_directory() -> None:
    """Refuse to start where torch cannot load: a working directory whose path is longer than
    ``PATH_MAX`` makes its bundled oneMKL abort the process inside ``import torch`` (exit 2, no
    message of ours). Checked before a run takes its lock or makes its staging directory.

    Raises:
        UsageError: the working directory cannot be read, or its path is too long.
    """
    try:
        here = os.getcwd()
        limit = os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError) as err:
        raise UsageError(f"the working directory cannot be read ({getattr(err, 'strerror', None) or err}); "
                         "run from another directory") from None
    if len(os.fsencode(here)) >= limit:
        raise UsageError(f"the working directory's path is {len(os.fsencode(here)):,} bytes long, more than "
                         f"PATH_MAX ({limit}): torch cannot load from there; run from a shorter path")
