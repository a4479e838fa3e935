"""Where bytes live: a :data:`Location` is a local :class:`~pathlib.Path` or a
:class:`~ema_ckpt.storage.object_paths.RemotePath`, parsed once from what the user typed.

Both offer the part of ``Path`` that finding and reading checkpoints uses, so code outside
:mod:`ema_ckpt.storage` handles either without asking which; the functions here say what a
place allows (links, folders to nest in, ...).

Example:
    >>> as_path("ckpts/step_100")
    PosixPath('ckpts/step_100')
    >>> str(as_path("s3://bucket/run/ckpts") / "step_100")
    's3://bucket/run/ckpts/step_100'
    >>> local_file(as_path("s3://bucket/x.pt")) is None
    True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from typing_extensions import TypeIs

from .object_clients import filesystem
from .object_listings import looking
from .object_paths import URL, RemotePath, listing_of

Location: TypeAlias = "Path | RemotePath"
"""A file or folder on a local disk or in object storage."""


def as_path(value: str | os.PathLike[str] | RemotePath) -> Location:
    """A local :class:`~pathlib.Path`, or a :class:`RemotePath` for a URL (``file://`` is local)."""
    if isinstance(value, RemotePath):
        return value
    if isinstance(value, str):
        match = URL.match(value)
        if match is not None:
            if match.group(1).lower() == "file":
                return Path("/" + match.group(2).lstrip("/"))
            return RemotePath.from_url(value)
    return Path(value)


def is_location(value: object) -> TypeIs[Path | RemotePath]:
    """``value`` is already a :data:`Location` (not a string to parse)."""
    return isinstance(value, (Path, RemotePath))


def local_file(path: Location) -> Path | None:
    """The local path behind ``path``; None in object storage."""
    return None if isinstance(path, RemotePath) else path


def one_file(a: Location, b: Location) -> bool:
    """``a`` and ``b`` name one local file (a hard link, a symlink); objects have no links."""
    try:
        return not isinstance(a, RemotePath) and not isinstance(b, RemotePath) and os.path.samefile(a, b)
    except OSError:
        return False


def enclosing_folders(path: Location) -> list[Location]:
    """The folders ``path`` lies in, innermost first (resolved); none for an object."""
    return [] if isinstance(path, RemotePath) else list(path.resolve().parents)


def read_in_blocks(path: Location) -> bool:
    """Reading ``path`` fetches blocks whose CRC-32s can be kept (``open_readable(checksums=True)``)."""
    return isinstance(path, RemotePath)


def scratch_beside(path: Location, name: str) -> Path:
    """A local folder ``name`` for scratch work on ``path``: beside it, or in the working directory."""
    return (Path.cwd() if isinstance(path, RemotePath) else path.parent) / name


def local_path(path: Location) -> Path:
    """``path`` where only a local file will do (a format read from a local disk only).

    Raises:
        TypeError: ``path`` is in object storage.
    """
    if isinstance(path, RemotePath):
        raise TypeError(f"{path}: read from a local disk only")
    return path


def output_location(out: str | os.PathLike[str] | RemotePath) -> Location:
    """Where an output goes, its storage package loaded now (a missing one is said before any work)."""
    path = as_path(out)
    if isinstance(path, RemotePath):
        filesystem(path.protocol)
    return path


@contextlib.contextmanager
def one_look(path: Location) -> Iterator[None]:
    """Within it, this thread's questions about entries under ``path`` in object storage are
    answered from one recursive listing taken on entry (:mod:`~ema_ckpt.storage.object_listings`)."""
    with looking(listing_of(path) if isinstance(path, RemotePath) else None):
        yield


__all__ = ["Location", "as_path", "enclosing_folders", "is_location", "local_file", "local_path", "one_file",
           "one_look", "output_location", "read_in_blocks", "scratch_beside"]
