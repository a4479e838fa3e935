"""The CRC-32 of every record written: ISA-L's when installed, zlib's otherwise, the same values."""

from __future__ import annotations

import builtins
import importlib
import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ema_ckpt import _crc


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 1 << 20, (1 << 20) + 13])
def test_crc32_equals_zlib_on_bytes_views_and_tensors(size):
    data = os.urandom(size)
    assert _crc.crc32(data) == zlib.crc32(data)
    assert _crc.crc32(memoryview(data)[3:], 0xDEADBEEF) == zlib.crc32(memoryview(data)[3:], 0xDEADBEEF)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    view = memoryview(tensor.numpy())
    assert _crc.crc32(view, 7) == zlib.crc32(view, 7)


def test_without_isal_the_crc_is_zlibs(monkeypatch):
    real_import = builtins.__import__

    def no_isal(name, *args, **kwargs):
        if name == "isal" or name.startswith("isal."):
            raise ImportError("no isal here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_isal)
    try:
        fallback = importlib.reload(_crc)
        assert fallback.IMPLEMENTATION == "zlib" and fallback.crc32(b"abc") == zlib.crc32(b"abc")
    finally:
        monkeypatch.undo()
        importlib.reload(_crc)


def test_isal_is_used_when_installed():
    pytest.importorskip("isal")
    assert _crc.IMPLEMENTATION == "isal"



COMBINES = [pytest.param(lambda *a: _crc.crc32_combine(*a), id="fastest"),
            pytest.param(lambda *a: _crc.combine_in_python(*a), id="python")]


@pytest.mark.parametrize("combine", COMBINES)
@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=6))
def test_crc32_combine_joins_pieces_checksummed_apart(combine, pieces):
    whole = 0
    for piece in pieces:
        whole = combine(whole, zlib.crc32(piece), len(piece))
    assert whole == zlib.crc32(b"".join(pieces))


@pytest.mark.parametrize("combine", COMBINES)
def test_crc32_combine_of_large_lengths(combine):
    # lengths far beyond what is hashed here: x^(8n) for n with many bits set, checked against
    # combining a prefix with itself twice (A ‖ A ‖ A)
    piece = os.urandom((1 << 20) + 7)
    two = combine(zlib.crc32(piece), zlib.crc32(piece), len(piece))
    assert combine(two, zlib.crc32(piece), len(piece)) == zlib.crc32(piece * 3)
    assert combine(0x12345678, 0, 0) == 0x12345678
