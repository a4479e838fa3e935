"""Inert data written back as a pickle: what a single file held beside its weights, carried on.

:mod:`.tree` reads a file's pickle into plain data and :class:`~.tree.Opaque` records; this
module writes such a tree back as a protocol-2 pickle, opcode by opcode, without importing
or calling anything: each record becomes the global, the call and the state it was read
from, so the loader that reads the output (Lightning's ``load_from_checkpoint`` reading
``hyper_parameters``) gets back what the trainer saved. Tensors are not written here (the
weights have their own writer); a state dict's pickle made elsewhere is spliced in whole
(:func:`wrap_pickle`), after every memo reference of the part written here, so its own memo
indices stand.

Example:
    >>> import pickle
    >>> pickle.loads(dumps_inert({"epoch": 3, "tags": ["a", 1.5], "name": b"x"}))
    {'epoch': 3, 'tags': ['a', 1.5], 'name': b'x'}
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Mapping
from typing import Any

from ..dtypes import DtypeName
from .pickles import TensorRecord
from .tree import Opaque

_PROTO = b"\x80\x02"
_STOP = b"."
_MARK = b"("
_MAX_DEPTH = 200


def _global(module: str, name: str) -> bytes:
    if "\n" in module or "\n" in name:
        raise ValueError(f"a global name holds a newline: {module!r}.{name!r}")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    size = (value.bit_length() + 8) // 8
    data = value.to_bytes(size, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data if len(data) < 256 else b"\x8b" + struct.pack("<i", len(data)) + data


def _str(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


class _Emitter:
    """The opcodes of one object. Containers are memoized as the pickler does (stored as soon as
    they exist, before their contents), so shared parts are written once and a container that
    holds itself (OmegaConf's nodes point at their parents) is written as it was read."""

    def __init__(self) -> None:
        self.memo: dict[int, int] = {}
        self.building: set[int] = set()  # tuples and call arguments: not memoized until complete
        self.kept: list[Any] = []  # keeps memoized objects alive, so their ids stay theirs

    def emit(self, obj: Any, depth: int = 0) -> bytes:
        if depth > _MAX_DEPTH:
            raise ValueError("nesting too deep to write back")
        if obj is None:
            return b"N"
        if obj is True or obj is False:
            return b"\x88" if obj else b"\x89"
        if isinstance(obj, DtypeName):
            return _global("torch", str(obj))
        if type(obj) is int:
            return _int(obj)
        if type(obj) is float:
            return b"G" + struct.pack(">d", obj)
        if type(obj) is str:
            return _str(obj)
        if isinstance(obj, (bytes, bytearray)):  # as protocol 2 writes bytes: _codecs.encode(latin-1 text)
            return _global("_codecs", "encode") + _MARK + _str(bytes(obj).decode("latin-1")) + _str("latin1") + b"tR"
        if isinstance(obj, TensorRecord):
            raise ValueError("a tensor outside the weights cannot be written back here")
        if isinstance(obj, type) and issubclass(obj, Opaque):
            return _global(*obj.global_name.rsplit(".", 1))
        if id(obj) in self.memo:
            return _get(self.memo[id(obj)])
        if id(obj) in self.building:
            raise ValueError("the data holds itself inside a tuple or a call's arguments")
        return self._container(obj, depth + 1)

    def _put(self, obj: Any) -> bytes:
        index = self.memo[id(obj)] = len(self.memo)
        self.kept.append(obj)
        return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def _args(self, obj: Any, items: Any, depth: int) -> bytes:
        self.building.add(id(obj))
        try:
            return _MARK + b"".join(self.emit(a, depth) for a in items) + b"t"
        finally:
            self.building.discard(id(obj))

    def _container(self, obj: Any, depth: int) -> bytes:
        if isinstance(obj, Opaque):
            module, name = obj.global_name.rsplit(".", 1)
            args = self._args(obj, obj.args, depth)
            if obj.kwargs:  # protocol 4's NEWOBJ_EX, as copyreg spells it for older protocols
                kwargs = self._args(obj, [dict(obj.kwargs)], depth)[1:-1]
                out = _global("copyreg", "__newobj_ex__") + _MARK + _global(module, name) + args + kwargs + b"tR"
            else:
                out = _global(module, name) + args + (b"R" if obj.called else b"\x81")
            out += self._put(obj)
            if len(obj):
                out += self._items(obj, depth)
            if obj.appended:
                out += _MARK + b"".join(self.emit(v, depth) for v in obj.appended) + b"e"
            if obj.state is not None:
                out += self.emit(obj.state, depth) + b"b"
            return out
        if isinstance(obj, collections.OrderedDict):
            return _global("collections", "OrderedDict") + b")R" + self._put(obj) + self._items(obj, depth)
        if isinstance(obj, dict):
            return b"}" + self._put(obj) + self._items(obj, depth)
        if isinstance(obj, list):
            head = b"]" + self._put(obj)
            return head + (_MARK + b"".join(self.emit(v, depth) for v in obj) + b"e" if obj else b"")
        if isinstance(obj, tuple):
            return self._args(obj, obj, depth) + self._put(obj)
        if isinstance(obj, (set, frozenset)):  # as protocol 2 writes them: set([items])
            items = b"]" + (_MARK + b"".join(self.emit(v, depth) for v in obj) + b"e" if obj else b"")
            return _global("builtins", type(obj).__name__) + _MARK + items + b"tR" + self._put(obj)
        raise ValueError(f"a {type(obj).__name__} cannot be written back")

    def _items(self, mapping: dict[Any, Any], depth: int) -> bytes:
        if not mapping:
            return b""
        pairs: Any = dict.items(mapping)  # a record's own items, whatever it defines
        return _MARK + b"".join(self.emit(k, depth) + self.emit(v, depth) for k, v in pairs) + b"u"


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def dumps_inert(obj: Any) -> bytes:
    """A protocol-2 pickle of inert data (see the module docstring).

    Raises:
        ValueError: a tensor, a cycle, or an object of another kind.
    """
    return _PROTO + _Emitter().emit(obj) + _STOP


def wrap_pickle(inner: bytes, key: str, beside: Mapping[str, Any]) -> bytes:
    """A pickle of ``{**beside, key: <what inner unpickles to>}``: ``inner`` (a whole pickle, a
    state dict of tensors) spliced in as it is.

    Example:
        >>> import pickle
        >>> pickle.loads(wrap_pickle(pickle.dumps({"w": 1}, 2), "state_dict", {"epoch": 3}))
        {'epoch': 3, 'state_dict': {'w': 1}}
    """
    if not (inner.startswith(_PROTO) and inner.endswith(_STOP)):
        raise ValueError("not a protocol-2 pickle")
    emitter = _Emitter()
    items = b"".join(emitter.emit(k) + emitter.emit(v) for k, v in beside.items() if k != key)
    return _PROTO + b"}" + _MARK + items + _str(key) + inner[len(_PROTO):-len(_STOP)] + b"u" + _STOP


__all__ = ["dumps_inert", "wrap_pickle"]
