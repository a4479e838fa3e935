"""Writing ``torch.save`` records: the pickles and the zip, byte for byte what torch writes.

Pickles are made from shapes and dtypes alone; records are written straight from the tensor's memory.

Example:
    >>> import io, torch                                              # doctest: +SKIP
    >>> sink = io.BytesIO()                                           # doctest: +SKIP
    >>> write_tensor_record(sink, torch.ones(2, 3))                   # doctest: +SKIP
    1125
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .._compat import torch_load
from .._crc import crc32
from .._lazy import torch
from ..errors import UsageError
from .pickles import row_major_strides
from .zipfmt import (
    CENTRAL_HEADER,
    CENTRAL_MAGIC,
    END_MAGIC,
    END_OF_CENTRAL,
    LOCAL_HEADER,
    LOCAL_MAGIC,
    ZIP32_LIMIT,
)

STORAGE_ALIGNMENT = 64
"""torch aligns storage data to 64 bytes inside a record (needed to mmap it)."""
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed: the same tensor always gives the same bytes
_DOS_DATE = (0 << 11) | (0 << 5) | 0, (1980 - 1980) << 9 | 1 << 5 | 1  # (time, date) = 1980-01-01
_PAD_FIELD = 0x5A5A  # an unassigned zip extra-field id, used only to pad


@functools.cache
def _storage_names() -> dict[Any, str]:
    return {
        torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
        torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
        torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
        torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage",
        torch.complex128: "ComplexDoubleStorage",
    }


def writable_dtype(dtype: torch.dtype) -> bool:
    """Whether records of ``dtype`` can be written here (the dtypes with a legacy typed storage)."""
    return dtype in _storage_names()


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly as a contiguous CPU tensor does, without any data."""

    def __init__(self, ref: _StorageRef, shape: tuple[int, ...]) -> None:
        self.ref, self.shape = ref, shape

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (torch_load.rebuild_functions()[torch_load.REBUILD_TENSOR],
                (self.ref, 0, torch.Size(self.shape), row_major_strides(self.shape), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", getattr(torch, _storage_names()[obj.dtype]), obj.key, "cpu", obj.numel)
        return None


def _dump(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def tensor_pickle(tensor: torch.Tensor) -> bytes:
    """The ``data.pkl`` of a ``torch.save`` of one contiguous CPU tensor (storage key "0")."""
    if tensor.dtype not in _storage_names():
        raise UsageError(f"dtype {tensor.dtype} is not supported in DCP records here")
    return _shaped_tensor_pickle(tensor.dtype, tuple(tensor.shape))


@functools.lru_cache(maxsize=4096)  # models repeat a few shapes many times
def _shaped_tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    return _dump(_TensorStub(_StorageRef("0", dtype, math.prod(shape)), shape))


def state_dict_pickle(tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """The ``data.pkl`` of ``torch.save({key: tensor})``, storages keyed "0", "1", … in order."""
    state = {}
    for index, (key, (shape, dtype)) in enumerate(tensors.items()):
        if dtype not in _storage_names():
            raise UsageError(f"{key}: dtype {dtype} is not supported in torch files here")
        state[key] = _TensorStub(_StorageRef(str(index), dtype, int(torch.Size(shape).numel())), tuple(shape))
    return _dump(state)


class RecordSink(Protocol):
    """Where records go: ``write`` may be told the data's CRC-32, already computed."""

    def write(self, data: bytes | memoryview, *, crc: int | None = None) -> int: ...


class _RecordStream:
    """Positions relative to the record start, as the record's own zip offsets must be."""

    def __init__(self, out: RecordSink) -> None:
        self._out, self.position = out, 0

    def write(self, data: bytes | memoryview) -> int:
        self._out.write(data)
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass


_JOINED_BELOW = 64 << 10  # records of tensors up to this size are joined in memory: one write


def _leading_members(pickled: bytes) -> tuple[tuple[str, bytes], ...]:
    """The members a ``torch.save`` zip holds before its storages."""
    return (("archive/data.pkl", pickled), ("archive/.format_version", b"1"),
            ("archive/.storage_alignment", b"64"), ("archive/byteorder", b"little"))


def _storage_member(name: str, nbytes: int, position: int, zip64: bool) -> zipfile.ZipInfo:
    """A storage's zip entry at file offset ``position``, padded so its bytes start 64-aligned (mmap needs it)."""
    member = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
    member.file_size = nbytes
    pad = -(position + LOCAL_HEADER.size + len(name) + (20 if zip64 else 0) + 4) % STORAGE_ALIGNMENT
    member.extra = struct.pack("<HH", _PAD_FIELD, pad) + b"\0" * pad
    return member


def write_tensor_record(out: RecordSink, tensor: torch.Tensor, *, start: int = 0,
                        data_alignment: int = STORAGE_ALIGNMENT) -> int:
    """Append a standalone ``torch.save``-format zip holding ``tensor``; returns its length.

    The data is hashed once (its CRC-32 handed to ``out.write``) and written once, uncopied.
    The storage bytes start at a multiple of ``data_alignment`` counted from ``start``, the
    record's file offset (a multiple of 64 when ``data_alignment`` is more than torch's 64).
    """
    if data_alignment != STORAGE_ALIGNMENT and (start % STORAGE_ALIGNMENT or data_alignment % STORAGE_ALIGNMENT):
        raise ValueError(f"a record at offset {start} cannot align its data to {data_alignment}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= ZIP32_LIMIT:
        return _write_tensor_record_zip64(out, tensor)
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
    members: list[tuple[bytes, bytes | memoryview]] = [
        *((name.encode(), pickled) for name, pickled in _leading_members(tensor_pickle(tensor))),
        (b"archive/data/0", data), (b"archive/version", b"3")]
    position = 0
    central: list[bytes] = []
    pieces: list[tuple[bytes | memoryview, int | None]] = []
    for name, payload in members:
        crc = crc32(payload)
        extra = b""
        if name == b"archive/data/0":  # align the storage bytes as torch does (mmap needs it)
            # torch's 64 counts from the record's start; a larger alignment from the file's
            origin = start if data_alignment != STORAGE_ALIGNMENT else 0
            pad = -(origin + position + LOCAL_HEADER.size + len(name) + 4) % data_alignment
            extra = struct.pack("<HH", _PAD_FIELD, pad) + b"\0" * pad
        header = LOCAL_HEADER.pack(LOCAL_MAGIC, 20, 0, 0, _DOS_DATE[0], _DOS_DATE[1], crc, len(payload),
                                   len(payload), len(name), len(extra)) + name + extra
        central.append(CENTRAL_HEADER.pack(CENTRAL_MAGIC, 20, 20, 0, 0, _DOS_DATE[0], _DOS_DATE[1], crc,
                                           len(payload), len(payload), len(name), 0, 0, 0, 0, 0, position) + name)
        pieces += [(header, None), (payload, crc)]
        position += len(header) + len(payload)
    directory = b"".join(central)
    pieces += [(directory, None), (END_OF_CENTRAL.pack(END_MAGIC, 0, 0, len(members), len(members),
                                                       len(directory), position, 0), None)]
    if nbytes <= _JOINED_BELOW:  # a small record: one write instead of fourteen
        out.write(b"".join(piece for piece, _crc in pieces))
    else:
        for piece, known in pieces:
            out.write(piece, crc=known)
    return position + len(directory) + END_OF_CENTRAL.size


def _write_tensor_record_zip64(out: RecordSink, tensor: torch.Tensor) -> int:
    """The same record through the zipfile module, for storages of 4 GiB and more (zip64)."""
    stream = _RecordStream(out)
    archive = zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_STORED)  # type: ignore[call-overload]
    for name, data in _leading_members(tensor_pickle(tensor)):
        archive.writestr(zipfile.ZipInfo(name, date_time=_ZIP_TIME), data)
    member = _storage_member("archive/data/0", tensor.numel() * tensor.element_size(), stream.tell(), True)
    with archive.open(member, "w", force_zip64=True) as handle:
        handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    archive.writestr(zipfile.ZipInfo("archive/version", date_time=_ZIP_TIME), b"3")
    archive.close()
    return stream.position


class StateDictFileWriter:
    """A ``torch.save`` file of a flat ``{key: tensor}`` dict, streamed block by block.

    The pickle is written first from shapes and dtypes alone, then each tensor's rows in
    order (each storage its own zip member): memory holds one block. ``wrap`` turns the state
    dict's pickle into the pickle of an object holding it (:func:`~.emit.wrap_pickle`).

    Example:
        >>> w = StateDictFileWriter(Path("model.pt"), [("w", (2, 3), torch.float32)])  # doctest: +SKIP
        >>> w.write("w", torch.ones(1, 3)); w.write("w", torch.zeros(1, 3))          # doctest: +SKIP
        >>> w.finish()                                                                  # doctest: +SKIP
    """

    def __init__(self, path: Any, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 wrap: Callable[[bytes], bytes] | None = None) -> None:
        self.path = path
        self._order = [(key, tuple(shape), dtype) for key, shape, dtype in tensors]
        for key, _shape, dtype in self._order:
            if not writable_dtype(dtype):
                raise UsageError(f"{key}: dtype {dtype} is not supported in torch files here")
        self._cursor = 0
        self._member: Any = None
        self._remaining = 0
        self._handle = open(path, "wb")  # noqa: SIM115 (closed in finish/abort)
        self._zip = zipfile.ZipFile(self._handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        state = state_dict_pickle({key: (shape, dtype) for key, shape, dtype in self._order})
        if wrap is not None:  # the state dict inside a larger object (a Lightning checkpoint)
            state = wrap(state)
        for name, data in _leading_members(state):
            self._zip.writestr(zipfile.ZipInfo(name, date_time=_ZIP_TIME), data)

    def write(self, key: str, block: torch.Tensor) -> None:
        """The next rows of ``key`` (tensors in the order given, each tensor's rows in order)."""
        if self._member is None:
            self._open_member()
        expected, _shape, dtype = self._order[self._cursor]
        if key != expected or block.dtype != dtype:
            raise ValueError(f"expected bytes of {expected} ({dtype}), got {key} ({block.dtype})")
        data = memoryview(block.contiguous().reshape(-1).view(torch.uint8).numpy()) if block.numel() else b""
        if len(data) > self._remaining:
            raise ValueError(f"{key}: {len(data)} bytes more than the {self._remaining} left of its storage")
        self._member.write(data)
        self._remaining -= len(data)
        if self._remaining == 0:
            self._member.close()
            self._member = None
            self._cursor += 1

    def _open_member(self) -> None:
        _key, shape, dtype = self._order[self._cursor]
        nbytes = math.prod(shape) * dtype.itemsize
        zip64 = nbytes >= ZIP32_LIMIT
        member = _storage_member(f"archive/data/{self._cursor}", nbytes, self._handle.tell(), zip64)
        self._member = self._zip.open(member, "w", force_zip64=zip64)
        self._remaining = nbytes

    def finish(self) -> int:
        """Close the zip, fsync; returns the file size."""
        while self._cursor < len(self._order) and math.prod(self._order[self._cursor][1]) == 0:
            self.write(self._order[self._cursor][0], torch.empty(0, dtype=self._order[self._cursor][2]))
        if self._cursor != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._cursor} tensors were not written")
        self._zip.writestr(zipfile.ZipInfo("archive/version", date_time=_ZIP_TIME), b"3")
        self._zip.close()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        size = self._handle.tell()
        self._handle.close()
        return size

    def abort(self) -> None:
        """Close the file without finishing it (the caller removes it)."""
        self._handle.close()
