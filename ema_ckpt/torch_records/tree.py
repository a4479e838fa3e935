"""The whole pickle of a ``torch.save`` file, read as inert data: nothing from the file runs.

:func:`load_tree` turns every global into an :class:`Opaque` stand-in that records what the
pickle asked for, and tensors into :class:`~ema_ckpt.torch_records.pickles.TensorRecord` s.
:func:`check_harmless` then judges the globals (:data:`HARMLESS_GLOBALS`, or the caller's
``inert_globals``); judging after reading lets a refusal name the key.

Example:
    >>> import pickle, argparse
    >>> tree = load_tree(pickle.dumps({"args": argparse.Namespace(lr=0.1)}), "x.pt")
    >>> tree.root["args"].global_name, tree.root["args"].state
    ('argparse.Namespace', {'lr': 0.1})
    >>> check_harmless(tree, "x.pt")
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..dtypes import DtypeName
from ..errors import CheckpointFormatError, Note, UnsafePickleError
from ..pickles.load import Allowlist, load_pickle
from ..pickles.rules import is_standard_module, refusal
from .pickles import RECORD_GLOBALS, UNTYPED, PickledStorage, TensorRecord


class Opaque(dict):  # type: ignore[type-arg]
    """A pickled object (or a call the pickle asked for) kept as inert data: a dict (for
    ``SETITEMS``) that records its arguments, ``BUILD`` state and ``APPENDS`` items."""

    global_name = "builtins.object"
    args: tuple[Any, ...]
    state: Any
    appended: list[Any]
    called: bool
    """Made by a call (``REDUCE``), not by ``NEWOBJ``: how it is written back (:mod:`.emit`)."""
    kwargs: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        self = dict.__new__(cls)
        self.args, self.kwargs, self.state, self.appended, self.called = args, kwargs, None, [], False
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the dict's own init would read args
        self.called = True

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, value: Any) -> None:
        self.appended.append(value)

    def extend(self, values: Any) -> None:
        self.appended.extend(values)

    def __repr__(self) -> str:
        return f"<{self.global_name}>"

    def __hash__(self) -> int:  # type: ignore[override]  # may be a dict key or a set member in the pickle
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def _standin(module: str, name: str) -> type[Opaque]:
    return type(name, (Opaque,), {"global_name": f"{module}.{name}", "__module__": __name__})


def _from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch's ``_rebuild_from_type_v2``: the tensor inside a plain ``Parameter`` or ``Tensor``,
    else the call kept as an opaque record."""
    value = func(*args) if callable(func) and isinstance(args, tuple) else None
    if isinstance(value, TensorRecord) and getattr(new_type, "global_name", "") in _PLAIN_TENSOR_TYPES:
        return value
    return _standin("torch._tensor", "_rebuild_from_type_v2")(func, new_type, args, state)


def _parameter(data: Any, *_rest: Any) -> Any:
    """``torch._utils._rebuild_parameter(data, requires_grad, hooks[, state])``: the tensor."""
    return data


