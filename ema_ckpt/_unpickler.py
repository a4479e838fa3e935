"""The one coupling to CPython's private pure-Python unpickler (``pickle._Unpickler``).

Why private: the C unpickler sizes an array from the memo index a file names, so a 10-byte
pickle can make it allocate gigabytes; the pure-Python one keeps its memo in a dict. Reading
a pickle already in memory, this subclass also sends reads straight to ``BytesIO``'s C
methods and skips protocol-4 FRAME lengths: about twice as fast on a 20,000-key DCP
``.metadata``. ``tests/test_unpickler.py`` checks that what is relied on here still holds
in the installed Python: the ``dispatch`` table keyed by opcode byte, the handlers read
through ``self.read``/``self.append``, ``_Stop`` carrying the value, and the two opcodes
overridden (FRAME, BYTEARRAY8).

Example:
    >>> InMemoryUnpickler(pickle.dumps({"a": 1})).load()
    {'a': 1}
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, ClassVar

_Base: Any = pickle._Unpickler
_Stop: type[BaseException] = pickle._Stop  # type: ignore[attr-defined]


class InMemoryUnpickler(_Base):  # type: ignore[misc]
    """The pure-Python unpickler over a pickle held in memory (no memo bombs, no large
    allocations a few bytes ask for). Subclasses override ``find_class``/``persistent_load``."""

    dispatch: ClassVar[dict[int, Any]] = dict(_Base.dispatch)
    dispatch[pickle.FRAME[0]] = lambda self: self.read(8)

    def _load_bytearray8(self) -> None:
        # the stock handler allocates the declared length before reading: 8 bytes could ask for 8 GB
        (length,) = struct.unpack("<Q", self.read(8))
        if length > self._size - self._buffer.tell():
            raise pickle.UnpicklingError("BYTEARRAY8 longer than the data left")
        self.append(bytearray(self.read(length)))

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8

    def __init__(self, data: bytes) -> None:
        self._buffer = io.BytesIO(data)
        self._size = len(data)
        super().__init__(self._buffer)

    def load(self) -> Any:
        buffer = self._buffer
        self.read, self.readline, self.readinto = buffer.read, buffer.readline, buffer.readinto
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                opcode = read(1)
                if not opcode:
                    raise EOFError("pickle data was truncated")
                dispatch[opcode[0]](self)
        except _Stop as stop:  # the STOP opcode ends a pickle
            return stop.value  # type: ignore[attr-defined]
