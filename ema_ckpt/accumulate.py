"""``accumulate``: fold new checkpoints into running EMAs kept on disk.

Made for cron: each run folds only the checkpoints newer than the step an EMA stands at,
with the right decay across each gap, so the EMA goes on after the training job's retention
deleted old checkpoints. Each new EMA is built beside the old one and swapped in whole; a
killed run leaves the old EMA as it was, and the next run does the work again.

Two families of profiles:

* a classic EMA (``decay``/``half_life``), kept in ``out``;
* power-function EMAs (EDM2; ``sigma_rels``/``gammas``), one per value in
  ``out/sigma_rel_<value>``, updated with r = (t_prev/t_new)^(γ+1), plus, with
  ``snapshot_every=K``, a snapshot of each every K steps in ``out/snapshots/`` from which
  ``posthoc`` reconstructs any other σ_rel after the raw checkpoints are gone.

Every accumulator and snapshot is computed in the same pass: each input region is read once.

Example:
    >>> result = accumulate("ckpts/", decay=0.999)        # doctest: +SKIP
    >>> result.step, [c.step for c in result.folded]      # doctest: +SKIP
    (3000, [2000, 3000])
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import planner
from .averaging import ACCUMULATE_DTYPES, PlannedOutput, SnapshotInput, Term, find_snapshots
from .averaging import Plan as AveragePlan
from .discovery import FoundCheckpoint, checkpoint_paths, discover
from .dist import Workers, current_workers, in_worker_group, run_workers
from .dtypes import torch_dtype
from .engine import OutputSpec, Progress, Update, check_device, layout_regions
from .execute import open_checkpoints, write_dcp_outputs
from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    ManifestMismatchError,
    NonFiniteError,
    UsageError,
)
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .fs import OutputLock, discard_on_error, new_staging_dir, output_path, publish, recover
from .manifest import MANIFEST_NAME, FoldedCheckpoint, Manifest, fingerprint
from .schedules import ExponentialProfile, PowerProfile, fold_coefficients, profile_from_dict
from .selection import check_compatible, select_keys
from .verify import damage

DEFAULT_OUT_NAME = "ema"
Profile = ExponentialProfile | PowerProfile


@dataclass(frozen=True, slots=True)
class FoldTerm:
    """One input's share of an EMA after this run (Σ coefficients = 1)."""

    path: str
    step: int
    coefficient: float


@dataclass(slots=True)
class AccumulateResult:
    """What an ``accumulate`` run did (or, with ``dry_run``, would do: see ``plan``)."""

    out: Path
    step: int
    folded: list[FoldedCheckpoint]
    up_to_date: bool
    notes: list[str] = field(default_factory=list)
    terms: list[FoldTerm] = field(default_factory=list)
    """The first EMA's terms (see ``terms_by_output`` for every EMA of a power-EMA run)."""
    terms_by_output: dict[str, list[FoldTerm]] = field(default_factory=dict)
    """Each EMA's terms, by its output directory."""
    keys: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    profile: str = ""
    outputs: list[Path] = field(default_factory=list)
    snapshots: list[Path] = field(default_factory=list)
    plan: AveragePlan | None = None


@dataclass(slots=True)
class _Accumulator:
    name: str
    final: Path
    profile: Profile
    previous: Manifest | None
    new: list[FoundCheckpoint] = field(default_factory=list)
    snapshot_steps: list[int] = field(default_factory=list)


def default_out(checkpoints: Sequence[Path]) -> Path:
    """``<folder>/ema`` for a single folder of checkpoints."""
    if len(checkpoints) == 1 and checkpoints[0].is_dir():
        return checkpoints[0] / DEFAULT_OUT_NAME
    raise UsageError("--out is required when more than one path is given")


def make_profile(
    *, decay: float | None, half_life: float | None, per_checkpoint: bool, warmup: bool
) -> ExponentialProfile:
    """The classic profile named by exactly one of ``decay`` / ``half_life``."""
    if (decay is None) == (half_life is None):
        raise UsageError("give exactly one of --decay or --half-life (or --sigma-rel/--gamma)")
    if half_life is not None:
        if per_checkpoint:
            raise UsageError("--half-life counts steps; use --decay with --per-checkpoint")
        return ExponentialProfile.from_half_life(half_life, warmup=warmup)
    assert decay is not None
    return ExponentialProfile(decay=decay, per_checkpoint=per_checkpoint, warmup=warmup)


