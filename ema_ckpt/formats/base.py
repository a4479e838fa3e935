"""The reader protocol every checkpoint format implements, and the format registry.

Formats are detected by marker files (``.metadata`` for DCP, ``latest`` or
``*_optim_states.pt`` for DeepSpeed, ``*.safetensors`` for Hugging Face), never by
trying to load data. Each format module registers itself with :func:`register_format`;
:func:`open_checkpoint` picks the first format whose ``detect`` accepts the path.

Example:
    >>> from ema_ckpt.formats import open_checkpoint     # doctest: +SKIP
    >>> with open_checkpoint("ckpts/step_1000") as reader:  # doctest: +SKIP
    ...     for key, spec in reader.specs().items():
    ...         print(key, spec.shape, reader.layout(key))
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..dtypes import name_of
from ..errors import CheckpointNotFoundError
from ..layout import Box, TensorSpec

if TYPE_CHECKING:
    import torch


@runtime_checkable
class CheckpointReader(Protocol):
    """Read access to one checkpoint, key by key and box by box.

    Why a protocol: the engine, ``inspect``, ``consolidate`` and ``reshard`` must work on
    any format without knowing how it is stored. A reader answers from metadata alone
    (``specs``, ``layout``) and reads any box of a tensor on demand (``read``), so memory
    stays bounded by the box asked for, never by the model.
    """

    path: Path
    format_name: str
    step: int | None
    """The training step recorded inside the checkpoint, when the format records one."""

    def specs(self) -> Mapping[str, TensorSpec]:
        """Every tensor key with its shape and dtype, from metadata alone."""
        ...

    def layout(self, key: str) -> Sequence[Box]:
        """The boxes ``key`` is stored in (zero-volume boxes omitted)."""
        ...

    def read(self, key: str, box: Box) -> torch.Tensor:
        """A new tensor holding ``box`` of ``key`` in its stored dtype."""
        ...

    def info(self) -> dict[str, Any]:
        """Format-specific facts for ``inspect`` (JSON-serialisable)."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...


@runtime_checkable
class ByteRangeReader(Protocol):
    """A reader that can say where a tensor's bytes lie, for copies that never touch torch."""

    path: Path

    def stored(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, canonical dtype name)} without importing torch."""
        ...

    def byte_ranges(self, key: str) -> list[tuple[str, int, int]] | None:
        """``key``'s bytes in row-major order as (file, offset, length), or None if not plain runs."""
        ...

    def open_data(self, file: str) -> int:
        """A read-only descriptor of a data file named by :meth:`byte_ranges` (the reader closes it)."""
        ...


def stored_tensors(reader: CheckpointReader) -> Mapping[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype name)}: without torch where the reader allows it.

    Example:
        >>> stored_tensors(reader)["fc.weight"]   # doctest: +SKIP
        ((16, 8), 'float32')
    """
    if isinstance(reader, ByteRangeReader):
        return reader.stored()
    return {key: (spec.shape, name_of(spec.dtype)) for key, spec in reader.specs().items()}


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """One registered format: how to recognise it and how to open it.

    ``incomplete`` answers whether a directory looks like a checkpoint of this format
    that is still being written (a reason string) or not (None); discovery skips those.
    ``records_step`` says the reader's ``step`` comes from inside the checkpoint (DeepSpeed's
    ``global_steps``) and beats the step parsed from the directory name.
    """

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], CheckpointReader]
    incomplete: Callable[[Path], str | None] = lambda _path: None
    records_step: bool = False
    step_label: str | None = None
    """How ``inspect`` names the record the step comes from (``DeepSpeed global_steps``)."""


_REGISTRY: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add a format to the registry (later registrations are tried after earlier ones)."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def registered_formats() -> Mapping[str, CheckpointFormat]:
    """The registry, in detection order."""
    return dict(_REGISTRY)


@dataclass(frozen=True, slots=True)
class NestedModel:
    """A trainer's checkpoint folder whose model weights sit in a subdirectory of their own.

    ``pattern`` matches the subdirectory's name; ``trainer`` names who writes it. accelerate's
    ``save_state`` (and so the Hugging Face Trainer) writes an FSDP model as
    ``checkpoint_<i>/pytorch_model_fsdp_0/`` (a DCP checkpoint holding ``{"model": …}``) beside
    ``optimizer_0/``; NeMo 2 writes Megatron's ``torch_dist`` checkpoint into ``weights/``.
    ``optimizer`` names the sibling folder holding that model's optimizer state, if any;
    where the subdirectory's name alone is common, ``beside`` names a sibling that must exist
    too and ``marker`` a file the nested folder must hold.
    """

    trainer: str
    pattern: re.Pattern[str]
    optimizer: str | None = None
    beside: str | None = None
    marker: str | None = None


NESTED_MODELS: tuple[NestedModel, ...] = (
    NestedModel("accelerate", re.compile(r"^pytorch_model_fsdp_0$"), optimizer="optimizer_0"),
    NestedModel("NeMo", re.compile(r"^weights$"), beside="context", marker="metadata.json"),
)


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """Where a checkpoint path's model weights are: the path itself, or a nested folder."""

    path: Path
    """The folder or file the reader opens."""
    trainer: str | None = None
    """Who nests the model (``accelerate``, ``NeMo``), when it is nested."""
    optimizer: Path | None = None
    """The nested model's optimizer folder, when the trainer writes one."""
    others: tuple[str, ...] = ()
    """Further model folders of the same trainer left aside (accelerate's second model, …)."""


