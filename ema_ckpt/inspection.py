"""``inspect``: what a checkpoint holds, from metadata alone (no tensor is read).

Example:
    >>> report = inspect_checkpoint("ckpts/step_1000")      # doctest: +SKIP
    >>> report.format_name, report.key_count, report.total_bytes  # doctest: +SKIP
    ('dcp', 24, 1073741824)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .discovery import step_from_name
from .formats import open_checkpoint
from .manifest import Manifest
from .schedules import profile_from_dict


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One key as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunks: int


@dataclass(slots=True)
class InspectResult:
    """What :func:`inspect_checkpoint` found."""

    path: Path
    format_name: str
    step: int | None
    key_count: int
    total_bytes: int
    dtypes: dict[str, int]
    tensors: list[TensorInfo] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "format": self.format_name,
            "step": self.step,
            "keys": self.key_count,
            "total_bytes": self.total_bytes,
            "dtypes": self.dtypes,
            "details": self.details,
            "manifest": self.manifest,
            "tensors": [
                {"key": t.key, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes, "chunks": t.chunks}
                for t in self.tensors
            ],
        }


def inspect_checkpoint(path: str | Path) -> InspectResult:
    """Describe the checkpoint at ``path``: format, step, keys, dtypes, bytes, layout."""
    path = Path(path)
    with contextlib.closing(open_checkpoint(path)) as reader:
        specs = reader.specs()
        tensors = [
            TensorInfo(k, s.shape, str(s.dtype).removeprefix("torch."), s.nbytes, len(reader.layout(k)))
            for k, s in specs.items()
        ]
        step = reader.step if reader.step is not None else step_from_name(path.name)
        manifest = Manifest.read(path) if path.is_dir() else None
        if manifest is not None:
            step = manifest.step
        return InspectResult(
            path=path,
            format_name=reader.format_name,
            step=step,
            key_count=len(tensors),
            total_bytes=sum(t.nbytes for t in tensors),
            dtypes=dict(Counter(t.dtype for t in tensors)),
            tensors=tensors,
            details=reader.info(),
            manifest=_manifest_summary(manifest) if manifest is not None else None,
        )


def _manifest_summary(manifest: Manifest) -> dict[str, Any]:
    try:
        description = profile_from_dict(manifest.profile).describe()
    except (ValueError, KeyError):
        description = str(manifest.profile)
    return {
        "kind": manifest.kind,
        "description": description,
        "profile": manifest.profile,
        "dtype": manifest.dtype,
        "step": manifest.step,
        "checkpoints": len(manifest.checkpoints),
        "tool_version": manifest.tool_version,
    }
