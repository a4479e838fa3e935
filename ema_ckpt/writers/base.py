"""The output contract: every output format (DCP, safetensors, HF sharded, torch file) is an
:class:`OutputWriter`, and the engine's one loop feeds them all.

A writer is made for one output and works in three phases:

1. :meth:`OutputWriter.plan` (every worker, the same answer): cut each tensor into regions and
   name the file each region goes to. Files are what workers share out, so a plan that
   depends only on the layout gives the same bytes for any number of workers.
2. :meth:`OutputWriter.write` (each worker, its own files, regions in plan order), then
   :meth:`OutputWriter.close`, which returns what this worker wrote (picklable).
3. :meth:`OutputWriter.finish` (the coordinator, once every worker closed): the metadata or
   index that names the files, written last.

Formats register with :func:`register_output`; :func:`output_format` picks one by the
output's path (``.safetensors`` → one file, ``.pt`` → a torch file, a directory → HF sharded)
or by name (``dcp``).

Example:
    >>> output_format_for("model.safetensors").name, output_format_for("out/").name
    ('safetensors', 'hf-sharded')
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..layout import Box

if TYPE_CHECKING:
    import torch

    from ..formats.base import CheckpointReader


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One tensor of an output: its source key, its name in the output, shape and dtypes.

    ``dtype`` is what the output stores and ``stored_dtype`` what the source stores
    (canonical names such as ``"bfloat16"``); they differ when the output casts.
    """

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    stored_dtype: str


@dataclass(frozen=True, slots=True)
class PlannedRegion:
    """One box of one key and the output file it goes to.

    ``nbytes`` is what the region costs to read; ``raw`` marks a region the writer copies
    as stored bytes (:meth:`OutputWriter.copy_stored`), never through a tensor.
    """

    key: str
    box: Box
    file: str
    nbytes: int
    raw: bool = False


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One file of a finished output, with its size and CRC-32 (when the format computes one)."""

    name: str
    size: int
    crc32: int | None = None


class OutputWriter(abc.ABC):
    """Writes one output into ``staging`` (see the module docstring for the phases).

    ``single_file`` outputs are one file, ``staging / final_name``, moved onto the output
    path when published; the others are a directory, published whole.
    """

    name: str = ""
    single_file: bool = False
    final: Path | None = None
    """The output's published path, for messages (set by the runner)."""

    def __init__(self, staging: Path, final_name: str) -> None:
        self.staging = staging
        self.final_name = final_name

    @property
    def shown_path(self) -> Path:
        """The path errors name: the published output's, else the staged file's."""
        return self.final if self.final is not None else self.staging / self.final_name

    @abc.abstractmethod
    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        """Every region of every tensor, in write order, each naming its file.

        ``source`` is the checkpoint whose layout the regions follow (reads stay within
        its stored chunks where the format allows). Deterministic; no data is read.
        """

    @abc.abstractmethod
    def write(self, region: PlannedRegion, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (exactly ``region.box``, in the output dtype)."""

    def copy_stored(self, region: PlannedRegion, source: CheckpointReader) -> None:
        """Copy a ``raw`` region's stored bytes from ``source`` (only formats that plan raw regions)."""
        raise NotImplementedError(f"{type(self).__name__} plans no raw regions")

    @abc.abstractmethod
    def close(self) -> Any:
        """Flush and close this worker's files; what it wrote, for :meth:`finish` (picklable)."""

    @abc.abstractmethod
    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        """Coordinator: write what names the files (metadata, index), given every worker's state."""

    def abort(self) -> None:
        """Close open files after a failure (the staging directory is removed by the caller)."""
        return None


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """One registered output format: how to recognise its path and how to make its writer."""

    name: str
    make: Callable[..., OutputWriter]
    suffixes: tuple[str, ...] = ()
    """Output paths ending so are this format (``.safetensors``); none: chosen by name only."""
    is_default: bool = False
    """The format of an output path no suffix claims (a directory)."""
    single_file: bool = False
    """The output is one file (else a directory)."""
    settings: tuple[str, ...] = ()
    """The keyword settings ``make`` takes beyond the staging path and name (``max_shard_bytes``)."""


_OUTPUTS: dict[str, OutputFormat] = {}


def register_output(fmt: OutputFormat) -> OutputFormat:
    """Add an output format to the registry (formats call this on import)."""
    _OUTPUTS[fmt.name] = fmt
    return fmt


def registered_outputs() -> Mapping[str, OutputFormat]:
    """Every registered output format, by name."""
    _load_builtin()
    return dict(_OUTPUTS)


def output_format(name: str) -> OutputFormat:
    """The output format called ``name``."""
    _load_builtin()
    return _OUTPUTS[name]


def output_format_for(path: str | Path) -> OutputFormat:
    """The output format an output path asks for, by its suffix."""
    _load_builtin()
    suffix = Path(path).suffix.lower()
    for fmt in _OUTPUTS.values():
        if suffix in fmt.suffixes:
            return fmt
    return next(fmt for fmt in _OUTPUTS.values() if fmt.is_default)


def _load_builtin() -> None:
    from . import outputs  # noqa: F401  (registers the built-in output formats)
