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
import json
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
    UnplacedCheckpointError,
    UsageError,
)
from .formats import Resolved, open_checkpoint, resolve
from .formats.base import CheckpointReader
from .formats.resolve import not_a_model_reason, waiting_reason
from .formats.torch_file import SUFFIXES as TORCH_SUFFIXES
from .layout import row_blocks
from .layouts import (
    ACCELERATE_PROJECT_CHECKPOINTS,
    ALIAS_NAMES,
    EPOCHS,
    EXPORT_MARKERS,
    EXPORT_NAMES,
    MAIN_WEIGHTS,
    NOT_COMPONENTS,
    STEP_FILES,
    TRAINER_KEPT_EMA,
    TRAINER_STATE,
)
from .manifest import MANIFEST_NAME
from .saves import save_in_progress
from .selection import select_keys
from .steps import StepRecord, StepUnknown, StepWaiting, name_stem, step_from_name, step_in_name, step_record
from .storage import Location, as_path, forget_listings, is_location, local_file, one_look

CHECKPOINT_FILE_SUFFIXES = (*TORCH_SUFFIXES, ".safetensors")
"""Files a folder scan looks at as possible checkpoints; other files are left unread."""


@dataclass(frozen=True, slots=True)
class Component:
    """A network a checkpoint holds, read by one format's reader.

    ``name`` is its path inside the checkpoint (``unet``, ``model_1``; ``""`` for the checkpoint's
    own model). ``role``: ``trained`` (averaged by default) or ``trainer EMA`` (an EMA the trainer
    kept itself: averaged only when chosen).
    """

    name: str
    path: Location
    format_name: str
    role: str = "trained"


TRAINED = "trained"
TRAINER_EMA = "trainer EMA"


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


@dataclass(frozen=True, slots=True)
class LeftPart:
    """A model-bearing part of a checkpoint that is not read, and why (on screen, in ``--json``
    and in the manifest)."""

    path: Location
    why: str

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "why": str(Note.of(self.why))}


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


def holds_checkpoints(path: str | Location | Resolved) -> bool:
    """True when a directory's own children are checkpoints (a folder of them, not one)."""
    found = resolve(path)
    path = found.path
    if not path.is_dir() or found.model.trainer is not None:
        return False
    return any(
        child.is_dir() and not child.name.startswith(".") and (resolve(child).format is not None
                                                                or _components_inside(child)[0])
        for child in path.iterdir()
    )


def _export_parts(folder: Location) -> set[str]:
    """Names an export marker in ``folder`` lists (a diffusers pipeline's ``unet``, ``vae``, …)."""
    parts: set[str] = set()
    for marker in EXPORT_MARKERS:
        try:
            doc = json.loads((folder / marker).read_bytes())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(doc, dict):
            parts |= {k for k in doc if isinstance(k, str) and not k.startswith("_")}
    return parts


def _component_name(checkpoint: Location, path: Location) -> str:
    return name_stem(path.name) if path.parent == checkpoint else path.name


def _role(name: str) -> str:
    return TRAINER_EMA if TRAINER_KEPT_EMA.search(name) else TRAINED


def _model_child(child: Location) -> Resolved | None:
    """``child`` resolved when it holds a model of a known format, else None."""
    if child.name.startswith(".") or NOT_COMPONENTS.match(name_stem(child.name)):
        return None
    if child.is_dir():
        if (child / MANIFEST_NAME).exists():
            return None
    elif not child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES):
        return None
    found = resolve(child)
    return found if found.format is not None else None


def _components_inside(folder: Location) -> tuple[list[Component], list[LeftPart]]:
    """The model-bearing folders and files inside a folder that is no checkpoint of its own
    (diffusers' ``checkpoint-N/unet/``, LitGPT's ``step-N/lit_model.pth``)."""
    components: list[Component] = []
    try:
        children: list[Location] = sorted(folder.iterdir(), key=lambda c: c.name)
    except OSError:
        return [], []
    for child in children:
        found = _model_child(child)
        if found is not None and found.format is not None:
            name = _component_name(folder, child)
            components.append(Component(name, child, found.format.name, _role(name)))
    if _numbered(components):
        return [], [LeftPart(folder, "a folder of checkpoints (give its path to read them)")]
    return components, []


def _numbered(components: Sequence[Component]) -> bool:
    """Parts named by steps (``step_5/``, ``checkpoint-1.pth.tar``): checkpoints, not components."""
    return any(step_in_name(c.name) is not None for c in components)


