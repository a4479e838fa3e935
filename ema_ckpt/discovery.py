"""Find checkpoints in a folder, each with its training step and the components read.

One discovery for every command and ``inspect``, over the general model of
:mod:`ema_ckpt.layouts`: each entry of a sequence root is a checkpoint (placed at a step by
:func:`~ema_ckpt.steps.step_record`), or left with the reason (:attr:`Discovery.entries`).
An entry like the others that no record places fails the run: a partial result never exits 0.

Example:
    >>> step_from_name("iter_0001000")
    1000
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from .components import (
    CHECKPOINT_FILE_SUFFIXES,
    FOLDER_OF_CHECKPOINTS,
    TRAINED,
    Component,
    LeftPart,
    chosen_components,
    components_inside,
    components_of,
    export_parts,
    holds_checkpoints,
    model_child,
    unread_parts,
)
from .copies import copy_of, one_per_step, same_kind
from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    EmaCkptError,
    Note,
    OptionError,
    UnplacedCheckpointError,
    UsageError,
)
from .formats import Resolved, resolve
from .formats.options import DEFAULT_READ, ReadOptions
from .formats.resolve import not_a_model_reason, waiting_reason
from .layouts import (
    ALIAS_NAMES,
    EPOCHS,
    EXPORT_MARKERS,
    EXPORT_NAMES,
    STEP_FILES,
)
from .manifest import MANIFEST_NAME
from .saves import save_in_progress
from .steps import StepUnknown, StepWaiting, describe_counters, name_stem, step_from_name, step_in_name, step_record
from .storage import Location, as_path, forget_listings, is_location, one_look


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    """One checkpoint found on disk: ``path`` is what is read (the component chosen), ``checkpoint``
    the entry of the sequence it belongs to (itself when it is one)."""

    path: Location
    step: int
    format_name: str
    step_source: str = "folder name"
    """Where the step came from (see :mod:`ema_ckpt.steps`)."""
    checkpoint: Location | None = None
    components: tuple[Component, ...] = ()
    """Every component of the checkpoint (empty: the checkpoint is its one model)."""
    counts: str = "optimizer steps"
    """What :attr:`step` counts: optimizer steps, or epochs where ``step_from`` asked for them."""
    counters: tuple[dict[str, object], ...] = ()
    """Every counter its records hold (``inspect`` lists them, marking the one taken)."""

    @property
    def entry(self) -> Location:
        return self.checkpoint if self.checkpoint is not None else self.path


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a scanned folder: taken as a checkpoint (with its step), or left and why."""

    path: Location
    taken: bool
    why: str
    step: int | None = None
    format_name: str | None = None
    components: tuple[Component, ...] = ()


