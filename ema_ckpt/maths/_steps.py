"""Checks shared by the coefficient families: steps are integers from the start of training."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from itertools import pairwise
from numbers import Integral

from ..errors import OptionError, UsageError


def _checked_step(value: object, error: Callable[[str], Exception]) -> int:
    """``value`` as a step ≥ 0, else ``error`` of what is wrong with it (worded after its name)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise error(f"must be an integer step, got {value!r}")
    if int(value) < 0:
        raise error(f"must be ≥ 0 (steps count from the start of training), got {int(value)}")
    return int(value)


def as_step(value: object, what: str) -> int:
    """``value`` as a step ≥ 0, else ``UsageError`` naming ``what`` (a datum, not a parameter)."""
    return _checked_step(value, lambda problem: UsageError(f"{what} {problem}"))


def option_step(value: object, option: str) -> int:
    """``value`` of the library parameter ``option`` as a step ≥ 0, else ``OptionError``."""
    return _checked_step(value, lambda problem: OptionError(option, problem, value=value))


def check_steps(steps: Sequence[int]) -> list[int]:
    """Checkpoint steps as ints, strictly increasing and non-empty."""
    out = [as_step(s, "checkpoint step") for s in steps]
    if not out:
        raise UsageError("no checkpoints to combine")
    for a, b in pairwise(out):
        if b <= a:
            what = "appears twice" if a == b else f"comes after step {a}"
            raise UsageError(f"checkpoint steps must strictly increase: step {b} {what}")
    return out


def check_pair(t_prev: int, t_new: int) -> tuple[int, int]:
    """Two steps of an incremental update, the second after the first."""
    a, b = as_step(t_prev, "t_prev"), as_step(t_new, "t_new")
    if b <= a:
        raise UsageError(f"steps must increase: {a} then {b}")
    return a, b


def used_count(steps: list[int], at_step: int | None) -> int:
    """How many checkpoints lie at or before ``at_step`` (all when None; past the newest is refused)."""
    if at_step is None:
        return len(steps)
    t = option_step(at_step, "at_step")
    n = bisect.bisect_right(steps, t)
    if n == 0:
        raise OptionError("at_step", f"{t} is before the first checkpoint (step {steps[0]})", value=t)
    if t > steps[-1]:
        raise OptionError("at_step", f"{t} is after the newest checkpoint (step {steps[-1]}): "
                          "nothing after it is known", value=t)
    return n
