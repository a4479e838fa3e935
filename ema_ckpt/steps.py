"""The training step of a checkpoint (the optimizer updates its weights have seen: what an EMA's
decay counts), and the record it was read from, in the order of ``docs/formats.md`` ("Steps"):
``step_regex`` or the record ``step_from`` names; the checkpoint's own records
(:mod:`ema_ckpt.layouts`: step files, the optimizer's counter, the format's record, a file's or
a safetensors header's counters, the counter of optimizer steps first); the names up to the
sequence root, a labelled number first. A checkpoint whose only record counts epochs is refused
unless ``step_from`` names it.

Example:
    >>> step_from_name("epoch=3-step=1000")
    1000
    >>> step_from_name("ep0-ba4-rank0.pt")
    4
    >>> step_from_name("ckpt_000100.pt")
    100
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .errors import EmaCkptError, Note, OptionError
from .formats import Resolved, detect_format, locate_model, open_checkpoint, resolve
from .formats.torch_file import file_facts, has_torch_suffix
from .formats.torch_file.optimizer import optimizer_step_counters, optimizer_steps
from .layout import Box
from .layouts import (
    ACCELERATE,
    ACCELERATE_OPTIMIZER,
    EPOCHS,
    NAME_LABELS,
    NESTED_MODELS,
    OPTIMIZER_STEPS,
    SAVES,
    STEP_FILES,
    TRAINER_STATE,
    SeenCounter,
    best_step,
    counter_named,
    counters_in,
)
from .storage import Location, as_path

T = TypeVar("T")
_FILE_SUFFIXES = (".pth.tar", ".safetensors", ".ckpt", ".pth", ".pt", ".bin", ".tar")
_NUMBERS = re.compile(r"(?:([A-Za-z]+(?:_[A-Za-z]+)*)[_=-]?)?(\d+)")
_WORDS = {word: label for label in NAME_LABELS for word in label.words}


def name_stem(name: str) -> str:
    """A checkpoint's name without a file suffix: ``checkpoint-12.pth.tar`` → ``checkpoint-12``."""
    lower = name.lower()
    for suffix in _FILE_SUFFIXES:
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


@dataclass(frozen=True, slots=True)
class NameNumber:
    """A number in a name, the word that labels it (lower case, or None) and what it counts."""

    label: str | None
    value: int
    counts: str | None
    rank: int = 0


def step_in_name(name: str) -> NameNumber | None:
    """The number of a name (its suffix left out) that counts optimizer steps: a labelled one
    (``step``, ``ba``, ``iter``: the best label), else the name's only number when it is
    unlabelled or names a save (``checkpoint-12``); an epoch-labelled only number is returned as
    such. None when there is none or several unlabelled ones (ambiguous)."""
    numbers = []
    for match in _NUMBERS.finditer(name_stem(name)):
        word = match.group(1).lower() if match.group(1) else None
        label = (_WORDS.get(word) or _WORDS.get(word.rsplit("_", 1)[-1])) if word else None
        if label is None or label.counts != "ranks":
            numbers.append(NameNumber(word, int(match.group(2)), label.counts if label else None,
                                      label.rank if label else 0))
    steps = [n for n in numbers if n.counts == OPTIMIZER_STEPS]
    if steps:
        return min(steps, key=lambda n: n.rank)
    if len(numbers) == 1 and numbers[0].counts in (None, SAVES, EPOCHS) and (
            numbers[0].label is None or numbers[0].counts is not None):
        return numbers[0]
    return None


def step_from_name(name: str, step_regex: str | None = None) -> int | None:
    """The step a checkpoint's name (or path) encodes, or None.

    ``step_regex`` must contain one group (or a group named ``step``) matching digits; it is
    searched in the whole name (a path from the sequence root: ``checkpoint-(\\d+)/unet``).
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
    found = step_in_name(name)
    return found.value if found is not None and found.counts != EPOCHS else None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A checkpoint's training step, the record it was read from, and every counter seen."""

    step: int
    source: str
    counts: str = OPTIMIZER_STEPS
    """What the step counts: optimizer steps, or epochs where ``step_from`` asked for them."""
    counters: tuple[SeenCounter, ...] = field(default=(), compare=False)
    taken: str | None = None
    """The record path of the counter taken (``step_count``), when the step is one of :attr:`counters`."""


class StepUnknown(Exception):
    """No record places the checkpoint (no step, only epochs, an ambiguous name): the reason."""


