"""Inert data written back as a pickle: what a single file held beside its weights, carried on.

:mod:`.tree` reads a file's pickle into plain data and :class:`~.tree.Opaque` records; this
module writes such a tree back as a protocol-2 pickle, opcode by opcode
(:mod:`ema_ckpt.pickles.emit`), without importing or calling anything: each record becomes the
global, the call and the state it was read from, so the loader that reads the output
(Lightning's ``load_from_checkpoint`` reading ``hyper_parameters``) gets back what the trainer
saved. Tensors are not written here (the weights have their own writer); a state dict's pickle
made elsewhere is spliced in whole (:func:`wrap_pickle`), after every memo reference of the
part written here, so its own memo indices stand.

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


class _Writer:
    """The opcodes of one object (protocol 2). Containers are memoized as the pickler does
    (stored as soon as they exist, before their contents), so shared parts are written once and
    a container that holds itself (OmegaConf's nodes point at their parents) is written as it was read."""

    def __init__(self) -> None:
        self.ops = op.Opcodes(2)
        self.building: set[int] = set()  # tuples and call arguments: not memoized until complete
        self.kept: list[Any] = []  # keeps memoized objects alive, so their ids stay theirs

    def emit(self, obj: Any, depth: int = 0) -> None:
        ops = self.ops
        if depth > _MAX_DEPTH:
            raise ValueError("nesting too deep to write back")
        if obj is None:
            ops.out += op.NONE
        elif obj is True or obj is False:
            ops.out += op.NEWTRUE if obj else op.NEWFALSE
        elif isinstance(obj, DtypeName):
            ops.global_("torch", str(obj))
        elif type(obj) is int:
            ops.integer(obj)
        elif type(obj) is float:
            ops.floating(obj)
        elif type(obj) is str:
            ops.text(obj)
        elif isinstance(obj, (bytes, bytearray)):  # as protocol 2 writes bytes: _codecs.encode(latin-1 text)
            ops.global_("_codecs", "encode")
            ops.out += op.MARK
            ops.text(bytes(obj).decode("latin-1"))
            ops.text("latin1")
            ops.out += op.TUPLE + op.REDUCE
        elif isinstance(obj, TensorRecord):
            raise ValueError("a tensor outside the weights cannot be written back here")
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            ops.global_(*obj.global_name.rsplit(".", 1))
        elif ops.recall(id(obj)):
            pass
        elif id(obj) in self.building:
            raise ValueError("the data holds itself inside a tuple or a call's arguments")
        else:
            self._container(obj, depth + 1)

    def _put(self, obj: Any) -> None:
        self.ops.remember(id(obj))
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
            self.ops.out += op.MARK
        for item in items:
            self.emit(item, depth)
        self.ops.out += end

    def _container(self, obj: Any, depth: int) -> None:
        ops = self.ops
        if isinstance(obj, Opaque):
            module, name = obj.global_name.rsplit(".", 1)
            if obj.kwargs:  # protocol 4's NEWOBJ_EX, as copyreg spells it for older protocols
                ops.global_("copyreg", "__newobj_ex__")
                ops.out += op.MARK
                ops.global_(module, name)
                self._args(obj, obj.args, depth)
                self._args(obj, [dict(obj.kwargs)], depth, marked=False)
                ops.out += op.TUPLE + op.REDUCE
            else:
                ops.global_(module, name)
                self._args(obj, obj.args, depth)
                ops.out += op.REDUCE if obj.called else op.NEWOBJ
            self._put(obj)
            if len(obj):
                self._items(obj, depth)
            if obj.appended:
                self._run(obj.appended, depth, op.APPENDS)
            if obj.state is not None:
                self.emit(obj.state, depth)
                ops.out += op.BUILD
        elif isinstance(obj, collections.OrderedDict):
            ops.global_("collections", "OrderedDict")
            ops.out += op.EMPTY_TUPLE + op.REDUCE
            self._put(obj)
            self._items(obj, depth)
        elif isinstance(obj, dict):
            ops.out += op.EMPTY_DICT
            self._put(obj)
            self._items(obj, depth)
        elif isinstance(obj, list):
            ops.out += op.EMPTY_LIST
            self._put(obj)
            if obj:
                self._run(obj, depth, op.APPENDS)
        elif isinstance(obj, tuple):
            self._args(obj, obj, depth)
            self._put(obj)
        elif isinstance(obj, (set, frozenset)):  # as protocol 2 writes them: set([items])
            ops.global_("builtins", type(obj).__name__)
            ops.out += op.MARK + op.EMPTY_LIST
            if obj:
                self._run(obj, depth, op.APPENDS)
            ops.out += op.TUPLE + op.REDUCE
            self._put(obj)
        else:
            raise ValueError(f"a {type(obj).__name__} cannot be written back")

    def _items(self, mapping: dict[Any, Any], depth: int) -> None:
        if mapping:  # a record's own items, whatever it defines
            self._run((part for pair in dict.items(mapping) for part in pair), depth, op.SETITEMS)


def dumps_inert(obj: Any) -> bytes:
    """A protocol-2 pickle of inert data (see the module docstring).

    Raises:
        ValueError: a tensor, a cycle, or an object of another kind.
    """
    writer = _Writer()
    writer.emit(obj)
    return bytes(writer.ops.out + op.STOP)


def wrap_pickle(inner: bytes, key: str, beside: Mapping[str, Any]) -> bytes:
    """A pickle of ``{**beside, key: <what inner unpickles to>}``: ``inner`` (a whole pickle, a
    state dict of tensors) spliced in as it is.

    Example:
        >>> import pickle
        >>> pickle.loads(wrap_pickle(pickle.dumps({"w": 1}, 2), "state_dict", {"epoch": 3}))
        {'epoch': 3, 'state_dict': {'w': 1}}
    """
    writer = _Writer()
    head = bytes(writer.ops.out)
    if not (inner.startswith(head) and inner.endswith(op.STOP)):
        raise ValueError("not a protocol-2 pickle")
    writer.ops.out += op.EMPTY_DICT + op.MARK
    for k, v in beside.items():
        if k != key:
            writer.emit(k)
            writer.emit(v)
    writer.ops.text(key)
    return bytes(writer.ops.out + inner[len(head) : -len(op.STOP)] + op.SETITEMS + op.STOP)


__all__ = ["dumps_inert", "wrap_pickle"]
