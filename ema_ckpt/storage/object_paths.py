"""Locations in object storage (``s3://``, ``gs://``, ``az://``, any fsspec protocol).

A :class:`RemotePath` offers the part of :class:`pathlib.Path` that finding and reading
checkpoints uses, over an fsspec filesystem; the store's failures become
:class:`~ema_ckpt.errors.RemoteStorageError` in one place (:func:`call`).

Example:
    >>> str(RemotePath.from_url("s3://bucket/run/ckpts") / "step_100")
    's3://bucket/run/ckpts/step_100'
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import stat as stat_module
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import EmaCkptError, RemoteStorageError, one_line
from . import object_outages
from .object_clients import ATTEMPTS_ENV, TIMEOUT_ENV, filesystem, request_timeout
from .object_listings import Listing, current, read_small

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
"""``protocol://rest``: a location on a storage protocol."""


@dataclass(frozen=True)
class RemoteStat:
    st_size: int
    st_mode: int
    st_mtime_ns: int = 0
    etag: str = ""  # the object version's tag, where the store gives one


def _stat_of(info: dict[str, Any]) -> RemoteStat:
    if info.get("type") == "directory":
        return RemoteStat(0, stat_module.S_IFDIR | 0o755)
    modified: Any = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if hasattr(modified, "timestamp"):
        mtime_ns = int(modified.timestamp() * 1e9)
    elif isinstance(modified, (int, float)):
        mtime_ns = int(modified * 1e9)
    else:
        mtime_ns = 0
    etag = info.get("ETag") or info.get("etag") or ""
    return RemoteStat(int(info.get("size") or 0), stat_module.S_IFREG | 0o644, mtime_ns, str(etag))


class RemotePath:
    """A location in object storage, used where the code takes a :class:`~pathlib.Path`."""

    __slots__ = ("key", "protocol")

    def __init__(self, protocol: str, key: str) -> None:
        self.protocol = protocol
        self.key = key.strip("/")  # without the protocol (``bucket/run/ckpts``), as fsspec takes it

    @classmethod
    def from_url(cls, url: str) -> RemotePath:
        match = URL.match(url)
        if match is None:
            raise ValueError(f"not a URL: {url!r}")
        return cls(match.group(1).lower(), match.group(2))

    @property
    def fs(self) -> Any:
        return filesystem(self.protocol)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.protocol, self.key) == (other.protocol, other.key)

    def __hash__(self) -> int:
        return hash((self.protocol, self.key))

    def __lt__(self, other: RemotePath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, part: str | os.PathLike[str]) -> RemotePath:
        return RemotePath(self.protocol, f"{self.key}/{os.fspath(part)}".rstrip("/"))

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix

    @property
    def stem(self) -> str:
        return PurePosixPath(self.key).stem

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.protocol, str(PurePosixPath(self.key).parent))

    @property
    def parents(self) -> list[RemotePath]:
        return [RemotePath(self.protocol, str(p)) for p in PurePosixPath(self.key).parents if str(p) != "."]

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def with_suffix(self, suffix: str) -> RemotePath:
        return self.with_name(self.stem + suffix)

    def resolve(self) -> RemotePath:
        return self

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        return PurePosixPath(self.key).relative_to(other.key)

    def _info(self) -> dict[str, Any] | None:
        listing = current(self.protocol, self.key)
        if listing is not None:  # a look under way: its listing answers
            known = listing.info(self.key)
            return None if known is None else dict(known)
        try:
            info: dict[str, Any] = read_call(self, self.fs.info, self.key)
        except FileNotFoundError:
            return None
        return info

    def exists(self) -> bool:
        return self._info() is not None

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> RemoteStat:
        info = self._info()
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        return _stat_of(info)

    def iterdir(self, *, fresh: bool = False) -> Iterator[RemotePath]:
        """The entries under this prefix; ``fresh``: from a new listing, not one kept a few seconds."""
        listing = None if fresh else current(self.protocol, self.key)
        if listing is not None:  # a look under way: its listing answers
            children = listing.children(self.key)
        else:
            if fresh:
                self.fs.invalidate_cache(self.key)
            try:
                names = read_call(self, self.fs.ls, self.key, detail=False)
            except FileNotFoundError:
                names = None
            children = None if names is None else [str(name).strip("/") for name in sorted(names)]
        if children is None:
            raise FileNotFoundError(errno.ENOENT, "no such prefix", str(self))
        yield from (RemotePath(self.protocol, child) for child in children if child != self.key)

    def rglob(self, pattern: str) -> Iterator[RemotePath]:
        """Every object under this prefix (``pattern`` must be ``*``: all of them)."""
        if pattern != "*":
            raise ValueError("RemotePath.rglob takes only '*'")
        found = read_call(self, self.fs.find, self.key, withdirs=False)
        for name in sorted(found):
            yield RemotePath(self.protocol, str(name))

    def read_bytes(self) -> bytes:
        """The object's bytes (during a look, a small one already read in that version is kept)."""
        return read_small(self.protocol, self.key, self._read_all)

    def _read_all(self, size: int | None) -> bytes:
        """The whole object; with ``size`` (as listed), one ranged request for a byte more, whose
        answer is the whole object unless it grew since."""
        if size:
            data: bytes = read_call(self, self.fs.cat_file, self.key, start=0, end=size + 1)
            if len(data) <= size:
                return data
        data = read_call(self, self.fs.cat_file, self.key)
        return data

    def write_bytes(self, data: bytes, *, exclusive: bool = False) -> None:
        """One PUT of the whole object (a reader sees the old bytes or the new); ``exclusive``:
        only if the key is new (``If-None-Match: *``), else ``FileExistsError``."""
        call(self, self.fs.pipe_file, self.key, data, **({"mode": "create"} if exclusive else {}))

    def upload(self, local: Path) -> None:
        """The local file ``local`` as this object (a multipart upload appears once complete)."""
        call(self, self.fs.put_file, str(local), self.key)

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)


