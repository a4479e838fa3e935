"""Restricted unpickling of DCP ``.metadata``: no code from a checkpoint ever runs.

DCP's ``.metadata`` is a pickle that torch itself loads with plain ``pickle.load``; a
crafted one runs any command. Here every global a pickle names is checked against an
allowlist of inert data classes before it is resolved; anything else raises
:class:`~ema_ckpt.errors.UnsafePickleError` and nothing from the file is executed. The
pickles inside ``torch.save`` records are read by :mod:`ema_ckpt.torch_records`.

Example:
    >>> import pickle
    >>> load_dcp_metadata_bytes(pickle.dumps(print), "x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ema_ckpt.errors.UnsafePickleError: x: refers to builtins.print, ...
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ...dtypes import TORCH_NAMES, DtypeName, canonical
from ...errors import CheckpointFormatError, UnsafePickleError
from ...pickles.bounds import InMemoryUnpickler
from ...pickles.rules import refuse, torch_size

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
_DCP_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_DCP_PLANNER_CLASSES = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}
_LAYOUTS = {"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"}
_MEMORY_FORMATS = {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}


class _Inert:
    """A plain attribute bag standing in for one of DCP's metadata dataclasses.

    Reading ``.metadata`` never imports or instantiates torch's classes: the unpickler
    builds these instead, which run no code of the file's choosing and keep
    ``torch.distributed.checkpoint`` (a slow import) out of read-only commands.
    """

    _type_name = "object"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            raise pickle.UnpicklingError(f"unexpected state for {self._type_name}")

    def __repr__(self) -> str:
        return f"{self._type_name}({self.__dict__})"


class _MetadataIndex(_Inert):
    """Hashes like torch's ``MetadataIndex``: by key and chunk offset (not the index hint)."""

    _type_name = "MetadataIndex"
    fqn: str | None = None
    offset: Any = None
    index: int | None = None

    def _identity(self) -> tuple[Any, ...]:
        offset = self.__dict__.get("offset")
        return (self.__dict__.get("fqn"), None if offset is None else tuple(offset))

    def __hash__(self) -> int:
        return hash(self._identity())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetadataIndex) and self._identity() == other._identity()


class _TensorProperties(_Inert):
    """torch pickles ``TensorProperties`` as a 5-tuple state (dtype, layout, grad, format, pin)."""

    _type_name = "TensorProperties"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        else:
            super().__setstate__(state)
        if not isinstance(getattr(self, "dtype", None), DtypeName):
            raise pickle.UnpicklingError("TensorProperties without a torch dtype")


# Fields that torch omits from the pickled state when they hold their default.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "Metadata": {"planner_data": None, "storage_data": None, "storage_meta": None, "version": None},
    "_StorageInfo": {"transform_descriptors": None},
}


def _standin(name: str) -> type[_Inert]:
    if name == "MetadataIndex":
        return _MetadataIndex
    if name == "TensorProperties":
        return _TensorProperties
    return type(name, (_Inert,), {"_type_name": name, **_DEFAULTS.get(name, {})})


_PATH_CLASSES = {"PosixPath", "PurePosixPath", "Path", "WindowsPath", "PureWindowsPath", "PurePath"}


