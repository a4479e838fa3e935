"""The job runner: the one place that knows the order of a run and which worker does what.

Every command (``accumulate``, ``posthoc``, ``average``, ``consolidate``, ``reshard``) is a
:class:`Job`. :func:`run_job` runs it in this order:

1. **lock** the output and **recover** what a killed run left beside it (coordinator);
2. **plan** from metadata alone (coordinator), then share the plan with every worker;
3. **stage**: one staging directory per output target, beside its final path (coordinator);
4. **compute** (every worker): open the sources, check them, and stream the engine over this
   worker's share of the output files (:meth:`JobContext.write`);
5. **manifest** each output and **publish** it atomically, in the order the job lists its
   targets (coordinator).

A failure anywhere removes the staging directories and leaves every published output as it
was. A job may answer a checkpoint's error with a new plan (:meth:`Job.retry`: skip that
checkpoint and go on); the lock is held throughout.

Spawned workers (``workers=N``) receive the job itself, options included, so no option can
be lost on the way to a rank.

Example:
    >>> result = run_job(ConsolidateJob(ConsolidateOptions("ckpts/ema", "ema.safetensors")))  # doctest: +SKIP
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._env import check_working_directory
from ._gc import frozen_heap, paused_gc
from .dist import Workers, current_workers, in_worker_group, run_workers
from .engine import EngineStats, OutputSpec, combine_regions
from .errors import EmaCkptError, OptionError, UsageError
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .formats.options import read_options_from, reading
from .fs import OutputLock, check_output_place, discard_on_error, new_staging_dir, publish, publish_file, recover
from .manifest import Manifest
from .progress import Progress
from .remote import RemotePath, is_remote
from .remote_output import (
    RemoteLock,
    begin_upload,
    commit_upload,
    local_staging_dir,
    new_generation,
    recover_remote,
    upload_data_files,
    upload_file,
)
from .torch_records.checks import settle_reads
from .writers.base import OutputTensor, OutputWriter, PlannedRegion, WrittenFile
from .writers.outputs import region_cost

if TYPE_CHECKING:
    import torch

PlanT = TypeVar("PlanT")
ComputedT = TypeVar("ComputedT")
ResultT = TypeVar("ResultT")
T = TypeVar("T")


class RunSettings(Protocol):
    """The fields of every command's options that the runner itself reads."""

    @property
    def workers(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def wait_seconds(self) -> float: ...


def recorded_options(options: Any) -> dict[str, Any]:
    """An options dataclass as its manifest records it: JSON values, without the fields that
    only say where or how a run ran (``metadata={"recorded": False}``).

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Opts:
        ...     dtype: str = "float32"
        ...     workers: int = field(default=1, metadata={"recorded": False})
        >>> recorded_options(Opts())
        {'dtype': 'float32'}
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if f.metadata.get("recorded", True):
            out[f.name] = _jsonable(getattr(options, f.name))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (Path, RemotePath)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class Target:
    """One output of a run: its final path, and how it is staged.

    ``near``: stage beside this directory instead (the outputs of a sweep live inside it,
    and no half-built output may appear there). ``single_file``: the output is one file.
    ``replace``: an existing output may be replaced (else the run stops before writing).
    """

    final: Path
    near: Path | None = None
    single_file: bool = False
    replace: bool = False


@dataclass(slots=True)
class WrittenOutputs:
    """Files of each output (on every worker) and totals over all workers."""

    files: list[list[WrittenFile]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0


class Job(abc.ABC, Generic[PlanT, ComputedT, ResultT]):
    """One command's run, as the runner asks for it (see the module docstring).

    Only :meth:`compute` runs on every worker; :meth:`plan`, :meth:`manifests` and
    :meth:`finish_without_output` run on the coordinator. Plans and computed values cross
    processes, so they must pickle.
    """

    options: RunSettings

    def lock_path(self) -> Path | None:
        """The output the run locks; None when it writes nothing (a dry run)."""
        return None

    def recover_paths(self) -> Sequence[Path]:
        """Outputs to repair before planning (a killed run's staging or backup beside them)."""
        lock = self.lock_path()
        return [lock] if lock is not None else []

    @abc.abstractmethod
    def plan(self, notes: list[str]) -> PlanT:
        """What to compute, from metadata only (under the lock; ``notes`` from recovery)."""

    @abc.abstractmethod
    def targets(self, plan: PlanT) -> Sequence[Target]:
        """The outputs to stage and publish, in publish order; none: nothing to compute."""

    @abc.abstractmethod
    def compute(self, plan: PlanT, context: JobContext) -> ComputedT:
        """Every worker: write the outputs into ``context.stagings``."""

    def manifests(self, plan: PlanT, computed: ComputedT) -> Sequence[Manifest | None]:
        """The manifest of each target (None: it has none)."""
        return [None] * len(self.targets(plan))

    def finish_without_output(self, plan: PlanT) -> None:
        """Coordinator, when the plan has no target (e.g. record a skip in an existing manifest)."""
        return None

    def retry(self, plan: PlanT, error: EmaCkptError) -> PlanT | None:
        """A new plan after ``error`` (the same on every worker), or None to stop with it."""
        return None

    @abc.abstractmethod
    def result(self, plan: PlanT, computed: ComputedT | None, seconds: float) -> ResultT:
        """What the library call returns (``computed`` is None when nothing was written)."""


def run_job(job: Job[PlanT, ComputedT, ResultT], *,
            on_progress: Callable[[Progress], None] | None = None) -> ResultT:
    """Run ``job`` on this process or its worker group (see the module docstring)."""
    settings = job.options
    if settings.workers > 1 and not in_worker_group() and job.lock_path() is not None:
        result: ResultT = run_workers(settings.workers, run_job, job, local_kwargs={"on_progress": on_progress})
        return result
    check_working_directory()  # before the lock and the staging exist: a start-up that cannot fail later
    with reading(read_options_from(settings)):  # every reader of the run, on every worker
        return _run_job(job, on_progress)


def _run_job(job: Job[PlanT, ComputedT, ResultT], on_progress: Callable[[Progress], None] | None) -> ResultT:
    settings = job.options
    started = time.perf_counter()
    group = current_workers(settings.device)
    with contextlib.ExitStack() as stack:

        held: list[RemoteLock] = []

        def prepare() -> PlanT:
            notes: list[str] = []
            lock = job.lock_path()
            if lock is not None:
                if is_remote(lock):
                    held.append(stack.enter_context(RemoteLock(lock, wait_seconds=settings.wait_seconds)))
                else:
                    stack.enter_context(OutputLock(lock, wait_seconds=settings.wait_seconds))
                for path in job.recover_paths():
                    notes += recover_output(path)
            return job.plan(notes)

        plan = group.on_coordinator(prepare)
        while True:
            targets = list(job.targets(plan))
            if not targets:
                group.on_coordinator(functools.partial(job.finish_without_output, plan))
                return job.result(plan, None, time.perf_counter() - started)
            try:
                computed = _stage_compute_publish(job, plan, targets, group, on_progress,
                                                  held[0] if held else None)
            except EmaCkptError as err:
                again = job.retry(plan, err)
                if again is None:
                    raise
                plan = again
                continue
            return job.result(plan, computed, time.perf_counter() - started)


def recover_output(final: Path) -> list[str]:
    """Repair what a killed run left at ``final`` (local or on object storage); notes of it."""
    return recover_remote(final) if is_remote(final) else recover(final)


def _stage_compute_publish(job: Job[PlanT, ComputedT, Any], plan: PlanT, targets: Sequence[Target],
                           group: Workers, on_progress: Callable[[Progress], None] | None,
                           lock: RemoteLock | None = None) -> ComputedT:
    def stage() -> tuple[list[Path], list[str | None]]:
        for target in targets:
            recover_output(target.final)
            if target.final.exists() and not target.replace:
                raise UsageError(f"{target.final} exists; pass {{overwrite=True}} to replace it", remedy="overwrite")
            check_output_place(target.final)
        stagings, generations = [], []
        generation = new_generation()  # one per run: the outputs of a run share one layout
        for target in targets:
            if is_remote(target.final):  # built on a local disk, uploaded under a new generation
                stagings.append(local_staging_dir(target.final))
                generations.append(None if target.single_file else generation)
            else:
                stagings.append(new_staging_dir(target.final, near=target.near))
                generations.append(None)
        for target, tag in zip(targets, generations, strict=True):
            if tag is not None:
                begin_upload(target.final, tag)
        return stagings, generations

    stagings, generations = group.on_coordinator(stage)
    stagings = list(stagings)
    own: list[Path] = []  # this worker's local stagings of outputs on object storage
    if not group.is_coordinator:  # built on this node's disk: the nodes need share no filesystem
        for index, target in enumerate(targets):
            if is_remote(target.final):
                stagings[index] = local_staging_dir(target.final)
                own.append(stagings[index])
    try:
        return _compute_publish(job, plan, targets, group, on_progress, lock, stagings, generations)
    except EmaCkptError:
        # what this attempt uploaded goes, as a local staging does (an upload already switched
        # over is finished instead); where the store itself failed, the next run recovers it
        if group.is_coordinator:
            for target, tag in zip(targets, generations, strict=True):
                if tag is not None:
                    with contextlib.suppress(Exception):
                        recover_remote(target.final)
        raise
    finally:
        for path in own:
            shutil.rmtree(path, ignore_errors=True)


def _compute_publish(job: Job[PlanT, ComputedT, Any], plan: PlanT, targets: Sequence[Target], group: Workers,
                     on_progress: Callable[[Progress], None] | None, lock: RemoteLock | None, stagings: list[Path],
                     generations: list[str | None]) -> ComputedT:
    with discard_on_error(stagings, owner=group.is_coordinator), contextlib.ExitStack() as readers:
        context = JobContext(group, list(stagings), list(targets), readers, job.options.device, on_progress,
                             list(generations))
        # every worker has finished writing into the stagings before the coordinator publishes them
        computed = group.run(functools.partial(job.compute, plan, context))

        def publish_all() -> None:
            manifests = job.manifests(plan, computed)
            for staging, manifest in zip(stagings, manifests, strict=True):
                if manifest is not None:
                    manifest.write(staging)
            for target, staging, generation in zip(targets, stagings, generations, strict=True):
                if not is_remote(target.final):
                    (publish_file if target.single_file else publish)(staging, target.final)
                    continue
                if lock is not None:
                    lock.check()
                if generation is None:
                    upload_file(staging / target.final.name, target.final)
                else:
                    commit_upload(staging, target.final, generation, lock=lock)
                shutil.rmtree(staging, ignore_errors=True)

        group.on_coordinator(publish_all)
    return computed


@dataclass
class JobContext:
    """What :meth:`Job.compute` works with: the workers, the staging directories, and the
    engine's entry points."""

    workers: Workers
    stagings: list[Path]
    targets: list[Target]
    stack: contextlib.ExitStack
    device: str = "cpu"
    on_progress: Callable[[Progress], None] | None = None
    generations: list[str | None] = field(default_factory=list)
    """Per target on object storage, the generation its data files are named by (else None)."""

    def check(self, step: Callable[[], T]) -> T:
        """Run ``step`` on every worker; all fail alike if one does (a synchronisation point)."""
        return self.workers.run(step)

    def open_sources(self, paths: Sequence[Path]) -> list[CheckpointReader]:
        """Open every checkpoint on every worker, parsing each DCP ``.metadata`` only once.

        Parsing metadata (a bounds-checked, restricted unpickle) costs time in proportion to the
        keys, the largest fixed cost of a run over many small tensors. With N workers, worker r
        parses inputs r, r+N, … and the parsed indexes are exchanged, so the parse is split
        instead of repeated. The readers close when the run's attempt ends.
        """
        # their indexes (millions of objects) live as long as the readers: no collection while they are
        # parsed, sent and received, then kept out of cyclic collections (ema_ckpt._gc)
        with paused_gc():
            readers = _open_checkpoints(self.workers, paths, self.stack)
            self.stack.enter_context(frozen_heap())
        return readers

    def writer(self, index: int, format_name: str, **settings: Any) -> OutputWriter:
        """The writer of target ``index`` in the output format ``format_name``."""
        from .writers.base import output_format

        target = self.targets[index]
        if is_remote(target.final):
            check_remote_output(target, self.workers.world_size)
        writer = output_format(format_name).make(self.stagings[index], target.final.name, **settings)
        writer.final = target.final
        generation = self.generations[index] if index < len(self.generations) else None
        if generation is not None:
            writer.file_tag = generation
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
        """Stream this worker's share of every output through the engine, then finish them.

        Every writer plans the same regions (outputs of one run share ``layout``'s chunks);
        files are shared out among the workers by work; the coordinator writes each output's
        metadata once every worker has closed its files. Progress is reported in bytes of
        tensor data read (what the results' ``bytes_read`` counts), the total first.
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
        progress = None
        if self.on_progress is not None:
            progress = _ReadsProgress(self.on_progress, by_file, self.workers.claim_order(costs), sources, outputs,
                                      by_key)

        def compute() -> tuple[list[Any], EngineStats]:
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
                if writer.final is not None and is_remote(writer.final) and writer.file_tag is not None:
                    upload_data_files(writer.staging, writer.final, writer.own_files(state))
            return states, stats

        try:
            states, stats = self.workers.run(compute)
            settle_reads(sources, self.workers)  # records read only in part, checked before anything is finished
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
        # only the coordinator needs the states (it writes the metadata); every worker needs the totals
        gathered = self.workers.exchange((states if not self.workers.is_coordinator else None, stats.bytes_read,
                                          stats.bytes_written))
        def finish() -> list[list[WrittenFile]]:
            # the workers' states and the metadata: tens of thousands of lasting objects each
            with paused_gc():
                every = [states]
                for g in gathered[1:]:
                    assert g[0] is not None  # sent by every worker but the coordinator
                    every.append(g[0])
                return [w.finish([part[k] for part in every]) for k, w in enumerate(writers)]

        files = self.workers.on_coordinator(finish)
        return WrittenOutputs(files, sum(g[1] for g in gathered), sum(g[2] for g in gathered))


def check_remote_output(target: Target, world_size: int) -> None:
    """Refuse an output that cannot be published on object storage as :mod:`.remote_output` does."""
    if target.single_file and world_size > 1:
        raise OptionError("out", f"{target.final}: a single-file output on object storage is written by one "
                          "worker; run with one worker (or write a directory)", value=str(target.final))


class _ReadsProgress:
    """The engine's per-region reports restated in bytes read (as the results count them), over
    the whole run.

    A floating region is read from every source an output sums or folds (in each source's own
    dtype), any other from one source. The total is reported at once, before any region is read,
    so a progress bar never starts without it. With several workers, this one reports the work
    claimed so far by any of them (files are claimed in turn, see :meth:`Workers.claims`) plus
    its own progress in the file it works on: a little ahead of the truth, never backwards.
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

        def on_region(p: Progress) -> None:
            self._send(base + done[p.regions_done], regions_base + p.regions_done, p.key)

        return on_region

    def finish(self) -> None:
        self._send(self.total, self.regions_total, "")

    def _send(self, bytes_done: int, regions_done: int, key: str) -> None:
        if bytes_done < self.reported:
            return
        self.reported = bytes_done
        self.report(Progress(bytes_done, self.total, regions_done, self.regions_total, key))


def regions_by_file(regions: Sequence[PlannedRegion]) -> list[list[PlannedRegion]]:
    """The regions grouped by output file, files in order of their first region (each file is
    written by one worker, in the order its regions were planned)."""
    files: dict[str, list[PlannedRegion]] = {}
    for region in regions:
        files.setdefault(region.file, []).append(region)
    return list(files.values())


def _open_checkpoints(workers: Workers, paths: Sequence[Path], stack: contextlib.ExitStack
                      ) -> list[CheckpointReader]:
    def opened(path: Path, shared: Any = None) -> CheckpointReader:
        return stack.enter_context(contextlib.closing(open_checkpoint(path, shared=shared)))

    if workers.world_size == 1:
        return [opened(p) for p in paths]
    mine = workers.run(lambda: {i: opened(p) for i, p in enumerate(paths)
                                if i % workers.world_size == workers.rank})
    shared: dict[int, Any] = {}
    for part in workers.exchange({i: state for i, r in mine.items() if (state := r.share()) is not None}):
        shared.update(part)
    return workers.run(lambda: [mine[i] if i in mine else opened(p, shared.get(i)) for i, p in enumerate(paths)])


__all__ = ["Job", "JobContext", "Target", "WrittenOutputs", "recorded_options", "regions_by_file", "run_job"]
