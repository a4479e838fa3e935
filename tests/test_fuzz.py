"""Fuzzing the loaders: damaged DCP, DeepSpeed and safetensors checkpoints.

Each example takes a small, valid checkpoint, damages it (random byte flips, truncations,
insertions and deletions; or, one level up, the unpickled / parsed structure with fields
swapped for wrong types, huge or negative numbers, and then written back), then opens it
with :func:`open_checkpoint` and reads every key in full. The only acceptable outcomes are
success or an :class:`~ema_ckpt.errors.EmaCkptError`: any other exception (or a hang,
turned into a failure by an alarm) is a bug in a reader. Inputs stay tiny, so a run is
bounded by ``max_examples`` per target (about a minute in all).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import traceback
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ema_ckpt.commands.verify import verify
from ema_ckpt.errors import CheckpointFormatError, EmaCkptError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
from ema_ckpt.manifest import MANIFEST_NAME, Manifest
from tests.dcp_helpers import write_dcp
from tests.test_deepspeed import _write_zero

EXAMPLES = int(os.environ.get("EMA_CKPT_FUZZ_EXAMPLES", "200"))
STRICT = bool(os.environ.get("EMA_CKPT_FUZZ_STRICT"))
"""Set to fail on the known crashes below too (to check whether they are fixed)."""
HANG_SECONDS = 10
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LARGE_READ = 64 << 20


class _Hang(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` in a reader eats it."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise _Hang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# Crashes the fuzzer finds are listed here while being fixed, with a strict-xfail repro at the end
# of this file. An entry tolerates exceptions of these types (None: any) whose innermost ema_ckpt
# frame is (file, function), or with ``anywhere`` any ema_ckpt frame. Fix the reader, drop the entry.
@dataclasses.dataclass(frozen=True)
class KnownCrash:
    types: frozenset[str] | None
    file: str
    function: str
    anywhere: bool = False


_TORCH_LOAD_ERRORS = frozenset({"TypeError", "AssertionError", "AttributeError"})
KNOWN_CRASHES: list[KnownCrash] = []  # every crash the fuzzer found is fixed; add new ones here


def _ema_frames(err: BaseException) -> list[tuple[str, str]]:
    frames = []
    for frame in traceback.extract_tb(err.__traceback__):
        name = frame.filename.replace("\\", "/")
        if "/ema_ckpt/" in name:
            frames.append((name[name.rindex("/ema_ckpt/") + 1 :], frame.name))
    return frames


def crash_signature(err: BaseException) -> tuple[str, str, str]:
    """(exception type, file, function) of the innermost ema_ckpt frame."""
    frames = _ema_frames(err)
    file, function = frames[-1] if frames else ("?", "?")
    return type(err).__name__, file, function


def is_known_crash(err: BaseException) -> bool:
    frames = _ema_frames(err)
    for known in KNOWN_CRASHES:
        if known.types is not None and type(err).__name__ not in known.types:
            continue
        where = frames if known.anywhere else frames[-1:]
        if (known.file, known.function) in where:
            return True
    return False


def _vm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize")


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory() -> Iterator[None]:
    """Address space capped at 4 GiB above the current size while fuzzing.

    A reader that allocates gigabytes for a tiny input (say, from a huge number in a
    header) then fails with MemoryError here instead of taking the machine down.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _vm_bytes() + (4 << 30)
    except (ImportError, OSError, ValueError):
        yield
        return
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _disk_bytes(path: Path) -> int:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return sum(p.stat().st_size for p in files)


