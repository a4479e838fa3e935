"""One ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.pth.tar``; zip or torch < 1.6's
legacy format): the model inside, read without running anything from the file.

The pickle is read whole as inert data (:mod:`ema_ckpt.torch_records.tree`): globals of common
inert kinds pass, any other is refused naming the global and its key unless listed in
``inert_globals``. The model is one state dict in it (:mod:`.model`), its keys as the file's
writer loads them; tensors are read from their storages with ``pread``, box by box.

Example:
    >>> with TorchFileReader("epoch=3-step=1000.ckpt") as reader:    # doctest: +SKIP
    ...     reader.info()["container"], reader.read("model.0.weight", Box((0, 0), (2, 6))).shape
    ('state_dict', torch.Size([2, 6]))
"""

from __future__ import annotations

import io
import math
import re
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._lazy import torch
from ...dtypes import itemsize, torch_dtype
from ...errors import CheckpointFormatError, Note
from ...layout import Box, TensorSpec
from ...layouts import SeenCounter, counters_in
from ...storage import Location, Source, as_path, open_readable, open_structure
from ...torch_records import FileWindow, TensorRecord, member_start, view_problem
from ...torch_records.checks import ReadChecks
from ...torch_records.emit import dumps_inert
from ...torch_records.legacy import is_legacy, legacy_storage_starts, read_legacy_head
from ...torch_records.tree import Opaque, PickledTree, check_harmless, foreign_globals, key_path, load_tree, walk
from ...torch_records.zipfmt import END_MAGIC, LOCAL_MAGIC
from ..base import TRAINER_STATE_FILE, CarriedFile, CheckpointReader, deliver
from ..options import DEFAULT_READ, ReadOptions
from .model import Candidate, KeyPrefix, candidates, choose, epoch_in_tree, key_prefix, step_in_tree

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
"""File suffixes of single-file checkpoints (``.pth.tar`` ends in ``.tar``)."""
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError)
"""What zipfile raises on a corrupt directory, a name not in UTF-8, a compression it cannot read."""
_MAX_PICKLE_BYTES = 64 << 20  # pickled records of a few million keys
_TAIL = 65536 + 22  # a zip's end record lies within its last 64 KiB + 22 bytes


def has_torch_suffix(path: Location) -> bool:
    return path.name.lower().endswith(SUFFIXES)


def file_kind(path: Location) -> str | None:
    """``"zip"``, ``"legacy"``, ``"partial-zip"`` (no end record yet: still being written) or None."""
    try:
        with open_structure(path) as source:
            head = source.pread(4096, 0)
            if head.startswith(LOCAL_MAGIC):
                return "zip" if END_MAGIC in source.pread(_TAIL, max(0, source.size - _TAIL)) else "partial-zip"
    except OSError:
        return None
    return "legacy" if is_legacy(head) else None


@dataclass(frozen=True, slots=True)
class ParsedFile:
    """What opening a file parsed: its pickle as inert data, and where each storage's data starts."""

    kind: str
    tree: PickledTree
    starts: dict[str, int]
    """{storage key: absolute offset of its first data byte}."""
    stored_bytes: dict[str, int]
    """{storage key: bytes stored for it}."""
    crcs: dict[str, int] = field(default_factory=dict)
    """{storage key: the CRC-32 its zip member records} (none in the legacy format)."""


def parse_file(source: Source, path: Location) -> ParsedFile:
    """The pickle and storage places of an open ``torch.save`` file (zip or legacy).

    Raises:
        CheckpointFormatError: not a torch.save file, truncated, compressed storages, …
    """
    head, size = source.pread(4096, 0), source.size
    if head.startswith(LOCAL_MAGIC):
        return _parse_zip(source, path)
    if is_legacy(head):
        if source.fd() is None:
            raise CheckpointFormatError(path, "torch's legacy format is read through a file descriptor only")
        object_pickle, keys, pos = read_legacy_head(source, size, str(path))
        tree = load_tree(object_pickle, str(path))
        sizes = {k: itemsize(r.dtype) if r.dtype != "untyped" else 1 for k, r in tree.storages.items()}
        found = legacy_storage_starts(source, size, keys, pos, sizes, str(path))
        return ParsedFile("legacy", tree, {k: start for k, (start, _) in found.items()},
                          {k: numel * sizes[k] for k, (_, numel) in found.items()})
    raise CheckpointFormatError(path, "not a torch.save file (neither a zip nor torch's legacy format)")


