"""torch.distributed.checkpoint (DCP) directories: FSDP1, FSDP2, torchtitan.

A DCP checkpoint is a directory with a ``.metadata`` pickle (or rank-local
``__<r>.metadata`` files from ``use_collectives=False``, which are merged here; torch's
own tools silently read only rank 0's) and ``__<r>_<n>.distcp`` data files. Each stored
chunk is a standalone ``torch.save`` zip record at a known offset. This reader parses the
record's zip directory and ``data.pkl`` with an allowlist, then reads the raw tensor bytes
straight into the destination buffer: one read per chunk, no pickle code, no extra copy.

Example:
    >>> reader = DcpReader("ckpts/step_1000")               # doctest: +SKIP
    >>> reader.specs()["model.embed.weight"].shape           # doctest: +SKIP
    (50304, 768)
    >>> reader.read("model.embed.weight", Box((0, 0), (16, 768))).shape  # doctest: +SKIP
    torch.Size([16, 768])
"""

from __future__ import annotations

import bisect
import io
import os
import stat
import re
import struct
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._gc import paused_gc
from .._lazy import torch
from .._pickle import TensorRecord, load_dcp_metadata_bytes, load_tensor_record
from ..dtypes import DtypeName, itemsize, name_of, torch_dtype
from ..errors import CheckpointFormatError, CheckpointNotFoundError, EmaCkptError, UnsafePickleError
from ..layout import Box, TensorSpec, boxes_cover
from ._ds_unpickle import _GLOBAL_IN_MESSAGE, _first_line, _globals_in_pickle, _torch_allows
from .base import CheckpointFormat, register_format

METADATA_FILE = ".metadata"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_MAX_PICKLE_BYTES = 1 << 20  # a tensor record's data.pkl is a few hundred bytes


def _planner_data(metadata: Any) -> dict[str, tuple[str, ...]]:
    """``planner_data`` as {key: path of strings}; anything malformed is dropped (it is only a hint)."""
    raw = getattr(metadata, "planner_data", None)
    if not isinstance(raw, dict):
        return {}
    clean: dict[str, tuple[str, ...]] = {}
    for key, path in raw.items():
        if isinstance(key, str) and isinstance(path, (tuple, list)) and path and all(isinstance(p, str) for p in path):
            clean[key] = tuple(path)
    return clean


def _int(value: Any) -> int:
    """An int from metadata, refusing floats, strings and other look-alikes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One stored chunk of a tensor: its box and where its record lies."""

    box: Box
    file: str
    offset: int
    length: int

    @property
    def rank(self) -> int | None:
        """The writing rank, from the ``__<rank>_<n>.distcp`` file name."""
        match = _DATA_FILE.match(self.file)
        return int(match.group(1)) if match else None


def _is_dcp(path: Path) -> bool:
    if not path.is_dir():
        return False
    if (path / METADATA_FILE).is_file():
        return True
    return any(_RANK_METADATA.match(p.name) and p.is_file() for p in path.iterdir())


def _incomplete(path: Path) -> str | None:
    if path.is_dir() and not _is_dcp(path) and any(_DATA_FILE.match(p.name) for p in path.iterdir()):
        return "DCP data files but no .metadata yet (a save in progress?)"
    return None


def _read_metadata_file(file: Path) -> Any:
    try:
        data = file.read_bytes()
    except OSError as err:
        raise CheckpointFormatError(file, f"cannot read ({err.strerror})") from None
    return load_dcp_metadata_bytes(data, str(file))