def _read_all(path: Path) -> None:
    """Open ``path`` and read every key in full; anything but an EmaCkptError propagates."""
    try:
        with _time_limit(HANG_SECONDS):
            reader = open_checkpoint(path)
            try:
                reader.info()
                plausible = 64 * _disk_bytes(path) + (1 << 20)
                for key, spec in reader.specs().items():
                    boxes = list(reader.layout(key))
                    if spec.nbytes <= min(plausible, LARGE_READ):
                        value = reader.read(key, Box.full(spec.shape))
                        assert tuple(value.shape) == spec.shape and value.dtype == spec.dtype, key
                        continue
                    # The metadata promises more than the files hold: never allocate it; one
                    # element of each stored box must still end in data or a clean error.
                    for box in boxes:
                        if box.numel:
                            reader.read(key, Box(box.offsets, tuple(1 for _ in box.sizes)))
            finally:
                reader.close()
    except EmaCkptError:
        pass
    except Exception as err:
        if not STRICT and is_known_crash(err):
            return
        raise


# --- generic mutations ------------------------------------------------------------------------

_BYTE_OPS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 30), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 1 << 30), st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01])),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 30), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 30), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 30), st.integers(1, 32)),
)
BYTE_MUTATIONS = st.lists(_BYTE_OPS, min_size=1, max_size=4)


def mutate_bytes(data: bytes, ops: list[tuple[str, int, Any]]) -> bytes:
    buf = bytearray(data)
    for op, where, arg in ops:
        pos = where % (len(buf) + 1)
        if op == "flip" and buf:
            buf[pos % len(buf)] ^= arg
        elif op == "set" and buf:
            buf[pos % len(buf)] = arg
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = arg
        elif op == "delete":
            del buf[pos : pos + arg]
    return bytes(buf)


Path_ = tuple[tuple[str, Any], ...]


def _walk(obj: Any, path: Path_ = (), depth: int = 0) -> Iterator[Path_]:
    """Every slot of a nested structure: attributes of dataclasses/objects, dict keys and values, items."""
    if path:
        yield path
    if depth > 8:
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):  # an earlier edit may have deleted it
                yield from _walk(getattr(obj, f.name), (*path, ("attr", f.name)), depth + 1)
    elif isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield (*path, ("key", key))
            yield from _walk(value, (*path, ("item", key)), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, ("idx", i)), depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Tensor, torch.dtype)):
        for name, value in list(vars(obj).items()):
            yield from _walk(value, (*path, ("attr", name)), depth + 1)


_DELETE = object()
EDITS: list[str] = []
"""The structural edits of the current example (for failure reports and tools)."""


def _rebuild_sequence(obj: Any, items: list[Any]) -> Any:
    if isinstance(obj, list):
        obj[:] = items
        return obj
    try:
        return type(obj)(items)
    except (TypeError, ValueError):  # torch.Size of non-ints
        return tuple(items)


def replace(obj: Any, path: Path_, value: Any) -> Any:
    """``obj`` with the slot at ``path`` set to ``value`` (``_DELETE`` removes it)."""
    if not path:
        return value
    (kind, name), rest = path[0], path[1:]
    if kind == "attr":
        child = getattr(obj, name)
        if not rest and value is _DELETE:
            with contextlib.suppress(AttributeError, TypeError):
                object.__delattr__(obj, name)
            return obj
        object.__setattr__(obj, name, replace(child, rest, value))
        return obj
    if kind == "item":
        if not rest and value is _DELETE:
            del obj[name]
        else:
            obj[name] = replace(obj[name], rest, value)
        return obj
    if kind == "key":
        items = list(obj.items())
        index = next(i for i, (k, _) in enumerate(items) if k is name)
        new_key = replace(copy.copy(name), rest, value) if rest else value
        if new_key is _DELETE:
            del items[index]
        else:
            items[index] = (new_key, items[index][1])
        obj.clear()
        for k, v in items:
            obj[k] = v
        return obj
    items = list(obj)
    if not rest and value is _DELETE:
        del items[name]
    elif not rest and value == "__dup__":
        items.insert(name, items[name])
    else:
        items[name] = replace(items[name], rest, value)
    return _rebuild_sequence(obj, items)


