"""The header of one ``.safetensors`` file, read and validated (no tensor data read).

Each tensor's data offsets must tile the data area exactly; files whose headers have the same
bytes share one parsed layout in memory.

Example:
    >>> header = read_header(Path("ckpt/model.safetensors"))      # doctest: +SKIP
    >>> header.tensors["lm_head.weight"].shape                    # doctest: +SKIP
    (32000, 4096)
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import json.decoder
import json.scanner
import math
import struct
import weakref
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, cast

from ..._lazy import torch
from ...dtypes import SAFETENSORS_CODES
from ...errors import CheckpointFormatError
from ...layout import TensorSpec
from ...storage import Location, open_structure
from ..base import StoredView

__all__ = ["FileHeader", "dtypes", "read_header", "read_metadata", "sorted_specs"]

_MAX_HEADER = 100_000_000  # the limit safetensors itself enforces

# Safetensors dtype names torch can hold: those the writer stores, and float8 kinds it reads
# only; float8 and unsigned kinds only where this torch has them. Sub-byte kinds (F4, F6_*)
# pack several values per byte: not supported.
_DTYPE_NAMES = (
    *((code, name) for name, code in SAFETENSORS_CODES.items()),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E8M0", "float8_e8m0fnu"),
)


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
    offsets: dict[str, int]
    """Each tensor's first byte in the file (the header included)."""
    shared: _Parsed = field(repr=False, compare=False)
    """Keeps the shared parsed layout alive (``tensors`` and ``offsets`` are its dicts: never changed)."""


def read_header(file: Location) -> FileHeader:
    """Parse and validate the header of one ``.safetensors`` file (``CheckpointFormatError``)."""
    # the first use imports torch, which keeps the frames on the stack then (and their last
    # locals) for good: here, before this frame holds the header's bytes
    dtypes()
    try:
        with open_structure(file) as f:
            size = f.size
            head = f.pread(8, 0)
            if len(head) < 8:
                raise CheckpointFormatError(file, f"truncated: {size} bytes, no header length")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise CheckpointFormatError(file, f"header length {length} is implausible")
            if 8 + length > size:
                raise CheckpointFormatError(
                    file, f"truncated: header needs {8 + length} bytes, file has {size}"
                )
            raw = f.pread(length, 8)
    except OSError as err:
        raise CheckpointFormatError(file, f"cannot read ({err.strerror})") from None
    layout_key = (hashlib.blake2b(raw, digest_size=16).digest(), length, size)
    shared = _PARSED.get(layout_key)
    if shared is not None:  # the same header as a checkpoint opened before: its layout, validated
        return FileHeader(file, size, dict(shared.metadata), shared.tensors, shared.offsets, shared)
    data_size = size - 8 - length
    tensors: dict[str, TensorSpec] = {}
    starts: dict[str, int] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape
    tiled = [0, True]  # the end of the data so far, and whether each tensor began where the last ended

    def add(key: str, entry: Any) -> None:
        spec, begin, end = _parse_entry(file, key, entry, shapes)
        starts[key] = 8 + length + begin
        if end > data_size:
            raise CheckpointFormatError(
                file,
                f"truncated: tensor {key!r} ends at data byte {end}, the file holds {data_size}",
            )
        tensors[key] = spec
        if begin != tiled[0]:
            tiled[1] = False
        tiled[0] = end

    streamed = _streamed(raw, add, starts)
    if streamed is None:  # not read by the stream: the whole document, as json reads it
        tensors.clear()
        starts.clear()
        tiled[:] = [0, True]
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointFormatError(file, f"header is not JSON ({err})") from None
        if not isinstance(doc, dict):
            raise CheckpointFormatError(file, "header is not a JSON object")
        metadata = _checked_metadata(file, doc.pop("__metadata__", None))
        for key, entry in doc.items():
            add(key, entry)
        del doc
    del raw
    if streamed is not None:
        metadata = _checked_metadata(file, streamed[0])
        if streamed[1] is not None:
            raise streamed[1]
    position = tiled[0] if tiled[1] else _tile(file, tensors, starts, 8 + length)
    if position != data_size:
        raise CheckpointFormatError(file, f"{data_size - position} bytes after the last tensor")
    parsed = _Parsed(dict(metadata), tensors, starts)
    _PARSED[layout_key] = parsed
    return FileHeader(file, size, dict(metadata), tensors, starts, parsed)


