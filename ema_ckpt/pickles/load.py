"""The one loader of every untrusted pickle: :func:`load_pickle`, over a format's :class:`Allowlist`.

A pickle reaches code through its globals only, and every global goes through the one
``find_class`` here: the unpickler gets what the format's table names for it (an inert
stand-in, a rebuild that makes a record, a dtype name) or what the table's ``other`` makes of
any other name (a per-load record class, or a refusal). Each format's table is data beside its
stand-ins (``torch_records.pickles``, ``torch_records.tree``, ``formats.dcp.metadata_unpickle``,
``formats.deepspeed.fastload``, whose declined files go to torch's weights-only unpickler).
Every pickle is walked first (:mod:`.bounds`), then loaded by CPython's C unpickler, or, for
pickles of millions of objects, by the pure-Python one with a lean memo (:mod:`.memo`).

Example:
    >>> import pickle
    >>> load_pickle(pickle.dumps({"a": (1, 2)}), Allowlist({}), "x")
    {'a': (1, 2)}
    >>> load_pickle(pickle.dumps(print), Allowlist({}), "x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ema_ckpt.errors.UnsafePickleError: x: refers to builtins.print, ...
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._compat.pickle_internals import PURE_PYTHON_AVAILABLE, python3_name
from .bounds import check_pickle_bounds
from .memo import LeanUnpickler
from .rules import refuse

__all__ = ["Allowlist", "load_pickle"]


@dataclass(frozen=True, slots=True)
class Allowlist:
    """The globals a format's pickles may name, and what each becomes."""

    table: Mapping[tuple[str, str], Any]
    """``(module, name)`` → what the unpickler is handed for it."""
    other: Callable[[str, str], Any] | None = None
    """What any other global becomes, made once per name and load (a stand-in class of the
    load, or an error raised); None: refused with :func:`~.rules.refuse`, naming the file."""
    python2_names: bool = False
    """Read protocol 2's Python 2 names (``__builtin__.set``) as CPython's unpickler does first."""


class _Resolving:
    """``find_class`` from an :class:`Allowlist`, for both unpicklers below."""

    allow: Allowlist
    source: str | Path
    made: dict[tuple[str, str], Any]

    def find_class(self, module: str, name: str) -> Any:
        allow = self.allow
        if allow.python2_names:
            module, name = python3_name(module, name)
        found = allow.table.get((module, name))
        if found is None:
            found = self.made.get((module, name))
            if found is None:
                if allow.other is None:
                    raise refuse(self.source, module, name)
                found = self.made[(module, name)] = allow.other(module, name)
        return found


class _InMemory(_Resolving, pickle.Unpickler):
    pass


class _Lean(_Resolving, LeanUnpickler):
    pass


def load_pickle(data: bytes, allow: Allowlist, source: str | Path, *, persistent: Callable[[Any], Any] | None = None,
                lean: bool = False, encoding: str = "ASCII", walk: bool = True) -> Any:
    """The object ``data`` pickles, every global resolved through ``allow`` (see the module docstring).

    Args:
        persistent: what a persistent id (a ``torch.save`` storage) becomes; None: refused.
        lean: load with the lean memo (:mod:`.memo`), where CPython offers it: a pickle of
            millions of objects, at about 1.8x the time and a much lower peak.
        encoding: how protocol 2's 8-bit strings decode.
        walk: False only for a pickle walked already, or written by this process.

    Raises:
        UnsafePickleError: a global neither listed nor made by ``allow.other`` (nothing ran).
        pickle.UnpicklingError, EOFError, and whatever a stand-in raises: a malformed pickle.
    """
    unpickler: Any
    if lean and PURE_PYTHON_AVAILABLE:  # else the C unpickler: the same objects, at its peak memory
        unpickler = _Lean(data, encoding=encoding)  # walks the pickle as it starts
    else:
        if walk:
            check_pickle_bounds(data)
        unpickler = _InMemory(io.BytesIO(data), encoding=encoding)
    unpickler.allow, unpickler.source, unpickler.made = allow, source, {}
    if persistent is not None:
        unpickler.persistent_load = persistent
    return unpickler.load()

