"""Reading DCP chunk records: locate a record's tensor bytes and read them straight into a buffer.

A record's zip directory and ``data.pkl`` are parsed with an allowlist, then its bytes are read
into the destination, no extra copy; other records go through torch's weights-only loader.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Iterable, Mapping

from ..._lazy import torch
from ...dtypes import itemsize, name_of
from ...errors import CheckpointFormatError, EmaCkptError, RecordChecksumError, UnsafePickleError
from ...layout import Box, TensorSpec
from ...pickles.load import load_weights_only
from ...storage import BlockChecksums, Location, Source, open_readable
from ...torch_records import (
    FileWindow,
    TensorRecord,
    load_tensor_record,
    member_start,
    scan_record,
    tensor_view_problem,
    view_problem,
)
from ...torch_records.checks import ReadChecks
from ...torch_records.zipfmt import Member
from .metadata import StoredChunk

_MAX_PICKLE_BYTES = 1 << 20  # a tensor record's data.pkl is a few hundred bytes


def _check_record_crcs(data: bytes, file: Location, key: str, offset: int) -> None:
    """Every member of a whole record read into memory against its CRC-32 (members saved
    without one, CRC 0, pass); a record zipfile cannot list is left to the loader's error."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                if info.CRC != 0 and not info.is_dir():
                    archive.read(info)  # raises BadZipFile on a CRC mismatch
    except zipfile.BadZipFile as err:
        if "CRC" in str(err):
            raise RecordChecksumError(file, f"key {key!r}: the record at offset {offset} does not match its "
                                              f"CRC-32 ({err}): the file was damaged after it was written") from None
    except Exception:  # an unreadable directory or member: torch's loader reports it below
        return


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_RECENT_RECORDS = 1024


