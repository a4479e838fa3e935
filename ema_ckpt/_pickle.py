"""Restricted unpickling: no code from a checkpoint ever runs.

DCP's ``.metadata`` is a pickle that torch itself loads with plain ``pickle.load``; a
crafted one runs any command. Here every global a pickle names is checked against an
allowlist of inert data classes before it is resolved; anything else raises
:class:`~ema_ckpt.errors.UnsafePickleError` and nothing from the file is executed.

Example:
    >>> import pickle
    >>> load_dcp_metadata_bytes(pickle.dumps(print), "x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ema_ckpt.errors.UnsafePickleError: x: refers to builtins.print, ...
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from .dtypes import TORCH_NAMES, DtypeName, canonical, itemsize
from .errors import CheckpointFormatError, UnsafePickleError

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


# The pure-Python unpickler keeps its memo in a dict: the C one sizes an array from the memo
# index a file names, so a 10-byte pickle can make it allocate gigabytes.


class _InMemoryUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler, reading straight from a pickle held in memory.

    The stock loop sends every opcode's read through a Python-level frame reader. With the
    whole pickle in memory, protocol-4 frames are only grouping, so here reads go to
    ``BytesIO``'s C methods and a FRAME opcode just skips its 8-byte length: about twice as
    fast on a 20,000-key ``.metadata``, with the same dict memo (no memo bombs).
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.FRAME[0]] = lambda self: self.read(8)

    def _load_bytearray8(self) -> None:
        # the stock handler allocates the declared length before reading: 8 bytes could ask for 8 GB
        (length,) = struct.unpack("<Q", self.read(8))
        if length > self._size - self._buffer.tell():
            raise pickle.UnpicklingError("BYTEARRAY8 longer than the data left")
        self.append(bytearray(self.read(length)))

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8

    def __init__(self, data: bytes) -> None:
        self._buffer = io.BytesIO(data)
        self._size = len(data)
        super().__init__(self._buffer)

    def load(self) -> Any:
        self.read, self.readline, self.readinto = self._buffer.read, self._buffer.readline, self._buffer.readinto
        self.metastack, self.stack = [], []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                opcode = read(1)
                if not opcode:
                    raise EOFError("pickle data was truncated")
                dispatch[opcode[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # the STOP opcode ends a pickle
            return stop.value


def _refuse(source: str, module: str, name: str) -> UnsafePickleError:
    return UnsafePickleError(
        source, f"refers to {module}.{name}, which is not allowed; nothing from the file was run"
    )


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


def _size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size`` as a tuple of ints."""
    return tuple(map(int, dims))


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
    standins[("torch", "Size")] = _size
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


class _DcpMetadataUnpickler(_InMemoryUnpickler):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data)
        self._source = source
        self._standins = _fresh_standins()

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(self._standins, module, name)
        if found is None:
            raise _refuse(self._source, module, name)
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse(self._source, "persistent_load", repr(pid)[:40])


class _Bag:
    """A plain object: the C unpickler fills its ``__dict__`` without calling Python code."""


class _TupleBag:
    def __setstate__(self, state: Any) -> None:
        self.state = state


class _OwnMetadataUnpickler(pickle.Unpickler):
    """The C unpickler over plain stand-ins: for metadata ema-ckpt itself just wrote (fast)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._standins = {**_fresh_standins()}
        for (module, name), standin in list(self._standins.items()):
            if isinstance(standin, type) and issubclass(standin, _Inert):
                base = _TupleBag if name == "TensorProperties" else _Bag
                self._standins[(module, name)] = type(name, (base,), {})
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


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where a tensor's bytes lie inside a ``torch.save`` zip, from its ``data.pkl``."""

    storage_key: str
    dtype: str  # canonical torch dtype name
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for dim, stride in zip(reversed(self.size), reversed(self.stride), strict=True):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


_STORAGE_DTYPES = {
    f"{name}Storage": dtype
    for name, dtype in {
        "Double": "float64",
        "Float": "float32",
        "Half": "float16",
        "BFloat16": "bfloat16",
        "Long": "int64",
        "Int": "int32",
        "Short": "int16",
        "Char": "int8",
        "Byte": "uint8",
        "Bool": "bool",
        "ComplexFloat": "complex64",
        "ComplexDouble": "complex128",
    }.items()
}


class _StorageRef:
    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: str, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _ints(value: Any, what: str) -> tuple[int, ...]:
    items = tuple(value) if isinstance(value, (tuple, list)) else None
    if items is None or not all(type(v) is int and v >= 0 for v in items):
        raise pickle.UnpicklingError(f"tensor {what} {value!r} is not a tuple of non-negative ints")
    return items


