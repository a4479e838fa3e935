"""Find checkpoints in a folder and the training step of each.

A checkpoint is a folder (or file) of a known format, or a trainer's checkpoint folder whose
model sits in a subfolder (accelerate's ``checkpoint_<i>/pytorch_model_fsdp_0/``). Its step
comes from the first record that holds one (:data:`STEP_SOURCES`): the Hugging Face
Trainer's ``trainer_state.json`` ``global_step``, the optimizer's own step counter saved
beside a nested model, the format's own record (DeepSpeed ``global_steps``), and only then
the directory name: ``step_1000``, ``step-1000``, ``global_step1000``, ``checkpoint-1000``,
``iter_0001000``, ``epoch=3-step=1000`` or a bare ``1000``; ``step_regex`` overrides the
name patterns. Directories still being written (DCP writes ``.metadata`` last) are skipped
with a note. ema-ckpt's own outputs (they hold ``ema-ckpt.json``), hidden directories and the
excluded paths are never taken as inputs. Two candidates holding the same step and the same
model bytes (the Hugging Face Trainer's final ``save_model`` beside its last
``checkpoint-N``) count once.

Example:
    >>> step_from_name("epoch=3-step=1000")
    1000
    >>> step_from_name("iter_0001000")
    1000
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointNotFoundError, IncompatibleCheckpointError, UsageError
from .formats import detect_format, locate_model, open_checkpoint, registered_formats
from .formats.base import CheckpointFormat, CheckpointReader
from .layout import Box, row_blocks
from .manifest import MANIFEST_NAME
from .selection import select_keys

_STEP_PATTERNS = (
    re.compile(r"(?:^|[^A-Za-z])step[_=-]?(\d+)"),
    re.compile(r"^checkpoint[_-](\d+)$"),
    re.compile(r"^iter[_-]?(\d+)$"),
    re.compile(r"^(\d+)$"),
)


def step_from_name(name: str, step_regex: str | None = None) -> int | None:
    """The step a checkpoint directory's name encodes, or None.

    ``step_regex`` must contain one group (or a group named ``step``) matching digits.
    """
    if step_regex is not None:
        try:
            pattern = re.compile(step_regex)
        except re.error as err:
            raise UsageError(f"--step-regex {step_regex!r} is not a valid regular expression: {err}") from None
        match = pattern.search(name)
        if not match:
            return None
        text = match.group("step") if "step" in pattern.groupindex else match.group(1)
        return int(text)
    for pattern in _STEP_PATTERNS:
        match = pattern.search(name)
        if match:
            return int(match.group(1))
    return None


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    """One checkpoint found on disk."""

    path: Path
    step: int
    format_name: str
    step_source: str = "folder name"
    """Where the step came from (see :data:`STEP_SOURCES`)."""


@dataclass(slots=True)
class Discovery:
    """Checkpoints sorted by step, and notes on what was skipped."""

    checkpoints: list[FoundCheckpoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def checkpoint_paths(checkpoints: str | Path | Sequence[str | Path]) -> list[Path]:
    """The paths a command was given (a folder, one checkpoint, or a list), each checked to exist.

    Example:
        >>> checkpoint_paths(["ckpts/step_100", "ckpts/step_200"])  # doctest: +SKIP
        [PosixPath('ckpts/step_100'), PosixPath('ckpts/step_200')]
    """
    paths = [Path(checkpoints)] if isinstance(checkpoints, (str, Path)) else [Path(p) for p in checkpoints]
    if not paths:
        raise UsageError("no checkpoint paths given")
    for path in paths:
        if not path.exists():
            raise CheckpointNotFoundError(path, "no such file or directory")
    return paths


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == r or r in resolved.parents for r in roots)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A checkpoint's training step and the record it was read from."""

    step: int
    source: str


TRAINER_STATE = "trainer_state.json"


def _trainer_state_step(path: Path, fmt: CheckpointFormat) -> StepRecord | None:
    """The Hugging Face Trainer's ``trainer_state.json`` ``global_step`` (optimizer steps)."""
    try:
        doc = json.loads((path / TRAINER_STATE).read_bytes()) if path.is_dir() else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    step = doc.get("global_step") if isinstance(doc, dict) else None
    return StepRecord(step, f"{TRAINER_STATE} global_step") if type(step) is int and step >= 0 else None


