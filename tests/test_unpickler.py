""":mod:`ema_ckpt.pickles`: the bounds walk before CPython's C unpickler loads a pickle, the lean
memo, and the one loader over an allowlist."""

from __future__ import annotations

import codecs
import collections
import contextlib
import copyreg
import io
import pickle
import pickletools
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ema_ckpt.errors import UnsafePickleError
from ema_ckpt.pickles.bounds import (
    _ARGUMENTS,
    _LENGTH1,
    _LENGTH4,
    _LENGTH4U,
    _LENGTH8U,
    _LINE,
    _PUT_LINE,
    _TWO_LINES,
    check_pickle_bounds,
)
from ema_ckpt.pickles.load import Allowlist, load_pickle
from ema_ckpt.pickles.memo import FetchedIndices, LeanUnpickler

_BUILTINS = Allowlist({("_codecs", "encode"): codecs.encode, ("copyreg", "_reconstructor"): copyreg._reconstructor,
                       **{("builtins", t.__name__): t for t in (bytearray, bytes, set, frozenset, object)}},
                      python2_names=True)  # what pickle spells plain data with


def _in_memory(data):
    return load_pickle(data, _BUILTINS, "x")


def _lean(data):
    return load_pickle(data, _BUILTINS, "x", lean=True)


def test_the_opcode_table_matches_pickletools():
    lengths = {
        pickletools.TAKEN_FROM_ARGUMENT1: {_LENGTH1},
        pickletools.TAKEN_FROM_ARGUMENT4: {_LENGTH4},
        pickletools.TAKEN_FROM_ARGUMENT4U: {_LENGTH4U},
        pickletools.TAKEN_FROM_ARGUMENT8U: {_LENGTH8U},
        pickletools.UP_TO_NEWLINE: {_LINE, _PUT_LINE, _TWO_LINES},
    }
    assert {op.code.encode("latin-1") for op in pickletools.opcodes} == set(_ARGUMENTS)
    for op in pickletools.opcodes:
        kind = _ARGUMENTS[op.code.encode("latin-1")]
        if op.name in ("STOP", "FRAME", "LONG_BINPUT"):
            continue  # handled on their own
        if op.arg is None:
            assert kind == 0, op.name
        elif op.arg.n >= 0:
            assert kind == op.arg.n, op.name
        else:
            assert kind in lengths[op.arg.n], op.name
        assert (kind == _TWO_LINES) == (op.arg is not None and op.arg.name == "stringnl_noescape_pair")


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_loads_what_pickle_dumps(protocol):
    value = {"a": [1, 2.5, "x", b"y", (None, True)], "b": bytearray(b"zz"), "c": {3: frozenset({4})},
             "big": 2**300, "long": "é" * 300, "bytes": b"\n" * 300, "neg": -(2**70)}
    assert _in_memory(pickle.dumps(value, protocol=protocol)) == value


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=30,
)