def _rebuild_record(
    storage: _StorageRef, offset: Any, size: Any, stride: Any, *_rest: Any
) -> TensorRecord:
    if not isinstance(storage, _StorageRef) or type(offset) is not int:  # the callers bound the offset
        raise pickle.UnpicklingError("malformed tensor record")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"tensor size {shape} and stride {strides} differ in length")
    return TensorRecord(storage.key, storage.dtype, storage.numel, offset, shape, strides)


def _rebuild_record_v3(
    storage: _StorageRef, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_rest: Any
) -> TensorRecord:
    """torch's v3 record (float8, uint16, …): an untyped byte storage plus the dtype."""
    if not isinstance(dtype, DtypeName) or storage.dtype != _UNTYPED:
        raise pickle.UnpicklingError("malformed v3 tensor record")
    size_of = itemsize(dtype)
    if storage.numel % size_of:
        raise pickle.UnpicklingError(f"{storage.numel} storage bytes do not hold whole {dtype} values")
    typed = _StorageRef(storage.key, str(dtype), storage.numel // size_of)
    return _rebuild_record(typed, offset, size, stride)


_UNTYPED = "untyped"


class _TensorRecordUnpickler(_InMemoryUnpickler):
    """Reads a plain tensor's ``data.pkl`` into a :class:`TensorRecord`; nothing else."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_record
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_record_v3
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return DtypeName(_UNTYPED)
        if module == "torch" and name in _STORAGE_DTYPES:
            return DtypeName(_STORAGE_DTYPES[name])
        if module == "torch" and name in TORCH_NAMES:
            return DtypeName(canonical(name))
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name == "Size":
            return _size
        raise _refuse(self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(self._source, "unexpected storage reference in tensor record")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, DtypeName) or type(numel) is not int or numel < 0:
            raise CheckpointFormatError(self._source, "unexpected storage type in tensor record")
        return _StorageRef(str(key), dtype, numel)


_RECORD_CACHE: dict[bytes, TensorRecord] = {}
_RECORD_CACHE_SIZE = 4096


def load_tensor_record(data: bytes, source: str) -> TensorRecord:
    """Parse a tensor record's ``data.pkl`` without building the tensor.

    Raises:
        UnsafePickleError: the pickle names a global outside the allowlist.
        CheckpointFormatError: it is not a single plain tensor.
    """
    cached = _RECORD_CACHE.get(data)  # chunks of one shape and dtype share their data.pkl bytes
    if cached is not None:
        return cached
    try:
        obj = _TensorRecordUnpickler(data, source).load()
    except (UnsafePickleError, CheckpointFormatError):
        raise
    except Exception as err:
        raise CheckpointFormatError(source, f"unreadable tensor record ({err})") from None
    if not isinstance(obj, TensorRecord):
        raise CheckpointFormatError(source, "record does not hold a single tensor")
    if len(_RECORD_CACHE) >= _RECORD_CACHE_SIZE:
        _RECORD_CACHE.clear()
    _RECORD_CACHE[data] = obj
    return obj


def load_state_dict_records(data: bytes, source: str) -> dict[str, tuple[tuple[str, ...], TensorRecord]]:
    """The tensors of a ``torch.save``-d state dict's ``data.pkl`` without building them.

    Returns {flat key: (nesting path, record)}. Nested dicts are flattened with ``.``
    (``{"model": {"w": t}}`` → ``model.w``, path ``("model", "w")``); values that are not
    tensors (ints, strings) are left out. Only the globals a plain tensor needs are allowed.

    Raises:
        UnsafePickleError: the pickle names a global outside the allowlist.
        CheckpointFormatError: it is unreadable or holds no dict of tensors.
    """
    try:
        obj = _TensorRecordUnpickler(data, source).load()
    except (UnsafePickleError, CheckpointFormatError):
        raise
    except Exception as err:
        raise CheckpointFormatError(source, f"unreadable pickle ({err})") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(source, f"holds a {type(obj).__name__}, not a state dict")
    records: dict[str, tuple[tuple[str, ...], TensorRecord]] = {}
    pending: list[tuple[tuple[str, ...], dict]] = [((), obj)]
    seen: set[int] = set()
    entries = 0
    while pending:
        prefix, mapping = pending.pop()
        if id(mapping) in seen:  # a dict inside itself, or one dict nested twice: a bomb, not a state dict
            raise CheckpointFormatError(source, "a nested dict appears twice in the state dict")
        seen.add(id(mapping))
        entries += len(mapping)
        if entries > len(data) or len(prefix) > 1024:
            raise CheckpointFormatError(source, "state dict nests more entries than its pickle holds")
        for key, value in mapping.items():
            if not isinstance(key, str):
                continue
            path = (*prefix, key)
            if isinstance(value, TensorRecord):
                name = ".".join(path)
                if name in records:
                    raise CheckpointFormatError(source, f"key {name!r} appears twice once nested dicts are joined")
                records[name] = (path, value)
            elif isinstance(value, dict):
                pending.append((path, value))
    return records
