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
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointNotFoundError, EmaCkptError, IncompatibleCheckpointError, Note, OptionError, UsageError
from .formats import detect_format, locate_model, open_checkpoint
from .formats.base import (
    NESTED_MODELS,
    TRAINER_STATE,
    CheckpointFormat,
    CheckpointReader,
    formats_for,
    nested_incomplete,
    trainer_state_step,
)
from .layout import Box, row_blocks
from .manifest import MANIFEST_NAME
from .remote import RemotePath, as_path, forget_listings
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
            raise OptionError("step_regex", f"{step_regex!r} is not a valid regular expression: {err}",
                              value=step_regex) from None
        if pattern.groups < 1:
            raise OptionError("step_regex", f"{step_regex!r} has no group: put the step's digits in (...), "
                              r"e.g. 'ckpt_(\d+)'", value=step_regex)
        match = pattern.search(name)
        if not match:
            return None
        text = match.group("step") if "step" in pattern.groupindex else match.group(1)
        if text is None or not re.fullmatch(r"[0-9]+", text):
            raise OptionError("step_regex", f"{step_regex!r} matched {text!r} in {name!r}, not digits",
                              value=step_regex)
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
    """What was skipped and why: :class:`~ema_ckpt.errors.Note` strings where they name a parameter."""


def checkpoint_paths(checkpoints: str | Path | Sequence[str | Path]) -> list[Path]:
    """The paths a command was given (a folder, one checkpoint, or a list), each checked to exist.

    Example:
        >>> checkpoint_paths(["ckpts/step_100", "ckpts/step_200"])  # doctest: +SKIP
        [PosixPath('ckpts/step_100'), PosixPath('ckpts/step_200')]
    """
    paths = [as_path(checkpoints)] if isinstance(checkpoints, (str, Path, RemotePath)) else [
        as_path(p) for p in checkpoints]
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


ACCELERATE_CHECKPOINTS = "checkpoints"
"""Where accelerate's ``automatic_checkpoint_naming`` saves, inside the project folder."""


class StepUnknown(Exception):
    """A step source that sees its record still being written: the checkpoint waits (a note)."""


def _trainer_state_step(path: Path, fmt: CheckpointFormat) -> StepRecord | None:
    """The Hugging Face Trainer's ``trainer_state.json`` ``global_step`` (optimizer steps)."""
    step = trainer_state_step(path)
    return StepRecord(step, f"{TRAINER_STATE} global_step") if step is not None else None


def _optimizer_counter_step(path: Path, fmt: CheckpointFormat) -> StepRecord | None:
    """The optimizer's own step counter (Adam's per-parameter ``step``) saved beside a nested model.

    accelerate records no optimizer step of its own: the ``step`` in ``random_states_<i>.pkl``
    counts micro-batches through ``accumulate()`` and restarts at the end of every epoch. The
    largest counter is taken (a parameter frozen for a while counts fewer steps).
    """
    location = locate_model(path)
    if location.trainer is None or location.optimizer is None:
        return None
    if detect_format(location.optimizer) is None:
        raise StepUnknown(f"{location.optimizer.name}/ is not complete yet (still being written?)")
    with contextlib.closing(open_checkpoint(location.optimizer)) as reader:
        counters = [key for key, spec in reader.specs().items() if key.endswith(".step") and spec.shape == ()]
        values = [float(reader.read(key, Box((), ())).item()) for key in counters]
    steps = [int(v) for v in values if v >= 0 and v == int(v)]
    return StepRecord(max(steps), f"optimizer step counter in {location.optimizer.name}/") if steps else None


def _format_step(path: Path, fmt: CheckpointFormat) -> StepRecord | None:
    """The step the format itself records (DeepSpeed ``global_steps``)."""
    if not fmt.records_step:
        return None
    step = fmt.step_of(locate_model(path).path)  # cheap: no reader is built, no tensor opened
    return StepRecord(int(step), fmt.step_label or f"{fmt.name} record") if step is not None else None


STEP_SOURCES: tuple[Callable[[Path, CheckpointFormat], StepRecord | None], ...] = (
    _trainer_state_step,
    _optimizer_counter_step,
    _format_step,
)
"""Where a checkpoint's step is looked for, in order; the directory name comes last."""

_NAMES_COUNT_SAVES = {"accelerate"}
"""Trainers whose folder names count saves, not steps (accelerate's ``checkpoint_<i>``)."""


def _owner(path: Path) -> Path:
    """The trainer folder around a nested model folder given by itself, else ``path``."""
    if any(n.pattern.match(path.name) for n in NESTED_MODELS) and locate_model(path.parent).path == path:
        return path.parent
    return path


