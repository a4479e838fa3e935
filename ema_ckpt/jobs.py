"""The job runner: the one place that knows the order of a run and which worker does what.

:func:`run_job` runs a :class:`Job` that writes in this order: **lock** the output and
**recover** what a killed run left (coordinator); **plan** from metadata alone (coordinator,
shared with every worker); **stage** one directory per target (coordinator); **compute** on
every worker (:meth:`JobContext.write`); **manifest** and **publish** each target in the order
the job lists them (coordinator). A job that only reads (:attr:`Job.writes` False) is planned,
then computed on every worker (:meth:`JobContext.share_out`). A failure anywhere removes the
stagings; :meth:`Job.retry` may answer a checkpoint's error with a new plan under the same lock.
Spawned workers receive the job itself, so no option is lost on the way to a rank.

Example:
    >>> result = run_job(ConsolidateJob(options))  # doctest: +SKIP
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from ._env import check_working_directory
from .dist import Workers, current_workers, in_worker_group
from .dist.pool import run_workers
from .errors import EmaCkptError, UsageError
from .formats.options import read_options_from
from .job_context import JobContext
from .manifest import MANIFEST_NAME, OUTPUT_OWN_FILES, Manifest, check_output_place
from .options import RunFields
from .progress import Progress
from .storage import (
    HeldLock,
    Location,
    Staged,
    destination_for,
    discard_on_error,
    is_location,
    new_generation,
    output_lock,
)
from .storage.roles import MANIFEST
from .writers.base import OutputWriter

PlanT = TypeVar("PlanT")
ComputedT = TypeVar("ComputedT")
ResultT = TypeVar("ResultT")
T = TypeVar("T")


def recorded_options(options: Any) -> dict[str, Any]:
    """An options dataclass as its manifest records it: JSON values, without the fields that
    only say where or how a run ran (``metadata={"recorded": False}``).

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Opts:
        ...     dtype: str = "float32"
        ...     workers: int = dataclasses.field(default=1, metadata={"recorded": False})
        >>> recorded_options(Opts())
        {'dtype': 'float32'}
    """
    return {f.name: _jsonable(getattr(options, f.name)) for f in dataclasses.fields(options)
            if f.metadata.get("recorded", True)}


def _jsonable(value: Any) -> Any:
    if is_location(value):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class Target:
    """One output of a run: its final path; ``near``: stage beside this directory instead (a
    sweep's outputs live inside it); ``replace``: an existing output may be replaced."""

    final: Location
    near: Location | None = None
    single_file: bool = False
    replace: bool = False


class Job(abc.ABC, Generic[PlanT, ComputedT, ResultT]):
    """One command's run: :meth:`plan`, :meth:`manifests` and :meth:`finish_without_output` run on
    the coordinator, the rest on every worker. Plans and computed values cross processes, so they
    must pickle."""

    options: RunFields
    writes: ClassVar[bool] = True
    """False for a job that only reads (``verify``, ``diff``): no targets, no lock."""

    def lock_path(self) -> Location | None:
        """The output the run locks; None when it writes nothing (a dry run)."""
        return None

    def recover_paths(self) -> Sequence[Location]:
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


class ReadingJob(Job[PlanT, ResultT, ResultT]):
    """A job that only reads (``verify``, ``diff``): what every worker computes is its result."""

    writes = False

    def targets(self, plan: PlanT) -> list[Target]:
        return []

    def result(self, plan: PlanT, computed: ResultT | None, seconds: float) -> ResultT:
        assert computed is not None
        return computed


def run_job(job: Job[PlanT, ComputedT, ResultT], *,
            on_progress: Callable[[Progress], None] | None = None) -> ResultT:
    """Run ``job`` on this process or its worker group (see the module docstring)."""
    settings = job.options
    if (settings.workers > 1 and not in_worker_group()
            and (not job.writes or job.lock_path() is not None)):  # a dry run writes nothing, alone
        result: ResultT = run_workers(settings.workers, run_job, job, local_kwargs={"on_progress": on_progress})
        return result
    check_working_directory()  # before the lock and the staging exist: a start-up that cannot fail later
    started = time.perf_counter()
    group = current_workers(settings.device)
    if not job.writes:
        plan = group.on_coordinator(functools.partial(job.plan, []))
        with contextlib.ExitStack() as readers:
            context = JobContext(group, [], readers, settings.device, on_progress, read=read_options_from(settings))
            computed = group.run(functools.partial(job.compute, plan, context))
        return job.result(plan, computed, time.perf_counter() - started)
    with contextlib.ExitStack() as stack:

        held: list[HeldLock] = []

        def prepare() -> PlanT:
            notes: list[str] = []
            lock = job.lock_path()
            if lock is not None:
                held.append(stack.enter_context(output_lock(lock, wait_seconds=settings.wait_seconds)))
                for path in job.recover_paths():
                    notes += destination_for(path).recover()
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


def _stage_compute_publish(job: Job[PlanT, ComputedT, Any], plan: PlanT, targets: Sequence[Target],
                           group: Workers, on_progress: Callable[[Progress], None] | None,
                           lock: HeldLock | None = None) -> ComputedT:
    destinations = [destination_for(t.final, near=t.near, single_file=t.single_file) for t in targets]

    def stage() -> list[Staged]:
        for target, destination in zip(targets, destinations, strict=True):
            destination.recover()
            if target.final.exists() and not target.replace:
                raise UsageError(f"{target.final} exists; pass {{overwrite=True}} to replace it", remedy="overwrite")
            check_output_place(target.final)
        generation = new_generation()  # one per run: the outputs of a run share one layout
        return [d.stage(generation=generation) for d in destinations]

    staged = list(group.on_coordinator(stage))
    sinks = [d.sink(s, coordinator=group.is_coordinator) for d, s in zip(destinations, staged, strict=True)]
    stagings = [s.directory for s in staged]
    try:
        with discard_on_error(stagings, owner=group.is_coordinator), contextlib.ExitStack() as readers:
            context = JobContext(group, list(sinks), readers, job.options.device, on_progress,
                                 read=read_options_from(job.options))
            # every worker has finished writing into the stagings before the coordinator publishes them
            computed = group.run(functools.partial(job.compute, plan, context))

            def publish_all() -> None:
                manifests = job.manifests(plan, computed)
                for staging, manifest in zip(stagings, manifests, strict=True):
                    if manifest is not None:
                        manifest.write(staging)
                for index, (destination, output) in enumerate(zip(destinations, staged, strict=True)):
                    roles = {**context.roles.get(index, {}), MANIFEST_NAME: MANIFEST}
                    previous = functools.partial(_replaced, destination.final, context.writers.get(index))
                    destination.publish(output, roles, replaces=previous, lock=lock)

            group.on_coordinator(publish_all)
        return computed
    except EmaCkptError:
        if group.is_coordinator:
            for destination in destinations:
                destination.abandon()
        raise
    finally:
        for sink in sinks:
            sink.close()


def _replaced(final: Location, writer: OutputWriter | None) -> set[str]:
    """What of the output at ``final`` a new one replaces, where it is not swapped in whole: the
    files its manifest lists and the manifest's own, and the files of the writer's format there.
    Read before the commit, so the previous output's."""
    if not final.is_dir():
        return set()
    manifest = Manifest.read(final, check=False)
    listed = (set(manifest.files) | OUTPUT_OWN_FILES) if manifest is not None else set()
    return listed | {p.name for p in final.iterdir() if writer is not None and writer.owns(p.name)}


__all__ = ["Job", "ReadingJob", "Target", "recorded_options", "run_job"]
