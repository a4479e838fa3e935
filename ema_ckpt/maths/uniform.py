"""Plain averaging of checkpoints (fairseq ``average_checkpoints``, LAWA): 1/k on a selection."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from ..errors import OptionError, UsageError
from ._steps import check_steps, option_step

__all__ = ["uniform_coefficients", "uniform_selection"]


def uniform_selection(
    steps: Sequence[int],
    *,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
    every: int | None = None,
) -> list[int]:
    """Indices averaged by ``uniform_coefficients``: steps in [from_step, to_step] (inclusive),
    every n-th of them counted back from the newest (LAWA's spacing), then the last k.

    Example:
        >>> uniform_selection([10, 20, 30, 40, 50], last=2, to_step=40)
        [2, 3]
        >>> uniform_selection([10, 20, 30, 40, 50], last=2, every=2)
        [2, 4]
    """
    ts = check_steps(steps)
    lo = option_step(from_step, "from_step") if from_step is not None else None
    hi = option_step(to_step, "to_step") if to_step is not None else None
    if lo is not None and hi is not None and lo > hi:
        raise OptionError("from_step", f"{lo} is after {{to_step}} {hi}", value=lo, mentions=("to_step",))
    picked = [i for i, t in enumerate(ts) if (lo is None or t >= lo) and (hi is None or t <= hi)]
    if every is not None:
        picked = picked[::-1][:: _count(every, "every")][::-1]
    if last is not None:
        picked = picked[-_count(last, "last"):]
    if not picked:
        bounds = f"[{lo if lo is not None else ts[0]}, {hi if hi is not None else ts[-1]}]"
        raise UsageError(f"no checkpoint in the selected steps {bounds} (checkpoints span {ts[0]}–{ts[-1]})")
    return picked


def _count(value: object, option: str) -> int:
    """``value`` as a positive count (checked as any value: callers need not be type-checked)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise OptionError(option, f"must be a positive number of checkpoints, got {value!r}", value=value)
    return int(value)


def uniform_coefficients(
    steps: Sequence[int],
    *,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
    every: int | None = None,
) -> list[float]:
    """Plain averaging: 1/k on each checkpoint of ``uniform_selection``, 0 elsewhere.

    Example:
        >>> uniform_coefficients([10, 20, 30, 40, 50], from_step=20, to_step=30)
        [0.0, 0.5, 0.5, 0.0, 0.0]
    """
    picked = set(uniform_selection(steps, last=last, from_step=from_step, to_step=to_step, every=every))
    return [1.0 / len(picked) if i in picked else 0.0 for i in range(len(steps))]
