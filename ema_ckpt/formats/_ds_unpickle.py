"""Load DeepSpeed ``.pt`` files safely, memory-mapped, without DeepSpeed installed.

Why this module exists: DeepSpeed pickles a few of its own classes into every ZeRO checkpoint
(``ZeroStageEnum``, ``LossScaler``, ``fragment_address``), so a plain ``torch.load`` needs
DeepSpeed importable *and* ``weights_only=False``, which runs whatever code the file names.
Here the files go through torch's weights-only unpickler, with inert stand-ins registered under
the DeepSpeed names for the duration of one load. Nothing else is importable from a file: any
other global is refused with :class:`~ema_ckpt.errors.UnsafePickleError` before it is called.

Files are opened with ``mmap=True``: tensors are views on a private mapping of the file, so a
rank file costs its pickle (small) plus the pages actually read. Pages that were read stay in
the process's resident set until the mapping goes, which for a sequence of multi-GiB rank files
held open together is most of the data; :func:`release_pages` hands the pages of a span back
once it has been copied out (they stay in the page cache and refault from the file if read
again), so resident memory stays near one span instead of growing with every file read.

On object storage a file is never mapped nor fetched whole: :func:`load_ds_structure` reads its
zip directory and ``data.pkl`` by ranged requests and unpickles it with the same weights-only
unpickler and stand-ins, every storage an empty ``meta`` one of its size (tensors keep their
shapes, dtypes and views); :func:`meta_member` then says where a tensor's bytes lie in the
object, for ranged reads of just those bytes.

Example:
    >>> from ema_ckpt.formats._ds_unpickle import load_ds_file  # doctest: +SKIP
    >>> state = load_ds_file("ckpt/global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    ... # doctest: +SKIP
    >>> int(state["optimizer_state_dict"]["zero_stage"])  # doctest: +SKIP
    2
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import io
import mmap
import os
import pickle
import pickletools
import re
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from .._lazy import torch
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsafePickleError
from ..remote import RangedReads, RangeSource, RemotePath
from ..torch_records import FileWindow, member_start
from ..torch_records.zipfmt import stored_members

__all__ = [
    "STAND_INS",
    "DynamicLossScaler",
    "LossScaler",
    "RemoteStructure",
    "ZeroStageEnum",
    "fragment_address",
    "load_ds_file",
    "load_ds_file_releasable",
    "load_ds_structure",
    "meta_member",
    "pages_releasable",
    "release_pages",
    "storage_file_offsets",
]


# --- inert stand-ins -----------------------------------------------------------------------
# Each is built by the weights-only unpickler in one of two ways only: ``cls(*args)`` (REDUCE,
# for the enum) or ``cls.__new__(cls)`` followed by ``instance.__dict__.update(state)``
# (NEWOBJ + BUILD). None defines ``__setstate__``, ``__reduce__`` or an ``__init__`` with effects.


class ZeroStageEnum(enum.IntEnum):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``cls(value)``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _AttributeBag:
    """A plain object whose attributes come from the pickled ``__dict__``; it runs nothing."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()))
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]


class LossScaler(_AttributeBag):
    """Stands in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (``cur_scale``, ``dynamic``)."""


class DynamicLossScaler(_AttributeBag):
    """Stands in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


class fragment_address(_AttributeBag):  # the pickled qualname
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address``: ``(numel, start)``.

    Unpacks like the tuple it describes: ``numel, start = address``.
    """

    numel: int
    start: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.numel, self.start))


STAND_INS: dict[str, type] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": fragment_address,
    # Megatron-DeepSpeed pickles its ``args``; a Namespace only stores attributes.
    "argparse.Namespace": argparse.Namespace,
}
"""Pickled global name -> the class built in its place. Everything else is refused."""

_SAFE_GLOBALS = [(cls, name) for name, cls in STAND_INS.items()]

# torch's allowlist lives in a process-wide set; one lock keeps our additions scoped to our
# own loads (another thread's load in between would otherwise see them come and go).
_LOAD_LOCK = threading.Lock()

