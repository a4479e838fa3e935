"""Find checkpoints in a folder, each with its training step.

A checkpoint is a folder or a file of a known format, or a trainer's checkpoint folder whose
model sits in a subfolder (accelerate's ``checkpoint_<i>/pytorch_model_fsdp_0/``). A folder
of checkpoint files (``epoch=3-step=1000.ckpt``, ``checkpoint-12.pth.tar``, ``ckpt_000100.pt``,
``*.safetensors``) is a sequence exactly as a folder of checkpoint folders is. Each step comes
from :func:`~ema_ckpt.steps.step_record`. Checkpoints still being written (DCP writes
``.metadata`` last, a ``torch.save`` zip its directory) are skipped with a note, and so are
files beside them that hold no model (``optimizer.pt``). ema-ckpt's own outputs (they hold
``ema-ckpt.json``), hidden entries and the excluded paths are never taken as inputs. Two
candidates holding the same step and the same model bytes (the Hugging Face Trainer's final
``save_model`` beside its last ``checkpoint-N``, Lightning's ``last.ckpt`` beside the
checkpoint it copies, a symlink or a hard link) count once, the named checkpoint kept over
the alias. :attr:`Discovery.entries` says, for each entry of a folder, why it was taken or left.

Example:
    >>> step_from_name("epoch=3-step=1000")
    1000
    >>> step_from_name("iter_0001000")
    1000
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    EmaCkptError,
    IncompatibleCheckpointError,
    Note,
    OptionError,
    UsageError,
)
from .formats import Resolved, detect_format, open_checkpoint, resolve
from .formats.base import TRAINER_STATE, CheckpointFormat, CheckpointReader
from .formats.resolve import not_a_model_reason, waiting_reason
from .formats.torch_file import SUFFIXES as TORCH_SUFFIXES
from .layout import row_blocks
from .manifest import MANIFEST_NAME
from .saves import save_in_progress
from .selection import select_keys
from .steps import EPOCHS, StepRecord, StepUnknown, step_from_name, step_record
from .storage import Location, as_path, forget_listings, is_location, local_file, one_look

CHECKPOINT_FILE_SUFFIXES = (*TORCH_SUFFIXES, ".safetensors")
"""Files a folder scan looks at as possible checkpoints; other files are left unread."""
ACCELERATE_CHECKPOINTS = "checkpoints"
"""Where accelerate's ``automatic_checkpoint_naming`` saves, inside the project folder."""
ALIAS_NAMES = re.compile(r"^(last|latest|best|model_best|final)([-_.=]|$)", re.IGNORECASE)
"""Names of copies of another checkpoint (``last.ckpt``, ``model_best.pth.tar``): the other is kept."""


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    """One checkpoint found on disk."""

    path: Location
    step: int
    format_name: str
    step_source: str = "folder name"
    """Where the step came from (see :data:`~ema_ckpt.steps.STEP_SOURCES`)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a scanned folder: taken as a checkpoint (with its step), or left and why."""

    path: Location
    taken: bool
    why: str
    step: int | None = None
    format_name: str | None = None