def _optimizer_counter_step(path: Path, fmt: CheckpointFormat) -> StepRecord | None:
    """The optimizer's own step counter (Adam's per-parameter ``step``) saved beside a nested model.

    accelerate records no optimizer step of its own: the ``step`` in ``random_states_<i>.pkl``
    counts micro-batches through ``accumulate()`` and restarts at the end of every epoch.
    """
    optimizer = locate_model(path).optimizer
    if optimizer is None or detect_format(optimizer) is None:
        return None
    try:
        with contextlib.closing(open_checkpoint(optimizer)) as reader:
            for key, spec in reader.specs().items():
                if key.endswith(".step") and spec.shape == ():
                    value = float(reader.read(key, Box((), ())).item())
                    if value >= 0 and value == int(value):
                        return StepRecord(int(value), f"optimizer step counter in {optimizer.name}/")
    except Exception:  # noqa: BLE001 - a bonus over the name: an unreadable optimizer must not stop reads
        return None
    return None


def _format_step(path: Path, fmt: CheckpointFormat) -> StepRecord | None:
    """The step the format itself records (DeepSpeed ``global_steps``)."""
    if not fmt.records_step:
        return None
    with contextlib.closing(open_checkpoint(path)) as reader:
        if reader.step is not None:
            return StepRecord(int(reader.step), fmt.step_label or f"{fmt.name} record")
    return None


STEP_SOURCES: tuple[Callable[[Path, CheckpointFormat], StepRecord | None], ...] = (
    _trainer_state_step,
    _optimizer_counter_step,
    _format_step,
)
"""Where a checkpoint's step is looked for, in order; the directory name comes last."""


def step_record(path: str | Path, step_regex: str | None = None) -> StepRecord | None:
    """The training step of the checkpoint at ``path`` and where it came from, or None.

    Example:
        >>> step_record("out/checkpoint-500")  # doctest: +SKIP
        StepRecord(step=500, source='trainer_state.json global_step')
    """
    path = Path(path)
    fmt = detect_format(path)
    if fmt is not None:
        # A trainer's nested model folder given by itself: its trainer folder holds the records.
        owner = path.parent if locate_model(path.parent).path == path else path
        for source in STEP_SOURCES:
            record = source(owner, fmt)
            if record is not None:
                return record
        if owner != path:
            step = step_from_name(owner.name, step_regex)
            if step is not None:
                return StepRecord(step, f"folder name {owner.name}")
    step = step_from_name(path.name, step_regex)
    if step is None:
        return None
    return StepRecord(step, "--step-regex on the folder name" if step_regex else "folder name")


def _incomplete_reason(path: Path) -> str | None:
    for fmt in registered_formats().values():
        reason = fmt.incomplete(path)
        if reason:
            return reason
    return None


def _holds_checkpoints(path: Path) -> bool:
    """True when a directory's own children are checkpoints (a folder of them, not one)."""
    if not path.is_dir() or locate_model(path).trainer is not None:
        return False
    return any(
        child.is_dir() and not child.name.startswith(".") and detect_format(child) is not None
        for child in path.iterdir()
    )


def _found(path: Path, fmt: CheckpointFormat, step_regex: str | None) -> FoundCheckpoint | None:
    record = step_record(path, step_regex)
    if record is None:
        return None
    return FoundCheckpoint(path, record.step, fmt.name, record.source)