def _profiles(
    decay: float | None, half_life: float | None, per_checkpoint: bool, warmup: bool,
    sigma_rels: Sequence[str], gammas: Sequence[str], snapshot_every: int | None,
) -> list[tuple[str, Profile]]:
    if sigma_rels or gammas:
        if decay is not None or half_life is not None or per_checkpoint or warmup:
            raise UsageError("--sigma-rel/--gamma (power EMAs) cannot be combined with --decay/--half-life")
        named: list[tuple[str, Profile]] = []
        for text in sigma_rels:
            for typed, value in planner.parse_sigma_list(text):
                named.append((f"sigma_rel_{typed}", PowerProfile(planner.sigma_rel_to_gamma(value), typed)))
        for text in gammas:
            for item in (i.strip() for i in text.split(",")):
                named.append((f"gamma_{item}", PowerProfile(planner.check_gamma(item), item)))
        if len({n for n, _ in named}) != len(named):
            raise UsageError("the same profile is requested twice")
        return named
    if snapshot_every is not None:
        raise UsageError("--snapshot-every keeps power EMAs: use it with --sigma-rel or --gamma")
    return [(DEFAULT_OUT_NAME, make_profile(decay=decay, half_life=half_life,
                                            per_checkpoint=per_checkpoint, warmup=warmup))]


