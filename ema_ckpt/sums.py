"""Weighted sums of checkpoints as one job of the runner: ``posthoc``, ``average`` and the
candidates ``select`` evaluates are each a :class:`~ema_ckpt.plans.Plan` written by :class:`SumJob`.

The plan (outputs × terms) comes from the options; executing it reads each input region once
and adds it into every output, so K outputs cost one pass over the inputs. Each output is a
directory holding its manifest (``ema-ckpt.json``) and the data in one of :data:`SUM_FORMATS`.

Example:
    >>> SUM_FORMATS
    ('dcp', 'safetensors', 'hf', 'torch')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .dtypes import ACCUMULATE_DTYPES, torch_dtype
from .engine import OutputSpec, Update
from .errors import Note, OptionError, UsageError
from .job_context import JobContext, WrittenOutputs
from .jobs import Job, Target, recorded_options
from .manifest import FoldedCheckpoint, Manifest, fingerprint
from .options import RUNTIME, InputFields, KeyFields, ReadFields, RunFields
from .plans import Plan, PlannedOutput
from .selection import averaged_tensors, carry_into, check_compatible, container_prefix, output_names, select_keys
from .storage import Location, as_path, files_on_disk
from .writers.base import OutputWriter, check_directory_output

SUM_FORMATS = ("dcp", "safetensors", "hf", "torch")
"""The output formats of a weighted sum, each output a directory holding its manifest: a DCP
checkpoint, ``model.safetensors``, the Hugging Face sharded layout (with the newest input's
config files), or ``model.pt`` (a ``torch.save`` state dict)."""
SAFETENSORS_FILE = "model.safetensors"
"""The one data file of a ``safetensors`` output (the name Hugging Face loaders look for)."""
TORCH_FILE = "model.pt"
"""The one data file of a ``torch`` output."""
HF_SHARD_BYTES = 5 * 10**9
"""The shard limit of an ``hf`` output (Hugging Face's default)."""
_FILE_OUTPUTS = {"safetensors": ("safetensors", SAFETENSORS_FILE), "torch": ("torch", TORCH_FILE)}


@dataclass(frozen=True, kw_only=True)
class SumOptions(InputFields, KeyFields, ReadFields, RunFields):
    """The options of a weighted sum, as :class:`SumJob` reads them: ``posthoc``'s and ``average``'s
    (which add how the plan is made) and ``select``'s candidates.

    ``out`` is the one output, or the parent of one directory per output (:attr:`single_output`).
    """

    out: Location = field(metadata=RUNTIME)
    dtype: str = "float32"
    format: str | None = None
    average_buffers: bool = False
    dry_run: bool = field(default=False, metadata=RUNTIME)
    overwrite: bool = field(default=False, metadata=RUNTIME)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format is not None and self.format not in SUM_FORMATS:
            raise OptionError("format", f"must be one of {', '.join(SUM_FORMATS)}, got {self.format!r}",
                              value=self.format)
        if self.dtype not in ACCUMULATE_DTYPES:
            raise OptionError("dtype", f"must be one of {', '.join(ACCUMULATE_DTYPES)}, got {self.dtype!r}",
                              value=self.dtype)
        written = self.format or "dcp"
        check_directory_output(self.out, "dcp" if written == "hf" else written)

    @property
    def single_output(self) -> bool:
        """Whether ``out`` is the one output (else the parent of one directory per output)."""
        raise NotImplementedError

    def make_plan(self) -> Plan:
        """The outputs × terms to compute (from steps and manifests alone)."""
        raise NotImplementedError

    def recorded(self) -> dict[str, Any]:
        """What each output's manifest records of these options."""
        return recorded_options(self)


@dataclass(slots=True)
class SumPlan(Plan):
    """A :class:`~ema_ckpt.plans.Plan` and the output format it writes (chosen when planned)."""

    format: str = "dcp"


def default_format(plan: Plan) -> str:
    """The output format when none is asked for: the newest input's where a sum writes it
    (safetensors), else ``dcp`` (DCP, DeepSpeed and torch-file inputs)."""
    steps = {str(c.path): (c.step, str(c.path)) for c in plan.inputs}
    used = [t.path for o in plan.outputs for t in o.terms]
    newest = max(used, key=lambda p: steps.get(p, (-1, p)), default=None)
    name = next((c.format_name for c in plan.inputs if str(c.path) == newest), "dcp")
    return name if name in SUM_FORMATS else "dcp"


@dataclass(slots=True)
class RunResult:
    """What a weighted sum (:func:`~ema_ckpt.posthoc`, :func:`~ema_ckpt.average`) wrote.

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
    """A weighted sum of checkpoints (``posthoc``, ``average``, ``select``'s candidates) as a job of the runner."""

    options: SumOptions
    extra_manifest: dict[str, Any] = field(default_factory=dict)
    """Written into each output's manifest ``options`` (``select``: the choice and its scores)."""

    def lock_path(self) -> Location | None:
        return None if self.options.dry_run else self.options.out

    def plan(self, notes: list[str]) -> SumPlan:
        plan = self.options.make_plan()
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
        return SumPlan(**fields, format=self.options.format or default_format(plan))

    def _finals(self, plan: SumPlan) -> list[Location]:
        out = self.options.out
        return [out] if self.options.single_output else [out / o.name for o in plan.outputs]

    def targets(self, plan: SumPlan) -> list[Target]:
        if self.options.dry_run:
            return []
        near = None if self.options.single_output else self.options.out
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
            tensors = averaged_tensors(newest, keys, opts.dtype, average_buffers=opts.average_buffers)
            writers = [context.writer(i, "dcp", planner_data=newest.planner_data) for i in range(len(outputs))]
        else:
            names = output_names(newest, keys, keep_prefix=opts.keep_prefix)
            renamed = None if opts.keep_prefix else container_prefix(newest, keys)
            tensors = averaged_tensors(newest, keys, opts.dtype, names=names, average_buffers=opts.average_buffers)
            writers = [_file_writer(context, i, plan.format) for i in range(len(outputs))]
        carry_into(writers, newest, opts.include, opts.exclude)
        written = context.write(readers, outputs, writers, tensors, layout=newest, copy_source=len(readers) - 1,
                                accumulate_dtype=torch_dtype(opts.dtype), check_finite=range(len(readers)))
        return _Summed(written, newest.format_name, renamed)

    def manifests(self, plan: SumPlan, computed: _Summed) -> list[Manifest | None]:
        opts = self.options
        recorded = {**opts.recorded(), "format": plan.format, **self.extra_manifest}
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
    """The writer of target ``index``'s data in ``format_name`` (its manifest beside it).

    Every output's files have the same names, so the outputs of a run plan the same regions.
    """
    if format_name == "hf":
        return context.writer(index, "hf-sharded", max_shard_bytes=HF_SHARD_BYTES)
    output_name, file_name = _FILE_OUTPUTS[format_name]
    return context.writer(index, output_name, file_name=file_name)


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


__all__ = ["SAFETENSORS_FILE", "SUM_FORMATS", "TORCH_FILE", "RunResult", "SumJob", "SumOptions", "SumPlan",
           "default_format", "output_manifest"]
