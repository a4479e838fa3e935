"""Restricted unpickling of DCP ``.metadata``: no code from a checkpoint ever runs.

torch loads ``.metadata`` with plain ``pickle.load``, so a crafted one runs any command. Here
every global resolves to an inert stand-in: DCP's metadata classes to records of their fields,
any other global to a :class:`~.metadata_foreign.Foreign` record that runs and imports nothing.
A foreign record is read as data only as a value of ``storage_data`` with exactly the fields of
torch's ``filesystem._StorageInfo`` (a trainer's own ``StorageWriter`` pickles its own copy);
anywhere else it raises :class:`~ema_ckpt.errors.UnsafePickleError`, or, listed in
``inert_globals``, stays an opaque record never interpreted. Nothing from the file is executed.

Example:
    >>> import pickle
    >>> load_dcp_metadata_bytes(pickle.dumps(print), "x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ema_ckpt.errors.UnsafePickleError: x: refers to builtins.print, ...
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from ..._apart import run_apart
from ...dtypes import DtypeName
from ...errors import CheckpointFormatError, UnsafePickleError
from ...pickles.load import Allowlist, load_pickle
from ...pickles.rules import TORCH_DTYPES, refuse, torch_size
from .metadata_foreign import (
    CONTAINERS,
    Foreign,
    by_shape,
    foreign_class,
    labelled_parts,
    listed,
    reach,
    refused_global,
    storage_fields,
)

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_DCP_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_DCP_PLANNER_CLASSES = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}
_LAYOUTS = {"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"}
_MEMORY_FORMATS = {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}


class _Inert:
    """A plain record standing in for one of DCP's metadata dataclasses: no code of the file's
    choosing runs, and ``torch.distributed.checkpoint`` (a slow import) is never imported.

    torch's fields live in slots (a million records at 200,000 tensors: a dict each would cost
    hundreds of MiB); any other goes to ``__dict__``. A field left out reads as its default.
    """

    __slots__ = ("__dict__",)
    _type_name = "object"
    _slot_names: frozenset[str] = frozenset()
    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._assign(kwargs)

    def _assign(self, state: dict[Any, Any]) -> None:
        slots = type(self)._slot_names
        for name, value in state.items():
            if not isinstance(name, str):
                raise pickle.UnpicklingError(f"{self._type_name}: field name {name!r} is not a string")
            if name in slots:
                object.__setattr__(self, name, value)
            else:
                self.__dict__[name] = value
        # torch's pickler memoizes every state dict, so the unpickler keeps each alive to the end
        # of the load: emptied, it holds nothing (about 1 KiB per tensor otherwise)
        state.clear()

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            for part in state:
                if isinstance(part, dict):
                    self._assign(part)
        elif isinstance(state, dict):
            self._assign(state)
        else:
            raise pickle.UnpicklingError(f"unexpected state for {self._type_name}")

    def __getattr__(self, name: str) -> Any:  # only for fields never assigned
        defaults = type(self)._defaults
        if name in defaults:
            return defaults[name]
        raise AttributeError(name)

    def fields(self) -> dict[str, Any]:
        """Every field assigned, slotted or not."""
        found = {name: getattr(self, name) for name in type(self)._slot_names if hasattr(self, name)}
        return {**found, **self.__dict__}

    def __repr__(self) -> str:
        return f"{self._type_name}({self.fields()})"


class _MetadataIndex(_Inert):
    """Hashes like torch's ``MetadataIndex``: by key and chunk offset (not the index hint)."""

    __slots__ = ("fqn", "index", "offset")
    _type_name = "MetadataIndex"
    _slot_names = frozenset(__slots__)
    _defaults: ClassVar[dict[str, Any]] = {"fqn": None, "offset": None, "index": None}

    def _identity(self) -> tuple[Any, ...]:
        offset = self.offset
        return (self.fqn, None if offset is None else tuple(offset))

    def __hash__(self) -> int:
        return hash(self._identity())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetadataIndex) and self._identity() == other._identity()


class _TensorProperties(_Inert):
    """torch pickles ``TensorProperties`` as a 5-tuple state (dtype, layout, grad, format, pin)."""

    __slots__ = ("dtype", "layout", "memory_format", "pin_memory", "requires_grad")
    _type_name = "TensorProperties"
    _slot_names = frozenset(__slots__)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        else:
            super().__setstate__(state)
        if not isinstance(getattr(self, "dtype", None), DtypeName):
            raise pickle.UnpicklingError("TensorProperties without a torch dtype")


class _TensorStorageMetadata(_Inert):
    """Tensor entries share one ``TensorProperties`` per distinct value (each is pickled apart)."""

    __slots__ = ("chunks", "properties", "size")
    _type_name = "TensorStorageMetadata"
    _slot_names = frozenset(__slots__)
    _interned: ClassVar[dict[tuple[Any, ...], Any]] = {}  # replaced per load (see _standin)

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        properties = getattr(self, "properties", None)
        if isinstance(properties, _TensorProperties):  # fields beyond torch's are never read
            with contextlib.suppress(TypeError):  # an unhashable field: kept as it is
                self.properties = type(self)._interned.setdefault(
                    tuple(getattr(properties, n, None) for n in _TensorProperties.__slots__), properties)


