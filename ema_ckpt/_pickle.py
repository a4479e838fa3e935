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
from dataclasses import dataclass
from typing import Any

import torch

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
_DTYPES = {
    name
    for name in dir(torch)
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_LAYOUTS = {"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"}
_MEMORY_FORMATS = {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}


def _refuse(source: str, module: str, name: str) -> UnsafePickleError:
    return UnsafePickleError(
        source, f"refers to {module}.{name}, which is not allowed; nothing from the file was run"
    )


class _DcpMetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, source: str) -> None:
        super().__init__(data)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == _DCP_METADATA_MODULE and name in _DCP_METADATA_CLASSES)
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch" and (name in _DTYPES or name == "Size"))
            or (module == "torch" and (name in _LAYOUTS or name in _MEMORY_FORMATS))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath", "Path"})
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise _refuse(self._source, module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse(self._source, "persistent_load", repr(pid)[:40])


def load_dcp_metadata_bytes(data: bytes, source: str) -> Any:
    """Unpickle DCP ``Metadata`` from ``data``, admitting only DCP's metadata classes.

    ``source`` names the file in error messages.
    """
    try:
        obj = _DcpMetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafePickleError:
        raise
    except Exception as err:  # any malformed pickle: one clean line, never a traceback
        raise CheckpointFormatError(source, f"not a readable DCP metadata pickle ({err})") from None
    if type(obj).__name__ != "Metadata" or not hasattr(obj, "state_dict_metadata"):
        raise CheckpointFormatError(source, "does not hold DCP Metadata")
    return obj


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where a tensor's bytes lie inside a ``torch.save`` zip, from its ``data.pkl``."""

    storage_key: str
    dtype: torch.dtype
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
        "Double": torch.float64,
        "Float": torch.float32,
        "Half": torch.float16,
        "BFloat16": torch.bfloat16,
        "Long": torch.int64,
        "Int": torch.int32,
        "Short": torch.int16,
        "Char": torch.int8,
        "Byte": torch.uint8,
        "Bool": torch.bool,
        "ComplexFloat": torch.complex64,
        "ComplexDouble": torch.complex128,
    }.items()
}


class _StorageRef:
    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _rebuild_record(
    storage: _StorageRef, offset: int, size: Any, stride: Any, *_rest: Any
) -> TensorRecord:
    return TensorRecord(storage.key, storage.dtype, storage.numel, int(offset), tuple(size), tuple(stride))


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads a plain tensor's ``data.pkl`` into a :class:`TensorRecord`; nothing else."""

    def __init__(self, data: io.BytesIO, source: str) -> None:
        super().__init__(data)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_record
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise _refuse(self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(self._source, "unexpected storage reference in tensor record")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(self._source, "unexpected storage type in tensor record")
        return _StorageRef(str(key), dtype, int(numel))


def load_tensor_record(data: bytes, source: str) -> TensorRecord:
    """Parse a tensor record's ``data.pkl`` without building the tensor.

    Raises:
        UnsafePickleError: the pickle names a global outside the allowlist.
        CheckpointFormatError: it is not a single plain tensor.
    """
    try:
        obj = _TensorRecordUnpickler(io.BytesIO(data), source).load()
    except (UnsafePickleError, CheckpointFormatError):
        raise
    except Exception as err:
        raise CheckpointFormatError(source, f"unreadable tensor record ({err})") from None
    if not isinstance(obj, TensorRecord):
        raise CheckpointFormatError(source, "record does not hold a single tensor")
    return obj