def load_metadata(path: Path) -> tuple[Any, list[Path]]:
    """The checkpoint's metadata and the metadata files it came from.

    With only rank-local ``__<r>.metadata`` files, every rank's file is read and their
    chunks and storage entries are merged.
    """
    global_file = path / METADATA_FILE
    if global_file.is_file():
        return _read_metadata_file(global_file), [global_file]
    files = sorted(
        (p for p in path.iterdir() if _RANK_METADATA.match(p.name) and p.is_file()),
        key=lambda p: int(_RANK_METADATA.match(p.name).group(1)),  # type: ignore[union-attr]
    )
    if not files:
        raise CheckpointNotFoundError(path, "no .metadata file: not a DCP checkpoint")
    merged = _read_metadata_file(files[0])
    for file in files[1:]:
        md = _read_metadata_file(file)
        for key, entry in md.state_dict_metadata.items():
            known = merged.state_dict_metadata.get(key)
            if known is None:
                merged.state_dict_metadata[key] = entry
            elif hasattr(known, "chunks") and hasattr(entry, "chunks"):
                seen = {tuple(c.offsets) for c in known.chunks}
                known.chunks.extend(c for c in entry.chunks if tuple(c.offsets) not in seen)
        merged.storage_data = {**(md.storage_data or {}), **(merged.storage_data or {})}
        if md.planner_data:
            merged.planner_data = {**md.planner_data, **(merged.planner_data or {})}
    return merged, files


class _Window(io.RawIOBase):
    """A read-only file view of ``[start, start + length)`` of an open descriptor."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


_EOCD = struct.Struct("<4sHHHHIIH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_TAIL_BYTES = 4096


def _scan_record(fd: int, offset: int, length: int) -> dict[str, tuple[int, int, int]] | None:
    """{member name: (method, size, local header offset)} of a record's zip, from its tail.

    The common case (no archive comment, no zip64, central directory in the last 4 KiB) in
    one or two reads; anything else returns None and the zipfile module handles it.
    """
    if length < _EOCD.size:
        return None
    tail_len = min(length, _TAIL_BYTES)
    tail = os.pread(fd, tail_len, offset + length - tail_len)
    if len(tail) != tail_len:
        return None
    sig, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, tail_len - _EOCD.size)
    if sig != b"PK\x05\x06" or comment or entries == 0xFFFF or cd_offset == 0xFFFFFFFF:
        return None
    if cd_offset + cd_size + _EOCD.size > length:  # a zip64 end record may sit in between
        return None
    cd_in_tail = cd_offset - (length - tail_len)
    if cd_in_tail < 0:
        return None
    members: dict[str, tuple[int, int, int]] = {}
    pos = cd_in_tail
    for _ in range(entries):
        if pos + _CENTRAL.size > tail_len - _EOCD.size:
            return None
        fields = _CENTRAL.unpack_from(tail, pos)
        if fields[0] != b"PK\x01\x02":
            return None
        method, size, name_len, extra_len, comment_len, local = fields[4], fields[9], fields[10], fields[11], fields[12], fields[16]
        if size == 0xFFFFFFFF or local == 0xFFFFFFFF:
            return None
        name = tail[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len].decode("utf-8", "replace")
        members[name] = (method, size, local)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return members


def _member_start(fd: int, offset: int, length: int, local: int) -> int | None:
    """Where a member's data starts in its record, from its local header; None if malformed."""
    if not 0 <= local <= length - _LOCAL_HEADER.size:
        return None
    header = os.pread(fd, _LOCAL_HEADER.size, offset + local)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        return None
    fields = _LOCAL_HEADER.unpack(header)
    return local + _LOCAL_HEADER.size + fields[9] + fields[10]


def _pread_into(fd: int, view: memoryview, offset: int, file: str) -> None:
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointFormatError(file, f"truncated: expected {total} bytes at offset {offset}")
        done += n


