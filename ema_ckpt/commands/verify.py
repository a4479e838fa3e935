"""``verify``: is a checkpoint on disk intact and fully readable?

For an ema-ckpt output (a directory holding ``ema-ckpt.json``), every data file the
manifest lists is re-hashed (size and CRC-32, streamed in 8 MiB blocks) and compared
with the manifest, and files missing from the directory or not listed in the manifest
are reported. For any checkpoint, with or without a manifest, the reader must open it
(for DCP that already checks that the stored chunks cover every tensor exactly once)
and every stored box of every tensor is read once, block by block, so each record's
bytes must parse.

What is wrong with the data ends up in :attr:`VerifyResult.problems`, one line each,
naming the file; a path that does not exist or holds no checkpoint at all raises the
usual :class:`~ema_ckpt.errors.CheckpointNotFoundError`.

Example:
    >>> result = verify("ckpts/ema")                       # doctest: +SKIP
    >>> result.ok, result.files, result.problems           # doctest: +SKIP
    (True, ['__0_0.distcp', '__1_0.distcp'], [])
"""

from __future__ import annotations

import contextlib
import functools
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, EmaCkptError, RecordChecksumError
from ..formats import open_checkpoint
from ..formats.base import CheckpointReader
from ..formats.options import ReadOptions
from ..integrity import file_checks, read_manifest
from ..job_context import JobContext, Piece, Tally
from ..jobs import Job, Target, run_job
from ..layout import split_rows
from ..manifest import MANIFEST_NAME
from ..options import ReadFields, RunFields
from ..progress import Progress
from ..storage import HASH_BLOCK_BYTES, Location, as_path

READ_BLOCK_BYTES = 64 << 20
"""Tensors are read back in row blocks of at most this many bytes (at least one row)."""


@dataclass(slots=True)
class VerifyResult:
    """What :func:`verify` checked and what it found wrong.

    ``files`` are the data files whose size and CRC-32 matched the manifest; ``keys`` the
    tensor keys read back in full without error. ``ok`` is True when ``problems`` is empty.
    ``bytes_hashed`` counts each byte whose checksum was checked once: the listed files'
    sizes on disk (against the manifest), or the ``torch.save`` records' lengths (against
    their own zip CRC-32s) for a checkpoint without a manifest. ``bytes_read`` counts the
    tensor and non-tensor data read back, a second pass over (mostly) the same bytes.
    """

    path: Location
    format_name: str | None = None
    manifest: bool = False
    """Whether the path is an ema-ckpt output (holds ``ema-ckpt.json``)."""
    checks: list[str] = field(default_factory=list)
    """What was checked: ``"files"`` (sizes and CRC-32s against the manifest), ``"readable"``."""
    files: list[str] = field(default_factory=list)
    keys: int = 0
    entries: int = 0
    """Non-tensor entries (DCP bytes records) read back."""
    bytes_hashed: int = 0
    hashed_files: int = 0
    """Files whose bytes were checked against a checksum (manifest or zip CRC-32s)."""
    records: int = 0
    """``torch.save`` records whose zip CRC-32s were checked (no manifest)."""
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bytes_checked(self) -> int:
        """Bytes checked against a checksum, each counted once (:attr:`bytes_hashed`)."""
        return self.bytes_hashed

    def problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def add(self, part: VerifyResult) -> None:
        """Take in what one check found (see :func:`verify`'s workers)."""
        for message in part.problems:
            self.problem(message)
        self.notes += [n for n in part.notes if n not in self.notes]
        self.files += part.files
        self.keys += part.keys
        self.entries += part.entries
        self.bytes_hashed += part.bytes_hashed
        self.hashed_files += part.hashed_files
        self.records += part.records
        self.bytes_read += part.bytes_read

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "format": self.format_name,
            "manifest": self.manifest,
            "checks": list(self.checks),
            "files": list(self.files),
            "keys": self.keys,
            "entries": self.entries,
            "bytes_hashed": self.bytes_hashed,
            "hashed_files": self.hashed_files,
            "records": self.records,
            "bytes_read": self.bytes_read,
            "bytes_checked": self.bytes_checked,
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


