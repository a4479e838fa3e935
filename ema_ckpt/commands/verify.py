"""``verify``: is a checkpoint on disk intact and fully readable?

An ema-ckpt output's data files are re-hashed (size and CRC-32) against its manifest, and files
missing or not listed are reported; any checkpoint must open, and every stored box of every tensor
is read back. What is wrong ends up in :attr:`VerifyResult.problems`, one line each; a path that
holds no checkpoint at all raises :class:`~ema_ckpt.errors.CheckpointNotFoundError`.
"""

from __future__ import annotations

import contextlib
import functools
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import CheckpointNotFoundError, EmaCkptError, RecordChecksumError
from ..formats import open_checkpoint
from ..formats.base import CheckpointReader
from ..formats.options import ReadOptions
from ..integrity import file_checks, read_manifest
from ..job_context import JobContext, Piece, Tally
from ..jobs import ReadingJob, run_job
from ..layout import split_rows
from ..manifest import MANIFEST_NAME
from ..options import ReadFields, RunFields
from ..progress import Progress
from ..storage import HASH_BLOCK_BYTES, Location, as_path

READ_BLOCK_BYTES = 64 << 20
"""Tensors are read back in row blocks of at most this many bytes (at least one row)."""
_T = TypeVar("_T")


@dataclass(slots=True)
class VerifyResult:
    """What :func:`verify` checked and what it found wrong (``ok``: no ``problems``).

    ``files``: data files whose size and CRC-32 matched the manifest; ``keys``: tensors read back
    whole. ``bytes_hashed`` counts each byte checked against a checksum once (the manifest's, or
    the ``torch.save`` records' own zip CRC-32s without one); ``bytes_read``, the data read back.
    """

    path: Location
    format_name: str | None = None
    manifest: bool = False
    """Whether the path holds ``ema-ckpt.json``."""
    checks: list[str] = field(default_factory=list)
    """What was checked: ``"files"`` (against the manifest), ``"readable"``, record CRC-32s."""
    files: list[str] = field(default_factory=list)
    keys: int = 0
    entries: int = 0
    """Non-tensor entries (DCP bytes records) read back."""
    bytes_hashed: int = 0
    hashed_files: int = 0
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
        return self.bytes_hashed

    def problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def add(self, part: VerifyResult) -> None:
        """Take in what one check found."""
        for message in part.problems:
            self.problem(message)
        self.notes += [n for n in part.notes if n not in self.notes]
        self.files += part.files
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(part, name))

    def to_dict(self) -> dict[str, Any]:
        named = ("manifest", "checks", "files", *_COUNTS, "bytes_checked", "problems", "notes")
        plain = {name: getattr(self, name) for name in named}
        return {"path": str(self.path), "ok": self.ok, "format": self.format_name,
                **{k: list(v) if isinstance(v, list) else v for k, v in plain.items()}}


_COUNTS = ("keys", "entries", "bytes_hashed", "hashed_files", "records", "bytes_read")


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
    processes (by bytes); the result is the same for any N. ``on_progress``: as this process's
    share is read. ``state_key``, ``inert_globals``: as for :func:`~ema_ckpt.accumulate`.

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
    """A :func:`verify` run's options."""

    path: Location
    hash_block_bytes: int = HASH_BLOCK_BYTES
    read_block_bytes: int = READ_BLOCK_BYTES


_Check = Callable[[VerifyResult, Tally], None]
"""One piece of the work: adds what it finds to the result, and the bytes it reads to the tally."""


@dataclass
class VerifyJob(ReadingJob[Location, VerifyResult]):
    options: VerifyOptions

    def plan(self, notes: list[str]) -> Location:
        return self.options.path

    def compute(self, path: Location, context: JobContext) -> VerifyResult:
        """:func:`verify` on one worker: every worker lists the same checks; each is done by one."""
        if not path.exists() and not path.is_symlink():
            raise CheckpointNotFoundError(path, "no such file or directory")
        result = VerifyResult(path)
        manifest_file = path / MANIFEST_NAME
        result.manifest = path.is_dir() and (manifest_file.exists() or manifest_file.is_symlink())
        checks: list[tuple[int, _Check]] = []
        with contextlib.ExitStack() as stack:
            if result.manifest:
                result.checks.append("files")
                found = VerifyResult(path)
                manifest = read_manifest(path, found)  # every worker reads it; the first check reports it
                checks.append((0, lambda part, _: part.add(found)))
                if manifest is not None:
                    checks += file_checks(path, manifest, self.options.hash_block_bytes)
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
                checks += _read_checks(reader, self.options.read_block_bytes, records_checked)
                if records_checked:
                    result.checks.append("file CRC-32s" if reader.whole_file_records else "record CRC-32s")
                    checks += _record_checks(path, reader)
            parts = context.share_out([Piece(cost, functools.partial(_run_check, path, run)) for cost, run in checks])
        for part in parts:
            result.add(part)
        return result


