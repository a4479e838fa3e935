"""Streaming DCP writer: each chunk is written as soon as it is produced, then freed.

torch's ``FileSystemWriter`` keeps every tensor of a data file alive until that file
closes (see pytorch/pytorch#195982), so a lazily computed checkpoint still peaks at the
size of a whole rank file. This writer appends one ``torch.save`` record per chunk to
``__<rank>_0.distcp`` (the record format torch's reader expects) and keeps only offsets.
``.metadata`` is written last, after every data file is flushed to disk.

Example:
    >>> w = DcpWriter(Path("out"))                                     # doctest: +SKIP
    >>> w.declare("model.w", (4, 3), torch.float32)                    # doctest: +SKIP
    >>> w.write("model.w", Box((0, 0), (2, 3)), torch.ones(2, 3), rank=0)  # doctest: +SKIP
    >>> w.write("model.w", Box((2, 0), (2, 3)), torch.ones(2, 3), rank=1)  # doctest: +SKIP
    >>> w.finish()                                                     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .._lazy import torch
from ..dtypes import name_of
from .._pickle import check_written_metadata
from ..errors import CheckpointFormatError, OutputError
from ..fs import fsync_dir, start_writeback
from ..formats.dcp import METADATA_FILE
from ..layout import Box, boxes_cover
from ._dcp_metadata import dump_metadata


_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed: the same tensor always gives the same bytes
_ALIGN = 64  # torch aligns storage data to 64 bytes inside a record (needed to mmap it)
_PAD_FIELD = 0x5A5A  # an unassigned zip extra-field id, used only to pad


class _RecordStream:
    """Positions relative to the record start, as the record's own zip offsets must be."""

    def __init__(self, out: _ChecksumFile) -> None:
        self._out, self.position = out, 0

    def write(self, data: bytes | memoryview) -> int:
        self._out.write(data)
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass


_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL_DIR = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")
_DOS_DATE = (0 << 11) | (0 << 5) | 0, (1980 - 1980) << 9 | 1 << 5 | 1  # (time, date) = 1980-01-01


def _write_tensor_record(out: _ChecksumFile, tensor: torch.Tensor) -> int:
    """Append a standalone ``torch.save``-format zip holding ``tensor``; returns its length.

    Written from the tensor's memory as it is (a view of a reused buffer included): the data
    is hashed once (its zip CRC-32, folded into the file's CRC-32 with crc32_combine) and
    written once, with no copy and no pickle of anything but a plain tensor reference.
    """
    from .torch_file import tensor_pickle

    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= 0xFFFFFFFF:
        return _write_tensor_record_zip64(out, tensor)
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
    members: list[tuple[bytes, bytes | memoryview]] = [
        (b"archive/data.pkl", tensor_pickle(tensor)), (b"archive/.format_version", b"1"),
        (b"archive/.storage_alignment", b"64"), (b"archive/byteorder", b"little"),
        (b"archive/data/0", data), (b"archive/version", b"3"),
    ]
    position = 0
    central: list[bytes] = []
    for name, payload in members:
        crc = zlib.crc32(payload)
        extra = b""
        if name == b"archive/data/0":  # align the storage bytes as torch does (mmap needs it)
            pad = -(position + _LOCAL.size + len(name) + 4) % _ALIGN
            extra = struct.pack("<HH", _PAD_FIELD, pad) + b"\0" * pad
        header = _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, _DOS_DATE[0], _DOS_DATE[1], crc, len(payload),
                             len(payload), len(name), len(extra)) + name + extra
        central.append(_CENTRAL_DIR.pack(b"PK\x01\x02", 20, 20, 0, 0, _DOS_DATE[0], _DOS_DATE[1], crc,
                                         len(payload), len(payload), len(name), 0, 0, 0, 0, 0, position) + name)
        out.write(header)
        out.write(payload, crc=crc)
        position += len(header) + len(payload)
    directory = b"".join(central)
    out.write(directory)
    out.write(_END.pack(b"PK\x05\x06", 0, 0, len(members), len(members), len(directory), position, 0))
    return position + len(directory) + _END.size


