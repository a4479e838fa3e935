"""DCP's ``.metadata`` pickle, written without importing ``torch.distributed.checkpoint``.

**Relies on** the pickled form of DCP's metadata, which torch does not promise to keep:
the private ``torch.distributed.checkpoint.filesystem._StorageInfo`` and
``metadata._MEM_FORMAT_ENCODING``, the private ``torch.serialization._get_layout``, and the
field names, defaults and pickling hooks of ``Metadata``, ``TensorStorageMetadata``,
``ChunkStorageMetadata``, ``TensorProperties``, ``BytesStorageMetadata`` and
``MetadataIndex``.

**Why it pays:** importing ``torch.distributed.checkpoint`` and pickling its dataclasses costs
more than writing the data of a checkpoint of many keys; the pickle is written opcode by opcode.

**When it is gone:** :func:`emitter_matches_torch` compares the installed torch's class
definitions with :data:`EXPECTED_LAYOUT` from their source, once per process; on any
difference :func:`dump_metadata` pickles torch's own dataclasses instead, and
``tests/test_compat.py`` fails loudly.

Only strings and globals are memoized (by value): the bytes are a function of the inputs only.

Example:
    >>> data = dump_metadata(
    ...     tensors={"w": ("float32", (4,), [((0,), (4,), ("__0_0.distcp", 0, 1024))])},
    ...     blobs={}, planner_data={"w": ("w",)})
    >>> data[:2]
    b'\\x80\\x04'
"""

from __future__ import annotations

import functools
import io
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, TypeVar

from ..._compat.dcp_storage import storage_info_class
from ...pickles import emit as op
from .metadata_layout import DCP_METADATA_VERSION, emitter_matches_torch

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"

_BATCH = 1000  # items per SETITEMS/APPENDS, as the stock pickler batches them
_T = TypeVar("_T")

# ``TensorProperties`` pickles its memory format as an enum value; 0 is contiguous.
_CONTIGUOUS_FORMAT = 0

ChunkRecord = tuple[tuple[int, ...], tuple[int, ...], "tuple[str, int, int] | None"]
"""(offsets, sizes, (data file, offset, length) of its stored record, or None)."""


class _Emitter(op.Opcodes):
    """Protocol 4 opcodes passed on to ``sink`` a batch at a time, with the shapes DCP's
    dataclasses pickle as; strings and globals memoized by value."""

    def __init__(self, sink: BinaryIO) -> None:
        super().__init__(4, sink)

    def size(self, dims: tuple[int, ...]) -> None:
        """``torch.Size(dims)``, as torch pickles it: ``Size`` called on a tuple."""
        self.fragment(dims, lambda: self._size(dims))

    def _size(self, dims: tuple[int, ...]) -> None:
        self.global_("torch", "Size")
        self.out += op.MARK
        for dim in dims:
            self.integer(dim)
        self.out += op.TUPLE + op.TUPLE1 + op.REDUCE

    def new(self, module: str, name: str) -> None:
        """An instance of a dataclass, created without ``__init__`` (``cls.__new__(cls)``)."""
        self.global_(module, name)
        self.out += op.EMPTY_TUPLE + op.NEWOBJ

    def begin_state(self) -> None:
        self.out += op.EMPTY_DICT + op.MARK

    def end_state(self) -> None:
        self.out += op.SETITEMS + op.BUILD


def _tensor_header(emit: _Emitter, dtype: str) -> None:
    """A ``TensorStorageMetadata`` up to its size: the class, then properties of ``dtype``."""
    _header(emit, _METADATA_MODULE, "TensorStorageMetadata", "properties")
    emit.new(_METADATA_MODULE, "TensorProperties")
    emit.out += op.MARK  # its state is a 5-tuple: dtype, layout, requires_grad, memory format, pinned
    emit.global_("torch", dtype)
    emit.global_("torch.serialization", "_get_layout")
    emit.string("torch.strided")
    emit.out += op.TUPLE1 + op.REDUCE + op.NEWFALSE
    emit.global_(_METADATA_MODULE, "_MEM_FORMAT_ENCODING")
    emit.integer(_CONTIGUOUS_FORMAT)
    emit.out += op.TUPLE1 + op.REDUCE + op.NEWFALSE + op.TUPLE + op.BUILD
    emit.string("size")


def _header(emit: _Emitter, module: str, name: str, first_field: str) -> None:
    """A dataclass instance up to its first field's value."""
    emit.new(module, name)
    emit.begin_state()
    emit.string(first_field)


_CHUNK = (_METADATA_MODULE, "ChunkStorageMetadata", "offsets")
_INDEX = (_METADATA_MODULE, "MetadataIndex", "fqn")  # MetadataIndex.__init__ sets offset only for tensors
_STORAGE = (_FILESYSTEM_MODULE, "_StorageInfo", "relative_path")


Tensors = Mapping[str, tuple[str, Sequence[int], Sequence[ChunkRecord]]]
Blobs = Mapping[str, tuple[str, int, int]]


def dump_metadata(tensors: Tensors, blobs: Blobs, planner_data: Mapping[str, Sequence[str]]) -> bytes:
    """The bytes of DCP ``Metadata`` (version ``1.0.0``), keys in the given order.

    ``tensors``: key → (dtype name, shape, chunks with their records); ``blobs``: key → a
    non-tensor entry's record; ``planner_data``: key → its path in the nested state dict.
    """
    buffer = io.BytesIO()
    write_metadata(buffer, tensors, blobs, planner_data)
    return buffer.getvalue()


