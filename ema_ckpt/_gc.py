"""Pausing Python's cyclic garbage collector while many long-lived objects are built.

Parsing a 20,000-key DCP ``.metadata`` creates millions of small objects in no reference cycle,
and each collection they trigger walks the growing heap again (about a fifth of the parse).
Both helpers change the collector of the whole process, so only the code that owns the process's
work enters them: :func:`paused_gc` around one parse, :func:`frozen_heap` in the job runner;
library functions never do on a caller's behalf. :func:`import_module` sets modules aside only
in a process declared ema-ckpt's own (:func:`own_the_heap`: the command line, spawned workers).

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
import importlib
import sys
import threading
from collections.abc import Iterator
from types import ModuleType


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
_owns_heap = False  # set by the entry points of ema-ckpt's own processes: see own_the_heap
# the freeze count import_module left: what this module set aside itself (the count only falls
# after that, as frozen objects are freed, unless another freeze adds to it)
_settled = 0


def own_the_heap() -> None:
    """Declare this process ema-ckpt's own (the command line, a spawned worker): from now on
    :func:`import_module` may set the modules it imports aside. Never called by library code."""
    global _owns_heap
    _owns_heap = True


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``; in a process that owns its heap, imported without
    cyclic collections and its objects then set aside (``gc.freeze``): torch's million objects
    would otherwise be walked by every collection (a quarter of the import's time, and more later).
    """
    module = sys.modules.get(name)
    if module is not None or not _owns_heap:
        return module if module is not None else importlib.import_module(name)
    with paused_gc():
        module = importlib.import_module(name)
        _settle()
    return module


def _settle() -> None:
    global _settled
    with _freezes_lock:
        if _CAN_FREEZE and (_freezes > 0 or gc.get_freeze_count() <= _settled):
            gc.freeze()  # inside a frozen_heap block: the outermost one unfreezes it with the rest
            if _freezes == 0:
                _settled = gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects that exist on entry are left out of cyclic collections until the outermost
    block ends (the inputs' parsed indexes live for the whole run). A process that froze
    objects for its own reasons (``gc.freeze`` before a fork) is left as it is.
    """
    global _freezes, _settled
    with _freezes_lock:
        owned = _CAN_FREEZE and (_freezes > 0 or gc.get_freeze_count() <= _settled)
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
                    gc.unfreeze()  # what import_module set aside too: one bookkeeping, no partial unfreeze
                    _settled = 0