@given(value=_VALUES, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
@settings(max_examples=300, deadline=None)
def test_any_pickle_walks_to_its_stop_as_pickletools_does(value, protocol):
    data = pickle.dumps(value, protocol=protocol) + b"trailing bytes are not read"
    check_pickle_bounds(data)
    assert _in_memory(data) == value
    stop = max(pos for _op, _arg, pos in pickletools.genops(data))
    check_pickle_bounds(data[: stop + 1])
    with pytest.raises((EOFError, pickle.UnpicklingError)):
        check_pickle_bounds(data[:stop])  # any cut before STOP is refused by the walk


@pytest.mark.parametrize("unpickler", [_in_memory, _lean])
@given(data=st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_random_bytes_allocate_little_whatever_they_say(unpickler, data):
    unpickler(pickle.dumps(["jjjjjjjj"], protocol=5))  # a first load sets up what no data asks for
    tracemalloc.start()
    with contextlib.suppress(Exception):
        unpickler(b"\x80\x05" + data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("bomb", [
    b"\x80\x04Nr" + struct.pack("<I", 0xFFFFFFFF) + b".",  # LONG_BINPUT: a 32 GiB memo
    b"Np4000000000\n.",  # protocol 0 PUT
    b"\x80\x05\x96" + struct.pack("<Q", 10**12) + b".",  # BYTEARRAY8 allocated before it is read
    b"\x80\x04\x8e" + struct.pack("<Q", 10**12) + b".",  # BINBYTES8
    b"\x80\x04\x95" + struct.pack("<Q", 10**12) + b"N.",  # FRAME
    b"\x80\x02T" + struct.pack("<i", -5) + b".",  # a negative BINSTRING length
])
@pytest.mark.parametrize("unpickler", [_in_memory, _lean])
def test_bombs_are_refused_before_loading(bomb, unpickler):
    with pytest.raises(pickle.UnpicklingError):
        unpickler(bomb)


def test_an_unknown_opcode_is_named():
    with pytest.raises(pickle.UnpicklingError, match="invalid opcode 0xff at byte 2"):
        _in_memory(b"\x80\x04\xff.")


def test_truncated_data_is_refused():
    with pytest.raises(pickle.UnpicklingError, match="frame"):  # the frame says more than is there
        _in_memory(pickle.dumps([1, 2, 3])[:-1])
    with pytest.raises(EOFError):
        _in_memory(pickle.dumps([1, 2, 3], protocol=2)[:-1])
    with pytest.raises(EOFError):
        _in_memory(b"\x80\x04J\x01")  # a fixed-size argument cut short


@pytest.mark.parametrize("lean", [False, True])
def test_an_allowlist_is_the_only_way_to_a_global(lean):
    for protocol in (0, 2, 4):
        with pytest.raises(UnsafePickleError, match=r"x\.pt: refers to (__builtin__|builtins)\.print"):
            load_pickle(pickle.dumps(print, protocol=protocol), Allowlist({}), "x.pt", lean=lean)
    table = Allowlist({("builtins", "len"): str}, python2_names=True)
    assert load_pickle(pickle.dumps((len, [1]), protocol=2), table, "x.pt", lean=lean)[0] is str
    made = []
    other = Allowlist({}, other=lambda module, name: made.append(name) or type(name, (), {}))
    first, again = load_pickle(pickle.dumps([collections.Counter, collections.Counter], 0), other, "x", lean=lean)
    assert first is again and first.__name__ == "Counter" and made == ["Counter"]  # once per name and load
    assert load_pickle(pickle.dumps(collections.Counter), other, "x", lean=lean) is not first


def test_persistent_ids_go_to_the_callers_function_or_fail():
    class Saving(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", obj.decode()) if isinstance(obj, bytes) else None

    buffer = io.BytesIO()
    Saving(buffer, protocol=2).dump([b"ref", 1])
    assert load_pickle(buffer.getvalue(), Allowlist({}), "x", persistent=lambda pid: pid[1].upper()) == ["REF", 1]
    with pytest.raises(pickle.UnpicklingError):
        load_pickle(buffer.getvalue(), Allowlist({}), "x")


# The pure-Python unpickler with a lean memo (large DCP metadata): the same results and refusals.


_SHARED = st.recursive(
    st.none() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4).map(lambda items: [items, tuple(items), items])  # fetched again
    | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=40,
)


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_the_lean_unpickler_loads_what_pickle_dumps(protocol):
    words = [f"word{i}" for i in range(700)]  # memo indices past 256: LONG_BINGET
    value = {"a": [1, 2.5, "x", b"y", (None, True)], "b": bytearray(b"zz"), "c": {3: frozenset({4})},
             "big": 2**300, "long": "é" * 300, "words": words, "again": words[::-1], "tail": tuple(words[400:])}
    data = pickle.dumps(value, protocol=protocol)
    unpickler = LeanUnpickler(data)
    assert unpickler.load() == value
    assert len(dict.keys(unpickler.memo)) < len(unpickler.memo)  # entries never fetched were not kept


@given(value=_VALUES | _SHARED, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
@settings(max_examples=300, deadline=None)
def test_the_lean_unpickler_agrees_with_pickle(value, protocol):
    data = pickle.dumps(value, protocol=protocol) + b"trailing bytes are not read"
    assert LeanUnpickler(data).load() == pickle.loads(data)


@given(value=_SHARED, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
@settings(max_examples=200, deadline=None)
def test_every_memo_index_fetched_is_found(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    fetched = FetchedIndices(data, below=0)
    for op, arg, _pos in pickletools.genops(data):
        if op.name in ("GET", "BINGET", "LONG_BINGET"):
            assert arg in fetched or (op.name == "BINGET" and arg < 256)


def test_the_lean_unpickler_names_a_missing_memo_entry():
    with pytest.raises(pickle.UnpicklingError, match="Memo value not found at index 3"):
        LeanUnpickler(b"\x80\x04h\x03.").load()