def accumulate(
    checkpoints: str | Path | Sequence[str | Path],
    *,
    decay: float | None = None,
    half_life: float | None = None,
    per_checkpoint: bool = False,
    warmup: bool = False,
    sigma_rels: Sequence[str] = (),
    gammas: Sequence[str] = (),
    snapshot_every: int | None = None,
    out: str | Path | None = None,
    dtype: str = "float32",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    step_regex: str | None = None,
    restart: bool = False,
    wait_seconds: float = 0.0,
    dry_run: bool = False,
    allow_new_keys: bool = False,
    skip_nonfinite: bool = False,
    skip_damaged: bool = False,
    skip: Sequence[str | Path] = (),
    workers: int = 1,
    device: str = "cpu",
    on_progress: Callable[[Progress], None] | None = None,
) -> AccumulateResult:
    """Fold every checkpoint newer than the EMA(s) at ``out`` into them.

    Args:
        checkpoints: a folder of checkpoints, or several checkpoint paths.
        decay: β per optimizer step (``per_checkpoint`` makes it per checkpoint).
        half_life: alternatively, the half-life in steps (β = 2^(−1/h)).
        warmup: decay at step n is min(β, (1 + n)/(10 + n)).
        sigma_rels, gammas: power-function EMAs instead (values, lists or ranges as typed).
        snapshot_every: with power EMAs, keep a snapshot of each every K steps.
        out: the EMA directory (default ``<folder>/ema``).
        dtype: accumulation and storage dtype of floating tensors (float32 or float64).
        include, exclude: glob patterns on keys.
        step_regex: a regex with one group for the step in directory names.
        restart: discard an existing EMA made with other settings and start over.
        wait_seconds: how long to wait for another run holding the output's lock.
        dry_run: plan only; read no tensor and write nothing (``result.plan``).
        allow_new_keys: accept keys added or removed during training (an added key's average
            starts where it first appears; a removed key leaves the EMA).
        skip_nonfinite: skip a checkpoint holding NaN/Inf (recorded in the manifest) instead
            of refusing the run.
        skip_damaged: skip a damaged checkpoint (truncated or corrupt files, refused pickles),
            recorded in the manifest, instead of refusing the run.
        skip: checkpoints to leave out (each noted), e.g. an export under other key names.
        workers: split the work over N local processes (torch.distributed; under torchrun the
            group comes from the environment instead).
        device: ``cpu`` or ``cuda``: where the arithmetic runs.
        on_progress: called after each region.

    Returns:
        An :class:`AccumulateResult`; ``up_to_date`` is True when nothing was new (and
        nothing was written).
    """
    if workers > 1 and not in_worker_group():
        return run_workers(
            workers, accumulate, checkpoints, decay=decay, half_life=half_life, per_checkpoint=per_checkpoint,
            warmup=warmup, sigma_rels=sigma_rels, gammas=gammas, snapshot_every=snapshot_every, out=out,
            dtype=dtype, include=include, exclude=exclude, step_regex=step_regex, restart=restart,
            wait_seconds=wait_seconds, dry_run=dry_run, allow_new_keys=allow_new_keys,
            skip_nonfinite=skip_nonfinite, skip_damaged=skip_damaged, skip=skip, device=device, local_kwargs={"on_progress": on_progress},
        )
    check_device(device)
    started = time.perf_counter()
    group = current_workers(device)
    with contextlib.ExitStack() as stack:

        def prepare() -> tuple:
            return _prepare(
                stack, checkpoints, decay, half_life, per_checkpoint, warmup, sigma_rels, gammas,
                snapshot_every, out, dtype, include, exclude, step_regex, restart, wait_seconds, dry_run, started,
                allow_new_keys=allow_new_keys, skip=skip,
            )

        prepared = group.broadcast(group.run(prepare if group.is_coordinator else lambda: None))
        if prepared[0] == "done":
            return prepared[1]
        _, out_path, accumulators, selection, notes, plan = prepared
        skipped: list[tuple[FoundCheckpoint, str]] = []  # (checkpoint, reason) recorded in the manifest
        while True:
            try:
                return _fold(group, out_path, accumulators, dtype, selection, include, exclude, notes, started,
                             on_progress, plan, device, allow_new_keys, skipped)
            except NonFiniteError as err:
                bad = _source_checkpoint(accumulators, err.source)
                if not skip_nonfinite or bad is None:
                    raise NonFiniteError(err.source, f"{err} (pass --skip-nonfinite to skip that checkpoint)") \
                        from None
                reason = "NaN/Inf"
            except CheckpointFormatError as err:
                bad = _checkpoint_holding(accumulators, Path(err.path))
                if bad is None:
                    raise
                if not skip_damaged:
                    raise type(err)(err.path, f"{err.reason} (pass --skip-damaged to skip that checkpoint)") \
                        from None
                reason = f"damaged: {err.reason}"
            notes.append(f"skipped {bad.path} (step {bad.step}): {reason}")
            skipped.append((bad, reason))
            for acc in accumulators:
                acc.new = [c for c in acc.new if c.path != bad.path]
                acc.snapshot_steps = [s for s in acc.snapshot_steps if s != bad.step]
            if not any(acc.new for acc in accumulators):
                if not any(acc.previous for acc in accumulators):  # nothing folded, no EMA to keep
                    raise CheckpointFormatError(out_path, "every checkpoint was skipped: no EMA was written ("
                                                + "; ".join(f"{c.path}: {r}" for c, r in skipped) + ")")
                group.run(lambda: _record_skips(accumulators, skipped) if group.is_coordinator else None)
                return AccumulateResult(out_path, max(a.previous.step for a in accumulators if a.previous)
                                        if any(a.previous for a in accumulators) else bad.step,
                                        [], True, notes, seconds=time.perf_counter() - started)


