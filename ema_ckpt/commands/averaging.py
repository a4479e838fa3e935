"""``posthoc`` and ``average``: weighted sums of checkpoints, planned first, then streamed.

A run is a :class:`~ema_ckpt.plans.Plan` (outputs × terms), computed from steps and manifests
alone; ``dry_run=True`` returns it without reading a tensor. Executing it reads each input
region once and adds it into every output, so a sweep of K profiles costs one pass over the
inputs.

Each output is a directory with its manifest (``ema-ckpt.json``): a DCP checkpoint, or
(``format="safetensors"``) one ``model.safetensors`` file named as ``consolidate`` names it.

Example:
    >>> posthoc("ckpts/", out="posthoc/", sigma_rels=["0.05", "0.10"])   # doctest: +SKIP
    >>> posthoc("ckpts/", out="sweep/", sigma_rels=["0.05"], format="safetensors")  # doctest: +SKIP
    >>> average("ckpts/", out="avg/", last=5)                               # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from ..discovery import checkpoint_paths
from ..dtypes import ACCUMULATE_DTYPES, torch_dtype
from ..engine import OutputSpec, Update, check_device
from ..errors import Note, OptionError, UsageError
from ..formats.options import read_options_from
from ..job_context import JobContext, WrittenOutputs
from ..jobs import Job, Target, recorded_options, run_job
from ..manifest import FoldedCheckpoint, Manifest, fingerprint
from ..plans import Plan, PlannedOutput, SnapshotInput, Term, find_snapshots, plan_average, plan_posthoc
from ..progress import Progress
from ..selection import averaged_tensors, carry_into, check_compatible, container_prefix, output_names, select_keys
from ..storage import Location, as_path, files_on_disk, is_location, output_location, output_path
from ..writers.base import OutputWriter, check_directory_output

_RUNTIME = {"recorded": False}
SUM_FORMATS = ("dcp", "safetensors")
"""The output formats of ``posthoc`` and ``average``: each output a directory holding its manifest."""
SAFETENSORS_FILE = "model.safetensors"
"""The one data file of a ``safetensors`` output (the name Hugging Face loaders look for)."""


@dataclass(frozen=True, slots=True)
class PosthocOptions:
    """Everything a :func:`posthoc` run needs; checked when made."""

    checkpoints: tuple[Location, ...]
    out: Location = field(metadata=_RUNTIME)
    sigma_rels: tuple[str, ...] = ()
    gammas: tuple[str, ...] = ()
    at_step: int | None = None
    step_regex: str | None = None
    skip: tuple[Location, ...] = ()
    dtype: str = "float32"
    format: str | None = None
    keep_prefix: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    state_key: str | None = None
    inert_globals: tuple[str, ...] = field(default=(), metadata=_RUNTIME)
    dry_run: bool = field(default=False, metadata=_RUNTIME)
    overwrite: bool = field(default=False, metadata=_RUNTIME)
    wait_seconds: float = field(default=0.0, metadata=_RUNTIME)
    workers: int = field(default=1, metadata=_RUNTIME)
    device: str = field(default="cpu", metadata=_RUNTIME)

    def __post_init__(self) -> None:
        _check_run_fields(self)
        if not self.sigma_rels and not self.gammas:
            raise UsageError("give at least one {sigma_rels} or {gammas}", mentions=("sigma_rels", "gammas"))

    def make_plan(self) -> Plan:
        return plan_posthoc(self.checkpoints, sigma_rels=self.sigma_rels, gammas=self.gammas, at_step=self.at_step,
                            step_regex=self.step_regex, exclude_paths=[self.out], skip=self.skip)


@dataclass(frozen=True, slots=True)
class AverageOptions:
    """Everything an :func:`average` run needs; checked when made."""

    checkpoints: tuple[Location, ...]
    out: Location = field(metadata=_RUNTIME)
    last: int | None = None
    from_step: int | None = None
    to_step: int | None = None
    step_regex: str | None = None
    skip: tuple[Location, ...] = ()
    dtype: str = "float32"
    format: str | None = None
    keep_prefix: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    state_key: str | None = None
    inert_globals: tuple[str, ...] = field(default=(), metadata=_RUNTIME)
    dry_run: bool = field(default=False, metadata=_RUNTIME)
    overwrite: bool = field(default=False, metadata=_RUNTIME)
    wait_seconds: float = field(default=0.0, metadata=_RUNTIME)
    workers: int = field(default=1, metadata=_RUNTIME)
    device: str = field(default="cpu", metadata=_RUNTIME)

    def __post_init__(self) -> None:
        _check_run_fields(self)
        if self.last is None and self.from_step is None and self.to_step is None:
            raise UsageError("choose the checkpoints: {last=K}, or {from_step=A} and/or {to_step=B}",
                             mentions=("last", "from_step", "to_step"))

    def make_plan(self) -> Plan:
        return plan_average(self.checkpoints, last=self.last, from_step=self.from_step, to_step=self.to_step,
                            step_regex=self.step_regex, exclude_paths=[self.out], skip=self.skip)


def _check_run_fields(options: PosthocOptions | AverageOptions) -> None:
    set_ = object.__setattr__
    set_(options, "inert_globals", read_options_from(options).inert_globals)
    set_(options, "checkpoints", tuple(checkpoint_paths(options.checkpoints)))
    if options.format is not None and options.format not in SUM_FORMATS:
        raise OptionError("format", f"must be one of {', '.join(SUM_FORMATS)}, got {options.format!r}",
                          value=options.format)
    check_directory_output(options.out, options.format or "dcp")
    set_(options, "out", output_path(options.out))
    for name in ("include", "exclude"):
        set_(options, name, tuple(getattr(options, name)))
    set_(options, "skip", tuple(as_path(p) for p in options.skip))
    if options.dtype not in ACCUMULATE_DTYPES:
        raise OptionError("dtype", f"must be one of {', '.join(ACCUMULATE_DTYPES)}, got {options.dtype!r}",
                          value=options.dtype)
    check_device(options.device)


@dataclass(slots=True)
class SumPlan(Plan):
    """A :class:`~ema_ckpt.plans.Plan` and the output format it writes (chosen when planned)."""

    format: str = "dcp"


def default_format(plan: Plan) -> str:
    """The output format when none is asked for: the newest input's, where a sum can write it.

    Safetensors inputs give ``safetensors``; DCP, DeepSpeed and torch-file inputs give ``dcp``
    (``torch.distributed.checkpoint.load`` reads it on any number of ranks).
    """
    steps = {str(c.path): (c.step, str(c.path)) for c in plan.inputs}
    used = [t.path for o in plan.outputs for t in o.terms]
    if not used:
        return "dcp"
    newest = max(used, key=lambda p: steps.get(p, (-1, p)))
    name = next((c.format_name for c in plan.inputs if str(c.path) == newest), "dcp")
    return name if name in SUM_FORMATS else "dcp"


@dataclass(slots=True)
class RunResult:
    """What a :func:`posthoc` or :func:`average` run wrote.

    ``bytes_read`` counts the tensor data read (each input once, however many outputs);
    ``bytes_written`` and ``files_written`` the files on disk (``.metadata`` and manifests included),
    ``files`` their paths; ``format`` is the outputs' format.
    """

    plan: Plan
    outputs: list[Location]
    bytes_read: int
    bytes_written: int
    seconds: float
    files_written: int = 0
    format: str = "dcp"
    files: list[Location] = field(default_factory=list)


@dataclass(slots=True)
class _Summed:
    written: WrittenOutputs
    source_format: str
    renamed_prefix: str | None = None


@dataclass
class SumJob(Job[SumPlan, _Summed, "Plan | RunResult"]):
    """A weighted sum of checkpoints (``posthoc``, ``average``) as a job of the runner."""

    options: PosthocOptions | AverageOptions

    @property
    def single_output(self) -> bool:
        return isinstance(self.options, AverageOptions)

    def lock_path(self) -> Location | None:
        return None if self.options.dry_run else self.options.out

    def plan(self, notes: list[str]) -> SumPlan:
        plan = self.options.make_plan()
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
        return SumPlan(**fields, format=self.options.format or default_format(plan))

    def _finals(self, plan: SumPlan) -> list[Location]:
        out = self.options.out
        return [out] if self.single_output else [out / o.name for o in plan.outputs]

    def targets(self, plan: SumPlan) -> list[Target]:
        if self.options.dry_run:
            return []
        near = None if self.single_output else self.options.out
        return [Target(final, near=near, replace=self.options.overwrite) for final in self._finals(plan)]

    def compute(self, plan: SumPlan, context: JobContext) -> _Summed:
        opts = self.options
        steps = {str(c.path): c.step for c in plan.inputs}
        # (step, path): snapshots of several profiles share a step, and the order of the sum must
        # not depend on set order (string hashing differs per process) or the bits would
        used = sorted({t.path for o in plan.outputs for t in o.terms}, key=lambda p: (steps[p], p))
        index = {p: i for i, p in enumerate(used)}
        readers = context.open_sources([as_path(p) for p in used])

        def check_all() -> list[str]:
            keys = select_keys(readers[-1], opts.include, opts.exclude)
            if not keys:
                raise UsageError(f"{readers[-1].path}: no tensor keys left after {{include}}/{{exclude}}",
                                 mentions=("include", "exclude"))
            check_compatible(readers, keys, reference=len(readers) - 1, include=opts.include, exclude=opts.exclude)
            return keys

        keys = context.check(check_all)
        newest = readers[-1]
        outputs = [OutputSpec(o.name, tuple(Update(index[t.path], t.coefficient)
                                            for t in sorted(o.terms, key=lambda t: index[t.path])), mode="sum")
                   for o in plan.outputs]
        renamed = None
        if plan.format == "dcp":  # the keys as stored, so dcp.load takes the same state dict
            tensors = averaged_tensors(newest, keys, opts.dtype)
            writers = [context.writer(i, "dcp", planner_data=newest.planner_data) for i in range(len(outputs))]
        else:
            names = output_names(newest, keys, keep_prefix=opts.keep_prefix)
            renamed = None if opts.keep_prefix else container_prefix(newest, keys)
            tensors = averaged_tensors(newest, keys, opts.dtype, names=names)
            writers = [_file_writer(context, i, plan.format) for i in range(len(outputs))]
        carry_into(writers, newest, opts.include, opts.exclude)
        written = context.write(readers, outputs, writers, tensors, layout=newest, copy_source=len(readers) - 1,
                                accumulate_dtype=torch_dtype(opts.dtype), check_finite=range(len(readers)))
        return _Summed(written, newest.format_name, renamed)

    def manifests(self, plan: SumPlan, computed: _Summed) -> list[Manifest | None]:
        opts = self.options
        recorded = {**recorded_options(opts), "format": plan.format}
        return [output_manifest(plan.kind, output, files, opts.dtype, computed.source_format,
                                opts.include, opts.exclude, recorded)
                for output, files in zip(plan.outputs, computed.written.files, strict=True)]

    def result(self, plan: SumPlan, computed: _Summed | None, seconds: float) -> Plan | RunResult:
        if computed is None:
            return plan
        if computed.renamed_prefix:
            plan.notes.append(Note(f"keys written without the DCP container level {computed.renamed_prefix!r} "
                                   "({keep_prefix=True} keeps it)", mentions=("keep_prefix",)))
        finals = self._finals(plan)
        files = [(final / name, size) for final in finals for name, size in files_on_disk(final)]
        return RunResult(plan, finals, computed.written.bytes_read, sum(size for _, size in files), seconds,
                         files_written=len(files), format=plan.format, files=[path for path, _ in files])


def _file_writer(context: JobContext, index: int, format_name: str) -> OutputWriter:
    """The writer of a one-file output inside target ``index``'s directory (its manifest beside it).

    Every output's file has the same name, so the outputs of a run plan the same regions.
    """
    return context.writer(index, format_name, file_name=SAFETENSORS_FILE)


def output_manifest(kind: str, output: PlannedOutput, files: Sequence[Any], dtype: str, source_format: str,
                    include: Sequence[str], exclude: Sequence[str], options: dict[str, Any]) -> Manifest:
    """The manifest of one output of a weighted sum."""
    return Manifest(
        kind=kind, profile=output.profile, dtype=dtype, step=output.step, source_format=source_format,
        checkpoints=[FoldedCheckpoint(str(as_path(t.path).resolve()), t.step, fingerprint(as_path(t.path)))
                     for t in output.terms],
        selection={"include": list(include), "exclude": list(exclude)},
        files={f.name: {"size": f.size, "crc32": f.crc32} for f in files},
        terms=[{"path": str(as_path(t.path).resolve()), "step": t.step, "coefficient": t.coefficient}
               for t in output.terms],
        warnings=list(output.warnings),
        options=options,
    )


@overload
def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location,
            dry_run: Literal[False] = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> RunResult: ...
@overload
def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: Literal[True],
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan: ...
@overload
def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: bool = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan | RunResult: ...


def posthoc(
    checkpoints: str | Location | Sequence[str | Location],
    *,
    out: str | Location,
    dry_run: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    **options: Any,
) -> Plan | RunResult:
    """Post-hoc power-function EMAs (EDM2), one per value, at ``out/sigma_rel_<value>``.

    Each output is a directory with its manifest: a DCP checkpoint, or (``format="safetensors"``)
    ``model.safetensors``, its keys named as :func:`~ema_ckpt.consolidate` names them.

    Args:
        checkpoints: a folder of raw checkpoints, or of the snapshots ``accumulate(snapshot_every=…)`` keeps.
        out: parent directory of the outputs.
        dry_run: return the :class:`~ema_ckpt.plans.Plan` (coefficients) and read no tensor.
        on_progress: called after each region.
        **options: the fields of :class:`PosthocOptions`: ``sigma_rels``, ``gammas`` (the
            profiles as typed: ``"0.05"``, ``"0.05:0.2:0.05"``), ``at_step`` (T, default the
            newest checkpoint), ``step_regex``, ``skip``, ``dtype``, ``format`` (``dcp`` or
            ``safetensors``; default: safetensors for safetensors inputs, else dcp), ``keep_prefix``
            (safetensors: keep the ``model.`` of a DCP ``{"model": …}`` save), ``include``,
            ``exclude``, ``state_key`` and ``inert_globals`` (single-file checkpoints: as for
            :func:`~ema_ckpt.accumulate`), ``overwrite``, ``wait_seconds``, ``workers``, ``device``.

    Example:
        >>> plan = posthoc("ckpts", out="posthoc", sigma_rels=["0.05", "0.1"], dry_run=True)  # doctest: +SKIP
        >>> [round(sum(t.coefficient for t in o.terms), 12) for o in plan.outputs]              # doctest: +SKIP
        [1.0, 1.0]
    """
    opts = PosthocOptions(_paths(checkpoints), output_location(out), dry_run=dry_run, **_tuples(options))
    return run_job(SumJob(opts), on_progress=on_progress)


@overload
def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location,
            dry_run: Literal[False] = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> RunResult: ...
@overload
def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: Literal[True],
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan: ...
@overload
def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: bool = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan | RunResult: ...


def average(
    checkpoints: str | Location | Sequence[str | Location],
    *,
    out: str | Location,
    dry_run: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    **options: Any,
) -> Plan | RunResult:
    """Uniform average of the selected checkpoints into ``out`` (one directory, as :func:`posthoc` writes).

    Args:
        checkpoints: a folder of checkpoints, or a list of them.
        out: the output directory.
        dry_run: return the :class:`~ema_ckpt.plans.Plan` and read no tensor.
        **options: the fields of :class:`AverageOptions`: ``last`` (the newest K), or
            ``from_step``/``to_step``; and as for :func:`posthoc`.

    Example:
        >>> average("ckpts", out="avg", last=5)  # doctest: +SKIP
    """
    opts = AverageOptions(_paths(checkpoints), output_location(out), dry_run=dry_run, **_tuples(options))
    return run_job(SumJob(opts), on_progress=on_progress)


def _paths(checkpoints: str | Location | Sequence[str | Location]) -> tuple[Location, ...]:
    if isinstance(checkpoints, str) or is_location(checkpoints):
        return (as_path(checkpoints),)
    return tuple(as_path(p) for p in checkpoints)


def _tuples(options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(PosthocOptions.__dataclass_fields__) - set(AverageOptions.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unexpected option{'s' if len(unknown) > 1 else ''}: {', '.join(sorted(unknown))}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


__all__ = ["SUM_FORMATS", "AverageOptions", "Plan", "PlannedOutput", "PosthocOptions", "RunResult", "SnapshotInput",
           "SumJob", "SumPlan", "Term", "average", "default_format", "find_snapshots", "posthoc"]
