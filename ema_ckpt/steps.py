"""The training step of a checkpoint, and the record it was read from.

A checkpoint's step comes from the first record that holds one (:data:`STEP_SOURCES`): the
Hugging Face Trainer's ``trainer_state.json`` ``global_step``, the optimizer's own step counter
saved beside the model (accelerate), the format's own record (DeepSpeed ``global_steps``;
a single file's ``global_step``, ``step``, ``iteration``, ``iter_num``), and only then the
name: ``step_1000``, ``step-1000``, ``global_step1000``, ``checkpoint-1000``, ``iter_0001000``,
``epoch=3-step=1000``, ``ckpt_000100.pt`` or a bare ``1000``. A single file that records only
its ``epoch`` counts epochs, and its step says so (``checkpoint-12.pth.tar`` of timm, MAE's
``checkpoint-12.pth``). ``step_regex`` overrides every record and name pattern.

Example:
    >>> step_from_name("epoch=3-step=1000")
    1000
    >>> step_from_name("ckpt_000100.pt")
    100
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import EmaCkptError, Note, OptionError
from .formats import Resolved, detect_format, locate_model, open_checkpoint, resolve
from .formats.base import TRAINER_STATE, trainer_state_step
from .formats.resolve import NESTED_MODELS
from .formats.torch_file import file_facts, has_torch_suffix
from .formats.torch_file.optimizer import optimizer_step_counters
from .layout import Box
from .storage import Location, as_path, local_file

_STEP_PATTERNS = (
    re.compile(r"(?:^|[^A-Za-z])step[_=-]?(\d+)"),
    re.compile(r"^(?:checkpoint|ckpt|model|weights)[_-]?(\d+)$"),
    re.compile(r"^iter[_-]?(\d+)$"),
    re.compile(r"^(\d+)$"),
)
_FILE_SUFFIXES = (".pth.tar", ".safetensors", ".ckpt", ".pth", ".pt", ".bin", ".tar")


def name_stem(name: str) -> str:
    """A checkpoint's name without a file suffix: ``checkpoint-12.pth.tar`` → ``checkpoint-12``."""
    lower = name.lower()
    for suffix in _FILE_SUFFIXES:
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def step_from_name(name: str, step_regex: str | None = None) -> int | None:
    """The step a checkpoint's name encodes (a folder, or a file without its suffix), or None.

    ``step_regex`` must contain one group (or a group named ``step``) matching digits; it is
    searched in the whole name.
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
    stem = name_stem(name)
    for pattern in _STEP_PATTERNS:
        match = pattern.search(stem)
        if match:
            return int(match.group(1))
    return None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A checkpoint's training step and the record it was read from."""

    step: int
    source: str


class StepUnknown(Exception):
    """A step source that sees its record still being written: the checkpoint waits (a note)."""


def _trainer_state_step(found: Resolved) -> StepRecord | None:
    """The Hugging Face Trainer's ``trainer_state.json`` ``global_step`` (optimizer steps)."""
    path = found.path
    if not path.is_dir():
        return None
    step = trainer_state_step(path)
    return StepRecord(step, f"{TRAINER_STATE} global_step") if step is not None else None


ACCELERATE_OPTIMIZER = "optimizer.bin"
"""What accelerate's ``save_state`` writes the (first) optimizer's state to, beside unnested weights."""
_ACCELERATE_FOLDER = re.compile(r"^checkpoint_\d+$")


