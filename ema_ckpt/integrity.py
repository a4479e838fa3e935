"""Outputs checked against their manifests (every data file's size and CRC-32, as ``verify``
checks them: :func:`file_checks`), and the EMA an ``accumulate`` run folds into refused when it
does not match: a flipped bit would otherwise be folded in and covered by fresh checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from .dist import Workers
from .errors import CheckpointError, CheckpointFormatError, EmaCkptError, RecordChecksumError
from .folding import Accumulator
from .formats.base import CheckpointReader
from .formats.dcp.reader import DcpReader
from .job_context import Tally
from .manifest import MANIFEST_NAME, OUTPUT_OWN_FILES, Manifest
from .storage import HASH_BLOCK_BYTES, Location, as_path, read_in_blocks, size_and_crc32


class Findings(Protocol):
    """Where a check puts what it finds (``verify``'s result is one)."""

    files: list[str]
    bytes_hashed: int
    hashed_files: int

    def problem(self, message: str) -> None: ...


@dataclass
class _Problems:
    files: list[str] = field(default_factory=list)
    bytes_hashed: int = 0
    hashed_files: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)


def damage(path: str | Location, *, block_bytes: int = HASH_BLOCK_BYTES, crc: bool = True) -> list[str]:
    """What is wrong with an ema-ckpt output's data files against its manifest (empty: intact).

    Sizes and CRC-32s only, as ``verify`` checks them; files the manifest does not list are
    not damage and are left to ``verify``. Reads every data file once; ``crc`` False checks
    the sizes alone and reads nothing.

    Example:
        >>> import tempfile, zlib; from pathlib import Path; from ema_ckpt.manifest import Manifest
        >>> ema = Path(tempfile.mkdtemp()); _ = (ema / "__0_0.distcp").write_bytes(b"weights")
        >>> Manifest(kind="ema", profile={}, dtype="float32", step=10, source_format="dcp",
        ...          files={"__0_0.distcp": {"size": 7, "crc32": zlib.crc32(b"weights")}}).write(ema)
        >>> _ = (ema / "__0_0.distcp").write_bytes(b"weight")   # a byte lost
        >>> damage(ema)   # doctest: +ELLIPSIS
        ['/.../__0_0.distcp: truncated: 6 bytes, ema-ckpt.json says 7']
    """
    path = as_path(path)
    found = _Problems()
    manifest = read_manifest(path, found)
    if manifest is not None:
        tally = Tally(0, 0, None)
        for _cost, run in file_checks(path, manifest, block_bytes, extras=False, crc=crc):
            run(found, tally)
    return found.problems


def crc_mismatch(file: Location, actual: int, recorded: int) -> str:
    """The problem of a data file whose CRC-32 is not the one its manifest records."""
    return f"{file}: CRC-32 {actual:08x}, {MANIFEST_NAME} says {recorded:08x} (corrupt data)"


def read_manifest(path: Location, result: Findings) -> Manifest | None:
    file = path / MANIFEST_NAME
    try:
        if not file.is_file():
            raise CheckpointError(file, "not a regular file")
        manifest = Manifest.read(path)
    except EmaCkptError as err:
        result.problem(str(err))
        return None
    except RecursionError:  # absurdly nested JSON
        result.problem(f"{file}: unreadable ema-ckpt manifest (nested too deeply)")
        return None
    files = manifest.files if manifest is not None else None
    if not isinstance(files, dict):
        result.problem(f"{file}: 'files' is not an object mapping data file names to size and crc32")
        return None
    return manifest


def _entry(value: Any) -> tuple[int, int] | None:
    if not isinstance(value, dict):
        return None
    size, crc = value.get("size"), value.get("crc32")
    if type(size) is not int or type(crc) is not int or size < 0 or not 0 <= crc < 1 << 32:
        return None
    return size, crc


def file_checks(path: Location, manifest: Manifest, block_bytes: int, *, extras: bool = True, crc: bool = True
                ) -> list[tuple[int, Callable[[Findings, Tally], None]]]:
    """One check per file the manifest lists (its size and CRC-32, or its size alone without
    ``crc``), then one for files it does not list (``extras``)."""
    listed: dict[str, Any] = manifest.files
    manifest_file = path / MANIFEST_NAME
    checks: list[tuple[int, Callable[[Findings, Tally], None]]] = []
    for name in sorted(listed, key=str):
        expected = _entry(listed[name])

        def check(part: Findings, tally: Tally, name: Any = name, expected: tuple[int, int] | None = expected
                  ) -> None:
            if not isinstance(name, str) or Path(name).name != name or name in {"", ".", ".."} or "\0" in name:
                part.problem(f"{manifest_file}: lists {name!r}, which is not a file name in this directory")
                return
            file = path / name
            if expected is None:
                part.problem(f"{manifest_file}: entry for {name!r} has no valid size and crc32 ({listed[name]!r})")
                return
            if not file.exists():
                part.problem(f"{file}: missing (listed in {MANIFEST_NAME})")
                return
            if not file.is_file():
                part.problem(f"{file}: not a regular file")
                return
            size, recorded = expected
            try:
                if crc:
                    actual_size, actual_crc = size_and_crc32(file, block_bytes)
                else:
                    actual_size, actual_crc = file.stat().st_size, recorded
            except OSError as err:
                part.problem(f"{file}: cannot read ({err.strerror or err})")
                return
            if crc:
                part.bytes_hashed += actual_size
                part.hashed_files += 1
                tally.add(actual_size, name)
            if actual_size != size:
                what = "truncated" if actual_size < size else "longer than recorded"
                part.problem(f"{file}: {what}: {actual_size} bytes, {MANIFEST_NAME} says {size}")
            elif actual_crc != recorded:
                part.problem(crc_mismatch(file, actual_crc, recorded))
            else:
                part.files.append(name)

        checks.append((expected[0] if expected is not None else 0, check))
    if extras:
        checks.append((0, lambda part, _: _check_extras(path, listed, part)))
    return checks


