"""A module imported on first attribute access.

Byte-copying commands never touch a tensor: the modules on their path refer to ``torch``
through this proxy and never pay its import.

Example:
    >>> json = LazyModule("json")
    >>> json.dumps([1])
    '[1]'
"""

from __future__ import annotations

from typing import Any

from ._gc import import_module


class LazyModule:
    """Stands in for the module ``name`` until an attribute is read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = import_module(self._name)
        value = getattr(module, attr)
        # kept on the proxy: later reads are plain attribute reads (hot loops read torch.* per tensor)
        setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


torch: Any = LazyModule("torch")
