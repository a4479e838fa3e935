"""The pickles inside ``torch.save`` records: read without building tensors, written without data.

Reading: a record's ``data.pkl`` goes through a restricted unpickler that admits only what a
plain tensor (or a state dict of them) needs and turns each tensor into a
:class:`TensorRecord`, the place of its bytes; nothing else from the file is resolved or run.
The writing side is :mod:`.write`.
"""

from __future__ import annotations

import collections
import pickle
from dataclasses import dataclass
from typing import Any

from ..dtypes import TORCH_NAMES, DtypeName, canonical, itemsize
from ..errors import CheckpointFormatError, UnsafePickleError
from ..pickles.bounds import InMemoryUnpickler
from ..pickles.rules import refuse, torch_size


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


def storage_dtype(module: str, name: str) -> DtypeName | None:
    """The dtype a torch storage or dtype global names (``torch.FloatStorage``, ``torch.bfloat16``,
    ``torch.UntypedStorage``), or None."""
    if module in ("torch", "torch.storage") and name == "UntypedStorage":
        return DtypeName(_UNTYPED)
    if module == "torch" and name in _STORAGE_DTYPES:
        return DtypeName(_STORAGE_DTYPES[name])
    if module == "torch" and name in TORCH_NAMES:
        return DtypeName(canonical(name))
    return None


class _StorageRef:
    __slots__ = ("dtype", "key", "numel")

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


class _TensorRecordUnpickler(InMemoryUnpickler):
    """Reads a plain tensor's ``data.pkl`` into a :class:`TensorRecord`; nothing else."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_record
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_record_v3
        dtype = storage_dtype(module, name)
        if dtype is not None:
            return dtype
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name == "Size":
            return torch_size
        raise refuse(self._source, module, name)

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
