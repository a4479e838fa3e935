"""The one loader of every untrusted pickle: :func:`load_pickle`, over a format's :class:`Allowlist`.

A pickle reaches code through its globals only, and every global goes through the one
``find_class`` here: the unpickler gets what the format's table names for it (an inert stand-in,
a rebuild that makes a record, a dtype name) or what the table's ``other`` makes of any other
name (a per-load record class, or a refusal). Every pickle is walked first (:mod:`.bounds`),
then loaded by CPython's C unpickler, or for pickles of millions of objects by the pure-Python
one with a lean memo (:mod:`.memo`). What a format's table declines goes to torch's weights-only
unpickler by one way only (:func:`load_weights_only`), whose refusals are reported as this loader's.

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
import threading
import warnings
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._compat import torch_load
from .._compat.pickle_internals import PURE_PYTHON_AVAILABLE, python3_name
from .._lazy import torch
from ..errors import CheckpointFormatError, UnsafePickleError
from .bounds import check_pickle_bounds
from .memo import LeanUnpickler
from .rules import GLOBAL_IN_MESSAGE, first_line, globals_in_pickle, refusal, refuse, torch_allows

__all__ = ["Allowlist", "load_pickle", "load_weights_only"]


@dataclass(frozen=True, slots=True)
class Allowlist:
    """The globals a format's pickles may name, and what each becomes."""

    table: Mapping[tuple[str, str], Any]
    """``(module, name)`` → what the unpickler is handed for it."""
    other: Callable[[str, str], Any] | None = None
    """What any other global becomes, made once per name and load; None: refused (:func:`~.rules.refuse`)."""
    python2_names: bool = False
    """Read protocol 2's Python 2 names (``__builtin__.set``) as CPython's unpickler does."""


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
    """The object ``data`` pickles, every global resolved through ``allow``.

    Args:
        persistent: what a persistent id (a ``torch.save`` storage) becomes; None: refused.
        lean: load with the lean memo (:mod:`.memo`): about 1.8x the time, a much lower peak.
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


# torch's allowlist lives in a process-wide set; one lock keeps the stand-ins admitted for a load
# to that load (another thread's load in between would otherwise see them come and go).
_WEIGHTS_ONLY_LOCK = threading.Lock()


def load_weights_only(file: str | Path | bytes, source: str | Path, *,
                      stand_ins: Mapping[str, type] | None = None, persistent: Callable[[Any], Any] | None = None,
                      mmap: bool = False) -> Any:
    """torch's weights-only load, the one way to it: of a ``torch.save`` file (its name or bytes),
    or, with ``persistent`` (what a storage's persistent id becomes), of the ``data.pkl`` bytes
    ``file``. ``stand_ins`` (a global's name → its class) are admitted for this load only.

    Raises:
        UnsafePickleError: a global torch refused (named from its message or the pickle); nothing ran.
        CheckpointFormatError: anything else the load raised (a corrupt pickle or file), naming ``source``.
    """
    stand_ins = stand_ins or {}
    try:
        with _WEIGHTS_ONLY_LOCK, torch.serialization.safe_globals([(c, n) for n, c in stand_ins.items()]), \
                warnings.catch_warnings():
            # torch warns about pickle protocols other than 2 and then refuses the file anyway.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            if persistent is None:
                opened = io.BytesIO(file) if isinstance(file, bytes) else file
                return torch.load(opened, map_location="cpu", weights_only=True, mmap=mmap)
            assert isinstance(file, bytes)
            unpickler = torch_load.weights_only_unpickler(file)
            unpickler.persistent_load = persistent
            return unpickler.load()
    except pickle.UnpicklingError as err:
        try:
            name = _refused_global(file, str(err), stand_ins, zipped=persistent is None)
        except Exception:  # a damaged archive: the pickle error below is the message
            name = None
        if name is not None:
            raise UnsafePickleError(source, refusal(name)) from None
        raise CheckpointFormatError(source, f"corrupt or unsupported pickle ({first_line(str(err))})") from None
    except Exception as err:  # torch.load raises many types on damaged files; all mean the same here
        first = first_line(str(err)) or type(err).__name__
        raise CheckpointFormatError(source, f"truncated or corrupt torch.save file ({first})") from None


def _refused_global(file: str | Path | bytes, message: str, stand_ins: Mapping[str, type], *,
                    zipped: bool) -> str | None:
    """The global the weights-only unpickler refused, from its message or from the pickle
    (``file``: a ``torch.save`` file where ``zipped``, else ``data.pkl`` bytes)."""
    match = GLOBAL_IN_MESSAGE.search(message)
    if match:  # torch prints builtins without their module ("GLOBAL eval")
        return match.group(1) if "." in match.group(1) else f"builtins.{match.group(1)}"
    data = file if isinstance(file, bytes) and not zipped else b""
    if zipped:
        try:
            with zipfile.ZipFile(io.BytesIO(file) if isinstance(file, bytes) else file) as zf:
                pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                data = zf.read(pkl) if pkl else b""
        except (OSError, zipfile.BadZipFile, KeyError):
            return None
    return next((n for n in globals_in_pickle(data) if n not in stand_ins and not torch_allows(n)), None)