def _write_tensor_record_zip64(out: _ChecksumFile, tensor: torch.Tensor) -> int:
    """The same record through the zipfile module, for storages of 4 GiB and more (zip64)."""
    from .torch_file import tensor_pickle

    stream = _RecordStream(out)
    archive = zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_STORED)  # type: ignore[arg-type]
    for name, data in (("archive/data.pkl", tensor_pickle(tensor)), ("archive/.format_version", b"1"),
                       ("archive/.storage_alignment", b"64"), ("archive/byteorder", b"little")):
        archive.writestr(zipfile.ZipInfo(name, date_time=_ZIP_TIME), data)
    member = zipfile.ZipInfo("archive/data/0", date_time=_ZIP_TIME)
    member.file_size = tensor.numel() * tensor.element_size()
    header = 30 + len(member.filename) + 20
    pad = -(stream.tell() + header + 4) % _ALIGN
    member.extra = struct.pack("<HH", _PAD_FIELD, pad) + b"\0" * pad
    with archive.open(member, "w", force_zip64=True) as handle:
        handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    archive.writestr(zipfile.ZipInfo("archive/version", date_time=_ZIP_TIME), b"3")
    archive.close()
    return stream.position


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


@functools.cache
def _zeros_operator(power: int) -> tuple[int, ...]:
    """The GF(2) matrix that appends 2**power zero bytes to a CRC-32 (the same for every file)."""
    if power == 0:
        operator: Sequence[int] = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
        squarings = 3  # 1 → 2 → 4 → 8 bits
    else:
        operator, squarings = _zeros_operator(power - 1), 1
    for _ in range(squarings):
        operator = [_gf2_times(operator, operator[n]) for n in range(32)]
    return tuple(operator)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B), in GF(2) as zlib's crc32_combine.

    crc(A) is carried over len(B) zero bytes, one cached operator per set bit of len(B).

    Example:
        >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
        True
    """
    power = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_operator(power), crc1)
        len2 >>= 1
        power += 1
    return crc1 ^ crc2


_WRITEBACK_BYTES = 32 << 20


class _ChecksumFile:
    """A write-only file wrapper that keeps a CRC-32 and the position of what it wrote.

    Every 32 MiB it starts the disk write of what came before (``sync_file_range``), so the
    closing fsync waits for the tail instead of the whole file.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self.crc32 = 0
        self.position = 0
        self._written_back = 0

    def write(self, data: bytes | memoryview, *, crc: int | None = None) -> int:
        """Write ``data``; ``crc`` (its own CRC-32, already known) spares hashing it again."""
        n = self._handle.write(data)
        if crc is not None and len(data) > 4096:
            self.crc32 = crc32_combine(self.crc32, crc, len(data))
        else:
            self.crc32 = zlib.crc32(data, self.crc32)
        self.position += len(data)
        if self.position - self._written_back >= _WRITEBACK_BYTES:
            self._handle.flush()
            start_writeback(self._handle.fileno(), self._written_back, self.position - self._written_back)
            self._written_back = self.position
        return n

    def flush(self) -> None:
        self._handle.flush()

    def tell(self) -> int:
        return self.position


@dataclass
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One data file the writer produced, with its size and CRC-32."""

    name: str
    size: int
    crc32: int


@dataclass
class WriterState:
    """What one writer (one worker) wrote: enough for the coordinator to write ``.metadata``."""

    entries: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    boxes: dict[str, list[Box]] = field(default_factory=dict)
    storage: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = field(default_factory=dict)
    blobs: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    files: list[WrittenFile] = field(default_factory=list)


def data_file_name(rank: int, part: int = 0) -> str:
    """``__<rank>_<part>.distcp``: rank's chunks, split in parts of bounded size."""
    return f"__{rank}_{part}.distcp"


def _file_sort_key(name: str) -> tuple[int, int, str]:
    parts = name.removeprefix("__").removesuffix(".distcp").split("_")
    try:
        return int(parts[0]), int(parts[1]), name
    except (IndexError, ValueError):
        return (1 << 62, 0, name)


