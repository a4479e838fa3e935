"""Pausing Python's cyclic garbage collector while many long-lived objects are built.

Parsing a 20,000-key DCP ``.metadata`` creates millions of small tuples and dicts, none in a
reference cycle. Each batch of new objects triggers a collection that walks the growing
heap again, about a fifth of the parse time; receiving another worker's parsed index pays
the same several times over. Reference counting still frees everything as usual.

Both helpers are context managers and change the collector of the whole process, so only
the code that owns the process's work enters them: :func:`paused_gc` around one parse,
:func:`frozen_heap` only in the job runner, around a command's data loop. Library
functions never enter them on a caller's behalf, as decorators or otherwise.

**Relies on** the freeze semantics of CPython's public ``gc.freeze`` / ``gc.unfreeze`` /
``gc.get_freeze_count`` (checked in ``tests/test_compat.py``): frozen objects are left out
of every collection until unfrozen. Where ``gc.freeze`` is missing (not CPython),
:func:`frozen_heap` does nothing.

Example:
    >>> with paused_gc():
    ...     table = {i: (i, str(i)) for i in range(1000)}
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic collection inside the block (restored after, also on errors)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_freezes = 0  # frozen_heap blocks open in this process
_freezes_lock = threading.Lock()
_CAN_FREEZE = all(hasattr(gc, name) for name in ("freeze", "unfreeze", "get_freeze_count"))


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects that exist on entry are left out of cyclic collections until the outermost
    block ends.

    For the job runner's data loop: the parsed indexes of every input (millions of objects)
    live for the whole run, and each full collection would walk them all again. Objects made
    inside the block are collected as usual; a nested block also sets aside what was made since
    the outer one began. A process that froze objects for its own reasons (``gc.freeze``
    before a fork) is left as it is.
    """
    global _freezes
    with _freezes_lock:
        owned = _CAN_FREEZE and (_freezes > 0 or not gc.get_freeze_count())
        if owned:
            gc.freeze()
            _freezes += 1
    try:
        yield
    finally:
        if owned:
            with _freezes_lock:
                _freezes -= 1
                if _freezes == 0:
                    gc.unfreeze()
