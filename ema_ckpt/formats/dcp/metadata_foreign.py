"""Globals of a DCP ``.metadata`` that are none of torch's: recorded, never imported or run.

Every global the unpickler does not know becomes a record class made here (:func:`foreign_class`),
read as data only as a value of ``storage_data`` with exactly ``_StorageInfo``'s fields
(:func:`storage_fields`: OLMo-core pickles its own copy of that class); anywhere else refused
(:func:`refused_global`) unless listed in ``inert_globals``, then kept opaque.

Example:
    >>> cls = foreign_class("olmo_core.io", "_StorageInfo", "x/.metadata", inert=False)
    >>> info = cls.__new__(cls)
    >>> info.__setstate__({"relative_path": "__0_0.distcp", "offset": 0, "length": 8})
    >>> storage_fields(info, None, "x/.metadata")
    ('__0_0.distcp', 0, 8, None)
"""

from __future__ import annotations

import fnmatch
import functools
import gc
import itertools
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from ...errors import CheckpointFormatError, Note, UnsafePickleError
from ...pickles.rules import CODE_MODULES, refusal

STORAGE_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
"""torch's ``filesystem._StorageInfo`` fields, in order; the last may be absent (None)."""

_DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_NO_STATE: Any = object()


class Foreign:
    """A global of the metadata that is none of torch's classes, as the pickle used it.

    ``cls.__new__(cls)`` and ``BUILD`` record its state; a call, or arguments to ``__new__``,
    is refused at once unless the global is :attr:`inert` (listed), then recorded too.
    """

    __slots__ = ("args", "called", "kwargs", "state")
    global_name: ClassVar[str] = "builtins.object"
    inert: ClassVar[bool] = False
    source: ClassVar[str] = ""  # the file, for messages

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    called: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> Foreign:
        if (args or kwargs) and not cls.inert:
            raise refused_global(cls.source, cls.global_name, called=True)
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.called = args, kwargs, _NO_STATE, False
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # a call (REDUCE, INST, OBJ); NEWOBJ never comes here
        if not type(self).inert:
            raise refused_global(type(self).source, type(self).global_name, called=True)
        self.called = True

    def __setstate__(self, state: Any) -> None:
        if self.state is not _NO_STATE:
            raise ValueError(f"{self.global_name} is built twice")
        self.state = state

    def parts(self) -> list[Any]:
        """Everything the pickle put in this record (its arguments and state)."""
        found = [*self.args, *self.kwargs.values()]
        if self.state is not _NO_STATE:
            found.append(self.state)
        return found

    def __repr__(self) -> str:
        return f"<{self.global_name}>"


def foreign_class(module: str, name: str, source: str, *, inert: bool) -> type[Foreign]:
    """A fresh record class for the global ``module.name`` of one load (never the real one)."""
    return type("Foreign", (Foreign,), {"__slots__": (), "global_name": f"{module}.{name}", "inert": inert,
                                        "source": source})


def listed(name: str, inert_globals: Sequence[str]) -> bool:
    """Whether ``name`` matches a pattern of ``inert_globals`` (``module.Name``, ``module.*``)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in inert_globals)


def _is_code(name: str) -> bool:
    """A function, or a class of a module of code: never data (``_Private`` classes are classes)."""
    module, _, short = name.rpartition(".")
    return not short.lstrip("_")[:1].isupper() or module.split(".")[0] in CODE_MODULES


def _shown(name: str) -> str:
    """``name`` for a one-line message: as it is when it is a dotted name, else its repr."""
    return name if _DOTTED_NAME.fullmatch(name) else repr(name)[:120]


def refused_global(source: str, name: str, *, where: str = "", called: bool = False) -> UnsafePickleError:
    """The refusal of a foreign global, naming it and ``where`` it sits, offering
    ``inert_globals`` for a class that can be plain data, never for code."""
    shown = _shown(name)
    said = refusal(f"{shown} {where}".rstrip())
    if _is_code(name) or shown != name:
        return UnsafePickleError(source, said + f" ({shown} is {'called' if called else 'code'}, not data)")
    module = name.rpartition(".")[0]
    return UnsafePickleError(source, Note(
        f"{said}. If it is plain data (a record of the training code or of its checkpoint writer), pass "
        f"{{inert_globals={name}}} (or '{module}.*') to read it as inert data", mentions=("inert_globals",)))


def by_shape(cls: type[Foreign]) -> bool:
    """Whether records of ``cls`` may be read by their shape in ``storage_data`` (not of a code module)."""
    return cls.global_name.split(".")[0] not in CODE_MODULES


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened; by its type where repr fails (nested past the recursion limit)."""
    try:
        text = repr(value)
    except Exception:  # any repr a pickle can make fail: the message must still come out
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value(value: Any) -> str:
    return brief(value) + f" (a {type(value).__name__})"


_FIELD_SET = frozenset(STORAGE_FIELDS)


StorageFields = tuple[str, int, int, "list[str] | tuple[str, ...] | None"]
"""``relative_path``, ``offset``, ``length``, ``transform_descriptors``."""


