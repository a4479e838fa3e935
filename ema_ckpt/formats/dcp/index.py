"""Indexing parsed DCP metadata: every tensor's stored chunks, checked to cover it exactly once."""

from __future__ import annotations

import stat
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from ...dtypes import DtypeName, itemsize, torch_dtype
from ...errors import CheckpointFormatError
from ...layout import Box, TensorSpec, boxes_cover
from ...storage import Location
from ..options import ReadOptions
from .metadata import METADATA_FILE, KeyPaths, StoredChunk, load_metadata, metadata_int, planner_data_of

PackedChunks = dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str, int, int]]]
"""Stored chunks as plain tuples (offsets, sizes, file, offset, length): what workers exchange."""


class Structure:
    """The parts of a parsed index that checkpoints of one training run have in common (keys,
    shapes, dtypes, byte layout): readers whose parts are equal share one, read-only."""

    __slots__ = ("__weakref__", "chunks", "packed", "planner_data", "specs", "starts", "stored")

    def __init__(self, planner_data: KeyPaths, stored: dict[str, tuple[tuple[int, ...], str]],
                 chunks: dict[str, list[StoredChunk]], starts: dict[str, tuple[tuple[int, ...], int]],
                 packed: PackedChunks | None = None) -> None:
        self.planner_data, self.stored, self.chunks, self.starts = planner_data, stored, chunks, starts
        self.specs: StoredSpecs | None = None  # made on first use
        self.packed = packed

    def packed_chunks(self) -> PackedChunks:
        if self.packed is None:
            self.packed = {key: [(c.box.offsets, c.box.sizes, c.file, c.offset, c.length) for c in chunks]
                           for key, chunks in self.chunks.items()}
        return self.packed

    def same_as(self, planner_data: KeyPaths, stored: dict[str, tuple[tuple[int, ...], str]],
                chunks: dict[str, list[StoredChunk]] | None = None, packed: PackedChunks | None = None) -> bool:
        """Whether these parts equal this structure's (``chunks`` or their ``packed`` form), in
        the same key order too: the order of the keys decides a run's plan and its output bytes."""
        # equal items in equal order: one pass each, sizes first
        if list(stored.items()) != list(self.stored.items()) or not planner_data.same_as(self.planner_data):
            return False
        if packed is not None:
            return packed is self.packed or (packed == self.packed_chunks() and list(packed) == list(self.stored))
        return chunks == self.chunks and list(chunks) == list(self.stored)


class StoredSpecs(Mapping[str, TensorSpec]):
    """{key: TensorSpec}, each made when looked up (200,000 kept would cost about 18 MiB).

    Example:
        >>> StoredSpecs({"w": ((2, 3), "float32")})["w"].shape
        (2, 3)
    """

    __slots__ = ("_stored",)

    def __init__(self, stored: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        self._stored = stored

    def __getitem__(self, key: str) -> TensorSpec:
        shape, dtype = self._stored[key]
        return TensorSpec(key, shape, torch_dtype(dtype))

    def __contains__(self, key: object) -> bool:
        return key in self._stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


_recent: list[weakref.ref[Structure]] = []
"""The structures of the readers alive in this process, newest last (a few at most)."""
_RECENT_LIMIT = 4


def shared_structure(planner_data: KeyPaths, stored: dict[str, tuple[tuple[int, ...], str]],
                     chunks: dict[str, list[StoredChunk]] | None = None, packed: PackedChunks | None = None
                     ) -> Structure:
    """The structure of a live reader equal to these parts (``chunks``, or ``packed`` from a
    worker), else a new one made of them."""
    _recent[:] = [ref for ref in _recent if ref() is not None]
    for ref in reversed(_recent):
        found = ref()
        if found is not None and found.same_as(planner_data, stored, chunks, packed):
            return found
    if chunks is None:
        assert packed is not None
        chunks = {key: [StoredChunk(Box(offsets, sizes), file, offset, length)
                        for offsets, sizes, file, offset, length in items]
                  for key, items in packed.items()}
    structure = Structure(planner_data, stored, chunks, starts_of(stored, chunks), packed)
    _recent.append(weakref.ref(structure))
    del _recent[:-_RECENT_LIMIT]
    return structure


def starts_of(stored: dict[str, tuple[tuple[int, ...], str]], chunks: dict[str, list[StoredChunk]]
              ) -> dict[str, tuple[tuple[int, ...], int]]:
    """Per key of several chunks, its chunks' dim-0 offsets (sorted) and the longest dim-0 size:
    for bisection (a key of one chunk needs none)."""
    seen: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int]] = {}
    starts = {}
    for key, items in chunks.items():
        if len(items) < 2:
            continue
        found = ((tuple(c.box.offsets[0] for c in items), max((c.box.sizes[0] for c in items), default=0))
                 if stored[key][0] else ((), 0))
        starts[key] = seen.setdefault(found, found)  # one object per distinct value: most are ((0,), n)
    return starts


