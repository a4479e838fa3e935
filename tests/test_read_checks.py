"""ReadChecks: the bytes read from torch zips are checked against their CRC-32s, however they are
cut, ordered, repeated and shared among workers."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ema_ckpt.errors import CheckpointFormatError
from ema_ckpt.torch_records.checks import ReadChecks

_BASE = 1000  # where the member starts in its file


def _checks(file_bytes: bytes, reads: list[tuple[int, int]] | None = None) -> ReadChecks:
    def read(_file: str, n: int, offset: int) -> bytes:
        if reads is not None:
            reads.append((offset, n))
        return file_bytes[offset:offset + n]

    return ReadChecks(lambda file: f"/ckpt/{file}", read)


@st.composite
def _reads(draw):
    size = draw(st.integers(1, 300))
    data = draw(st.binary(min_size=size, max_size=size))
    spans = draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, size)), max_size=8))
    workers = draw(st.integers(1, 3))
    owners = [draw(st.integers(0, workers - 1)) for _ in spans]
    return data, [(a, min(size, a + n)) for a, n in spans], workers, owners


@settings(max_examples=300, deadline=None)
@given(_reads(), st.booleans(), st.integers(0, 10**6))
def test_a_member_read_in_any_spans_by_any_workers_passes_exactly_when_intact(case, damaged, where):
    data, spans, workers, owners = case
    size = len(data)
    stored = zlib.crc32(data)
    file_bytes = bytearray(b"\0" * _BASE + data + b"\0" * 10)
    if damaged:
        file_bytes[_BASE + where % size] ^= 0xFF  # read or not, the member holds a damaged byte
    checks = [_checks(bytes(file_bytes)) for _ in range(workers)]
    for c in checks:
        c.expect("f", _BASE, size, stored, "key 'w'")
    failed = False
    try:
        for (a, b), owner in zip(spans, owners, strict=True):
            checks[owner].saw("f", _BASE + a, bytes(file_bytes[_BASE + a:_BASE + b]))
        parts = [c.pending() for c in checks]
        checks[0].settle([p for p in parts if p])
    except CheckpointFormatError as err:
        failed = True
        assert "key 'w'" in str(err) and "/ckpt/f" in str(err)
    assert failed == (damaged and bool(spans))  # a member nobody read is not checked


def test_spans_in_any_order_complete_the_member_without_reading_back():
    data = bytes(range(256)) * 40
    reads: list[tuple[int, int]] = []
    checks = _checks(b"\0" * _BASE + data, reads)
    checks.expect("f", _BASE, len(data), zlib.crc32(data), "key 'w'")
    for a in (4096, 0, 8192, 2048, 6000):
        b = {4096: 6000, 0: 2048, 8192: len(data), 2048: 4096, 6000: 8192}[a]
        checks.saw("f", _BASE + a, data[a:b])
    assert checks.pending() == {} and checks.checked_bytes == len(data) and reads == []
    checks.saw("f", _BASE, b"\0" * 10)  # read again after it was found intact: nothing left to check


def test_a_hole_is_found_when_the_last_span_arrives():
    data = bytes(range(256)) * 16
    checks = _checks(b"")
    checks.expect("f", _BASE, len(data), zlib.crc32(data), "key 'w'")
    torn = data[:1024] + b"\0" * 512 + data[1536:]
    checks.saw("f", _BASE, torn[:2048])
    with pytest.raises(CheckpointFormatError, match=r"key 'w': the 4096 bytes stored at offset 1000 do not match"):
        checks.saw("f", _BASE + 2048, torn[2048:])


def test_settling_reads_only_what_no_worker_read():
    data = bytes(range(256)) * 16
    reads: list[tuple[int, int]] = []
    first, second = _checks(b"\0" * _BASE + data, reads), _checks(b"\0" * _BASE + data, reads)
    for c in (first, second):
        c.expect("f", _BASE, len(data), zlib.crc32(data), "key 'w'")
    first.saw("f", _BASE, data[:1000])
    second.saw("f", _BASE + 3000, data[3000:])
    first.settle([first.pending(), second.pending()])
    assert reads == [(_BASE + 1000, 2000)] and first.pending() == {}


def test_members_without_checksums_and_bytes_outside_members_are_left_alone():
    checks = _checks(b"")
    checks.expect("f", 0, 10, 0, "key 'w'")  # saved with set_crc32_options(False)
    checks.saw("f", 0, b"x" * 10)
    checks.saw("g", 5, b"y")
    assert checks.pending() == {} and checks.checked_bytes == 0