def _parse_zip(source: Source, path: Location) -> ParsedFile:
    size = source.size
    try:
        with zipfile.ZipFile(io.BufferedReader(FileWindow(source, 0, size))) as archive:
            infos = archive.infolist()
            pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
            if pkl is None:
                raise CheckpointFormatError(path, "no data.pkl: not a torch.save file")
            if pkl.file_size > _MAX_PICKLE_BYTES:
                raise CheckpointFormatError(path, f"data.pkl of {pkl.file_size} bytes is too large")
            data = archive.read(pkl)
    except _ZIP_ERRORS as err:
        raise CheckpointFormatError(path, f"not a readable torch.save zip ({err})") from None
    tree = load_tree(data, str(path))
    prefix = pkl.filename[: -len("data.pkl")]
    members = {i.filename: i for i in infos}
    starts: dict[str, int] = {}
    stored: dict[str, int] = {}
    crcs: dict[str, int] = {}
    for key in tree.storages:
        member = members.get(prefix + "data/" + key)
        if member is None:
            continue  # named by a part of the file that is not read; a tensor read from it is refused
        if member.compress_type != zipfile.ZIP_STORED:
            raise CheckpointFormatError(path, f"storage {key}: compressed storage is not supported")
        start = member_start(source, 0, size, member.header_offset)
        if start is None:
            raise CheckpointFormatError(path, f"corrupt zip header of {member.filename}")
        starts[key], stored[key], crcs[key] = start, member.file_size, member.CRC
    return ParsedFile("zip", tree, starts, stored, crcs)


@dataclass(frozen=True, slots=True)
class _Stored:
    record: TensorRecord
    data_offset: int  # absolute offset of the storage's first byte in the file


def _is_tensor(value: Any) -> bool:
    return isinstance(value, TensorRecord) or (
        isinstance(value, Opaque) and value.global_name.startswith(("torch._utils._rebuild", "torch._tensor._rebuild")))


def _nbytes(value: Any) -> int:
    return math.prod(value.size) * itemsize(value.dtype) if isinstance(value, TensorRecord) else 0


def find_model(tree: PickledTree, path: Location, state_key: str | None) -> tuple[Candidate, list[Candidate]]:
    """(the chosen state dict, the others offered) of a file (see :mod:`.model`).

    Raises:
        CheckpointFormatError: no dict of tensors, or none at ``state_key``.
    """
    found = candidates(tree.root, is_tensor=_is_tensor, nbytes=_nbytes)
    every = candidates(tree.root, is_tensor=_is_tensor, nbytes=_nbytes, everywhere=True) if state_key else []
    chosen = choose(found, state_key, every)
    if chosen is None and state_key is not None:
        offered = ", ".join(repr(c.name or "(the top level)") for c in (found or every)[:6]) or "none"
        raise CheckpointFormatError(path, Note(f"holds no state dict at {{state_key={state_key}}} (dicts of "
                                               f"tensors in the file: {offered})", mentions=("state_key",)))
    if chosen is None:
        raise CheckpointFormatError(path, "holds no model weights (no dict of tensors outside optimizer, "
                                          "scheduler, loop and callback state)")
    if chosen.repeated:  # a dict inside itself, or one dict nested twice: a bomb, not a state dict
        raise CheckpointFormatError(path, f"a nested dict appears twice in the state dict "
                                          f"{chosen.name or '(the top level)'!r}")
    # a state dict chosen: a dict holding tensors beside other values is no alternative worth naming
    return chosen, [c for c in found if c is not chosen and (c.strict or not chosen.strict)]


