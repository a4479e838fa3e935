"""What a job's compute step works with on every worker: the sources opened once, a writer per
target, the engine over this worker's share of the files, or a reading job's pieces shared out.

Example:
    >>> readers = context.open_sources(paths)                        # doctest: +SKIP
    >>> written = context.write(readers, outputs, writers, tensors,  # doctest: +SKIP
    ...                         layout=readers[-1], copy_source=-1)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._gc import frozen_heap, paused_gc
from .dist import Workers, assign_by_bytes
from .engine import EngineStats, OutputSpec, combine_regions
from .errors import OptionError
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .formats.options import DEFAULT_READ, ReadOptions
from .progress import Progress
from .storage import Location, Sink
from .storage.roles import INDEX
from .torch_records.checks import settle_reads
from .writers.base import OutputTensor, OutputWriter, PlannedRegion, WrittenFile
from .writers.regions import region_cost

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass(slots=True)
class WrittenOutputs:
    """Files of each output (on every worker) and totals over all workers."""

    files: list[list[WrittenFile]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(slots=True)
class Tally:
    """This worker's bytes and pieces done, reported to ``on_progress`` as they grow (regions in
    the report count pieces)."""

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
    """One piece of a reading job's work: its cost in bytes, and what does it (adding the bytes
    it reads to the tally) and returns its picklable result."""

    cost: int
    run: Callable[[Tally], T]


@dataclass
class JobContext:
    """What :meth:`Job.compute` works with: the workers, this worker's
    :class:`~ema_ckpt.storage.Sink` per target, and the engine's entry points."""

    workers: Workers
    sinks: list[Sink]
    stack: contextlib.ExitStack
    device: str = "cpu"
    on_progress: Callable[[Progress], None] | None = None
    read: ReadOptions = DEFAULT_READ
    roles: dict[int, dict[str, str]] = field(default_factory=dict)
    """Per target, the role of each file its writer wrote (for publishing), once finished."""
    writers: dict[int, OutputWriter] = field(default_factory=dict)

    def check(self, step: Callable[[], T]) -> T:
        """Run ``step`` on every worker; all fail alike if one does (a synchronisation point)."""
        return self.workers.run(step)

    def open(self, path: Location, shared: Any = None) -> CheckpointReader:
        """One checkpoint opened with the run's read options, closed when the attempt ends."""
        return self.stack.enter_context(contextlib.closing(open_checkpoint(path, read=self.read, shared=shared)))

    def share_out(self, pieces: Sequence[Piece[T]]) -> list[T]:
        """Every piece's result, in order, on every worker; each run by one worker, shared out
        by bytes, so the result is the same for any number of workers. A synchronisation point.
        """
        owners = assign_by_bytes([p.cost for p in pieces], self.workers.world_size)
        mine = [i for i, owner in enumerate(owners) if owner == self.workers.rank]

        def run_mine() -> dict[int, T]:
            tally = Tally(sum(pieces[i].cost for i in mine), len(mine), self.on_progress)
            tally.add(0)
            done = {}
            for i in mine:
                done[i] = pieces[i].run(tally)
                tally.add(0, piece_done=True)
            return done

        found: dict[int, T] = {}
        for part in self.workers.all_gather(self.workers.run(run_mine)):
            found.update(part)
        return [found[i] for i in range(len(pieces))]

    def open_sources(self, paths: Sequence[Location]) -> list[CheckpointReader]:
        """Every checkpoint opened on every worker, each DCP ``.metadata`` parsed once: worker r
        of N parses inputs r, r+N, … and the parsed indexes are exchanged."""
        # their indexes (millions of objects) live as long as the readers: no collection while they are
        # parsed, sent and received, then kept out of cyclic collections (ema_ckpt._gc)
        with paused_gc():
            readers = _open_checkpoints(self.workers, paths, self.open)
            self.stack.enter_context(frozen_heap())
        return readers

    def _index_of(self, writer: OutputWriter) -> int:
        return next(i for i, w in self.writers.items() if w is writer)

    @property
    def stagings(self) -> list[Path]:
        """The directory this worker writes each target in."""
        return [sink.directory for sink in self.sinks]

    def writer(self, index: int, format_name: str, *, file_name: str | None = None, **settings: Any) -> OutputWriter:
        """The writer of target ``index`` in the output format ``format_name`` (``file_name``:
        one file of that name inside the target's directory, its manifest beside it)."""
        from .writers.base import output_format

        sink = self.sinks[index]
        if sink.one_writer and self.workers.world_size > 1:
            raise OptionError("out", f"{sink.final}: a single-file output on object storage is written by "
                              "one worker; run with one worker (or write a directory)", value=str(sink.final))
        name = sink.final.name if file_name is None else file_name
        writer = output_format(format_name).make(sink.directory, name, **settings)
        if file_name is not None:
            writer.final, writer.in_directory = sink.final / file_name, True
        else:
            writer.final, writer.file_tag = sink.final, sink.file_tag
        self.writers[index] = writer
        return writer

    def write(
        self,
        sources: Sequence[CheckpointReader],
        outputs: Sequence[OutputSpec],
        writers: Sequence[OutputWriter],
        tensors: Sequence[OutputTensor],
        *,
        layout: CheckpointReader,
        copy_source: int,
        accumulate_dtype: torch.dtype | None = None,
        check_finite: Sequence[int] = (),
    ) -> WrittenOutputs:
        """Stream this worker's share of every output's files through the engine, then finish
        them on the coordinator. Every writer plans the same regions (``layout``'s chunks);
        progress counts bytes of tensor data read, the total first.
        """
        copies = all(out.mode == "copy" for out in outputs)
        for writer in writers:
            writer.may_copy_stored = copies
        plans = [w.plan(tensors, layout) for w in writers]
        regions = plans[0]
        if any(p != regions for p in plans[1:]):
            raise ValueError("the outputs of one run must share one layout")
        by_key = {t.key: t for t in tensors}
        by_file = regions_by_file(regions)
        costs = [sum(region_cost(r) for r in part) for part in by_file]
        claims = self.workers.claims(costs)
        progress = None if self.on_progress is None else _ReadsProgress(
            self.on_progress, by_file, self.workers.claim_order(costs), sources, outputs, by_key)

        try:
            states, stats = self.workers.run(functools.partial(
                self._stream, sources, outputs, writers, by_file, by_key, claims, progress,
                copy_source=copy_source, accumulate_dtype=accumulate_dtype, check_finite=check_finite))
            settle_reads(sources, self.workers)  # records read only in part, checked before anything is finished
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
        # only the coordinator needs the states (it writes the metadata); every worker needs the totals
        gathered = self.workers.exchange((states if not self.workers.is_coordinator else None, stats.bytes_read,
                                          stats.bytes_written))
        # the plan (a region per key or more) is done with: gone before the metadata is made
        del plans, regions, by_key, by_file, claims, progress

        def finish() -> list[list[WrittenFile]]:
            # the workers' states and the metadata: tens of thousands of lasting objects each
            with paused_gc():
                every = [states]
                for g in gathered[1:]:
                    assert g[0] is not None  # sent by every worker but the coordinator
                    every.append(g[0])
                written = [w.finish([part[k] for part in every]) for k, w in enumerate(writers)]
            for writer, files in zip(writers, written, strict=True):
                index = self._index_of(writer)
                self.roles[index] = {**{name: INDEX for name in writer.index_files()},
                                     **{f.name: f.role for f in files}}
            return written

        files = self.workers.on_coordinator(finish)
        return WrittenOutputs(files, sum(g[1] for g in gathered), sum(g[2] for g in gathered))

    def _stream(self, sources: Sequence[CheckpointReader], outputs: Sequence[OutputSpec],
                writers: Sequence[OutputWriter], by_file: Sequence[Sequence[PlannedRegion]],
                by_key: dict[str, OutputTensor], claims: Any, progress: _ReadsProgress | None, *,
                copy_source: int, accumulate_dtype: torch.dtype | None, check_finite: Sequence[int]
                ) -> tuple[list[Any], EngineStats]:
        """This worker's part of :meth:`write`: the files it claims, through the engine."""
        stats = EngineStats(per_output_bytes=[0] * len(outputs))
        with frozen_heap():  # the plan's regions and specs live for the whole loop
            try:
                for index in claims:  # a whole output file at a time
                    part = combine_regions(sources, outputs, writers, by_file[index], by_key,
                                           copy_source=copy_source, accumulate_dtype=accumulate_dtype,
                                           on_progress=None if progress is None else progress.file(index),
                                           device=self.device, check_finite=check_finite)
                    stats.add(part)
            except BaseException:
                claims.stop()
                raise
        if progress is not None:
            progress.finish()
        states = [w.close() for w in writers]
        for writer, state in zip(writers, states, strict=True):
            self.sinks[self._index_of(writer)].written(writer.own_files(state))
        return states, stats


