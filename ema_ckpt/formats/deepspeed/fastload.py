"""The fast way to :func:`.unpickle.load_ds_file`: CPython's C unpickler over a short allowlist.

torch's weights-only unpickler loops in Python over every opcode: seconds for a ZeRO-3
model-states file of 20,000 (empty) tensors, where the C unpickler spends a fraction of one.
:func:`fast_load` gives what the weights-only load of :mod:`.unpickle` gives (the same objects,
tensors sliced from one private mapping of the file), but only for a file it can read to that
same result; for any other (or any doubt) it returns None and torch's weights-only loader
reads the file, so every refusal still comes from there. What a file must be:

* a zip-format ``torch.save`` file, not a TorchScript archive, in this machine's byte order,
  loaded outside any fake-tensor mode;
* its pickle made only of the opcodes the weights-only unpickler implements (protocol 2's;
  no INST, OBJ, EXT, STACK_GLOBAL, FRAME, out-of-band buffers), every memo index below the
  pickle's size and every length within the data (walked before loading:
  :func:`~ema_ckpt.pickles.bounds.check_pickle_bounds`);
* naming only the globals of :data:`_ALLOWLISTS`, each allowed by the weights-only unpickler too
  (DeepSpeed's stand-ins aside) and built by the same torch functions (the tensor rebuild is
  torch's ``_rebuild_tensor_v2`` less its fake-mode step; torch's private pieces come from
  :mod:`ema_ckpt._compat.torch_load`). The allowlist never hands the C unpickler a shared
  function or class it could change: functions come as sealed call wrappers, storage and
  tensor types as sealed markers, and the only classes are immutable
  built-in types (``OrderedDict``, ``torch.Size``, ``torch.device``) or DeepSpeed's stand-ins,
  of a metaclass that refuses attribute writes, so ``BUILD`` can set nothing on an object
  another load would see;
* every storage a zip member, sliced out of the mapping exactly as ``torch.load(mmap=True)``
  slices it (so :func:`~.unpickle.storage_file_offsets` finds the same places).

What this way lets through that the weights-only unpickler refuses: ``SETITEM`` into a list or
a tensor of the same load, and ``BUILD`` on a tensor (``Tensor.__setstate__``: its
``requires_grad`` and hooks); they change only objects of that load (the mapping is private),
as writing other values into the file would, and run nothing.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path
from typing import Any

from ..._compat import torch_load
from ..._lazy import torch
from ...pickles.bounds import check_pickle_bounds
from ...pickles.load import Allowlist, load_pickle

__all__ = ["SealedType", "default_byteorder", "fast_load"]


class SealedType(type):
    """A metaclass whose classes refuse attribute writes (``BUILD`` on a class cannot poison it)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"{cls.__name__} is read-only")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"{cls.__name__} is read-only")


class _NotFast(Exception):
    """This file goes the weights-only way."""


class _Sealed:
    """An object no pickle opcode can change: no ``__dict__``, no attribute writes; its ``value``
    set once, when it is made."""

    __slots__ = ("value",)
    value: Any

    def __init__(self, value: Any) -> None:
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")


class _Call(_Sealed):
    """A global the pickle may call (``REDUCE``), standing in for the function or class itself."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        return self.value(*args)


class _StorageKind(_Sealed):
    """``torch.FloatStorage`` and kin in a storage reference: the dtype only."""

    __slots__ = ()


class _TensorType(_Sealed):
    """``torch.Tensor`` / ``torch.nn.Parameter`` as ``_rebuild_from_type_v2``'s type argument."""

    __slots__ = ()


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch's ``_rebuild_from_type_v2``, its type given as a :class:`_TensorType`."""
    if type(func) is not _Call or type(new_type) is not _TensorType or type(args) is not tuple:
        raise _NotFast
    return torch_load.rebuild_from_type(func, new_type.value, args, state)


_ALLOWLISTS: list[Allowlist] = []  # DeepSpeed files', then a summary's (rebuilds skipped); built on first use
_REBUILDS = (torch_load.REBUILD_TENSOR, torch_load.REBUILD_PARAMETER, torch_load.REBUILD_FROM_TYPE)