@dataclass(slots=True)
class Discovery:
    """Checkpoints sorted by step, and notes on what was skipped."""

    checkpoints: list[FoundCheckpoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was skipped and why: :class:`~ema_ckpt.errors.Note` strings where they name a parameter."""
    entries: list[Entry] = field(default_factory=list)
    """Every entry of the folders scanned, taken or left, in name order (for ``inspect``)."""


def checkpoint_paths(checkpoints: str | Location | Sequence[str | Location]) -> list[Location]:
    """The paths a command was given (a folder, one checkpoint, or a list), each checked to exist.

    Example:
        >>> checkpoint_paths(["ckpts/step_100", "ckpts/step_200"])  # doctest: +SKIP
        [PosixPath('ckpts/step_100'), PosixPath('ckpts/step_200')]
    """
    if isinstance(checkpoints, str) or is_location(checkpoints):
        paths = [as_path(checkpoints)]
    else:
        paths = [as_path(p) for p in checkpoints]
    if not paths:
        raise UsageError("no checkpoint paths given")
    for path in paths:
        if not path.exists():
            raise CheckpointNotFoundError(path, "no such file or directory")
    return paths


def _inside(path: Location, roots: Iterable[Location]) -> bool:
    resolved = path.resolve()
    return any(resolved == r or r in resolved.parents for r in roots)


def _holds_checkpoints(found: Resolved) -> bool:
    """True when a directory's own children are checkpoints (a folder of them, not one)."""
    path = found.path
    if not path.is_dir() or found.model.trainer is not None:
        return False
    return any(
        child.is_dir() and not child.name.startswith(".") and detect_format(child) is not None
        for child in path.iterdir()
    )


def _found(resolved: Resolved, fmt: CheckpointFormat, step_regex: str | None) -> FoundCheckpoint | str:
    """The checkpoint at ``resolved.path`` with its step, or why it waits (a note)."""
    path = resolved.path
    try:
        record = step_record(resolved, step_regex)
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
    a: FoundCheckpoint, b: FoundCheckpoint, known: set[Location]
) -> tuple[FoundCheckpoint, FoundCheckpoint]:
    """(kept, skipped) of two copies of one step: the one already folded, else the one with a
    trainer's own step record, else the one not named as an alias (``last.ckpt``), else the
    first by path."""

    def rank(c: FoundCheckpoint) -> tuple[int, int, int, str]:
        return (0 if c.path.resolve() in known else 1, 0 if c.step_source.startswith(TRAINER_STATE) else 1,
                1 if ALIAS_NAMES.match(c.path.name) else 0, str(c.path))

    return (a, b) if rank(a) <= rank(b) else (b, a)


def _drop_identical_copies(found: Discovery, known: Mapping[Location, int], compare_after: int | None) -> None:
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
        if _same_file(previous.path, candidate.path):
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
        why = f"the same step {skip.step} {what} {keep.path}" + (", already folded" if unread else "")
        found.notes.append(f"skipped {skip.path}: {why}")
        found.entries = [Entry(e.path, False, why, e.step, e.format_name) if e.path == skip.path else e
                         for e in found.entries]
    found.checkpoints = kept


def _same_file(a: Location, b: Location) -> bool:
    """One file or folder under two names: a symlink, or a hard link (timm's ``last.pth.tar``)."""
    if a.resolve() == b.resolve():
        return True
    try:
        local_a, local_b = local_file(a), local_file(b)  # objects have no links
        return local_a is not None and local_b is not None and not a.is_dir() and os.path.samefile(local_a, local_b)
    except OSError:
        return False


def _skipped(found: Resolved, skipped: Sequence[Location], used: set[Location]) -> bool:
    """True when ``found`` (or the model folder nested in it) is one the user left out."""
    if not skipped:
        return False
    for candidate in {found.path.resolve(), found.model.path.resolve()}:
        for target in skipped:
            if candidate == target or target in candidate.parents:
                used.add(target)
                return True
    return False


def _left(found: Discovery, child: Location, why: str, *, note: bool = True) -> None:
    found.entries.append(Entry(child, False, why))
    if note:
        found.notes.append(f"skipped {child}: " + why)


def _scan_folder(path: Location, found: Discovery, step_regex: str | None, excluded: Sequence[Location],
                 skipped: Sequence[Location], used: set[Location]) -> None:
    """Folders first; the files beside them count only when no folder is a checkpoint (a file
    beside checkpoint folders is an export or a copy: ``model.safetensors`` of a final save)."""
    with reading_input(path):
        children = sorted(c for c in path.iterdir() if not c.name.startswith("."))
    folders = [c for c in children if _is_dir(c)]
    files = [c for c in children if c not in folders]
    beside_folders = False
    for child in folders:
        with reading_input(child):
            beside_folders |= _scan_entry(child, found, step_regex, excluded, skipped, used, beside=children)
    for child in files:
        with reading_input(child):
            if not (child.is_file() and child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES)):
                _left(found, child, "not a checkpoint file" if child.is_file() else "not a file or folder",
                      note=False)
            elif beside_folders:
                _left(found, child, "a file beside checkpoint folders (name it to read it)", note=False)
            else:
                _scan_entry(child, found, step_regex, excluded, skipped, used)


