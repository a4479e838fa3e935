"""Streaming writer of ``torch.save``-format files (``.pt`` / ``.bin``) holding a flat state dict.

``torch.save`` needs the whole state dict in memory. The format itself does not: its
``data.pkl`` only names storages by key, and each storage is a separate zip member. So the
pickle is written first from shapes and dtypes alone, then each tensor's storage as it is
produced; memory holds one tensor at a time. ``torch.load(..., weights_only=True)`` reads it.

Example:
    >>> w = TorchFileWriter(Path("model.pt"))                       # doctest: +SKIP
    >>> w.begin([("w", (2, 3), torch.float32)])                     # doctest: +SKIP
    >>> w.write("w", torch.ones(2, 3)); w.finish()                  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import OutputError, UsageError

_STORAGE_NAMES = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly as a contiguous CPU tensor does, without any data."""

    def __init__(self, ref: _StorageRef, shape: tuple[int, ...]) -> None:
        self.ref, self.shape = ref, shape

    def __reduce_ex__(self, protocol: int) -> Any:
        stride = []
        acc = 1
        for dim in reversed(self.shape):
            stride.append(acc)
            acc *= dim
        return (torch._utils._rebuild_tensor_v2,
                (self.ref, 0, torch.Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", getattr(torch, _STORAGE_NAMES[obj.dtype]), obj.key, "cpu", obj.numel)
        return None


def tensor_pickle(tensor: torch.Tensor) -> bytes:
    """The ``data.pkl`` of a ``torch.save`` of one contiguous CPU tensor (storage key "0")."""
    if tensor.dtype not in _STORAGE_NAMES:
        raise UsageError(f"dtype {tensor.dtype} is not supported in DCP records here")
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_TensorStub(_StorageRef("0", tensor.dtype, tensor.numel()), tuple(tensor.shape)))
    return buffer.getvalue()


class TorchFileWriter:
    """Write a flat ``{key: tensor}`` torch file, one tensor at a time, in ``begin`` order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._order: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._cursor = 0
        self._zip: Any = None

    def begin(self, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        state = {}
        for index, (key, shape, dtype) in enumerate(tensors):
            if dtype not in _STORAGE_NAMES:
                raise UsageError(f"{key}: dtype {dtype} is not supported in torch files here")
            state[key] = _TensorStub(_StorageRef(str(index), dtype, int(torch.Size(shape).numel())), tuple(shape))
            self._order.append((key, tuple(shape), dtype))
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(state)
        data = buffer.getvalue()
        try:
            self._zip = torch._C.PyTorchFileWriter(str(self.path))
            self._zip.write_record("data.pkl", data, len(data))
            self._zip.write_record(".format_version", "1", 1)
            self._zip.write_record(".storage_alignment", "64", 2)
            self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        except (OSError, RuntimeError) as err:
            raise OutputError(f"{self.path}: cannot write ({err})") from None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """The whole tensor of the next key."""
        expected_key, shape, dtype = self._order[self._cursor]
        if key != expected_key or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"expected {expected_key} {shape} {dtype}, got {key} {tuple(tensor.shape)} {tensor.dtype}")
        tensor = tensor.contiguous()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        try:
            self._zip.write_record(f"data/{self._cursor}", tensor.untyped_storage(),
                                   tensor.numel() * tensor.element_size())
        except (OSError, RuntimeError) as err:
            raise OutputError(f"{self.path}: write failed ({err})") from None
        self._cursor += 1

    def finish(self) -> int:
        if self._cursor != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._cursor} tensors were not written")
        try:
            self._zip.write_end_of_file()
            self._zip = None
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except (OSError, RuntimeError) as err:
            raise OutputError(f"{self.path}: write failed ({err})") from None
        return self.path.stat().st_size

    def abort(self) -> None:
        self._zip = None
