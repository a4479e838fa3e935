"""DCP's ``.metadata`` pickle, written without importing torch.

``torch.distributed.checkpoint`` takes about 0.7 s to import on top of torch, and building
its dataclasses then pickling them costs more for a 20,000-key checkpoint. The pickle's
shape is simple and fixed: a ``Metadata`` dataclass holding dicts of DCP's metadata
dataclasses, ``torch.Size`` values, dtypes and the ``_StorageInfo`` of each record. This
module emits that shape directly, opcode by opcode (protocol 4, the format
``pickle.dump`` writes by default), naming the same globals torch's own pickle names, so
``pickle.load`` with torch installed builds exactly the objects torch would have saved
(checked against torch's classes in ``tests/test_dcp_metadata_pickle.py``).

Strings and globals are memoized by value and referenced again with ``BINGET``; nothing
else is memoized, which keeps the pickle small and the output a function of its inputs
only (the same bytes whatever objects the caller happened to share).

Example:
    >>> data = dump_metadata(
    ...     tensors={"w": ("float32", (4,), [((0,), (4,), ("__0_0.distcp", 0, 1024))])},
    ...     blobs={}, planner_data={"w": ("w",)})
    >>> data[:2]
    b'\\x80\\x04'
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"

# Opcodes (pickle protocol 4; see Lib/pickletools.py for their definitions).
_PROTO4 = b"\x80\x04"
_SHORT_BINUNICODE = b"\x8c"
_BINUNICODE = b"X"
_MEMOIZE = b"\x94"
_BINGET = b"h"
_LONG_BINGET = b"j"
_STACK_GLOBAL = b"\x93"
_EMPTY_TUPLE = b")"
_NEWOBJ = b"\x81"
_EMPTY_DICT = b"}"
_EMPTY_LIST = b"]"
_MARK = b"("
_SETITEMS = b"u"
_APPENDS = b"e"
_BUILD = b"b"
_TUPLE = b"t"
_TUPLE1 = b"\x85"
_REDUCE = b"R"
_NONE = b"N"
_NEWFALSE = b"\x89"
_STOP = b"."
_BATCH = 1000  # items per SETITEMS/APPENDS, as the stock pickler batches them

# ``TensorProperties`` pickles its memory format as an enum value; 0 is contiguous.
_CONTIGUOUS_FORMAT = 0

ChunkRecord = tuple[tuple[int, ...], tuple[int, ...], "tuple[str, int, int] | None"]
"""(offsets, sizes, (data file, offset, length) of its stored record, or None)."""


class _Emitter:
    """Appends pickle opcodes to one buffer; memoizes strings and globals by value."""

    def __init__(self) -> None:
        self.out = bytearray(_PROTO4)
        self._memo: dict[object, int] = {}
        self._fragments: dict[object, bytes] = {}

    def fragment(self, key: object, write: Callable[[], None]) -> None:
        """``write()``, or the bytes it gave last time: once every string and global it
        names is memoized, its bytes are only references and constants, the same each time."""
        cached = self._fragments.get(key)
        if cached is not None:
            self.out += cached
            return
        start, known = len(self.out), len(self._memo)
        write()
        if len(self._memo) == known:
            self._fragments[key] = bytes(self.out[start:])

    def _recall(self, key: object) -> bool:
        index = self._memo.get(key)
        if index is None:
            return False
        self.out += _BINGET + bytes((index,)) if index < 256 else _LONG_BINGET + struct.pack("<I", index)
        return True

    def _remember(self, key: object) -> None:
        self._memo[key] = len(self._memo)
        self.out += _MEMOIZE

    def string(self, text: str) -> None:
        if self._recall(text):
            return
        data = text.encode("utf-8", "surrogatepass")
        if len(data) < 256:
            self.out += _SHORT_BINUNICODE + bytes((len(data),)) + data
        else:
            self.out += _BINUNICODE + struct.pack("<I", len(data)) + data
        self._remember(text)

    def global_(self, module: str, name: str) -> None:
        key = (_STACK_GLOBAL, module, name)
        if self._recall(key):
            return
        self.string(module)
        self.string(name)
        self.out += _STACK_GLOBAL
        self._remember(key)

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes((value,))
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        elif -(1 << 31) <= value < (1 << 31):
            self.out += b"J" + struct.pack("<i", value)
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes((len(data),)) + data  # LONG1

    def size(self, dims: tuple[int, ...]) -> None:
        """``torch.Size(dims)``, as torch pickles it: ``Size`` called on a tuple."""
        self.fragment(dims, lambda: self._size(dims))

    def _size(self, dims: tuple[int, ...]) -> None:
        self.global_("torch", "Size")
        self.out += _MARK
        for dim in dims:
            self.integer(dim)
        self.out += _TUPLE + _TUPLE1 + _REDUCE

    def new(self, module: str, name: str) -> None:
        """An instance of a dataclass, created without ``__init__`` (``cls.__new__(cls)``)."""
        self.global_(module, name)
        self.out += _EMPTY_TUPLE + _NEWOBJ

    def begin_state(self) -> None:
        self.out += _EMPTY_DICT + _MARK

    def end_state(self) -> None:
        self.out += _SETITEMS + _BUILD


def _tensor_header(emit: _Emitter, dtype: str) -> None:
    """A ``TensorStorageMetadata`` up to its size: the class, then properties of ``dtype``."""
    emit.new(_METADATA_MODULE, "TensorStorageMetadata")
    emit.begin_state()
    emit.string("properties")
    emit.new(_METADATA_MODULE, "TensorProperties")
    emit.out += _MARK  # its state is a 5-tuple: dtype, layout, requires_grad, memory format, pinned
    emit.global_("torch", dtype)
    emit.global_("torch.serialization", "_get_layout")
    emit.string("torch.strided")
    emit.out += _TUPLE1 + _REDUCE + _NEWFALSE
    emit.global_(_METADATA_MODULE, "_MEM_FORMAT_ENCODING")
    emit.integer(_CONTIGUOUS_FORMAT)
    emit.out += _TUPLE1 + _REDUCE + _NEWFALSE + _TUPLE + _BUILD
    emit.string("size")


def _chunk_header(emit: _Emitter) -> None:
    emit.new(_METADATA_MODULE, "ChunkStorageMetadata")
    emit.begin_state()
    emit.string("offsets")


def _index_header(emit: _Emitter) -> None:
    emit.new(_METADATA_MODULE, "MetadataIndex")
    emit.begin_state()  # the attributes MetadataIndex.__init__ sets: offset only for tensors
    emit.string("fqn")


def _storage_header(emit: _Emitter) -> None:
    emit.new(_FILESYSTEM_MODULE, "_StorageInfo")
    emit.begin_state()
    emit.string("relative_path")


def dump_metadata(
    tensors: Mapping[str, tuple[str, Sequence[int], Sequence[ChunkRecord]]],
    blobs: Mapping[str, tuple[str, int, int]],
    planner_data: Mapping[str, Sequence[str]],
) -> bytes:
    """The bytes of DCP ``Metadata`` (version ``1.0.0``) describing a checkpoint.

    ``tensors``: key → (dtype name, shape, chunks) with each chunk's storage record;
    ``blobs``: key → (data file, offset, length) of a non-tensor entry; ``planner_data``:
    key → the path of the key in the nested state dict. Keys keep the given order.
    """
    emit = _Emitter()
    out = emit.out
    storage: list[tuple[str, tuple[int, ...] | None, int | None, tuple[str, int, int]]] = []

    emit.new(_METADATA_MODULE, "Metadata")
    emit.begin_state()
    emit.string("state_dict_metadata")
    out += _EMPTY_DICT
    entries = [(key, value) for key, value in tensors.items()] + [(key, None) for key in blobs]
    for start in range(0, len(entries), _BATCH):
        out += _MARK
        for key, tensor in entries[start:start + _BATCH]:
            emit.string(key)
            if tensor is None:
                emit.new(_METADATA_MODULE, "BytesStorageMetadata")
                storage.append((key, None, None, blobs[key]))
                continue
            dtype, shape, chunks = tensor
            emit.fragment(("properties", dtype), lambda: _tensor_header(emit, dtype))
            emit.size(tuple(shape))
            emit.string("chunks")
            out += _EMPTY_LIST
            for chunk_start in range(0, len(chunks), _BATCH):
                out += _MARK
                for index, (offsets, sizes, record) in enumerate(chunks[chunk_start:chunk_start + _BATCH],
                                                                 chunk_start):
                    emit.fragment("chunk", lambda: _chunk_header(emit))
                    emit.size(tuple(offsets))
                    emit.string("sizes")
                    emit.size(tuple(sizes))
                    emit.end_state()
                    if record is not None:
                        storage.append((key, tuple(offsets), index, record))
                out += _APPENDS
            emit.end_state()
        out += _SETITEMS

    emit.string("planner_data")
    out += _EMPTY_DICT
    keys = [key for key, _ in entries]
    for start in range(0, len(keys), _BATCH):
        out += _MARK
        for key in keys[start:start + _BATCH]:
            emit.string(key)
            out += _MARK
            for part in planner_data.get(key, (key,)):
                emit.string(part)
            out += _TUPLE
        out += _SETITEMS

    emit.string("storage_data")
    out += _EMPTY_DICT
    for start in range(0, len(storage), _BATCH):
        out += _MARK
        for key, offsets, index, (relative_path, offset, length) in storage[start:start + _BATCH]:
            emit.fragment("index", lambda: _index_header(emit))
            emit.string(key)
            emit.string("index")
            if index is None:
                out += _NONE
            else:
                emit.integer(index)
                emit.string("offset")
                emit.size(offsets or ())
            emit.end_state()
            emit.fragment("storage", lambda: _storage_header(emit))
            emit.string(relative_path)
            emit.string("offset")
            emit.integer(offset)
            emit.string("length")
            emit.integer(length)
            emit.end_state()
        out += _SETITEMS

    emit.string("storage_meta")
    out += _NONE
    emit.string("version")
    emit.string("1.0.0")
    emit.end_state()
    out += _STOP
    return bytes(out)
