"""The reader contract every checkpoint format implements, and the format registry: formats
are detected by marker files, never by loading data, in the order they registered.

Example:
    >>> from ema_ckpt.formats import open_checkpoint     # doctest: +SKIP
    >>> with open_checkpoint("ckpts/step_1000") as reader:  # doctest: +SKIP
    ...     for key, spec in reader.specs().items():
    ...         print(key, spec.shape, reader.layout(key))
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol

from ..dtypes import name_of
from ..layout import Box, TensorSpec
from ..layouts import CARRIED_NAMES, TRAINER_STATE
from ..storage import Location, Source, as_path, open_readable
from .options import DEFAULT_READ, ReadOptions

if TYPE_CHECKING:
    import torch

    from ..torch_records.checks import ReadChecks


class Chunk(Protocol):
    """One stored box of a tensor, as :meth:`CheckpointReader.chunks` gives it."""

    @property
    def box(self) -> Box: ...

    @property
    def rank(self) -> int | None:
        """The rank that wrote it, when the format records one (DCP's ``__<rank>_<n>.distcp``)."""
        ...


@dataclass(frozen=True, slots=True)
class CarriedFile:
    """A small file beside the weights that loaders need, carried into outputs byte for byte."""

    name: str
    data: bytes


TRAINER_STATE_FILE = "trainer-state.pkl"
"""A single file's own top-level entries beside its weights, tensors left out (Lightning's
``epoch``, ``global_step``, ``hyper_parameters``; timm's ``args``), as a pickle of inert data."""
SAFETENSORS_METADATA_FILE = "safetensors-metadata.json"
"""A safetensors input's header ``__metadata__`` (kohya's ``ss_*``, ``modelspec.*``), as a JSON
object of strings, carried through an EMA into the safetensors files made from it."""
CARRIED_FILES = (*CARRIED_NAMES, TRAINER_STATE_FILE, SAFETENSORS_METADATA_FILE)
"""Files beside the weights that loaders read with them (Hugging Face's configs, megatron-core's
``metadata.json`` and ``common.pt``, Lightning's ``meta.pt``, and the two above)."""
MAX_CARRIED_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class StoredBox:
    """A stored box with no rank: the default :meth:`CheckpointReader.chunks` entry."""

    box: Box
    rank: int | None = None


class CheckpointReader(abc.ABC):
    """Read access to one checkpoint, key by key and box by box: metadata alone answers
    ``specs`` and ``layout``, and ``read`` reads any box on demand.

    A format implements the five abstract methods and sets ``path``, ``step`` and
    ``format_name``; every other capability has a default right for a format without it, so
    no caller probes a reader. A context manager; ``close`` may be called twice.

    Example:
        >>> with open_checkpoint("ckpts/step_10") as reader:          # doctest: +SKIP
        ...     reader.read("fc.weight", Box((0, 0), (2, 8))).shape
        torch.Size([2, 8])
    """

    format_name: ClassVar[str]
    """The registered format's name (``dcp``, ``deepspeed``, ``safetensors``, ``torch``)."""
    path: Location
    step: int | None = None
    """The training step recorded inside the checkpoint, when the format records one."""
    read_options: ReadOptions = DEFAULT_READ
    """How it was opened (passed to :func:`~ema_ckpt.formats.resolve.open_checkpoint`)."""

    supports_out: ClassVar[bool] = False
    """True when ``read(..., out=buf)`` fills ``buf`` straight from storage (callers that reuse
    buffers then pass them); otherwise ``out`` is filled by a copy."""

    whole_file_records: ClassVar[bool] = False
    """True when each of :meth:`stored_records` is a whole file (a DeepSpeed ``.pt``, a
    ``torch.save`` file), not a record inside a larger data file (DCP)."""

    planner_data: Mapping[str, tuple[str, ...]] | None = None
    """DCP's ``planner_data`` (flat key → the nested path it was saved under), passed on to a
    DCP writer."""

    non_tensor_keys: Sequence[str] = ()
    """Entries that are not tensors (DCP ``BytesStorageMetadata``), readable with :meth:`read_bytes`."""

    read_checks: ReadChecks | None = None
    """The stored checksums (torch zips' CRC-32s) the bytes :meth:`read` returns are checked
    against, or None for a format that stores none."""

    @abc.abstractmethod
    def specs(self) -> Mapping[str, TensorSpec]:
        """Every tensor key with its shape and dtype, from metadata alone."""

    @abc.abstractmethod
    def layout(self, key: str) -> Sequence[Box]:
        """The boxes ``key`` is best read by (stored chunks; zero-volume boxes omitted)."""

    @abc.abstractmethod
    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """``box`` of ``key`` in its stored dtype: a new tensor, or ``out`` (contiguous, of the
        box's shape and the key's dtype, else ValueError) filled and returned."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """Format-specific facts for ``inspect`` (JSON-serialisable)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release open files; a second call does nothing."""

    @classmethod
    def step_of(cls, path: Location) -> int | None:
        """The step :attr:`step` would hold, cheaply: no reader built, no tensor opened."""
        return None

    def chunks(self, key: str) -> Sequence[Chunk]:
        """``key``'s stored boxes with the rank that wrote each (default: :meth:`layout`, no rank)."""
        return [StoredBox(box) for box in self.layout(key)]

    def root_of(self, key: str) -> str | None:
        """The top-level state-dict name ``key`` was saved under (``model``, ``optim``), or None
        when the format records none."""
        return None

    def container_of(self, key: str) -> str | None:
        """The state-dict container ``key`` was nested in when saved (``model`` of
        ``{"model": model.state_dict()}``), or None when it was not nested."""
        return None

    def share(self) -> object | None:
        """What opening this checkpoint parsed, as picklable data, or None:
        ``open_checkpoint(path, shared=reader.share())`` elsewhere rebuilds it without parsing."""
        return None

    def stored(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, canonical dtype name)}; without importing torch where the format allows."""
        return {key: (spec.shape, name_of(spec.dtype)) for key, spec in self.specs().items()}

    def byte_ranges(self, key: str) -> list[tuple[str, int, int]] | None:
        """``key``'s bytes in row-major order as (data file, offset, length), or None when they
        are not plain runs of stored bytes (the default: copy through :meth:`read`)."""
        return None

    def open_data(self, file: str) -> Source:
        """A data file :meth:`byte_ranges` names, opened for reading (the reader closes it)."""
        raise ValueError(f"{self.path}: {self.format_name} readers name no data files ({file!r})")

    def stored_records(self) -> Sequence[tuple[str, int, int]]:
        """Every ``torch.save`` zip record of the checkpoint as (file relative to :attr:`path`,
        offset, length): what ``verify`` checks the CRC-32s of. Default: none."""
        return ()

    def open_record(self, file: str, offset: int, length: int) -> IO[bytes]:
        """A read-only, seekable file object of one of :meth:`stored_records` (the caller closes it)."""
        from ..torch_records import FileWindow

        full = self.path / file if file else self.path
        return FileWindow(open_readable(full), offset, length, owns_fd=True)  # type: ignore[return-value]

    def read_bytes(self, key: str) -> bytes:
        """The raw stored record of a non-tensor entry (one of :attr:`non_tensor_keys`), never unpickled."""
        raise KeyError(key)

    def carried_files(self) -> Sequence[CarriedFile]:
        """Files beside the weights that an output made from this checkpoint carries
        (default: the :data:`CARRIED_FILES` in its folder, regular files up to 16 MiB)."""
        if not self.path.is_dir():
            return ()
        found = []
        for name in CARRIED_FILES:
            file = self.path / name
            try:
                if file.is_file() and not file.is_symlink() and file.stat().st_size <= MAX_CARRIED_BYTES:
                    found.append(CarriedFile(name, file.read_bytes()))
            except OSError:
                continue
        return found

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoredView(Mapping[str, tuple[tuple[int, ...], str]]):
    """:meth:`CheckpointReader.stored` read from a reader's specs as asked: no copy per key."""

    __slots__ = ("_names", "_specs")

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self._specs = specs
        self._names: dict[Any, str] = {}

    def __getitem__(self, key: str) -> tuple[tuple[int, ...], str]:
        spec = self._specs[key]
        name = self._names.get(spec.dtype)
        if name is None:
            name = self._names[spec.dtype] = name_of(spec.dtype)
        return spec.shape, name

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, key: object) -> bool:
        return key in self._specs