def verify(
    path: str | Location,
    *,
    hash_block_bytes: int = HASH_BLOCK_BYTES,
    read_block_bytes: int = READ_BLOCK_BYTES,
    state_key: str | None = None,
    inert_globals: Sequence[str] = (),
    workers: int = 1,
    on_progress: Callable[[Progress], None] | None = None,
) -> VerifyResult:
    """Check the checkpoint at ``path`` (see the module docstring).

    ``workers``: share the files to hash, the keys to read and the records to check among N
    processes (by bytes); the result is the same for any N. ``on_progress`` is called as
    this process's share is read (bytes hashed and read; regions count checks).
    ``state_key``, ``inert_globals``: for a single-file checkpoint, as for :func:`~ema_ckpt.accumulate`.

    Example:
        >>> result = verify("ckpts/ema")                     # doctest: +SKIP
        >>> result.ok, result.checks                         # doctest: +SKIP
        (True, ['files', 'readable'])

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or (without a manifest) holds no
            checkpoint of any known format.
    """
    options = VerifyOptions(path=as_path(path), hash_block_bytes=hash_block_bytes, read_block_bytes=read_block_bytes,
                            state_key=state_key, inert_globals=tuple(inert_globals), workers=workers)
    return run_job(VerifyJob(options), on_progress=on_progress)


@dataclass(frozen=True, kw_only=True)
class VerifyOptions(ReadFields, RunFields):
    """Everything a :func:`verify` run needs; checked when made."""

    path: Location
    hash_block_bytes: int = HASH_BLOCK_BYTES
    read_block_bytes: int = READ_BLOCK_BYTES


class VerifyJob(Job[Location, VerifyResult, VerifyResult]):
    """:func:`verify` as a job that writes nothing: every worker lists the same checks, each
    done by one (:meth:`~ema_ckpt.job_context.JobContext.share_out`)."""

    writes = False

    def __init__(self, options: VerifyOptions) -> None:
        self.options: VerifyOptions = options

    def plan(self, notes: list[str]) -> Location:
        return self.options.path

    def targets(self, plan: Location) -> list[Target]:
        return []

    def compute(self, plan: Location, context: JobContext) -> VerifyResult:
        return _verify(context, plan, self.options.hash_block_bytes, self.options.read_block_bytes)

    def result(self, plan: Location, computed: VerifyResult | None, seconds: float) -> VerifyResult:
        assert computed is not None
        return computed


@dataclass(frozen=True, slots=True)
class _Check:
    """One piece of the work, done by one worker into a fresh :class:`VerifyResult`."""

    cost: int
    run: Callable[[VerifyResult, Tally], None]
    """Adds what it finds to the result it is given, and the bytes it reads to the tally."""


