"""What :mod:`ema_ckpt._unpickler` relies on in CPython's private pure-Python unpickler still holds."""

from __future__ import annotations

import pickle
import struct

import pytest

from ema_ckpt._unpickler import InMemoryUnpickler


def test_the_private_unpickler_has_the_shape_relied_on():
    base = pickle._Unpickler  # type: ignore[attr-defined]
    assert isinstance(base.dispatch, dict)
    assert all(isinstance(k, int) for k in base.dispatch)  # keyed by opcode byte
    for opcode in (pickle.FRAME, pickle.BYTEARRAY8, pickle.STOP, pickle.GLOBAL, pickle.BINPERSID):
        assert opcode[0] in base.dispatch
    assert issubclass(pickle._Stop, Exception) and hasattr(pickle._Stop(1), "value")  # type: ignore[attr-defined]
    for name in ("find_class", "persistent_load", "load"):
        assert callable(getattr(base, name))


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_loads_what_pickle_dumps(protocol):
    value = {"a": [1, 2.5, "x", b"y", (None, True)], "b": bytearray(b"zz"), "c": {3: frozenset({4})}}
    assert InMemoryUnpickler(pickle.dumps(value, protocol=protocol)).load() == value


def test_frames_are_skipped_not_read_through():
    data = pickle.dumps(list(range(10_000)), protocol=4)
    assert pickle.FRAME in data
    assert InMemoryUnpickler(data).load() == list(range(10_000))


def test_a_bytearray8_longer_than_the_data_is_refused_before_allocating():
    bomb = b"\x80\x05\x96" + struct.pack("<Q", 10**12) + b"."
    with pytest.raises(pickle.UnpicklingError, match="longer than the data"):
        InMemoryUnpickler(bomb).load()


def test_truncated_data_raises_eof():
    with pytest.raises(EOFError):
        InMemoryUnpickler(pickle.dumps([1, 2, 3])[:-1]).load()


def test_find_class_is_the_only_way_to_a_global():
    class Refusing(InMemoryUnpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"{module}.{name}")

    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print"):
        Refusing(pickle.dumps(print)).load()