def _tile(file: Location, tensors: dict[str, TensorSpec], starts: dict[str, int], data_start: int) -> int:
    """The end of the data area the tensors cover, sorted by offset (refusing overlaps and gaps)."""
    extents = sorted((starts[key] - data_start, starts[key] - data_start + spec.nbytes, key)
                     for key, spec in tensors.items())
    position = 0
    for begin, end, key in extents:
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise CheckpointFormatError(file, f"tensor {key!r} at data byte {begin} {what}")
        position = end
    return position


class _Parsed:
    """A validated header's layout, shared by every file whose header has the same bytes and size."""

    __slots__ = ("__weakref__", "metadata", "offsets", "sorted", "tensors")

    def __init__(self, metadata: dict[str, str], tensors: dict[str, TensorSpec], offsets: dict[str, int]) -> None:
        self.metadata, self.tensors, self.offsets = metadata, tensors, offsets
        self.sorted: tuple[dict[str, TensorSpec], StoredView] | None = None


def sorted_specs(header: FileHeader) -> tuple[dict[str, TensorSpec], StoredView]:
    """``header.tensors`` in key order, and their :class:`~..base.StoredView`: the same objects
    for every file of one parsed layout."""
    parsed = header.shared
    if parsed.sorted is None:
        in_order = all(a < b for a, b in itertools.pairwise(parsed.tensors))  # as writers save them
        specs = parsed.tensors if in_order else dict(sorted(parsed.tensors.items()))
        parsed.sorted = specs, StoredView(specs)
    return parsed.sorted


_PARSED: weakref.WeakValueDictionary[tuple[bytes, int, int], _Parsed] = weakref.WeakValueDictionary()
"""Headers parsed and still in use, by (digest of the header bytes, header length, file size)."""


def read_metadata(file: Location) -> dict[str, str]:
    """The header's ``__metadata__`` alone: tensors not checked, torch not imported (discovery
    reads it from every file of a folder on every run); else ``CheckpointFormatError``."""
    with open_structure(file) as f:
        size = f.size
        head = f.pread(8, 0)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise CheckpointFormatError(file, "not a safetensors file (its header length does not fit)")
        raw = f.pread(length, 8)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(file, f"header is not JSON ({err})") from None
    return _checked_metadata(file, doc.get("__metadata__") if isinstance(doc, dict) else None)


def _checked_metadata(file: Location, metadata: Any) -> dict[str, str]:
    metadata = metadata or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(file, "__metadata__ is not a string-to-string map")
    return metadata


_scan_value: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))
_WHITESPACE = " \t\n\r"
_skip = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]


def _streamed(raw: bytes, add: Callable[[str, Any], None], added: Container[str]
              ) -> tuple[Any, CheckpointFormatError | None] | None:
    """The header's top-level object read entry by entry, each tensor's entry given to ``add``
    as soon as it is parsed (the whole document at once holds about half a KiB a tensor):
    ``(the __metadata__ value, the first error add raised)``.

    None where ``json.loads`` might read it otherwise (not UTF-8, malformed, a key twice): the
    caller then parses the whole. After an error from ``add`` the rest is only parsed.
    """
    if json.detect_encoding(raw) != "utf-8":
        return None
    try:
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    metadata: Any = None
    seen_metadata = False
    failure: CheckpointFormatError | None = None
    refused: set[str] = set()  # keys after an error
    scanstring = json.decoder.scanstring  # type: ignore[attr-defined]
    try:
        at = _skip(text, 0).end()
        if text[at] != "{":
            return None
        at = _skip(text, at + 1).end()
        if text[at] == "}":
            at += 1
        else:
            while True:
                if text[at] != '"':
                    return None
                key, at = scanstring(text, at + 1)
                if text[at] != ":":
                    at = _skip(text, at).end()
                    if text[at] != ":":
                        return None
                at += 1
                if text[at] in _WHITESPACE:
                    at = _skip(text, at).end()
                value, at = _scan_value(text, at)
                if key == "__metadata__":
                    if seen_metadata:
                        return None
                    seen_metadata, metadata = True, value
                elif key in added or key in refused:
                    return None
                elif failure is None:
                    try:
                        add(key, value)
                    except CheckpointFormatError as err:
                        failure = err
                        refused.add(key)
                else:
                    refused.add(key)
                del value
                if text[at] in _WHITESPACE:
                    at = _skip(text, at).end()
                if text[at] == "}":
                    at += 1
                    break
                if text[at] != ",":
                    return None
                at = _skip(text, at + 1).end()
        if _skip(text, at).end() != len(text):
            return None
    except (IndexError, StopIteration, ValueError):
        return None
    return metadata, failure


def _parse_entry(file: Location, key: str, entry: Any,
                 shapes: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[TensorSpec, int, int]:
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
    dims = tuple(shape)
    return TensorSpec(key, shapes.setdefault(dims, dims), dtype), begin, end
