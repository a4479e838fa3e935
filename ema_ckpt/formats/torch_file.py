"""``torch.save`` files holding a state dict (``.pt``, ``.pth``, ``.bin``), read without unpickling code.

What ``consolidate(src, "model.pt")`` writes, and what ``pytorch_model.bin`` files hold: a
zip whose ``data.pkl`` maps keys to tensors and whose ``data/<n>`` members hold each storage's
bytes. The pickle goes through the restricted unpickler of :mod:`ema_ckpt.torch_records` (only the
globals a plain tensor needs); tensors are read straight from their storage members with
``pread``, box by box, so memory holds the box asked for. Nested dicts are flattened with
``.``; values that are not tensors are left out. Keys that share a storage (tied weights)
each read their own view of it.

Example:
    >>> with TorchFileReader("ema.pt") as reader:                 # doctest: +SKIP
    ...     reader.read("fc.weight", Box((0, 0), (2, 8))).shape
    torch.Size([2, 8])
"""

from __future__ import annotations

import math
import os
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._lazy import torch
from ..dtypes import itemsize, torch_dtype
from ..errors import CheckpointFormatError
from ..layout import Box, TensorSpec
from ..torch_records import TensorRecord, load_state_dict_records, member_start, pread_into
from .base import CheckpointFormat, CheckpointReader, deliver, register_format

SUFFIXES = (".pt", ".pth", ".bin")
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_PICKLE_BYTES = 64 << 20  # pickled records of a few million keys
_MAX_REPEATED_BYTES = 64 << 20  # an expanded (stride-0) view may be at most this large


def _is_torch_file(path: Path) -> bool:
    if not (path.is_file() and path.suffix.lower() in SUFFIXES):
        return False
    try:
        with path.open("rb") as handle:
            return handle.read(4) == _ZIP_MAGIC
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class _Stored:
    record: TensorRecord
    data_offset: int  # absolute offset of the storage's first byte in the file
    path: tuple[str, ...]  # how the key was nested: ("model", "fc.weight")


def _dtype(path: Path, key: str, name: str) -> torch.dtype:
    try:
        return torch_dtype(name)
    except (KeyError, AttributeError, TypeError):
        raise CheckpointFormatError(path, f"key {key!r}: dtype {name} is not supported") from None


