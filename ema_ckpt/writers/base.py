"""The output contract: every output format is an :class:`OutputWriter`, fed by the engine's loop.

A writer works in three phases: :meth:`~OutputWriter.plan` (every worker, the same regions and
files, so the bytes do not depend on the number of workers); :meth:`~OutputWriter.write` (each
worker, its own files) then :meth:`~OutputWriter.close`; :meth:`~OutputWriter.finish` (the
coordinator: the metadata or index that names the files, written last).

Example:
    >>> choose_output_format("model.safetensors").name, choose_output_format("out/").name
    ('safetensors', 'hf-sharded')
    >>> choose_output_format("model.safetensor")
    Traceback (most recent call last):
    ...
    ema_ckpt.errors.OptionError: out model.safetensor: unknown output suffix .safetensor (did you mean ...
"""

from __future__ import annotations

import abc
import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import OptionError, OutputError
from ..formats.options import DEFAULT_READ, ReadOptions
from ..layout import Box
from ..storage import Location, as_path, replace_file

if TYPE_CHECKING:
    import torch

    from ..formats.base import CarriedFile, CheckpointReader


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One tensor of an output: its source key, its name in the output, shape, the dtype the
    output stores and the one the source stores (``"bfloat16"``)."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    stored_dtype: str
    copied: bool = False
    """Taken from one source as stored, never averaged (:data:`ema_ckpt.selection.NON_WEIGHT_BUFFERS`)."""


@dataclass(frozen=True, slots=True)
class PlannedRegion:
    """One box of one key, the output file it goes to and its bytes to read; ``raw``: copied as
    stored bytes (:meth:`OutputWriter.copy_stored`)."""

    key: str
    box: Box
    file: str
    nbytes: int
    raw: bool = False


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One file of a finished output, its size and CRC-32; ``role``: ``"data"``, ``"index"``
    (names the others) or ``"carried"`` (a source's ``config.json``)."""

    name: str
    size: int
    crc32: int | None = None
    role: str = "data"


class OutputWriter(abc.ABC):
    """Writes one output into ``staging``: one file ``staging / final_name`` (``single_file``),
    else a directory."""

    name: str = ""
    single_file: bool = False
    final: Location | None = None
    """The output's published path, for messages (set by the runner)."""
    file_tag: str | None = None
    """A tag the data files' names carry (object storage: each upload is a new generation)."""
    in_directory: bool = False
    """A one-file output inside a directory of its own, carried files beside it."""
    may_copy_stored: bool = True
    """Whether regions may be planned ``raw``: False for a computed output (a fold or a sum)."""

    def __init__(self, staging: Path, final_name: str) -> None:
        self.staging = staging
        self.final_name = final_name
        self.carried: list[CarriedFile] = []
        self.carried_entries: dict[str, bytes] = {}
        self.carried_read = DEFAULT_READ

    def carry(self, files: Sequence[CarriedFile], entries: Mapping[str, bytes] | None = None,
              read: ReadOptions = DEFAULT_READ) -> None:
        """Keep a source's files (``config.json``) and non-tensor entries (``_extra_state``) in
        this output, where its format can hold them; written in :meth:`finish`. ``read``: how the
        source was read (a carried pickle is judged as the source's was)."""
        self.carried = list(files)
        self.carried_entries = dict(entries or {})
        self.carried_read = read

    def write_carried(self) -> list[WrittenFile]:
        """Write the carried files into staging (a lone file has nowhere to keep them)."""
        from .._crc import crc32

        if self.single_file and not self.in_directory:
            return []
        written = []
        for file in self.carried:
            try:
                replace_file(self.staging / file.name, file.data)
            except OSError as err:
                raise OutputError(f"{self.staging / file.name}: write failed ({err.strerror})") from None
            written.append(WrittenFile(file.name, len(file.data), crc32(file.data), role="carried"))
        return written

    @property
    def shown_path(self) -> Location:
        """The path errors name: the published output's, else the staged file's."""
        return self.final if self.final is not None else self.staging / self.final_name

    @abc.abstractmethod
    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        """Every region of every tensor, in write order, following ``source``'s layout; no data read."""

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

    def own_files(self, state: Any) -> list[str]:
        """The data files this worker wrote, from its :meth:`close` state (names in staging)."""
        return []

    def owns(self, name: str) -> bool:
        """A file of this name in the output's place was written by an earlier output of this format."""
        return False

    def index_files(self) -> list[str]:
        """Files :meth:`finish` writes that name the data files but are not in its list (DCP's
        ``.metadata``): published after the data."""
        return []


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """One registered output format: the path suffixes it claims, whether it is the directory
    default, and the keyword ``settings`` its ``make`` takes (``max_shard_bytes``)."""

    name: str
    make: Callable[..., OutputWriter]
    suffixes: tuple[str, ...] = ()
    is_default: bool = False
    single_file: bool = False
    settings: tuple[str, ...] = ()


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


def output_format_for(path: str | Location) -> OutputFormat:
    """The output format an output path's suffix names, else the directory format (no checks:
    see :func:`choose_output_format`)."""
    _load_builtin()
    suffix = as_path(path).suffix.lower()
    for fmt in _OUTPUTS.values():
        if suffix in fmt.suffixes:
            return fmt
    return _directory_format()


def _directory_format() -> OutputFormat:
    return next(fmt for fmt in _OUTPUTS.values() if fmt.is_default)


def path_formats() -> list[OutputFormat]:
    """The formats an output path can ask for (``consolidate``'s ``format``): a suffix, or a directory."""
    _load_builtin()
    return [fmt for fmt in _OUTPUTS.values() if fmt.suffixes or fmt.is_default]


def ends_in_separator(path: str | Location) -> bool:
    """``path`` was written with a trailing ``/`` (a ``Path`` drops it: only a ``str`` can say so)."""
    return isinstance(path, str) and path.endswith((os.sep, os.altsep or os.sep))


def _or_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _accepted_forms(formats: Sequence[OutputFormat]) -> str:
    suffixes = [suffix for fmt in formats for suffix in fmt.suffixes]
    return (f"use a path ending in {_or_list(suffixes)}, a directory for {_directory_format().name} (an existing "
            f"one, or a path ending in /), or pass {{format=NAME}} ({', '.join(f.name for f in formats)})")


def choose_output_format(out: str | Location, format: str | None = None, *, directory: bool | None = None
                         ) -> OutputFormat:
    """The output format ``out`` asks for, or an :class:`~ema_ckpt.errors.OptionError` naming the forms accepted.

    By ``format``, a suffix a format claims, or a directory (existing, a trailing ``/``, or a
    name without a file suffix). An unknown suffix is refused, so a typo never becomes a directory.

    Example:
        >>> choose_output_format("model", "safetensors").name
        'safetensors'
    """
    formats = path_formats()
    path = as_path(out)
    directory = ends_in_separator(out) if directory is None else directory
    suffix = file_suffix(path)
    claimed = next((fmt for fmt in formats if suffix in fmt.suffixes), None)
    if format is not None:
        chosen = next((fmt for fmt in formats if fmt.name == format), None)
        if chosen is None:
            raise OptionError("format", f"must be one of {', '.join(f.name for f in formats)}, got {format!r}",
                              value=format)
        if claimed is not None and claimed is not chosen:
            raise OptionError("format", f"{format} does not match {{out}} {out} (its suffix {suffix} is "
                              f"{claimed.name})", value=format, mentions=("out",))
        if chosen.single_file and (directory or path.is_dir()):
            raise OptionError("format", f"{format} writes one file, but {{out}} {out} is a directory",
                              value=format, mentions=("out",))
        return chosen
    if directory:
        if claimed is not None:
            raise OptionError("out", f"{out}: a directory whose name ends in {suffix} ({claimed.name}) would be "
                              f"mistaken for one file; {_accepted_forms(formats)}", value=out, mentions=("format",))
        return _directory_format()
    if claimed is not None:
        return claimed
    if path.is_dir() or not suffix:
        return _directory_format()
    known = [s for fmt in formats for s in fmt.suffixes]
    close = difflib.get_close_matches(suffix, known, n=1, cutoff=0.6)
    hint = f" (did you mean {path.with_suffix(close[0]).name}?)" if close else ""
    raise OptionError("out", f"{out}: unknown output suffix {suffix}{hint}; {_accepted_forms(formats)}", value=out,
                      mentions=("format",))


_FILE_SUFFIX = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,11}")