def _prepare(
    stack: contextlib.ExitStack, checkpoints, decay, half_life, per_checkpoint, warmup, sigma_rels, gammas,
    snapshot_every, out, dtype, include, exclude, step_regex, restart, wait_seconds, dry_run, started,
    *, allow_new_keys: bool = False, skip: Sequence[str | Path] = (),
) -> tuple:
    """Coordinator only: lock, repair, read manifests, discover, plan."""
    paths = checkpoint_paths(checkpoints)
    if snapshot_every is not None and snapshot_every < 1:
        raise UsageError(f"--snapshot-every must be a positive number of steps, got {snapshot_every}")
    named = _profiles(decay, half_life, per_checkpoint, warmup, sigma_rels, gammas, snapshot_every)
    if dtype not in ACCUMULATE_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(ACCUMULATE_DTYPES)}, got {dtype!r}")
    out_path = output_path(out if out is not None else default_out(paths))
    power = isinstance(named[0][1], PowerProfile)
    selection = {"include": list(include), "exclude": list(exclude)}
    if not dry_run:
        stack.enter_context(OutputLock(out_path, wait_seconds=wait_seconds))
    notes: list[str] = []
    accumulators = []
    if power and not dry_run:
        notes += recover(out_path)  # staging directories of sweeps live beside OUT
    for name, profile in named:
        final = out_path / name if power else out_path
        if not dry_run:
            notes += recover(final)
        previous = Manifest.read(final) if final.is_dir() else None
        if not power and final.exists() and previous is None and any(final.iterdir()):
            raise UsageError(f"{final} exists and is not an ema-ckpt output; choose another --out")
        if previous is not None and not restart:
            _check_same_settings(previous, profile, dtype, selection, final)
        accumulators.append(_Accumulator(name, final, profile, None if restart else previous))
    if power and not dry_run and (out_path / "snapshots").is_dir():
        for leftover in (out_path / "snapshots").iterdir():
            if leftover.name.startswith(".") and ".tmp-" in leftover.name:
                shutil.rmtree(leftover, ignore_errors=True)
    folded = {Path(c.path).resolve(): c.step for acc in accumulators if acc.previous is not None
              for c in acc.previous.checkpoints}
    starts = [acc.previous.step if acc.previous is not None else None for acc in accumulators]
    found = discover(paths, step_regex=step_regex, exclude=[out_path], skip=skip, known=folded,
                     compare_after=None if None in starts else min(s for s in starts if s is not None))
    notes.extend(found.notes)
    for c in found.checkpoints:
        done = folded.get(c.path.resolve())
        if done is not None and done != c.step:
            notes.append(f"skipped {c.path}: folded before at step {done}, it now reads step {c.step}")
    snapshots_on_disk = find_snapshots([out_path]) if snapshot_every else []
    for acc in accumulators:
        start = acc.previous.step if acc.previous is not None else None
        recorded = {s.get("path"): s for s in (acc.previous.skipped if acc.previous else [])}
        acc.new = []
        for c in found.checkpoints:
            if (start is not None and c.step <= start) or c.path.resolve() in folded:
                continue
            skip_record = recorded.get(str(c.path.resolve()))
            if skip_record is not None and skip_record.get("fingerprint") in (None, fingerprint(c.path)):
                if acc is accumulators[0]:
                    notes.append(f"skipped {c.path} (step {c.step}): recorded as skipped "
                                 f"({skip_record.get('reason')}) in {acc.final / MANIFEST_NAME}")
                continue
            acc.new.append(c)
        if start is not None:
            _refuse_backwards(acc, found.checkpoints, start)
        if snapshot_every:
            assert isinstance(acc.profile, PowerProfile)
            taken = [s.step for s in snapshots_on_disk if abs(s.gamma - acc.profile.gamma) < 1e-12]
            acc.snapshot_steps = _snapshot_steps([c.step for c in acc.new], max(taken, default=None),
                                                 snapshot_every)
    if not dry_run:
        _refuse_damaged_emas(accumulators)
    plan = _plan(accumulators)
    if dry_run and any(acc.new for acc in accumulators):
        active, sources, checkpoints = _sources(accumulators)
        with contextlib.ExitStack() as readers_stack:
            readers = [readers_stack.enter_context(contextlib.closing(open_checkpoint(p))) for p in sources]
            _check_keys(readers, sources, checkpoints, active, include, exclude, allow_new_keys)
    if dry_run or not any(acc.new for acc in accumulators):
        steps = [acc.previous.step for acc in accumulators if acc.previous is not None]
        up_to_date = not any(acc.new for acc in accumulators)
        if up_to_date and not steps:
            raise CheckpointNotFoundError(out_path, "nothing to fold")
        return ("done", AccumulateResult(
            out_path, min(steps) if up_to_date else max(c.step for a in accumulators for c in a.new),
            [], up_to_date, notes, terms=_fold_terms(accumulators[0]),
            terms_by_output={str(a.final): _fold_terms(a) for a in accumulators},
            profile="; ".join(a.profile.describe() for a in accumulators),
            seconds=time.perf_counter() - started, plan=plan,
            outputs=[a.final for a in accumulators],
        ))
    return ("fold", out_path, accumulators, selection, notes, plan)