def write_metadata(sink: BinaryIO, tensors: Tensors, blobs: Blobs, planner_data: Mapping[str, Sequence[str]]
                   ) -> None:
    """:func:`dump_metadata` written to ``sink`` as it is made (40 MB at 200,000 keys)."""
    if emitter_matches_torch():
        _emit_metadata(sink, tensors, blobs, planner_data)
    else:
        sink.write(_pickle_with_torch(tensors, blobs, planner_data))


def _batches(items: Iterable[_T]) -> Iterator[list[_T]]:
    """``items`` in lists of :data:`_BATCH` (the last shorter), as the stock pickler batches them."""
    items = iter(items)
    while batch := list(itertools.islice(items, _BATCH)):
        yield batch


def _storage_records(tensors: Tensors, blobs: Blobs
                     ) -> Iterator[tuple[str, tuple[int, ...] | None, int | None, tuple[str, int, int]]]:
    """Every stored record in the order ``storage_data`` lists them: the tensors' chunks, then the blobs."""
    for key, (_dtype, _shape, chunks) in tensors.items():
        for index, (offsets, _sizes, record) in enumerate(chunks):
            if record is not None:
                yield key, tuple(offsets), index, record
    for key, record in blobs.items():
        yield key, None, None, record


def _emit_metadata(sink: BinaryIO, tensors: Tensors, blobs: Blobs, planner_data: Mapping[str, Sequence[str]]
                   ) -> None:
    emit = _Emitter(sink)
    out = emit.out

    emit.new(_METADATA_MODULE, "Metadata")
    emit.begin_state()
    emit.string("state_dict_metadata")
    out += op.EMPTY_DICT
    entries: Iterable[tuple[str, tuple[str, Sequence[int], Sequence[ChunkRecord]] | None]] = itertools.chain(
        tensors.items(), ((key, None) for key in blobs))
    for batch in _batches(entries):
        out += op.MARK
        for key, tensor in batch:
            emit.string(key)
            if tensor is None:
                emit.new(_METADATA_MODULE, "BytesStorageMetadata")
                continue
            dtype, shape, chunks = tensor
            emit.fragment(("properties", dtype), functools.partial(_tensor_header, emit, dtype))
            emit.size(tuple(shape))
            emit.string("chunks")
            out += op.EMPTY_LIST
            for chunk_batch in _batches(chunks):
                out += op.MARK
                for offsets, sizes, _record in chunk_batch:
                    emit.fragment("chunk", lambda: _header(emit, *_CHUNK))
                    emit.size(tuple(offsets))
                    emit.string("sizes")
                    emit.size(tuple(sizes))
                    emit.end_state()
                out += op.APPENDS
            emit.end_state()
        out += op.SETITEMS
        emit.spill()

    emit.string("planner_data")
    out += op.EMPTY_DICT
    for keys in _batches(itertools.chain(tensors, blobs)):
        out += op.MARK
        for key in keys:
            emit.string(key)
            out += op.MARK
            for part in planner_data.get(key, (key,)):
                emit.string(part)
            out += op.TUPLE
        out += op.SETITEMS
        emit.spill()

    emit.string("storage_data")
    out += op.EMPTY_DICT
    for records in _batches(_storage_records(tensors, blobs)):
        out += op.MARK
        for key, chunk_offsets, chunk_index, (relative_path, offset, length) in records:
            emit.fragment("index", lambda: _header(emit, *_INDEX))
            emit.string(key)
            emit.string("index")
            if chunk_index is None:
                out += op.NONE
            else:
                emit.integer(chunk_index)
                emit.string("offset")
                emit.size(chunk_offsets or ())
            emit.end_state()
            emit.fragment("storage", lambda: _header(emit, *_STORAGE))
            emit.string(relative_path)
            emit.string("offset")
            emit.integer(offset)
            emit.string("length")
            emit.integer(length)
            emit.end_state()
        out += op.SETITEMS
        emit.spill()

    emit.string("storage_meta")
    out += op.NONE
    emit.string("version")
    emit.string(DCP_METADATA_VERSION)
    emit.end_state()
    out += op.STOP
    emit.spill(least=0)


def _pickle_with_torch(tensors: Tensors, blobs: Blobs, planner_data: Mapping[str, Sequence[str]]) -> bytes:
    """What :func:`_emit_metadata` describes, built from torch's classes and pickled by
    ``pickle`` (protocol 4); imports ``torch.distributed.checkpoint``."""
    import pickle

    import torch
    from torch.distributed.checkpoint import metadata as dcp

    storage_info = storage_info_class()
    same: dict[str, str] = {}

    def text(value: str) -> str:  # equal strings as one object: the bytes depend on values only
        return same.setdefault(value, value)

    state: dict[str, dcp.TensorStorageMetadata | dcp.BytesStorageMetadata] = {}
    storage: dict[dcp.MetadataIndex, Any] = {}
    for key, (dtype, shape, chunks) in tensors.items():
        key = text(key)
        boxes = [dcp.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                 for offsets, sizes, _ in chunks]
        state[key] = dcp.TensorStorageMetadata(
            dcp.TensorProperties(dtype=getattr(torch, dtype)), torch.Size(shape), boxes)
        for index, (offsets, _sizes, record) in enumerate(chunks):
            if record is not None:
                storage[dcp.MetadataIndex(key, offsets, index)] = storage_info(text(record[0]), *record[1:])
    for key, (relative_path, offset, length) in blobs.items():
        key = text(key)
        state[key] = dcp.BytesStorageMetadata()
        storage[dcp.MetadataIndex(key)] = storage_info(text(relative_path), offset, length)
    planner = {key: tuple(text(part) for part in planner_data.get(key, (key,))) for key in state}
    metadata = dcp.Metadata(state_dict_metadata=dict(state), planner_data=planner, storage_data=storage,
                            version=DCP_METADATA_VERSION)
    return pickle.dumps(metadata, protocol=4)