_DTYPE_NAMES: dict[str, str] = {}
"""One plain ``str`` per dtype name (a key's stored pair holds it)."""


def _ints(values: Any, seen: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[int, ...]:
    """``values`` as a checked tuple of ints, one object per distinct value in ``seen``."""
    found = tuple(metadata_int(v) for v in values)
    return seen.setdefault(found, found)


class MetadataIndex:
    """What parsing ``.metadata`` gives a :class:`~.reader.DcpReader` (a base class of it)."""

    path: Location
    read_options: ReadOptions
    metadata_files: list[Location]
    _version: Any
    _starts: dict[str, tuple[tuple[int, ...], int]]
    _structure: Structure

    def _parse(self) -> None:
        metadata, self.metadata_files = load_metadata(self.path, self.read_options.inert_globals)
        self._version = getattr(metadata, "version", None)
        self.planner_data: KeyPaths = planner_data_of(metadata)
        self.non_tensor_keys: list[str] = []
        self._stored: dict[str, tuple[tuple[int, ...], str]] = {}  # key → (shape, dtype name)
        self._chunks: dict[str, list[StoredChunk]] = {}
        self._bytes_records: dict[str, tuple[str, int, int]] = {}
        self._file_ends: dict[str, int] = {}  # data file → the end of its last record
        self._records_all: list[tuple[str, int, int]] = []  # stored records no chunk holds (see _index)
        try:
            self._index(metadata)
        except (AttributeError, TypeError, ValueError, OverflowError) as err:
            raise CheckpointFormatError(
                self.metadata_files[0], f"malformed DCP metadata ({type(err).__name__}: {err})"
            ) from None
        self._check_file_sizes()
        self._adopt(shared_structure(self.planner_data, self._stored, chunks=self._chunks))

    def _adopt(self, structure: Structure) -> None:
        self._structure = structure
        self.planner_data, self._stored = structure.planner_data, structure.stored
        self._chunks, self._starts = structure.chunks, structure.starts

    def _check_file_sizes(self) -> None:
        """Every data file the metadata names is there and as long as its last record needs
        (a checkpoint cut short anywhere is refused before anything of it is used)."""
        for file, end in sorted(self._file_ends.items()):
            full = self.path / file
            try:
                info = full.stat()
            except FileNotFoundError:
                raise CheckpointFormatError(full, "data file named by the metadata is missing") from None
            except OSError as err:
                raise CheckpointFormatError(full, f"cannot stat data file ({err.strerror})") from None
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointFormatError(full, "not a regular file")
            size = info.st_size
            if size < end:
                raise CheckpointFormatError(
                    full, f"truncated: {size} bytes, but the metadata has records up to byte {end}"
                )

    def _index(self, metadata: Any) -> None:
        """Every tensor's chunks from ``metadata``, whose entries are removed as they are used:
        the parsed metadata and the index never both exist whole (at 200,000 keys, each is
        over 100 MiB)."""
        tensor_records, blobs = self._storage_index(metadata)
        entries = metadata.state_dict_metadata
        seen: dict[tuple[int, ...], tuple[int, ...]] = {}  # one object per distinct shape or offset
        pairs: dict[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]] = {}  # and per (shape, dtype)
        for key in list(entries):
            entry = entries.pop(key)
            if not isinstance(key, str):
                raise TypeError(f"key {key!r} is not a string")
            if not hasattr(entry, "chunks"):
                self.non_tensor_keys.append(key)
                if key in blobs:
                    self._bytes_records[key] = blobs[key]
                continue
            shape = _ints(entry.size, seen)
            if any(d < 0 for d in shape):
                raise ValueError(f"key {key!r}: negative size {list(shape)}")
            dtype = entry.properties.dtype
            if not isinstance(dtype, DtypeName):
                raise TypeError(f"key {key!r}: dtype {dtype!r} is not a torch dtype")
            chunks = []
            for chunk in entry.chunks:
                offsets, sizes = _ints(chunk.offsets, seen), _ints(chunk.sizes, seen)
                box = Box.full(shape) if sizes == shape and not any(offsets) else Box(offsets, sizes)
                if any(s < 0 for s in box.sizes) or box.numel == 0:
                    if any(s < 0 for s in box.sizes):
                        raise ValueError(f"key {key!r}: negative chunk size {list(box.sizes)}")
                    continue
                where = tensor_records.pop((key, box.offsets), None)
                if where is None:
                    raise CheckpointFormatError(
                        self.metadata_files[0], f"key {key!r}: chunk at {box.offsets} has no storage entry"
                    )
                if box.numel * itemsize(dtype) > where[2]:
                    raise ValueError(f"key {key!r}: chunk at {list(box.offsets)} is larger than its record")
                chunks.append(StoredChunk(box, *where))
            if not boxes_cover(shape, [c.box for c in chunks]):
                raise CheckpointFormatError(
                    self.metadata_files[0],
                    f"key {key!r}: stored chunks do not cover shape {list(shape)} exactly once"
                    + (" (a rank's __<r>.metadata file is missing?)" if len(self.metadata_files) > 1 or
                       self.metadata_files[0].name != METADATA_FILE else ""),
                )
            chunks.sort(key=lambda c: c.box.offsets[:1])
            stored = (shape, _DTYPE_NAMES.setdefault(dtype, str(dtype)))
            self._stored[key] = pairs.setdefault(stored, stored)
            self._chunks[key] = chunks
        # the records no chunk holds (empty chunks, records no entry names): stored_records() adds the rest
        self._records_all = [*tensor_records.values(), *blobs.values()]

    def _storage_index(self, metadata: Any) -> tuple[dict[Any, tuple[str, int, int]], dict[Any, tuple[str, int, int]]]:
        tensor: dict[Any, tuple[str, int, int]] = {}
        blobs: dict[Any, tuple[str, int, int]] = {}
        storage_data = metadata.storage_data or {}
        while storage_data:  # emptied as it is read: see _index
            index, info = storage_data.popitem()
            rel = info.relative_path
            if not isinstance(rel, str) or "/" in rel or "\\" in rel or "\0" in rel or rel in {"", ".", ".."}:
                raise CheckpointFormatError(
                    self.metadata_files[0], f"storage path {rel!r} leaves the checkpoint directory"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointFormatError(
                    self.metadata_files[0],
                    f"key {index.fqn!r}: transformed records ({info.transform_descriptors}) are not supported",
                )
            where = (rel, metadata_int(info.offset), metadata_int(info.length))
            if where[1] < 0 or where[2] < 0:
                raise ValueError(f"key {index.fqn!r}: negative storage offset or length")
            self._file_ends[rel] = max(self._file_ends.get(rel, 0), where[1] + where[2])
            if index.offset is None:
                blobs[index.fqn] = where
            else:
                tensor[(index.fqn, tuple(int(o) for o in index.offset))] = where
        return tensor, blobs