def _run_check(path: Location, run: _Check, tally: Tally) -> VerifyResult:
    part = VerifyResult(path)
    run(part, tally)
    return part


def _reporting(problem: str) -> tuple[int, _Check]:
    return 0, lambda part, _: part.problem(problem)


def _open(path: Location, read: ReadOptions, *, strict: bool) -> CheckpointReader | str:
    """The reader, or why it does not open (``strict``: a manifest says a checkpoint is there,
    so even a path that holds none is a problem, not an error)."""
    try:
        return open_checkpoint(path, read=read)
    except CheckpointNotFoundError as err:
        if not strict:
            raise
        return str(err)
    except EmaCkptError as err:
        return str(err)


def _zip_crcs_ok(source: Any, name: str, result: VerifyResult) -> bool:
    """Every member of the zip at ``source`` against the CRC-32 its headers record; whether
    there was anything to check (members saved without checksums and torch's legacy format
    carry none: noted, not wrong)."""
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


_BATCH_BYTES = 64 << 20
_BATCH_KEYS = 4096
"""Keys are read back, and records checked, in batches of about this many bytes or this many
items: a check each would cost about 1 KiB of bookkeeping (200 MiB at 200,000 keys)."""


def _batched(items: Iterable[_T], cost: Callable[[_T], int]) -> Iterator[tuple[int, list[_T]]]:
    """``items`` in batches (see :data:`_BATCH_KEYS`), each with its cost."""
    batch: list[_T] = []
    total = 0
    for item in items:
        batch.append(item)
        total += cost(item)
        if total >= _BATCH_BYTES or len(batch) >= _BATCH_KEYS:
            yield total, batch
            batch, total = [], 0
    if batch:
        yield total, batch


def _record_checks(path: Location, reader: CheckpointReader) -> list[tuple[int, _Check]]:
    """The CRC-32s of every ``torch.save`` zip the checkpoint stores, which neither torch nor
    DeepSpeed ever checks when loading (safetensors carries none). The first record of each
    file counts it in :attr:`VerifyResult.hashed_files`."""
    seen: set[str] = set()
    records = []
    for file, offset, length in reader.stored_records():
        records.append((file, offset, length, file not in seen))
        seen.add(file)
    return [(cost, functools.partial(_check_records, path, reader, batch))
            for cost, batch in _batched(records, lambda record: record[2])]


def _check_records(path: Location, reader: CheckpointReader, records: Sequence[tuple[str, int, int, bool]],
                   part: VerifyResult, tally: Tally) -> None:
    whole = reader.whole_file_records
    for file, offset, length, first in records:
        name = str(path / file) if whole else f"{path / file} (record at offset {offset})"
        try:
            source = reader.open_record(file, offset, length)
        except EmaCkptError as err:
            part.problem(str(err))
        except OSError as err:
            part.problem(f"{path / file}: cannot read ({err.strerror})")
        else:
            with contextlib.closing(source):
                if _zip_crcs_ok(source, name, part):
                    part.records += 1
                    part.bytes_hashed += length
                    part.hashed_files += first
            tally.add(length, name)


def _read_checks(reader: CheckpointReader, block_bytes: int, records_checked: bool) -> list[tuple[int, _Check]]:
    """Checks that read back every tensor key, in batches, and every non-tensor entry (as raw
    bytes, never unpickled). ``records_checked``: a read that fails its record's CRC-32 is left
    to the record check of the same bytes."""
    try:
        specs = reader.specs()
    except EmaCkptError as err:
        return [_reporting(str(err))]
    checks: list[tuple[int, _Check]] = [
        (cost, functools.partial(_read_keys, reader, batch, block_bytes, records_checked))
        for cost, batch in _batched(specs, lambda key: specs[key].nbytes)]
    for key in reader.non_tensor_keys:

        def read_entry(part: VerifyResult, tally: Tally, key: str = key) -> None:
            try:
                nbytes = len(reader.read_bytes(key))
            except KeyError:
                part.problem(f"{reader.path}: non-tensor entry {key!r} has no stored record")
            except EmaCkptError as err:
                part.problem(str(err))
            else:
                part.bytes_read += nbytes
                part.entries += 1
                tally.add(nbytes, key)

        checks.append((0, read_entry))
    return checks


def _read_keys(reader: CheckpointReader, keys: Sequence[str], block_bytes: int, records_checked: bool,
               part: VerifyResult, tally: Tally) -> None:
    specs = reader.specs()
    for key in keys:
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
        except EmaCkptError as err:
            part.problem(str(err))
        else:
            part.keys += 1
