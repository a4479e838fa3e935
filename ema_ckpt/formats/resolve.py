"""A checkpoint path resolved once: the folder holding its model (itself, or one a trainer
nests in it), its format by marker files, why it is no checkpoint yet, and its reader.

Example:
    >>> found = resolve("ckpts/checkpoint_3")             # doctest: +SKIP
    >>> found.model.path, found.format.name                 # doctest: +SKIP
    (PosixPath('ckpts/checkpoint_3/pytorch_model_fsdp_0'), 'dcp')
    >>> reader = open_checkpoint(found)                     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..layouts import NESTED_MODELS, NestedModel
from ..storage import Location, as_path
from .base import CheckpointFormat, CheckpointReader, registered_formats
from .options import DEFAULT_READ, ReadOptions


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """Where a checkpoint path's model weights are: the path itself, or a nested folder."""

    path: Location
    """The folder or file the reader opens."""
    trainer: str | None = None
    """Who nests the model (``accelerate``, ``NeMo``), when it is nested."""
    optimizer: Location | None = None
    """The nested model's optimizer folder, when the trainer writes one."""
    others: tuple[str, ...] = ()
    """Further model folders of the same trainer left aside (accelerate's second model, …)."""


def _own_format(path: Location) -> CheckpointFormat | None:
    formats = list(registered_formats().values())
    for index, fmt in enumerate(formats):
        if fmt.detect(path):
            # A save of a format detected earlier still in progress here makes the folder
            # incomplete: the Hugging Face Trainer writes model.safetensors before its DeepSpeed tag.
            return None if any(other.incomplete(path) for other in formats[:index]) else fmt
    return None


@dataclass(frozen=True, slots=True)
class Resolved:
    """A checkpoint path resolved once: where its model weights are and their format (None:
    no known checkpoint there). Passed on instead of the path, nothing is looked for again."""

    path: Location
    model: ModelLocation
    format: CheckpointFormat | None


def resolve(path: str | Location | Resolved) -> Resolved:
    """``path`` resolved (:class:`Resolved`); one already resolved is returned as it is."""
    if isinstance(path, Resolved):
        return path
    path = as_path(path)
    return Resolved(path, *_locate(path))


def locate_model(path: str | Location | Resolved) -> ModelLocation:
    """The folder holding ``path``'s model weights: ``path`` itself unless a trainer nests them
    (by name, in a folder that is no checkpoint of its own, and itself a known checkpoint).

    Example:
        >>> locate_model("ckpts/checkpoints/checkpoint_3").path  # doctest: +SKIP
        PosixPath('ckpts/checkpoints/checkpoint_3/pytorch_model_fsdp_0')
    """
    return resolve(path).model


def _locate(path: Location) -> tuple[ModelLocation, CheckpointFormat | None]:
    """The model's location and format, each format's markers looked at once."""
    own = _own_format(path)
    if own is not None or not path.is_dir():
        return ModelLocation(path), own
    try:
        children = sorted(c.name for c in path.iterdir() if c.is_dir())
    except OSError:
        return ModelLocation(path), None
    for nested in NESTED_MODELS:
        names = [n for n in children if nested.pattern.match(n)]
        if not names or (nested.beside is not None and nested.beside not in children):
            continue
        if nested.marker is not None and not (path / names[0] / nested.marker).is_file():
            continue
        fmt = _own_format(path / names[0])
        if fmt is not None:
            others = tuple(n for n in children if n != names[0] and nested.others is not None
                           and nested.others.match(n))
            optimizer = path / nested.optimizer if nested.optimizer else None
            optimizer = optimizer if optimizer is not None and optimizer.is_dir() else None
            return ModelLocation(path / names[0], nested.trainer, optimizer, others), fmt
    return ModelLocation(path), None


def waiting_reason(path: Location) -> str | None:
    """Why ``path`` is a checkpoint still being written (itself, or the model folder a trainer
    nests in it), or None."""
    formats = list(registered_formats().values())
    reason = next((reason for fmt in formats if (reason := fmt.incomplete(path))), None)
    if reason or not path.is_dir() or any(fmt.detect(path) for fmt in formats):
        return reason  # none incomplete: a format detected is the folder's own (what _own_format finds)
    for nested in NESTED_MODELS:
        if nested.beside is not None and not (path / nested.beside).is_dir():
            continue
        for name in sorted(c.name for c in path.iterdir() if nested.pattern.match(c.name) and c.is_dir()):
            reason = next((reason for fmt in formats if (reason := fmt.incomplete(path / name))), None)
            if reason:
                return f"{name}/: {reason}"
    return None


def not_a_model_reason(path: Location) -> str | None:
    """Why ``path``, complete and of a known kind, never holds a model (``optimizer.pt``), or None."""
    return next((reason for fmt in registered_formats().values() if (reason := fmt.not_a_model(path))), None)


def detect_format(path: str | Location | Resolved) -> CheckpointFormat | None:
    """The format whose marker files ``path`` (or the model folder a trainer nests in it) holds, or None."""
    return resolve(path).format


def open_checkpoint(path: str | Location | Resolved, *, read: ReadOptions = DEFAULT_READ,
                    shared: object | None = None) -> CheckpointReader:
    """Open the checkpoint at ``path`` with the reader of its format.

    ``read``: the command's read options. ``shared``: what :meth:`CheckpointReader.share`
    returned for it in another process (the reader is rebuilt without parsing again).

    Example:
        >>> with open_checkpoint("ckpts/step_1000") as reader:      # doctest: +SKIP
        ...     key = next(iter(reader.specs()))
        ...     first_chunk = reader.read(key, reader.layout(key)[0])

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no known checkpoint.
    """
    resolved = resolve(path)
    path, location, fmt = resolved.path, resolved.model, resolved.format
    if fmt is None and not path.exists():
        raise CheckpointNotFoundError(path, "no such file or directory")
    if fmt is None:
        reason = waiting_reason(path)
        if reason:  # a folder without its marker yet holds no checkpoint; a cut file is a damaged one
            raise (CheckpointNotFoundError if path.is_dir() else CheckpointFormatError)(path, reason)
        reason = not_a_model_reason(path)
        if reason:
            raise CheckpointFormatError(path, reason)
        names = ", ".join(registered_formats())
        raise CheckpointNotFoundError(path, f"not a checkpoint of any known format ({names})")
    reopen = fmt.reopen if shared is not None else None
    reader = fmt.open(location.path, read) if reopen is None else reopen(location.path, shared, read)
    reader.read_options = read
    return reader


__all__ = ["NESTED_MODELS", "ModelLocation", "NestedModel", "Resolved", "detect_format",
           "locate_model", "not_a_model_reason", "open_checkpoint", "resolve", "waiting_reason"]