def _dtype(path: Location, key: str, name: str) -> torch.dtype:
    try:
        return torch_dtype(name)
    except (KeyError, AttributeError, TypeError, ValueError):
        raise CheckpointFormatError(path, f"key {key!r}: dtype {name} is not supported") from None


class TorchFileReader(CheckpointReader):
    """Reader for one ``torch.save`` file (see the module docstring). ``checks``: where the bytes
    read are checked against their storages' CRC-32s (a folder of files shares one)."""

    format_name = "torch"
    whole_file_records = True
    read_checks: ReadChecks

    def __init__(self, path: str | Location, options: ReadOptions = DEFAULT_READ, *,
                 checks: ReadChecks | None = None) -> None:
        self.path = as_path(path)
        self.read_options = options
        self.read_checks = checks if checks is not None else ReadChecks(
            lambda name: self.path.parent / name, lambda _name, n, offset: self.read_back(n, offset))
        try:
            self._source = open_readable(self.path)
        except OSError as err:
            raise CheckpointFormatError(self.path, f"cannot read ({err.strerror})") from None
        try:
            self._size = self._source.size
            parsed = parse_file(self._source, self.path)
            check_harmless(parsed.tree, str(self.path), options.inert_globals)
            self.chosen, self.others = find_model(parsed.tree, self.path, options.state_key)
            self.prefix: KeyPrefix = key_prefix(parsed.tree.root, self.chosen, keep=options.keep_prefix)
            self.wrapper = self.prefix.dropped
            self._kind = parsed.kind
            # what is kept of the rest of the file (its optimizer state may be most of its records)
            self._entries = describe_top_level(parsed.tree.root, self.chosen)
            self._trainer_state = trainer_state(parsed.tree.root, self.chosen)
            record = step_in_tree(parsed.tree.root)
            self.step: int | None = record[0] if record is not None else None
            self._tensors = self._index(parsed)
            self._specs = {key: TensorSpec(key, t.record.size, _dtype(self.path, key, t.record.dtype))
                           for key, t in self._tensors.items()}
        except BaseException:
            self._source.close()
            raise

    def _index(self, parsed: ParsedFile) -> dict[str, _Stored]:
        cut = len(self.wrapper or "")
        tensors: dict[str, _Stored] = {}
        for name, record in self.chosen.tensors.items():
            key = name[cut:]
            shown = key_path((*self.chosen.path, name))
            if not isinstance(record, TensorRecord):
                raise CheckpointFormatError(self.path, f"key {shown!r}: {record.global_name} tensors are not supported")
            start = parsed.starts.get(record.storage_key)
            if start is None:
                raise CheckpointFormatError(self.path, f"key {shown!r}: storage {record.storage_key} is missing")
            nbytes = record.storage_numel * itemsize(record.dtype)
            if parsed.stored_bytes[record.storage_key] != nbytes:
                raise CheckpointFormatError(
                    self.path, f"key {shown!r}: storage holds {parsed.stored_bytes[record.storage_key]} bytes, "
                               f"its tensor needs {nbytes}")
            if start + nbytes > self._size:
                raise CheckpointFormatError(self.path, f"truncated: key {shown!r} ends past the end of the file")
            # a view past its storage, a negative stride, a stride-0 view of a few bytes claiming
            # terabytes: refused here, before anything is sized from it
            problem = view_problem(record.size, record.stride, record.storage_offset, record.storage_numel,
                                   itemsize(record.dtype))
            if problem is not None:
                raise CheckpointFormatError(self.path, f"key {shown!r}: {problem}")
            if key in tensors:
                raise CheckpointFormatError(self.path, f"key {key!r} appears twice once nested dicts are joined")
            tensors[key] = _Stored(record, start)
            self.read_checks.expect(self.path.name, start, nbytes, parsed.crcs.get(record.storage_key, 0),
                                    f"key {shown!r}")
        return tensors

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def layout(self, key: str) -> Sequence[Box]:
        spec = self._specs[key]
        return [Box.full(spec.shape)] if spec.numel else []

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        stored = self._tensors[key]
        record, spec = stored.record, self._specs[key]
        size = itemsize(record.dtype)
        if record.is_contiguous and box.sizes and box.sizes[1:] == spec.shape[1:]:
            row = math.prod(spec.shape[1:])
            rows = torch.empty(box.sizes, dtype=spec.dtype)
            self._pread_into(rows, stored.data_offset + (record.storage_offset + box.offsets[0] * row) * size)
            return deliver(key, box, rows, out)
        # Any other view: read the storage span the box reaches, from its first element to its last.
        first = record.storage_offset + sum(o * st for o, st in zip(box.offsets, record.stride, strict=True))
        reach = 1 + sum((n - 1) * st for n, st in zip(box.sizes, record.stride, strict=True)) if box.numel else 0
        flat = torch.empty(reach, dtype=spec.dtype)
        if reach:
            self._pread_into(flat, stored.data_offset + first * size)
        view = torch.as_strided(flat, box.sizes, record.stride).clone() if box.numel else flat.reshape(box.sizes)
        return deliver(key, box, view, out)

    def read_back(self, length: int, offset: int) -> bytes:
        """``length`` bytes of the file at ``offset`` (what :class:`ReadChecks` reads to settle a storage)."""
        return self._source.pread(length, offset)

    def _pread_into(self, out: torch.Tensor, offset: int) -> None:
        self.read_checks.fill(self._source, self.path.name, memoryview(out.reshape(-1).view(torch.uint8).numpy()),
                              offset)

    @classmethod
    def step_of(cls, path: Location) -> int | None:
        """The step the file records (``global_step``, ``iter_num``, …), reading its pickle only."""
        record = file_facts(path).step
        return record[0] if record is not None else None

    def stored_records(self) -> Sequence[tuple[str, int, int]]:
        """The file itself: one ``torch.save`` zip (a legacy file has no CRC-32s to check)."""
        return [("", 0, self._size)] if self._kind == "zip" else []

    def info(self) -> dict[str, Any]:
        storages = Counter(t.record.storage_key for t in self._tensors.values())
        return {
            "file": self.path.name,
            "serialization": "zip" if self._kind == "zip" else "legacy (torch < 1.6)",
            "container": self.chosen.name or None,
            "other_state_dicts": [c.name or "(the top level)" for c in self.others],
            "wrapper_prefix": self.wrapper,
            "key_prefix": self.prefix.why,
            "left_out": sorted(k for k in self.chosen.extras)[:20],
            "tree": self._entries,
            "storages": len(storages),
            "keys_sharing_storage": sum(n for n in storages.values() if n > 1),
            "step": self.step,
        }

    def carried_files(self) -> Sequence[CarriedFile]:
        """The file's top-level entries that hold no tensor (Lightning's ``hyper_parameters``), as
        :data:`~ema_ckpt.formats.base.TRAINER_STATE_FILE`, for ``load_from_checkpoint``."""
        if not self._trainer_state:
            return ()
        try:
            return [CarriedFile(TRAINER_STATE_FILE, dumps_inert(self._trainer_state))]
        except ValueError:  # nothing a loader needs is lost: the weights are whole
            return ()

    def close(self) -> None:
        self._source.close()


