"""Inert data written back as a pickle: what a single file held beside its weights, carried on.

:mod:`.tree` reads a file's pickle into plain data and :class:`~.tree.Opaque` records; this
module writes such a tree back as a protocol-2 pickle, opcode by opcode, without importing
or calling anything: each record becomes the global, the call and the state it was read
from, so the loader that reads the output (Lightning's ``load_from_checkpoint`` reading
``hyper_parameters``) gets back what the trainer saved. Tensors are not written here (the
weights have their own writer); a state dict's pickle made elsewhere is spliced in whole
(:func:`wrap_pickle`). No memo is used, so a spliced pickle's own memo indices stand.

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


def _tuple(items: Any, depth: int) -> bytes:
    return _MARK + b"".join(_emit(i, depth) for i in items) + b"t"


class _Emitter:
    """The opcodes of one object (recursive; shared parts written again, cycles refused)."""

    def __init__(self) -> None:
        self.active: set[int] = set()

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
        if id(obj) in self.active:
            raise ValueError("the data holds itself")
        self.active.add(id(obj))
        try:
            return self._container(obj, depth + 1)
        finally:
            self.active.discard(id(obj))

    def _container(self, obj: Any, depth: int) -> bytes:
        if isinstance(obj, Opaque):
            module, name = obj.global_name.rsplit(".", 1)
            args = _MARK + b"".join(self.emit(a, depth) for a in obj.args) + b"t"
            if obj.kwargs:  # protocol 4's NEWOBJ_EX, as copyreg spells it for older protocols
                out = (_global("copyreg", "__newobj_ex__") + _MARK + _global(module, name) + args
                       + self.emit(dict(obj.kwargs), depth) + b"tR")
            else:
                out = _global(module, name) + args + (b"R" if obj.called else b"\x81")
            if len(obj):
                out += self._items(obj, depth)
            if obj.appended:
                out += _MARK + b"".join(self.emit(v, depth) for v in obj.appended) + b"e"
            if obj.state is not None:
                out += self.emit(obj.state, depth) + b"b"
            return out
        if isinstance(obj, collections.OrderedDict):
            return _global("collections", "OrderedDict") + b")R" + self._items(obj, depth)
        if isinstance(obj, dict):
            return b"}" + self._items(obj, depth)
        if isinstance(obj, list):
            return b"]" + (_MARK + b"".join(self.emit(v, depth) for v in obj) + b"e" if obj else b"")
        if isinstance(obj, tuple):
            return _MARK + b"".join(self.emit(v, depth) for v in obj) + b"t"
        if isinstance(obj, (set, frozenset)):  # as protocol 2 writes them: set([items])
            items = b"]" + (_MARK + b"".join(self.emit(v, depth) for v in obj) + b"e" if obj else b"")
            return _global("builtins", type(obj).__name__) + _MARK + items + b"tR"
        raise ValueError(f"a {type(obj).__name__} cannot be written back")

    def _items(self, mapping: dict[Any, Any], depth: int) -> bytes:
        if not mapping:
            return b""
        pairs: Any = dict.items(mapping)  # a record's own items, whatever it defines
        return _MARK + b"".join(self.emit(k, depth) + self.emit(v, depth) for k, v in pairs) + b"u"


def _emit(obj: Any, depth: int) -> bytes:
    return _Emitter().emit(obj, depth)


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