_WEIRD_COMMON = [
    None, True, False, 0, -1, 1, 3, 7, 2**31, 2**63 - 1, 2**63, -(2**63), 2**64 + 5, 10**30, -(10**30),
    1.5, -0.0, math.nan, math.inf, "", "x", "model.w", "../escape", "a/b", "__0_0.distcp", "\0",
    b"\x00\xff", [], [0], [-1], [2**62], [1, 2, 3], {}, (), (1, -1), "__dup__", _DELETE,
]
_WEIRD_TORCH = [
    torch.Size([]), torch.Size([0]), torch.Size([2**40]), torch.Size([-3, 2]), torch.Size([1, 1, 1, 1]),
    torch.float32, torch.int8, torch.bool, torch.complex64, torch.bfloat16, torch.uint64,
]


def weird_values(extra: list[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(_WEIRD_COMMON + extra), st.integers(-(2**70), 2**70))


def structural_mutations(values: st.SearchStrategy[Any]) -> st.SearchStrategy[list[tuple[int, Any]]]:
    """(which slot, by index into the walk; what to put there), up to three times."""
    return st.lists(st.tuples(st.integers(0, 1 << 20), values), min_size=1, max_size=3)


def _describe(path: Path_, value: Any) -> str:
    where = "".join(f".{n}" if kind == "attr" else f"[{n!r}]" if kind == "item" else f"<key {n!r}>"
                    if kind == "key" else f"[{n}]" for kind, n in path)
    what = "deleted" if value is _DELETE else "duplicated" if value == "__dup__" else f"= {value!r}"
    return f"root{where} {what}"


def apply_structural(root: Any, ops: list[tuple[int, Any]]) -> Any:
    """Apply each (slot, value) edit in turn; the edits made are noted for a failure report."""
    for which, value in ops:
        slots = list(_walk(root))
        if not slots:
            break
        path = slots[which % len(slots)]
        try:
            root = replace(root, path, copy.copy(value) if value is not _DELETE else value)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, StopIteration,
                dataclasses.FrozenInstanceError):
            continue  # an edit the structure cannot even hold (unhashable key, ...): skip it
        EDITS.append(_describe(path, value))
        note(EDITS[-1])
    return root


# --- DCP ---------------------------------------------------------------------------------------


