"""Where a DCP item's bytes lie, as torch's own ``.metadata`` records it: its private ``_StorageInfo``.

**Relies on** ``torch.distributed.checkpoint.filesystem._StorageInfo``, the dataclass of a
``.metadata`` file's ``storage_data`` values (first fields ``relative_path``, ``offset``, ``length``).

**Why it pays:** when the ``.metadata`` emitter no longer matches the installed torch,
:mod:`ema_ckpt.formats.dcp.metadata_pickle` falls back to pickling torch's own classes.

**When it is gone:** :func:`storage_info_class` raises ``ImportError``, and so does that fallback.

Example:
    >>> storage_info_class()("__0_0.distcp", 0, 16).length
    16
"""

from __future__ import annotations

from typing import Any


def storage_info_class() -> Any:
    """torch's ``_StorageInfo`` class, built as ``(relative_path, offset, length)``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo
