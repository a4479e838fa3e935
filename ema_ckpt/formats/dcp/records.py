"""Reading DCP chunk records: locate a record's tensor bytes and read them straight into a buffer.

A record's zip directory and ``data.pkl`` are parsed with an allowlist, then its bytes are read
into the destination, no extra copy; other records go through torch's weights-only loader.
"""

from __future__ import annotations

import io
import warnings
import zipfile
from collections.abc import Iterable, Mapping

from ..._lazy import torch
from ...dtypes import itemsize, name_of
from ...errors import CheckpointFormatError, EmaCkptError, RecordChecksumError, UnsafePickleError
from ...layout import Box, TensorSpec
from ...pickles.rules import GLOBAL_IN_MESSAGE, first_line, globals_in_pickle, refusal, torch_allows
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
from ...torch_records.zipfmt import LOCAL_HEADER, LOCAL_MAGIC, Member
from .metadata import StoredChunk

_MAX_PICKLE_BYTES = 1 << 20  # a tensor record's data.pkl is a few hundred bytes


def _pread_into(fd: Source, view: memoryview, offset: int, file: str) -> None:
    if not fd.fill(view, offset):
        raise CheckpointFormatError(file, f"truncated: expected {len(view)} bytes at offset {offset}")


def _refused_in_record(message: str, record: bytes) -> str | None:
    """The global torch's weights-only loader refused in a record, from its message or its pickle."""
    if "weights_only" not in message and "Weights only" not in message and "GLOBAL" not in message:
        return None
    match = GLOBAL_IN_MESSAGE.search(message)
    if match:
        name = match.group(1)
        return name if "." in name else f"builtins.{name}"
    try:
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            names = globals_in_pickle(archive.read(pkl)) if pkl else []
    except Exception:  # a damaged record: reported as unreadable, not as a refused global
        return None
    refused = [n for n in names if not torch_allows(n)]
    return refused[0] if refused else None


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

    def specs(self) -> Mapping[str, TensorSpec]:
        raise NotImplementedError

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

    def _remember(self, cache_key: tuple[str, int], found: tuple[int, TensorRecord] | None) -> None:
        """Keep a parsed record for the next read of its chunk (the recent ones: a run reads each once)."""
        if len(self._records) >= _RECENT_RECORDS:
            self._records.clear()
        self._records[cache_key] = found

    def _record(self, key: str, chunk: StoredChunk) -> tuple[int, TensorRecord] | None:
        """(absolute data offset, record) for a plain tensor record, else None."""
        cache_key = (chunk.file, chunk.offset)
        if cache_key in self._records:
            return self._records[cache_key]
        self._check_extent(chunk.file, chunk.offset, chunk.length)
        fd = self._fd(chunk.file)
        source = f"{self._name(chunk.file)} (key {key!r})"
        fast = scan_record(fd, chunk.offset, chunk.length)
        if fast is not None:
            found = self._record_from_index(key, chunk, fast, source)
            if found is not False:
                self._remember(cache_key, found)  # type: ignore[arg-type]
                return found  # type: ignore[return-value]
        try:
            archive = zipfile.ZipFile(FileWindow(fd, chunk.offset, chunk.length))
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
            self._remember(cache_key, None)
            return None
        if not (0 <= member.header_offset < chunk.length) or record.storage_offset < 0 or record.storage_numel < 0:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: corrupt record")
        self._check_view(key, chunk, record)
        header = fd.pread(LOCAL_HEADER.size, chunk.offset + member.header_offset)
        if len(header) != LOCAL_HEADER.size or header[:4] != LOCAL_MAGIC:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: corrupt record header")
        fields = LOCAL_HEADER.unpack(header)
        start = member.header_offset + LOCAL_HEADER.size + fields[9] + fields[10]
        nbytes = record.storage_numel * itemsize(record.dtype)
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != nbytes:
            self._remember(cache_key, None)
            return None
        if start + nbytes > chunk.length:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record overruns its extent")
        self.read_checks.expect(chunk.file, chunk.offset + start, nbytes, member.CRC, f"key {key!r}")
        result = (chunk.offset + start, record)
        self._remember(cache_key, result)
        return result

    def _record_from_index(
        self, key: str, chunk: StoredChunk, members: dict[str, Member], source: str
    ) -> tuple[int, TensorRecord] | bool | None:
        """The record through the fast zip index; False to let the zipfile path decide."""
        fd = self._fd(chunk.file)
        pkl = next((n for n in members if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            return False
        method, size, local, _ = members[pkl]
        if method != 0 or size > _MAX_PICKLE_BYTES:
            return False
        start = member_start(fd, chunk.offset, chunk.length, local)
        if start is None or start + size > chunk.length:
            return False
        try:
            record = load_tensor_record(fd.pread(size, chunk.offset + start), source)
        except EmaCkptError:
            return False
        data = members.get(pkl[: -len("data.pkl")] + "data/" + record.storage_key)
        if data is None or data[0] != 0:
            return False
        if record.storage_offset < 0 or record.storage_numel < 0:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: corrupt record")
        self._check_view(key, chunk, record)
        nbytes = record.storage_numel * itemsize(record.dtype)
        if data[1] != nbytes:
            return None
        begin = member_start(fd, chunk.offset, chunk.length, data[2])
        if begin is None:
            return False
        if begin + nbytes > chunk.length:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record overruns its extent")
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
        _check_record_crcs(data, self.path / chunk.file, key, chunk.offset)
        try:
            with warnings.catch_warnings():  # a corrupt record's odd protocol is reported below, not warned
                warnings.simplefilter("ignore")
                value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as err:
            refused = _refused_in_record(str(err), data)
            if refused is not None:  # torch's own advice (load it with weights_only=False) is never relayed
                raise UnsafePickleError(
                    self.path / chunk.file,
                    f"key {key!r}: the record at offset {chunk.offset} {refusal(refused)}",
                ) from None
            first = first_line(str(err)) or type(err).__name__
            if "weights_only" in first or "will likely succeed" in first:  # torch's advice: never relayed
                first = "refused by torch's weights-only loader"
            raise CheckpointFormatError(
                self.path / chunk.file, f"key {key!r}: unreadable record at offset {chunk.offset} ({first})"
            ) from None
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record is not a tensor")
        problem = tensor_view_problem(value)
        if problem is not None:
            raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: the record at offset "
                                                                f"{chunk.offset} holds {problem}")
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
            self._read_checked(chunk.file, _tensor_bytes(dest), base)
            return
        row_numel = chunk.box.numel // chunk.box.sizes[0]
        first, rows = part.offsets[0], part.sizes[0]
        offset = base + first * row_numel * itemsize
        full_rows = part.sizes[1:] == chunk.box.sizes[1:]
        if full_rows and dest.is_contiguous():
            self._read_checked(chunk.file, _tensor_bytes(dest), offset)
            return
        block = torch.empty((rows, *chunk.box.sizes[1:]), dtype=spec.dtype)
        self._read_checked(chunk.file, _tensor_bytes(block), offset)
        dest.copy_(block[(slice(None), *part.slices()[1:])])

    def _read_checked(self, file: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``file`` at ``offset`` and check the bytes against their record's CRC-32."""
        _pread_into(self._fd(file), view, offset, self._name(file))
        self.read_checks.saw(file, offset, view)

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