def _verify(context: JobContext, path: Location, hash_block_bytes: int, read_block_bytes: int) -> VerifyResult:
    """:func:`verify` on one worker: every worker lists the same checks; each is done by one."""
    if not path.exists() and not path.is_symlink():
        raise CheckpointNotFoundError(path, "no such file or directory")
    result = VerifyResult(path)
    manifest_file = path / MANIFEST_NAME
    result.manifest = path.is_dir() and (manifest_file.exists() or manifest_file.is_symlink())
    checks: list[_Check] = []
    with contextlib.ExitStack() as stack:
        if result.manifest:
            result.checks.append("files")
            found = VerifyResult(path)
            manifest = read_manifest(path, found)  # every worker reads it; the first check reports it
            checks.append(_Check(0, lambda part, _: part.add(found)))
            if manifest is not None:
                checks += [_Check(cost, run) for cost, run in file_checks(path, manifest, hash_block_bytes)]
        else:
            result.notes.append(f"no {MANIFEST_NAME}: the checkpoint's own zip CRC-32s are checked (where it has "
                                "them) and every tensor read back")
        result.checks.append("readable")
        opened = context.check(lambda: _open(path, context.read, strict=result.manifest))
        if isinstance(opened, str):
            checks.append(_reporting(opened))
        else:
            reader = stack.enter_context(contextlib.closing(opened))
            result.format_name = reader.format_name
            records_checked = not result.manifest and bool(reader.stored_records())
            checks += _read_checks(reader, read_block_bytes, records_checked=records_checked)
            if records_checked:
                result.checks.append("file CRC-32s" if reader.whole_file_records else "record CRC-32s")
                checks += _record_checks(path, reader)
        pieces = [Piece(c.cost, functools.partial(_run_check, path, c.run)) for c in checks]
        parts = context.share_out(pieces)
    for part in parts:
        result.add(part)
    return result


def _run_check(path: Location, run: Callable[[VerifyResult, Tally], None], tally: Tally) -> VerifyResult:
    part = VerifyResult(path)
    run(part, tally)
    return part


def _reporting(problem: str) -> _Check:
    """A check that only reports ``problem`` (found while listing the checks)."""

    def report(part: VerifyResult, tally: Tally) -> None:
        part.problem(problem)

    return _Check(0, report)


def _open(path: Location, read: ReadOptions, *, strict: bool) -> CheckpointReader | str:
    """The reader, or the problem that stops it opening (a path that holds no checkpoint at
    all raises, unless a manifest says it should hold one)."""
    try:
        return open_checkpoint(path, read=read)
    except CheckpointNotFoundError as err:
        if not strict:
            raise  # not a checkpoint at all, and no manifest says it should be one
        return str(err)
    except EmaCkptError as err:
        return str(err)


def _zip_crcs_ok(source: Any, name: str, result: VerifyResult) -> bool:
    """Every member of the zip at ``source`` against the CRC-32 its headers record; whether
    there was anything to check.

    Members saved without checksums (``torch.serialization.set_crc32_options(False)`` writes
    CRC 0) and files in torch's legacy, non-zip format carry nothing to check: noted, not wrong.
    """
    try:
        if not zipfile.is_zipfile(source):
            result.notes.append(f"{name}: legacy torch.save format, no CRC-32s to check")
            return False
        with zipfile.ZipFile(source) as archive:
            infos = archive.infolist()
            unchecked = [i for i in infos if i.CRC == 0 and i.file_size > 0]
            if unchecked and len(unchecked) == len([i for i in infos if i.file_size > 0]):
                result.notes.append(f"{name}: saved without CRC-32s, nothing to check")
                return False
            bad = archive.testzip()
    except Exception as err:  # any odd header (a compression or encryption flag): one line, not a crash
        result.problem(f"{name}: not a readable zip record ({err})")
        return True
    if bad is not None:
        result.problem(f"{name}: member {bad!r} does not match the CRC-32 its zip header records (corrupt data)")
    return True


def _record_checks(path: Location, reader: CheckpointReader) -> list[_Check]:
    """A training checkpoint's own checksums: every ``torch.save`` zip's CRC-32s, which neither
    torch nor DeepSpeed ever checks when loading.

    DCP: every record the metadata names (optimizer and bytes entries too); DeepSpeed: every
    ``.pt`` file of the tag; a ``torch.save`` file: itself. Safetensors carries no checksum.
    The first check of each file counts it in :attr:`VerifyResult.hashed_files`. Records are
    checked in batches (see :data:`_BATCH_KEYS`).
    """
    checks = []
    seen: set[str] = set()
    batch: list[tuple[str, int, int, bool]] = []
    cost = 0
    for file, offset, length in reader.stored_records():
        batch.append((file, offset, length, file not in seen))
        seen.add(file)
        cost += length
        if cost >= _BATCH_BYTES or len(batch) >= _BATCH_KEYS:
            checks.append(_Check(cost, functools.partial(_check_records, path, reader, batch)))
            batch, cost = [], 0
    if batch:
        checks.append(_Check(cost, functools.partial(_check_records, path, reader, batch)))
    return checks