def _refuse_backwards(acc: _Accumulator, checkpoints: list[FoundCheckpoint], start: int) -> None:
    """Refuse a checkpoint that appeared at or before the EMA's step: steps went backwards."""
    known = {c.path for c in acc.previous.checkpoints} if acc.previous else set()
    known |= {s["path"] for s in (acc.previous.skipped if acc.previous else [])}
    late = [c for c in checkpoints if c.step <= start and str(c.path.resolve()) not in known]
    if late:
        raise IncompatibleCheckpointError(
            f"{late[0].path}: step {late[0].step} is at or before step {start}, where the EMA {acc.final} "
            "stands, but was never folded: steps went backwards (a job restarted into the same folder?); "
            "move it away, or pass --restart to rebuild the EMA"
        )


def _refuse_damaged_emas(accumulators: list[_Accumulator]) -> None:
    """Every EMA about to be folded into matches its manifest (sizes, CRC-32s), or the run stops.

    A flipped bit in the previous EMA would otherwise be folded in and then covered by fresh
    checksums. Checked before anything is written; the damaged EMA is left as it is.
    """
    for acc in accumulators:
        if acc.previous is None or not acc.new:
            continue
        problems = damage(acc.final)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointFormatError(
                acc.final,
                f"the EMA does not match its manifest: {problems[0]}{more}; it is left as it is. "
                "Restore it from a backup, or rebuild it with --restart (every checkpoint still on "
                "disk is folded again)",
            )


def _skip_records(skipped: Sequence[tuple[FoundCheckpoint, str]]) -> list[dict[str, Any]]:
    return [{"path": str(c.path.resolve()), "step": c.step, "reason": reason, "fingerprint": fingerprint(c.path)}
            for c, reason in skipped]


def _record_skips(accumulators: list[_Accumulator], skipped: Sequence[tuple[FoundCheckpoint, str]]) -> None:
    """Remember skips in each existing EMA's manifest when nothing else is written this run.

    Only the manifest file changes, replaced atomically; the EMA's data stay as they are.
    """
    for acc in accumulators:
        if acc.previous is None or not skipped:
            continue
        acc.previous.skipped = acc.previous.skipped + _skip_records(skipped)
        acc.previous.replace(acc.final)


def _checkpoint_holding(accumulators: list[_Accumulator], path: Path) -> FoundCheckpoint | None:
    """The new checkpoint a damaged file belongs to, or None (then it is not a checkpoint's fault)."""
    target = path.resolve()
    for acc in accumulators:
        for c in acc.new:
            root = c.path.resolve()
            if target == root or root in target.parents:
                return c
    return None


def _source_checkpoint(accumulators: list[_Accumulator], source: int) -> FoundCheckpoint | None:
    """The raw checkpoint behind source index ``source`` of a fold (same order as ``_fold``)."""
    _, sources, checkpoints = _sources(accumulators)
    index = source - (len(sources) - len(checkpoints))
    return checkpoints[index] if 0 <= index < len(checkpoints) else None


def _snapshot_steps(new_steps: list[int], last: int | None, every: int) -> list[int]:
    """Checkpoint steps at which a snapshot is taken: the first at or after each multiple of K."""
    chosen = []
    for step in new_steps:
        if step // every > (last // every if last is not None else 0):
            chosen.append(step)
            last = step
    return chosen


def _check_same_settings(previous: Manifest, profile: Profile, dtype: str, selection: dict, out: Path) -> None:
    wanted = profile.to_dict()
    if previous.kind != "ema" or previous.profile != wanted:
        try:
            before = profile_from_dict(previous.profile).describe()
        except (ValueError, KeyError, UsageError):
            before = str(previous.profile)
        raise ManifestMismatchError(
            f"{out} holds an {before}, not an {profile.describe()}; "
            "pass --restart to start a new EMA there, or choose another --out"
        )
    if previous.dtype != dtype:
        raise ManifestMismatchError(
            f"{out} accumulates in {previous.dtype}, not {dtype}; pass --restart or keep --dtype {previous.dtype}"
        )
    if previous.selection != selection:
        raise ManifestMismatchError(
            f"{out} was made with key selection {previous.selection}, not {selection}; pass --restart"
        )


def _weights(acc: _Accumulator, upto: int | None = None) -> list[tuple[str, int, float]]:
    """(label, step, lerp weight) of an accumulator's fold: previous EMA first, then new checkpoints."""
    rows: list[tuple[str, int, float]] = []
    prev = acc.previous.step if acc.previous is not None else None
    if acc.previous is not None:
        rows.append((str(acc.final), acc.previous.step, 1.0))
    for ckpt in acc.new:
        if upto is not None and ckpt.step > upto:
            break
        rows.append((str(ckpt.path), ckpt.step, 1.0 if prev is None else acc.profile.update_weight(prev, ckpt.step)))
        prev = ckpt.step
    return rows


