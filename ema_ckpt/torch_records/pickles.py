"""The pickles inside ``torch.save`` records: read without building tensors, written without data.

A record's ``data.pkl`` goes through a restricted unpickler that admits only what plain tensors
need and turns each into a :class:`TensorRecord`, the place of its bytes. Writing: :mod:`.write`.
"""

from __future__ import annotations

import collections
import functools
import math
import pickle
from dataclasses import dataclass
from typing import Any

from ..dtypes import DtypeName, itemsize
from ..errors import CheckpointFormatError, UnsafePickleError
from ..pickles.load import Allowlist, load_pickle
from ..pickles.rules import TORCH_DTYPES, torch_size


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


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, in elements."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


UNTYPED = "untyped"
"""The dtype name of a ``torch.UntypedStorage`` (bytes; a v3 record gives the dtype apart)."""


STORAGE_GLOBALS: dict[tuple[str, str], DtypeName] = {
    **TORCH_DTYPES,
    **{("torch", f"{name}Storage"): DtypeName(dtype) for name, dtype in {
        "Double": "float64", "Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
        "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
        "ComplexFloat": "complex64", "ComplexDouble": "complex128"}.items()},
    ("torch", "UntypedStorage"): DtypeName(UNTYPED), ("torch.storage", "UntypedStorage"): DtypeName(UNTYPED),
}  # fmt: skip
"""The dtype a torch storage or dtype global names (``torch.FloatStorage``, ``torch.bfloat16``;
``torch.UntypedStorage``: :data:`UNTYPED`)."""


class PickledStorage:
    """A storage reference as the record unpicklers hand it to :func:`rebuild_record`: the
    zip member's key, the dtype name (:data:`UNTYPED` for a byte storage) and the elements."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: str, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _ints(value: Any, what: str, *, signed: bool = False) -> tuple[int, ...]:
    items = tuple(value) if isinstance(value, (tuple, list)) else None
    if items is None or not all(type(v) is int and (signed or v >= 0) for v in items):
        kind = "ints" if signed else "non-negative ints"
        raise pickle.UnpicklingError(f"tensor {what} {value!r} is not a tuple of {kind}")
    return items


def view_problem(size: tuple[int, ...], stride: tuple[int, ...], storage_offset: int, storage_numel: int,
                 item_bytes: int) -> str | None:
    """What is wrong with a tensor view of a storage of ``storage_numel`` elements, or None.

    Asked before anything is sized from a view: negative strides or offsets, a view past its
    storage, a stride of 0 on a dimension of size > 1, or overlapping strides that claim more
    elements than stored.

    Example:
        >>> view_problem((2**36,), (0,), 0, 1, 4)
        'a [68719476736] view of 1 stored elements with a stride of 0 (strides [0]): it repeats them'
        >>> view_problem((3, 4), (4, 1), 0, 12, 4) is None
        True
    """
    if len(size) != len(stride):
        return f"size {list(size)} and stride {list(stride)} differ in length"
    if any(s < 0 for s in stride):
        return f"negative stride {list(stride)}"
    if storage_offset < 0:
        return f"negative storage offset {storage_offset}"
    if any(d < 0 for d in size):
        return f"negative size {list(size)}"
    numel = math.prod(size)
    if not numel:
        return None
    reach = 1 + sum((d - 1) * s for d, s in zip(size, stride, strict=True))
    if storage_offset + reach > storage_numel:
        return (f"view outside its storage: a {list(size)} view (strides {list(stride)}, offset {storage_offset}) "
                f"reaches element {storage_offset + reach} of {storage_numel} stored "
                f"({storage_numel * item_bytes} bytes)")
    if any(s == 0 and d > 1 for d, s in zip(size, stride, strict=True)):
        return f"a {list(size)} view of {storage_numel} stored elements with a stride of 0 (strides {list(stride)}): " \
               "it repeats them"
    if numel > reach:
        return f"a {list(size)} view of {storage_numel} stored elements whose strides {list(stride)} overlap"
    return None


def tensor_view_problem(t: Any) -> str | None:
    """:func:`view_problem` of a tensor that was built (torch's own loaders): its storage's bytes."""
    item = t.element_size()
    stored = t.untyped_storage().nbytes() // item if item else 0
    return view_problem(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), stored, item)


def rebuild_record(
    storage: PickledStorage, offset: Any, size: Any, stride: Any, *_rest: Any
) -> TensorRecord:
    """torch's tensor rebuild (``_rebuild_tensor_v2``) as a record: where the bytes lie, no tensor."""
    if not isinstance(storage, PickledStorage) or type(offset) is not int:  # the callers bound the offset
        raise pickle.UnpicklingError("malformed tensor record")
    shape, strides = _ints(size, "size"), _ints(stride, "stride", signed=True)  # judged by view_problem
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"tensor size {shape} and stride {strides} differ in length")
    return TensorRecord(storage.key, storage.dtype, storage.numel, offset, shape, strides)


def rebuild_record_v3(
    storage: PickledStorage, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_rest: Any
) -> TensorRecord:
    """torch's v3 record (float8, uint16, …): an untyped byte storage plus the dtype."""
    if not isinstance(dtype, DtypeName) or storage.dtype != UNTYPED:
        raise pickle.UnpicklingError("malformed v3 tensor record")
    size_of = itemsize(dtype)
    if storage.numel % size_of:
        raise pickle.UnpicklingError(f"{storage.numel} storage bytes do not hold whole {dtype} values")
    typed = PickledStorage(storage.key, str(dtype), storage.numel // size_of)
    return rebuild_record(typed, offset, size, stride)



RECORD_GLOBALS = Allowlist({
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_record,
    ("torch._utils", "_rebuild_tensor_v3"): rebuild_record_v3,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch_size,
    **STORAGE_GLOBALS,
})
"""What a plain tensor's (or a state dict of them) ``data.pkl`` may name; nothing else."""


def _record_storage(source: str, pid: Any) -> PickledStorage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise CheckpointFormatError(source, "unexpected storage reference in tensor record")
    _, dtype, key, _location, numel = pid
    if not isinstance(dtype, DtypeName) or type(numel) is not int or numel < 0:
        raise CheckpointFormatError(source, "unexpected storage type in tensor record")
    return PickledStorage(str(key), dtype, numel)


_RECORD_CACHE: dict[bytes, TensorRecord] = {}
_RECORD_CACHE_SIZE = 4096


def load_tensor_record(data: bytes, source: str) -> TensorRecord:
    """Parse a tensor record's ``data.pkl`` without building the tensor (``UnsafePickleError``,
    ``CheckpointFormatError``)."""
    cached = _RECORD_CACHE.get(data)  # chunks of one shape and dtype share their data.pkl bytes
    if cached is not None:
        return cached
    try:
        obj = load_pickle(data, RECORD_GLOBALS, source, persistent=functools.partial(_record_storage, source))
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
