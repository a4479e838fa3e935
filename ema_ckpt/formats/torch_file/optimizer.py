"""The step counters of an optimizer state saved with ``torch.save`` (accelerate's ``optimizer.bin``).

``torch.optim`` keeps one ``step`` per parameter in ``state[i]["step"]``: a 0-d float tensor
(or a number, in older releases). Only those few bytes are read; the moments are not.

Example:
    >>> optimizer_step_counters("checkpoint_3/optimizer.bin")   # doctest: +SKIP
    [6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from ...dtypes import itemsize
from ...errors import CheckpointFormatError
from ...torch_records import TensorRecord
from .reader import parse_file

_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "float16": "<e"}
_MAX_COUNTERS = 100_000


def _counters(root: Any) -> list[Any]:
    """The ``step`` entries of ``state`` (or of each optimizer in a list of states)."""
    states = root if isinstance(root, list) else [root]
    found = []
    for state in states:
        per_param = state.get("state") if isinstance(state, dict) else None
        if isinstance(per_param, dict):
            found += [v.get("step") for v in per_param.values() if isinstance(v, dict) and "step" in v]
    return found[:_MAX_COUNTERS]


def optimizer_step_counters(path: Path) -> list[float]:
    """Every parameter's ``step`` counter in the optimizer state at ``path`` (empty when none is
    readable: the caller then finds the step elsewhere)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        parsed = parse_file(fd, os.fstat(fd).st_size, path)
        values: list[float] = []
        for counter in _counters(parsed.tree.root):
            if isinstance(counter, (int, float)) and not isinstance(counter, bool):
                values.append(float(counter))
            elif isinstance(counter, TensorRecord) and counter.size == () and counter.dtype in _FORMATS:
                start = parsed.starts.get(counter.storage_key)
                if start is None:
                    continue
                size = itemsize(counter.dtype)
                raw = os.pread(fd, size, start + counter.storage_offset * size)
                if len(raw) == size:
                    values.append(float(struct.unpack(_FORMATS[counter.dtype], raw)[0]))
        return values
    except CheckpointFormatError:
        return []
    finally:
        os.close(fd)


__all__ = ["optimizer_step_counters"]