def _is_dir(path: Location) -> bool:
    with reading_input(path):
        return path.is_dir()


@contextlib.contextmanager
def reading_input(path: Location) -> Iterator[None]:
    """An ``OSError`` while looking at input ``path`` (a folder that cannot be listed, a file that
    cannot be opened) is a :class:`~ema_ckpt.errors.CheckpointFormatError` naming it (exit 3):
    never an output error, never a file of ours it never held."""
    try:
        yield
    except EmaCkptError:
        raise
    except OSError as err:
        raise CheckpointFormatError(path, f"cannot read ({err.strerror or err})") from None


def _scan_entry(child: Location, found: Discovery, step_regex: str | None, excluded: Sequence[Location],
                skipped: Sequence[Location], used: set[Location], beside: Sequence[Location] = ()) -> bool:
    """One entry of a scanned folder (``beside``: the folder's other entries): taken (with its
    step), or left with the reason. True when it is a checkpoint of the training run (taken,
    left out by the user, or still being written)."""
    if _inside(child, excluded):
        _left(found, child, "the output of this run", note=False)
        return False
    resolved = resolve(child)  # the model folder and format, looked for once
    if _skipped(resolved, skipped, used):
        found.notes.append(Note(f"skipped {child}: left out ({{skip}})", mentions=("skip",)))
        found.entries.append(Entry(child, False, Note("left out ({skip})", mentions=("skip",))))
        return True
    if child.is_dir() and (child / MANIFEST_NAME).exists():
        _left(found, child, "an ema-ckpt output", note=False)
        return False
    child_fmt = resolved.format
    if child_fmt is None:
        waits = waiting_reason(child)
        if waits:
            _left(found, child, waits)
            return True
        # never a checkpoint: listed by inspect, not noted on every run
        _left(found, child, not_a_model_reason(child) or "not a checkpoint of a known format", note=False)
        return False
    waits = save_in_progress(child, beside)
    if waits:
        _left(found, child, waits)
        return True
    checkpoint = _found(resolved, child_fmt, step_regex)
    if isinstance(checkpoint, str):
        _left(found, child, checkpoint)
        return True
    found.checkpoints.append(checkpoint)
    found.entries.append(Entry(child, True, Note.of(checkpoint.step_source), checkpoint.step,
                               checkpoint.format_name))
    return True


def _refuse_nesting(outputs: Sequence[Location], checkpoints: Sequence[FoundCheckpoint]) -> None:
    """An output inside a checkpoint, or holding one: publishing it would replace the checkpoint."""
    for out in outputs:
        for c in checkpoints:
            path = c.path.resolve()
            if path == out or path in out.parents or out in path.parents:
                where = "inside" if path in out.parents else "around"
                raise OptionError("out", f"{out} lies {where} the checkpoint {c.path}; write the output elsewhere",
                                  value=out)


def _record_kind(source: str) -> str:
    """A step source without the name it was read from (``step_regex on the folder name x``)."""
    note = Note.of(source)
    return Note(re.split(" on the (?:folder|file) name", note.template)[0], mentions=note.mentions)