@dataclass(slots=True)
class Discovery:
    """Checkpoints sorted by step, and notes on what was skipped."""

    checkpoints: list[FoundCheckpoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was skipped and why: :class:`~ema_ckpt.errors.Note` strings where they name a parameter."""
    entries: list[Entry] = field(default_factory=list)
    """Every entry of the folders scanned, taken or left, in name order (for ``inspect``)."""
    components: list[str] = field(default_factory=list)
    """The components read (names inside each checkpoint; ``""``: the checkpoint's own model)."""
    left: list[LeftPart] = field(default_factory=list)
    """Model-bearing parts of the checkpoints that are not read, each with the reason."""
    unplaced: list[tuple[Location, str, str | None]] = field(default_factory=list)
    """(entry, why, format) of model-bearing entries no record places."""


def checkpoint_paths(checkpoints: str | Location | Sequence[str | Location]) -> list[Location]:
    """The paths a command was given (a folder, one checkpoint, or a list), each checked to exist.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> ckpts = Path(tempfile.mkdtemp()); (ckpts / "step_100").mkdir()
        >>> checkpoint_paths(str(ckpts / "step_100")) == [ckpts / "step_100"]
        True
        >>> checkpoint_paths([ckpts / "step_100", ckpts / "step_200"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ema_ckpt.errors.CheckpointNotFoundError: /.../step_200: no such file or directory
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


def _skipped(found: Resolved, skipped: Sequence[Location], used: set[Location]) -> bool:
    if not skipped:
        return False
    for candidate in {found.path.resolve(), found.model.path.resolve()}:
        for target in skipped:
            if candidate == target or target in candidate.parents:
                used.add(target)
                return True
    return False


@dataclass(slots=True)
class _Scan:
    """What one discovery is asked (the rules every entry is judged by)."""

    found: Discovery
    step_regex: str | None
    step_from: str | None
    component: str | None
    all_components: bool
    excluded: Sequence[Location]
    skipped: Sequence[Location]
    used: set[Location] = field(default_factory=set)
    root: Location | None = None


_LEFT_OUT = Note("left out ({skip})", mentions=("skip",))


def _left(found: Discovery, child: Location, why: str, *, note: bool = True) -> None:
    found.entries.append(Entry(child, False, why))
    if note:
        found.notes.append(f"skipped {child}: " + why)


def _scan_folder(path: Location, scan: _Scan) -> None:
    """Folders first; the files beside them count only when no folder is a checkpoint (a file
    beside checkpoint folders is an export or a copy: ``model.safetensors`` of a final save)."""
    found = scan.found
    with reading_input(path):
        children = sorted(c for c in path.iterdir() if not c.name.startswith("."))
    exports = export_parts(path)
    folders = [c for c in children if _is_dir(c)]
    files = [c for c in children if c not in folders]
    beside_folders = False
    for child in folders:
        with reading_input(child):
            if child.name in exports:
                _left(found, child, f"part of the final export in {path.name}/ ({EXPORT_MARKERS[0]}), not a "
                                    "checkpoint", note=model_child(child) is not None)
                continue
            beside_folders |= _scan_entry(child, scan, beside=children)
    for child in files:
        with reading_input(child):
            if not (child.is_file() and child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES)):
                _left(found, child, "not a checkpoint file" if child.is_file() else "not a file or folder",
                      note=False)
            elif beside_folders:
                model = model_child(child) is not None
                _left(found, child, "a file beside checkpoint folders: a final export or a copy (name it to read "
                                    "it)" if model else "a file beside checkpoint folders", note=model)
            else:
                _scan_entry(child, scan)


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


def _found(resolved: Resolved, components: Sequence[Component], scan: _Scan) -> FoundCheckpoint | str:
    """The checkpoint at ``resolved.path`` with its step and the components read, or why it is
    not placed (a note; :class:`StepWaiting` notes begin with ``waits:``)."""
    chosen = chosen_components(resolved.path, components, scan.component, every=scan.all_components)
    if isinstance(chosen, str):
        return chosen
    parts = [resolve(c.path) if c.name else resolved for c in chosen]
    try:
        record = step_record(resolved, scan.step_regex, root=scan.root, step_from=scan.step_from,
                             components=parts)
    except StepWaiting as why:
        return "waits: " + Note.of(why.args[0])
    except StepUnknown as why:
        return Note.of(why.args[0])
    if record is None:
        return Note("no step in its records or its name (see {step_regex}, {step_from})",
                    mentions=("step_regex", "step_from"))
    path = chosen[0].path if len(chosen) == 1 and chosen[0].name else resolved.path
    return FoundCheckpoint(path, record.step, chosen[0].format_name, record.source, checkpoint=resolved.path,
                           components=tuple(components) if len(components) > 1 or (components and components[0].name)
                           else (), counts=record.counts, counters=tuple(describe_counters(record.counters)))


def _scan_entry(child: Location, scan: _Scan, beside: Sequence[Location] = ()) -> bool:
    """One entry of a scanned folder (``beside``: the folder's other entries): taken (with its
    step), or left with the reason. True when it is a checkpoint of the training run (taken,
    left out by the user, or still being written)."""
    found = scan.found
    where = child.resolve()
    if any(where == out or out in where.parents for out in scan.excluded):
        _left(found, child, "the output of this run", note=False)
        return False
    resolved = resolve(child)  # the model folder and format, looked for once
    if _skipped(resolved, scan.skipped, scan.used):
        _left(found, child, _LEFT_OUT)
        return True
    if child.is_dir() and (child / MANIFEST_NAME).exists():
        _left(found, child, "an ema-ckpt output", note=False)
        return False
    if child.is_dir() and any((child / m).is_file() for m in EXPORT_MARKERS):
        _left(found, child, f"an export of finished weights ({EXPORT_MARKERS[0]}), not a checkpoint")
        return False
    child_fmt = resolved.format
    components, left = components_of(resolved)
    if child_fmt is None:
        waits = waiting_reason(child)
        if waits:
            _left(found, child, waits)
            return True
        if not components:
            # never a checkpoint: listed by inspect, not noted on every run
            _left(found, child, left[0].why if left else not_a_model_reason(child)
                  or "not a checkpoint of a known format", note=False)
            return False
    waits = save_in_progress(child, beside)
    if waits:
        _left(found, child, waits)
        return True
    checkpoint = _found(resolved, components, scan)
    if isinstance(checkpoint, str):
        if checkpoint.startswith("waits: "):
            _left(found, child, checkpoint[len("waits: "):])
            return True
        if EXPORT_NAMES.match(name_stem(child.name)):
            _left(found, child, "a final export beside the checkpoints, not a checkpoint (no step of its own)")
            return False
        fmt_name = child_fmt.name if child_fmt is not None else components[0].format_name if components else None
        found.unplaced.append((child, checkpoint, fmt_name))
        _left(found, child, checkpoint)
        return True
    found.checkpoints.append(checkpoint)
    found.left += unread_parts(components, left, scan.component)
    found.entries.append(Entry(child, True, Note.of(checkpoint.step_source), checkpoint.step,
                               checkpoint.format_name, tuple(components) if checkpoint.components else ()))
    return True


def _refuse_nesting(outputs: Sequence[Location], checkpoints: Sequence[FoundCheckpoint]) -> None:
    """An output inside a checkpoint, or holding one: publishing it would replace the checkpoint."""
    for out in outputs:
        for c in checkpoints:
            path = c.entry.resolve()
            if path == out or path in out.parents or out in path.parents:
                where = "inside" if path in out.parents else "around"
                raise OptionError("out", f"{out} lies {where} the checkpoint {c.entry}; write the output elsewhere",
                                  value=out)


def _record_kind(source: str) -> str:
    """A step source without the name it was read from (``step_regex on the folder name x``)."""
    note = Note.of(source)
    return Note(re.split(" on the (?:folder name|file name|path)", note.template)[0], mentions=note.mentions)


def _discover_one(path: Location, scan: _Scan) -> None:
    """One path a command was given: a checkpoint, or a folder of them."""
    found = scan.found
    if not path.exists():
        raise CheckpointNotFoundError(path, "no such file or directory")
    resolved = resolve(path)
    if _skipped(resolved, scan.skipped, scan.used):
        found.notes.append(f"skipped {path}: " + _LEFT_OUT)
        return
    fmt = resolved.format
    if fmt is not None and holds_checkpoints(resolved):
        fmt = None  # e.g. a DeepSpeed save dir: `latest` names one tag, but every tag counts
    if fmt is not None and not (path / MANIFEST_NAME).exists():
        components, left = components_of(resolved)
        scan.root = path.parent
        checkpoint = _found(resolved, components, scan)
        if isinstance(checkpoint, str):
            raise CheckpointNotFoundError(path, "cannot tell the training step: " + checkpoint.removeprefix("waits: "))
        found.checkpoints.append(checkpoint)
        found.left += unread_parts(components, left, scan.component)
        return
    if not path.is_dir():
        raise CheckpointNotFoundError(path, "not a checkpoint of any known format")
    reason = waiting_reason(path)
    if reason:
        raise CheckpointNotFoundError(path, reason)
    components, _ = components_inside(path)
    placed_by_name = step_in_name(path.name) is not None or any((path / f.path).exists() for f in STEP_FILES)
    if components and not export_parts(path) and placed_by_name:
        scan.root = path.parent  # one checkpoint whose models sit in subfolders (checkpoint-4/unet/)
        before = len(found.checkpoints)
        _scan_entry(path, scan)
        if len(found.checkpoints) > before:
            return
    scan.root = path
    before, listed = len(found.checkpoints), len(found.entries)
    _scan_folder(path, scan)
    nested = [e.path for e in found.entries[listed:] if e.why == FOLDER_OF_CHECKPOINTS and not e.path.is_symlink()]
    if len(found.checkpoints) == before and len(nested) == 1:
        # the checkpoints one folder down: accelerate's project folder saves into checkpoints/,
        # lit-gpt into out/<dataset>/
        scan.root = nested[0]
        _scan_folder(nested[0], scan)


def _refuse_unplaced(found: Discovery, read: ReadOptions) -> None:
    """An entry like the folded ones that no record places fails the run: folding the others
    would be a partial result that exits 0."""
    if not found.checkpoints or not found.unplaced:
        return
    taken = found.checkpoints[-1]
    alike = []
    for path, why, fmt in found.unplaced:
        if fmt != taken.format_name or not same_kind(_readable(path, taken), taken.path, read):
            continue
        copy = copy_of(path, found.checkpoints, read) if ALIAS_NAMES.match(path.name) else None
        if copy is not None:  # last.safetensors beside the step it copies: one checkpoint
            found.entries = [Entry(e.path, False, f"a copy of {copy.path} (the same weights)") if e.path == path
                             else e for e in found.entries]
            found.notes = [n for n in found.notes if not str(n).startswith(f"skipped {path}:")]
            found.notes.append(f"skipped {path}: a copy of {copy.path} (the same weights)")
            continue
        alike.append((path, why))
    if not alike:
        return
    shown = "; ".join(f"{p}: {Note.of(w)}" for p, w in alike[:3]) + (f"; and {len(alike) - 3} more"
                                                                     if len(alike) > 3 else "")
    raise UnplacedCheckpointError(
        alike[0][0], Note(f"{len(alike)} checkpoint(s) like the others cannot be placed at a step ({shown}); "
                          "give the steps with {step_regex} or {step_from}, or leave them out with {skip}",
                          mentions=("step_regex", "step_from", "skip")))


def _readable(entry: Location, like: FoundCheckpoint) -> Location:
    """What of an unplaced entry would be read: the component named as the folded ones' is."""
    if like.checkpoint is not None and like.path != like.checkpoint:
        inner = entry / like.path.name
        if inner.exists():
            return inner
    return entry


def discover(
    paths: Sequence[str | Location],
    *,
    step_regex: str | None = None,
    step_from: str | None = None,
    component: str | None = None,
    all_components: bool = False,
    exclude: Sequence[str | Location] = (),
    skip: Sequence[str | Location] = (),
    known: Collection[Location] = (),
    compare_after: int | None = None,
    require: bool = True,
    compare: bool = True,
    read: ReadOptions = DEFAULT_READ,
) -> Discovery:
    """Find the checkpoints in ``paths`` (each a checkpoint or a folder of them).

    ``exclude``: paths never taken, silently (an output inside a checkpoint, or holding one, is
    refused); ``skip``: checkpoints the user leaves out, each noted. ``known``: checkpoints
    already folded, kept over their copies; copies of steps up to ``compare_after`` are not
    compared byte for byte, and with ``compare`` False none are (nothing is read). ``require``:
    finding nothing, or an entry like the others that no record places, is an error.
    ``component``: the model read inside checkpoints that hold several (``all_components``:
    each trained one, listed in :attr:`FoundCheckpoint.components`). ``read``: the run's read
    options, for the checkpoints opened to compare them.

    Raises:
        CheckpointNotFoundError: a path is missing, an explicit path is not a checkpoint,
            or nothing was found at all.
        UnplacedCheckpointError: an entry like the others has no step (exit 3).
        OptionError: a checkpoint holds several trained models and none was chosen.
        IncompatibleCheckpointError: two checkpoints claim the same step with different weights.
    """
    forget_listings()
    found = Discovery()
    scan = _Scan(found, step_regex, step_from, component, all_components,
                 [as_path(p).resolve() for p in exclude], [as_path(p).resolve() for p in skip])
    for raw in paths:
        path = as_path(raw)
        with reading_input(path), one_look(path):  # in object storage: one listing answers the look
            _discover_one(path, scan)
    for target in scan.skipped:
        if target not in scan.used:
            found.notes.append(Note(f"{{skip}} {target}: no such checkpoint was found", mentions=("skip",)))
    sources = {_record_kind(c.step_source) for c in found.checkpoints}
    if len(sources) > 1:
        # the user's own pattern first, as it always has been listed
        ordered = sorted(sources, key=lambda s: (not Note.of(s).template.startswith("{"), s))
        found.notes.append("steps come from different records: " + Note.joined(", ", ordered)
                           + Note(" (check the order with {dry_run=True})", mentions=("dry_run",)))
    if any(c.counts == EPOCHS for c in found.checkpoints):
        found.notes.append(Note("these steps count epochs, as {step_from} asked: {decay} and {half_life} apply "
                                "per epoch", mentions=("step_from", "decay", "half_life")))
    for part in found.left:
        found.notes.append(f"not read: {part.path}: " + part.why)
    found.components = sorted({c.path.name if c.checkpoint is not None and c.path != c.checkpoint else ""
                               for c in found.checkpoints} if not all_components else
                              {p.name for c in found.checkpoints for p in c.components if p.role == TRAINED}
                              | ({""} if any(not c.components for c in found.checkpoints) else set()))
    _refuse_nesting(scan.excluded, found.checkpoints)
    found.checkpoints.sort(key=lambda c: (c.step, str(c.path)))
    if require:
        _refuse_unplaced(found, read)
    if compare:  # one checkpoint per step, each copy left said
        kept, copies = one_per_step(found.checkpoints, {as_path(p).resolve() for p in known}, compare_after, read)
        for path, why in copies:
            found.notes.append(f"skipped {path}: {why}")
            found.entries = [Entry(e.path, False, why, e.step, e.format_name) if e.path == path else e
                             for e in found.entries]
        found.checkpoints = kept
    if not found.checkpoints and require:
        where = ", ".join(str(p) for p in paths)
        raise CheckpointNotFoundError(where, "no checkpoints found" + (
            " (" + Note.joined("; ", found.notes) + ")" if found.notes else ""))
    return found


__all__ = ["Discovery", "Entry", "FoundCheckpoint", "LeftPart", "checkpoint_paths", "discover", "step_from_name",
           "step_record"]
