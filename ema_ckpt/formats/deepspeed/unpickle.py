"""Load DeepSpeed ``.pt`` files safely, memory-mapped, without DeepSpeed installed.

DeepSpeed pickles its own classes into every ZeRO checkpoint (``ZeroStageEnum``, ``LossScaler``,
``fragment_address``): a plain ``torch.load`` needs DeepSpeed *and* ``weights_only=False``, which
runs whatever the file names. Here torch's weights-only loader reads them with inert stand-ins
under those names for one load (:func:`~ema_ckpt.pickles.load.load_weights_only`); any other
global is refused (:class:`~ema_ckpt.errors.UnsafePickleError`) before it is called. Most files
take :mod:`.fastload` instead (CPython's C unpickler, where it vouches for the same result).

Tensors are views on a private mapping of the file, and :func:`release_pages` hands a span's
pages back once copied out, so resident memory stays near one span.

Example:
    >>> state = load_ds_file("ckpt/global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt")  # doctest: +SKIP
    >>> int(state["optimizer_state_dict"]["zero_stage"])  # doctest: +SKIP
    2
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import mmap
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError, CheckpointNotFoundError
from ...pickles.load import load_weights_only
from ...storage import Location, open_readable
from ...torch_records.zipfmt import LOCAL_MAGIC, stored_members
from .fastload import SealedType, default_byteorder, fast_load

__all__ = ["STAND_INS", "DynamicLossScaler", "LossScaler", "ZeroStageEnum", "fragment_address", "load_ds_file",
           "load_ds_file_releasable", "pages_releasable", "release_pages", "storage_file_offsets"]


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


class _AttributeBag(metaclass=SealedType):
    """A plain object whose attributes come from the pickled ``__dict__``; it runs nothing. Its
    classes refuse attribute writes: a pickle can fill an instance, never change the class."""

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
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address``; unpacks as ``numel, start``."""

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

def load_ds_file(path: str | Path) -> Any:
    """Load one DeepSpeed ``.pt`` file (any ``torch.save`` file) with the stand-ins, tensors views
    on a mapping of the file where it is a zip (a legacy file is read whole).

    Raises:
        CheckpointNotFoundError: The file does not exist.
        UnsafePickleError: The pickle refers to a global outside the allowlist; nothing ran.
        CheckpointFormatError: The file is truncated, corrupt or not a ``torch.save`` file.
    """
    return _load(Path(path))[0]


def load_ds_file_releasable(path: str | Path) -> tuple[Any, bool]:
    """:func:`load_ds_file`, and whether :func:`release_pages` may be used on its tensors: mapped
    and :func:`pages_releasable` (a legacy file is in ordinary memory: dropping pages zeroes it)."""
    path = Path(path)
    state, mapped, native = _load(path)
    # a fast load read the byte order already (native, or it would not have been taken)
    return state, mapped and (_madvise is not None if native else pages_releasable(path))


def _load(path: Path) -> tuple[Any, bool, bool]:
    """The object, whether it is memory-mapped, and whether :func:`~.fastload.fast_load` loaded it
    (so it is in this machine's byte order)."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except FileNotFoundError:
        raise CheckpointNotFoundError(path, "no such file") from None
    except OSError as err:
        raise CheckpointFormatError(path, f"cannot read: {err.strerror or err}") from None
    mapped = check_magic(path, magic)
    fast = fast_load(path, STAND_INS) if mapped else None  # the C unpickler where it gives the same result
    if fast is not None:
        return fast[0], True, True
    return load_weights_only(path, path, stand_ins=STAND_INS, mmap=mapped), mapped, False


def check_magic(path: Location, magic: bytes) -> bool:
    """Whether the file is a zip-format ``torch.save`` file (else a legacy one); refuses anything else."""
    if not magic:
        raise CheckpointFormatError(path, "empty file (truncated, or still being written)")
    is_zip = magic == LOCAL_MAGIC
    if not is_zip and magic[:1] != b"\x80":
        raise CheckpointFormatError(path, "not a torch.save file (no zip or pickle header)")
    return is_zip


def pages_releasable(path: str | Path) -> bool:
    """Whether the tensors :func:`load_ds_file` maps from ``path`` may go through :func:`release_pages`:
    a zip-format file in this machine's byte order (torch byte-swaps others in the mapping)."""
    if _madvise is None:
        return False
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != LOCAL_MAGIC:
                return False
        with zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if n == "byteorder" or n.endswith("/byteorder")), None)
            order = default_byteorder() if name is None else zf.read(name).decode("ascii", "replace").strip()
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
    ``t`` must be a view on a mapping of a file :func:`pages_releasable` allows, never written:
    its pages leave the process, not the page cache, and refault with the file's bytes."""
    if _madvise is None or t.numel() == 0:
        return
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    end = start + extent * t.element_size()
    lo = start - start % _PAGE
    hi = end + (-end) % _PAGE
    _madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def storage_file_offsets(path: Location, state: Any) -> dict[int, int] | None:
    """Where each storage of a memory-mapped load lies in its file: ``{data_ptr: byte offset}``.

    ``state``: :func:`load_ds_file_releasable`'s for ``path``. Every storage is sliced out of one
    mapping at its member's data offset, so one base address ties each pointer to a member:
    accepted only where *every* storage then starts at a stored member of its size; else None.

    Example:
        >>> state, ok = load_ds_file_releasable("zero_pp_rank_0_mp_rank_00_optim_states.pt")  # doctest: +SKIP
        >>> flat = state["optimizer_state_dict"]["fp32_flat_groups"][0]  # doctest: +SKIP
        >>> storage_file_offsets(path, state)[flat.untyped_storage().data_ptr()]  # doctest: +SKIP
        3540
    """
    storages: dict[int, int] = {}  # data_ptr -> nbytes
    _collect_storages(state, storages, depth=0)
    members = _stored_members(path)
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


def _stored_members(path: Location) -> dict[int, int] | None:
    """``{data offset: size}`` of the uncompressed ``data/<key>`` members of a ``torch.save`` zip."""
    try:
        with open_readable(path) as fd:
            listed = stored_members(fd, fd.size)
    except OSError:
        return None
    if listed is None:
        return None
    return {start: size for start, (size, _, name) in listed.items() if "/data/" in f"/{name}" and size}