class _ReadsProgress:
    """The engine's per-region reports restated in bytes read over the whole run (a floating
    region from every source an output uses, any other from one), the total first. With several
    workers: the files claimed so far by any, plus this one's progress in its file (a little
    ahead of the truth, never backwards).
    """

    def __init__(self, report: Callable[[Progress], None], files: Sequence[Sequence[PlannedRegion]],
                 order: Sequence[int], sources: Sequence[CheckpointReader], outputs: Sequence[OutputSpec],
                 tensors: dict[str, OutputTensor]) -> None:
        from .dtypes import is_float

        needed = sorted({u.source for out in outputs for u in out.updates})
        per_element: dict[str, int] = {}
        self.report = report
        self.done: list[list[int]] = []  # per file, the bytes read after each of its regions
        for regions in files:
            done = [0]
            for region in regions:
                cost = per_element.get(region.key)
                if cost is None:
                    if is_float(tensors[region.key].stored_dtype):
                        specs = [sources[s].specs().get(region.key) for s in needed]
                        cost = sum(spec.dtype.itemsize for spec in specs if spec is not None)
                    else:
                        cost = -1  # copied from one source: the region's own bytes
                    per_element[region.key] = cost
                done.append(done[-1] + (region.nbytes if region.raw or cost < 0 else region.box.numel * cost))
            self.done.append(done)
        self.total = sum(d[-1] for d in self.done)
        self.regions_total = sum(len(regions) for regions in files)
        self.reported = 0
        # per file, what the files offered before it hold: every one claimed by some worker already
        self.before: dict[int, tuple[int, int]] = {}
        claimed_bytes = claimed_regions = 0
        for file in order:
            self.before[file] = (claimed_bytes, claimed_regions)
            claimed_bytes += self.done[file][-1]
            claimed_regions += len(self.done[file]) - 1
        report(Progress(0, self.total, 0, self.regions_total, ""))

    def file(self, index: int) -> Callable[[Progress], None]:
        """The engine's callback while this worker works on file ``index``."""
        base, regions_base = self.before[index]
        done = self.done[index]
        return lambda p: self._send(base + done[p.regions_done], regions_base + p.regions_done, p.key)

    def finish(self) -> None:
        self._send(self.total, self.regions_total, "")

    def _send(self, bytes_done: int, regions_done: int, key: str) -> None:
        if bytes_done < self.reported:
            return
        self.reported = bytes_done
        self.report(Progress(bytes_done, self.total, regions_done, self.regions_total, key))


def regions_by_file(regions: Sequence[PlannedRegion]) -> list[list[PlannedRegion]]:
    """The regions grouped by output file, files in order of their first region."""
    files: dict[str, list[PlannedRegion]] = {}
    for region in regions:
        files.setdefault(region.file, []).append(region)
    return list(files.values())


def _open_checkpoints(workers: Workers, paths: Sequence[Location],
                      opened: Callable[[Location, Any], CheckpointReader]) -> list[CheckpointReader]:
    if workers.world_size == 1:
        return [opened(p, None) for p in paths]
    mine = workers.run(lambda: {i: opened(p, None) for i, p in enumerate(paths)
                                if i % workers.world_size == workers.rank})
    shared: dict[int, Any] = {}
    for part in workers.exchange({i: state for i, r in mine.items() if (state := r.share()) is not None}):
        shared.update(part)
    return workers.run(lambda: [mine[i] if i in mine else opened(p, shared.get(i)) for i, p in enumerate(paths)])


__all__ = ["JobContext", "Piece", "Tally", "WrittenOutputs", "regions_by_file"]