class StepWaiting(StepUnknown):
    """A step source that sees its record still being written: the checkpoint waits (a note)."""


def _step_file_counters(folder: Location) -> list[tuple[str, list[SeenCounter]]]:
    """(file, counters) of the :data:`~ema_ckpt.layouts.STEP_FILES` in a checkpoint folder."""
    found = []
    for step_file in STEP_FILES:
        path = folder / step_file.path
        if not path.is_file():  # on object storage: answered by the folder's listing, no request
            continue
        if step_file.kind == "json":
            try:
                doc = json.loads(path.read_bytes())
            except (OSError, ValueError):
                doc = None
            counters = counters_in(doc) if isinstance(doc, dict) else []
        else:
            counters = list(file_facts(path).counters)
        if counters:
            found.append((step_file.path, counters))
    return found


def _optimizer_counter_step(found: Resolved) -> StepRecord | None:
    """The optimizer's own step counter (Adam's per-parameter ``step``) saved beside the model.

    accelerate records no optimizer step of its own: the ``step`` in ``random_states_<i>.pkl``
    counts micro-batches through ``accumulate()`` and restarts at the end of every epoch. The
    largest counter is taken (a parameter frozen for a while counts fewer steps). Nested
    models (``pytorch_model_fsdp_0/``) keep it in ``optimizer_0/`` (DCP); unnested ones (a
    ``FULL_STATE_DICT`` file, ``model.safetensors``) in ``optimizer.bin``.
    """
    path, location = found.path, found.model
    if location.trainer is not None and location.optimizer is not None:
        if detect_format(location.optimizer) is None:
            raise StepWaiting(f"{location.optimizer.name}/ is not complete yet (still being written?)")
        with contextlib.closing(open_checkpoint(location.optimizer)) as reader:
            counters = [key for key, spec in reader.specs().items() if key.endswith(".step") and spec.shape == ()]
            values = [float(reader.read(key, Box((), ())).item()) for key in counters]
        where = f"{location.optimizer.name}/"
    elif path.is_dir() and (path / ACCELERATE_OPTIMIZER).is_file():
        values = optimizer_step_counters(path / ACCELERATE_OPTIMIZER)
        where = ACCELERATE_OPTIMIZER
    else:
        return None
    steps = [int(v) for v in values if v >= 0 and v == int(v)]
    return StepRecord(max(steps), f"optimizer step counter in {where}") if steps else None


_REMEMBERED: dict[tuple[str, str, int, int], Any] = {}


def _remembered(what: str, file: Location, compute: Callable[[], T]) -> T:
    """``compute()`` for ``file``, remembered while its size and mtime stay (discovery runs again and again)."""
    stat = file.stat()
    key = (what, str(file), stat.st_size, stat.st_mtime_ns)
    if key not in _REMEMBERED:
        _REMEMBERED[key] = compute()
    return cast(T, _REMEMBERED[key])


def _steps_of_optimizers(found: Resolved) -> StepRecord | None:
    """Each optimizer's own step (its largest per-parameter ``step``) saved in a single file beside
    a ``global_step`` that counts them all: Lightning under manual optimization with two
    optimizers (a GAN) counts every ``optimizer.step()`` of either, twice the updates each network
    got. Taken only where every optimizer took the same number of steps."""
    model = found.model.path
    if found.format is None or found.format.name != "torch" or not model.is_file():
        return None
    facts = file_facts(model)
    total = next((c.value for c in facts.counters if c.path == "global_step"), None)
    if total is None:
        return None
    steps = _remembered("optimizers", model, lambda: [int(max(v)) for v in optimizer_steps(model)
                                                      if v and max(v) == int(max(v))])
    if len(steps) < 2 or len(set(steps)) != 1 or steps[0] == total:
        return None
    return StepRecord(steps[0], "the optimizers' own step counters in the file (global_step counts the steps of "
                                "every optimizer)")