_PLAIN_TENSOR_TYPES = {"torch.nn.parameter.Parameter", "torch.Tensor", "torch._tensor.Tensor"}
@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage the pickle points at: its key (a zip member or a legacy storage), dtype and size."""

    key: str
    dtype: str
    numel: int


TREE_GLOBALS = Allowlist({
    **RECORD_GLOBALS.table,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type_v2,
}, other=_standin, python2_names=True)
"""A tensor record's globals, and parameters as their tensors; any other global a fresh
:class:`Opaque` class of the load (a pickle's edits to it stay in that load)."""


def _storage(source: str, storages: dict[str, StorageRef], pid: Any) -> Any:
    # zip format: ("storage", type, key, location, numel); legacy adds view metadata (None)
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
        raise CheckpointFormatError(source, "unexpected storage reference in the pickle")
    dtype, key, numel = pid[1], pid[2], pid[4]
    if not isinstance(dtype, DtypeName) or type(numel) is not int or numel < 0 or not isinstance(key, str):
        raise CheckpointFormatError(source, "unexpected storage type in the pickle")
    if len(pid) == 6 and pid[5] is not None:
        raise CheckpointFormatError(source, "storage views of torch < 0.4 files are not supported")
    ref = StorageRef(key, str(dtype), numel)
    known = storages.setdefault(key, ref)
    if known != ref and not (known.dtype == UNTYPED or ref.dtype == UNTYPED):
        raise CheckpointFormatError(source, f"storage {key} is named with two types")
    return PickledStorage(ref.key, DtypeName(ref.dtype), ref.numel)


@dataclass(frozen=True, slots=True)
class PickledTree:
    """What a ``torch.save`` pickle holds: the object, and every storage it points at."""

    root: Any
    storages: dict[str, StorageRef]
    source: str


def load_tree(data: bytes, source: str) -> PickledTree:
    """Unpickle ``data`` (a ``torch.save`` pickle) into inert data, else ``CheckpointFormatError``."""
    storages: dict[str, StorageRef] = {}
    try:
        root = load_pickle(data, TREE_GLOBALS, source, persistent=functools.partial(_storage, source, storages))
    except (UnsafePickleError, CheckpointFormatError):
        raise
    except Exception as err:  # any malformed pickle: one clean line
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointFormatError(source, f"unreadable pickle ({detail})") from None
    _check_depth(root, source)  # before anything that recurses (or copies paths) walks it
    return PickledTree(root, storages, source)


HARMLESS_GLOBALS: tuple[str, ...] = (
    # training scripts' own records
    "argparse.Namespace", "omegaconf.*", "pathlib.*", "pathlib._local.*",
    "collections.OrderedDict", "collections.defaultdict", "collections.Counter", "collections.deque",
    "datetime.*", "decimal.Decimal", "fractions.Fraction", "uuid.UUID", "copyreg._reconstructor", "typing.*",
    "builtins.set", "builtins.frozenset", "builtins.slice", "builtins.complex", "builtins.bytearray",
    "builtins.range", "builtins.object", "builtins.list", "builtins.dict", "builtins.tuple", "builtins.int",
    "builtins.float", "builtins.str", "builtins.bool", "builtins.bytes", "_codecs.encode",
    # numpy arrays, scalars, dtypes and random states (numpy pickles these through many of its names)
    "numpy.*",
    # torch's own inert types beside the tensors; whole pickled modules, read for their weights
    "torch.nn.modules.*", "torch.nn.parameter.Parameter", "torch.nn.parameter.Buffer", "torch.device",
    "torch.torch_version.TorchVersion", "torch._utils._rebuild_*", "torch.Tensor", "torch._tensor.Tensor",
    "torch.serialization._get_layout", "torch.strided",
    "torch.contiguous_format", "torch.channels_last", "torch.preserve_format",
    # trainers' own containers and enums (Lightning hyper-parameters and loop states, HF enums)
    "lightning.fabric.utilities.data.AttributeDict", "lightning_fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict", "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning.pytorch.trainer.states.*", "pytorch_lightning.trainer.states.*",
    "lightning.fabric.utilities.enums.*", "lightning_fabric.utilities.enums.*",
    "transformers.trainer_utils.*Strategy", "transformers.trainer_utils.SchedulerType",
    "transformers.training_args.OptimizerNames",
)  # fmt: skip
"""Globals read as inert data with no flag (module.name, ``fnmatch`` patterns)."""


def key_path(parts: Sequence[Any]) -> str:
    """``("args", "lr")`` → ``args.lr``; list positions in brackets: ``optimizer_states[0]``."""
    text = ""
    for part in parts:
        piece = f"[{part}]" if isinstance(part, int) else str(part)
        text += piece if (not text or piece.startswith("[")) else "." + piece
    return text or "(the top level)"


class Trail:
    """Where a value sits in a tree: its parent's trail and its key, linked (a node costs the
    same at any depth)."""

    __slots__ = ("depth", "key", "parent")

    def __init__(self, parent: Trail | None, key: Any) -> None:
        self.parent, self.key = parent, key
        self.depth: int = parent.depth + 1 if parent is not None else 0

    def parts(self) -> tuple[Any, ...]:
        keys: list[Any] = []
        trail: Trail | None = self
        while trail is not None and trail.parent is not None:
            keys.append(trail.key)
            trail = trail.parent
        return tuple(reversed(keys))


MAX_DEPTH = 1000
"""Containers a pickle may nest (a checkpoint nests a few dozen): deeper is refused as it is read."""


def _children(value: Any) -> list[tuple[Any, Any]]:
    """(key, child) of a container of the tree, in order."""
    children: list[tuple[Any, Any]] = []
    if isinstance(value, Opaque):
        children += [(f"<arg {i}>", a) for i, a in enumerate(value.args)]
        children += [(f"<arg {k}>", a) for k, a in value.kwargs.items()]
        if value.state is not None:
            state = value.state
            if isinstance(state, dict) and not isinstance(state, Opaque):
                children += [(_name_of(k), v) for k, v in state.items()]
            else:
                children.append(("<state>", state))
        children += list(enumerate(value.appended))
    if isinstance(value, dict):
        children += [(_name_of(k), v) for k, v in value.items()]
        children += [("<key>", k) for k in value if isinstance(k, Opaque)]
    elif isinstance(value, (list, tuple)):
        children += list(enumerate(value))
    elif isinstance(value, (set, frozenset)):
        children += [("<member>", v) for v in value]
    return children


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _check_depth(root: Any, source: str, limit: int = MAX_DEPTH) -> None:
    """Refuse a tree that nests containers more than ``limit`` deep; each container looked at once."""
    seen: set[int] = set()
    stack: list[tuple[Trail, Any]] = [(Trail(None, None), root)]
    while stack:
        trail, value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if trail.depth >= limit:
            raise CheckpointFormatError(source, f"the pickle nests containers more than {limit} deep (under key "
                                                f"{key_path(trail.parts()[:8])!r}…)")
        stack.extend((Trail(trail, key), child) for key, child in _children(value) if isinstance(child, _CONTAINERS))


def walk(root: Any, *, max_nodes: int = 10_000_000) -> Iterator[tuple[Trail, Any]]:
    """Every (trail, value) of a tree in depth-first order, each container once (``ValueError``
    past ``max_nodes`` values)."""
    seen: set[int] = set()
    stack: list[tuple[Trail, Any]] = [(Trail(None, None), root)]
    visited = 0
    while stack:
        trail, value = stack.pop()
        visited += 1
        if visited > max_nodes:
            raise ValueError("the pickle nests more objects than a checkpoint holds")
        yield trail, value
        if isinstance(value, _CONTAINERS) and id(value) not in seen:
            seen.add(id(value))
            children = _children(value)
            stack.extend((Trail(trail, key), child) for key, child in reversed(children))


def _name_of(key: Any) -> Any:
    return key if isinstance(key, (str, int)) else f"<{type(key).__name__} key>"


def foreign_globals(tree: PickledTree, inert_globals: Sequence[str] = ()) -> dict[str, tuple[Any, ...]]:
    """{global name: the first key path it sits under} for every global the tree names that
    is neither harmless nor listed in ``inert_globals``."""
    allowed = (*HARMLESS_GLOBALS, *inert_globals)
    found: dict[str, tuple[Any, ...]] = {}
    try:
        for trail, value in walk(tree.root):
            # an object, or a class kept as a value
            if isinstance(value, Opaque) or (isinstance(value, type) and issubclass(value, Opaque)):
                name = value.global_name
                if name not in found and not any(fnmatch.fnmatchcase(name, p) for p in allowed):
                    found[name] = trail.parts()
    except ValueError as err:
        raise CheckpointFormatError(tree.source, str(err)) from None
    return found


def check_harmless(tree: PickledTree, source: str, inert_globals: Sequence[str] = ()) -> None:
    """Refuse a tree that names a global neither harmless nor listed in ``inert_globals``
    (``UnsafePickleError`` naming the global, its key, and the ``inert_globals`` that would pass it)."""
    foreign = foreign_globals(tree, inert_globals)
    if not foreign:
        return
    name, path = next(iter(foreign.items()))
    more = f" (and {len(foreign) - 1} more: {', '.join(list(foreign)[1:4])})" if len(foreign) > 1 else ""
    said = refusal(f"{name} under key {key_path(path)!r}{more}")
    code = next((n for n in foreign if _is_code(n)), None)
    if code is not None:
        raise UnsafePickleError(source, said + f" ({code} is a function, not data)")
    packages = sorted({n.split(".")[0] + ".*" for n in foreign})
    what = ("a pickled module, whose weights can be read" if any(is_module(v) for _, v in walk(tree.root))
            else "plain data (a config or a record of the training script)")
    if len(foreign) == 1:
        fix = f"pass {{inert_globals={name}}} (or '{name.rpartition('.')[0]}.*')"
    else:
        fix = "pass " + " and ".join(f"{{inert_globals={p}}}" for p in packages[:4])
    raise UnsafePickleError(source, Note(f"{said}. If it is {what}, {fix} to read it as inert data",
                                         mentions=("inert_globals",)))


def _is_code(name: str) -> bool:
    short = name.rpartition(".")[2]
    return not short[:1].isupper() or is_standard_module(name)


def is_module(value: Any) -> bool:
    """A pickled ``torch.nn.Module`` read as inert data (its state holds ``_parameters`` and ``_modules``)."""
    state = value.state if isinstance(value, Opaque) else None
    return isinstance(state, dict) and isinstance(state.get("_parameters"), dict) and isinstance(
        state.get("_modules"), dict)


def module_state_dict(module: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """What ``module.state_dict()`` would hold, from a pickled module read as inert data:
    parameters and persistent buffers, children's by their dotted names. Nothing is built."""
    if depth > 100 or not is_module(module):
        return {}
    state = module.state
    out = {prefix + k: v for k, v in state["_parameters"].items() if isinstance(k, str) and v is not None}
    skipped = state.get("_non_persistent_buffers_set")
    transient = set(skipped.args[0]) if isinstance(skipped, Opaque) and skipped.args and isinstance(
        skipped.args[0], list) else set(skipped) if isinstance(skipped, (set, frozenset)) else set()
    buffers = state.get("_buffers")
    if isinstance(buffers, dict):
        out.update({prefix + k: v for k, v in buffers.items()
                    if isinstance(k, str) and v is not None and k not in transient})
    for name, child in state["_modules"].items():
        if isinstance(name, str) and child is not None:
            out.update(module_state_dict(child, f"{prefix}{name}.", depth + 1))
    return out