_ZIP_MAGIC = b"PK\x03\x04"
_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def load_ds_file(path: str | Path, *, mmap: bool = True) -> Any:
    """Load one DeepSpeed ``.pt`` file with the weights-only unpickler and the stand-ins.

    :func:`load_ds_file_releasable` also says whether the result's pages may be released.

    Args:
        path: A ``*_model_states.pt`` or ``*_optim_states.pt`` file (any ``torch.save`` file).
        mmap: Memory-map the file (zip format only; legacy ``torch.save`` files are read whole).

    Returns:
        The unpickled object, tensors on the CPU (views on the mapping when ``mmap``).

    Raises:
        CheckpointNotFoundError: The file does not exist.
        UnsafePickleError: The pickle refers to a global outside the allowlist; nothing ran.
        CheckpointFormatError: The file is truncated, corrupt or not a ``torch.save`` file.
    """
    return _load(Path(path), mmap)[0]


def load_ds_file_releasable(path: str | Path) -> tuple[Any, bool]:
    """:func:`load_ds_file` (memory-mapped), and whether :func:`release_pages` may be used on its tensors.

    The flag is True when the file was memory-mapped (a zip-format ``torch.save`` file: torch
    refuses ``mmap`` for any other, so a successful mapped load proves it) and
    :func:`pages_releasable` holds for it; False for legacy files, read into ordinary memory,
    where dropping pages would zero them.
    """
    path = Path(path)
    state, mapped = _load(path, True)
    return state, mapped and pages_releasable(path)