def file_suffix(path: Location) -> str:
    """A path's file suffix, lower case, or "" when it has none that looks like one.

    Example:
        >>> file_suffix(Path("ema.SafeTensors")), file_suffix(Path("llama-3.1-ema")), file_suffix(Path("hf_ema"))
        ('.safetensors', '', '')
    """
    suffix = path.suffix
    return suffix.lower() if _FILE_SUFFIX.fullmatch(suffix) else ""


def check_directory_output(out: str | Location, format_name: str = "dcp") -> None:
    """Refuse a directory output whose name ends in a one-file format's suffix.

    Example:
        >>> check_directory_output("ema-16")
        >>> check_directory_output("ema.safetensors")
        Traceback (most recent call last):
        ...
        ema_ckpt.errors.OptionError: out ema.safetensors: a dcp directory here would be taken for a safetensors file ...
    """
    suffix = as_path(out).suffix.lower()
    claimed = next((fmt for fmt in path_formats() if fmt.single_file and suffix in fmt.suffixes), None)
    if claimed is not None:
        raise OptionError("out", f"{out}: a {format_name} directory here would be taken for a {claimed.name} "
                          f"file (its suffix {suffix}); name it otherwise, or write one file with consolidate",
                          value=out)


def _load_builtin() -> None:
    # the built-in output formats, each registered by its format's package
    from ..formats.dcp import output as _dcp  # noqa: F401
    from ..formats.safetensors import output as _safetensors  # noqa: F401
    from ..formats.torch_file import output as _torch_file  # noqa: F401
