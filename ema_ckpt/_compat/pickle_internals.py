"""The private parts of CPython's ``pickle`` reused: its pure-Python unpickler, and its Python 2 names.

**Relies on** two private names of the standard library:

- ``pickle._Unpickler`` (the pure-Python unpickler), its ``dispatch`` table (opcode byte →
  handler taking the unpickler), the state its ``load`` sets up (``read``, ``readline``,
  ``readinto``, ``metastack``, ``stack``, ``append``, ``proto``) and ``pickle._Stop``, which
  the STOP handler raises with the loaded object as ``value``;
- ``_compat_pickle.NAME_MAPPING`` and ``IMPORT_MAPPING``: the Python 2 names of built-ins and
  modules that protocols 0 to 2 write, as CPython's unpickler maps them (``fix_imports``).

**Why it pays:** a large DCP ``.metadata`` loads through a subclass of the pure-Python
unpickler whose memo keeps only what the pickle fetches again (:mod:`ema_ckpt.pickles.memo`),
at a fraction of the C unpickler's peak memory; and the loader (:mod:`ema_ckpt.pickles.load`)
reads protocol 2's names as ``pickle`` and torch's weights-only unpickler read them, for the
allowlists that ask it to (a whole file's, DeepSpeed's fast load).

**When it is gone:** without the pure-Python unpickler, :data:`PURE_PYTHON_AVAILABLE` is False
and every pickle goes through the C unpickler (the same objects, at its peak memory); without
``_compat_pickle`` the import of this module fails. ``tests/test_compat.py`` fails loudly on
either.

Example:
    >>> python3_name("__builtin__", "set")
    ('builtins', 'set')
"""

from __future__ import annotations

import _compat_pickle
import pickle
from typing import Any

PurePythonUnpickler: Any = getattr(pickle, "_Unpickler", pickle.Unpickler)
"""CPython's pure-Python unpickler (``pickle.Unpickler``, the C one, where it is gone)."""
Stop: Any = getattr(pickle, "_Stop", None)
"""What the pure-Python unpickler's STOP handler raises, the loaded object as ``value``."""
PURE_PYTHON_AVAILABLE = PurePythonUnpickler is not pickle.Unpickler and Stop is not None and isinstance(
    getattr(PurePythonUnpickler, "dispatch", None), dict)
"""Whether the pure-Python unpickler is there, with its dispatch table and its STOP signal."""

_NAMES = _compat_pickle.NAME_MAPPING
_MODULES = _compat_pickle.IMPORT_MAPPING


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A global's module and name as CPython's unpickler reads them from a protocol 2 pickle
    (``__builtin__.set`` is ``builtins.set``); any other as it is."""
    if (module, name) in _NAMES:
        mapped: tuple[str, str] = _NAMES[(module, name)]
        return mapped
    return _MODULES.get(module, module), name