def deliver(key: str, box: Box, value: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``value`` (``box`` of ``key``), or ``out`` filled with it: ``read(out=)`` for readers
    whose :attr:`~CheckpointReader.supports_out` is False."""
    if out is None:
        return value
    if tuple(out.shape) != box.sizes or out.dtype != value.dtype or not out.is_contiguous():
        raise ValueError(f"{key}: buffer {tuple(out.shape)} {out.dtype} does not fit {box} {value.dtype}")
    return out.copy_(value)


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """One registered format: how to recognise it and how to open it.

    ``incomplete``: why a path looks like a checkpoint of this format still being written, or
    None. ``records_step``: the step read by ``step_of`` from inside the checkpoint beats the
    one in its name. ``reopen``: from what a reader's ``share()`` returned.
    """

    name: str
    detect: Callable[[Location], bool]
    open: Callable[[Location, ReadOptions], CheckpointReader]
    incomplete: Callable[[Location], str | None] = lambda _path: None
    not_a_model: Callable[[Location], str | None] = lambda _path: None
    """Why a path of this format's kind, complete, holds no model (``optimizer.pt``), or None."""
    records_step: bool = False
    step_label: str | None = None
    """How ``inspect`` names the record the step comes from (``DeepSpeed global_steps``)."""
    step_of: Callable[[Location], int | None] = lambda _path: None
    step_record: Callable[[Location], tuple[int, str] | None] | None = None
    """The step and where it was read (``global_step in the file``), where it depends on the
    checkpoint; else ``step_of`` with :attr:`step_label`."""
    reopen: Callable[[Location, Any, ReadOptions], CheckpointReader] | None = None


_REGISTRY: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add a format to the registry (later registrations are tried after earlier ones)."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def registered_formats() -> Mapping[str, CheckpointFormat]:
    """The registry, in detection order."""
    return dict(_REGISTRY)


def trainer_state_step(path: str | Location) -> int | None:
    """``global_step`` of the Hugging Face Trainer's ``trainer_state.json`` in ``path``, or None
    (a missing or unreadable file is no error)."""
    try:
        doc = json.loads((as_path(path) / TRAINER_STATE).read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    step = doc.get("global_step") if isinstance(doc, dict) else None
    return step if type(step) is int and step >= 0 else None