def components_of(found: Resolved) -> tuple[list[Component], list[LeftPart]]:
    """A checkpoint's components, and the model-bearing parts left (copies of its model).

    A checkpoint of a known format is its own model (component ``""``); further model files
    beside its weights (accelerate's ``model_1.safetensors``) are components of their own, and
    a main weights file beside weights read in another format (the Trainer's bf16
    ``model.safetensors`` beside its DeepSpeed tag) is a copy, left. A folder of no format of its
    own holds its components (diffusers' ``unet/`` and ``unet_ema/``).

    Example:
        >>> [c.name for c in components_of(resolve("ckpts/checkpoint-4"))[0]]   # doctest: +SKIP
        ['unet', 'unet_ema']
    """
    path = found.path
    if found.format is None:
        return _components_inside(path) if path.is_dir() else ([], [])
    main = Component("", path, found.format.name)
    if not path.is_dir() or (found.model.path != path and found.model.trainer is None):
        return [main], []
    components: list[Component] = []
    left: list[LeftPart] = []
    try:
        children: list[Location] = sorted(path.iterdir(), key=lambda c: c.name)
    except OSError:
        return [main], []
    for child in children:
        if child.is_dir() or not child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES):
            continue
        if found.model.path == path and found.format.name in ("safetensors", "torch") and (
                MAIN_WEIGHTS.match(child.name) or _only_file(children, child)):
            continue  # the weights the checkpoint's own reader reads
        own_files = found.format.name not in ("safetensors", "torch")  # DCP records, DeepSpeed rank files
        if own_files and not MAIN_WEIGHTS.match(child.name):
            continue
        part = _model_child(child)
        if part is None or part.format is None:
            continue
        if MAIN_WEIGHTS.match(child.name):
            left.append(LeftPart(child, f"the same model's {child.name} ({found.format.name} weights "
                                        f"{_shown(found.model.path, path)} are read; name the file to read it)"))
            continue
        name = _component_name(path, child)
        components.append(Component(name, child, part.format.name, _role(name)))
    if components:  # several models: each by its file's name (model, model_1), each its own output folder
        own = next((name_stem(c.name) for c in children if not c.is_dir() and MAIN_WEIGHTS.match(c.name)
                    and not c.name.endswith(".json")), "model")
        main = Component(own, path, found.format.name)
    return [main, *components], left


def _only_file(children: Sequence[Location], child: Location) -> bool:
    """``child`` is the folder's one file of its suffix (what a reader of the folder reads)."""
    suffix = ".safetensors" if child.name.endswith(".safetensors") else None
    return suffix is not None and sum(c.name.endswith(suffix) for c in children) == 1


def _shown(model: Location, path: Location) -> str:
    return "of the folder" if model == path else f"in {model.name}/"


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
    exports = _export_parts(path)
    folders = [c for c in children if _is_dir(c)]
    files = [c for c in children if c not in folders]
    beside_folders = False
    for child in folders:
        with reading_input(child):
            if child.name in exports:
                _left(found, child, f"part of the final export in {path.name}/ ({EXPORT_MARKERS[0]}), not a "
                                    "checkpoint", note=_model_child(child) is not None)
                continue
            beside_folders |= _scan_entry(child, scan, beside=children)
    for child in files:
        with reading_input(child):
            if not (child.is_file() and child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES)):
                _left(found, child, "not a checkpoint file" if child.is_file() else "not a file or folder",
                      note=False)
            elif beside_folders:
                model = _model_child(child) is not None
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


def _chosen(entry: Location, components: Sequence[Component], scan: _Scan) -> list[Component] | str:
    """The components read of one checkpoint, or why none is (a note)."""
    if scan.component is not None:
        wanted = scan.component.strip("/")
        named = [c for c in components if c.name == wanted or (wanted in ("", ".") and c.name == "")]
        if not named:
            names = ", ".join(c.name or "(the checkpoint)" for c in components)
            return Note(f"holds no component {wanted!r} ({{component}}; it holds {names})", mentions=("component",))
        return named
    trained = [c for c in components if c.role == TRAINED] or list(components)
    if len(trained) > 1 and not scan.all_components:
        names = ", ".join(c.name or "(the checkpoint)" for c in trained)
        raise OptionError("component", f"{entry} holds {len(trained)} models ({names}); this command reads one: "
                          "choose it with {component}", value=None)
    return trained


def _found(resolved: Resolved, components: Sequence[Component], scan: _Scan) -> FoundCheckpoint | str:
    """The checkpoint at ``resolved.path`` with its step and the components read, or why it is
    not placed (a note; :class:`StepWaiting` notes begin with ``waits:``)."""
    chosen = _chosen(resolved.path, components, scan)
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
    one = chosen[0] if len(chosen) == 1 else None
    path = (one.path if one.name else resolved.path) if one is not None else resolved.path
    fmt = one.format_name if one is not None else chosen[0].format_name
    counters = tuple({"record": c.path, "value": c.value, "counts": c.counts} for c in record.counters)
    return FoundCheckpoint(path, record.step, fmt, record.source, checkpoint=resolved.path,
                           components=tuple(components) if len(components) > 1 or (components and components[0].name)
                           else (), counts=record.counts, counters=counters)


def _left_parts(resolved: Resolved, components: Sequence[Component], left: Sequence[LeftPart],
                checkpoint: FoundCheckpoint, scan: _Scan) -> None:
    """Note every model-bearing part of a taken checkpoint that is not read."""
    read = {c.name for c in components if checkpoint.path in (c.path, resolved.path) and
            (c.name == "" or c.path == checkpoint.path)} if not scan.all_components else {
        c.name for c in components if c.role == TRAINED or c.name == scan.component}
    for part in left:
        scan.found.left.append(part)
    for c in components:
        if c.name in read or c.role == TRAINED:  # another trained one: its own run (or the run was refused)
            continue
        why = (Note(f"an EMA the trainer kept ({c.name}): not averaged again; choose it with {{component}}",
                    mentions=("component",)) if c.role == TRAINER_EMA else
               Note(f"another component ({c.name}); choose it with {{component}}", mentions=("component",)))
        scan.found.left.append(LeftPart(c.path, why))