_FIELDS: dict[str, tuple[str, ...]] = {
    "Metadata": ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
    "ChunkStorageMetadata": ("offsets", "sizes"),
    "_StorageInfo": ("relative_path", "offset", "length", "transform_descriptors"),
}
# Fields that torch omits from the pickled state when they hold their default.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "Metadata": {"planner_data": None, "storage_data": None, "storage_meta": None, "version": None},
    "_StorageInfo": {"transform_descriptors": None},
}


_BASES: dict[str, type[_Inert]] = {cls._type_name: cls for cls in (_MetadataIndex, _TensorProperties,
                                                                   _TensorStorageMetadata)}


def _standin(name: str) -> type[_Inert]:
    """A fresh class for ``name`` (see :func:`_fresh_standins`)."""
    base, fields = _BASES.get(name, _Inert), _FIELDS.get(name, ())
    cls = type(name, (base,), {"__slots__": fields, "_type_name": name,
                               "_slot_names": base._slot_names | frozenset(fields),
                               "_defaults": {**base._defaults, **_DEFAULTS.get(name, {})}})
    if name == "TensorStorageMetadata":
        cls._interned = {}  # type: ignore[attr-defined]
    return cls


def _interning_size() -> Any:
    """``torch.Size`` as a tuple of ints, one object per distinct value within one load."""
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}

    def size(dims: Any = ()) -> tuple[int, ...]:
        value = torch_size(dims)
        return seen.setdefault(value, value)

    return size


_PATH_CLASSES = {"PosixPath", "PurePosixPath", "Path", "WindowsPath", "PureWindowsPath", "PurePath"}


def _fresh_standins() -> dict[tuple[str, str], Any]:
    """New stand-in classes and functions for one load: a pickle can set attributes on the
    classes it is handed (BUILD on a class), and such edits stay inside that load."""
    return {
        **{(_DCP_METADATA_MODULE, name): _standin(name) for name in _DCP_METADATA_CLASSES - {"_MEM_FORMAT_ENCODING"}},
        (_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): lambda value: value,
        (_DCP_FILESYSTEM_MODULE, "_StorageInfo"): _standin("_StorageInfo"),
        # Megatron's torch_dist strategy keeps its cached save plans in the metadata
        # (``all_local_plans``); they are read into inert bags like the rest, and never used.
        **{(_DCP_PLANNER_MODULE, name): _standin(name) for name in _DCP_PLANNER_CLASSES},
        ("torch.serialization", "_get_layout"): lambda name: str(name),
        ("torch", "Size"): _interning_size(),
        **{(module, name): lambda *parts: "/".join(str(p) for p in parts)
           for module in ("pathlib", "pathlib._local") for name in _PATH_CLASSES},
    }


_TORCH_VALUES: dict[tuple[str, str], Any] = {**TORCH_DTYPES, **{("torch", n): n for n in _LAYOUTS | _MEMORY_FORMATS}}
"""Dtypes as :class:`~ema_ckpt.dtypes.DtypeName`, layouts and memory formats as their names."""


def _metadata_globals(source: str, inert_globals: Sequence[str]
                      ) -> tuple[Allowlist, dict[tuple[str, str], type[Foreign]]]:
    """The allowlist of one load, and the :class:`~.metadata_foreign.Foreign` record class it
    makes of each global none of torch's (judged once the whole pickle is read)."""
    foreign: dict[tuple[str, str], type[Foreign]] = {}

    def other(module: str, name: str) -> type[Foreign]:  # called once per name
        return foreign.setdefault((module, name), foreign_class(module, name, source, inert=listed(
            f"{module}.{name}", inert_globals)))

    return Allowlist({**_TORCH_VALUES, **_fresh_standins()}, other=other), foreign


_LEAN_ABOVE = 16 << 20
"""Metadata longer than this (about 65,000 keys) is read with the lean memo: about 1.8x the
time of the C unpickler, at a peak about 190 MiB lower for 200,000 keys."""


class _Bag:
    """A plain object: the C unpickler fills its ``__dict__`` without calling Python code."""


class _Dropped:
    """An object whose state the check does not keep: ``__setstate__`` is a builtin that takes
    the state and returns, so no Python code runs and nothing per record outlives its BUILD."""

    __slots__ = ()
    __setstate__ = len


