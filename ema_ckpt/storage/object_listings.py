"""One look at a folder in object storage: every object under it from one recursive listing.

Finding checkpoints asks many small questions of each entry (is ``.metadata`` there, what
does ``latest`` say), each a request or two. A :class:`Listing` answers them from one recursive
listing taken when the look begins, in that thread and until the look ends, so no listing of an
earlier look hides a new checkpoint (an object written while the listing was taken is seen at
the next look; trainers write the marker files last). Small files read during a look are kept
by object version (:func:`read_small`), so a checkpoint already seen costs no request.

Example:
    >>> look = Listing("s3", "b/run", {"b/run/step_1/.metadata": {"type": "file", "size": 3}})
    >>> look.children("b/run"), look.info("b/run/step_1")["type"], look.info("b/run/step_2")
    (['b/run/step_1'], 'directory', None)
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

SMALL_FILE_BYTES = 4 << 20  # files up to this size read during a look are kept by version
KEPT_BYTES = 16 << 20  # the most bytes of small files kept (the least recently read go first)


class Listing:
    """Every object under ``root`` (a key without its protocol) as one listing gave them."""

    def __init__(self, protocol: str, root: str, found: Mapping[str, Mapping[str, Any]]) -> None:
        self.protocol, self.root = protocol, root.strip("/")
        self._files: dict[str, Mapping[str, Any]] = {}
        self._children: dict[str, set[str]] = {}
        inside = self.root + "/"
        for name, info in found.items():
            key = str(name).strip("/")
            if not key.startswith(inside):
                continue  # the root itself (a file, a placeholder) is asked of the store
            if info.get("type") != "directory" and not str(name).endswith("/"):
                self._files[key] = info
            self._children.setdefault(key, set())
            while key != self.root:  # every folder up to the root, also those holding only folders
                parent = key.rsplit("/", 1)[0]
                self._children.setdefault(parent, set()).add(key)
                key = parent

    def __bool__(self) -> bool:
        return bool(self._children.get(self.root))

    def covers(self, protocol: str, key: str) -> bool:
        return protocol == self.protocol and (key == self.root or key.startswith(self.root + "/"))

    def info(self, key: str) -> Mapping[str, Any] | None:
        """The object's listing entry (an object wins over a folder of one name, as a HEAD does),
        a folder's, or None."""
        file = self._files.get(key)
        if file is not None:
            return file
        if key in self._children:
            return {"name": key, "type": "directory", "size": 0}
        return None

    def children(self, key: str) -> list[str] | None:
        """The entries directly under ``key``, sorted; None when nothing is there."""
        names = self._children.get(key)
        return None if names is None else sorted(names)


_LOOKS = threading.local()


def current(protocol: str, key: str) -> Listing | None:
    """The listing of this thread's look that covers ``key``, if one is under way."""
    stack: list[Listing] = getattr(_LOOKS, "stack", [])
    for listing in reversed(stack):
        if listing.covers(protocol, key):
            return listing
    return None


@contextlib.contextmanager
def looking(listing: Listing | None) -> Iterator[None]:
    """Answer this thread's questions under ``listing.root`` from ``listing`` (None: from the store)."""
    if listing is None:
        yield
        return
    stack: list[Listing] = _LOOKS.__dict__.setdefault("stack", [])
    stack.append(listing)
    try:
        yield
    finally:
        stack.remove(listing)


_KEPT: OrderedDict[tuple[str, str], tuple[tuple[str, int, str], bytes]] = OrderedDict()
_KEPT_LOCK = threading.Lock()
_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")


def _version(info: Mapping[str, Any]) -> tuple[str, int, str] | None:
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("generation")
    if not tag or info.get("type") == "directory":
        return None
    modified = info.get("LastModified") or info.get("mtime") or info.get("last_modified") or info.get("updated")
    return str(tag), int(info.get("size") or 0), str(modified)


def _is_version(data: bytes, info: Mapping[str, Any]) -> bool:
    """``data``'s MD5 is the listed version's S3 ETag (single-part), GCS ``md5Hash`` or Azure
    ``content_md5`` (no other tag says what the bytes are)."""
    digest = hashlib.md5(data, usedforsecurity=False)
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if _MD5_HEX.match(etag):
        return etag == digest.hexdigest()
    settings: Any = info.get("content_settings")  # azure's ContentSettings: a mapping, not a Mapping
    stored = settings.get("content_md5") if hasattr(settings, "get") else None
    if isinstance(stored, (bytes, bytearray)) and stored:
        return bytes(stored) == digest.digest()
    encoded = info.get("md5Hash")
    if isinstance(encoded, str):
        with contextlib.suppress(ValueError):
            return base64.b64decode(encoded) == digest.digest()
    return False


def read_small(protocol: str, key: str, fetch: Callable[[int | None], bytes]) -> bytes:
    """The object's bytes, by ``fetch(size)`` (``size`` as a look lists it, else None). During a
    look, a small object is kept by version once its bytes are shown to be that version's;
    missing from the look's listing, it is ``FileNotFoundError``."""
    listing = current(protocol, key)
    if listing is None:
        return fetch(None)
    info = listing.info(key)
    if info is None:
        raise FileNotFoundError(errno.ENOENT, "no such object", f"{protocol}://{key}")
    version = _version(info)
    size = int(info.get("size") or 0)
    if version is None or size > SMALL_FILE_BYTES:
        return fetch(size if size <= SMALL_FILE_BYTES else None)  # a large one as outside a look
    with _KEPT_LOCK:
        kept = _KEPT.get((protocol, key))
        if kept is not None and kept[0] == version:
            _KEPT.move_to_end((protocol, key))
            return kept[1]
    data = fetch(size)
    if len(data) == size and _is_version(data, info):  # else rewritten since the listing
        with _KEPT_LOCK:
            _KEPT[(protocol, key)] = (version, data)
            _KEPT.move_to_end((protocol, key))
            total = sum(len(d) for _, d in _KEPT.values())
            while total > KEPT_BYTES:
                _, (_, gone) = _KEPT.popitem(last=False)
                total -= len(gone)
    return data


def forget_small_files() -> None:
    with _KEPT_LOCK:
        _KEPT.clear()


__all__ = ["KEPT_BYTES", "SMALL_FILE_BYTES", "Listing", "current", "forget_small_files", "looking", "read_small"]
