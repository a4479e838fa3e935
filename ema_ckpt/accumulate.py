"""``accumulate``: fold new checkpoints into a running EMA kept on disk.

Made for cron: each run folds only the checkpoints newer than the step the EMA stands at,
with the right decay across each gap, so the EMA goes on after the training job's retention
deleted old checkpoints. The new EMA is built beside the old one and swapped in whole; a
killed run leaves the old EMA as it was, and the next run does the work again.

Example:
    >>> result = accumulate("ckpts/", decay=0.999)        # doctest: +SKIP
    >>> result.step, [c.step for c in result.folded]      # doctest: +SKIP
    (3000, [2000, 3000])
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .discovery import discover
from .engine import OutputSpec, Progress, Update, combine_regions, layout_regions
from .errors import (
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    ManifestMismatchError,
    UsageError,
)
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .fs import OutputLock, new_staging_dir, publish, recover
from .manifest import MANIFEST_NAME, FoldedCheckpoint, Manifest, fingerprint
from .selection import check_compatible, select_keys
from .schedules import ExponentialProfile, fold_coefficients, profile_from_dict
from .writers.dcp import DcpWriter

DEFAULT_OUT_NAME = "ema"
ACCUMULATE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True, slots=True)
class FoldTerm:
    """One checkpoint's share of the EMA after this run (Σ coefficients = 1)."""

    path: str
    step: int
    coefficient: float


@dataclass(slots=True)
class AccumulateResult:
    """What an ``accumulate`` run did."""

    out: Path
    step: int
    folded: list[FoldedCheckpoint]
    up_to_date: bool
    notes: list[str] = field(default_factory=list)
    terms: list[FoldTerm] = field(default_factory=list)
    keys: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    profile: str = ""


def default_out(checkpoints: Sequence[Path]) -> Path:
    """``<folder>/ema`` for a single folder of checkpoints."""
    if len(checkpoints) == 1 and checkpoints[0].is_dir():
        return checkpoints[0] / DEFAULT_OUT_NAME
    raise UsageError("--out is required when more than one path is given")


def make_profile(
    *, decay: float | None, half_life: float | None, per_checkpoint: bool, warmup: bool
) -> ExponentialProfile:
    """The profile named by exactly one of ``decay`` / ``half_life``."""
    if (decay is None) == (half_life is None):
        raise UsageError("give exactly one of --decay or --half-life")
    if half_life is not None:
        if per_checkpoint:
            raise UsageError("--half-life counts steps; use --decay with --per-checkpoint")
        return ExponentialProfile.from_half_life(half_life, warmup=warmup)
    assert decay is not None
    return ExponentialProfile(decay=decay, per_checkpoint=per_checkpoint, warmup=warmup)


def accumulate(
    checkpoints: str | Path | Sequence[str | Path],
    *,
    decay: float | None = None,
    half_life: float | None = None,
    per_checkpoint: bool = False,
    warmup: bool = False,
    out: str | Path | None = None,
    dtype: str = "float32",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    step_regex: str | None = None,
    restart: bool = False,
    wait_seconds: float = 0.0,
    on_progress: Callable[[Progress], None] | None = None,
) -> AccumulateResult:
    """Fold every checkpoint newer than the EMA at ``out`` into it.

    Args:
        checkpoints: a folder of checkpoints, or several checkpoint paths.
        decay: β per optimizer step (``per_checkpoint`` makes it per checkpoint).
        half_life: alternatively, the half-life in steps (β = 2^(−1/h)).
        warmup: decay at step n is min(β, (1 + n)/(10 + n)).
        out: the EMA directory (default ``<folder>/ema``).
        dtype: accumulation and storage dtype of floating tensors (float32 or float64).
        include, exclude: glob patterns on keys.
        step_regex: a regex with one group for the step in directory names.
        restart: discard an existing EMA made with other settings and start over.
        wait_seconds: how long to wait for another run holding the output's lock.
        on_progress: called after each region.

    Returns:
        An :class:`AccumulateResult`; ``up_to_date`` is True when nothing was new (and
        nothing was written).
    """
    started = time.perf_counter()
    paths = [Path(checkpoints)] if isinstance(checkpoints, (str, Path)) else [Path(p) for p in checkpoints]
    if not paths:
        raise UsageError("no checkpoint paths given")
    for path in paths:
        if not path.exists():
            raise CheckpointNotFoundError(path, "no such file or directory")
    profile = make_profile(decay=decay, half_life=half_life, per_checkpoint=per_checkpoint, warmup=warmup)
    if dtype not in ACCUMULATE_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(ACCUMULATE_DTYPES)}, got {dtype!r}")
    out_path = Path(out) if out is not None else default_out(paths)
    selection = {"include": list(include), "exclude": list(exclude)}
    with OutputLock(out_path, wait_seconds=wait_seconds):
        notes = recover(out_path)
        previous = Manifest.read(out_path) if out_path.exists() else None
        if out_path.exists() and previous is None and any(out_path.iterdir()):
            raise UsageError(f"{out_path} exists and is not an ema-ckpt output; choose another --out")
        if previous is not None and not restart:
            _check_same_settings(previous, profile, dtype, selection, out_path)
        if restart:
            previous = None
        found = discover(paths, step_regex=step_regex, exclude=[out_path])
        notes.extend(found.notes)
        start_step = previous.step if previous is not None else None
        new = [c for c in found.checkpoints if start_step is None or c.step > start_step]
        if start_step is not None:
            older = [c for c in found.checkpoints if c.step <= start_step]
            folded_paths = {c.path for c in previous.checkpoints} if previous else set()
            late = [c for c in older if str(c.path.resolve()) not in folded_paths]
            if late:
                notes.append(
                    f"ignored {len(late)} checkpoint(s) at or before step {start_step}, "
                    f"where the EMA already stands (e.g. {late[0].path})"
                )
        if not new:
            assert previous is not None
            return AccumulateResult(
                out_path, previous.step, [], True, notes, profile=profile.describe(),
                seconds=time.perf_counter() - started,
            )
        return _fold(out_path, previous, new, profile, dtype, selection, include, exclude, notes,
                     started, on_progress)