def _fold_terms(acc: _Accumulator) -> list[FoldTerm]:
    rows = _weights(acc)
    return [FoldTerm(p, s, c) for (p, s, _), c in zip(rows, fold_coefficients([w for *_, w in rows]), strict=True)]


def _plan(accumulators: list[_Accumulator]) -> AveragePlan:
    outputs = []
    inputs: dict[str, FoundCheckpoint] = {}
    for acc in accumulators:
        rows = _weights(acc)
        inputs.update({str(c.path): c for c in acc.new})
        if not rows:
            continue
        coeffs = fold_coefficients([w for *_, w in rows])
        terms = [Term(p, s, c) for (p, s, _), c in zip(rows, coeffs, strict=True)]
        profile = acc.profile
        steps = [t.step for t in terms]
        stats = planner.describe_plan(steps, coeffs, profile=profile if isinstance(profile, ExponentialProfile) else None)
        if isinstance(profile, PowerProfile):
            window = planner.power_window(profile.gamma, steps[-1])
            sigma, gamma = profile.sigma_rel, profile.gamma
        else:
            window = 1.0 / (1.0 - stats.step_decay) if stats.step_decay and stats.step_decay < 1 else float("inf")
            sigma, gamma = stats.sigma_rel, None
        warning = planner.spacing_warning(steps, window) if window != float("inf") else None
        outputs.append(PlannedOutput(
            acc.name, steps[-1], terms, sigma_rel=sigma, gamma=gamma, profile=profile.to_dict(),
            warnings=[warning] if warning else [],
            stats={"sigma_rel": stats.sigma_rel, "mean_age": stats.mean_age, "n_eff": stats.n_eff,
                   "max_abs": stats.max_abs, "half_life": stats.half_life},
        ))
    return AveragePlan("accumulate", sorted(inputs.values(), key=lambda c: c.step), outputs)


def _sources(accumulators: list[_Accumulator]) -> tuple[list[_Accumulator], list[Path], list[FoundCheckpoint]]:
    """(accumulators with new checkpoints, every path to read: their EMAs then the checkpoints, checkpoints)."""
    active = [acc for acc in accumulators if acc.new]
    sources: list[Path] = [acc.final for acc in active if acc.previous is not None]
    checkpoints = sorted({c.path: c for acc in active for c in acc.new}.values(), key=lambda c: c.step)
    return active, sources + [c.path for c in checkpoints], checkpoints


def _check_keys(
    readers: Sequence[CheckpointReader],
    sources: Sequence[Path],
    checkpoints: Sequence[FoundCheckpoint],
    active: Sequence[_Accumulator],
    include: Sequence[str],
    exclude: Sequence[str],
    allow_new_keys: bool,
) -> list[str]:
    """The keys to fold, once every source agrees on them (metadata only: no tensor is read)."""
    index = {str(p): i for i, p in enumerate(sources)}
    keys = select_keys(readers[-1], include, exclude)
    if not keys:
        raise UsageError(f"{readers[-1].path}: no tensor keys left after --include/--exclude")
    raw = [index[str(c.path)] for c in checkpoints]
    check_compatible(readers, keys, reference=len(readers) - 1, allow_new_keys=allow_new_keys,
                     same_selection=raw, include=include, exclude=exclude)
    for acc in active:
        if acc.previous is not None and not allow_new_keys:
            extra = sorted(set(readers[index[str(acc.final)]].specs()) - set(keys))
            if extra:
                raise IncompatibleCheckpointError(
                    f"{readers[-1].path}: key {extra[0]!r} of the EMA {acc.final} is gone "
                    "from the newest checkpoint"
                )
    return keys