def _own_globals() -> Allowlist:
    """The allowlist that reads back metadata ema-ckpt just wrote, fast: ``Metadata`` keeps its
    fields, every record below it is dropped, builtins stand in for Python functions."""
    table = {**_TORCH_VALUES, **_fresh_standins()}
    for (module, name), standin in list(table.items()):
        if isinstance(standin, type) and issubclass(standin, _Inert):
            base = _Bag if name == "Metadata" else _Dropped
            table[(module, name)] = type(name, (base,), {"__slots__": ()} if base is _Dropped else {})
    table[("torch", "Size")], table[("torch.serialization", "_get_layout")] = tuple, str
    table[(_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING")] = int
    return Allowlist(table)


_CHECK_APART_BYTES = 4 << 20
"""Metadata longer than this (about 20,000 keys) is checked in a child process: the check's
objects (about 350 bytes per key) would add to the run's peak memory."""


def check_written_file(path: Path, keys: int) -> None:
    """:func:`check_written_metadata` of a ``.metadata`` about to be published (a large one in a
    child process)."""
    if path.stat().st_size > _CHECK_APART_BYTES:
        _check_apart(path, keys)
    else:
        check_written_metadata(path.read_bytes(), keys)


def check_written_metadata(data: bytes, keys: int) -> None:
    """``data`` unpickles into Metadata with ``keys`` entries, as ``dcp.load`` will unpickle it."""
    try:
        entries = load_pickle(data, _own_globals(), "", walk=False).state_dict_metadata
    except Exception as err:
        raise ValueError(f"the written DCP metadata does not load ({type(err).__name__}: {err})") from None
    if len(entries) != keys:
        raise ValueError(f"the written DCP metadata holds {len(entries)} keys, not {keys}")


def _check_apart(path: Path, keys: int) -> None:
    script = ("import pathlib\n"
              "from ema_ckpt.formats.dcp.metadata_unpickle import check_written_metadata as check\n"
              "try:\n    check(pathlib.Path(sys.argv[1]).read_bytes(), int(sys.argv[2]))\n"
              "except ValueError as err:\n    print(err)\n    sys.exit(1)\n")
    try:
        detail = run_apart(script, str(path), str(keys))
    except OSError as err:
        raise ValueError(f"the written DCP metadata could not be checked ({err})") from None
    if detail is not None:
        raise ValueError(detail)


def load_dcp_metadata_bytes(data: bytes, source: str, inert_globals: Sequence[str] = ()) -> Any:
    """Unpickle DCP ``Metadata`` from ``data`` into inert stand-ins (see the module docstring):
    DCP's metadata classes, torch dtypes (:class:`~ema_ckpt.dtypes.DtypeName`), ``torch.Size``,
    layouts, memory formats and ``pathlib`` paths are admitted. ``source`` names the file.
    """
    allow, foreign = _metadata_globals(source, inert_globals)
    try:
        obj = load_pickle(data, allow, source, persistent=functools.partial(_no_persistent_ids, source),
                          lean=len(data) > _LEAN_ABOVE)
    except UnsafePickleError:
        raise
    except Exception as err:  # any malformed pickle: one clean line, never a traceback
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointFormatError(source, f"not a readable DCP metadata pickle ({detail})") from None
    if foreign:
        _settle_foreign(obj, source, allow, foreign)
    if not isinstance(obj, _Inert) or obj._type_name != "Metadata" or not isinstance(
        getattr(obj, "state_dict_metadata", None), dict
    ):
        raise CheckpointFormatError(source, "does not hold DCP Metadata")
    return obj


def _no_persistent_ids(source: str, pid: Any) -> Any:
    raise refuse(source, "persistent_load", repr(pid)[:40])


def _settle_foreign(obj: Any, source: str, allow: Allowlist, foreign: dict[tuple[str, str], type[Foreign]]) -> None:
    """Read the foreign records among ``storage_data``'s values by their shape; refuse every
    other foreign global the pickle left in ``obj`` unless it is listed as inert data. Only for
    a pickle that named a global none of torch's; the search runs in C (about 1 s at 100,000 keys).

    Raises:
        CheckpointFormatError: a value of ``storage_data`` of a foreign class whose shape is not
            ``_StorageInfo``'s (:func:`~.metadata_foreign.storage_fields`).
        UnsafePickleError: a foreign global anywhere else (named, with where it sits).
    """
    is_metadata = isinstance(obj, _Inert) and obj._type_name == "Metadata"
    storage = getattr(obj, "storage_data", None) if is_metadata else None
    shaped = {cls for cls in foreign.values() if by_shape(cls)}
    if isinstance(storage, dict) and shaped:
        make = allow.table[(_DCP_FILESYSTEM_MODULE, "_StorageInfo")]
        for index, info in storage.items():  # values replaced in place: the dict keeps its size
            if type(info) in shaped:
                path, offset, length, descriptors = storage_fields(info, index, source)
                record = make.__new__(make)
                record.relative_path, record.offset, record.length = path, offset, length
                if descriptors is not None:
                    record.transform_descriptors = descriptors
                storage[index] = record
    refused = frozenset(cls for cls in foreign.values() if not cls.inert)
    if not refused:
        return
    records = {cls for cls in allow.table.values() if isinstance(cls, type)}
    records |= {cls for cls in foreign.values() if cls.inert}
    open_types = CONTAINERS | records
    stray = reach([obj], open_types, refused)
    if stray is None:
        return
    where = next((label() for label, part in labelled_parts(obj, is_metadata)
                  if reach([part], open_types, frozenset(), stray) is not None), "")
    raise refused_global(source, stray.global_name, where=where)
