"""Hugging Face safetensors checkpoints: one file, or shards with an index.

A path is a ``.safetensors`` or ``*.safetensors.index.json`` file, or a folder holding
``model.safetensors``, ``model.safetensors.index.json``, its only index, or its only
``*.safetensors`` file (never a lone shard without its index).

The index is authoritative: every key it lists must be in the shard it names, and every shard
must hold only the keys the index gives it. Tensors are read lazily, each one stored chunk.
``step`` is a folder's ``trainer_state.json`` ``global_step``; the first header's
``__metadata__`` is offered as a carried file (:mod:`.metadata`).

Example:
    >>> with SafetensorsReader("runs/a/checkpoint-500") as reader:   # doctest: +SKIP
    ...     spec = reader.specs()["lm_head.weight"]
    ...     rows = reader.read("lm_head.weight", Box((0, 0), (16, spec.shape[1])))
    >>> rows.shape                                                     # doctest: +SKIP
    torch.Size([16, 768])
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError, CheckpointNotFoundError
from ...layout import Box, TensorSpec
from ...storage import Location, Source, as_path, open_readable
from ..base import (
    SAFETENSORS_METADATA_FILE,
    CarriedFile,
    CheckpointFormat,
    CheckpointReader,
    StoredView,
    deliver,
    register_format,
    trainer_state_step,
)
from .header import FileHeader, read_header, sorted_specs
from .metadata import metadata_file

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"-\d+-of-\d+(?:\.[0-9A-Za-z-]+)?\.safetensors$")  # tagged on object storage
def _is_candidate(p: Location, suffix: str) -> bool:
    return p.name.endswith(suffix) and not p.name.startswith(".") and p.is_file()


def _locate(path: Location) -> tuple[Location | None, list[Location]] | None:
    """``(index, files)`` for a recognised path; ``files`` is empty when indexed."""
    if path.is_file():  # a file named on purpose: its suffix in any case, as outputs are chosen
        name = path.name.lower()
        if name.endswith(INDEX_SUFFIX):
            return path, []
        return (None, [path]) if name.endswith(SUFFIX) else None
    if not path.is_dir():
        return None
    if (path / SINGLE_FILE).is_file():
        return None, [path / SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        return path / INDEX_FILE, []
    indexes = [p for p in path.iterdir() if _is_candidate(p, INDEX_SUFFIX)]
    if len(indexes) == 1:
        return indexes[0], []
    files = [p for p in path.iterdir() if _is_candidate(p, SUFFIX)]
    if not indexes and len(files) == 1 and not _SHARD_NAME.search(files[0].name):
        return None, files
    return None


def read_index(index: Location) -> tuple[dict[str, str], dict[str, Any]]:
    """``(weight_map, metadata)`` of an HF index file, validated (``CheckpointFormatError``)."""
    try:
        doc = json.loads(index.read_bytes())
    except OSError as err:
        raise CheckpointFormatError(index, f"cannot read ({err.strerror})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(index, f"not a JSON file ({err})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(index, "no 'weight_map' object")
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in {"", ".", ".."}:
            raise CheckpointFormatError(index, f"key {key!r} maps to {name!r}, not a file in this folder")
    metadata = doc.get("metadata")
    return weight_map, metadata if isinstance(metadata, dict) else {}


def missing_shards(path: Location) -> list[str]:
    """Shard files an index names but that do not exist (empty when not indexed)."""
    located = _locate(path)
    if located is None or located[0] is None:
        return []
    try:
        weight_map, _ = read_index(located[0])
    except CheckpointFormatError:
        return []
    return _missing(located[0], weight_map)


def _missing(index: Location, weight_map: Mapping[str, str]) -> list[str]:
    return sorted(n for n in set(weight_map.values()) if not (index.parent / n).is_file())


def _incomplete(path: Location) -> str | None:
    missing = missing_shards(path)
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        return f"index names {len(missing)} missing shard file(s): {shown} (save in progress?)"
    if path.is_dir() and _locate(path) is None:
        shards = [p for p in path.iterdir() if _is_candidate(p, SUFFIX) and _SHARD_NAME.search(p.name)]
        if shards:
            return f"{len(shards)} shard file(s) but no {INDEX_SUFFIX} (save in progress?)"
    return None


class SafetensorsReader(CheckpointReader):
    """Reader for one safetensors checkpoint: each file opened once (memory-mapped where local);
    ``read`` may be called from several threads."""

    format_name = "safetensors"

    def __init__(self, path: str | Location) -> None:
        self.path = as_path(path)
        if not self.path.exists():
            raise CheckpointNotFoundError(self.path, "no such file or directory")
        located = _locate(self.path)
        if located is None:
            raise CheckpointNotFoundError(
                self.path, f"no {SINGLE_FILE}, {INDEX_FILE}, or single *{SUFFIX} / *{INDEX_SUFFIX} file"
            )
        self.index, files = located
        self.index_metadata: dict[str, Any] = {}
        self._where: Mapping[str, Location] = {}  # key -> file, when indexed
        self._readables: dict[Location, Source] = {}
        self._specs: dict[str, TensorSpec]
        self._stored: StoredView
        if self.index is None:  # one file: its header's dicts serve, shared with files of the same header
            self.headers = [read_header(files[0])]
            self._starts: Mapping[str, int] = self.headers[0].offsets
            self._specs, self._stored = sorted_specs(self.headers[0])
        else:
            self.headers, self._where = self._load_index(self.index)
            self._starts = {key: start for header in self.headers for key, start in header.offsets.items()}
            merged = {key: spec for header in self.headers for key, spec in header.tensors.items()}
            self._specs = dict(sorted(merged.items()))
            self._stored = StoredView(self._specs)
        self.step: int | None = trainer_state_step(self.path) if self.path.is_dir() else None
        self._sizes = {header.path: header.size for header in self.headers}
        self._lock = threading.Lock()

    def _load_index(self, index: Location) -> tuple[list[FileHeader], dict[str, Location]]:
        weight_map, self.index_metadata = read_index(index)
        missing = _missing(index, weight_map)
        if missing:
            raise CheckpointNotFoundError(
                index, f"names missing shard file(s): {', '.join(missing)} (save in progress?)"
            )
        headers = [read_header(index.parent / name) for name in sorted(set(weight_map.values()))]
        by_name = {h.path.name: h for h in headers}
        for key, name in weight_map.items():
            if key not in by_name[name].tensors:
                raise CheckpointFormatError(
                    index, f"maps {key!r} to {index.parent / name}, which does not hold it"
                )
        for header in headers:
            for key in header.tensors:
                if weight_map.get(key) != header.path.name:
                    elsewhere = weight_map.get(key)
                    where = f"maps it to {elsewhere}" if elsewhere else "does not list it"
                    raise CheckpointFormatError(index, f"{header.path} holds {key!r} but the index {where}")
        return headers, {key: index.parent / name for key, name in weight_map.items()}

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def stored(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype name)}: one object for readers of one parsed layout (an identity test)."""
        return self._stored

    def layout(self, key: str) -> Sequence[Box]:
        spec = self._specs[key]
        return [Box.full(spec.shape)] if spec.numel else []

    @classmethod
    def step_of(cls, path: Location) -> int | None:
        """``trainer_state.json``'s ``global_step`` beside the weights, as :attr:`step`."""
        return trainer_state_step(path) if path.is_dir() else None

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(key, box, self._read(key, box), out)

    def _read(self, key: str, box: Box) -> torch.Tensor:
        spec = self._specs[key]
        if len(box.sizes) != len(spec.shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, spec.shape, strict=True)
        ):
            raise ValueError(f"{key!r}: {box} is outside shape {list(spec.shape)}")
        if box.numel == 0:
            return torch.empty(box.sizes, dtype=spec.dtype)
        file = self.headers[0].path if self.index is None else self._where[key]
        source = self._readable(file)
        itemsize = spec.dtype.itemsize
        row = math.prod(spec.shape[1:]) * itemsize if spec.shape else itemsize
        first, count = (box.offsets[0], box.sizes[0]) if spec.shape else (0, 1)
        offset = self._starts[spec.key] + first * row
        whole = box.numel * itemsize <= _SMALL_READ and tuple(box.sizes) == spec.shape
        # a small tensor whole by one read (for many small tensors, a tenth of the cost of slicing
        # a memory map); else the rows the box spans, from the map where the file has one
        mapped = None if whole or not spec.shape else source.mapped()
        if mapped is not None:
            return _copied_from_map(mapped, offset, spec, box)
        rows = torch.empty(count * row, dtype=torch.uint8)
        if not source.fill(memoryview(rows.numpy()), offset):
            raise CheckpointFormatError(file, f"tensor {spec.key!r}: truncated at byte {offset}")
        values = rows.view(spec.dtype).reshape((count, *spec.shape[1:]) if spec.shape else ())
        inner = values[(slice(None), *box.slices()[1:])] if spec.shape else values
        return inner if inner.is_contiguous() else inner.contiguous()

    def _readable(self, file: Location) -> Source:
        """``file`` opened once, refused when it changed size since its header was read."""
        with self._lock:
            source = self._readables.get(file)
            if source is not None:
                return source
            try:
                source = open_readable(file)
            except FileNotFoundError:
                raise CheckpointNotFoundError(file, "vanished after the checkpoint was opened") from None
            except OSError as err:
                raise CheckpointFormatError(file, f"cannot open ({err})") from None
            if source.size != self._sizes[file]:
                source.close()
                raise CheckpointFormatError(file, "changed since the checkpoint was opened")
            self._readables[file] = source
            return source

    def info(self) -> dict[str, Any]:
        dtypes = Counter(str(s.dtype).removeprefix("torch.") for s in self._specs.values())
        return {
            "files": len(self.headers),
            "total_bytes": sum(h.size for h in self.headers),
            "tensors": len(self._specs),
            "dtypes": dict(sorted(dtypes.items())),
            "indexed": self.index is not None,
            "index": self.index.name if self.index else None,
            "index_metadata": self.index_metadata,
            "metadata": self.headers[0].metadata if self.headers else {},
            "step": self.step,
        }

    def carried_files(self) -> Sequence[CarriedFile]:
        """The folder's :data:`~ema_ckpt.formats.base.CARRIED_FILES`, and the first header's
        ``__metadata__`` as :data:`~ema_ckpt.formats.base.SAFETENSORS_METADATA_FILE` (never a file beside)."""
        files = [f for f in super().carried_files() if f.name != SAFETENSORS_METADATA_FILE]
        offered = metadata_file(self.headers[0].metadata) if self.headers else None
        return [*files, offered] if offered is not None else files

    def close(self) -> None:
        with self._lock:
            readables, self._readables = list(self._readables.values()), {}
        for source in readables:
            source.close()


def _copied_from_map(mapped: memoryview, offset: int, spec: TensorSpec, box: Box) -> torch.Tensor:
    """``box`` of a tensor whose rows start at byte ``offset`` of the map, sliced as bytes, copied once."""
    import numpy as np

    size = spec.dtype.itemsize
    count = box.sizes[0]
    shape = (count, *spec.shape[1:-1], spec.shape[-1] * size) if len(spec.shape) > 1 else (count * size,)
    rows = np.frombuffer(mapped, dtype=np.uint8, count=math.prod(shape), offset=offset).reshape(shape)
    if len(spec.shape) > 1:
        last = slice(box.offsets[-1] * size, (box.offsets[-1] + box.sizes[-1]) * size)
        rows = rows[(slice(None), *box.slices()[1:-1], last)]
    return torch.from_numpy(rows.copy()).view(spec.dtype).reshape(box.sizes)


_SMALL_READ = 1 << 20  # whole tensors up to this size: one pread (larger ones and boxes: the memory map)

FORMAT = register_format(
    CheckpointFormat("safetensors", detect=lambda path: _locate(path) is not None and not missing_shards(path),
                     open=lambda path, _read: SafetensorsReader(path),
                     incomplete=_incomplete, step_of=SafetensorsReader.step_of)
)