def _load(path: Path, mmap: bool) -> tuple[Any, bool]:
    """The loaded object and whether it is memory-mapped."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except FileNotFoundError:
        raise CheckpointNotFoundError(path, "no such file") from None
    except OSError as err:
        raise CheckpointFormatError(path, f"cannot read: {err.strerror or err}") from None
    is_zip = _check_magic(path, magic)
    mapped = mmap and is_zip
    state = _safe_load(path, lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=mapped), path, is_zip)
    return state, mapped


def _check_magic(path: Path, magic: bytes) -> bool:
    """Whether the file is a zip-format ``torch.save`` file (else a legacy one); refuses anything else."""
    if not magic:
        raise CheckpointFormatError(path, "empty file (truncated, or still being written)")
    is_zip = magic == _ZIP_MAGIC
    if not is_zip and magic[:1] != b"\x80":
        raise CheckpointFormatError(path, "not a torch.save file (no zip or pickle header)")
    return is_zip


def _safe_load(path: Path, load: Callable[[], Any], pickle_source: Path | bytes, is_zip: bool) -> Any:
    """``load()`` (a load through the weights-only unpickler) with the stand-ins allowed; every
    failure is one :class:`~ema_ckpt.errors.CheckpointFormatError` naming ``path``.

    ``pickle_source``: the file, or its ``data.pkl`` bytes, searched for the global refused.
    """
    try:
        with _LOAD_LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS), warnings.catch_warnings():
            # torch warns about pickle protocols other than 2 and then refuses the file anyway.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return load()
    except pickle.UnpicklingError as err:
        try:
            name = _refused_global(pickle_source, str(err), is_zip)
        except Exception:  # a damaged archive: the pickle error below is the message
            name = None
        if name is not None:
            raise UnsafePickleError(
                path, f"refers to {name}, which is not allowed; nothing from the file was run"
            ) from None
        first = _first_line(str(err))
        raise CheckpointFormatError(path, f"corrupt or unsupported pickle ({first})") from None
    except Exception as err:  # torch.load raises many types on damaged files; all mean the same here
        first = _first_line(str(err)) or type(err).__name__
        raise CheckpointFormatError(path, f"truncated or corrupt torch.save file ({first})") from None


def pages_releasable(path: str | Path) -> bool:
    """Whether the tensors :func:`load_ds_file` maps from ``path`` may go through :func:`release_pages`.

    True for a zip-format ``torch.save`` file (so memory-mapped) whose ``byteorder`` record is
    absent or this machine's: then torch never writes to the private mapping (it byte-swaps
    foreign-endian storages in place), and dropped pages refault with the same bytes. False
    for legacy files (read into ordinary memory, where dropping pages would zero them),
    foreign-endian files, unreadable files, and where :func:`release_pages` is a no-op anyway.
    """
    if _madvise is None:
        return False
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != _ZIP_MAGIC:
                return False
        with zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if n == "byteorder" or n.endswith("/byteorder")), None)
            if name is None:  # torch assumes the configured fallback (little unless told)
                ends = torch.serialization.LoadEndianness
                fallback = torch.serialization.get_default_load_endianness()
                order = {None: "little", ends.LITTLE: "little", ends.BIG: "big"}.get(fallback, sys.byteorder)
            else:
                order = zf.read(name).decode("ascii", "replace").strip()
            return order == sys.byteorder
    except (OSError, zipfile.BadZipFile, KeyError, ValueError):
        return False


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None  # elsewhere MADV_DONTNEED may not drop pages, or may not keep their content
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()
_PAGE = mmap.PAGESIZE


def release_pages(t: torch.Tensor) -> None:
    """Drop the pages under tensor ``t`` from this process's resident set (Linux; else no-op).

    ``t`` must be a view on a mapping made by :func:`load_ds_file` of a file for which
    :func:`pages_releasable` is True, so that every page from its first to its last byte,
    rounded out to page boundaries, lies inside that mapping and was never written. The
    pages leave the process (``madvise(MADV_DONTNEED)``) but not the page cache: touching
    them again maps the file's bytes back in, so ``t`` and every other view on the file still
    read the same data. Errors are ignored (the pages then simply stay resident).
    """
    if _madvise is None or t.numel() == 0:
        return
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    end = start + extent * t.element_size()
    lo = start - start % _PAGE
    hi = end + (-end) % _PAGE
    _madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def storage_file_offsets(path: str | Path, state: Any) -> dict[int, int] | None:
    """Where each storage of a memory-mapped load lies in its file: ``{data_ptr: byte offset}``.

    ``state`` is what :func:`load_ds_file_releasable` returned for ``path`` (flagged
    releasable). torch maps the whole file once and slices every storage out of that mapping
    at its zip member's data offset, so one base address ties every storage pointer to a
    member; the base is accepted only when *every* storage found in ``state`` then starts
    exactly at a stored member of its size. With the offsets a reader ``pread`` s a flat range
    straight into its buffer (no page faults, no parallel copy, no pages to hand back).
    None when the file's members cannot be listed or the storages do not line up (read
    through the mapping then).

    Example:
        >>> state, ok = load_ds_file_releasable("zero_pp_rank_0_mp_rank_00_optim_states.pt")  # doctest: +SKIP
        >>> flat = state["optimizer_state_dict"]["fp32_flat_groups"][0]  # doctest: +SKIP
        >>> storage_file_offsets(path, state)[flat.untyped_storage().data_ptr()]  # doctest: +SKIP
        3540
    """
    storages: dict[int, int] = {}  # data_ptr -> nbytes
    _collect_storages(state, storages, depth=0)
    members = _stored_members(Path(path))
    if not storages or not members:
        return None
    lowest = min(storages)
    for start in sorted(members):
        base = lowest - start
        if all(members.get(ptr - base) == nbytes for ptr, nbytes in storages.items()):
            return {ptr: ptr - base for ptr in storages}
    return None


def _collect_storages(obj: Any, into: dict[int, int], depth: int) -> None:
    """Every non-empty CPU storage under ``obj`` (dicts, lists, tuples, the stand-ins' attributes)."""
    if depth > 64:
        return
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.nbytes() > 0 and obj.device.type == "cpu":
            into[storage.data_ptr()] = storage.nbytes()
        return
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, list | tuple):
        items = obj
    elif isinstance(obj, _AttributeBag | argparse.Namespace):
        items = vars(obj).values()
    else:
        return
    for item in items:
        _collect_storages(item, into, depth + 1)


