"""The header of one ``.safetensors`` file, read and validated (no tensor data read).

8-byte little-endian length, then JSON: every tensor's dtype, shape and data offsets, and
``__metadata__``. The offsets must agree with dtype × shape and tile the data area exactly, so
a truncated or corrupt file fails here with its own path. Files whose headers have the same
bytes (a run's checkpoints of one layout) share one parsed layout in memory.

Example:
    >>> header = read_header(Path("ckpt/model.safetensors"))      # doctest: +SKIP
    >>> header.tensors["lm_head.weight"].shape                    # doctest: +SKIP
    (32000, 4096)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError
from ...layout import TensorSpec
from ...storage import Location, Readable, close_readable, open_structure, pread, readable_size

__all__ = ["FileHeader", "dtypes", "read_header"]

_MAX_HEADER = 100_000_000  # the limit safetensors itself enforces

# Safetensors dtype names torch can hold; float8 and unsigned kinds only where this
# torch has them. Sub-byte kinds (F4, F6_*) pack several values per byte: not supported.
_DTYPE_NAMES = (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"),
    ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("U8", "uint8"),
    ("BOOL", "bool"), ("C64", "complex64"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
)  # fmt: skip


@functools.cache
def dtypes() -> dict[str, torch.dtype]:
    return {name: getattr(torch, attr) for name, attr in _DTYPE_NAMES if hasattr(torch, attr)}


@dataclass(frozen=True, slots=True)
class FileHeader:
    """The validated header of one ``.safetensors`` file."""

    path: Location
    size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorSpec]
    offsets: dict[str, int] = field(default_factory=dict)
    """Each tensor's first byte in the file (the header included)."""
    shared: object = field(default=None, repr=False, compare=False)
    """Keeps the parsed layout (shared with files of the same header) alive; ``tensors`` and
    ``offsets`` are its dicts: never changed in place."""


def read_header(file: Location) -> FileHeader:
    """Parse and validate the header of one ``.safetensors`` file (no tensor data read).

    Raises:
        CheckpointFormatError: truncated file, bad JSON, unknown dtype, or data offsets
            that disagree with dtype × shape or do not tile the data area exactly.
    """
    try:
        with _opened(file) as f:
            size = readable_size(f)
            head = pread(f, 8, 0)
            if len(head) < 8:
                raise CheckpointFormatError(file, f"truncated: {size} bytes, no header length")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise CheckpointFormatError(file, f"header length {length} is implausible")
            if 8 + length > size:
                raise CheckpointFormatError(
                    file, f"truncated: header needs {8 + length} bytes, file has {size}"
                )
            raw = pread(f, length, 8)
    except OSError as err:
        raise CheckpointFormatError(file, f"cannot read ({err.strerror})") from None
    layout_key = (hashlib.blake2b(raw, digest_size=16).digest(), length, size)
    shared = _PARSED.get(layout_key)
    if shared is not None:  # the same header as a checkpoint opened before: its layout, validated
        return FileHeader(file, size, dict(shared.metadata), shared.tensors, shared.offsets, shared)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(file, f"header is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(file, "header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(file, "__metadata__ is not a string-to-string map")
    data_size = size - 8 - length
    tensors: dict[str, TensorSpec] = {}
    starts: dict[str, int] = {}
    extents: list[tuple[int, int, str]] = []
    for key, entry in doc.items():
        spec, begin, end = _parse_entry(file, key, entry)
        starts[key] = 8 + length + begin
        if end > data_size:
            raise CheckpointFormatError(
                file,
                f"truncated: tensor {key!r} ends at data byte {end}, the file holds {data_size}",
            )
        tensors[key] = spec
        extents.append((begin, end, key))
    position = 0
    for begin, end, key in sorted(extents):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise CheckpointFormatError(file, f"tensor {key!r} at data byte {begin} {what}")
        position = end
    if position != data_size:
        raise CheckpointFormatError(file, f"{data_size - position} bytes after the last tensor")
    parsed = _Parsed(dict(metadata), tensors, starts)
    _PARSED[layout_key] = parsed
    return FileHeader(file, size, dict(metadata), tensors, starts, parsed)


class _Parsed:
    """A validated header's layout, shared by every file whose header has the same bytes and
    size (a run's checkpoints, usually): parsed once, held in memory once."""

    __slots__ = ("__weakref__", "metadata", "offsets", "tensors")

    def __init__(self, metadata: dict[str, str], tensors: dict[str, TensorSpec], offsets: dict[str, int]) -> None:
        self.metadata, self.tensors, self.offsets = metadata, tensors, offsets


_PARSED: weakref.WeakValueDictionary[tuple[bytes, int, int], _Parsed] = weakref.WeakValueDictionary()
"""Headers parsed and still in use, by (digest of the header bytes, header length, file size)."""


@contextlib.contextmanager
def _opened(file: Location) -> Iterator[Readable]:
    handle = open_structure(file)
    try:
        yield handle
    finally:
        close_readable(handle)


def _parse_entry(file: Location, key: str, entry: Any) -> tuple[TensorSpec, int, int]:
    if not isinstance(entry, dict):
        raise CheckpointFormatError(file, f"tensor {key!r}: entry is not an object")
    name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = dtypes().get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointFormatError(file, f"tensor {key!r}: dtype {name!r} is not supported")
    # a dim beyond 2**48 is nonsense even beside a zero dim (numel 0) and overflows torch
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and 0 <= d < 1 << 48 for d in shape)):
        raise CheckpointFormatError(file, f"tensor {key!r}: bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointFormatError(file, f"tensor {key!r}: bad data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointFormatError(
            file,
            f"tensor {key!r}: data_offsets span {end - begin} bytes, {name} {shape} needs {nbytes}",
        )
    return TensorSpec(key, tuple(shape), dtype), begin, end
