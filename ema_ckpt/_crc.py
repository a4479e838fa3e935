"""CRC-32, the zip checksum of every record written: ISA-L's when ``isal`` is installed, else zlib's.

Both compute the same standard CRC-32; ISA-L's folds with carry-less multiplies (PCLMULQDQ,
PMULL) and runs at several GB/s where zlib 1.2's table-driven loop gives about 1 GB/s. A sweep
hashes every byte it writes, so on a small machine this is a visible share of a run.

Example:
    >>> crc32(b"abc") == 0x352441C2 and crc32(b"c", crc32(b"ab")) == crc32(b"abc")
    True
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_Crc32 = Callable[[Any, int], int]


def _fastest() -> tuple[_Crc32, str]:
    try:
        from isal import isal_zlib
    except ImportError:  # an optional speed-up: a platform without the wheel keeps zlib's
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


_crc32, IMPLEMENTATION = _fastest()


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 of ``data``, continuing from ``value`` (as ``zlib.crc32``)."""
    return _crc32(data, value)