def step_record(path: str | Path, step_regex: str | None = None) -> StepRecord | None:
    """The training step of the checkpoint at ``path`` and where it came from, or None.

    ``step_regex``, when given and matching, wins over every record: the user said so.

    Raises:
        StepUnknown: the record that holds the step is still being written.

    Example:
        >>> step_record("out/checkpoint-500")  # doctest: +SKIP
        StepRecord(step=500, source='trainer_state.json global_step')
    """
    path = as_path(path)
    owner = _owner(path)
    if step_regex is not None:
        step = step_from_name(owner.name, step_regex)
        if step is not None:
            return StepRecord(step, Note("{step_regex} on the folder name ", mentions=("step_regex",)) + owner.name)
    fmt = detect_format(owner)
    if fmt is not None:
        for source in STEP_SOURCES:
            try:
                record = source(owner, fmt)
            except EmaCkptError:
                raise
            except OSError:
                record = None
            if record is not None:
                return record
        trainer = locate_model(owner).trainer
        if trainer in _NAMES_COUNT_SAVES:
            raise StepUnknown(
                f"no step record ({trainer}'s {owner.name} counts saves, not steps); "
                + Note("pass {step_regex} to take the name as the step", mentions=("step_regex",))
            )
    step = step_from_name(owner.name)
    return StepRecord(step, "folder name") if step is not None else None


def _incomplete_reason(path: Path) -> str | None:
    nested = nested_incomplete(path)
    if nested:
        return nested
    for fmt in formats_for(path):
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


def _found(path: Path, fmt: CheckpointFormat, step_regex: str | None) -> FoundCheckpoint | str:
    """The checkpoint at ``path`` with its step, or why it waits (a note)."""
    try:
        record = step_record(path, step_regex)
    except StepUnknown as why:
        return Note.of(why.args[0])
    if record is None:
        return Note("no step in its name (see {step_regex})", mentions=("step_regex",))
    return FoundCheckpoint(path, record.step, fmt.name, record.source)