def _scan_entry(child: Location, scan: _Scan, beside: Sequence[Location] = ()) -> bool:
    """One entry of a scanned folder (``beside``: the folder's other entries): taken (with its
    step), or left with the reason. True when it is a checkpoint of the training run (taken,
    left out by the user, or still being written)."""
    found = scan.found
    if _inside(child, scan.excluded):
        _left(found, child, "the output of this run", note=False)
        return False
    resolved = resolve(child)  # the model folder and format, looked for once
    if _skipped(resolved, scan.skipped, scan.used):
        found.notes.append(Note(f"skipped {child}: left out ({{skip}})", mentions=("skip",)))
        found.entries.append(Entry(child, False, Note("left out ({skip})", mentions=("skip",))))
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
    _left_parts(resolved, components, left, checkpoint, scan)
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
        found.notes.append(Note(f"skipped {path}: left out ({{skip}})", mentions=("skip",)))
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
        _left_parts(resolved, components, left, checkpoint, scan)
        return
    if not path.is_dir():
        raise CheckpointNotFoundError(path, "not a checkpoint of any known format")
    reason = waiting_reason(path)
    if reason:
        raise CheckpointNotFoundError(path, reason)
    components, _ = _components_inside(path)
    placed_by_name = step_in_name(path.name) is not None or any((path / f.path).exists() for f in STEP_FILES)
    if components and not _export_parts(path) and (placed_by_name or len(components) == 1):
        scan.root = path.parent  # one checkpoint whose models sit in subfolders (checkpoint-4/unet/)
        before = len(found.checkpoints)
        _scan_entry(path, scan)
        if len(found.checkpoints) > before:
            return
    scan.root = path
    before = len(found.checkpoints)
    _scan_folder(path, scan)
    project = path / ACCELERATE_PROJECT_CHECKPOINTS
    if len(found.checkpoints) == before and project.is_dir() and not project.is_symlink():
        # accelerate's project folder: automatic_checkpoint_naming saves into checkpoints/
        _scan_folder(project, scan)


def _same_kind(a: Location, b: Location) -> bool:
    """Two checkpoints of one format holding the same keys (metadata only)."""
    try:
        with contextlib.closing(open_checkpoint(a)) as x, contextlib.closing(open_checkpoint(b)) as y:
            return sorted(select_keys(x)) == sorted(select_keys(y))
    except EmaCkptError:
        return True  # unreadable: not known to differ, so never left unsaid


def _refuse_unplaced(found: Discovery) -> None:
    """An entry like the folded ones that no record places fails the run: folding the others
    would be a partial result that exits 0."""
    if not found.checkpoints or not found.unplaced:
        return
    taken = found.checkpoints[-1]
    alike = []
    for path, why, fmt in found.unplaced:
        if fmt != taken.format_name or not _same_kind(_readable(path, taken), taken.path):
            continue
        copy = _copy_of(path, found.checkpoints) if ALIAS_NAMES.match(path.name) else None
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


def _copy_of(path: Location, checkpoints: Sequence[FoundCheckpoint]) -> FoundCheckpoint | None:
    """The checkpoint an alias with no step of its own copies (a link, or the same weights), or None."""
    for c in reversed(checkpoints):
        if _same_file(path, c.path):
            return c
        try:
            with contextlib.closing(open_checkpoint(path)) as a, contextlib.closing(open_checkpoint(c.path)) as b:
                keys = select_keys(a)
                if sorted(keys) == sorted(select_keys(b)) and same_model_bytes(a, b, keys):
                    return c
        except EmaCkptError:
            return None
    return None


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
    finding nothing is an error (else an empty result, whose entries say why), and so is an
    entry like the found ones that no record places. ``step_from`` names the record the steps
    come from; ``component`` the model read inside checkpoints that hold several
    (``all_components``: each trained one, listed in :attr:`FoundCheckpoint.components`).

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
        _refuse_unplaced(found)
    _drop_identical_copies(found, {as_path(p).resolve(): s for p, s in (known or {}).items()}, compare_after)
    if not found.checkpoints and require:
        where = ", ".join(str(p) for p in paths)
        raise CheckpointNotFoundError(where, "no checkpoints found" + (
            " (" + Note.joined("; ", found.notes) + ")" if found.notes else ""))
    return found


__all__ = [
    "ALIAS_NAMES",
    "CHECKPOINT_FILE_SUFFIXES",
    "Component",
    "Discovery",
    "Entry",
    "FoundCheckpoint",
    "LeftPart",
    "StepRecord",
    "checkpoint_paths",
    "components_of",
    "discover",
    "holds_checkpoints",
    "same_model_bytes",
    "step_from_name",
    "step_record",
]
