"""Streaming DCP writer: each chunk is written as soon as it is produced, then freed.

torch's ``FileSystemWriter`` keeps every tensor of a data file alive until it closes; this one
appends a ``torch.save`` record per chunk to ``__<rank>_<part>.distcp`` and keeps only offsets.
``.metadata`` is written last, after every data file is flushed to disk.

Example:
    >>> w = DcpWriter(Path("out"))                                     # doctest: +SKIP
    >>> w.declare("model.w", (4, 3), torch.float32)                    # doctest: +SKIP
    >>> w.write("model.w", Box((0, 0), (2, 3)), torch.ones(2, 3), rank=0)  # doctest: +SKIP
    >>> w.write("model.w", Box((2, 0), (2, 3)), torch.ones(2, 3), rank=1)  # doctest: +SKIP
    >>> [f.name for f in w.finish()]                                   # doctest: +SKIP
    ['__0_0.distcp', '__1_0.distcp']
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..._crc import crc32, crc32_combine
from ..._lazy import torch
from ...errors import CheckpointFormatError, OutputError
from ...layout import Box
from ...storage import fsync_dir, start_writeback
from ...storage.direct_io import ALIGNMENT as PAGE
from ...storage.direct_io import DirectAppender
from ...torch_records import write_tensor_record
from ...torch_records.write import STORAGE_ALIGNMENT
from ...writers.base import WrittenFile
from .chunks import ChunkTable
from .metadata import DATA_FILE, METADATA_FILE
from .metadata_pickle import write_metadata
from .metadata_unpickle import check_written_file

# Looked up at each call, so a test can stand in for it (a full disk mid-record).
_write_tensor_record = write_tensor_record
# A record of at least this many bytes starts 64-aligned in its file and its data starts on a
# page boundary of the file (at most 4 KiB of padding per MiB): with a page-aligned tensor, its
# bytes go to the disk straight from memory (ema_ckpt.direct_io). Small records pack densely.
_PAGE_ALIGNED_FROM = 1 << 20


_WRITEBACK_BYTES = 32 << 20


class _ChecksumFile:
    """A write-only file wrapper that keeps a CRC-32 and the position of what it wrote; through
    the page cache, it starts the disk's write-back every 32 MiB (the closing fsync waits less)."""

    def __init__(self, handle: DirectAppender) -> None:
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
            self.crc32 = crc32(data, self.crc32)
        self.position += len(data)
        if self.position - self._written_back >= _WRITEBACK_BYTES and not self._handle.direct:
            self._handle.flush()
            start_writeback(self._handle.fileno(), self._written_back, self.position - self._written_back)
            self._written_back = self.position
        return n

    def flush(self) -> None:
        self._handle.flush()

    def tell(self) -> int:
        return self.position


_NO_RECORD = -1  # the file index of an empty chunk: it has no stored record


@dataclass
class WriterState:
    """What one worker wrote, for the coordinator's ``.metadata``: one row per chunk as parallel
    columns (key, shape, dtype, box, and in ``where`` three numbers: index into ``names`` or
    ``-1``, offset, length), no object per chunk beyond those it shares with the plan."""

    keys: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    where: array[int] = field(default_factory=lambda: array("q"))
    names: list[str] = field(default_factory=list)
    blobs: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    files: list[WrittenFile] = field(default_factory=list)

    def record(self, row: int) -> tuple[str, int, int] | None:
        """Row ``row``'s stored record (data file, offset, length), or None for an empty chunk."""
        file, offset, length = self.where[3 * row:3 * row + 3]
        return None if file == _NO_RECORD else (self.names[file], offset, length)


def data_file_name(rank: int, part: int = 0, tag: str | None = None) -> str:
    """``__<rank>_<part>.distcp``, or ``__<rank>_<part>.<tag>.distcp``."""
    return f"__{rank}_{part}.{tag}.distcp" if tag else f"__{rank}_{part}.distcp"


def _file_sort_key(name: str) -> tuple[int, int, str]:
    found = DATA_FILE.match(name)
    return (int(found[1]), int(found[2]), name) if found else (1 << 62, 0, name)


IDLE_BYTES = 32 << 20