def _own_format(path: Path) -> CheckpointFormat | None:
    earlier: list[CheckpointFormat] = []
    for fmt in _REGISTRY.values():
        if fmt.detect(path):
            # A save of a format detected earlier still in progress here makes the folder
            # incomplete: the Hugging Face Trainer writes model.safetensors before its DeepSpeed tag.
            if any(other.incomplete(path) for other in earlier):
                return None
            return fmt
        earlier.append(fmt)
    return None


def locate_model(path: str | Path) -> ModelLocation:
    """The folder holding ``path``'s model weights: ``path`` itself unless a trainer nests them.

    Only names are looked at, and the nested folder must itself be a checkpoint of a known
    format. A folder that is a checkpoint of its own is never looked into.

    Example:
        >>> locate_model("ckpts/checkpoints/checkpoint_3").path  # doctest: +SKIP
        PosixPath('ckpts/checkpoints/checkpoint_3/pytorch_model_fsdp_0')
    """
    path = Path(path)
    if not path.is_dir() or _own_format(path) is not None:
        return ModelLocation(path)
    try:
        children = sorted(c.name for c in path.iterdir() if c.is_dir())
    except OSError:
        return ModelLocation(path)
    for nested in NESTED_MODELS:
        names = [n for n in children if nested.pattern.match(n)]
        if not names or (nested.beside is not None and nested.beside not in children):
            continue
        if nested.marker is not None and not (path / names[0] / nested.marker).is_file():
            continue
        if _own_format(path / names[0]) is not None:
            others = tuple(n for n in children if n != names[0] and n.startswith("pytorch_model_fsdp_"))
            optimizer = path / nested.optimizer if nested.optimizer else None
            optimizer = optimizer if optimizer is not None and optimizer.is_dir() else None
            return ModelLocation(path / names[0], nested.trainer, optimizer, others)
    return ModelLocation(path)


def nested_incomplete(path: str | Path) -> str | None:
    """Why a trainer folder's nested model folder is still being written, or None."""
    path = Path(path)
    if not path.is_dir() or _own_format(path) is not None:
        return None
    for nested in NESTED_MODELS:
        if nested.beside is not None and not (path / nested.beside).is_dir():
            continue
        names = [c.name for c in path.iterdir() if nested.pattern.match(c.name) and c.is_dir()]
        for name in sorted(names):
            for fmt in _REGISTRY.values():
                reason = fmt.incomplete(path / name)
                if reason:
                    return f"{name}/: {reason}"
    return None


TRAINER_STATE = "trainer_state.json"


def trainer_state_step(path: str | Path) -> int | None:
    """``global_step`` of the Hugging Face Trainer's ``trainer_state.json`` in ``path``, or None.

    A bonus over the folder name: a missing or unreadable file is no error.
    """
    try:
        doc = json.loads((Path(path) / TRAINER_STATE).read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    step = doc.get("global_step") if isinstance(doc, dict) else None
    return step if type(step) is int and step >= 0 else None


def detect_format(path: str | Path) -> CheckpointFormat | None:
    """The format whose marker files ``path`` (or the model folder a trainer nests in it) holds, or None."""
    return _own_format(locate_model(path).path)


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """Open the checkpoint at ``path`` with the reader of its format.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no known checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(path, "no such file or directory")
    location = locate_model(path)
    fmt = _own_format(location.path)
    if fmt is None:
        for candidate in _REGISTRY.values():
            reason = candidate.incomplete(path)
            if reason:
                raise CheckpointNotFoundError(path, reason)
        reason = nested_incomplete(path)
        if reason:
            raise CheckpointNotFoundError(path, reason)
        names = ", ".join(_REGISTRY)
        raise CheckpointNotFoundError(path, f"not a checkpoint of any known format ({names})")
    return fmt.open(location.path)
