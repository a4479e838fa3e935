"""``inspect``: what a checkpoint holds, from metadata alone (no tensor is read)."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..discovery import Entry, LeftPart, discover, step_record
from ..dtypes import itemsize
from ..errors import Note
from ..formats import detect_format, open_checkpoint, resolve
from ..formats.base import registered_formats
from ..formats.options import ReadOptions
from ..manifest import MANIFEST_NAME, Manifest
from ..maths import profile_from_dict
from ..selection import container_prefix, select_keys
from ..steps import StepUnknown, describe_counters
from ..storage import Location, as_path
from ..streamed import StreamedList


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One key as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunks: int

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "shape": list(self.shape), "dtype": self.dtype, "bytes": self.nbytes,
                "chunks": self.chunks}


@dataclass(slots=True)
class InspectResult:
    """What :func:`inspect_checkpoint` found."""

    path: Location
    format_name: str
    step: int | None
    key_count: int
    total_bytes: int
    dtypes: dict[str, int]
    tensors: list[TensorInfo] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    step_source: str | None = None
    """Where the step came from: ``trainer_state.json global_step``, ``folder name``, …"""
    model_path: Location | None = None
    """The folder the weights are read from, when a trainer nests them (else None)."""
    trainer: str | None = None
    container: str | None = None
    """The DCP container level (``"model."``) that ``consolidate`` leaves out of the names."""
    notes: list[str] = field(default_factory=list)
    counters: list[dict[str, Any]] = field(default_factory=list)
    """Every counter the checkpoint's records hold (``record``, ``value``, ``counts``, ``taken``)."""

    def to_dict(self, *, streamed: bool = False) -> dict[str, Any]:
        """The report as plain data; ``streamed``: its tensors made as JSON writes them
        (:class:`~ema_ckpt.streamed.StreamedList`)."""
        return {
            "path": str(self.path),
            "format": self.format_name,
            "step": self.step,
            "step_source": self.step_source,
            "model_path": None if self.model_path is None else str(self.model_path),
            "trainer": self.trainer,
            "container": self.container,
            "notes": self.notes,
            "counters": self.counters,
            "keys": self.key_count,
            "total_bytes": self.total_bytes,
            "dtypes": self.dtypes,
            "details": self.details,
            "manifest": self.manifest,
            "tensors": (StreamedList(self.tensors, TensorInfo.to_dict) if streamed
                        else [t.to_dict() for t in self.tensors]),
        }


@dataclass(slots=True)
class FolderInspection:
    """What :func:`inspect_folder` found: each entry of a folder of checkpoints, taken or left, and why."""

    path: Location
    entries: list[Entry]
    notes: list[str] = field(default_factory=list)
    left: list[LeftPart] = field(default_factory=list)
    """Model-bearing parts of the checkpoints that are not read, and why."""

    @property
    def taken(self) -> list[Entry]:
        return [e for e in self.entries if e.taken]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "checkpoints": len(self.taken),
            "entries": [{"path": str(e.path), "taken": e.taken, "why": e.why, "step": e.step,
                         "format": e.format_name,
                         "components": [{"name": c.name, "path": str(c.path), "format": c.format_name,
                                         "role": c.role} for c in e.components]} for e in self.entries],
            "left": [part.to_json() for part in self.left],
            "notes": self.notes,
        }


def is_folder_of_checkpoints(path: str | Location) -> bool:
    """``path`` is a folder of checkpoints (to list), not a checkpoint itself (to describe: a
    DeepSpeed save folder is described by the tag its ``latest`` names)."""
    path = as_path(path)
    return path.is_dir() and not (path / MANIFEST_NAME).exists() and detect_format(path) is None


def inspect_folder(path: str | Location, *, step_regex: str | None = None, step_from: str | None = None,
                   state_key: str | None = None, inert_globals: Sequence[str] = (),
                   keep_prefix: bool = False) -> FolderInspection:
    """Every entry of a folder of checkpoints, and why each was taken (with its step) or left:
    the averaging commands' scan, reading no tensor.

    Example:
        >>> [(e.path.name, e.taken) for e in inspect_folder("ckpts").entries]   # doctest: +SKIP
        [('epoch=0-step=2.ckpt', True), ('last.ckpt', False)]
    """
    path = as_path(path)
    found = discover([path], step_regex=step_regex, step_from=step_from, all_components=True, require=False,
                     read=ReadOptions(state_key, tuple(inert_globals), keep_prefix))
    entries = sorted(found.entries, key=lambda e: str(e.path))
    notes = [n for n in found.notes if not any(str(n).startswith(f"skipped {e.path}:") for e in entries)]
    return FolderInspection(path, entries, notes, found.left)


def inspect_checkpoint(path: str | Location, *, state_key: str | None = None, step_from: str | None = None,
                       inert_globals: Sequence[str] = (), keep_prefix: bool = False) -> InspectResult:
    """Describe the checkpoint at ``path`` from metadata alone: format, step, keys, dtypes,
    bytes, layout. ``state_key``, ``inert_globals``: as for :func:`~ema_ckpt.accumulate`.

    Example:
        >>> info = inspect_checkpoint("ckpts/step_1000")        # doctest: +SKIP
        >>> info.format_name, info.step, info.key_count         # doctest: +SKIP
        ('dcp', 1000, 120)
    """
    found = resolve(path)  # found, located and detected once, then passed on
    path, location = found.path, found.model
    options = ReadOptions(state_key, tuple(inert_globals), keep_prefix)
    with contextlib.closing(open_checkpoint(found, read=options)) as reader:
        tensors = [  # from the stored shapes and dtype names: for most formats, without importing torch
            TensorInfo(k, shape, dtype, math.prod(shape) * itemsize(dtype), len(reader.layout(k)))
            for k, (shape, dtype) in reader.stored().items()
        ]
        manifest = Manifest.read(path) if path.is_dir() else None
        step: int | None = None
        source: str | None = None
        counters: list[dict[str, Any]] = []
        if manifest is not None:
            step, source = manifest.step, "ema-ckpt.json"
        else:
            try:
                record = step_record(found, root=path.parent, step_from=step_from)
            except StepUnknown as why:
                record, source = None, Note.of(why.args[0])
            if record is not None:
                step, source = record.step, record.source
                counters = [{**c, "taken": c["record"] == record.taken} for c in describe_counters(record.counters)]
        notes = _ignored_weights(path, reader.format_name)
        notes += [f"{other}/: another model, shown by inspect {path / other}; accumulate averages each model into "
                  f"OUT/<its folder>" for other in location.others]
        container = container_prefix(reader, select_keys(reader))
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
            step_source=source,
            model_path=location.path if location.trainer is not None else None,
            trainer=location.trainer,
            container=container,
            notes=notes,
            counters=counters,
        )


def _ignored_weights(path: Location, chosen: str) -> list[str]:
    """Notes on weights of another format in the same folder, not read (the Hugging Face
    Trainer's bf16 ``model.safetensors`` beside the DeepSpeed tag's fp32 masters)."""
    if not path.is_dir():
        return []
    notes = []
    for fmt in registered_formats().values():
        name = fmt.name
        if name == chosen or not fmt.detect(path):
            continue
        files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES.get(name, ())))
        shown = ", ".join(files[:3]) or name
        target = path / files[0] if len(files) == 1 else path
        notes.append(f"{shown} ({name}) ignored: the {chosen} weights are read"
                     + (f"; pass {target} to read that file instead" if target != path else ""))
    return notes


_SUFFIXES = {"safetensors": (".safetensors", ".safetensors.index.json")}


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
