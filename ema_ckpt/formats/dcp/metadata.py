"""DCP metadata: finding it, loading it (every rank's ``__<r>.metadata`` merged, where torch's
own tools read only rank 0's), and the stored-chunk record."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointFormatError, CheckpointNotFoundError
from ...layout import Box
from ...storage import Location
from .metadata_unpickle import load_dcp_metadata_bytes

METADATA_FILE = ".metadata"
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
DATA_FILE = re.compile(r"^__(\d+)_(\d+)(?:\.[0-9A-Za-z-]+)?\.distcp$")
"""``__<rank>_<n>.distcp``, or ``__<rank>_<n>.<tag>.distcp`` (an output uploaded to object storage)."""


class KeyPaths(Mapping[str, tuple[str, ...]]):
    """DCP's ``planner_data``: each key's path in the nested state dict it was saved from. A path
    ``(root, rest)`` whose key is ``root + "." + rest`` is kept as its root alone, shared (25 MiB
    less at 200,000 keys).

    Example:
        >>> paths = KeyPaths({"model.fc.w": "model", "step": ("step",)})
        >>> paths["model.fc.w"], paths["step"], list(paths)
        (('model', 'fc.w'), ('step',), ['model.fc.w', 'step'])
    """

    __slots__ = ("entries",)

    def __init__(self, entries: dict[str, str | tuple[str, ...]]) -> None:
        self.entries = entries
        """{key: its root (the path is the root and the rest of the key), or its whole path}."""

    def __getitem__(self, key: str) -> tuple[str, ...]:
        found = self.entries[key]
        return (found, key[len(found) + 1 :]) if type(found) is str else found  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def same_as(self, other: KeyPaths) -> bool:
        """The same paths in the same key order."""
        return len(self.entries) == len(other.entries) and list(self.entries.items()) == list(other.entries.items())


def planner_data_of(metadata: Any) -> KeyPaths:
    """``planner_data`` as {key: path of strings}; anything malformed is dropped (it is only a hint)."""
    raw = getattr(metadata, "planner_data", None)
    entries: dict[str, str | tuple[str, ...]] = {}
    if not isinstance(raw, dict):
        return KeyPaths(entries)
    roots: dict[str, str] = {}
    for key, path in raw.items():
        if isinstance(key, str) and isinstance(path, (tuple, list)) and path and all(isinstance(p, str) for p in path):
            root = path[0]
            if len(path) == 2 and type(root) is str and key == f"{root}.{path[1]}":
                entries[key] = roots.setdefault(root, root)
            else:
                entries[key] = path if type(path) is tuple else tuple(path)
    return KeyPaths(entries)


def metadata_int(value: Any) -> int:
    """An int from metadata, refusing floats, strings and other look-alikes, and integers that do
    not fit in 64 bits (every size and offset becomes a torch size or a file offset)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"{value} does not fit in 64 bits")
        return value
    raise TypeError(f"{value!r} is not an integer")


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One stored chunk of a tensor: its box and where its record lies."""

    box: Box
    file: str
    offset: int
    length: int

    @property
    def rank(self) -> int | None:
        """The writing rank, from the ``__<rank>_<n>.distcp`` file name."""
        match = DATA_FILE.match(self.file)
        return int(match.group(1)) if match else None


def is_dcp(path: Location) -> bool:
    return path.is_dir() and ((path / METADATA_FILE).is_file()
                              or any(RANK_METADATA.match(p.name) and p.is_file() for p in path.iterdir()))


def incomplete(path: Location) -> str | None:
    if path.is_dir() and not is_dcp(path) and any(DATA_FILE.match(p.name) for p in path.iterdir()):
        return "DCP data files but no .metadata yet (a save in progress?)"
    return None


def _read_metadata_file(file: Location, inert_globals: Sequence[str]) -> Any:
    try:
        data = file.read_bytes()
    except OSError as err:
        raise CheckpointFormatError(file, f"cannot read ({err.strerror})") from None
    return load_dcp_metadata_bytes(data, str(file), inert_globals)


def load_metadata(path: Location, inert_globals: Sequence[str] = ()) -> tuple[Any, list[Location]]:
    """The checkpoint's metadata and the files it came from (every rank's ``__<r>.metadata``
    merged where there is no ``.metadata``); ``inert_globals``: classes read as data."""
    global_file = path / METADATA_FILE
    if global_file.is_file():
        return _read_metadata_file(global_file, inert_globals), [global_file]
    files = sorted(
        (p for p in path.iterdir() if RANK_METADATA.match(p.name) and p.is_file()),
        key=lambda p: int(RANK_METADATA.match(p.name).group(1)),  # type: ignore[union-attr]
    )
    if not files:
        raise CheckpointNotFoundError(path, "no .metadata file: not a DCP checkpoint")
    merged = _read_metadata_file(files[0], inert_globals)
    for file in files[1:]:
        md = _read_metadata_file(file, inert_globals)
        for key, entry in md.state_dict_metadata.items():
            known = merged.state_dict_metadata.get(key)
            if known is None:
                merged.state_dict_metadata[key] = entry
            elif hasattr(known, "chunks") and hasattr(entry, "chunks"):
                seen = {tuple(c.offsets) for c in known.chunks}
                known.chunks.extend(c for c in entry.chunks if tuple(c.offsets) not in seen)
        merged.storage_data = {**(md.storage_data or {}), **(merged.storage_data or {})}
        if md.planner_data:
            merged.planner_data = {**md.planner_data, **(merged.planner_data or {})}
    return merged, files