def _check_same_settings(
    previous: Manifest, profile: ExponentialProfile, dtype: str, selection: dict, out: Path
) -> None:
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


def _fold(
    out_path: Path,
    previous: Manifest | None,
    new: list,
    profile: ExponentialProfile,
    dtype: str,
    selection: dict,
    include: Sequence[str],
    exclude: Sequence[str],
    notes: list[str],
    started: float,
    on_progress: Callable[[Progress], None] | None,
) -> AccumulateResult:
    readers: list[CheckpointReader] = []
    with contextlib.ExitStack() as stack:
        if previous is not None:
            readers.append(stack.enter_context(contextlib.closing(open_checkpoint(out_path))))
        for ckpt in new:
            readers.append(stack.enter_context(contextlib.closing(open_checkpoint(ckpt.path))))
        newest = readers[-1]
        keys = select_keys(newest, include, exclude)
        if not keys:
            raise UsageError(f"{newest.path}: no tensor keys left after --include/--exclude")
        check_compatible(readers, keys, reference=len(readers) - 1)
        if previous is not None:
            extra = sorted(set(readers[0].specs()) - set(keys))
            if extra:
                raise IncompatibleCheckpointError(
                    f"{newest.path}: key {extra[0]!r} of the EMA is gone from the newest checkpoint"
                )

        updates: list[Update] = []
        prev_step = previous.step if previous is not None else None
        for index, ckpt in enumerate(new):
            source = index + (1 if previous is not None else 0)
            if prev_step is None:
                weight = 1.0
            else:
                weight = profile.update_weight(prev_step, ckpt.step)
            updates.append(Update(source, weight))
            prev_step = ckpt.step
        if previous is not None:
            updates.insert(0, Update(0, 1.0))
        output = OutputSpec("ema", tuple(updates), mode="fold")

        staging = new_staging_dir(out_path)
        try:
            writer = DcpWriter(staging)
            specs = newest.specs()
            regions = layout_regions(newest, keys)
            stats = combine_regions(
                readers, [output], [writer], regions, specs,
                copy_source=len(readers) - 1,
                accumulate_dtype=ACCUMULATE_DTYPES[dtype],
                on_progress=on_progress,
            )
            planner = getattr(newest, "planner_data", None)
            written = writer.finish(planner)
            folded_now = [FoldedCheckpoint(str(c.path.resolve()), c.step, fingerprint(c.path)) for c in new]
            manifest = Manifest(
                kind="ema",
                profile=profile.to_dict(),
                dtype=dtype,
                step=new[-1].step,
                source_format=newest.format_name,
                checkpoints=(previous.checkpoints if previous else []) + folded_now,
                selection=selection,
                files={f.name: {"size": f.size, "crc32": f.crc32} for f in written},
            )
            manifest.write(staging)
            publish(staging, out_path)
        except BaseException:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            raise

    terms = _terms(previous, new, updates)
    return AccumulateResult(
        out_path, new[-1].step, folded_now, False, notes, terms=terms, keys=len(keys),
        bytes_read=stats.bytes_read, bytes_written=stats.bytes_written,
        seconds=time.perf_counter() - started, profile=profile.describe(),
    )


def _terms(previous: Manifest | None, new: list, updates: list[Update]) -> list[FoldTerm]:
    coefficients = fold_coefficients([u.weight for u in updates])
    labels: list[tuple[str, int]] = []
    if previous is not None:
        labels.append((f"previous EMA ({MANIFEST_NAME} step {previous.step})", previous.step))
    labels.extend((str(c.path), c.step) for c in new)
    return [FoldTerm(p, s, c) for (p, s), c in zip(labels, coefficients, strict=True)]
