"""The torch-free ``.metadata`` pickler against torch's own DCP metadata classes.

``dump_metadata`` names torch's classes (private ``_StorageInfo`` and
``_MEM_FORMAT_ENCODING`` included) without importing them: for any checkpoint, plain
``pickle.loads`` must build objects equal to the ones torch's classes would hold, and
torch's ``dcp.load`` must read a checkpoint whose metadata was written this way. The
definitions it mirrors and its fallback are checked in ``tests/test_compat.py``.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ema_ckpt.dtypes import torch_dtype
from ema_ckpt.formats.dcp import writer as dcp_writer
from ema_ckpt.formats.dcp.metadata_pickle import dump_metadata, write_metadata
from ema_ckpt.formats.dcp.metadata_unpickle import load_dcp_metadata_bytes
from ema_ckpt.formats.dcp.writer import DcpWriter
from ema_ckpt.layout import Box


def test_the_writer_uses_the_checked_pickler():
    assert dcp_writer.write_metadata is write_metadata


def _torch_metadata(tensors, blobs, planner) -> Metadata:
    """What torch's classes hold for the same checkpoint (the oracle)."""
    state, storage = {}, {}
    for key, (dtype, shape, chunks) in tensors.items():
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=torch_dtype(dtype)), torch.Size(shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in chunks])
        for index, (offsets, _sizes, record) in enumerate(chunks):
            if record is not None:
                storage[MetadataIndex(key, torch.Size(offsets), index)] = _StorageInfo(*record)
    for key, record in blobs.items():
        state[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(*record)
    planner_data = {key: tuple(planner.get(key, (key,))) for key in state}
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage,
                    version="1.0.0")


def _assert_same(ours: Metadata, theirs: Metadata) -> None:
    assert type(ours) is Metadata
    assert ours == theirs
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    # MetadataIndex compares without its index hint; the hint must still be right
    assert [(i.fqn, i.offset, i.index) for i in ours.storage_data] == [
        (i.fqn, i.offset, i.index) for i in theirs.storage_data]
    for value in ours.state_dict_metadata.values():
        if isinstance(value, TensorStorageMetadata):
            assert value.properties.memory_format == torch.contiguous_format
            assert isinstance(value.size, torch.Size)
            assert all(isinstance(c.offsets, torch.Size) for c in value.chunks)
    for index, info in ours.storage_data.items():
        assert info.transform_descriptors is None
        assert index.offset is None or isinstance(index.offset, torch.Size)


def test_a_small_checkpoint_unpickles_to_torchs_objects():
    tensors = {
        "model.w": ("float32", (4, 2), [((0, 0), (2, 2), ("__0_0.distcp", 0, 100)),
                                        ((2, 0), (2, 2), ("__1_0.distcp", 0, 100))]),
        "model.scalar": ("bfloat16", (), [((), (), ("__0_0.distcp", 100, 50))]),
        "model.empty": ("int64", (0, 3), [((0, 0), (0, 3), None)]),
        "lone \ud800 surrogate": ("float32", (1,), [((0,), (1,), ("__0_0.distcp", 150, 40))]),
    }
    blobs = {"step": ("__0_0.distcp", 150, 12)}
    planner = {"model.w": ("model", "w"), "step": ("step",)}
    data = dump_metadata(tensors, blobs, planner)
    _assert_same(pickle.loads(data), _torch_metadata(tensors, blobs, planner))


def test_batches_past_a_thousand_items_and_large_numbers():
    """SETITEMS/APPENDS come in batches; offsets past 4 GiB and memo indexes past 255."""
    tensors = {f"layers.{i}.w": ("float16", (8, 1 << 40), [((0, 0), (8, 1 << 40), (f"__0_{i % 7}.distcp",
                                                                                 (1 << 33) + i, 70000 + i))])
               for i in range(2500)}
    tensors["many"] = ("float64", (1001,), [((i,), (1,), ("__0_0.distcp", i * 8, 8)) for i in range(1001)])
    data = dump_metadata(tensors, {}, {})
    _assert_same(pickle.loads(data), _torch_metadata(tensors, {}, {}))


_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=300)


