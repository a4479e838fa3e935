"""The CRC-32 of every record written: ISA-L's when installed, zlib's otherwise, the same values."""

from __future__ import annotations

import builtins
import importlib
import os
import zlib

import pytest
import torch

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