def _stored_members(path: Path) -> dict[int, int] | None:
    """``{data offset: size}`` of the uncompressed ``data/<key>`` members of a ``torch.save`` zip."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        listed = stored_members(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if listed is None:
        return None
    return {start: size for start, (size, _, name) in listed.items() if "/data/" in f"/{name}" and size}


@dataclass(eq=False)
class RemoteStructure:
    """A ``.pt`` object on object storage, loaded for its structure only.

    ``state`` is the unpickled object with every tensor on the ``meta`` device; ``members``
    maps each zip member's name to ``(local header offset, method, size, CRC-32)``; ``storages`` maps
    each ``meta`` storage (by ``id``) to its member's name; ``source`` is what the structure
    was read through (member headers are read through it later).
    """

    path: Path
    state: Any
    members: dict[str, tuple[int, int, int, int]]
    storages: dict[int, str]
    source: RangeSource
    _kept: list[Any] = field(default_factory=list)  # the storages, so that their ids stay theirs
    _starts: dict[str, int] = field(default_factory=dict)  # member -> where its data starts, checked

    def close(self) -> None:
        self.source.close()


def load_ds_structure(path: Path) -> RemoteStructure:
    """Load a DeepSpeed ``.pt`` object from object storage without reading its tensors' bytes.

    The zip directory, ``data.pkl`` and ``byteorder`` are read by ranged requests; ``data.pkl``
    goes through torch's weights-only unpickler with the stand-ins, as in :func:`load_ds_file`,
    and each storage it names becomes an empty ``meta`` storage of its size, so tensors come
    back on the ``meta`` device with their shapes, dtypes and views; :func:`meta_member`
    says where one's bytes lie.

    Raises:
        CheckpointNotFoundError: no such object.
        UnsafePickleError: the pickle refers to a global outside the allowlist; nothing ran.
        CheckpointFormatError: the object is truncated, corrupt, a legacy ``torch.save``
            file, or written on a machine of the other byte order.
    """
    source = RangedReads(cast(RemotePath, path))
    try:
        if not _check_magic(path, source.pread(4, 0)):
            raise CheckpointFormatError(path, "a legacy (non-zip) torch.save file, which is read from a local "
                                              "copy only")
        try:
            with zipfile.ZipFile(cast(IO[bytes], FileWindow(source, 0, source.size))) as zf:
                infos = zf.infolist()
                # A small read brings the bytes after it up to the next member's header, never into that member.
                source.fences = sorted(i.header_offset for i in infos)
                pkl = next((i.filename for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"),
                           None)
                if pkl is None:
                    raise CheckpointFormatError(path, "not a torch.save file (no data.pkl)")
                data = zf.read(pkl)
                order = next((zf.read(i) for i in infos if i.filename.endswith("/byteorder")), b"little")
        except (zipfile.BadZipFile, ValueError, EOFError, OSError) as err:
            raise CheckpointFormatError(path, f"truncated or corrupt torch.save file ({_first_line(str(err))})") \
                from None
        if order.decode("ascii", "replace") != sys.byteorder:
            raise CheckpointFormatError(path, f"written {order.decode('ascii', 'replace')}-endian, which is read "
                                              "from a local copy only")
        prefix = pkl[: -len("data.pkl")]
        members = {i.filename: (i.header_offset, i.compress_type, i.file_size, i.CRC) for i in infos}
        storages: dict[int, str] = {}
        kept: list[Any] = []
        state = _safe_load(path, lambda: _unpickle_to_meta(data, prefix, storages, kept), data, True)
        return RemoteStructure(path, state, members, storages, source, kept)
    except BaseException:
        source.close()
        raise


def _unpickle_to_meta(data: bytes, prefix: str, storages: dict[int, str], kept: list[Any]) -> Any:
    """``data.pkl`` through torch's weights-only unpickler, each storage an empty ``meta`` one."""
    from torch import _weights_only_unpickler as weights_only

    typed: dict[str, Any] = {}

    def persistent_load(saved_id: Any) -> Any:
        # What torch.load's own persistent_load does, with a placeholder for the bytes.
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] not in ("storage", b"storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {saved_id!r}")
        _, storage_type, key, _location, numel = saved_id
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if key not in typed:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            if type(numel) is not int or numel < 0:
                raise pickle.UnpicklingError(f"storage {key}: bad size {numel!r}")
            storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
            storages[id(storage)] = f"{prefix}data/{key}"
            kept.append(storage)
            typed[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        return typed[key]

    unpickler = weights_only.Unpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()  # type: ignore[no-untyped-call]


def meta_member(loaded: RemoteStructure, t: torch.Tensor) -> tuple[str, int, int, int]:
    """(name, data start, size, CRC-32) of the zip member holding ``t``'s storage.

    Its header is read once per member; the member must be stored uncompressed and hold
    exactly the storage's bytes.

    Raises:
        CheckpointFormatError: ``t`` is not a storage of the file, or its member does not match.
    """
    storage = t.untyped_storage()
    name = loaded.storages.get(id(storage))
    if name is None:
        raise CheckpointFormatError(loaded.path, "a tensor's place in the file is unknown")
    local, method, size, crc = loaded.members.get(name, (-1, -1, -1, 0))
    start = loaded._starts.get(name)
    if start is None:
        found = member_start(loaded.source, 0, loaded.source.size, local) if local >= 0 else None
        if found is None or method != zipfile.ZIP_STORED or size != storage.nbytes() \
                or found + size > loaded.source.size:
            raise CheckpointFormatError(loaded.path, f"zip member {name} does not hold its storage's "
                                                     f"{storage.nbytes()} bytes (truncated or corrupt)")
        start = loaded._starts[name] = found
    return name, start, size, crc


def _first_line(message: str) -> str:
    """The informative line of a torch error (past the weights-only preamble), shortened."""
    _, marker, rest = message.partition("WeightsUnpickler error:")
    for line in (rest if marker else message).splitlines():
        line = line.strip()
        if line:
            return line[:200]
    return ""


def _refused_global(path: Path | bytes, message: str, is_zip: bool) -> str | None:
    """The global the weights-only unpickler refused, from its message or from the pickle
    (``path``: the file, or its ``data.pkl`` bytes)."""
    match = _GLOBAL_IN_MESSAGE.search(message)
    if match:
        name = match.group(1)
        # torch prints builtins without their module ("GLOBAL eval").
        return name if "." in name else f"builtins.{name}"
    if not is_zip:
        return None
    if isinstance(path, bytes):
        data = path
    else:
        try:
            with zipfile.ZipFile(path) as zf:
                pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                data = zf.read(pkl) if pkl else b""
        except (OSError, zipfile.BadZipFile, KeyError):
            return None
    for name in _globals_in_pickle(data):
        if name not in STAND_INS and not _torch_allows(name):
            return name
    return None


def _globals_in_pickle(data: bytes) -> list[str]:
    """Every global a pickle names, in order, found by disassembly (nothing is executed)."""
    names: list[str] = []
    strings: list[str] = []  # recent string pushes, for STACK_GLOBAL (protocol 4+)
    memo: dict[int, str] = {}
    top: str | None = None  # the last pushed value when it is a string
    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            pushed: str | None = None
            if op.name in ("GLOBAL", "INST"):
                module, _, qualname = str(arg).partition(" ")
                names.append(f"{module}.{qualname}")
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
                pushed = arg
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                key = len(memo) if arg is None else int(arg)  # MEMOIZE alone has no argument
                if top is not None:
                    memo[key] = top
                continue  # memoising leaves the stack (and ``top``) as it was
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg is not None:
                pushed = memo.get(int(arg))
            if pushed is not None:
                strings.append(pushed)
            top = pushed
    except (ValueError, EOFError, pickle.UnpicklingError):
        pass  # a damaged tail: report what was found before it
    return names


def _torch_allows(name: str) -> bool:
    """Whether torch's weights-only unpickler allows ``name`` by default (private API, guarded)."""
    from torch import _weights_only_unpickler as wo

    allowed = getattr(wo, "_get_allowed_globals", None)
    if allowed is None:  # pragma: no cover - a torch without the private helper
        return name.startswith("torch.") or name.startswith("collections.")
    return name in allowed()