class TorchFileReader(CheckpointReader):
    """Reader for one ``torch.save`` state-dict file (see the module docstring)."""

    format_name = "torch"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.step: int | None = None
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise CheckpointFormatError(self.path, f"cannot read ({err.strerror})") from None
        try:
            self._size = os.fstat(self._fd).st_size
            self._tensors = self._index()
            self._specs = {
                key: TensorSpec(key, t.record.size, _dtype(self.path, key, t.record.dtype))
                for key, t in self._tensors.items()
            }
        except BaseException:
            os.close(self._fd)
            raise

    def _index(self) -> dict[str, _Stored]:
        try:
            with self.path.open("rb") as handle, zipfile.ZipFile(handle) as archive:
                infos = archive.infolist()
                pkl = next(
                    (i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None
                )
                if pkl is None:
                    raise CheckpointFormatError(self.path, "no data.pkl: not a torch.save file")
                if pkl.file_size > _MAX_PICKLE_BYTES:
                    raise CheckpointFormatError(self.path, f"data.pkl of {pkl.file_size} bytes is too large")
                records = load_state_dict_records(archive.read(pkl), str(self.path))
                prefix = pkl.filename[: -len("data.pkl")]
                members = {i.filename: i for i in infos}
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise CheckpointFormatError(self.path, f"not a readable torch.save zip ({err})") from None
        if not records:
            raise CheckpointFormatError(self.path, "holds no tensors")
        starts: dict[str, int] = {}
        tensors = {}
        for key, (nesting, record) in records.items():
            member = members.get(prefix + "data/" + record.storage_key)
            if member is None:
                raise CheckpointFormatError(
                    self.path, f"key {key!r}: storage {record.storage_key} is missing"
                )
            if member.compress_type != zipfile.ZIP_STORED:
                raise CheckpointFormatError(self.path, f"key {key!r}: compressed storage is not supported")
            nbytes = record.storage_numel * itemsize(record.dtype)
            if member.file_size != nbytes:
                raise CheckpointFormatError(
                    self.path,
                    f"key {key!r}: storage holds {member.file_size} bytes, its tensor needs {nbytes}",
                )
            if member.filename not in starts:
                starts[member.filename] = self._data_start(member)
            if starts[member.filename] + nbytes > self._size:
                raise CheckpointFormatError(
                    self.path, f"truncated: key {key!r} ends past the end of the file"
                )
            span = _span(record)
            if record.storage_offset < 0 or record.storage_offset + span > record.storage_numel:
                raise CheckpointFormatError(self.path, f"key {key!r}: view outside its storage")
            numel = math.prod(record.size)
            if numel > record.storage_numel and numel * itemsize(record.dtype) > _MAX_REPEATED_BYTES:
                # a stride-0 view of a few bytes claiming terabytes: refused, not expanded
                raise CheckpointFormatError(
                    self.path,
                    f"key {key!r}: a {list(record.size)} view of {record.storage_numel} stored elements",
                )
            tensors[key] = _Stored(record, starts[member.filename], nesting)
        return tensors

    def _data_start(self, member: zipfile.ZipInfo) -> int:
        start = member_start(self._fd, 0, self._size, member.header_offset)
        if start is None:
            raise CheckpointFormatError(self.path, f"corrupt zip header of {member.filename}")
        return start

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def layout(self, key: str) -> Sequence[Box]:
        spec = self._specs[key]
        return [Box.full(spec.shape)] if spec.numel else []

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(key, box, self._read(key, box), out)

    def _read(self, key: str, box: Box) -> torch.Tensor:
        stored = self._tensors[key]
        record, spec = stored.record, self._specs[key]
        size = itemsize(record.dtype)
        if record.is_contiguous and box.sizes and box.sizes[1:] == spec.shape[1:]:
            row = math.prod(spec.shape[1:])
            out = torch.empty(box.sizes, dtype=spec.dtype)
            start = stored.data_offset + (record.storage_offset + box.offsets[0] * row) * size
            self._pread_into(out, start)
            return out
        # Any other view: read the storage span the box reaches, from its first element to its last.
        first = record.storage_offset + sum(o * st for o, st in zip(box.offsets, record.stride, strict=True))
        reach = (
            1 + sum((n - 1) * st for n, st in zip(box.sizes, record.stride, strict=True)) if box.numel else 0
        )
        flat = torch.empty(reach, dtype=spec.dtype)
        if reach:
            self._pread_into(flat, stored.data_offset + first * size)
        return (
            torch.as_strided(flat, box.sizes, record.stride).clone() if box.numel else flat.reshape(box.sizes)
        )

    def _pread_into(self, out: torch.Tensor, offset: int) -> None:
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        if not pread_into(self._fd, view, offset):
            raise CheckpointFormatError(self.path, f"truncated: expected {len(view)} bytes at offset {offset}")

    def root_of(self, key: str) -> str:
        """The top-level name ``key`` was saved under (``model`` of ``{"model": …}``)."""
        return self._tensors[key].path[0]

    def container_of(self, key: str) -> str | None:
        """The dict ``key`` was nested in at the top level, or None for a flat state dict."""
        path = self._tensors[key].path
        return path[0] if len(path) > 1 else None

    whole_file_records = True

    def stored_records(self) -> Sequence[tuple[str, int, int]]:
        """The file itself: one ``torch.save`` zip."""
        return [("", 0, self._size)]

    def info(self) -> dict[str, Any]:
        storages = Counter(t.record.storage_key for t in self._tensors.values())
        return {
            "file": self.path.name,
            "storages": len(storages),
            "keys_sharing_storage": sum(n for n in storages.values() if n > 1),
        }

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _span(record: TensorRecord) -> int:
    """Elements of storage a view reaches, from its first element."""
    if any(d == 0 for d in record.size):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(record.size, record.stride, strict=True))


def open_torch_file(path: Path) -> TorchFileReader:
    return TorchFileReader(path)


FORMAT = register_format(CheckpointFormat("torch", detect=_is_torch_file, open=open_torch_file))
