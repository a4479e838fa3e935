"""The pickle rules every reader shares: how a refused global is reported, ``torch.Size``'s
stand-in, and, for loads through torch's weights-only unpickler, what it refused.

DeepSpeed ``.pt`` files (:mod:`ema_ckpt.formats.deepspeed.unpickle`) and DCP chunk records
(:mod:`ema_ckpt.formats.dcp.records`) both go through that unpickler; when it refuses a file,
the global to blame is read from its message (:data:`GLOBAL_IN_MESSAGE`) or found by
disassembling the pickle (:func:`globals_in_pickle`, nothing is executed) and checking each
name against torch's own allowlist (:func:`torch_allows`).

Example:
    >>> import pickle
    >>> globals_in_pickle(pickle.dumps(print, protocol=4))
    ['builtins.print']
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
from pathlib import Path
from typing import Any

from ..errors import UnsafePickleError

__all__ = ["GLOBAL_IN_MESSAGE", "first_line", "globals_in_pickle", "refusal", "refuse", "torch_allows", "torch_size"]

GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def refusal(name: str) -> str:
    """What every refused global is told: ``name`` (``module.qualname``) is not allowed, and
    nothing from the file ran."""
    return f"refers to {name}, which is not allowed; nothing from the file was run"


def refuse(source: str | Path, module: str, name: str) -> UnsafePickleError:
    """The error for a pickle global outside an allowlist (raised before anything of the file ran)."""
    return UnsafePickleError(source, refusal(f"{module}.{name}"))


def torch_size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size`` rebuilt as a tuple of ints (every restricted unpickler's stand-in)."""
    return tuple(map(int, dims))


def first_line(message: str) -> str:
    """The informative line of a torch error (past the weights-only preamble), shortened."""
    _, marker, rest = message.partition("WeightsUnpickler error:")
    for line in (rest if marker else message).splitlines():
        line = line.strip()
        if line:
            return line[:200]
    return ""


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
    """Whether torch's weights-only unpickler allows ``name`` by default (private API, guarded)."""
    from torch import _weights_only_unpickler as wo

    allowed = getattr(wo, "_get_allowed_globals", None)
    if allowed is None:  # pragma: no cover - a torch without the private helper
        return name.startswith("torch.") or name.startswith("collections.")
    return name in allowed()