def same_model_bytes(a: CheckpointReader, b: CheckpointReader, keys: Sequence[str]) -> bool:
    """True when ``a`` and ``b`` hold the same ``keys`` with the same shapes, dtypes and bytes.

    Reads block by block (memory: one block of each), and stops at the first difference.
    """
    import torch

    specs_a, specs_b = a.specs(), b.specs()
    for key in keys:
        spec_a, spec_b = specs_a[key], specs_b.get(key)
        if spec_b is None or spec_a.shape != spec_b.shape or spec_a.dtype != spec_b.dtype:
            return False
    for key in keys:
        spec = specs_a[key]
        limit = max(1, (16 << 20) // max(spec.dtype.itemsize, 1))
        for box in row_blocks(spec.shape, list(a.layout(key)), limit):
            x = a.read(key, box).contiguous().reshape(-1).view(torch.uint8)
            y = b.read(key, box).contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(x, y):  # bytes, so NaNs in the same places compare equal
                return False
    return True


def _prefer(
    a: FoundCheckpoint, b: FoundCheckpoint, known: set[Path]
) -> tuple[FoundCheckpoint, FoundCheckpoint]:
    """(kept, skipped) of two copies of one step: the one already folded, else the one with a
    trainer's own step record, else the first by path."""

    def rank(c: FoundCheckpoint) -> tuple[int, int, str]:
        return (0 if c.path.resolve() in known else 1, 0 if c.step_source.startswith(TRAINER_STATE) else 1,
                str(c.path))

    return (a, b) if rank(a) <= rank(b) else (b, a)


def _drop_identical_copies(found: Discovery, known: Mapping[Path, int], compare_after: int | None) -> None:
    """One checkpoint per step: identical copies of a step count once; different ones are refused.

    Bytes are compared only for steps after ``compare_after`` (the steps a run will read); an
    older duplicate keeps the copy already folded, unread.
    """
    kept: list[FoundCheckpoint] = []
    folded = set(known)
    for candidate in found.checkpoints:
        previous = kept[-1] if kept else None
        if previous is None or previous.step != candidate.step:
            kept.append(candidate)
            continue
        keep, skip = _prefer(previous, candidate, folded)
        if previous.path.resolve() == candidate.path.resolve():
            same = True
        elif compare_after is not None and candidate.step <= compare_after:
            same = True  # not read by this run either way
        else:
            with contextlib.closing(open_checkpoint(previous.path)) as a, \
                    contextlib.closing(open_checkpoint(candidate.path)) as b:
                keys_a, keys_b = select_keys(a), select_keys(b)
                same = sorted(keys_a) == sorted(keys_b) and same_model_bytes(a, b, keys_a)
        if not same:
            raise IncompatibleCheckpointError(
                f"{previous.path} and {candidate.path} both hold step {candidate.step} with different "
                "weights; leave one out with {skip=PATH}", remedy="skip"
            )
        kept[-1] = keep
        unread = compare_after is not None and candidate.step <= compare_after
        what = "as" if unread else "and the same weights as"
        found.notes.append(f"skipped {skip.path}: the same step {skip.step} {what} {keep.path}"
                           + (", already folded" if unread else ""))
    found.checkpoints = kept


def _skipped(path: Path, skipped: Sequence[Path], used: set[Path]) -> bool:
    """True when ``path`` (or the model folder nested in it) is one the user left out."""
    if not skipped:
        return False
    for candidate in {path.resolve(), locate_model(path).path.resolve()}:
        for target in skipped:
            if candidate == target or target in candidate.parents:
                used.add(target)
                return True
    return False


def _scan_folder(path: Path, found: Discovery, step_regex: str | None, excluded: Sequence[Path],
                 skipped: Sequence[Path], used: set[Path]) -> None:
    for child in sorted(path.iterdir()):
        if child.name.startswith(".") or not child.is_dir():
            continue
        if _inside(child, excluded):
            continue
        if _skipped(child, skipped, used):
            found.notes.append(Note(f"skipped {child}: left out ({{skip}})", mentions=("skip",)))
            continue
        if (child / MANIFEST_NAME).exists():
            continue
        child_fmt = detect_format(child)
        if child_fmt is None:
            reason = _incomplete_reason(child)
            if reason:
                found.notes.append(f"skipped {child}: " + reason)
            continue
        checkpoint = _found(child, child_fmt, step_regex)
        if isinstance(checkpoint, str):
            found.notes.append(f"skipped {child}: " + checkpoint)
            continue
        found.checkpoints.append(checkpoint)


def _record_kind(source: str) -> str:
    """A step source without the folder it was read from (``step_regex on the folder name x``)."""
    note = Note.of(source)
    return Note(note.template.split(" on the folder name")[0], mentions=note.mentions)


def discover(
    paths: Sequence[str | Path],
    *,
    step_regex: str | None = None,
    exclude: Sequence[str | Path] = (),
    skip: Sequence[str | Path] = (),
    known: Mapping[Path, int] | None = None,
    compare_after: int | None = None,
) -> Discovery:
    """Find the checkpoints in ``paths`` (each a checkpoint or a folder of them).

    ``exclude`` lists paths never taken, silently (outputs); ``skip`` lists checkpoints the
    user leaves out, each noted. ``known`` maps checkpoints already folded to
    their steps: of two copies of one step the known one is kept, and copies of steps up to
    ``compare_after`` are not compared byte for byte (that run reads neither).

    Raises:
        CheckpointNotFoundError: a path is missing, an explicit path is not a checkpoint,
            or nothing was found at all.
        IncompatibleCheckpointError: two checkpoints claim the same step with different weights.
    """
    forget_listings()
    found = Discovery()
    excluded = [as_path(p).resolve() for p in exclude]
    skipped = [as_path(p).resolve() for p in skip]
    used: set[Path] = set()
    for raw in paths:
        path = as_path(raw)
        if not path.exists():
            raise CheckpointNotFoundError(path, "no such file or directory")
        if _skipped(path, skipped, used):
            found.notes.append(Note(f"skipped {path}: left out ({{skip}})", mentions=("skip",)))
            continue
        fmt = detect_format(path)
        if fmt is not None and _holds_checkpoints(path):
            fmt = None  # e.g. a DeepSpeed save dir: `latest` names one tag, but every tag counts
        if fmt is not None and not (path / MANIFEST_NAME).exists():
            checkpoint = _found(path, fmt, step_regex)
            if isinstance(checkpoint, str):
                raise CheckpointNotFoundError(path, "cannot tell the training step: " + checkpoint)
            found.checkpoints.append(checkpoint)
            continue
        if not path.is_dir():
            raise CheckpointNotFoundError(path, "not a checkpoint of any known format")
        reason = _incomplete_reason(path)
        if reason:
            raise CheckpointNotFoundError(path, reason)
        before = len(found.checkpoints)
        _scan_folder(path, found, step_regex, excluded, skipped, used)
        project = path / ACCELERATE_CHECKPOINTS
        if len(found.checkpoints) == before and project.is_dir() and not project.is_symlink():
            # accelerate's project folder: automatic_checkpoint_naming saves into checkpoints/
            _scan_folder(project, found, step_regex, excluded, skipped, used)
    for target in skipped:
        if target not in used:
            found.notes.append(Note(f"{{skip}} {target}: no such checkpoint was found", mentions=("skip",)))
    sources = {_record_kind(c.step_source) for c in found.checkpoints}
    if len(sources) > 1:
        # the user's own pattern first, as it always has been listed
        ordered = sorted(sources, key=lambda s: (not Note.of(s).template.startswith("{"), s))
        found.notes.append("steps come from different records: " + Note.joined(", ", ordered)
                           + Note(" (check the order with {dry_run=True})", mentions=("dry_run",)))
    found.checkpoints.sort(key=lambda c: (c.step, str(c.path)))
    _drop_identical_copies(found, {as_path(p).resolve(): s for p, s in (known or {}).items()}, compare_after)
    if not found.checkpoints:
        where = ", ".join(str(p) for p in paths)
        raise CheckpointNotFoundError(where, "no checkpoints found" + (
            " (" + Note.joined("; ", found.notes) + ")" if found.notes else ""))
    return found