def carried_trainer_state(files: Sequence[CarriedFile], source: str,
                          inert_globals: Sequence[str] = ()) -> dict[str, Any]:
    """The trainer's own entries among carried files (:data:`~ema_ckpt.formats.base.TRAINER_STATE_FILE`,
    or Lightning's ``meta.pt``), tensors left out, read as inert data and judged as a checkpoint's
    pickle is; {} when none.

    Raises:
        UnsafePickleError: it names a global that is not read as data.
        CheckpointFormatError: it is not a readable pickle.
    """
    for file in files:
        if file.name == TRAINER_STATE_FILE:
            data = file.data
        elif file.name == "meta.pt":
            try:
                with zipfile.ZipFile(io.BytesIO(file.data)) as archive:
                    name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                    if name is None:
                        continue
                    data = archive.read(name)
            except _ZIP_ERRORS as err:
                raise CheckpointFormatError(f"{source}/{file.name}", f"not a readable torch.save zip ({err})") from None
        else:
            continue
        tree = load_tree(data, f"{source}/{file.name}")
        check_harmless(tree, f"{source}/{file.name}", inert_globals)
        return trainer_state(tree.root)
    return {}


def trainer_state(root: Any, chosen: Candidate | None = None) -> dict[str, Any]:
    """A file's top-level entries that hold no tensor, but for the chosen state dict's container."""
    if not isinstance(root, dict):
        return {}
    skip = chosen.path[0] if chosen is not None and chosen.path else None
    return {k: v for k, v in root.items()
            if isinstance(k, str) and k != skip and not any(_is_tensor(part) for _, part in walk(v))}


