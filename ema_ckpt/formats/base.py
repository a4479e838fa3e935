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


_REGISTRY: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add a format to the registry (later registrations are tried after earlier ones)."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def registered_formats() -> Mapping[str, CheckpointFormat]:
    """The registry, in detection order."""
    return dict(_REGISTRY)


def detect_format(path: str | Path) -> CheckpointFormat | None:
    """The format whose marker files ``path`` holds, or None."""
    path = Path(path)
    for fmt in _REGISTRY.values():
        if fmt.detect(path):
            return fmt
    return None


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """Open the checkpoint at ``path`` with the reader of its format.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no known checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(path, "no such file or directory")
    fmt = detect_format(path)
    if fmt is None:
        for candidate in _REGISTRY.values():
            reason = candidate.incomplete(path)
            if reason:
                raise CheckpointNotFoundError(path, reason)
        names = ", ".join(_REGISTRY)
        raise CheckpointNotFoundError(path, f"not a checkpoint of any known format ({names})")
    return fmt.open(path)
