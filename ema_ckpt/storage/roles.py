"""What each file of an output is for, as publishing needs it: :data:`DATA` (tensors),
:data:`INDEX` (names the data files; published after them), :data:`MANIFEST` (``ema-ckpt.json``,
published last), :data:`CARRIED` (a source's file kept beside the data); and the generation
tag that names data files uploaded beside a previous output.

Example:
    >>> tagged("__0_0.20261202T010203-ab12cd.distcp", "20261202T010203-ab12cd")
    True
    >>> generation_of("model-00001-of-00002.20261202T010203-ab12cd.safetensors")
    '20261202T010203-ab12cd'
    >>> generation_of("model.safetensors") is None
    True
"""

from __future__ import annotations

import re
from typing import Literal

Role = Literal["data", "index", "manifest", "carried", "other"]
DATA: Role = "data"
INDEX: Role = "index"
MANIFEST: Role = "manifest"
CARRIED: Role = "carried"
COMMIT_ROLES: tuple[Role, Role] = (INDEX, MANIFEST)
"""The roles of the files published last, in this order: what makes an upload the output."""

_GENERATION = re.compile(r"\.(\d{8}T\d{6}-[0-9a-f]{6})\.[^.]+$")  # <stem>.<generation>.<suffix>


def tagged(name: str, generation: str) -> bool:
    """``name`` is a data file of ``generation``."""
    return generation_of(name) == generation


def generation_of(name: str) -> str | None:
    """The generation a data file's name carries, or None."""
    match = _GENERATION.search(name)
    return match.group(1) if match else None


__all__ = ["CARRIED", "COMMIT_ROLES", "DATA", "INDEX", "MANIFEST", "Role", "generation_of", "tagged"]