def same_model_bytes(a: CheckpointReader, b: CheckpointReader, keys: Sequence[str]) -> bool:
    """True when ``a`` and ``b`` hold the same ``keys`` with the same shapes, dtypes and bytes.

    Reads block by block (memory: one block of each), and stops at the first difference.
    """
    specs_a, specs_b = a.specs(), b.specs()
    for key in keys:
        if key not in specs_b or specs_a[key].shape != specs_b[key].shape or specs_a[key].dtype != specs_b[key].dtype:
            return False
    for key in keys:
        spec = specs_a[key]
        limit = max(1, (16 << 20) // max(spec.dtype.itemsize, 1))
        for box in row_blocks(spec.shape, list(a.layout(key)), limit):
            x, y = a.read(key, box), b.read(key, box)
            if x.contiguous().view(-1).view(_uint8()).numpy().tobytes() != \
                    y.contiguous().view(-1).view(_uint8()).numpy().tobytes():
                return False
    return True


def _uint8():
    import torch

    return torch.uint8


def _prefer(a: FoundCheckpoint, b: FoundCheckpoint) -> tuple[FoundCheckpoint, FoundCheckpoint]:
    """(kept, skipped) of two copies of one step: the one with a trainer's own step record wins."""
    key_a = (0 if a.step_source.startswith(TRAINER_STATE) else 1, str(a.path))
    key_b = (0 if b.step_source.startswith(TRAINER_STATE) else 1, str(b.path))
    return (a, b) if key_a <= key_b else (b, a)


def _drop_identical_copies(found: Discovery) -> None:
    """One checkpoint per step: identical copies of a step count once; different ones are refused."""
    kept: list[FoundCheckpoint] = []
    for candidate in found.checkpoints:
        previous = kept[-1] if kept else None
        if previous is None or previous.step != candidate.step:
            kept.append(candidate)
            continue
        with contextlib.closing(open_checkpoint(previous.path)) as a, \
                contextlib.closing(open_checkpoint(candidate.path)) as b:
            keys_a, keys_b = select_keys(a), select_keys(b)
            same = sorted(keys_a) == sorted(keys_b) and same_model_bytes(a, b, keys_a)
        if not same:
            raise IncompatibleCheckpointError(
                f"{previous.path} and {candidate.path} both hold step {candidate.step} with different "
                "weights; leave one out with --skip PATH"
            )
        keep, skip = _prefer(previous, candidate)
        kept[-1] = keep
        found.notes.append(f"skipped {skip.path}: the same step {skip.step} and the same weights as {keep.path}")
    found.checkpoints = kept


def discover(
    paths: Sequence[str | Path],
    *,
    step_regex: str | None = None,
    exclude: Sequence[str | Path] = (),
    skip: Sequence[str | Path] = (),
) -> Discovery:
    """Find the checkpoints in ``paths`` (each a checkpoint or a folder of them).

    ``exclude`` lists paths never taken, silently (outputs); ``skip`` lists checkpoints the
    user leaves out (``--skip``), each noted.

    Raises:
        CheckpointNotFoundError: a path is missing, an explicit path is not a checkpoint,
            or nothing was found at all.
        IncompatibleCheckpointError: two checkpoints claim the same step with different weights.
    """
    found = Discovery()
    excluded = [Path(p).resolve() for p in exclude]
    skipped = [Path(p).resolve() for p in skip]
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise CheckpointNotFoundError(path, "no such file or directory")
        if _inside(path, skipped):
            found.notes.append(f"skipped {path}: left out (--skip)")
            continue
        fmt = detect_format(path)
        if fmt is not None and _holds_checkpoints(path):
            fmt = None  # e.g. a DeepSpeed save dir: `latest` names one tag, but every tag counts
        if fmt is not None and not (path / MANIFEST_NAME).exists():
            checkpoint = _found(path, fmt, step_regex)
            if checkpoint is None:
                raise CheckpointNotFoundError(
                    path, "cannot tell the training step from the name; pass --step-regex"
                )
            found.checkpoints.append(checkpoint)
            continue
        if not path.is_dir():
            raise CheckpointNotFoundError(path, "not a checkpoint of any known format")
        reason = _incomplete_reason(path)
        if reason:
            raise CheckpointNotFoundError(path, reason)
        for child in sorted(path.iterdir()):
            if child.name.startswith(".") or not child.is_dir():
                continue
            if _inside(child, excluded):
                continue
            if _inside(child, skipped):
                found.notes.append(f"skipped {child}: left out (--skip)")
                continue
            if (child / MANIFEST_NAME).exists():
                continue
            child_fmt = detect_format(child)
            if child_fmt is None:
                reason = _incomplete_reason(child)
                if reason:
                    found.notes.append(f"skipped {child}: {reason}")
                continue
            checkpoint = _found(child, child_fmt, step_regex)
            if checkpoint is None:
                found.notes.append(f"skipped {child}: no step in its name (see --step-regex)")
                continue
            found.checkpoints.append(checkpoint)
    found.checkpoints.sort(key=lambda c: (c.step, str(c.path)))
    _drop_identical_copies(found)
    if not found.checkpoints:
        where = ", ".join(str(p) for p in paths)
        raise CheckpointNotFoundError(where, "no checkpoints found" + (
            f" ({'; '.join(found.notes)})" if found.notes else ""))
    return found