@st.composite
def _checkpoints(draw):
    tensors, blobs = {}, {}
    for key in draw(st.lists(_names, min_size=1, max_size=6, unique=True)):
        if draw(st.booleans()):
            blobs[key] = ("__0_0.distcp", draw(st.integers(0, 1 << 45)), draw(st.integers(0, 1 << 35)))
            continue
        shape = tuple(draw(st.lists(st.integers(0, 1 << 34), max_size=4)))
        chunks = []
        for _ in range(draw(st.integers(1, 3))):
            offsets = tuple(draw(st.integers(0, 1 << 34)) for _ in shape)
            record = draw(st.none() | st.tuples(st.sampled_from(["__0_0.distcp", "__12_3.distcp"]),
                                                st.integers(0, 1 << 45), st.integers(0, 1 << 40)))
            chunks.append((offsets, shape, record))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "complex64"]))
        tensors[key] = (dtype, shape, chunks)
    planner = {key: tuple(draw(st.lists(_names, min_size=1, max_size=3)))
               for key in tensors if draw(st.booleans())}
    return tensors, blobs, planner


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_checkpoints())
def test_any_checkpoint_unpickles_to_torchs_objects_and_reads_back_safely(checkpoint):
    tensors, blobs, planner = checkpoint
    data = dump_metadata(tensors, blobs, planner)
    _assert_same(pickle.loads(data), _torch_metadata(tensors, blobs, planner))
    inert = load_dcp_metadata_bytes(data, "x")  # and the restricted reader takes it too
    assert list(inert.state_dict_metadata) == list(tensors) + list(blobs)


def test_torch_loads_a_checkpoint_written_by_the_writer(tmp_path):
    w = DcpWriter(tmp_path / "ck")
    w.declare("model.w", (4, 3), torch.float32)
    a, b = torch.arange(6.0).reshape(2, 3), -torch.arange(6.0).reshape(2, 3)
    w.write("model.w", Box((0, 0), (2, 3)), a, rank=0)
    w.write("model.w", Box((2, 0), (2, 3)), b, rank=1)
    w.declare("model.h", (5,), torch.bfloat16)
    w.write("model.h", Box((0,), (5,)), torch.ones(5, dtype=torch.bfloat16), rank=1)
    w.write_bytes("step", _torch_bytes(tmp_path, 7))
    w.finish({"model.w": ("model", "w"), "model.h": ("model", "h")})
    state = {"model": {"w": torch.zeros(4, 3), "h": torch.zeros(5, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
    assert torch.equal(state["model"]["w"], torch.cat([a, b]))
    assert torch.equal(state["model"]["h"], torch.ones(5, dtype=torch.bfloat16))
    assert state["step"] == 7


def _torch_bytes(tmp_path, value) -> bytes:
    """A non-tensor entry's record as torch's writer stores it (torch.save of the object)."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_writing_a_dcp_checkpoint_does_not_import_torchs_dcp_package(tmp_path):
    code = (
        "import sys, torch\n"
        "from ema_ckpt.formats.dcp.writer import DcpWriter\n"
        "from ema_ckpt.layout import Box\n"
        f"w = DcpWriter(__import__('pathlib').Path({str(tmp_path / 'ck')!r}))\n"
        "w.declare('w', (2,), torch.float32)\n"
        "w.write('w', Box((0,), (2,)), torch.ones(2))\n"
        "w.finish()\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported torch.distributed.checkpoint'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("apart", [False, True], ids=["in-process", "child-process"])
def test_written_metadata_is_checked_before_it_is_published(tmp_path, monkeypatch, apart):
    """Large ``.metadata`` files are checked in a child process (the check's objects never add
    to the run's peak memory); both ways refuse what does not load, and a wrong key count."""
    from ema_ckpt.formats.dcp import metadata_unpickle

    if apart:
        monkeypatch.setattr(metadata_unpickle, "_CHECK_APART_BYTES", 0)
    tensors = {"w": ("float32", (4,), [((0,), (4,), ("__0_0.distcp", 0, 1024))])}
    good = tmp_path / "good.metadata"
    good.write_bytes(dump_metadata(tensors, {}, {}))
    metadata_unpickle.check_written_file(good, 1)
    with pytest.raises(ValueError, match="holds 1 keys, not 2"):
        metadata_unpickle.check_written_file(good, 2)
    cut = tmp_path / "cut.metadata"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(ValueError, match="does not load"):
        metadata_unpickle.check_written_file(cut, 1)