def call(where: RemotePath, func: Any, *args: Any, **kwargs: Any) -> Any:
    """``func(*args)`` with the store's failures as one clear error; a missing object stays
    ``FileNotFoundError``, a conditional write's refusal ``FileExistsError``."""
    try:
        return func(*args, **kwargs)
    except BaseException as err:
        translated = _translated(where, err)
        if translated is err:
            raise
        raise translated from None


def read_call(where: RemotePath, func: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`call` for a read, stopped once a read of the store exhausted its attempts
    (:mod:`~ema_ckpt.storage.object_outages`): run as the filesystem's coroutine on its event
    loop, where it can be cancelled.

    Raises:
        RemoteStorageError: this read, or an earlier one of the store, failed for good.
    """
    protocol = where.protocol
    object_outages.check(protocol)
    fs = where.fs
    coroutine = _coroutine_of(fs, func)
    try:
        if coroutine is None:
            return func(*args, **kwargs)
        future = asyncio.run_coroutine_threadsafe(coroutine(*args, **kwargs), fs.loop)
        object_outages.started(protocol, future)
        try:
            return future.result()
        finally:
            future.cancel()  # an interrupt while waiting: the request goes too (done: nothing to do)
            object_outages.finished(protocol, future)
    except CancelledError:
        object_outages.check(protocol)  # cancelled because another read exhausted its attempts
        raise RemoteStorageError(f"{where}: the read was cancelled") from None
    except BaseException as err:
        translated = _translated(where, err)
        if translated is err:
            raise
        if isinstance(translated, RemoteStorageError) and _unanswered(err):
            translated = object_outages.trip(protocol, translated)
        raise translated from None


def _coroutine_of(fs: Any, func: Any) -> Callable[..., Any] | None:
    """The coroutine behind ``func``, a blocking method of an fsspec async ``fs``
    (``fs.cat_file`` -> ``fs._cat_file``); None for another."""
    name = str(getattr(func, "__name__", "")).lstrip("_")
    if not name or getattr(fs, "asynchronous", True) or getattr(fs, name, None) != func:
        return None
    coroutine = getattr(fs, "_" + name, None)
    try:
        loop = fs.loop
    except Exception:
        return None
    if not asyncio.iscoroutinefunction(coroutine) or loop is None or not loop.is_running():
        return None
    return coroutine


def _unanswered(err: BaseException) -> bool:
    """The store did not answer, or failed past its retries (not a refusal or a missing object)."""
    return not isinstance(err, (EmaCkptError, FileNotFoundError, FileExistsError, PermissionError,
                                NotImplementedError, TypeError, KeyboardInterrupt, SystemExit))


def _translated(where: RemotePath, err: BaseException) -> BaseException:
    """``err`` itself, or the one clear error :func:`call` raises for it."""
    if isinstance(err, FileNotFoundError):
        if "bucket" in str(err).lower():
            return RemoteStorageError(f"{where}: no such bucket ({err})")
        return err  # callers treat a missing object as on a local disk
    if isinstance(err, PermissionError):
        return RemoteStorageError(f"{where}: access denied ({err})")
    if not isinstance(err, Exception) or isinstance(err, (EmaCkptError, FileExistsError, NotImplementedError,
                                                          TypeError)):
        return err  # ours, a conditional write's refusal, a filesystem without the call, an interrupt
    # endpoint unreachable, bad region, retries exhausted
    if isinstance(err, TimeoutError) or "Timeout" in type(err).__name__:  # each client names its own
        return RemoteStorageError(f"{where}: no answer within {request_timeout():g} s, on every attempt "
                                  f"({type(err).__name__}; {TIMEOUT_ENV}, {ATTEMPTS_ENV})")
    return RemoteStorageError(f"{where}: {one_line(err)[:300]}")


def listing_of(path: RemotePath) -> Listing | None:
    """Every object under ``path`` from one recursive listing (None: nothing there); the
    filesystem's own listings cache is left as it was."""
    fs = path.fs
    cache = getattr(fs, "dircache", None)
    before = set(cache) if cache is not None else set()
    try:
        found = read_call(path, fs.find, path.key, withdirs=True, detail=True)
    except FileNotFoundError:
        return None
    finally:
        if cache is not None:
            for key in set(cache) - before:
                cache.pop(key, None)
    listing = Listing(path.protocol, path.key, found if isinstance(found, dict) else {})
    return listing if listing else None


def delete_objects(paths: list[RemotePath]) -> None:
    """Delete these objects (of one store), in one request where the store allows; missing ones are fine."""
    if paths:
        first = paths[0]
        with contextlib.suppress(FileNotFoundError):
            call(first, first.fs.rm, [p.key for p in paths])


def objects_under(path: RemotePath, *, recursive: bool = False) -> list[RemotePath]:
    """The entries in ``path`` (every object below it with ``recursive``); none when it is missing."""
    try:
        return list(path.rglob("*") if recursive else path.iterdir())
    except FileNotFoundError:
        return []


def remote_files(where: RemotePath) -> list[tuple[str, int]]:
    """(name, size) of the object at ``where``, or of every object under it (names relative)."""
    info = where._info()
    if info is None:
        return []
    if info.get("type") == "file":
        return [(where.name, int(info.get("size") or 0))]
    found = read_call(where, where.fs.find, where.key, withdirs=False, detail=True)
    prefix = where.key + "/"
    return sorted((str(name).strip("/").removeprefix(prefix), int(item.get("size") or 0))
                  for name, item in found.items())
