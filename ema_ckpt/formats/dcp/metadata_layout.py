"""The check behind :mod:`.metadata_pickle`: does the installed torch define DCP's metadata
classes as the emitter mirrors them? Read from torch's source, never imported.

Example:
    >>> emitter_matches_torch()   # doctest: +SKIP
    True
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import NamedTuple

DCP_METADATA_VERSION = "1.0.0"  # DCP's metadata version, torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION


class ClassLayout(NamedTuple):
    """What unpickling the emitted bytes relies on in one class definition of torch's."""

    decorators: tuple[str, ...]
    bases: tuple[str, ...]
    fields: tuple[str, ...]
    """``name`` or ``name=default`` in order (an Enum's ``MEMBER=value``)."""
    hooks: tuple[str, ...] = ()
    """The methods it defines that change how it pickles or compares, sorted."""
    state_order: tuple[str, ...] = ()
    """Where its ``__setstate__`` unpacks a tuple state, in order."""


_HOOKS = frozenset({"__new__", "__getstate__", "__setstate__", "__reduce__", "__reduce_ex__",
                    "__getnewargs__", "__getnewargs_ex__", "__slots__", "__eq__", "__hash__"})
_DATACLASS = ("dataclass",)

EXPECTED_LAYOUT: dict[str, ClassLayout | str] = {
    "metadata.Metadata": ClassLayout(_DATACLASS, (), (
        "state_dict_metadata", "planner_data=None", "storage_data=None", "storage_meta=None",
        "version=None")),
    "metadata.TensorStorageMetadata": ClassLayout(_DATACLASS, (), ("properties", "size", "chunks")),
    "metadata.ChunkStorageMetadata": ClassLayout(_DATACLASS, (), ("offsets", "sizes")),
    "metadata.BytesStorageMetadata": ClassLayout(_DATACLASS, (), ()),
    "metadata.TensorProperties": ClassLayout(_DATACLASS, (), (
        "dtype=field(default_factory=torch.get_default_dtype)", "layout=field(default=torch.strided)",
        "requires_grad=False", "memory_format=field(default=torch.contiguous_format)", "pin_memory=False"),
        ("__getstate__", "__setstate__"),
        ("self.dtype", "self.layout", "self.requires_grad", "mem_format_encoding", "self.pin_memory")),
    "metadata.MetadataIndex": ClassLayout(("dataclass(frozen=True)",), (), (
        "fqn", "offset=None", "index=field(hash=False, compare=False, default=None)")),
    "metadata._MEM_FORMAT_ENCODING": ClassLayout((), ("Enum",), (
        "TORCH_CONTIGUOUS_FORMAT=0", "TORCH_CHANNELS_LAST=1", "TORCH_PRESERVE_FORMAT=2")),
    "filesystem._StorageInfo": ClassLayout(_DATACLASS, (), (
        "relative_path", "offset", "length", "transform_descriptors=None"), ("__getstate__",)),
    "filesystem.CURRENT_DCP_VERSION": DCP_METADATA_VERSION,
}
"""The definitions in ``torch/distributed/checkpoint/{metadata,filesystem}.py`` the emitter
mirrors, as :func:`installed_layout` reads them."""


@functools.cache
def emitter_matches_torch() -> bool:
    """Whether the installed torch would pickle DCP metadata as :func:`dump_metadata` emits it:
    :func:`installed_layout` against :data:`EXPECTED_LAYOUT`, and how torch pickles dtypes,
    layouts and sizes (source that cannot be read counts as a difference). Once per process.
    """
    try:
        return installed_layout() == EXPECTED_LAYOUT and _torch_pickles_as_emitted()
    except Exception:  # any surprise in torch's files: fall back rather than fail the write
        return False


def installed_layout() -> dict[str, ClassLayout | str | None]:
    """The installed torch's definitions of the names in :data:`EXPECTED_LAYOUT` (``None``:
    not defined at the top level of that module)."""
    found: dict[str, ClassLayout | str | None] = {}
    for module in dict.fromkeys(qualified.split(".")[0] for qualified in EXPECTED_LAYOUT):
        source = _torch_source(module)
        wanted = {q.split(".")[1]: want for q, want in EXPECTED_LAYOUT.items() if q.startswith(f"{module}.")}
        classes = _classes(source, [name for name, want in wanted.items() if not isinstance(want, str)])
        for name, want in wanted.items():
            node = classes.get(name)
            found[f"{module}.{name}"] = (_constant(source, name) if isinstance(want, str)
                                         else None if node is None else _layout(node))
    return found


def _torch_source(module: str) -> str:
    spec = importlib.util.find_spec("torch")  # torch's own spec: imports nothing below it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torch is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    return (root / "distributed" / "checkpoint" / f"{module}.py").read_text(encoding="utf-8")


def _constant(source: str, name: str) -> str | None:
    match = re.search(rf"^{name}\b[^=\n]*=\s*[\"']([^\"'\n]*)[\"']\s*$", source, re.MULTILINE)
    return match.group(1) if match else None


def _classes(source: str, names: list[str]) -> dict[str, ast.ClassDef]:
    """The top-level classes ``names`` of ``source``, parsed from their blocks alone
    (parsing the whole of ``filesystem.py`` would cost many times more)."""
    pattern = rf"^(?:@[^\n]*\n)*class (?:{'|'.join(names)})\b.*?(?=^\S|\Z)"
    blocks = [block.group(0) for block in re.finditer(pattern, source, re.MULTILINE | re.DOTALL)]
    tree = ast.parse("\n".join(blocks))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _layout(node: ast.ClassDef) -> ClassLayout:
    fields: list[str] = []
    hooks: list[str] = []
    state_order: tuple[str, ...] = ()
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            default = "" if statement.value is None else "=" + ast.unparse(statement.value)
            fields.append(statement.target.id + default)
        elif isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(
                statement.targets[0], ast.Name):
            target = statement.targets[0].id
            if target in _HOOKS:
                hooks.append(target)
            elif not target.startswith("_"):
                fields.append(f"{target}={ast.unparse(statement.value)}")
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name in _HOOKS:
            hooks.append(statement.name)
            if statement.name == "__setstate__":
                state_order = _unpacked_into(statement)
    decorators = tuple(ast.unparse(decorator) for decorator in node.decorator_list)
    bases = tuple(ast.unparse(base) for base in node.bases)
    return ClassLayout(decorators, bases, tuple(fields), tuple(sorted(hooks)), state_order)


def _unpacked_into(method: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """The targets of the method's first statement when it unpacks a tuple (``a, b = state``)."""
    body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    first = body[0] if body else None
    if isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Tuple):
        return tuple(ast.unparse(element) for element in first.targets[0].elts)
    return ()


def _torch_pickles_as_emitted() -> bool:
    """Dtypes as globals of ``torch``, layouts through ``torch.serialization._get_layout`` of
    their name, ``torch.Size`` as a call on a tuple: what :class:`_Emitter` writes."""
    import copyreg

    import torch

    get_layout = getattr(torch.serialization, "_get_layout", None)
    layout_reduce = copyreg.dispatch_table.get(torch.layout)
    return (
        get_layout is not None and layout_reduce is not None
        and layout_reduce(torch.strided) == (get_layout, ("torch.strided",))
        and get_layout("torch.strided") is torch.strided
        and torch.float32.__reduce__() == "float32"
        and torch.Size((2, 3)).__reduce__() == (torch.Size, ((2, 3),))
    )
