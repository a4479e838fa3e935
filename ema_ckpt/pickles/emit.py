"""Pickle opcodes written by hand: the one module that spells them, for every pickle a format writes.

DCP's ``.metadata`` (protocol 4) and the inert data a single file held beside its weights
(protocol 2) are written into an :class:`Opcodes` buffer, spelled as ``pickle`` spells them.

Example:
    >>> import pickle
    >>> ops = Opcodes(4)
    >>> ops.string("a"); ops.string("a"); ops.out += TUPLE2 + STOP
    >>> bytes(ops.out), pickle.loads(ops.out)
    (b'\\x80\\x04\\x8c\\x01a\\x94h\\x00\\x86.', ('a', 'a'))
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import BinaryIO

MARK, STOP, TUPLE, TUPLE1, TUPLE2, EMPTY_TUPLE = b"(", b".", b"t", b"\x85", b"\x86", b")"
EMPTY_DICT, EMPTY_LIST, SETITEMS, APPENDS = b"}", b"]", b"u", b"e"
NONE, NEWTRUE, NEWFALSE = b"N", b"\x88", b"\x89"
REDUCE, NEWOBJ, BUILD = b"R", b"\x81", b"b"
_MEMOIZE, _STACK_GLOBAL = b"\x94", b"\x93"


class Opcodes:
    """A pickle of ``protocol`` 2 or 4 being written into :attr:`out` (its PROTO opcode first).

    At protocol 4 a memo entry is stored by MEMOIZE, at protocol 2 by its index (BINPUT);
    either way it is fetched by BINGET. :meth:`spill` and :meth:`fragment` serve pickles
    written as they are made, too large to hold whole.
    """

    def __init__(self, protocol: int, sink: BinaryIO | None = None) -> None:
        if protocol not in (2, 4):
            raise ValueError(f"pickle protocol {protocol} is not written here")
        self.protocol = protocol
        self.out = bytearray(b"\x80" + bytes((protocol,)))
        self.memo: dict[object, int] = {}
        self._sink = sink
        self._fragments: dict[object, bytes] = {}

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes((value,))
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        elif -(1 << 31) <= value < (1 << 31):
            self.out += b"J" + struct.pack("<i", value)
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += (b"\x8a" + bytes((len(data),)) if len(data) < 256 else b"\x8b" + struct.pack("<i", len(data)))
            self.out += data

    def floating(self, value: float) -> None:
        self.out += b"G" + struct.pack(">d", value)

    def text(self, value: str) -> None:
        """A string; at protocol 4 a short one in the short form."""
        data = value.encode("utf-8", "surrogatepass")
        if len(data) < 256 and self.protocol == 4:
            self.out += b"\x8c" + bytes((len(data),)) + data
        else:
            self.out += b"X" + struct.pack("<I", len(data)) + data

    def string(self, value: str) -> None:
        """A string, memoized by value: written once, fetched again after."""
        if not self.recall(value):
            self.text(value)
            self.remember(value)

    def global_(self, module: str, name: str) -> None:
        """A global: at protocol 2 named on its own lines (GLOBAL), at 4 by two strings
        (STACK_GLOBAL), memoized by value like them."""
        if self.protocol == 2:
            if "\n" in module or "\n" in name:
                raise ValueError(f"a global name holds a newline: {module!r}.{name!r}")
            self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        elif not self.recall((_STACK_GLOBAL, module, name)):
            self.string(module)
            self.string(name)
            self.out += _STACK_GLOBAL
            self.remember((_STACK_GLOBAL, module, name))

    def recall(self, key: object) -> bool:
        """Fetch the memo entry stored as ``key``, if there is one."""
        index = self.memo.get(key)
        if index is None:
            return False
        self.out += b"h" + bytes((index,)) if index < 256 else b"j" + struct.pack("<I", index)
        return True

    def remember(self, key: object) -> None:
        """Store what was just written as the next memo entry, ``key``."""
        index = self.memo[key] = len(self.memo)
        if self.protocol == 4:
            self.out += _MEMOIZE
        else:
            self.out += b"q" + bytes((index,)) if index < 256 else b"r" + struct.pack("<I", index)

    def fragment(self, key: object, write: Callable[[], None]) -> None:
        """``write()``, or the bytes it gave last time: once every string and global it
        names is memoized, its bytes are only references and constants, the same each time."""
        cached = self._fragments.get(key)
        if cached is not None:
            self.out += cached
            return
        start, known = len(self.out), len(self.memo)
        write()
        if len(self.memo) == known:
            self._fragments[key] = bytes(self.out[start:])

    def spill(self, *, least: int = 1 << 20) -> None:
        """Pass what :attr:`out` holds to the sink once it holds ``least`` bytes (between
        fragments only: a fragment being recorded needs its bytes in the buffer)."""
        if self._sink is not None and len(self.out) >= least:
            self._sink.write(self.out)
            self.out.clear()

