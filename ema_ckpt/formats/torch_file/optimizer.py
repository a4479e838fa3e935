"""The step counters of an optimizer state saved with ``torch.save`` (accelerate's ``optimizer.bin``).

``torch.optim`` keeps one ``step`` per parameter in ``state[i]["step"]``: a 0-d float tensor
(or a number, in older releases). Only those few bytes are read; the moments are not.

Example:
    >>> optimizer_step_counters(Path("checkpoint_3/optimizer.bin"))   # doctest: +SKIP
    [6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import struct
from typing import Any

from ...dtypes import itemsize
from ...errors import CheckpointFormatError
from ...storage import Location, open_readable
from ...torch_records import TensorRecord
from .reader import parse_file

_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "float16": "<e"}
_MAX_COUNTERS = 100_000


def _counters(root: Any) -> list[list[Any]]:
    """The ``step`` entries of ``state``, one list per optimizer: an optimizer's state, a list of
    them, or a Lightning checkpoint's ``optimizer_states``."""
    if isinstance(root, dict) and isinstance(root.get("optimizer_states"), list):
        root = root["optimizer_states"]
    states = root if isinstance(root, list) else [root]
    found = []
    for state in states[:64]:
        per_param = state.get("state") if isinstance(state, dict) else None
        if isinstance(per_param, dict):
            found.append([v.get("step") for v in list(per_param.values())[:_MAX_COUNTERS]
                          if isinstance(v, dict) and "step" in v])
    return found


def optimizer_steps(path: Location) -> list[list[float]]:
    """Every parameter's ``step`` counter in the optimizer states at ``path``, one list per
    optimizer (empty when none is readable: the caller then finds the step elsewhere)."""
    try:
        source = open_readable(path)
    except OSError:
        return []
    try:
        parsed = parse_file(source, path)
        found: list[list[float]] = []
        for counters in _counters(parsed.tree.root):
            values: list[float] = []
            for counter in counters:
                if isinstance(counter, (int, float)) and not isinstance(counter, bool):
                    values.append(float(counter))
                elif isinstance(counter, TensorRecord) and counter.size == () and counter.dtype in _FORMATS:
                    start = parsed.starts.get(counter.storage_key)
                    if start is None:
                        continue
                    size = itemsize(counter.dtype)
                    raw = source.pread(size, start + counter.storage_offset * size)
                    if len(raw) == size:
                        values.append(float(struct.unpack(_FORMATS[counter.dtype], raw)[0]))
            found.append(values)
        return found
    except CheckpointFormatError:
        return []
    finally:
        source.close()


def optimizer_step_counters(path: Location) -> list[float]:
    """Every parameter's ``step`` counter in the optimizer state at ``path``, all optimizers together."""
    return [v for values in optimizer_steps(path) for v in values]


__all__ = ["optimizer_step_counters", "optimizer_steps"]
