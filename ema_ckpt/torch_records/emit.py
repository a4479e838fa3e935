"""Inert data written back as a pickle: what a single file held beside its weights, carried on.

A :mod:`.tree` is written back as a protocol-2 pickle, opcode by opcode, nothing imported or
called: each :class:`~.tree.Opaque` record becomes the global, call and state it was read from.
A state dict's pickle made elsewhere is spliced in whole (:func:`wrap_pickle`).

Example:
    >>> import pickle
    >>> pickle.loads(dumps_inert({"epoch": 3, "tags": ["a", 1.5], "name": b"x"}))
    {'epoch': 3, 'tags': ['a', 1.5], 'name': b'x'}
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from ..dtypes import DtypeName
from ..pickles import emit as op
from .pickles import TensorRecord
from .tree import Opaque

_MAX_DEPTH = 200


class _Writer(op.Opcodes):
    """The opcodes of one object (protocol 2), containers memoized as the pickler does (before
    their contents), so shared and self-holding parts are written as they were read."""

    def __init__(self) -> None:
        super().__init__(2)
        self.building: set[int] = set()  # tuples and call arguments: not memoized until complete
        self.kept: list[Any] = []  # keeps memoized objects alive, so their ids stay theirs

    def emit(self, obj: Any, depth: int = 0) -> None:
        if depth > _MAX_DEPTH:
            raise ValueError("nesting too deep to write back")
        if obj is None:
            self.out += op.NONE
        elif obj is True or obj is False:
            self.out += op.NEWTRUE if obj else op.NEWFALSE
        elif isinstance(obj, DtypeName):
            self.global_("torch", str(obj))
        elif type(obj) is int:
            self.integer(obj)
        elif type(obj) is float:
            self.floating(obj)
        elif type(obj) is str:
            self.text(obj)
        elif isinstance(obj, (bytes, bytearray)):  # as protocol 2 writes bytes: _codecs.encode(latin-1 text)
            self.global_("_codecs", "encode")
            self.out += op.MARK
            self.text(bytes(obj).decode("latin-1"))
            self.text("latin1")
            self.out += op.TUPLE + op.REDUCE
        elif isinstance(obj, TensorRecord):
            raise ValueError("a tensor outside the weights cannot be written back here")
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            self.global_(*obj.global_name.rsplit(".", 1))
        elif self.recall(id(obj)):
            pass
        elif id(obj) in self.building:
            raise ValueError("the data holds itself inside a tuple or a call's arguments")
        else:
            self._container(obj, depth + 1)

    def _put(self, obj: Any) -> None:
        self.remember(id(obj))
        self.kept.append(obj)

    def _args(self, obj: Any, items: Any, depth: int, *, marked: bool = True) -> None:
        self.building.add(id(obj))
        try:
            self._run(items, depth, op.TUPLE if marked else b"")
        finally:
            self.building.discard(id(obj))

    def _run(self, items: Any, depth: int, end: bytes) -> None:
        """MARK, each of ``items``, then ``end`` (only the items where ``end`` is empty)."""
        if end:
            self.out += op.MARK
        for item in items:
            self.emit(item, depth)
        self.out += end

    def _container(self, obj: Any, depth: int) -> None:
        if isinstance(obj, Opaque):
            if obj.kwargs:  # protocol 4's NEWOBJ_EX, as copyreg spells it for older protocols
                self.global_("copyreg", "__newobj_ex__")
                self.out += op.MARK
            self.global_(*obj.global_name.rsplit(".", 1))
            self._args(obj, obj.args, depth)
            if obj.kwargs:
                self._args(obj, [dict(obj.kwargs)], depth, marked=False)
                self.out += op.TUPLE + op.REDUCE
            else:
                self.out += op.REDUCE if obj.called else op.NEWOBJ
            self._put(obj)
            if len(obj):
                self._items(obj, depth)
            if obj.appended:
                self._run(obj.appended, depth, op.APPENDS)
            if obj.state is not None:
                self.emit(obj.state, depth)
                self.out += op.BUILD
        elif isinstance(obj, collections.OrderedDict):
            self.global_("collections", "OrderedDict")
            self.out += op.EMPTY_TUPLE + op.REDUCE
            self._put(obj)
            self._items(obj, depth)
        elif isinstance(obj, dict):
            self.out += op.EMPTY_DICT
            self._put(obj)
            self._items(obj, depth)
        elif isinstance(obj, list):
            self.out += op.EMPTY_LIST
            self._put(obj)
            if obj:
                self._run(obj, depth, op.APPENDS)
        elif isinstance(obj, tuple):
            self._args(obj, obj, depth)
            self._put(obj)
        elif isinstance(obj, (set, frozenset)):  # as protocol 2 writes them: set([items])
            self.global_("builtins", type(obj).__name__)
            self.out += op.MARK + op.EMPTY_LIST
            if obj:
                self._run(obj, depth, op.APPENDS)
            self.out += op.TUPLE + op.REDUCE
            self._put(obj)
        else:
            raise ValueError(f"a {type(obj).__name__} cannot be written back")

    def _items(self, mapping: dict[Any, Any], depth: int) -> None:
        if mapping:  # a record's own items, whatever it defines
            self._run((part for pair in dict.items(mapping) for part in pair), depth, op.SETITEMS)


def dumps_inert(obj: Any) -> bytes:
    """A protocol-2 pickle of inert data (``ValueError`` for a tensor, a cycle, or another kind)."""
    writer = _Writer()
    writer.emit(obj)
    return bytes(writer.out + op.STOP)


def wrap_pickle(inner: bytes, key: str, beside: Mapping[str, Any]) -> bytes:
    """A pickle of ``{**beside, key: <what inner unpickles to>}``: ``inner`` (a whole pickle, a
    state dict of tensors) spliced in as it is.

    Example:
        >>> import pickle
        >>> pickle.loads(wrap_pickle(pickle.dumps({"w": 1}, 2), "state_dict", {"epoch": 3}))
        {'epoch': 3, 'state_dict': {'w': 1}}
    """
    writer = _Writer()
    head = bytes(writer.out)
    if not (inner.startswith(head) and inner.endswith(op.STOP)):
        raise ValueError("not a protocol-2 pickle")
    writer.out += op.EMPTY_DICT + op.MARK
    for k, v in beside.items():
        if k != key:
            writer.emit(k)
            writer.emit(v)
    writer.text(key)
    return bytes(writer.out + inner[len(head) : -len(op.STOP)] + op.SETITEMS + op.STOP)


__all__ = ["dumps_inert", "wrap_pickle"]