def _write_base_dcp(path: Path) -> Path:
    """Row and column chunks on two ranks, a bfloat16, a scalar, an empty tensor and a blob (torch saves)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.w": torch.randn(6, 4, generator=g),
        "model.b": torch.randn(5, generator=g).to(torch.bfloat16),
        "model.n": torch.tensor(7),
        "model.e": torch.zeros(0, 3),
        "model.g": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "train.step": 7,
    }
    boxes = {"model.w": [Box((0, 0), (3, 4)), Box((3, 0), (3, 4))],
             "model.g": [Box((0, 0), (3, 2)), Box((0, 2), (3, 2))]}
    return write_dcp(path, tensors, world_size=2, boxes=boxes, rank_of={"train.step": 1})


@pytest.fixture(scope="module")
def dcp_base(tmp_path_factory) -> Path:
    path = _write_base_dcp(tmp_path_factory.mktemp("fuzz") / "dcp")
    _read_all(path)  # the unmutated checkpoint reads cleanly
    with open_checkpoint(path) as reader:
        assert len(reader.specs()) == 5
    return path


@contextlib.contextmanager
def _copy_of(base: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / base.name
        if base.is_dir():
            shutil.copytree(base, dst)
        else:
            shutil.copy(base, dst)
        yield dst


@FUZZ
@given(ops=BYTE_MUTATIONS)
def test_dcp_metadata_bytes(dcp_base, ops):
    with _copy_of(dcp_base) as ck:
        meta = ck / ".metadata"
        meta.write_bytes(mutate_bytes(meta.read_bytes(), ops))
        _read_all(ck)


@FUZZ
@given(ops=structural_mutations(weird_values(_WEIRD_TORCH)), protocol=st.sampled_from([2, 4, 5]))
def test_dcp_metadata_fields(dcp_base, ops, protocol):
    with _copy_of(dcp_base) as ck:
        meta = ck / ".metadata"
        root = apply_structural(pickle.loads(meta.read_bytes()), ops)
        try:
            data = pickle.dumps(root, protocol=protocol)
        except (pickle.PicklingError, TypeError, ValueError, AttributeError, RuntimeError, RecursionError):
            return  # the test itself cannot write this structure (torch refuses to pickle it)
        meta.write_bytes(data)
        _read_all(ck)


@pytest.mark.parametrize("size", [[0, 1 << 63], [-1, 4], [1 << 64, 0]])
def test_dcp_sizes_beyond_64_bits_or_negative_are_refused(dcp_base, size):
    # a key of no elements (one size 0) has no chunk to check against its records
    with _copy_of(dcp_base) as ck:
        meta = ck / ".metadata"
        root = pickle.loads(meta.read_bytes())
        root.state_dict_metadata["model.e"].size = size
        meta.write_bytes(pickle.dumps(root))
        with pytest.raises(CheckpointFormatError, match=r"64 bits|negative size"):
            open_checkpoint(ck)


@FUZZ
@given(ops=BYTE_MUTATIONS, rank=st.sampled_from([0, 1]))
def test_dcp_data_file_bytes(dcp_base, ops, rank):
    with _copy_of(dcp_base) as ck:
        file = ck / f"__{rank}_0.distcp"
        file.write_bytes(mutate_bytes(file.read_bytes(), ops))
        _read_all(ck)


# --- ema-ckpt manifest (verify) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ema_base(dcp_base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "ema"
    shutil.copytree(dcp_base, out)
    files = {}
    for file in sorted(out.glob("*.distcp")):
        files[file.name] = {"size": file.stat().st_size, "crc32": zlib.crc32(file.read_bytes())}
    Manifest(kind="ema", profile={"kind": "exponential", "decay": 0.9}, dtype="float32", step=7,
             source_format="dcp", files=files).write(out)
    assert verify(out).ok
    return out


@FUZZ
@given(mode=st.sampled_from(["bytes", "fields", "deep"]), ops=BYTE_MUTATIONS,
       json_ops=structural_mutations(weird_values([])))
def test_verify_with_a_damaged_manifest(ema_base, mode, ops, json_ops):
    with _copy_of(ema_base) as out:
        manifest = out / MANIFEST_NAME
        if mode == "deep":
            manifest.write_text("[" * 100_000 + "]" * 100_000)
        elif mode == "fields":
            doc = apply_structural(json.loads(manifest.read_text()), json_ops)
            try:
                manifest.write_text(json.dumps(doc, default=repr))
            except (TypeError, ValueError):
                return  # a structure JSON cannot hold (a tuple key, ...)
        else:
            manifest.write_bytes(mutate_bytes(manifest.read_bytes(), ops))
        try:
            with _time_limit(HANG_SECONDS):
                result = verify(out)
        except EmaCkptError:
            return
        assert isinstance(result.problems, list)


# --- DeepSpeed ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_bases(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("fuzz-ds")
    bases = {}
    g = torch.Generator().manual_seed(1)
    for stage in (2, 3):
        tag = root / f"stage{stage}" / "global_step7"
        _write_zero(
            tag, stage=stage, world_size=2,
            groups=[{"a.w": torch.randn(3, 4, generator=g), "a.b": torch.randn(5, generator=g)},
                    {"c.w": torch.randn(2, 2, generator=g)}],
            frozen={"f.w": torch.randn(3, 2, generator=g).to(torch.bfloat16)} if stage == 2 else {},
            buffers={"buf.i": torch.arange(4), "buf.f": torch.ones(2, dtype=torch.bfloat16)},
            shared={"tied.w": "c.w"}, sub_group_numel=8,
        )  # fmt: skip
        (tag.parent / "latest").write_text("global_step7")
        _read_all(tag)
        bases[stage] = tag
    return bases


def _ds_files(tag: Path) -> list[Path]:
    return sorted(tag.glob("*.pt"))


@FUZZ
@given(stage=st.sampled_from([2, 3]), which=st.integers(0, 10), ops=BYTE_MUTATIONS)
def test_deepspeed_file_bytes(ds_bases, stage, which, ops):
    with _copy_of(ds_bases[stage]) as tag:
        files = _ds_files(tag)
        victim = files[which % len(files)]
        victim.write_bytes(mutate_bytes(victim.read_bytes(), ops))
        _read_all(tag)


_WEIRD_DS = [
    *_WEIRD_TORCH, torch.zeros(0), torch.ones(3, dtype=torch.int64), torch.randn(40), torch.randn(2, 3),
    torch.ones(5, dtype=torch.bfloat16), torch.tensor(3), OrderedDict(x=torch.Size([2, 2])), [torch.zeros(4)],
]


@FUZZ
@given(stage=st.sampled_from([2, 3]), which=st.integers(0, 10),
       ops=structural_mutations(weird_values(_WEIRD_DS)))
def test_deepspeed_fields(ds_bases, stage, which, ops):
    with _copy_of(ds_bases[stage]) as tag:
        files = _ds_files(tag)
        victim = files[which % len(files)]
        state = torch.load(victim, weights_only=False, map_location="cpu")
        state = apply_structural(state, ops)
        try:
            torch.save(state, victim)
        except (pickle.PicklingError, TypeError, ValueError, AttributeError, RuntimeError):
            return
        _read_all(tag)


# --- safetensors -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def st_base(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(2)
    path = tmp_path_factory.mktemp("fuzz-st") / "model.safetensors"
    save_file({
        "w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "n": torch.tensor(5), "e": torch.zeros(0, 2), "i": torch.arange(6, dtype=torch.int16).reshape(2, 3),
    }, str(path), metadata={"format": "pt"})  # fmt: skip
    _read_all(path)
    return path


def _split_safetensors(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


@FUZZ
@given(ops=BYTE_MUTATIONS, header_only=st.booleans())
def test_safetensors_bytes(st_base, ops, header_only):
    with _copy_of(st_base) as file:
        data = file.read_bytes()
        if header_only:  # aim at the header: the first 8 + length bytes
            (length,) = struct.unpack("<Q", data[:8])
            head, rest = data[: 8 + length], data[8 + length :]
            data = mutate_bytes(head, ops) + rest
        else:
            data = mutate_bytes(data, ops)
        file.write_bytes(data)
        _read_all(file)


@pytest.fixture(scope="module", params=["zip", "legacy"])
def single_file_base(request, tmp_path_factory) -> Path:
    """A single-file checkpoint as research code writes it: weights beside training state and a Namespace."""
    import argparse

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    state = {"model": model.state_dict(), "epoch": 2, "args": argparse.Namespace(lr=0.1, tags=["a"]),
             "optimizer": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1}]}}
    path = tmp_path_factory.mktemp("fuzz") / "checkpoint-2.pth"
    torch.save(state, path, _use_new_zipfile_serialization=request.param == "zip")
    _read_all(path)
    return path


@FUZZ
@given(ops=BYTE_MUTATIONS, head=st.booleans())
def test_single_file_bytes(single_file_base, ops, head):
    with _copy_of(single_file_base) as file:
        data = file.read_bytes()
        cut = min(len(data), 600)  # the pickle lies near the start in both serializations
        file.write_bytes(mutate_bytes(data[:cut], ops) + data[cut:] if head else mutate_bytes(data, ops))
        _read_all(file)


_WEIRD_ST = ["F32", "BF16", "I64", "BOOL", "U8", "F8_E4M3", "F4", "XX", "f32", [0, 0], [0, 2**64], [8, 4],
             [-8, 4], [2**63, 2**63 + 4], {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}]


@FUZZ
@given(ops=structural_mutations(weird_values(_WEIRD_ST)), pad=st.integers(-8, 8), fix_length=st.booleans())
def test_safetensors_header_fields(st_base, ops, pad, fix_length):
    with _copy_of(st_base) as file:
        header, body = _split_safetensors(file.read_bytes())
        header = apply_structural(header, ops)
        try:
            raw = json.dumps(header, default=repr).encode()
        except (TypeError, ValueError, RecursionError):
            return
        length = len(raw) if fix_length else max(0, len(raw) + pad)
        body = body[: max(0, len(body) + pad)] if pad < 0 else body + b"\0" * pad
        file.write_bytes(struct.pack("<Q", length) + raw + body)
        _read_all(file)


def test_mutators_do_what_they_say():
    assert mutate_bytes(b"abcd", [("flip", 0, 1)]) == b"`bcd"
    assert mutate_bytes(b"abcd", [("truncate", 2, 0)]) == b"ab"
    assert mutate_bytes(b"abcd", [("insert", 1, b"XY")]) == b"aXYbcd"
    assert mutate_bytes(b"abcd", [("delete", 1, 2)]) == b"ad"
    doc = {"a": [1, 2], "b": {"c": 3}}
    slots = list(_walk(doc))
    assert (("item", "b"), ("item", "c")) in slots and (("item", "a"), ("idx", 1)) in slots
    assert replace(copy.deepcopy(doc), (("item", "b"), ("item", "c")), -1) == {"a": [1, 2], "b": {"c": -1}}
    assert replace(copy.deepcopy(doc), (("item", "a"), ("idx", 0)), _DELETE) == {"a": [2], "b": {"c": 3}}
    assert replace(copy.deepcopy(doc), (("key", "a"),), "z") == {"z": [1, 2], "b": {"c": 3}}
    size = replace((torch.Size([2, 3]),), (("idx", 0), ("idx", 1)), "x")
    assert size == ((2, "x"),)


# --- crashes the fuzzer found: minimal inputs, now regression tests ---------------------------
# Each asserts the behaviour we want (a clean EmaCkptError, bounded memory). A new crash gets a
# strict xfail here and a KNOWN_CRASHES entry until it is fixed.


def _edit_dcp_metadata(tmp_path: Path, edit: Callable[[Any], None]) -> Path:
    ck = tmp_path / "ck"
    write_dcp(ck, {"model.w": torch.ones(2)})
    meta = pickle.loads((ck / ".metadata").read_bytes())
    edit(meta)
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    return ck


def _read_strict(path: Path) -> None:
    with open_checkpoint(path) as reader:
        reader.info()
        for key, spec in reader.specs().items():
            reader.read(key, Box.full(spec.shape))


@pytest.mark.parametrize("value", [True, 69, "x"])
def test_dcp_planner_data_that_is_not_a_mapping(tmp_path, value):
    ck = _edit_dcp_metadata(tmp_path, lambda meta: setattr(meta, "planner_data", value))
    _read_strict(ck)  # planner_data is only a hint: a malformed one is ignored


def test_dcp_planner_data_value_that_is_not_a_path(tmp_path):
    ck = _edit_dcp_metadata(tmp_path, lambda meta: meta.planner_data.__setitem__("model.w", 26))
    _read_strict(ck)


@pytest.mark.parametrize("loader", [
    "formats.dcp.metadata_unpickle import load_dcp_metadata_bytes", "torch_records import load_tensor_record",
    "torch_records.tree import load_tree"])
@pytest.mark.parametrize("bomb", [
    # PROTO 4, NONE, LONG_BINPUT 30_000_000, STOP: 10 bytes that make CPython's C unpickler grow
    # its memo to 60M slots (480 MB); LONG_BINPUT 0xFFFFFFFF asks for 64 GB.
    'b"\\x80\\x04Nr" + struct.pack("<I", 30_000_000) + b"."',
    'b"Np4000000000\\n."',  # the same through protocol 0's text PUT
    # PROTO 5, BYTEARRAY8 of a declared 1 GB with no data: the stock handler allocates it first
    'b"\\x80\\x05\\x96" + struct.pack("<Q", 10**9) + b"."',
])
def test_a_pickle_memo_index_allocates_no_memory(loader, bomb):
    code = f"""
import resource, struct
from ema_ckpt.{loader} as load
from ema_ckpt.errors import CheckpointFormatError, EmaCkptError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load({bomb}, "x")
except EmaCkptError:
    pass
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert proc.returncode == 0, proc.stderr
    grown_mib = int(proc.stdout.split()[-1])
    assert grown_mib < 100, f"peak RSS grew by {grown_mib} MiB for a 10-byte pickle"


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 4]])
def test_safetensors_huge_dim_beside_a_zero_dim(tmp_path, shape):
    raw = json.dumps({"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(EmaCkptError):
        _read_strict(file)


def _torch_file_with_pickle(path: Path, pkl: bytes) -> Path:
    torch.save({"t": torch.arange(3)}, path)
    with zipfile.ZipFile(path) as zin:
        records = [(info, zin.read(info.filename)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zout:
        for info, data in records:
            zout.writestr(info, pkl if info.filename.endswith("data.pkl") else data)
    return path


@pytest.mark.parametrize(
    "pkl", [b"\x80\x02K\x01Q.", b"\x80\x02}(}K\x01u."], ids=["persistent-id-not-a-tuple", "dict-as-dict-key"]
)
def test_deepspeed_pickle_errors_are_converted(tmp_path, pkl):
    from ema_ckpt.formats.deepspeed.unpickle import load_ds_file

    path = _torch_file_with_pickle(tmp_path / "x.pt", pkl)
    with pytest.raises(EmaCkptError):
        load_ds_file(path)


def test_deepspeed_unreadable_member_name_after_a_pickle_error(tmp_path):
    from ema_ckpt.formats.deepspeed.unpickle import load_ds_file

    path = tmp_path / "x.pt"
    torch.save({"t": torch.arange(3)}, path)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, 26)  # data.pkl's local header comes first
    struct.pack_into("<H", data, 6, struct.unpack_from("<H", data, 6)[0] | 0x800)  # UTF-8 names
    struct.pack_into("<H", data, 26, name_len + extra_len + 2)  # the name runs into the pickle bytes
    path.write_bytes(bytes(data))
    with pytest.raises(EmaCkptError):
        load_ds_file(path)


def _set(*keys: Any, value: Any) -> Callable[[Any], None]:
    def edit(state: Any) -> None:
        for key in keys[:-1]:
            state = state[key]
        state[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("target", "edit"),
    [
        ("optim", _set("optimizer_state_dict", "zero_stage", value=None)),
        ("optim", _set("optimizer_state_dict", "zero_stage", value="")),
        ("optim", _set("optimizer_state_dict", "zero_stage", value=torch.tensor([]))),
        ("optim", _set("optimizer_state_dict", "param_alignment_paddings", value=5)),
        ("model", _set("buffer_names", value=6)),
        ("model", _set("buffer_names", value=torch.tensor(3))),
        ("model", _set("module", value=torch.tensor([]))),
        ("model", _set("frozen_param_fragments", value=15)),
        ("model", _set("shared_params", value={"x": []})),
        ("model", _set("param_shapes", 0, "w", value=[math.inf, 4])),
    ],
    ids=["zero_stage-None", "zero_stage-str", "zero_stage-empty-tensor", "alignment-int", "buffer_names-int",
         "buffer_names-0d-tensor", "module-empty-tensor", "frozen_fragments-int", "shared-unhashable",
         "param_shape-inf"],
)
def test_deepspeed_malformed_fields(tmp_path, target, edit):
    tag = tmp_path / "global_step7"
    _write_zero(tag, stage=2, world_size=2, groups=[{"w": torch.randn(3, 4)}], frozen={"f": torch.ones(2)},
                buffers={"b": torch.arange(3)})
    for file in tag.glob(f"*{target}_states.pt"):
        state = torch.load(file, weights_only=False)
        edit(state)
        torch.save(state, file)
    with pytest.raises(EmaCkptError):
        _read_strict(tag)