def _fold(
    group: Workers,
    out_path: Path,
    accumulators: list[_Accumulator],
    dtype: str,
    selection: dict,
    include: Sequence[str],
    exclude: Sequence[str],
    notes: list[str],
    started: float,
    on_progress: Callable[[Progress], None] | None,
    plan: AveragePlan,
    device: str = "cpu",
    allow_new_keys: bool = False,
    skipped: Sequence[tuple[FoundCheckpoint, str]] = (),
) -> AccumulateResult:
    active, sources, checkpoints = _sources(accumulators)
    index = {str(p): i for i, p in enumerate(sources)}
    outputs: list[OutputSpec] = []
    targets: list[tuple[_Accumulator, Path, int]] = []  # (accumulator, final path, step)
    for acc in active:
        for snap in acc.snapshot_steps:
            name = f"{acc.name}-step_{snap}"
            outputs.append(_spec(name, _weights(acc, upto=snap), index))
            targets.append((acc, out_path / "snapshots" / name, snap))
    for acc in active:
        outputs.append(_spec(acc.name, _weights(acc), index))
        targets.append((acc, acc.final, acc.new[-1].step))

    with contextlib.ExitStack() as stack:

        readers = open_checkpoints(group, sources, stack)

        def check_all() -> tuple[list[CheckpointReader], list[str]]:
            return readers, _check_keys(readers, sources, checkpoints, active, include, exclude, allow_new_keys)

        readers, keys = group.run(check_all)
        newest = readers[-1]
        stagings = group.broadcast(
            group.run((lambda: [new_staging_dir(final, near=out_path if final != out_path else None)
                                for _, final, _ in targets]) if group.is_coordinator
                      else lambda: None)
        )
        with discard_on_error(stagings, owner=group.is_coordinator):
            planner_data = getattr(newest, "planner_data", None)
            written = write_dcp_outputs(
                group, readers, outputs, stagings, layout_regions(newest, keys), newest.specs(),
                copy_source=len(readers) - 1, accumulate_dtype=torch_dtype(dtype),
                planner_data=planner_data, on_progress=on_progress, device=device,
                check_finite=[index[str(c.path)] for c in checkpoints],
            )

            def publish_all() -> None:
                for (acc, final, step), files, staging in zip(targets, written.files, stagings, strict=True):
                    folded = [c for c in acc.new if c.step <= step]
                    Manifest(
                        kind="ema" if final == acc.final else "snapshot",
                        profile=acc.profile.to_dict(),
                        dtype=dtype,
                        step=step,
                        source_format=newest.format_name,
                        checkpoints=(acc.previous.checkpoints if acc.previous else [])
                        + [FoldedCheckpoint(str(c.path.resolve()), c.step, fingerprint(c.path)) for c in folded],
                        selection=selection,
                        files={f.name: {"size": f.size, "crc32": f.crc32} for f in files},
                        skipped=(acc.previous.skipped if acc.previous else []) + _skip_records(skipped),
                        warnings=[w for o in plan.outputs if o.name == acc.name for w in o.warnings],
                    ).write(staging)
                # snapshots first: a crash before the EMAs are swapped in makes the next run redo
                # the same fold and rewrite the same snapshots, byte for byte
                for (_acc, final, _step), staging in zip(targets, stagings, strict=True):
                    publish(staging, final)

            group.run(publish_all if group.is_coordinator else lambda: None)

    first = accumulators[0]
    folded_all = {c.path: c for acc in active for c in acc.new}
    return AccumulateResult(
        out_path, max(step for *_, step in targets),
        [FoldedCheckpoint(str(c.path.resolve()), c.step, fingerprint(c.path))
         for c in sorted(folded_all.values(), key=lambda c: c.step)],
        False, notes, terms=_fold_terms(first), keys=len(keys),
        terms_by_output={str(a.final): _fold_terms(a) for a in accumulators},
        bytes_read=written.bytes_read, bytes_written=written.bytes_written,
        seconds=time.perf_counter() - started,
        profile="; ".join(a.profile.describe() for a in accumulators),
        outputs=[a.final for a in accumulators],
        snapshots=[final for acc, final, _ in targets if final != acc.final],
        plan=plan,
    )


def _spec(name: str, rows: list[tuple[str, int, float]], index: dict[str, int]) -> OutputSpec:
    return OutputSpec(name, tuple(Update(index[p], w) for p, _, w in rows), mode="fold")


__all__ = ["AccumulateResult", "FoldTerm", "SnapshotInput", "accumulate", "default_out", "make_profile",
           "MANIFEST_NAME"]