def storage_fields(record: Foreign, index: Any, source: str) -> StorageFields:
    """The ``_StorageInfo`` fields of ``record`` (the value of ``storage_data[index]``), checked:
    ``CheckpointFormatError`` unless a dataclass-like record of exactly those fields and types."""
    state = record.state
    if type(state) is dict and not (record.called or record.args or record.kwargs):  # as torch writes it: fast
        path, offset, length = state.get("relative_path"), state.get("offset"), state.get("length")
        descriptors = state.get("transform_descriptors")
        if (type(path) is str and type(offset) is int and type(length) is int and state.keys() <= _FIELD_SET
                and (descriptors is None or (type(descriptors) in (list, tuple)
                                             and all(type(d) is str for d in descriptors)))):
            return path, offset, length, descriptors
    raise _misshapen(record, getattr(index, "fqn", index), source)


def _misshapen(record: Foreign, key: Any, source: str) -> CheckpointFormatError:
    """Why ``record`` is not read as a ``_StorageInfo`` (:func:`storage_fields`), in one line."""
    entry = f"the storage entry of key {brief(key, 160)} (a record of class {_shown(record.global_name)})"

    def refuse(reason: str) -> CheckpointFormatError:
        return CheckpointFormatError(source, f"{entry} {reason}; nothing from the file was run")

    if record.called or record.args or record.kwargs:
        return refuse("was made by a call, not from its fields as a dataclass is unpickled")
    state = record.state
    if type(state) is not dict or not all(isinstance(k, str) for k in state):
        return refuse("does not hold its fields as a dict (torch's _StorageInfo: " + ", ".join(STORAGE_FIELDS) + ")")
    return refuse("has " + _misshapen_state(state))


def _misshapen_state(state: dict[Any, Any]) -> str:
    """What is wrong with a state dict of fields (called only when something is)."""
    extra = [k for k in state if k not in _FIELD_SET]
    if extra:
        shown = ", ".join(brief(k) for k in extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        return (f"{'fields' if len(extra) > 1 else 'a field'} torch's _StorageInfo does not have, {shown}: "
                "it could change where the bytes lie, so the entry is not read")
    missing = [k for k in STORAGE_FIELDS[:3] if k not in state]
    if missing:
        return f"no {' and no '.join(missing)} field"
    if type(state["relative_path"]) is not str:
        return f"relative_path {_value(state['relative_path'])}, not a string"
    for field in ("offset", "length"):
        if type(state[field]) is not int:
            return f"{field} {_value(state[field])}, not an integer"
    descriptors = state.get("transform_descriptors")
    if descriptors is not None and not (type(descriptors) in (list, tuple)
                                        and all(type(d) is str for d in descriptors)):
        return f"transform_descriptors {_value(descriptors)}, not a list of strings"
    return "a state that does not read as one"  # pragma: no cover - storage_fields accepted it


CONTAINERS = frozenset({dict, list, tuple, set, frozenset})
"""Anything else a metadata pickle builds is a stand-in or holds no references."""


_is_class = frozenset({type}).__contains__


def reach(roots: list[Any], open_types: frozenset[type], kinds: frozenset[type[Foreign]], target: Any = None
           ) -> Any:
    """The first object reachable from ``roots`` through objects of ``open_types`` that is an
    instance of ``kinds``, one of ``kinds`` or ``target``, or None; a level at a time, in C."""
    is_open = open_types.__contains__
    seen: set[int] = set()
    frontier = roots
    while frontier:
        types = list(map(type, frontier))
        if kinds and not kinds.isdisjoint(types):
            return next(v for v in frontier if type(v) in kinds)
        classes = list(itertools.compress(frontier, map(_is_class, types)))
        if kinds and not kinds.isdisjoint(classes):
            return next(c for c in classes if c in kinds)
        if target is not None and any(v is target for v in frontier):
            return target
        grow = list(itertools.compress(frontier, map(is_open, types)))
        ids = list(map(id, grow))
        grow = list(itertools.compress(grow, map(operator.not_, map(seen.__contains__, ids))))
        seen.update(ids)
        frontier = gc.get_referents(*grow)  # slots, __dict__ values, items, keys: never a class's contents
    return None


def labelled_parts(obj: Any, is_metadata: bool) -> Iterator[tuple[Callable[[], str], Any]]:
    """The parts of the loaded metadata, each with (a function giving) where it sits."""
    if not is_metadata:
        yield (lambda: ""), obj
        return
    for field, value in obj.fields().items():
        if field in ("state_dict_metadata", "storage_data") and isinstance(value, dict):
            for key, entry in value.items():
                fqn = getattr(key, "fqn", key) if field == "storage_data" else key
                label = functools.partial(_where, field, fqn)
                yield label, key
                yield label, entry
        else:
            yield functools.partial(_where, field, None), value


def _where(field: str, key: Any) -> str:
    if key is None:
        return f"in the metadata's {brief(field)}"
    place = "under key" if field == "state_dict_metadata" else "in the storage entry of key"
    return f"{place} {brief(key, 160)}"


__all__ = ["CONTAINERS", "STORAGE_FIELDS", "Foreign", "StorageFields", "brief", "by_shape", "foreign_class",
           "labelled_parts", "listed", "reach", "refused_global", "storage_fields"]
