"""Load a DeepSpeed ``.pt`` object from object storage for its structure only, by ranged reads.

:func:`load_ds_structure` reads the zip directory and ``data.pkl`` by ranged requests and
unpickles it as :func:`~.unpickle.load_ds_file` does, every storage an empty ``meta`` one of its
size; :func:`meta_member` then says where a tensor's bytes lie in the object.

Example:
    >>> structure = load_ds_structure(location)  # doctest: +SKIP
    >>> name, start, size, crc = meta_member(structure, structure.state["module"]["w"])  # doctest: +SKIP
"""

from __future__ import annotations

import pickle
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, cast

from ..._compat import torch_load
from ..._lazy import torch
from ...errors import CheckpointFormatError
from ...pickles.load import load_weights_only
from ...pickles.rules import first_line
from ...storage import Location, Source, open_structure
from ...torch_records import FileWindow, member_start
from .unpickle import STAND_INS, check_magic

__all__ = ["RemoteStructure", "load_ds_structure", "meta_member"]


@dataclass(eq=False)
class RemoteStructure:
    """A ``.pt`` object loaded for its structure only: ``state`` with every tensor on ``meta``;
    ``members``: name → ``(local header offset, method, size, CRC-32)``; ``storages``: a ``meta``
    storage's ``id`` → its member; ``source``: what member headers are read through later."""

    path: Location
    state: Any
    members: dict[str, tuple[int, int, int, int]]
    storages: dict[int, str]
    source: Source
    _kept: list[Any] = field(default_factory=list)  # the storages, so that their ids stay theirs
    _starts: dict[str, int] = field(default_factory=dict)  # member -> where its data starts, checked

    def close(self) -> None:
        self.source.close()


def load_ds_structure(path: Location, source: Source | None = None) -> RemoteStructure:
    """Load a DeepSpeed ``.pt`` object without reading its tensors' bytes (``source``: ``path``
    opened already by :func:`open_structure`).

    Raises:
        CheckpointNotFoundError: no such object.
        UnsafePickleError: the pickle refers to a global outside the allowlist; nothing ran.
        CheckpointFormatError: the object is truncated, corrupt, a legacy ``torch.save``
            file, or written on a machine of the other byte order.
    """
    source = source if source is not None else open_structure(path)
    try:
        if not check_magic(path, source.pread(4, 0)):
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
            raise CheckpointFormatError(path, f"truncated or corrupt torch.save file ({first_line(str(err))})") \
                from None
        if order.decode("ascii", "replace") != sys.byteorder:
            raise CheckpointFormatError(path, f"written {order.decode('ascii', 'replace')}-endian, which is read "
                                              "from a local copy only")
        prefix = pkl[: -len("data.pkl")]
        members = {i.filename: (i.header_offset, i.compress_type, i.file_size, i.CRC) for i in infos}
        storages: dict[int, str] = {}
        kept: list[Any] = []
        state = load_weights_only(data, str(path), stand_ins=STAND_INS, persistent=_to_meta(prefix, storages, kept))
        return RemoteStructure(path, state, members, storages, source, kept)
    except BaseException:
        source.close()
        raise


def _to_meta(prefix: str, storages: dict[int, str], kept: list[Any]) -> Callable[[Any], Any]:
    """A ``persistent_load`` that makes each storage an empty ``meta`` one."""
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
            typed[key] = torch_load.typed_storage(storage, dtype)
        return typed[key]

    return persistent_load


def meta_member(loaded: RemoteStructure, t: torch.Tensor) -> tuple[str, int, int, int]:
    """(name, data start, size, CRC-32) of the zip member holding ``t``'s storage: stored
    uncompressed, exactly the storage's bytes (its header is read once).

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
