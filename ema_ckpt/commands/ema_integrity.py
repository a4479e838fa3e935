"""The EMAs an ``accumulate`` run folds into are checked against their manifests first.

A flipped bit in the previous EMA would otherwise be folded in and then covered by fresh
checksums. Local EMAs are checked before anything is written; on object storage the sizes are
checked first and the CRC-32s from the blocks the fold itself reads, so the EMA is downloaded
once.

Example:
    >>> refuse_damaged_emas(accumulators)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

from ..dist import Workers
from ..errors import CheckpointFormatError, EmaCkptError, RecordChecksumError
from ..folding import Accumulator
from ..formats.base import CheckpointReader
from ..formats.dcp.reader import DcpReader
from ..manifest import Manifest
from ..remote import is_remote
from .verify import crc_mismatch, damage


def refuse_damaged_emas(accumulators: list[Accumulator]) -> None:
    """Every EMA about to be folded into matches its manifest (sizes, CRC-32s), or the run stops.

    A flipped bit in the previous EMA would otherwise be folded in and then covered by fresh
    checksums. Checked before anything is written; the damaged EMA is left as it is. On object
    storage the sizes are checked here and the CRC-32s as the fold reads the EMA
    (:func:`refuse_damaged_remote_emas`), so that it is downloaded once.
    """
    for acc in accumulators:
        if acc.previous is None or not acc.new:
            continue
        problems = damage(acc.final, crc=not is_remote(acc.final))
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
    return [acc for acc in accumulators if acc.previous is not None and acc.new and is_remote(acc.final)]


def _damaged(final: Path, problems: list[str]) -> CheckpointFormatError:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckpointFormatError(
        final,
        f"the EMA does not match its manifest: {problems[0]}{more}; it is left as it is. "
        "Restore it from a backup, or rebuild it with {restart=True} (every checkpoint still on "
        "disk is folded again)", remedy="restart",
    )


__all__ = ["as_damaged_ema", "refuse_damaged_emas", "refuse_damaged_remote_emas", "remote_emas_folded_into"]