def _join_path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def _fresh_standins() -> dict[tuple[str, str], Any]:
    """New stand-in classes and functions for one load.

    A pickle can set attributes on the classes it is handed (the BUILD opcode on a class
    object); giving each load its own subclasses and functions keeps such edits inside
    that load instead of poisoning the process.
    """
    standins: dict[tuple[str, str], Any] = {}
    for name in _DCP_METADATA_CLASSES - {"_MEM_FORMAT_ENCODING"}:
        base = _standin(name)
        standins[(_DCP_METADATA_MODULE, name)] = type(name, (base,), {})
    standins[(_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING")] = lambda value: value
    standins[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = type(
        "_StorageInfo", (_standin("_StorageInfo"),), {}
    )
    # Megatron's torch_dist strategy keeps its cached save plans in the metadata
    # (``all_local_plans``); they are read into inert bags like the rest, and never used.
    for name in _DCP_PLANNER_CLASSES:
        standins[(_DCP_PLANNER_MODULE, name)] = type(name, (_standin(name),), {})
    standins[("torch.serialization", "_get_layout")] = lambda name: str(name)
    standins[("torch", "Size")] = torch_size
    for module in ("pathlib", "pathlib._local"):
        for name in _PATH_CLASSES:
            standins[(module, name)] = lambda *parts: _join_path(*parts)
    return standins


def _metadata_global(standins: dict[tuple[str, str], Any], module: str, name: str) -> Any:
    """What a DCP metadata pickle's global resolves to, or None when it is not admitted."""
    standin = standins.get((module, name))
    if standin is not None:
        return standin
    if module == "torch" and name in TORCH_NAMES:
        return DtypeName(canonical(name))
    if module == "torch" and (name in _LAYOUTS or name in _MEMORY_FORMATS):
        return name
    return None


class _DcpMetadataUnpickler(InMemoryUnpickler):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data)
        self._source = source
        self._standins = _fresh_standins()

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(self._standins, module, name)
        if found is None:
            raise refuse(self._source, module, name)
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise refuse(self._source, "persistent_load", repr(pid)[:40])


class _Bag:
    """A plain object: the C unpickler fills its ``__dict__`` without calling Python code."""


class _Dropped:
    """An object whose state the check does not keep: ``__setstate__`` is a builtin that takes
    the state and returns, so no Python code runs and nothing per record outlives its BUILD."""

    __slots__ = ()
    __setstate__ = len


class _OwnMetadataUnpickler(pickle.Unpickler):
    """The C unpickler over plain stand-ins: for metadata ema-ckpt itself just wrote (fast).

    Only ``Metadata`` keeps its fields; every record below it is parsed and dropped.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._standins = {**_fresh_standins()}
        for (module, name), standin in list(self._standins.items()):
            if isinstance(standin, type) and issubclass(standin, _Inert):
                base = _Bag if name == "Metadata" else _Dropped
                self._standins[(module, name)] = type(name, (base,), {"__slots__": ()} if base is _Dropped else {})
        # builtins in place of Python functions: nothing per record runs Python code
        self._standins[("torch", "Size")] = tuple
        self._standins[("torch.serialization", "_get_layout")] = str
        self._standins[(_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING")] = int

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(self._standins, module, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found


def check_written_metadata(data: bytes, keys: int) -> None:
    """``data`` (a ``.metadata`` about to be published) unpickles into Metadata with ``keys`` entries.

    What torch's ``dcp.load`` will do with it, checked before the file exists: exit 0 never
    leaves metadata that does not load.
    """
    try:
        obj = _OwnMetadataUnpickler(data).load()
        entries = obj.state_dict_metadata
    except Exception as err:
        raise ValueError(f"the written DCP metadata does not load ({type(err).__name__}: {err})") from None
    if len(entries) != keys:
        raise ValueError(f"the written DCP metadata holds {len(entries)} keys, not {keys}")


def load_dcp_metadata_bytes(data: bytes, source: str) -> Any:
    """Unpickle DCP ``Metadata`` from ``data`` into inert stand-ins of DCP's metadata classes.

    Only DCP's metadata classes, torch dtypes (as :class:`~ema_ckpt.dtypes.DtypeName`),
    ``torch.Size``, layouts, memory formats and ``pathlib`` paths are admitted; ``source``
    names the file in error messages.
    """
    try:
        obj = _DcpMetadataUnpickler(data, source).load()
    except UnsafePickleError:
        raise
    except Exception as err:  # any malformed pickle: one clean line, never a traceback
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointFormatError(source, f"not a readable DCP metadata pickle ({detail})") from None
    if not isinstance(obj, _Inert) or obj._type_name != "Metadata" or not isinstance(
        getattr(obj, "state_dict_metadata", None), dict
    ):
        raise CheckpointFormatError(source, "does not hold DCP Metadata")
    return obj