def _check_extras(path: Location, listed: dict[str, Any], result: Findings) -> None:
    try:
        present: list[Location] = sorted(path.iterdir(), key=str)
    except OSError as err:
        result.problem(f"{path}: cannot list ({err.strerror or err})")
        return
    for entry in present:
        if entry.name in OUTPUT_OWN_FILES or entry.name in listed:
            continue
        kind = "directory" if entry.is_dir() else "file"
        result.problem(f"{entry}: extra {kind} not listed in {MANIFEST_NAME}")


def refuse_damaged_emas(accumulators: list[Accumulator]) -> None:
    """Every EMA about to be folded into matches its manifest, or the run stops before anything
    is written. On object storage only the sizes are checked here, the CRC-32s from what the fold
    reads (:func:`refuse_damaged_remote_emas`), so that the EMA is downloaded once."""
    for acc in accumulators:
        if acc.previous is None or not acc.new:
            continue
        problems = damage(acc.final, crc=not read_in_blocks(acc.final))  # a local file is read twice for free
        if problems:
            raise _damaged(acc.final, problems)


def refuse_damaged_remote_emas(accumulators: list[Accumulator], readers: Sequence[CheckpointReader],
                               index: Mapping[str, int], workers: Workers) -> None:
    """After the fold, before anything is published: each EMA on object storage that was folded
    into has the CRC-32s its manifest records, computed from the blocks the workers read
    (blocks no worker read are read now). Every worker takes part; the coordinator checks."""
    previous = [(acc, readers[index[str(acc.final)]]) for acc in remote_emas_folded_into(accumulators)]
    if not previous:
        return
    read = workers.exchange([cast(DcpReader, reader).block_checksums() for _acc, reader in previous])

    def check() -> None:
        for k, (acc, reader) in enumerate(previous):
            others = [r[k] for rank, r in enumerate(read) if rank != workers.rank]
            problems = []
            for name, entry in sorted(cast(Manifest, acc.previous).files.items()):
                recorded = cast(int, entry["crc32"])  # entries were checked with the sizes, before the fold
                actual = cast(DcpReader, reader).file_crc32(name, others)
                if actual != recorded:
                    problems.append(crc_mismatch(acc.final / name, actual, recorded))
            if problems:
                raise _damaged(acc.final, problems)

    workers.on_coordinator(check)


def as_damaged_ema(accumulators: Sequence[Accumulator], error: EmaCkptError) -> CheckpointFormatError | None:
    """``error`` told as the EMA's own damage when the bytes that failed their record's CRC-32
    belong to an EMA this run folds into (the fold read them before its manifest's checksums
    were compared, as on object storage), so the remedy offered is the EMA's; else None."""
    if not isinstance(error, RecordChecksumError):
        return None
    damaged = str(error.path)
    for acc in accumulators:
        inside = damaged.startswith(str(acc.final).rstrip("/") + "/")
        if acc.previous is not None and acc.new and inside:
            return _damaged(acc.final, [f"{damaged}: {error.reason}"])
    return None


def remote_emas_folded_into(accumulators: Sequence[Accumulator]) -> list[Accumulator]:
    """The accumulators whose previous EMA, on object storage, this run folds new checkpoints into."""
    return [acc for acc in accumulators if acc.previous is not None and acc.new and read_in_blocks(acc.final)]


def _damaged(final: Location, problems: list[str]) -> CheckpointFormatError:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckpointFormatError(
        final,
        f"the EMA does not match its manifest: {problems[0]}{more}; it is left as it is. "
        "Restore it from a backup, or rebuild it with {restart=True} (every checkpoint still on "
        "disk is folded again)", remedy="restart",
    )


__all__ = ["Findings", "as_damaged_ema", "crc_mismatch", "damage", "file_checks", "read_manifest",
           "refuse_damaged_emas", "refuse_damaged_remote_emas", "remote_emas_folded_into"]
