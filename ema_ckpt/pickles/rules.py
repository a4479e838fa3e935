"""The pickle rules every reader shares: how a refused global is reported, ``torch.Size``'s
and the dtypes' stand-ins, and, for loads through torch's weights-only unpickler, what it refused.

When that unpickler refuses a file, the global to blame is read from its message
(:data:`GLOBAL_IN_MESSAGE`) or found by disassembling the pickle (:func:`globals_in_pickle`,
nothing is executed) and checking each name against torch's allowlist (:func:`torch_allows`).

Example:
    >>> import pickle
    >>> globals_in_pickle(pickle.dumps(print, protocol=4))
    ['builtins.print']
"""

from __future__ import annotations

import fnmatch
import io
import pickle
import pickletools
import re
import sys
from pathlib import Path
from typing import Any

from .._compat import torch_load
from ..dtypes import TORCH_NAMES, DtypeName, canonical
from ..errors import UnsafePickleError

__all__ = ["CODE_MODULES", "GLOBAL_IN_MESSAGE", "TORCH_DTYPES", "first_line", "globals_in_pickle",
           "is_standard_module", "refusal", "refuse", "standard_module_matched", "torch_allows", "torch_size"]

GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def refusal(name: str) -> str:
    """What every refused global is told: ``name`` is not allowed, and nothing from the file ran."""
    return f"refers to {name}, which is not allowed; nothing from the file was run"


def refuse(source: str | Path, module: str, name: str) -> UnsafePickleError:
    """The error for a pickle global outside an allowlist (raised before anything of the file ran)."""
    return UnsafePickleError(source, refusal(f"{module}.{name}"))


def torch_size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size`` rebuilt as a tuple of ints (every restricted unpickler's stand-in)."""
    return tuple(map(int, dims))


TORCH_DTYPES: dict[tuple[str, str], DtypeName] = {("torch", n): DtypeName(canonical(n)) for n in TORCH_NAMES}
"""``torch.float32`` and every other dtype global, as its canonical name (an allowlist's entries)."""


def first_line(message: str) -> str:
    """The informative line of a torch error (past the weights-only preamble), shortened."""
    _, marker, rest = message.partition("WeightsUnpickler error:")
    return next((line.strip()[:200] for line in (rest if marker else message).splitlines() if line.strip()), "")


def globals_in_pickle(data: bytes) -> list[str]:
    """Every global a pickle names, in order, found by disassembly (nothing is executed)."""
    names: list[str] = []
    strings: list[str] = []  # recent string pushes, for STACK_GLOBAL (protocol 4+)
    memo: dict[int, str] = {}
    top: str | None = None  # the last pushed value when it is a string
    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            pushed: str | None = None
            if op.name in ("GLOBAL", "INST"):
                module, _, qualname = str(arg).partition(" ")
                names.append(f"{module}.{qualname}")
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
                pushed = arg
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                key = len(memo) if arg is None else int(arg)  # MEMOIZE alone has no argument
                if top is not None:
                    memo[key] = top
                continue  # memoising leaves the stack (and ``top``) as it was
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg is not None:
                pushed = memo.get(int(arg))
            if pushed is not None:
                strings.append(pushed)
            top = pushed
    except (ValueError, EOFError, pickle.UnpicklingError):
        pass  # a damaged tail: report what was found before it
    return names


def torch_allows(name: str) -> bool:
    """Whether torch's weights-only unpickler allows ``name`` by default."""
    allowed = torch_load.allowed_globals()
    if allowed is None:  # pragma: no cover - a torch without the private helper
        return name.startswith("torch.") or name.startswith("collections.")
    return name in allowed


CODE_MODULES: frozenset[str] = frozenset(sys.stdlib_module_names) | {
    "builtins", "__builtin__", "posix", "nt", "os", "sys", "subprocess", "_posixsubprocess", "shutil", "importlib",
    "pty", "socket", "ctypes", "_ctypes", "pickle", "_pickle", "marshal", "types", "functools", "_functools",
    "operator", "_operator", "runpy", "code", "codeop", "webbrowser", "multiprocessing", "_thread", "signal"}
"""Top-level modules no ``inert_globals`` pattern may reach: all of Python's standard library
(its OS modules under every platform's name), whose globals are code, never a training
script's record (the data types checkpoints hold are read without a flag)."""


_NAMED_FIRST = ("builtins", "os", "posix", "nt", "subprocess", "sys")  # what a refusal of ``*.*`` names


def is_standard_module(name: str) -> bool:
    """Whether global ``name`` (``module.qualname``) lies in a module of :data:`CODE_MODULES`."""
    return name.split(".")[0] in CODE_MODULES


def _tokens(pattern: str) -> list[str]:
    """An ``fnmatch`` pattern as tokens: ``*``, ``?``, a ``[...]`` class, or one literal character."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            j = pattern.find("]", j)
            if j >= 0:
                out.append(pattern[i:j + 1])
                i = j + 1
                continue
        out.append(c)
        i += 1
    return out


def _may_start_with(tokens: list[str], prefix: str) -> bool:
    """Whether some name starting with ``prefix`` matches the pattern ``tokens`` (case-sensitive)."""

    def closed(states: set[int]) -> set[int]:  # a star may match nothing
        out = set(states)
        for at in sorted(states):
            while at < len(tokens) and tokens[at] == "*":
                at += 1
                out.add(at)
        return out

    states = closed({0})
    for char in prefix:
        step: set[int] = set()
        for at in states:
            token = tokens[at] if at < len(tokens) else None
            if token == "*":
                step.add(at)
            elif token is not None and (token in ("?", char) or (len(token) > 1 and fnmatch.fnmatchcase(char, token))):
                step.add(at + 1)
        states = closed(step)
        if not states:
            return False
    return True


def standard_module_matched(pattern: str) -> str | None:
    """The first module of :data:`CODE_MODULES` some global of which ``pattern`` matches
    (``posix.system``, ``os.*``, ``*.system``, ``o*.system``), or None (``myproj.Config``)."""
    tokens = _tokens(pattern)
    return next((m for m in (*_NAMED_FIRST, *sorted(CODE_MODULES)) if _may_start_with(tokens, m + ".")), None)