class DcpWriter:
    """Writes a DCP checkpoint directory chunk by chunk (see the module docstring)."""

    def __init__(self, path: Path, *, file_tag: str | None = None) -> None:
        self.path = Path(path)
        self.file_tag = file_tag
        self.path.mkdir(parents=True, exist_ok=True)
        self._declared: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._kinds: dict[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]] = {}
        self._written = WriterState()
        self._name_index: dict[str, int] = {}
        self._bytes: dict[str, tuple[str, int, int]] = {}
        self._handles: dict[str, tuple[DirectAppender, _ChecksumFile]] = {}
        self._current = ""
        self._idle: dict[str, int] = {}  # open files not being written: the bytes each holds, oldest first
        self._idle_bytes = 0
        self.files: list[WrittenFile] = []

    def declare(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Announce a tensor key before its chunks are written (again: no effect)."""
        if key not in self._declared:
            kind = (tuple(shape), dtype)
            self._declared[key] = self._kinds.setdefault(kind, kind)

    def _file(self, name: str) -> _ChecksumFile:
        if name != self._current and self._current in self._handles:
            self._park(self._current)
        self._current = name
        self._idle_bytes -= self._idle.pop(name, 0)
        if name not in self._handles:
            try:
                handle = DirectAppender(self.path / name)
            except OSError as err:
                raise OutputError(f"{self.path / name}: cannot create ({err.strerror})") from None
            self._handles[name] = (handle, _ChecksumFile(handle))
        return self._handles[name][1]

    def _park(self, name: str) -> None:
        """``name`` goes idle, open, holding what it gathered short of a direct write; past
        :data:`IDLE_BYTES` for all idle files, the oldest are written out."""
        handle = self._handles[name][0]
        handle.drain()
        self._idle[name] = handle.gathered
        self._idle_bytes += handle.gathered
        while self._idle_bytes > IDLE_BYTES:
            oldest = next(iter(self._idle))
            self._handles[oldest][0].drain(0)  # every whole block written; a page at most stays
            self._idle_bytes -= self._idle.pop(oldest)

    def _record(self, key: str, kind: tuple[tuple[int, ...], torch.dtype], box: Box, file: int, start: int,
                length: int) -> None:
        written = self._written
        written.keys.append(key)
        written.shapes.append(kind[0])
        written.dtypes.append(kind[1])
        written.boxes.append(box)
        written.where.extend((file, start, length))

    def write(self, key: str, box: Box, tensor: torch.Tensor, *, rank: int = 0, part: int = 0) -> None:
        """Append one chunk of ``key`` (``tensor`` holds exactly ``box``) to ``__<rank>_<part>.distcp``."""
        kind = self._declared[key]
        if tuple(tensor.shape) != box.sizes or tensor.dtype != kind[1]:
            raise ValueError(f"{key}: chunk {tuple(tensor.shape)} {tensor.dtype} does not match {box}")
        if box.numel == 0:
            self._record(key, kind, box, _NO_RECORD, 0, 0)
            return
        tensor = tensor.detach().cpu().contiguous()
        name = data_file_name(rank, part, self.file_tag)
        out = self._file(name)
        big = tensor.numel() * tensor.element_size() >= _PAGE_ALIGNED_FROM
        try:
            if big and out.tell() % STORAGE_ALIGNMENT:  # a gap: the record starts 64-aligned
                out.write(b"\0" * (-out.tell() % STORAGE_ALIGNMENT))
            start = out.tell()
            length = _write_tensor_record(out, tensor, start=start,
                                          data_alignment=PAGE if big else STORAGE_ALIGNMENT)
        except OSError as err:
            raise OutputError(f"{self.path}: write failed ({err.strerror})") from None
        index = self._name_index.get(name)
        if index is None:
            index = self._name_index[name] = len(self._written.names)
            self._written.names.append(name)
        self._record(key, kind, box, index, start, length)

    def write_bytes(self, key: str, record: bytes, *, rank: int = 0, part: int = 0) -> None:
        """Copy a non-tensor entry's stored record verbatim."""
        name = data_file_name(rank, part, self.file_tag)
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
        # the columns themselves, not copies: nothing is written after close
        return replace(self._written, blobs=dict(self._bytes), files=list(self.files))

    def finish(
        self,
        planner_data: Mapping[str, tuple[str, ...]] | None = None,
        others: list[WriterState] | tuple[WriterState, ...] = (),
        key_order: list[str] | None = None,
    ) -> list[WrittenFile]:
        """Close, merge the other workers' states, write ``.metadata`` last (keys in ``key_order``,
        whatever the number of workers), fsync the directory."""
        own = self.close()
        states = [own, *others]
        table = ChunkTable(self._declared, states, key_order)
        table.check_cover()
        for state in others:
            self._bytes.update(state.blobs)
        files = {f.name: f for state in states for f in state.files}
        self.files = [files[name] for name in sorted(files, key=_file_sort_key)]
        # a key without planner data is a flat top-level key: never guess nesting from dots
        keys = len(table) + sum(1 for k in self._bytes if k not in table)
        tmp = self.path / (METADATA_FILE + ".tmp")
        try:
            with open(tmp, "wb") as handle:
                write_metadata(handle, table, self._bytes, planner_data or {})
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as err:
            raise OutputError(f"{self.path}: write failed ({err.strerror})") from None
        del table  # the check's objects take its place
        try:
            check_written_file(tmp, keys)
        except ValueError as err:
            raise CheckpointFormatError(self.path / METADATA_FILE, str(err)) from None
        try:
            os.replace(tmp, self.path / METADATA_FILE)
            fsync_dir(self.path)
        except OSError as err:
            raise OutputError(f"{self.path}: write failed ({err.strerror})") from None
        return self.files

    def abort(self) -> None:
        """Close open files without writing metadata."""
        for handle, _ in self._handles.values():
            handle.abort()
        self._handles.clear()