def _safetensors_metadata(path: Location) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (a folder's first file)."""
    from .formats.safetensors.header import read_metadata

    def read() -> dict[str, str]:
        try:
            return read_metadata(file)
        except EmaCkptError:
            return {}

    try:
        file = path if not path.is_dir() else min(
            (p for p in path.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith(".")),
            key=lambda p: p.name)
        return _remembered("metadata", file, read)
    except (OSError, ValueError):
        return {}


def _component_counters(found: Resolved, *, headers: bool = True, files: bool = True
                        ) -> list[tuple[str, list[SeenCounter]]]:
    """(where, counters) of a component's own records: a file's counters (``files``), a
    safetensors header's (``headers``)."""
    fmt, model = found.format, found.model.path
    if fmt is None:
        return []
    if fmt.name == "torch" and files and model.is_file() and has_torch_suffix(model):
        counters = list(file_facts(model).counters)
        return [("the file", counters)] if counters else []
    if fmt.name == "safetensors" and headers:
        counters = counters_in(_safetensors_metadata(model))
        return [("its safetensors metadata", counters)] if counters else []
    return []


def _format_step(found: Resolved) -> StepRecord | None:
    """The step the format itself records (DeepSpeed ``global_steps``, a file's ``global_step``)."""
    fmt = found.format
    if fmt is None or not fmt.records_step:
        return None
    if fmt.step_record is not None:
        record = fmt.step_record(found.model.path)
        return StepRecord(*record) if record is not None else None
    step = fmt.step_of(found.model.path)  # cheap: no reader is built, no tensor opened
    return StepRecord(int(step), fmt.step_label or f"{fmt.name} record") if step is not None else None


def _owner(path: Location) -> Location:
    """The trainer folder around a nested model folder given by itself, else ``path``."""
    if any(n.pattern.match(path.name) for n in NESTED_MODELS) and locate_model(path.parent).path == path:
        return path.parent
    return path


def _relative(path: Location, root: Location | None) -> str:
    if root is not None:
        try:
            rel = path.resolve().relative_to(root.resolve())  # type: ignore[arg-type]
        except ValueError:
            rel = None
        if rel is not None and str(rel) not in ("", "."):
            return rel.as_posix()
    return path.name


def _names(owner: Location, root: Location | None) -> list[str]:
    """The names from the checkpoint up to (not including) the sequence root."""
    names = [owner.name]
    if root is not None:
        resolved_root, parent = root.resolve(), owner.parent
        while parent.resolve() != resolved_root and parent.resolve() in owner.resolve().parents and \
                len(names) < 8 and parent != parent.parent:
            names.append(parent.name)
            parent = parent.parent
    return names


def _seen(records: Sequence[tuple[str, Sequence[SeenCounter]]]) -> tuple[SeenCounter, ...]:
    return tuple(c for _, counters in records for c in counters)


def _labelled(where: str, counter: SeenCounter) -> str:
    return f"{counter.path} in {where}" if where != TRAINER_STATE or counter.path != "global_step" \
        else f"{TRAINER_STATE} global_step"


def step_record(
    path: str | Location | Resolved,
    step_regex: str | None = None,
    *,
    root: Location | None = None,
    step_from: str | None = None,
    components: Sequence[Resolved] = (),
) -> StepRecord | None:
    """The training step of the checkpoint at ``path`` and where it came from, or None.

    ``root``: the sequence root it was found in (names and ``step_regex`` are read on the path
    from there). ``components``: the checkpoint's model-bearing parts, when discovery found
    them (else the checkpoint resolved). Given a :class:`~ema_ckpt.formats.Resolved`
    checkpoint, its model folder and format are taken as they are.

    Raises:
        StepWaiting: the record that holds the step is still being written.
        StepUnknown: a record counts only epochs, ``step_from`` names no record, or the names
            say saves, not steps (accelerate's ``checkpoint_<i>``).

    Example:
        >>> import json, tempfile; from pathlib import Path
        >>> save = Path(tempfile.mkdtemp()) / "checkpoint-500"; save.mkdir()
        >>> _ = (save / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
        >>> record = step_record(save)
        >>> record.step, record.source
        (500, 'trainer_state.json global_step')
    """
    given = path if isinstance(path, Resolved) else None
    path = path.path if isinstance(path, Resolved) else as_path(path)
    owner = _owner(path)
    kind = "folder" if owner.is_dir() else "file"
    if step_regex is not None:
        for where in [_relative(owner, root), *(_relative(c.path, root) for c in components)]:
            step = step_from_name(where, step_regex)
            if step is not None:
                what = f"{kind} name " if "/" not in where else "path "
                return StepRecord(step, Note(f"{{step_regex}} on the {what}", mentions=("step_regex",)) + where)
    found = given if given is not None and owner == given.path else resolve(owner)
    parts = list(components) or [found]
    # records read in order, each only when the ones before place nothing: a safetensors header is
    # a request per file on object storage, a torch file's counters come with its detection
    records = _step_file_counters(owner) if owner.is_dir() else []
    records += [r for part in parts for r in _component_counters(part, headers=step_from is not None)]
    if step_from is not None:
        return _named_record(owner, records, parts, step_from)
    seen = _seen(records)
    for where, counters in records:
        if any(where == f.path for f in STEP_FILES):
            best = best_step(list(counters))
            if best is not None:
                return StepRecord(best.value, _labelled(where, best), counters=seen, taken=best.path)
    # records read by code, after the step files: the optimizer's counter, the format's own
    sources: list[tuple[Callable[[Resolved], StepRecord | None], Resolved]] = [(_optimizer_counter_step, found)]
    for source, part in sources + [(s, p) for p in parts for s in (_steps_of_optimizers, _format_step)]:
        try:
            record = source(part)
        except EmaCkptError:
            raise
        except OSError:
            record = None
        if record is not None:
            taken = next((c.path for c in seen if c.value == record.step and c.path in str(record.source)), None)
            return StepRecord(record.step, record.source, counters=seen, taken=taken)
    records += [r for part in parts for r in _component_counters(part, headers=True, files=False)]
    seen = _seen(records)
    for where, counters in records:
        best = best_step(list(counters))
        if best is not None:
            return StepRecord(best.value, _labelled(where, best), counters=seen, taken=best.path)
    return _step_from_names(owner, root, found, seen, kind)


def _named_record(owner: Location, records: list[tuple[str, list[SeenCounter]]], parts: Sequence[Resolved],
                  step_from: str) -> StepRecord:
    """The record ``step_from`` names (or the DeepSpeed/optimizer record it names)."""
    for where, counters in records:
        chosen = counter_named(counters, step_from)
        if chosen is not None:
            return StepRecord(chosen.value, Note(f"{chosen.path} in {where} ({{step_from}})",
                                                 mentions=("step_from",)), chosen.counts, _seen(records),
                              chosen.path)
    for part in parts:
        record = _format_step(part) if part.format is not None else None
        if record is not None and step_from.lower() in record.source.lower():
            return record
    names = sorted({c.path for _, counters in records for c in counters})
    raise StepUnknown(Note(f"no record {step_from!r} ({{step_from}})", mentions=("step_from",))
                      + (f"; it records {', '.join(names)}" if names else "; it records no counter"))


def _step_from_names(owner: Location, root: Location | None, found: Resolved, seen: tuple[SeenCounter, ...],
                     kind: str) -> StepRecord | None:
    epochs = [c for c in seen if c.counts == EPOCHS]
    names = _names(owner, root)
    for depth, name in enumerate(names):
        number = step_in_name(name)
        if number is None:
            continue
        where = f"{kind} name" if depth == 0 else f"name of {name}/"
        if number.counts == EPOCHS or (number.counts in (None, SAVES) and any(e.value == number.value
                                                                              for e in epochs)):
            raise StepUnknown(_epochs_only(f"the {where} ({number.label or 'number'} {number.value})"))
        if depth == 0 and number.counts == SAVES and _accelerate_folder(found):
            raise StepUnknown(
                f"no step record ({ACCELERATE.trainer}'s {owner.name} counts saves, not steps); "
                + Note("pass {step_regex} to take the name as the step", mentions=("step_regex",)))
        return StepRecord(number.value, where, counters=seen)
    if epochs:
        raise StepUnknown(_epochs_only(f"{epochs[0].path} = {epochs[0].value}"))
    return None


def _epochs_only(where: str) -> str:
    return Note(f"only epochs are recorded ({where}); the decay counts optimizer steps: pass "
                "{step_from}=epoch to count epochs instead, or {step_regex}",
                mentions=("step_from", "step_regex"))


def _accelerate_folder(path: Location | Resolved) -> bool:
    """A folder accelerate's ``save_state`` wrote with ``automatic_checkpoint_naming``: its name
    counts saves, not steps."""
    found = resolve(path)
    path = found.path
    if found.model.trainer == "accelerate":
        return True
    try:
        return bool(path.is_dir() and ACCELERATE.folder.match(path.name)
                    and any(p.name.startswith("random_states_") for p in path.iterdir()))
    except OSError:
        return False


def describe_counters(counters: Sequence[SeenCounter]) -> list[dict[str, object]]:
    """Every counter seen, for ``inspect`` and ``--json``: path, value, what it counts."""
    return [{"record": c.path, "value": c.value, "counts": c.counts} for c in counters]


__all__ = [
    "StepRecord",
    "StepUnknown",
    "StepWaiting",
    "describe_counters",
    "name_stem",
    "step_from_name",
    "step_in_name",
    "step_record",
]
