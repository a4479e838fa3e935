"""The private parts of CPython's ``pickle`` reused: its pure-Python unpickler, and its Python 2 names.

**Relies on** ``pickle._Unpickler`` (the pure-Python unpickler), its ``dispatch`` table, the
state its ``load`` sets up (``read``, ``readline``, ``readinto``, ``metastack``, ``stack``,
``append``, ``proto``) and ``pickle._Stop`` (raised by STOP, the object as ``value``); and
``_compat_pickle.NAME_MAPPING``/``IMPORT_MAPPING``, the Python 2 names protocols 0 to 2 write.

**Why it pays:** a large DCP ``.metadata`` loads through a pure-Python unpickler whose memo keeps
only what the pickle fetches again (:mod:`ema_ckpt.pickles.memo`), at a fraction of the C
unpickler's peak memory; the loader reads protocol 2's names as ``pickle`` does.

**When it is gone:** without the pure-Python unpickler :data:`PURE_PYTHON_AVAILABLE` is False and
every pickle loads in C; without ``_compat_pickle`` this module's import fails.

Example:
    >>> python3_name("__builtin__", "set")
    ('builtins', 'set')
"""

from __future__ import annotations

import _compat_pickle
import pickle
from typing import Any

PurePythonUnpickler: Any = getattr(pickle, "_Unpickler", pickle.Unpickler)  # the C one where it is gone
Stop: Any = getattr(pickle, "_Stop", None)
PURE_PYTHON_AVAILABLE = PurePythonUnpickler is not pickle.Unpickler and Stop is not None and isinstance(
    getattr(PurePythonUnpickler, "dispatch", None), dict)

_NAMES = _compat_pickle.NAME_MAPPING
_MODULES = _compat_pickle.IMPORT_MAPPING


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A global's module and name as CPython's unpickler reads them from a protocol 2 pickle."""
    if (module, name) in _NAMES:
        mapped: tuple[str, str] = _NAMES[(module, name)]
        return mapped
    return _MODULES.get(module, module), name
