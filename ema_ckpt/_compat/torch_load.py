"""The private pieces of ``torch.load`` reused to read ``torch.save`` files as torch reads them.

**Relies on** torch's private serialization internals:

- ``torch._weights_only_unpickler``: its ``Unpickler`` class and ``_get_allowed_globals()``,
  the globals a weights-only load allows by default;
- the tensor rebuilds a ``data.pkl`` names: ``torch._utils._rebuild_tensor_v2``,
  ``torch._utils._rebuild_parameter``, ``torch._tensor._rebuild_from_type_v2``, and what
  ``_rebuild_tensor_v2`` does (``set_tensor_metadata``, a tensor's ``_backward_hooks``, a
  typed storage's ``_untyped_storage``);
- ``torch._utils._element_size``, the ``_internal=True`` of ``TypedStorage``,
  ``torch._guards.detect_fake_mode`` and ``torch._C.PyTorchFileReader``.

**Why it pays:** what a format's allowlist declines is read by torch's weights-only unpickler
(:func:`ema_ckpt.pickles.load.load_weights_only`: its refusals are torch's); DeepSpeed files, where
they allow it, by CPython's C unpickler building the same objects
(:mod:`ema_ckpt.formats.deepspeed.fastload`); a refused global is judged against torch's allowlist.

**When it is gone:** :func:`allowed_globals` gives None: the fast load leaves every file to
torch's weights-only load, and a refusal is judged by a prefix rule; the other names fail where used.

Example:
    >>> "torch.Size" in (allowed_globals() or {})
    True
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .._lazy import torch

REBUILD_TENSOR = "torch._utils._rebuild_tensor_v2"
REBUILD_PARAMETER = "torch._utils._rebuild_parameter"
REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"


def allowed_globals() -> dict[str, Any] | None:
    """The globals torch's weights-only unpickler allows by default, by ``module.name``, or None."""
    try:
        from torch import _weights_only_unpickler as weights_only
    except ImportError:  # pragma: no cover - a torch without the weights-only unpickler
        return None
    allowed = getattr(weights_only, "_get_allowed_globals", None)
    return allowed() if allowed is not None else None


def weights_only_unpickler(data: bytes) -> Any:
    """torch's weights-only unpickler over ``data`` (strings as UTF-8), its ``persistent_load``
    for the caller to set."""
    from torch import _weights_only_unpickler as weights_only

    return weights_only.Unpickler(io.BytesIO(data), encoding="utf-8")


@functools.cache
def rebuild_functions() -> Mapping[str, Callable[..., Any]]:
    """torch's tensor rebuilds, by the global name a ``data.pkl`` gives each."""
    return MappingProxyType({
        REBUILD_TENSOR: torch._utils._rebuild_tensor_v2,
        REBUILD_PARAMETER: torch._utils._rebuild_parameter,
        REBUILD_FROM_TYPE: torch._tensor._rebuild_from_type_v2,
    })


def rebuild_tensor_outside_fake_mode(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                                     backward_hooks: Any, metadata: Any = None) -> Any:
    """torch's ``_rebuild_tensor_v2`` less its fake-mode step (:func:`in_fake_mode`).

    Raises:
        TypeError: ``storage`` is not a ``TypedStorage`` itself.
    """
    if type(storage) is not torch.storage.TypedStorage:
        raise TypeError("not a typed storage")
    untyped = storage._untyped_storage
    t = torch.empty((0,), dtype=storage.dtype, device=untyped.device).set_(untyped, storage_offset, size, stride)
    t.requires_grad = requires_grad
    if metadata:
        torch._utils.set_tensor_metadata(t, metadata)
    t._backward_hooks = backward_hooks
    return t


def rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch's ``_rebuild_from_type_v2``: ``func(*args)`` as ``new_type``, its ``state`` set."""
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


def element_size(dtype: Any) -> int:
    """The bytes of one element of ``dtype``, as ``torch.load`` sizes a storage (else RuntimeError, TypeError)."""
    size: int = torch._utils._element_size(dtype)
    return size


def typed_storage(untyped: Any, dtype: Any) -> Any:
    """A ``TypedStorage`` of ``dtype`` over ``untyped``, as ``torch.load`` builds it (no warning)."""
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def in_fake_mode() -> bool:
    """Whether a fake-tensor mode is active (``torch.load`` then builds fake tensors)."""
    return torch._guards.detect_fake_mode(None) is not None


def zip_reader(path: str | Path) -> Any:
    """torch's reader of a zip-format ``torch.save`` file, as ``torch.load`` opens it."""
    return torch._C.PyTorchFileReader(str(path))