def _globals(stand_ins: dict[str, type], summary: bool) -> Allowlist:
    if _ALLOWLISTS:
        return _ALLOWLISTS[summary]
    allowed = torch_load.allowed_globals()
    if allowed is None:
        raise _NotFast
    rebuilds = torch_load.rebuild_functions()
    found: dict[str, Any] = {}
    for name, cls in (("collections.OrderedDict", collections.OrderedDict), ("torch.Size", torch.Size),
                      ("torch.device", torch.device)):
        if allowed.get(name) is cls:  # immutable types: nothing of them can be set, they go as they are
            found[name] = cls
    # each tensor rebuild where torch allows its own: torch's, or the same steps as torch's
    for name, rebuild in ((torch_load.REBUILD_PARAMETER, rebuilds[torch_load.REBUILD_PARAMETER]),
                          (torch_load.REBUILD_TENSOR, torch_load.rebuild_tensor_outside_fake_mode),
                          (torch_load.REBUILD_FROM_TYPE, _rebuild_from_type_v2)):
        if allowed.get(name) is rebuilds[name]:
            found[name] = _Call(rebuild)
    for name in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        if isinstance(allowed.get(name), type):
            found[name] = _TensorType(allowed[name])
    for name, value in allowed.items():
        if isinstance(value, torch.serialization.StorageType):  # torch.FloatStorage, ...
            found[name] = _StorageKind(value.dtype)
    if allowed.get("torch.UntypedStorage") is torch.UntypedStorage:
        found["torch.UntypedStorage"] = _StorageKind(torch.uint8)
    for name, cls in stand_ins.items():
        if isinstance(cls, SealedType):  # DeepSpeed's record classes, built by NEWOBJ + BUILD
            found[name] = cls
        elif issubclass(cls, int):  # ZeroStageEnum, called with its value
            found[name] = _Call(cls)
    # a summary's tensor rebuilds (:func:`fast_load`): no tensor, None in its place
    skipped = {name: _Call(lambda *_args: None) if name in _REBUILDS else value for name, value in found.items()}
    _ALLOWLISTS[:] = [Allowlist({(n.rpartition(".")[0], n.rpartition(".")[2]): v for n, v in table.items()},
                                other=_not_fast, python2_names=True) for table in (found, skipped)]
    return _ALLOWLISTS[summary]


_WEIGHTS_ONLY_OPCODES = b"\x80\x81\x85\x86\x87\x88\x89\x8a\x8f()]}.GJKMNQRUXabcehjqrstu"
"""The opcodes the weights-only unpickler implements (protocol 2's, less INST, OBJ, EXT)."""


def _not_fast(module: str, name: str) -> Any:
    raise _NotFast


def _storages(storage: Any, reader: Any, size: int) -> Any:
    """torch's ``persistent_load`` for a mapped load: a typed view on each member's bytes."""
    loaded: dict[str, Any] = {}

    def persistent_load(pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise _NotFast
        _, kind, key, _location, numel = pid
        if type(kind) is not _StorageKind or type(key) is not str or type(numel) is not int or numel < 0:
            raise _NotFast
        if key in loaded:
            return loaded[key]
        nbytes = numel * torch_load.element_size(kind.value)
        try:
            start = reader.get_record_offset(f"data/{key}")
        except Exception:
            raise _NotFast from None
        if start < 0 or start + nbytes > size:
            raise _NotFast
        if storage is None:  # a summary: the member is there, nothing is mapped
            return None
        loaded[key] = torch_load.typed_storage(storage[start : start + nbytes], kind.value)
        return loaded[key]

    return persistent_load


def fast_load(path: str | Path, stand_ins: dict[str, type], *, summary: bool = False) -> tuple[Any] | None:
    """``(state,)``: what ``torch.load(path, weights_only=True, mmap=True)`` with the stand-ins
    allowed returns, by the C unpickler; None when the file must go the weights-only way.
    ``summary``: None for every tensor and nothing mapped (every storage still checked to be a
    member of the file), a file's small fields, cheaply."""
    try:
        if torch_load.in_fake_mode():
            return None
        names = _globals(stand_ins, summary)
        reader = torch_load.zip_reader(path)
        records = set(reader.get_all_records())
        if "constants.pkl" in records or "data.pkl" not in records:  # TorchScript, or not a state
            return None
        order = bytes(reader.get_record("byteorder")).decode("ascii", "replace") if "byteorder" in records \
            else default_byteorder()
        if sys.byteorder != order:
            return None
        data = reader.get_record("data.pkl")
        check_pickle_bounds(data, opcodes=_WEIGHTS_ONLY_OPCODES)  # else the weights-only way judges it
        size = os.path.getsize(path)
        if torch.serialization.get_default_mmap_options() == torch.serialization.MAP_SHARED:
            return None
        storage = None if summary else torch.UntypedStorage.from_file(os.fspath(path), False, size)
        return (load_pickle(data, names, path, persistent=_storages(storage, reader, size), encoding="utf-8",
                            walk=False),)
    except Exception:  # _NotFast, or anything the weights-only way is to judge
        return None


def default_byteorder() -> str:
    """The byte order torch reads a file without a ``byteorder`` record in (``"?"``: neither)."""
    ends = torch.serialization.LoadEndianness
    default = torch.serialization.get_default_load_endianness()
    if default is None or default == ends.LITTLE:
        return "little"
    return "big" if default == ends.BIG else "?"