class DcpWriter:
    """Writes a DCP checkpoint directory chunk by chunk (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}
        self._bytes: dict[str, tuple[str, int, int]] = {}
        self._storage: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
        self._handles: dict[str, tuple[IO[bytes], _ChecksumFile]] = {}
        self.files: list[WrittenFile] = []

    def declare(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Announce a tensor key before its chunks are written (again: no effect)."""
        if key not in self._entries:
            self._entries[key] = _Entry(tuple(shape), dtype)

    def _file(self, name: str) -> _ChecksumFile:
        if name not in self._handles:
            try:
                handle = open(self.path / name, "wb")  # noqa: SIM115 (closed in finish/abort)
            except OSError as err:
                raise OutputError(f"{self.path / name}: cannot create ({err.strerror})") from None
            self._handles[name] = (handle, _ChecksumFile(handle))
        return self._handles[name][1]

    def write(self, key: str, box: Box, tensor: torch.Tensor, *, rank: int = 0, part: int = 0) -> None:
        """Append one chunk of ``key`` (``tensor`` holds exactly ``box``) to ``__<rank>_<part>.distcp``."""
        entry = self._entries[key]
        if tuple(tensor.shape) != box.sizes or tensor.dtype != entry.dtype:
            raise ValueError(f"{key}: chunk {tuple(tensor.shape)} {tensor.dtype} does not match {box}")
        if box.numel == 0:
            entry.boxes.append(box)
            return
        tensor = tensor.detach().cpu().contiguous()
        name = data_file_name(rank, part)
        out = self._file(name)
        start = out.tell()
        try:
            length = _write_tensor_record(out, tensor)
        except OSError as err:
            raise OutputError(f"{self.path}: write failed ({err.strerror})") from None
        self._storage[(key, box.offsets)] = (name, start, length)
        entry.boxes.append(box)

    def write_bytes(self, key: str, record: bytes, *, rank: int = 0, part: int = 0) -> None:
        """Copy a non-tensor entry's stored record verbatim."""
        name = data_file_name(rank, part)
        out = self._file(name)
        start = out.tell()
        out.write(record)
        self._bytes[key] = (name, start, len(record))

    def close(self) -> WriterState:
        """Flush, fsync and close this writer's data files; what it wrote, for the coordinator."""
        try:
            for name, (handle, counted) in sorted(self._handles.items()):
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
                self.files.append(WrittenFile(name, counted.position, counted.crc32))
        except OSError as err:
            raise OutputError(f"{self.path}: write failed ({err.strerror})") from None
        self._handles.clear()
        return WriterState(
            entries={k: (e.shape, e.dtype) for k, e in self._entries.items()},
            boxes={k: list(e.boxes) for k, e in self._entries.items()},
            storage=dict(self._storage), blobs=dict(self._bytes), files=list(self.files),
        )

    def finish(
        self,
        planner_data: dict[str, tuple[str, ...]] | None = None,
        others: list[WriterState] | tuple[WriterState, ...] = (),
        key_order: list[str] | None = None,
    ) -> list[WrittenFile]:
        """Close, merge the other workers' states, write ``.metadata`` last, fsync the directory.

        ``key_order`` fixes the order of keys in the metadata (the layout order), so the
        bytes do not depend on how many workers shared the work.
        """
        own = self.close()
        self._merge([own, *others], key_order)
        for key, entry in self._entries.items():
            if not boxes_cover(entry.shape, entry.boxes):
                raise ValueError(f"{key}: written chunks do not cover shape {list(entry.shape)}")
        metadata = self._metadata(planner_data)
        try:
            check_written_metadata(metadata, len(set(self._entries) | set(self._bytes)))
        except ValueError as err:
            raise CheckpointFormatError(self.path / METADATA_FILE, str(err)) from None
        try:
            tmp = self.path / (METADATA_FILE + ".tmp")
            with open(tmp, "wb") as handle:
                handle.write(metadata)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path / METADATA_FILE)
            fsync_dir(self.path)
        except OSError as err:
            raise OutputError(f"{self.path}: write failed ({err.strerror})") from None
        return self.files

    def _merge(self, states: list[WriterState], key_order: list[str] | None) -> None:
        entries: dict[str, _Entry] = {}
        for state in states:
            for key, (shape, dtype) in state.entries.items():
                entries.setdefault(key, _Entry(shape, dtype))
        for state in states:
            for key, boxes in state.boxes.items():
                entries[key].boxes.extend(boxes)
            self._storage.update(state.storage)
            self._bytes.update(state.blobs)
        for entry in entries.values():
            entry.boxes.sort(key=lambda b: b.offsets)
        known = set(key_order or [])
        order = [k for k in (key_order or []) if k in entries] + [k for k in entries if k not in known]
        self._entries = {k: entries[k] for k in order}
        files = {f.name: f for state in states for f in state.files}
        self.files = [files[name] for name in sorted(files, key=_file_sort_key)]

    def abort(self) -> None:
        """Close open files without writing metadata."""
        for handle, _ in self._handles.values():
            handle.close()
        self._handles.clear()

    def _metadata(self, planner_data: dict[str, tuple[str, ...]] | None) -> bytes:
        tensors = {
            key: (name_of(entry.dtype), entry.shape,
                  [(box.offsets, box.sizes, self._storage.get((key, box.offsets))) for box in entry.boxes])
            for key, entry in self._entries.items()
        }
        keys = set(tensors) | set(self._bytes)
        # a key without planner data is a flat top-level key: never guess nesting from dots
        planner = {k: tuple(v) for k, v in (planner_data or {}).items() if k in keys}
        return dump_metadata(tensors, self._bytes, planner)
