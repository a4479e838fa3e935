"""The runner of the commands that only read (``verify``, ``diff``): their work shared among workers.

Such a command lists its work as :class:`Piece`\\ s, from metadata alone and alike on every
worker (a file to hash, a key to read back or compare). :func:`share_out` gives each piece
to one worker, balancing bytes (:func:`~ema_ckpt.dist.assign_by_bytes`), runs this worker's
pieces and gathers every piece's result onto every worker in the order listed, so the result
is the same for any number of workers. :func:`run_reading` starts the workers
(``workers=N`` spawns ranks 1…N-1 beside this process; under ``torchrun``, its group).

Nothing is locked, staged or published: the job runner (:mod:`ema_ckpt.jobs`) is for
commands that write.

Example:
    >>> def count(workers, words, on_progress=None):
    ...     pieces = [Piece(len(w), lambda tally, w=w: len(w)) for w in words]
    ...     return share_out(workers, pieces, on_progress)
    >>> run_reading(1, count, ["ab", "cde"])
    [2, 3]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._env import check_working_directory
from .dist import Workers, assign_by_bytes, current_workers
from .dist.pool import run_workers
from .formats.options import ReadOptions, reading
from .progress import Progress

T = TypeVar("T")


@dataclass(slots=True)
class Tally:
    """This worker's bytes and pieces done, reported to ``on_progress`` as they grow.

    Regions in the report count pieces. The total is reported before the first piece.
    """

    bytes_total: int
    pieces_total: int
    on_progress: Callable[[Progress], None] | None
    bytes_done: int = 0
    pieces_done: int = 0

    def add(self, nbytes: int, what: str = "", *, piece_done: bool = False) -> None:
        self.bytes_done += nbytes
        self.pieces_done += piece_done
        if self.on_progress is not None:
            self.on_progress(Progress(self.bytes_done, max(self.bytes_total, self.bytes_done), self.pieces_done,
                                      self.pieces_total, what))


@dataclass(frozen=True, slots=True)
class Piece(Generic[T]):
    """One piece of a command's reading: its cost in bytes, and what does it (given the tally
    to add the bytes it reads to) and returns its picklable result."""

    cost: int
    run: Callable[[Tally], T]


def share_out(workers: Workers, pieces: Sequence[Piece[T]],
              on_progress: Callable[[Progress], None] | None = None) -> list[T]:
    """Every piece's result, in order, on every worker; each piece was run by one worker.

    A synchronisation point: an error in any worker's pieces is raised on every worker.
    """
    owners = assign_by_bytes([p.cost for p in pieces], workers.world_size)
    mine = [i for i, owner in enumerate(owners) if owner == workers.rank]

    def run_mine() -> dict[int, T]:
        tally = Tally(sum(pieces[i].cost for i in mine), len(mine), on_progress)
        tally.add(0)
        done = {}
        for i in mine:
            done[i] = pieces[i].run(tally)
            tally.add(0, piece_done=True)
        return done

    found: dict[int, T] = {}
    for part in workers.all_gather(workers.run(run_mine)):
        found.update(part)
    return [found[i] for i in range(len(pieces))]


def run_reading(world_size: int, func: Callable[..., T], /, *args: Any,
                on_progress: Callable[[Progress], None] | None = None, device: str = "cpu",
                read: ReadOptions | None = None) -> T:
    """``func(workers, *args, on_progress=…)`` on ``world_size`` workers; this worker's result.

    ``on_progress`` goes to this process only (it reports this process's share). ``read``:
    how every worker reads checkpoints (:mod:`ema_ckpt.formats.options`).
    """
    check_working_directory()
    result: T = run_workers(world_size, _in_group, func, device, args, read,
                            local_kwargs={"on_progress": on_progress})
    return result


def _in_group(func: Callable[..., T], device: str, args: tuple[Any, ...], read: ReadOptions | None,
              on_progress: Callable[[Progress], None] | None = None) -> T:
    with reading(read):
        return func(current_workers(device), *args, on_progress=on_progress)


__all__ = ["Piece", "Tally", "run_reading", "share_out"]