def accelerate_folder(path: Location | Resolved) -> bool:
    """A folder accelerate's ``save_state`` wrote with ``automatic_checkpoint_naming``: its name
    counts saves, not steps."""
    found = resolve(path)
    path = found.path
    if found.model.trainer == "accelerate":
        return True
    return bool(path.is_dir() and _ACCELERATE_FOLDER.match(path.name)
                and any(p.name.startswith("random_states_") for p in path.iterdir()))


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
            raise StepUnknown(f"{location.optimizer.name}/ is not complete yet (still being written?)")
        with contextlib.closing(open_checkpoint(location.optimizer)) as reader:
            counters = [key for key, spec in reader.specs().items() if key.endswith(".step") and spec.shape == ()]
            values = [float(reader.read(key, Box((), ())).item()) for key in counters]
        where = f"{location.optimizer.name}/"
    elif location.trainer is None and path.is_dir() and (path / ACCELERATE_OPTIMIZER).is_file():
        local = local_file(path / ACCELERATE_OPTIMIZER)  # a torch file is read from a local disk only
        values = optimizer_step_counters(local) if local is not None else []
        where = ACCELERATE_OPTIMIZER
    else:
        return None
    steps = [int(v) for v in values if v >= 0 and v == int(v)]
    return StepRecord(max(steps), f"optimizer step counter in {where}") if steps else None


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


STEP_SOURCES: tuple[Callable[[Resolved], StepRecord | None], ...] = (
    _trainer_state_step,
    _optimizer_counter_step,
    _format_step,
)
"""Where a checkpoint's step is looked for, in order; the name comes after these."""

EPOCHS = "counts epochs, not optimizer steps"


def _owner(path: Location) -> Location:
    """The trainer folder around a nested model folder given by itself, else ``path``."""
    if any(n.pattern.match(path.name) for n in NESTED_MODELS) and locate_model(path.parent).path == path:
        return path.parent
    return path


def _file_epoch(path: Location) -> int | None:
    """A single file's top-level ``epoch`` (None for folders and other files)."""
    local = local_file(path)  # a torch file is read from a local disk only
    if local is None or local.is_dir() or not has_torch_suffix(local):
        return None
    return file_facts(local).epoch


def step_record(path: str | Location | Resolved, step_regex: str | None = None) -> StepRecord | None:
    """The training step of the checkpoint at ``path`` and where it came from, or None.

    Given a :class:`~ema_ckpt.formats.Resolved` checkpoint, its model folder and format are
    taken as they are (nothing is detected again).

    ``step_regex``, when given and matching, wins over every record: the user said so.

    Raises:
        StepUnknown: the record that holds the step is still being written, or a name that
            counts saves is all there is.

    Example:
        >>> step_record("out/checkpoint-500")  # doctest: +SKIP
        StepRecord(step=500, source='trainer_state.json global_step')
    """
    given = path if isinstance(path, Resolved) else None
    path = path.path if isinstance(path, Resolved) else as_path(path)
    owner = _owner(path)
    kind = "folder" if owner.is_dir() else "file"
    if step_regex is not None:
        step = step_from_name(owner.name, step_regex)
        if step is not None:
            return StepRecord(step, Note(f"{{step_regex}} on the {kind} name ", mentions=("step_regex",))
                              + owner.name)
    found = given if given is not None and owner == given.path else resolve(owner)
    fmt = found.format
    if fmt is not None:
        for source in STEP_SOURCES:
            try:
                record = source(found)
            except EmaCkptError:
                raise
            except OSError:
                record = None
            if record is not None:
                return record
        if accelerate_folder(found):
            raise StepUnknown(
                f"no step record (accelerate's {owner.name} counts saves, not steps); "
                + Note("pass {step_regex} to take the name as the step", mentions=("step_regex",))
            )
    step = step_from_name(owner.name)
    epoch = _file_epoch(owner) if fmt is not None else None
    if epoch is not None and step in (None, epoch):  # checkpoint-12.pth.tar holding epoch 12: epochs
        return StepRecord(epoch, f"epoch in the file ({EPOCHS})")
    return StepRecord(step, f"{kind} name") if step is not None else None


__all__ = [
    "EPOCHS",
    "STEP_SOURCES",
    "StepRecord",
    "StepUnknown",
    "accelerate_folder",
    "name_stem",
    "step_from_name",
    "step_record",
]