def _check_records(path: Location, reader: CheckpointReader, records: Sequence[tuple[str, int, int, bool]],
                   part: VerifyResult, tally: Tally) -> None:
    """The CRC-32s of ``records`` (file, offset, length, the file's first record)."""
    whole = reader.whole_file_records
    for file, offset, length, first in records:
        name = str(path / file) if whole else f"{path / file} (record at offset {offset})"
        try:
            source = reader.open_record(file, offset, length)
        except EmaCkptError as err:
            part.problem(str(err))
            continue
        except OSError as err:
            part.problem(f"{path / file}: cannot read ({err.strerror})")
            continue
        with contextlib.closing(source):
            if _zip_crcs_ok(source, name, part):
                part.records += 1
                part.bytes_hashed += length
                part.hashed_files += first
        tally.add(length, name)


_BATCH_BYTES = 64 << 20
_BATCH_KEYS = 4096
"""Keys are read back, and records' checksums checked, in batches of about this many bytes, or
this many keys or records: a check for each would cost about 1 KiB of bookkeeping (200 MiB at
200,000 keys)."""


def _read_checks(reader: CheckpointReader, block_bytes: int, *, records_checked: bool = False) -> list[_Check]:
    """Checks that read back every tensor key (every stored box in row blocks, in batches of
    keys), and one per non-tensor entry (its record read as raw bytes, never unpickled).
    ``records_checked``: every record's CRC-32s are checked too, so a read that fails its
    record's CRC-32 is left to that check."""
    try:
        specs = reader.specs()
    except EmaCkptError as err:
        return [_reporting(str(err))]
    keys = list(specs)
    checks = []
    first, cost = 0, 0
    for index, key in enumerate(keys):
        cost += specs[key].nbytes
        if cost >= _BATCH_BYTES or index + 1 - first >= _BATCH_KEYS or index + 1 == len(keys):
            batch = functools.partial(_read_keys, reader, keys, first, index + 1, block_bytes, records_checked)
            checks.append(_Check(cost, batch))
            first, cost = index + 1, 0
    # DCP non-tensor entries (``BytesStorageMetadata``): their records must lie in their files.
    for key in reader.non_tensor_keys:

        def read_entry(part: VerifyResult, tally: Tally, key: str = key) -> None:
            try:
                nbytes = len(reader.read_bytes(key))
            except KeyError:
                part.problem(f"{reader.path}: non-tensor entry {key!r} has no stored record")
                return
            except EmaCkptError as err:
                part.problem(str(err))
                return
            part.bytes_read += nbytes
            part.entries += 1
            tally.add(nbytes, key)

        checks.append(_Check(0, read_entry))
    return checks


def _read_keys(reader: CheckpointReader, keys: Sequence[str], first: int, end: int, block_bytes: int,
               records_checked: bool, part: VerifyResult, tally: Tally) -> None:
    """Read back ``keys[first:end]`` (see :func:`_read_checks`)."""
    specs = reader.specs()
    for key in keys[first:end]:
        limit = max(1, block_bytes // max(1, specs[key].dtype.itemsize))
        try:
            for box in reader.layout(key):
                for piece in split_rows(box, limit):
                    value = reader.read(key, piece)
                    nbytes = value.numel() * value.element_size()
                    del value
                    part.bytes_read += nbytes
                    tally.add(nbytes, key)
        except RecordChecksumError as err:
            if not records_checked:
                part.problem(str(err))
            continue  # else the record check of the same bytes reports it, once
        except EmaCkptError as err:
            part.problem(str(err))
            continue
        part.keys += 1
