"""Find checkpoints in a folder and the training step of each.

Steps come from the checkpoint itself where the format records one (DeepSpeed
``global_steps``), else from the directory name: ``step_1000``, ``step-1000``,
``global_step1000``, ``checkpoint-1000``, ``iter_0001000``, ``epoch=3-step=1000`` or a
bare ``1000``; ``step_regex`` overrides the patterns. Directories still being written
(DCP writes ``.metadata`` last) are skipped with a note. ema-ckpt's own outputs (they hold
``ema-ckpt.json``), hidden directories and the excluded paths are never taken as inputs.

Example:
    >>> step_from_name("epoch=3-step=1000")
    1000
    >>> step_from_name("iter_0001000")
    1000
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointNotFoundError, IncompatibleCheckpointError, UsageError
from .formats import detect_format, registered_formats
from .manifest import MANIFEST_NAME

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


def _step_of(path: Path, format_name: str, step_regex: str | None) -> int | None:
    fmt = registered_formats()[format_name]
    if fmt.records_step:
        reader = fmt.open(path)
        try:
            if reader.step is not None:
                return int(reader.step)
        finally:
            reader.close()
    return step_from_name(path.name, step_regex)


def _incomplete_reason(path: Path) -> str | None:
    for fmt in registered_formats().values():
        reason = fmt.incomplete(path)
        if reason:
            return reason
    return None


def _holds_checkpoints(path: Path) -> bool:
    """True when a directory's own children are checkpoints (a folder of them, not one)."""
    if not path.is_dir():
        return False
    return any(
        child.is_dir() and not child.name.startswith(".") and detect_format(child) is not None
        for child in path.iterdir()
    )


def discover(
    paths: Sequence[str | Path],
    *,
    step_regex: str | None = None,
    exclude: Sequence[str | Path] = (),
) -> Discovery:
    """Find the checkpoints in ``paths`` (each a checkpoint or a folder of them).

    Raises:
        CheckpointNotFoundError: a path is missing, an explicit path is not a checkpoint,
            or nothing was found at all.
        IncompatibleCheckpointError: two checkpoints claim the same step.
    """
    found = Discovery()
    excluded = [Path(p).resolve() for p in exclude]
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise CheckpointNotFoundError(path, "no such file or directory")
        fmt = detect_format(path)
        if fmt is not None and _holds_checkpoints(path):
            fmt = None  # e.g. a DeepSpeed save dir: `latest` names one tag, but every tag counts
        if fmt is not None and not (path / MANIFEST_NAME).exists():
            step = _step_of(path, fmt.name, step_regex)
            if step is None:
                raise CheckpointNotFoundError(
                    path, "cannot tell the training step from the name; pass --step-regex"
                )
            found.checkpoints.append(FoundCheckpoint(path, step, fmt.name))
            continue
        if not path.is_dir():
            raise CheckpointNotFoundError(path, "not a checkpoint of any known format")
        reason = _incomplete_reason(path)
        if reason:
            raise CheckpointNotFoundError(path, reason)
        for child in sorted(path.iterdir()):
            if child.name.startswith(".") or not child.is_dir() or _inside(child, excluded):
                continue
            if (child / MANIFEST_NAME).exists():
                continue
            child_fmt = detect_format(child)
            if child_fmt is None:
                reason = _incomplete_reason(child)
                if reason:
                    found.notes.append(f"skipped {child}: {reason}")
                continue
            step = _step_of(child, child_fmt.name, step_regex)
            if step is None:
                found.notes.append(f"skipped {child}: no step in its name (see --step-regex)")
                continue
            found.checkpoints.append(FoundCheckpoint(child, step, child_fmt.name))
    found.checkpoints.sort(key=lambda c: c.step)
    for a, b in zip(found.checkpoints, found.checkpoints[1:]):
        if a.step == b.step:
            raise IncompatibleCheckpointError(f"{a.path} and {b.path} both hold step {a.step}")
    if not found.checkpoints:
        where = ", ".join(str(p) for p in paths)
        raise CheckpointNotFoundError(where, "no checkpoints found" + (
            f" ({'; '.join(found.notes)})" if found.notes else ""))
    return found
