"""torch's legacy (pre-1.6, non-zip) ``torch.save`` format: where its pickle and storages lie.

Five pickles back to back (magic number, version, system info, the object, the sorted storage
keys), then each storage as an 8-byte little-endian element count and its raw bytes. Only the
small header pickles are unpickled, admitting no global.

Example:
    >>> import pickle
    >>> head = b"".join(pickle.dumps(x, 2) for x in (MAGIC_NUMBER, PROTOCOL_VERSION, {}, {"w": 1}, []))
    >>> is_legacy(head), split_pickles(head, "x.pt")[1:]
    (True, ([], 50))
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import CheckpointFormatError
from ..pickles.bounds import check_pickle_bounds
from ..pickles.load import Allowlist, load_pickle
from ..storage import Source

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
_HEAD_BYTES = 64 << 20  # the pickles of a state dict of a few million keys
_PICKLE_PREFIX = b"\x80"  # every protocol-2 pickle torch writes starts so


def _header_global(module: str, name: str) -> Any:
    raise CheckpointFormatError("", f"a legacy header names {module}.{name}")


_NO_GLOBALS = Allowlist({}, other=_header_global)
"""The header pickles (magic number, version, storage keys) name no global."""


def is_legacy(head: bytes) -> bool:
    """Whether a file's first bytes are a legacy ``torch.save`` (its magic-number pickle)."""
    if not head.startswith(_PICKLE_PREFIX):
        return False
    try:
        end = check_pickle_bounds(head)
        return bool(load_pickle(head[:end], _NO_GLOBALS, "") == MAGIC_NUMBER)
    except Exception:
        return False


def read_legacy_head(fd: Source, file_size: int, source: str) -> tuple[bytes, list[str], int]:
    """(the object's pickle, the storage keys in stored order, where the first storage starts)."""
    return split_pickles(fd.pread(min(file_size, _HEAD_BYTES), 0), source)


def legacy_storage_starts(fd: Source, file_size: int, keys: list[str], pos: int, element_sizes: dict[str, int],
                          source: str) -> dict[str, tuple[int, int]]:
    """{storage key: (its first data byte, its element count as stored)}; ``element_sizes``: from the pickle."""
    starts: dict[str, tuple[int, int]] = {}
    for key in keys:
        if key not in element_sizes:
            raise CheckpointFormatError(source, f"legacy storage {key} is not named in the pickle")
        count = fd.pread(8, pos)
        if len(count) != 8:
            raise CheckpointFormatError(source, f"truncated: storage {key} ends past the end of the file")
        (numel,) = struct.unpack("<q", count)
        if numel < 0:
            raise CheckpointFormatError(source, f"legacy storage {key} has a negative size")
        starts[key] = (pos + 8, numel)
        pos += 8 + numel * element_sizes[key]
        if pos > file_size:
            raise CheckpointFormatError(source, f"truncated: storage {key} ends past the end of the file")
    return starts


def split_pickles(head: bytes, source: str) -> tuple[bytes, list[str], int]:
    """(the object's pickle, the storage keys, where the storages start) of a legacy file's head."""
    pos = 0
    parts: list[bytes] = []
    try:
        for _ in range(5):
            end = check_pickle_bounds(head, pos)
            parts.append(head[pos:end])
            pos = end
    except EOFError:
        raise CheckpointFormatError(source, "truncated legacy torch.save file (still being written?)") from None
    except Exception as err:
        raise CheckpointFormatError(source, f"not a readable legacy torch.save file ({err})") from None
    try:
        magic, version = load_pickle(parts[0], _NO_GLOBALS, source), load_pickle(parts[1], _NO_GLOBALS, source)
        keys = load_pickle(parts[4], _NO_GLOBALS, source)
    except Exception as err:
        raise CheckpointFormatError(source, f"not a readable legacy torch.save file ({err})") from None
    if magic != MAGIC_NUMBER or version != PROTOCOL_VERSION:
        raise CheckpointFormatError(source, "not a legacy torch.save file (wrong magic number or version)")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointFormatError(source, "legacy torch.save file without a list of storage keys")
    return parts[3], keys, pos


__all__ = ["MAGIC_NUMBER", "is_legacy", "legacy_storage_starts", "read_legacy_head", "split_pickles"]