NOT_MODEL_FILES = re.compile(
    r"^(optimizer|optim|scheduler|lr_scheduler|scaler|rng_state|random_states|training_args|trainer_state"
    r"|args|hparams|config)([_.-]|$)", re.IGNORECASE)
"""Files a trainer writes beside the weights (``optimizer.pt``, ``rng_state_0.pth``,
``training_args.bin``): never a model, whatever tensors they hold."""


@dataclass(frozen=True, slots=True)
class FileFacts:
    """What discovery needs of a single file, from its pickle alone (no tensor read)."""

    kind: str | None
    """As :func:`file_kind`."""
    holds_model: bool
    """A state dict was found, or the pickle is unreadable (opening it then says why)."""
    step: tuple[int, str] | None
    epoch: int | None
    counters: tuple[SeenCounter, ...] = ()


_FACTS: OrderedDict[tuple[str, int, int, int], FileFacts] = OrderedDict()
_FACTS_KEPT = 512


def file_facts(path: Location) -> FileFacts:
    """:class:`FileFacts` of a file, parsed once per version of it (by size, mtime and inode):
    discovery asks of every file, every run, several times."""
    try:
        stat = path.stat()
    except OSError:
        return FileFacts(None, False, None, None)
    key = (str(path), stat.st_size, stat.st_mtime_ns, getattr(stat, "st_ino", 0))  # objects have no inode
    facts = _FACTS.get(key)
    if facts is None:
        facts = _FACTS[key] = _read_facts(path)
        while len(_FACTS) > _FACTS_KEPT:
            _FACTS.popitem(last=False)
    return facts


def _read_facts(path: Location) -> FileFacts:
    kind = file_kind(path)
    if kind not in ("zip", "legacy"):
        return FileFacts(kind, False, None, None)
    try:
        with open_readable(path) as source:
            tree = parse_file(source, path).tree
    except (OSError, CheckpointFormatError):
        return FileFacts(kind, True, None, None)
    root = tree.root
    # a file naming what is not read as data is taken: opening it says which global, under which key
    holds = not NOT_MODEL_FILES.match(path.name) and bool(candidates(root, is_tensor=_is_tensor) or foreign_globals(
        tree))
    return FileFacts(kind, holds, step_in_tree(root), epoch_in_tree(root),
                     tuple(counters_in(root)) if isinstance(root, dict) else ())


def _what(value: Any) -> str:
    if isinstance(value, TensorRecord):
        return f"tensor {'×'.join(map(str, value.size)) or 'scalar'} {value.dtype}"
    if isinstance(value, Opaque):
        return value.global_name
    if isinstance(value, dict):
        tensors = sum(isinstance(v, TensorRecord) for v in value.values())
        return f"dict of {len(value)}" + (f" ({tensors} tensors)" if tensors else "")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    return type(value).__name__


def describe_top_level(root: Any, chosen: Candidate) -> list[dict[str, str]]:
    """Each top-level entry of a file and what it holds; the chosen state dict marked."""
    if not isinstance(root, dict) or not chosen.path:  # the file is the state dict: its keys say it all
        return []
    role = "model" if len(chosen.path) == 1 else "model: " + chosen.name
    return [{"key": str(key), "holds": _what(value), "role": role if key == chosen.path[0] else ""}
            for key, value in list(root.items())[:40]]