class ChunkRecords:
    """Open data files and parsed records of a :class:`~.reader.DcpReader` (a base class of it)."""

    path: Location
    _fds: dict[str, Source]
    _file_sizes: dict[str, int]
    _names: dict[str, str]
    _fallback: tuple[tuple[str, int], torch.Tensor] | None
    _records: dict[tuple[str, int], tuple[int, TensorRecord] | None]
    _stored: dict[str, tuple[tuple[int, ...], str]]
    read_checks: ReadChecks

    keep_checksums = False
    """Keep the CRC-32 of every block read, where the file is fetched in blocks (:meth:`file_crc32`)."""
    specs: Callable[[], Mapping[str, TensorSpec]]

    def block_checksums(self) -> dict[str, BlockChecksums]:
        """Per data file fetched in blocks: (block size, {block index: CRC-32}) of what was read."""
        return {file: found for file, fd in self._fds.items() if (found := fd.block_checksums()) is not None}

    def file_crc32(self, file: str, known: Iterable[Mapping[str, BlockChecksums]] = ()) -> int:
        """Data file ``file``'s CRC-32, from the blocks this reader and the readers of ``known``
        (other workers' :meth:`block_checksums`) read, reading only what none did."""
        return self._fd(file).crc32([k[file] for k in known if file in k])

    def _fd(self, file: str) -> Source:
        fd = self._fds.get(file)
        if fd is None:
            full = self.path / file
            try:
                fd = open_readable(full, checksums=self.keep_checksums)
            except OSError as err:
                raise CheckpointFormatError(full, f"cannot open data file ({err.strerror})") from None
            self._fds[file] = fd
            self._file_sizes[file] = fd.size
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
        """(absolute data offset, record) for a plain tensor record, else None (torch's loader reads it)."""
        cache_key = (chunk.file, chunk.offset)
        if cache_key not in self._records:
            self._check_extent(chunk.file, chunk.offset, chunk.length)
            if len(self._records) >= _RECENT_RECORDS:  # the recent ones: a run reads each chunk once
                self._records.clear()
            self._records[cache_key] = self._locate(key, chunk)
        return self._records[cache_key]

    def _locate(self, key: str, chunk: StoredChunk) -> tuple[int, TensorRecord] | None:
        fd, file = self._fd(chunk.file), self.path / chunk.file
        try:
            members = scan_record(fd, chunk.offset, chunk.length)
            if members is None:  # a comment, zip64, a directory far from the end
                with zipfile.ZipFile(FileWindow(fd, chunk.offset, chunk.length)) as archive:
                    members = {i.filename: Member(i.compress_type, i.file_size, i.header_offset, i.CRC)
                               for i in archive.infolist()}
        except OSError as err:
            raise CheckpointFormatError(file, f"cannot read ({err})") from None
        except Exception:  # anything unusual: torch's weights-only loader decides, or refuses
            return None
        pkl = next((n for n in members if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            return None
        method, size, local, _ = members[pkl]
        start = member_start(fd, chunk.offset, chunk.length, local)
        if method != 0 or size > _MAX_PICKLE_BYTES or start is None or start + size > chunk.length:
            return None
        try:
            record = load_tensor_record(fd.pread(size, chunk.offset + start),
                                        f"{self._name(chunk.file)} (key {key!r})")
        except EmaCkptError:
            return None
        data = members.get(pkl[: -len("data.pkl")] + "data/" + record.storage_key)
        if data is None:
            return None
        if record.storage_offset < 0 or record.storage_numel < 0:
            raise CheckpointFormatError(file, f"key {key!r}: corrupt record")
        self._check_view(key, chunk, record)
        nbytes = record.storage_numel * itemsize(record.dtype)
        if data.method != 0 or data.size != nbytes:
            return None
        begin = member_start(fd, chunk.offset, chunk.length, data.local)
        if begin is None:
            raise CheckpointFormatError(file, f"key {key!r}: corrupt record header")
        if begin + nbytes > chunk.length:
            raise CheckpointFormatError(file, f"key {key!r}: record overruns its extent")
        self.read_checks.expect(chunk.file, chunk.offset + begin, nbytes, data.crc, f"key {key!r}")
        return (chunk.offset + begin, record)

    def _load_record_fallback(self, key: str, chunk: StoredChunk) -> torch.Tensor:
        """Load an unusual record with torch's weights-only loader; the last one is kept (read block by block)."""
        if self._fallback is not None and self._fallback[0] == (chunk.file, chunk.offset):
            return self._fallback[1]
        self._fallback = None  # release the previous record before loading the next
        fd = self._fd(chunk.file)
        self._check_extent(chunk.file, chunk.offset, chunk.length)
        data = fd.pread(chunk.length, chunk.offset)
        file = self.path / chunk.file
        _check_record_crcs(data, file, key, chunk.offset)
        try:
            value = load_weights_only(data, str(file))
        except UnsafePickleError as err:
            raise UnsafePickleError(file, f"key {key!r}: the record at offset {chunk.offset} {err.reason}") from None
        except CheckpointFormatError as err:
            raise CheckpointFormatError(file, f"key {key!r}: unreadable record at offset {chunk.offset} "
                                              f"({err.reason})") from None
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(file, f"key {key!r}: record is not a tensor")
        problem = tensor_view_problem(value)
        if problem is not None:
            raise CheckpointFormatError(file, f"key {key!r}: the record at offset {chunk.offset} holds {problem}")
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
            self.read_checks.fill(self._fd(chunk.file), chunk.file, _tensor_bytes(dest), base)
            return
        row_numel = chunk.box.numel // chunk.box.sizes[0]
        first, rows = part.offsets[0], part.sizes[0]
        offset = base + first * row_numel * itemsize
        full_rows = part.sizes[1:] == chunk.box.sizes[1:]
        if full_rows and dest.is_contiguous():
            self.read_checks.fill(self._fd(chunk.file), chunk.file, _tensor_bytes(dest), offset)
            return
        block = torch.empty((rows, *chunk.box.sizes[1:]), dtype=spec.dtype)
        self.read_checks.fill(self._fd(chunk.file), chunk.file, _tensor_bytes(block), offset)
        dest.copy_(block[(slice(None), *part.slices()[1:])])

    def _check_view(self, key: str, chunk: StoredChunk, record: TensorRecord) -> None:
        """Refuse a record whose view does not fit its storage, or repeats it, before anything is read."""
        problem = view_problem(record.size, record.stride, record.storage_offset, record.storage_numel,
                               itemsize(record.dtype))
        if problem is not None:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: the record at offset "
                                                                f"{chunk.offset} holds {problem}")

    def _check_record(self, key: str, chunk: StoredChunk, size: tuple[int, ...], dtype: str) -> None:
        expected = self._stored[key][1]
        if tuple(size) != chunk.box.sizes or dtype != expected:
            raise CheckpointFormatError(
                self.path / chunk.file,
                f"key {key!r}: record holds torch.{dtype} {list(size)}, metadata says "
                f"torch.{expected} {list(chunk.box.sizes)}",
            )

