"""``accumulate``: fold new checkpoints into running EMAs kept on disk.

Made for cron: each run folds only the checkpoints newer than the step an EMA stands at, with
the right decay across each gap, so the EMA outlives the trainer's retention. Each new EMA is
built beside the old one and swapped in whole; a killed run leaves the old one as it was.
A classic EMA (``decay``/``half_life``) is kept in ``out``; power-function EMAs (EDM2;
``sigma_rels``/``gammas``) in ``out/sigma_rel_<value>``, with ``snapshot_every=K`` a snapshot
of each every K steps in ``out/snapshots/`` for ``posthoc``. Every EMA and snapshot is computed
in one pass over the inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from ..discovery import FoundCheckpoint, LeftPart, checkpoint_paths
from ..dtypes import ACCUMULATE_DTYPES, torch_dtype
from ..engine import OutputSpec, Update
from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    EmaCkptError,
    NonFiniteError,
    Note,
    OptionError,
    UsageError,
)
from ..folding import (
    AccumulateResult,
    Accumulator,
    FoldTerm,
    Profile,
    check_fold_keys,
    check_same_settings,
    checkpoint_holding,
    component_file,
    components_to_fold,
    default_out,
    find_new,
    fold_inputs,
    fold_plan,
    fold_terms,
    fold_weights,
    named_profiles,
    record_skips,
    skip_records,
)
from ..formats import open_checkpoint
from ..formats.dcp.reader import DcpReader
from ..formats.options import read_options_from
from ..integrity import as_damaged_ema, refuse_damaged_emas, refuse_damaged_remote_emas, remote_emas_folded_into
from ..job_context import JobContext, WrittenOutputs
from ..jobs import Job, Target, recorded_options, run_job
from ..manifest import FoldedCheckpoint, Manifest, fingerprint
from ..options import RUNTIME, InputFields, KeyFields, ReadFields, RunFields, check_texts, command_options
from ..plans import Plan as AveragePlan
from ..progress import Progress
from ..selection import averaged_tensors, carry_into
from ..storage import Location, as_path, discard_stagings_in, files_on_disk, output_path
from ..writers.base import check_directory_output


@dataclass(frozen=True, kw_only=True)
class AccumulateOptions(InputFields, KeyFields, ReadFields, RunFields):
    """Everything an :func:`accumulate` run needs; checked when made (see :func:`accumulate`).

    ``out`` None: ``<folder>/ema``, chosen when the run starts (:attr:`out_path`).
    """

    out: Location | None = field(default=None, metadata=RUNTIME)
    decay: float | None = None
    half_life: float | None = None
    per_checkpoint: bool = False
    warmup: bool = False
    sigma_rels: tuple[str, ...] = ()
    gammas: tuple[str, ...] = ()
    snapshot_every: int | None = None
    dtype: str = "float32"
    restart: bool = False
    allow_new_keys: bool = False
    average_buffers: bool = False
    skip_nonfinite: bool = False
    skip_damaged: bool = False
    dry_run: bool = field(default=False, metadata=RUNTIME)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_texts(self, "sigma_rels", "gammas")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise OptionError("snapshot_every", f"must be a positive number of steps, got {self.snapshot_every}",
                              value=self.snapshot_every)
        self.profiles()  # refuses a contradictory or invalid profile
        if self.dtype not in ACCUMULATE_DTYPES:
            raise OptionError("dtype", f"must be one of {', '.join(ACCUMULATE_DTYPES)}, got {self.dtype!r}",
                              value=self.dtype)
        if self.out is not None:
            check_directory_output(self.out)

    @property
    def out_path(self) -> Location:
        assert self.out is not None
        return self.out

    @property
    def power(self) -> bool:
        return bool(self.sigma_rels or self.gammas)

    def profiles(self) -> list[tuple[str, Profile]]:
        return named_profiles(self.decay, self.half_life, self.per_checkpoint, self.warmup, self.sigma_rels,
                              self.gammas, self.snapshot_every)

    @property
    def selection(self) -> dict[str, object]:
        return {"include": list(self.include), "exclude": list(self.exclude), **read_options_from(self).recorded(),
                **({"average_buffers": True} if self.average_buffers else {})}


def accumulate(
    checkpoints: str | Location | Sequence[str | Location],
    *,
    out: str | Location | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    decay: float | None = None,
    half_life: float | None = None,
    per_checkpoint: bool = False,
    warmup: bool = False,
    sigma_rels: Sequence[str] = (),
    gammas: Sequence[str] = (),
    snapshot_every: int | None = None,
    dtype: str = "float32",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    step_regex: str | None = None,
    step_from: str | None = None,
    component: str | None = None,
    keep_prefix: bool = False,
    restart: bool = False,
    wait_seconds: float = 0.0,
    dry_run: bool = False,
    allow_new_keys: bool = False,
    average_buffers: bool = False,
    skip_nonfinite: bool = False,
    skip_damaged: bool = False,
    skip: Sequence[str | Location] = (),
    state_key: str | None = None,
    inert_globals: Sequence[str] = (),
    workers: int = 1,
    device: str = "cpu",
) -> AccumulateResult:
    """Fold every checkpoint newer than the EMAs at ``out`` (one, or one per power profile) into them.

    Args:
        checkpoints: a folder of checkpoints, or several checkpoint paths.
        out: the EMA directory (default ``<folder>/ema``).
        on_progress: called after each region.
        decay: β per optimizer step (``per_checkpoint`` makes it per checkpoint).
        half_life: alternatively, the half-life in steps (β = 2^(−1/h)).
        warmup: decay at step n is min(β, (1 + n)/(10 + n)).
        sigma_rels, gammas: power-function EMAs instead (values, lists or ranges as typed).
        snapshot_every: with power EMAs, keep a snapshot of each every K steps.
        dtype: accumulation and storage dtype of floating tensors (float32 or float64).
        include, exclude: glob patterns on keys.
        step_regex: a regex with one group for the step, searched in each checkpoint's path from
            the folder given (``checkpoint-(\\d+)/unet``).
        step_from: the record the steps come from (``global_step``, a safetensors metadata key,
            a dotted path into a file: ``state.timestamp.batch``; ``epoch`` to count epochs).
        component: the model read inside checkpoints that hold several (``unet``,
            ``model_1``); by default each trained one, its EMA in ``OUT/<component>``.
        keep_prefix: keep every key's prefix, even a wrapper's (DDP's ``module.``) that the
            trainer's own loader drops; recorded, so an EMA never changes names.
        restart: discard an existing EMA made with other settings and start over.
        wait_seconds: how long to wait for another run holding the output's lock.
        dry_run: plan only; read no tensor and write nothing (``result.plan``).
        allow_new_keys: accept keys added or removed during training (an added key's average
            starts where it first appears; a removed key leaves the EMA).
        average_buffers: average MoE routers' statistics too (``e_score_correction_bias``,
            ``expert_bias``, ``tokens_per_expert``: :data:`~ema_ckpt.selection.NON_WEIGHT_BUFFERS`);
            by default the EMA takes them from the newest checkpoint, as it takes integer tensors.
        skip_nonfinite: skip a checkpoint holding NaN/Inf (recorded in the manifest) instead
            of refusing the run.
        skip_damaged: skip a damaged checkpoint (truncated or corrupt files, refused pickles),
            recorded in the manifest, instead of refusing the run.
        skip: checkpoints to leave out (each noted), e.g. an export under other key names.
        state_key: the state dict to read inside single-file checkpoints (``state_dict_ema``),
            instead of the one found (see :mod:`ema_ckpt.formats.torch_file.model`).
        inert_globals: pickled classes (``module.Name``, ``module.*``) to read as inert data
            when single files hold objects of the training script's own.
        workers: split the work over N local processes (torch.distributed; under torchrun the
            group comes from the environment instead).
        device: ``cpu`` or ``cuda``: where the arithmetic runs.

    Returns:
        An :class:`AccumulateResult`; ``up_to_date`` is True when nothing was new (and
        nothing was written).

    Example:
        >>> accumulate("ckpts/", decay=0.999, dry_run=True).terms[-1]   # doctest: +SKIP
        FoldTerm(path='ckpts/step_3000', step=3000, coefficient=0.632...)
    """
    given = dict(locals())
    del given["on_progress"]
    args = command_options(given)
    checkpoint_paths(args["checkpoints"])  # each given path exists
    if args["out"] is None:
        args["out"] = output_path(default_out(args["checkpoints"]))
    options = AccumulateOptions(**args)
    names = components_to_fold(options, options.out_path)
    if names == [""]:
        return run_job(AccumulateJob(options), on_progress=on_progress)
    runs = {name: run_job(AccumulateJob(replace(options, component=name, out=options.out_path / name)),
                          on_progress=on_progress) for name in names}
    return AccumulateResult.merged(options.out_path, runs)


@dataclass(slots=True)
class FoldPlan:
    """What one run folds: each EMA with its new checkpoints, and what was skipped so far."""

    accumulators: list[Accumulator]
    plan: AveragePlan
    notes: list[str] = field(default_factory=list)
    skipped: list[tuple[FoundCheckpoint, str]] = field(default_factory=list)
    """(checkpoint, reason) left out during this run, recorded in the manifests."""
    left: list[LeftPart] = field(default_factory=list)
    """Model-bearing parts of the checkpoints not read, with the reason: recorded in the manifests."""

    def targets(self, out: Location) -> list[tuple[Accumulator, Location, int]]:
        """(accumulator, final path, step) of every output, snapshots first: a crash before the
        EMAs are swapped in makes the next run redo the fold and rewrite the same snapshots."""
        active = [acc for acc in self.accumulators if acc.new]
        snapshots = [(acc, out / "snapshots" / f"{acc.name}-step_{snap}", snap)
                     for acc in active for snap in acc.snapshot_steps]
        return snapshots + [(acc, acc.final, acc.new[-1].step) for acc in active]


@dataclass(slots=True)
class _Folded:
    written: WrittenOutputs
    keys: int
    source_format: str


@dataclass
class AccumulateJob(Job[FoldPlan, _Folded, AccumulateResult]):
    """:func:`accumulate` as a job of the runner (:mod:`ema_ckpt.jobs`)."""

    options: AccumulateOptions

    def lock_path(self) -> Location | None:
        return None if self.options.dry_run else self.options.out_path

    def recover_paths(self) -> list[Location]:
        opts = self.options
        if opts.dry_run:
            return []
        # staging directories of sweeps live beside OUT
        return [opts.out_path] + [opts.out_path / name for name, _ in opts.profiles() if opts.power]

    def plan(self, notes: list[str]) -> FoldPlan:
        opts = self.options
        out_path = opts.out_path
        accumulators = []
        for name, profile in opts.profiles():
            final = out_path / name if opts.power else out_path
            previous = Manifest.read(final, check=not opts.restart) if final.is_dir() else None
            if not opts.power and final.exists() and previous is None and any(final.iterdir()):
                raise UsageError(f"{final} exists and is not an ema-ckpt output; choose another {{out}}",
                                 mentions=("out",))
            if previous is not None and not opts.restart:
                check_same_settings(previous, profile, opts.dtype, opts.selection, final)
            accumulators.append(Accumulator(name, final, profile, None if opts.restart else previous))
        if opts.power and not opts.dry_run:
            discard_stagings_in(out_path / "snapshots")
        left = find_new(accumulators, opts, out=out_path, snapshot_every=opts.snapshot_every, notes=notes)
        if not opts.dry_run:
            refuse_damaged_emas(accumulators)
        plan = FoldPlan(accumulators, fold_plan(accumulators), notes, left=left)
        if opts.dry_run and any(acc.new for acc in accumulators):
            active, sources, checkpoints = fold_inputs(accumulators)
            with contextlib.ExitStack() as readers_stack:
                readers = [readers_stack.enter_context(contextlib.closing(open_checkpoint(p, read=opts.read)))
                           for p in sources]
                check_fold_keys(readers, sources, checkpoints, active, opts.include, opts.exclude,
                                opts.allow_new_keys)
        if not any(acc.new for acc in accumulators) and not any(acc.previous for acc in accumulators):
            raise CheckpointNotFoundError(out_path, "nothing to fold")
        return plan

    def targets(self, plan: FoldPlan) -> list[Target]:
        if self.options.dry_run:
            return []
        out = self.options.out_path
        return [Target(final, near=out if final != out else None, replace=True)
                for _, final, _ in plan.targets(out)]

    def compute(self, plan: FoldPlan, context: JobContext) -> _Folded:
        opts = self.options
        active, sources, checkpoints = fold_inputs(plan.accumulators)
        index = {str(p): i for i, p in enumerate(sources)}
        outputs = []
        for acc, final, step in plan.targets(opts.out_path):
            name = acc.name if final == acc.final else final.name
            rows = fold_weights(acc, upto=None if final == acc.final else step)
            outputs.append(OutputSpec(name, tuple(Update(index[p], w) for p, _, w in rows), mode="fold"))
        readers = context.open_sources(sources)
        for acc in remote_emas_folded_into(plan.accumulators):  # CRC-32s checked from what the fold reads
            cast(DcpReader, readers[index[str(acc.final)]]).keep_checksums = True
        keys = context.check(lambda: check_fold_keys(readers, sources, checkpoints, active, opts.include,
                                                     opts.exclude, opts.allow_new_keys))
        newest = readers[-1]
        tensors = averaged_tensors(newest, keys, opts.dtype, average_buffers=opts.average_buffers)
        file_name = None if opts.power else component_file(opts.component, opts.out_path, newest)
        writers = [context.writer(i, "safetensors", file_name=file_name) if file_name is not None else
                   context.writer(i, "dcp", planner_data=newest.planner_data) for i in range(len(outputs))]
        carry_into(writers, newest, opts.include, opts.exclude)
        written = context.write(readers, outputs, writers, tensors, layout=newest, copy_source=len(readers) - 1,
                                accumulate_dtype=torch_dtype(opts.dtype),
                                check_finite=[index[str(c.path)] for c in checkpoints])
        refuse_damaged_remote_emas(plan.accumulators, readers, index, context.workers)
        return _Folded(written, len(keys), newest.format_name)

    def manifests(self, plan: FoldPlan, computed: _Folded) -> list[Manifest | None]:
        opts = self.options
        manifests: list[Manifest | None] = []
        for (acc, final, step), files in zip(plan.targets(opts.out_path), computed.written.files, strict=True):
            folded = [c for c in acc.new if c.step <= step]
            manifests.append(Manifest(
                kind="ema" if final == acc.final else "snapshot",
                profile=acc.profile.to_dict(),
                dtype=opts.dtype,
                step=step,
                source_format=computed.source_format,
                checkpoints=(acc.previous.checkpoints if acc.previous else [])
                + [FoldedCheckpoint(str(c.path.resolve()), c.step, fingerprint(c.path)) for c in folded],
                selection=opts.selection,
                files={f.name: {"size": f.size, "crc32": f.crc32} for f in files},
                skipped=(acc.previous.skipped if acc.previous else []) + skip_records(plan.skipped),
                warnings=[w for o in plan.plan.outputs if o.name == acc.name for w in o.warnings],
                left=[part.to_json() for part in plan.left],
                options=recorded_options(opts),
            ))
        return manifests

    def finish_without_output(self, plan: FoldPlan) -> None:
        if not self.options.dry_run:
            record_skips(plan.accumulators, plan.skipped)

    def retry(self, plan: FoldPlan, error: EmaCkptError) -> FoldPlan | None:
        """Skip the checkpoint behind a NaN/Inf or damaged-file error (``skip_nonfinite``,
        ``skip_damaged``; else the error names the option) and fold the rest; never the EMA's own."""
        opts = self.options
        damaged_ema = as_damaged_ema(plan.accumulators, error)
        if damaged_ema is not None:
            raise damaged_ema from None
        _, sources, checkpoints = fold_inputs(plan.accumulators)
        by_path = {c.path: c for c in checkpoints}
        if isinstance(error, NonFiniteError):
            bad = by_path.get(sources[error.source]) if 0 <= error.source < len(sources) else None
            if not opts.skip_nonfinite or bad is None:
                raise NonFiniteError(error.source, error.note() + " (pass {skip_nonfinite=True} to skip that "
                                     "checkpoint)", remedy="skip_nonfinite") from None
            reason = "NaN/Inf"
        elif isinstance(error, CheckpointFormatError):
            bad = checkpoint_holding(checkpoints, as_path(error.path))
            if bad is None or "inert_globals" in error.parameters:  # its own remedy reads it whole: no skip
                return None
            if not opts.skip_damaged:
                raise type(error)(error.path, Note.of(error.reason) + " (pass {skip_damaged=True} to skip that "
                                  "checkpoint)", remedy="skip_damaged", mentions=error.parameters) from None
            reason = "damaged: " + error.reason
        else:
            return None
        skipped = [*plan.skipped, (bad, reason)]
        accumulators = [replace(acc, new=[c for c in acc.new if c.path != bad.path],
                                snapshot_steps=[s for s in acc.snapshot_steps if s != bad.step])
                        for acc in plan.accumulators]
        if not any(acc.new for acc in accumulators) and not any(acc.previous for acc in accumulators):
            raise CheckpointFormatError(opts.out_path, "every checkpoint was skipped: no EMA was written ("
                                        + "; ".join(f"{c.path}: {r}" for c, r in skipped) + ")")
        notes = [*plan.notes, f"skipped {bad.path} (step {bad.step}): " + reason]
        return FoldPlan(accumulators, fold_plan(accumulators), notes, skipped, plan.left)

    def result(self, plan: FoldPlan, computed: _Folded | None, seconds: float) -> AccumulateResult:
        accumulators, out = plan.accumulators, self.options.out_path
        up_to_date = not any(acc.new for acc in accumulators)
        step = (min(acc.previous.step for acc in accumulators if acc.previous is not None) if up_to_date
                else max(c.step for a in accumulators for c in a.new))
        result = AccumulateResult(
            out, step, [], up_to_date, plan.notes, terms=fold_terms(accumulators[0]),
            terms_by_output={str(a.final): fold_terms(a) for a in accumulators},
            profile="; ".join(a.profile.describe() for a in accumulators),
            outputs=[a.final for a in accumulators], plan=plan.plan, seconds=seconds)
        if computed is None:
            return result
        targets = plan.targets(out)
        written = [f for _, final, _ in targets for f in files_on_disk(final)]
        folded = sorted({c.path: c for acc in accumulators for c in acc.new}.values(), key=lambda c: c.step)
        return replace(
            result, step=max(step for *_, step in targets),
            folded=[FoldedCheckpoint(str(c.path.resolve()), c.step, fingerprint(c.path)) for c in folded],
            keys=computed.keys, bytes_read=computed.written.bytes_read,
            bytes_written=sum(size for _, size in written), files_written=len(written),
            snapshots=[final for acc, final, _ in targets if final != acc.final])


__all__ = ["AccumulateJob", "AccumulateOptions", "AccumulateResult", "FoldTerm", "accumulate"]