def _discover_one(path: Location, found: Discovery, step_regex: str | None, excluded: Sequence[Location],
                  skipped: Sequence[Location], used: set[Location]) -> None:
    """One path a command was given: a checkpoint, or a folder of them."""
    if not path.exists():
        raise CheckpointNotFoundError(path, "no such file or directory")
    resolved = resolve(path)
    if _skipped(resolved, skipped, used):
        found.notes.append(Note(f"skipped {path}: left out ({{skip}})", mentions=("skip",)))
        return
    fmt = resolved.format
    if fmt is not None and _holds_checkpoints(resolved):
        fmt = None  # e.g. a DeepSpeed save dir: `latest` names one tag, but every tag counts
    if fmt is not None and not (path / MANIFEST_NAME).exists():
        checkpoint = _found(resolved, fmt, step_regex)
        if isinstance(checkpoint, str):
            raise CheckpointNotFoundError(path, "cannot tell the training step: " + checkpoint)
        found.checkpoints.append(checkpoint)
        return
    if not path.is_dir():
        raise CheckpointNotFoundError(path, "not a checkpoint of any known format")
    reason = waiting_reason(path)
    if reason:
        raise CheckpointNotFoundError(path, reason)
    before = len(found.checkpoints)
    _scan_folder(path, found, step_regex, excluded, skipped, used)
    project = path / ACCELERATE_CHECKPOINTS
    if len(found.checkpoints) == before and project.is_dir() and not project.is_symlink():
        # accelerate's project folder: automatic_checkpoint_naming saves into checkpoints/
        _scan_folder(project, found, step_regex, excluded, skipped, used)


def discover(
    paths: Sequence[str | Location],
    *,
    step_regex: str | None = None,
    exclude: Sequence[str | Location] = (),
    skip: Sequence[str | Location] = (),
    known: Mapping[Location, int] | None = None,
    compare_after: int | None = None,
    require: bool = True,
) -> Discovery:
    """Find the checkpoints in ``paths`` (each a checkpoint or a folder of them).

    ``exclude`` lists paths never taken, silently (outputs: one inside a checkpoint, or holding
    one, is refused, as its publishing would replace the checkpoint); ``skip`` lists checkpoints the
    user leaves out, each noted. ``known`` maps checkpoints already folded to
    their steps: of two copies of one step the known one is kept, and copies of steps up to
    ``compare_after`` are not compared byte for byte (that run reads neither). ``require``:
    finding nothing is an error (else an empty result, whose entries say why).

    Raises:
        CheckpointNotFoundError: a path is missing, an explicit path is not a checkpoint,
            or nothing was found at all.
        IncompatibleCheckpointError: two checkpoints claim the same step with different weights.
    """
    forget_listings()
    found = Discovery()
    excluded = [as_path(p).resolve() for p in exclude]
    skipped = [as_path(p).resolve() for p in skip]
    used: set[Location] = set()
    for raw in paths:
        path = as_path(raw)
        with reading_input(path), one_look(path):  # in object storage: one listing answers the look
            _discover_one(path, found, step_regex, excluded, skipped, used)
    for target in skipped:
        if target not in used:
            found.notes.append(Note(f"{{skip}} {target}: no such checkpoint was found", mentions=("skip",)))
    sources = {_record_kind(c.step_source) for c in found.checkpoints}
    if len(sources) > 1:
        # the user's own pattern first, as it always has been listed
        ordered = sorted(sources, key=lambda s: (not Note.of(s).template.startswith("{"), s))
        found.notes.append("steps come from different records: " + Note.joined(", ", ordered)
                           + Note(" (check the order with {dry_run=True})", mentions=("dry_run",)))
    if any(EPOCHS in c.step_source for c in found.checkpoints):
        found.notes.append(Note("these steps count epochs: {decay} and {half_life} apply per epoch (or pass "
                                "{step_regex} where the names count optimizer steps)",
                                mentions=("decay", "half_life", "step_regex")))
    _refuse_nesting(excluded, found.checkpoints)
    found.checkpoints.sort(key=lambda c: (c.step, str(c.path)))
    _drop_identical_copies(found, {as_path(p).resolve(): s for p, s in (known or {}).items()}, compare_after)
    if not found.checkpoints and require:
        where = ", ".join(str(p) for p in paths)
        raise CheckpointNotFoundError(where, "no checkpoints found" + (
            " (" + Note.joined("; ", found.notes) + ")" if found.notes else ""))
    return found


__all__ = [
    "ALIAS_NAMES",
    "CHECKPOINT_FILE_SUFFIXES",
    "Discovery",
    "Entry",
    "FoundCheckpoint",
    "StepRecord",
    "checkpoint_paths",
    "discover",
    "same_model_bytes",
    "step_from_name",
    "step_record",
]
