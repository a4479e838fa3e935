"""CPython's C unpickler, made safe to point at a file from anywhere.

A crafted pickle can make the C unpickler size its memo array from an index the file names
(``LONG_BINPUT 0xffffffff``, five bytes, asks for 32 GiB), or allocate a ``BYTEARRAY8`` of the
declared length before reading it. So every pickle is walked once before it is loaded: a memo
index must be below the opcode's own position (or, skipped in a run, the pickle's size) and a
declared length within the data left, which bounds what loading can allocate by a small
multiple of the pickle's size. Globals still reach nothing but what :mod:`.load`'s
``find_class`` returns. Runs of fixed-size opcodes are skipped by one regular-expression match,
so the walk takes about half the C unpickler's time.

Example:
    >>> check_pickle_bounds(pickle.dumps({"a": 1}) + b"after")  # where the pickle ends
    21
"""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Callable

# What follows each opcode byte (the pickle format, protocols 0-5; tests check the table
# against ``pickletools``). A kind >= 0 is a fixed number of argument bytes.
_LINE = -1  # one newline-terminated line (protocol 0 text)
_TWO_LINES = -2  # module and name lines (GLOBAL, INST)
_LENGTH1 = -3  # a 1-byte length, then that many bytes
_LENGTH4 = -4  # a signed 4-byte length, then the bytes
_LENGTH4U = -5
_LENGTH8U = -6
_PUT_LINE = -7  # memo stores naming their index
_PUT4 = -8
_FRAME = -9
_STOP = -10
_INVALID = -11

_ARGUMENTS: dict[bytes, int] = {
    b"I": _LINE, b"J": 4, b"K": 1, b"M": 2, b"L": _LINE, b"\x8a": _LENGTH1, b"\x8b": _LENGTH4,
    b"S": _LINE, b"T": _LENGTH4, b"U": _LENGTH1, b"B": _LENGTH4U, b"C": _LENGTH1,
    b"\x8e": _LENGTH8U, b"\x96": _LENGTH8U, b"\x97": 0, b"\x98": 0, b"N": 0, b"\x88": 0,
    b"\x89": 0, b"V": _LINE, b"\x8c": _LENGTH1, b"X": _LENGTH4U, b"\x8d": _LENGTH8U,
    b"F": _LINE, b"G": 8, b"]": 0, b"a": 0, b"e": 0, b"l": 0, b")": 0, b"t": 0, b"\x85": 0,
    b"\x86": 0, b"\x87": 0, b"}": 0, b"d": 0, b"s": 0, b"u": 0, b"\x8f": 0, b"\x90": 0,
    b"\x91": 0, b"0": 0, b"2": 0, b"(": 0, b"1": 0, b"g": _LINE, b"h": 1, b"j": 4,
    b"p": _PUT_LINE, b"q": 1, b"r": _PUT4, b"\x94": 0, b"\x82": 1, b"\x83": 2, b"\x84": 4,
    b"c": _TWO_LINES, b"\x93": 0, b"R": 0, b"b": 0, b"i": _TWO_LINES, b"o": 0, b"\x81": 0,
    b"\x92": 0, b"\x80": 1, b".": _STOP, b"\x95": _FRAME, b"P": _LINE, b"Q": 0,
}  # fmt: skip


@functools.cache
def _walker(opcodes: bytes | None, blocks: int) -> tuple[tuple[int, ...], Callable[[bytes, int], re.Match[bytes]]]:
    """What follows each opcode byte (those not in ``opcodes``, when given, invalid), and the
    match that skips any run of fixed-size opcodes and of LONG_BINPUTs below ``blocks`` * 65536
    (at most the pickle's size: nearly every object of a large protocol 2 pickle has one)."""
    kinds = tuple(_ARGUMENTS.get(op, _INVALID) if opcodes is None or op in opcodes else _INVALID
                  for op in map(bytes, zip(range(256))))
    by_width: dict[int, list[bytes]] = {}
    for code, kind in enumerate(kinds):
        if kind >= 0:
            by_width.setdefault(kind, []).append(re.escape(bytes([code])))
    runs = [b"[" + b"".join(codes) + b"]" + b"." * width for width, codes in sorted(by_width.items())]
    if blocks and kinds[ord("r")] == _PUT4:
        runs.append(rb"r..[\x00-" + re.escape(bytes([blocks - 1])) + rb"]\x00")
    pattern = re.compile(b"(?:" + b"|".join(runs) + b")*+", re.DOTALL)  # possessive: no backtracking
    return kinds, pattern.match  # type: ignore[return-value]  # matches (maybe empty) anywhere


_LENGTH_PREFIX = {_LENGTH1: (1, False), _LENGTH4: (4, True), _LENGTH4U: (4, False), _LENGTH8U: (8, False)}


def check_pickle_bounds(data: bytes, start: int = 0, opcodes: bytes | None = None) -> int:
    """Walk ``data``'s opcodes from ``start`` up to STOP; refuse what would make loading allocate
    more than a small multiple of ``len(data)``, and any opcode not in ``opcodes`` (when given).
    Returns where the pickle ends (the byte after its STOP).

    Raises:
        pickle.UnpicklingError: an unknown opcode (or one not in ``opcodes``), a memo index
            past its own position or the pickle's size, a length or frame longer than the
            data left.
        EOFError: the data ends before STOP.
    """
    size, pos = len(data), start
    kinds, skip_fixed = _walker(opcodes, min(256, size >> 16))
    lengths = _LENGTH_PREFIX.get
    while pos < size:
        # most opcodes have a fixed-size argument; the pattern matches (maybe empty) anywhere
        pos = skip_fixed(data, pos).end()
        if pos >= size:
            break
        kind = kinds[data[pos]]
        pos += 1
        prefix = lengths(kind)  # the commonest left: strings
        if prefix is not None:
            width, signed = prefix
            length = int.from_bytes(data[pos : pos + width], "little", signed=True) if signed else \
                int.from_bytes(data[pos : pos + width], "little")  # the keyword costs more than the branch
            pos += width
            if length < 0 or length > size - pos:
                raise pickle.UnpicklingError(f"a length at byte {pos - width} is longer than the data left")
            pos += length
        elif kind >= 0:  # a fixed-size argument the data is too short for
            break
        elif kind == _STOP:
            return pos
        elif kind == _PUT4:
            if int.from_bytes(data[pos : pos + 4], "little") > pos:
                raise pickle.UnpicklingError(f"memo index at byte {pos} out of range")
            pos += 4
        elif kind == _FRAME:
            if int.from_bytes(data[pos : pos + 8], "little") > size - pos - 8:
                raise pickle.UnpicklingError(f"frame at byte {pos - 1} is longer than the data left")
            pos += 8
        elif kind == _INVALID:
            raise pickle.UnpicklingError(f"invalid opcode 0x{data[pos - 1]:02x} at byte {pos - 1}")
        else:  # text lines (protocol 0)
            end = data.find(b"\n", pos)
            if end < 0:
                break
            if kind == _PUT_LINE:
                line = data[pos:end]
                if not line.isdigit() or len(line) > 20 or int(line) > pos:
                    raise pickle.UnpicklingError(f"memo index at byte {pos} out of range")
            elif kind == _TWO_LINES:
                end = data.find(b"\n", end + 1)
                if end < 0:
                    break
            pos = end + 1
    raise EOFError("pickle data was truncated")