def _refused_in_record(message: str, record: bytes) -> str | None:
    """The global torch's weights-only loader refused in a record, from its message or its pickle."""
    if "weights_only" not in message and "Weights only" not in message and "GLOBAL" not in message:
        return None
    match = _GLOBAL_IN_MESSAGE.search(message)
    if match:
        name = match.group(1)
        return name if "." in name else f"builtins.{name}"
    try:
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            names = _globals_in_pickle(archive.read(pkl)) if pkl else []
    except Exception:  # a damaged record: reported as unreadable, not as a refused global
        return None
    refused = [n for n in names if not _torch_allows(n)]
    return refused[0] if refused else None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class DcpReader:
    """Reader for one DCP checkpoint directory (see the module docstring)."""

    format_name = "dcp"

    def __init__(self, path: str | Path, *, shared: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.step: int | None = None
        self._fds: dict[str, int] = {}
        self._file_sizes: dict[str, int] = {}
        self._names: dict[str, str] = {}
        self._fallback: tuple[tuple[str, int], torch.Tensor] | None = None
        self._records: dict[tuple[str, int], tuple[int, TensorRecord] | None] = {}
        self._specs: dict[str, TensorSpec] | None = None  # built on first use: needs torch
        if shared is not None:  # parsed by another worker: see share()
            for name in self._SHARED:
                setattr(self, name, shared[name])
            with paused_gc():  # sent as tuples: see share()
                self._chunks = {key: [StoredChunk(Box(offsets, sizes), file, offset, length)
                                      for offsets, sizes, file, offset, length in chunks]
                                for key, chunks in self._chunks.items()}
            return
        with paused_gc():
            self._parse()

    def _parse(self) -> None:
        metadata, self.metadata_files = load_metadata(self.path)
        self._version = getattr(metadata, "version", None)
        self.planner_data: dict[str, tuple[str, ...]] = _planner_data(metadata)
        self.non_tensor_keys: list[str] = []
        self._stored: dict[str, tuple[tuple[int, ...], str]] = {}  # key → (shape, dtype name)
        self._chunks: dict[str, list[StoredChunk]] = {}
        self._starts: dict[str, tuple[list[int], int]] = {}
        self._bytes_records: dict[str, tuple[str, int, int]] = {}
        self._file_ends: dict[str, int] = {}  # data file → the end of its last record
        self._records_all: list[tuple[str, int, int]] = []  # every stored record, optimizer's too
        try:
            self._index(metadata)
        except (AttributeError, TypeError, ValueError, OverflowError) as err:
            raise CheckpointFormatError(
                self.metadata_files[0], f"malformed DCP metadata ({type(err).__name__}: {err})"
            ) from None
        self._check_file_sizes()

    def _check_file_sizes(self) -> None:
        """Every data file the metadata names is there and as long as its last record needs.

        One ``stat`` per file, so a checkpoint cut short anywhere (also in records a run never
        reads, such as the optimizer's) is refused before anything of it is used.
        """
        for file, end in sorted(self._file_ends.items()):
            full = self.path / file
            try:
                info = full.stat()
            except FileNotFoundError:
                raise CheckpointFormatError(full, "data file named by the metadata is missing") from None
            except OSError as err:
                raise CheckpointFormatError(full, f"cannot stat data file ({err.strerror})") from None
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointFormatError(full, "not a regular file")
            size = info.st_size
            if size < end:
                raise CheckpointFormatError(
                    full, f"truncated: {size} bytes, but the metadata has records up to byte {end}"
                )

    _SHARED = ("metadata_files", "_version", "planner_data", "non_tensor_keys", "_stored", "_chunks", "_starts",
               "_bytes_records")

    def share(self) -> dict[str, Any]:
        """What parsing the metadata produced, as plain data: ``DcpReader(path, shared=...)``
        rebuilds this reader without parsing again (workers split the parsing of many inputs)."""
        shared = {name: getattr(self, name) for name in self._SHARED}
        # as tuples: pickling 20,000 dataclass instances to send them costs 10× more
        with paused_gc():
            shared["_chunks"] = {key: [(c.box.offsets, c.box.sizes, c.file, c.offset, c.length) for c in chunks]
                                 for key, chunks in self._chunks.items()}
        return shared

    def _index(self, metadata: Any) -> None:
        storage = self._storage_index(metadata)
        for key, entry in metadata.state_dict_metadata.items():
            if not isinstance(key, str):
                raise TypeError(f"key {key!r} is not a string")
            if not hasattr(entry, "chunks"):
                self.non_tensor_keys.append(key)
                if key in storage.get("bytes", {}):
                    self._bytes_records[key] = storage["bytes"][key]
                continue
            shape = tuple(_int(d) for d in entry.size)
            dtype = entry.properties.dtype
            if not isinstance(dtype, DtypeName):
                raise TypeError(f"key {key!r}: dtype {dtype!r} is not a torch dtype")
            chunks = []
            for chunk in entry.chunks:
                box = Box(tuple(_int(o) for o in chunk.offsets), tuple(_int(s) for s in chunk.sizes))
                if any(s < 0 for s in box.sizes) or box.numel == 0:
                    if any(s < 0 for s in box.sizes):
                        raise ValueError(f"key {key!r}: negative chunk size {list(box.sizes)}")
                    continue
                where = storage["tensor"].get((key, box.offsets))
                if where is None:
                    raise CheckpointFormatError(
                        self.metadata_files[0], f"key {key!r}: chunk at {box.offsets} has no storage entry"
                    )
                if box.numel * itemsize(dtype) > where[2]:
                    raise ValueError(f"key {key!r}: chunk at {list(box.offsets)} is larger than its record")
                chunks.append(StoredChunk(box, *where))
            if not boxes_cover(shape, [c.box for c in chunks]):
                raise CheckpointFormatError(
                    self.metadata_files[0],
                    f"key {key!r}: stored chunks do not cover shape {list(shape)} exactly once"
                    + (" (a rank's __<r>.metadata file is missing?)" if len(self.metadata_files) > 1 or
                       self.metadata_files[0].name != METADATA_FILE else ""),
                )
            chunks.sort(key=lambda c: c.box.offsets[:1])
            self._stored[key] = (shape, str(dtype))
            self._chunks[key] = chunks
            self._starts[key] = (
                [c.box.offsets[0] for c in chunks] if shape else [],
                max((c.box.sizes[0] for c in chunks), default=0) if shape else 0,
            )

    def _storage_index(self, metadata: Any) -> dict[str, dict[Any, tuple[str, int, int]]]:
        tensor: dict[Any, tuple[str, int, int]] = {}
        blobs: dict[Any, tuple[str, int, int]] = {}
        for index, info in (metadata.storage_data or {}).items():
            rel = info.relative_path
            if not isinstance(rel, str) or "/" in rel or "\\" in rel or "\0" in rel or rel in {"", ".", ".."}:
                raise CheckpointFormatError(
                    self.metadata_files[0], f"storage path {rel!r} leaves the checkpoint directory"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointFormatError(
                    self.metadata_files[0],
                    f"key {index.fqn!r}: transformed records ({info.transform_descriptors}) are not supported",
                )
            where = (rel, _int(info.offset), _int(info.length))
            if where[1] < 0 or where[2] < 0:
                raise ValueError(f"key {index.fqn!r}: negative storage offset or length")
            self._file_ends[rel] = max(self._file_ends.get(rel, 0), where[1] + where[2])
            self._records_all.append(where)
            if index.offset is None:
                blobs[index.fqn] = where
            else:
                tensor[(index.fqn, tuple(int(o) for o in index.offset))] = where
        return {"tensor": tensor, "bytes": blobs}

    # -- protocol ---------------------------------------------------------------------

    def specs(self) -> Mapping[str, TensorSpec]:
        if self._specs is None:
            with paused_gc():
                self._specs = {
                    key: TensorSpec(key, shape, torch_dtype(dtype)) for key, (shape, dtype) in self._stored.items()
                }
        return self._specs

    def stored(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype name)} without importing torch."""
        return self._stored

    def open_data(self, file: str) -> int:
        """A read-only descriptor of data file ``file`` (owned by the reader; closed by :meth:`close`)."""
        return self._fd(file)

    def byte_ranges(self, key: str) -> list[tuple[str, int, int]] | None:
        """``key``'s bytes in row-major order as (file, offset, length) ranges, or None.

        None when the tensor is not a concatenation of stored byte runs: chunks split
        along a dimension other than 0, or records that are not plain contiguous tensors.
        Reads only record headers; never imports torch.
        """
        shape, dtype = self._stored[key]
        size = itemsize(dtype)
        ranges = []
        for chunk in self._chunks[key]:
            if chunk.box.sizes[1:] != shape[1:]:
                return None
            found = self._record(key, chunk)
            if found is None or not found[1].is_contiguous:
                return None
            data_offset, record = found
            self._check_record(key, chunk, record.size, record.dtype)
            if record.storage_offset + chunk.box.numel > record.storage_numel:
                raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record storage too small")
            ranges.append((chunk.file, data_offset + record.storage_offset * size, chunk.box.numel * size))
        return ranges

    def layout(self, key: str) -> Sequence[Box]:
        return [c.box for c in self._chunks[key]]

    def chunks(self, key: str) -> Sequence[StoredChunk]:
        """The stored chunks of ``key`` with their files and offsets."""
        return self._chunks[key]

    supports_out = True  # read() can fill a caller's buffer (the engine reuses its buffers)

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """``box`` of ``key``; into ``out`` (contiguous, right shape and dtype) when given."""
        spec = self.specs()[key]
        if len(box.sizes) != len(spec.shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, spec.shape, strict=True)
        ):
            raise ValueError(f"{key}: box {box} lies outside shape {spec.shape}")
        candidates = self._candidates(key, box)
        for chunk in candidates:
            self._check_extent(chunk.file, chunk.offset, chunk.length)
        if out is None:
            out = torch.empty(box.sizes, dtype=spec.dtype)
        elif tuple(out.shape) != box.sizes or out.dtype != spec.dtype or not out.is_contiguous():
            raise ValueError(f"{key}: buffer {tuple(out.shape)} {out.dtype} does not fit {box} {spec.dtype}")
        if out.numel() == 0:
            return out
        filled = 0
        for chunk in candidates:
            part = chunk.box.intersect(box) if box.sizes else chunk.box
            if part is None:
                continue
            dest = out[part.relative_to(box).slices()] if box.sizes else out
            self._read_chunk_part(key, chunk, part.relative_to(chunk.box), dest)
            filled += part.numel
        if filled != box.numel:
            raise CheckpointFormatError(self.metadata_files[0], f"key {key!r}: stored chunks do not cover {box}")
        return out

    def _candidates(self, key: str, box: Box) -> list[StoredChunk]:
        """Stored chunks that may intersect ``box``: a bisection on dim-0 offsets."""
        chunks = self._chunks[key]
        if not box.sizes:
            return chunks
        starts, longest = self._starts[key]
        lo = bisect.bisect_left(starts, box.offsets[0] - longest + 1)
        hi = bisect.bisect_left(starts, box.offsets[0] + box.sizes[0])
        return chunks[lo:hi]

    def read_bytes(self, key: str) -> bytes:
        """The raw stored record of a non-tensor entry (never unpickled here)."""
        file, offset, length = self._bytes_records[key]
        fd = self._fd(file)
        self._check_extent(file, offset, length)
        return os.pread(fd, length, offset)

    def info(self) -> dict[str, Any]:
        ranks = sorted({c.rank for cs in self._chunks.values() for c in cs if c.rank is not None})
        files = sorted({c.file for cs in self._chunks.values() for c in cs})
        return {
            "metadata_files": [p.name for p in self.metadata_files],
            "rank_local_metadata": self.metadata_files[0].name != METADATA_FILE,
            "version": self._version,
            "data_files": len(files),
            "ranks": len(ranks),
            "chunks": sum(len(cs) for cs in self._chunks.values()),
            "non_tensor_keys": list(self.non_tensor_keys),
            "top_level": sorted({self.root_of(k) for k in self._stored}),
        }

    def root_of(self, key: str) -> str:
        """The top-level state-dict name ``key`` was saved under (``model``, ``optim``, …).

        Uses ``planner_data`` (keys themselves contain dots and must not be split).
        """
        path = self.planner_data.get(key)
        if path:
            return str(path[0])
        return key.split(".", 1)[0]

    def stored_records(self) -> list[tuple[str, int, int]]:
        """Every record the metadata names, as (data file, offset, length): model, optimizer, bytes."""
        return sorted(set(self._records_all))

    def open_record(self, file: str, offset: int, length: int) -> Any:
        """A read-only file view of one record (a standalone ``torch.save`` zip)."""
        self._check_extent(file, offset, length)
        return _Window(self._fd(file), offset, length)

    def container_of(self, key: str) -> str | None:
        """The state-dict container ``key`` was nested in when saved, or None.

        ``dcp.save({"model": model.state_dict()})`` flattens ``fc.weight`` to ``model.fc.weight``
        and records the path ``("model", "fc.weight")``: ``model`` is a container. A module
        attribute named ``model`` (``dcp.save(wrapper.state_dict())``) is recorded as one
        part, ``("model.fc.weight",)``, and is no container. Without ``planner_data`` nothing
        was nested.
        """
        path = self.planner_data.get(key)
        return str(path[0]) if path is not None and len(path) > 1 else None

    def close(self) -> None:
        self._fallback = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> DcpReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records ---------------------------------------------------------------------

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            full = self.path / file
            try:
                fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as err:
                raise CheckpointFormatError(full, f"cannot open data file ({err.strerror})") from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                raise CheckpointFormatError(full, "not a regular file")
            self._fds[file] = fd
            self._file_sizes[file] = info.st_size
        return fd

    def _name(self, file: str) -> str:
        """The data file's full path, for messages (cached: built on every read otherwise)."""
        name = self._names.get(file)
        if name is None:
            name = self._names[file] = str(self.path / file)
        return name

    def _check_extent(self, file: str, offset: int, length: int) -> None:
        self._fd(file)
        if offset < 0 or length < 0 or offset + length > self._file_sizes[file]:
            raise CheckpointFormatError(
                self.path / file,
                f"truncated: a record ends at byte {offset + length} but the file has "
                f"{self._file_sizes[file]}",
            )

    def _record(self, key: str, chunk: StoredChunk) -> tuple[int, TensorRecord] | None:
        """(absolute data offset, record) for a plain tensor record, else None."""
        cache_key = (chunk.file, chunk.offset)
        if cache_key in self._records:
            return self._records[cache_key]
        self._check_extent(chunk.file, chunk.offset, chunk.length)
        fd = self._fd(chunk.file)
        source = f"{self._name(chunk.file)} (key {key!r})"
        fast = _scan_record(fd, chunk.offset, chunk.length)
        if fast is not None:
            found = self._record_from_index(key, chunk, fast, source)
            if found is not False:
                self._records[cache_key] = found  # type: ignore[assignment]
                return found  # type: ignore[return-value]
        try:
            archive = zipfile.ZipFile(_Window(fd, chunk.offset, chunk.length))
            names = archive.namelist()
            pkl = next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
            pkl_info = archive.getinfo(pkl)
            if pkl_info.compress_type != zipfile.ZIP_STORED or pkl_info.file_size > _MAX_PICKLE_BYTES:
                raise CheckpointFormatError(source, "unexpected tensor record layout")
            record = load_tensor_record(archive.read(pkl), source)
            member = archive.getinfo(pkl[: -len("data.pkl")] + "data/" + record.storage_key)
        except OSError as err:
            raise CheckpointFormatError(self.path / chunk.file, f"cannot read ({err})") from None
        except Exception:  # anything unusual: torch's weights-only loader decides, or refuses
            self._records[cache_key] = None
            return None
        if not (0 <= member.header_offset < chunk.length) or record.storage_offset < 0 or record.storage_numel < 0:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: corrupt record")
        header = os.pread(fd, _LOCAL_HEADER.size, chunk.offset + member.header_offset)
        if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: corrupt record header")
        fields = _LOCAL_HEADER.unpack(header)
        start = member.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        nbytes = record.storage_numel * itemsize(record.dtype)
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != nbytes:
            self._records[cache_key] = None
            return None
        if start + nbytes > chunk.length:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record overruns its extent")
        result = (chunk.offset + start, record)
        self._records[cache_key] = result
        return result

    def _record_from_index(
        self, key: str, chunk: StoredChunk, members: dict[str, tuple[int, int, int]], source: str
    ) -> tuple[int, TensorRecord] | None | bool:
        """The record through the fast zip index; False to let the zipfile path decide."""
        fd = self._fd(chunk.file)
        pkl = next((n for n in members if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            return False
        method, size, local = members[pkl]
        if method != 0 or size > _MAX_PICKLE_BYTES:
            return False
        start = _member_start(fd, chunk.offset, chunk.length, local)
        if start is None or start + size > chunk.length:
            return False
        try:
            record = load_tensor_record(os.pread(fd, size, chunk.offset + start), source)
        except EmaCkptError:
            return False
        data = members.get(pkl[: -len("data.pkl")] + "data/" + record.storage_key)
        if data is None or data[0] != 0:
            return False
        if record.storage_offset < 0 or record.storage_numel < 0:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: corrupt record")
        nbytes = record.storage_numel * itemsize(record.dtype)
        if data[1] != nbytes:
            return None
        begin = _member_start(fd, chunk.offset, chunk.length, data[2])
        if begin is None:
            return False
        if begin + nbytes > chunk.length:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record overruns its extent")
        return (chunk.offset + begin, record)

    def _load_record_fallback(self, key: str, chunk: StoredChunk) -> torch.Tensor:
        """Load an unusual record (non-contiguous, new layout) with torch's weights-only loader.

        The last one loaded is kept: callers read a chunk block by block, and reloading the
        whole record for each block would cost its size once per block.
        """
        if self._fallback is not None and self._fallback[0] == (chunk.file, chunk.offset):
            return self._fallback[1]
        self._fallback = None  # release the previous record before loading the next
        fd = self._fd(chunk.file)
        self._check_extent(chunk.file, chunk.offset, chunk.length)
        data = os.pread(fd, chunk.length, chunk.offset)
        try:
            with warnings.catch_warnings():  # a corrupt record's odd protocol is reported below, not warned
                warnings.simplefilter("ignore")
                value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as err:
            refused = _refused_in_record(str(err), data)
            if refused is not None:  # torch's own advice (load it with weights_only=False) is never relayed
                raise UnsafePickleError(
                    self.path / chunk.file,
                    f"key {key!r}: the record at offset {chunk.offset} refers to {refused}, which is not "
                    "allowed; nothing from the file was run",
                ) from None
            first = _first_line(str(err)) or type(err).__name__
            if "weights_only" in first or "will likely succeed" in first:  # torch's advice: never relayed
                first = "refused by torch's weights-only loader"
            raise CheckpointFormatError(
                self.path / chunk.file, f"key {key!r}: unreadable record at offset {chunk.offset} ({first})"
            ) from None
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record is not a tensor")
        self._fallback = ((chunk.file, chunk.offset), value)
        return value

    def _read_chunk_part(self, key: str, chunk: StoredChunk, part: Box, dest: torch.Tensor) -> None:
        spec = self.specs()[key]
        found = self._record(key, chunk)
        if found is None or not found[1].is_contiguous:
            value = self._load_record_fallback(key, chunk)
            self._check_record(key, chunk, tuple(value.shape), name_of(value.dtype))
            dest.copy_(value[part.slices()] if part.sizes else value)
            return
        data_offset, record = found
        self._check_record(key, chunk, record.size, record.dtype)
        if record.storage_offset + chunk.box.numel > record.storage_numel:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record storage too small")
        itemsize = spec.dtype.itemsize
        base = data_offset + record.storage_offset * itemsize
        if not part.sizes:  # 0-d
            _pread_into(self._fd(chunk.file), _tensor_bytes(dest), base, self._name(chunk.file))
            return
        row_numel = chunk.box.numel // chunk.box.sizes[0]
        first, rows = part.offsets[0], part.sizes[0]
        offset = base + first * row_numel * itemsize
        full_rows = part.sizes[1:] == chunk.box.sizes[1:]
        if full_rows and dest.is_contiguous():
            _pread_into(self._fd(chunk.file), _tensor_bytes(dest), offset, self._name(chunk.file))
            return
        block = torch.empty((rows, *chunk.box.sizes[1:]), dtype=spec.dtype)
        _pread_into(self._fd(chunk.file), _tensor_bytes(block), offset, self._name(chunk.file))
        dest.copy_(block[(slice(None), *part.slices()[1:])])

    def _check_record(self, key: str, chunk: StoredChunk, size: tuple[int, ...], dtype: str) -> None:
        expected = self._stored[key][1]
        if tuple(size) != chunk.box.sizes or dtype != expected:
            raise CheckpointFormatError(
                self.path / chunk.file,
                f"key {key!r}: record holds torch.{dtype} {list(size)}, metadata says "
                f"torch.{expected} {list(chunk.box.sizes)}",
            )


def open_dcp(path: Path) -> DcpReader:
    """Open a DCP checkpoint directory."""
    return DcpReader(path)


FORMAT = register_format(CheckpointFormat("dcp", detect=_is_dcp, open=open_dcp, incomplete=_incomplete))
