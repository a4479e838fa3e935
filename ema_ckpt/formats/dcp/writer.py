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

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..._crc import crc32, crc32_combine
from ..._lazy import torch
from ...dtypes import name_of
from ...errors import CheckpointFormatError, OutputError
from ...layout import Box, boxes_cover
from ...storage import fsync_dir, start_writeback
from ...storage.direct_io import ALIGNMENT as PAGE
from ...storage.direct_io import DirectAppender
from ...torch_records import write_tensor_record
from ...torch_records.write import STORAGE_ALIGNMENT
from .metadata import METADATA_FILE
from .metadata_pickle import dump_metadata
from .metadata_unpickle import check_written_metadata

# Looked up at each call, so a test can stand in for it (a full disk mid-record).
_write_tensor_record = write_tensor_record
# A record of at least this many bytes starts 64-aligned in its file and its data starts on a
# page boundary of the file (at most 4 KiB of padding per MiB): with a page-aligned tensor, its
# bytes go to the disk straight from memory (ema_ckpt.direct_io). Small records pack densely.
_PAGE_ALIGNED_FROM = 1 << 20


_WRITEBACK_BYTES = 32 << 20


class _ChecksumFile:
    """A write-only file wrapper that keeps a CRC-32 and the position of what it wrote.

    Through the page cache (where ``O_DIRECT`` was refused), every 32 MiB it starts the disk
    write of what came before (``sync_file_range``), so the closing fsync waits for the tail
    instead of the whole file.
    """

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


def data_file_name(rank: int, part: int = 0, tag: str | None = None) -> str:
    """``__<rank>_<part>.distcp``: rank's chunks, split in parts of bounded size; with a
    ``tag``, ``__<rank>_<part>.<tag>.distcp``."""
    return f"__{rank}_{part}.{tag}.distcp" if tag else f"__{rank}_{part}.distcp"


def _file_sort_key(name: str) -> tuple[int, int, str]:
    parts = name.removeprefix("__").removesuffix(".distcp").split(".")[0].split("_")
    try:
        return int(parts[0]), int(parts[1]), name
    except (IndexError, ValueError):
        return (1 << 62, 0, name)


class DcpWriter:
    """Writes a DCP checkpoint directory chunk by chunk (see the module docstring)."""

    def __init__(self, path: Path, *, file_tag: str | None = None) -> None:
        self.path = Path(path)
        self.file_tag = file_tag
        self.path.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}
        self._bytes: dict[str, tuple[str, int, int]] = {}
        self._storage: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
        self._handles: dict[str, tuple[DirectAppender, _ChecksumFile]] = {}
        self._current = ""
        self.files: list[WrittenFile] = []

    def declare(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Announce a tensor key before its chunks are written (again: no effect)."""
        if key not in self._entries:
            self._entries[key] = _Entry(tuple(shape), dtype)

    def _file(self, name: str) -> _ChecksumFile:
        if name != self._current and self._current in self._handles:
            self._handles[self._current][0].drain()  # files stay open for the run: an idle one holds no buffer
        self._current = name
        if name not in self._handles:
            try:
                handle = DirectAppender(self.path / name)
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
        self._storage[(key, box.offsets)] = (name, start, length)
        entry.boxes.append(box)

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
        written = {k: e for k, e in self._entries.items() if e.boxes}  # the coordinator declares every key itself
        return WriterState(
            entries={k: (e.shape, e.dtype) for k, e in written.items()},
            boxes={k: list(e.boxes) for k, e in written.items()},
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
        # every key declared here, written or not (the cover check below then names a missing one)
        entries = {key: _Entry(e.shape, e.dtype) for key, e in self._entries.items()}
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
            handle.abort()
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
