"""Where a DCP item's bytes lie, as torch's own ``.metadata`` records it: its private ``_StorageInfo``.

**Relies on** ``torch.distributed.checkpoint.filesystem._StorageInfo``, the dataclass of a
``.metadata`` file's ``storage_data`` values (the ``.distcp`` file, the offset and the length
of one item's bytes); its first fields are ``relative_path``, ``offset`` and ``length``.

**Why it pays:** when the ``.metadata`` emitter no longer matches the installed torch,
:mod:`ema_ckpt.formats.dcp.metadata_pickle` falls back to building torch's own metadata
classes and pickling them; this is the one of them torch keeps private.

**When it is gone:** :func:`storage_info_class` raises ``ImportError`` and so does that
fallback (a DCP write on such a torch fails with it); ``tests/test_compat.py`` fails loudly
first.

Example:
    >>> storage_info_class()("__0_0.distcp", 0, 16).length
    16
"""

from __future__ import annotations

from typing import Any


def storage_info_class() -> Any:
    """torch's ``_StorageInfo`` class (imports ``torch.distributed.checkpoint``): built as
    ``(relative_path, offset, length)``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo
