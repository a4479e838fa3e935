"""The DCP reader against torch's own writer and reader."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ema_ckpt.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    UnsafePickleError,
)
from ema_ckpt.formats import detect_format, open_checkpoint
from ema_ckpt.formats.dcp import DcpReader
from ema_ckpt.layout import Box
from tests.dcp_helpers import torch_load_flat, write_dcp, write_dcp_with_dcp_writer

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]


def _random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


@st.composite
def chunked_tensors(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    world = draw(st.integers(1, 4))
    box = None
    if ndim:
        offsets = [draw(st.integers(0, d)) for d in shape]
        sizes = [draw(st.integers(0, d - o)) for d, o in zip(shape, offsets, strict=True)]
        box = Box(tuple(offsets), tuple(sizes))
    return shape, dtype, world, box, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=chunked_tensors())
def test_any_box_read_equals_the_slice_and_torch_reads_what_we_wrote(tmp_path, case):
    shape, dtype, world, box, seed = case
    path = tmp_path / f"ck{seed}"
    shutil.rmtree(path, ignore_errors=True)
    value = _random_tensor(shape, dtype, seed)
    ours = path.with_name(f"{path.name}-ours")
    shutil.rmtree(ours, ignore_errors=True)
    write_dcp(path, {"model.t": value}, world_size=world)  # saved by torch
    write_dcp_with_dcp_writer(ours, {"model.t": value}, world_size=world)
    assert torch.equal(torch_load_flat(ours, {"model.t": value})["model.t"], value)
    for written in (path, ours):
        with DcpReader(written) as reader:
            assert reader.specs()["model.t"].shape == shape
            assert torch.equal(reader.read("model.t", Box.full(shape)), value)
            if box is not None:
                assert torch.equal(reader.read("model.t", box), value[box.slices()])


def test_reads_a_checkpoint_written_by_torch(tmp_path):
    state = {
        "model": {"w": torch.randn(5, 3), "b": torch.randn(3).bfloat16(), "n": torch.tensor(7)},
        "extra": {"note": "hello"},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert detect_format(tmp_path / "ck").name == "dcp"
    with open_checkpoint(tmp_path / "ck") as reader:
        assert set(reader.specs()) == {"model.w", "model.b", "model.n"}
        assert reader.info()["non_tensor_keys"] == ["extra.note"]
        assert torch.equal(reader.read("model.w", Box((1, 1), (3, 2))), state["model"]["w"][1:4, 1:3])
        assert torch.equal(reader.read("model.b", Box((0,), (3,))), state["model"]["b"])
        assert reader.read("model.n", Box((), ())).item() == 7
        assert reader.root_of("model.w") == "model"


def _crafted_metadata(path: Path, marker: Path) -> None:
    class Exploit:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    (path / "__0_0.distcp").write_bytes(b"")


def test_crafted_metadata_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    _crafted_metadata(tmp_path / "ck", marker)
    with pytest.raises(UnsafePickleError, match=r"\.metadata: refers to posix\.system"):
        open_checkpoint(tmp_path / "ck")
    assert not marker.exists()


def test_garbage_metadata_is_one_clean_error(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointFormatError, match="not a readable DCP metadata pickle"):
        open_checkpoint(tmp_path / "ck")


def test_truncated_data_file_names_the_file(tmp_path):
    write_dcp(tmp_path / "ck", {"model.w": torch.randn(64, 8)}, world_size=2)
    data = tmp_path / "ck" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    # refused when opened: a stat per data file against the metadata, before any record is read
    with pytest.raises(CheckpointFormatError, match=r"__1_0.distcp: truncated: 100 bytes, but the metadata"):
        DcpReader(tmp_path / "ck")


def test_flipped_record_bytes_are_caught(tmp_path):
    write_dcp(tmp_path / "ck", {"model.w": torch.randn(4, 4)})
    data = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[:64] = b"\0" * 64  # destroy the record's zip header
    raw[-40:] = b"\0" * 40
    data.write_bytes(bytes(raw))
    with DcpReader(tmp_path / "ck") as reader, pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp"):
        reader.read("model.w", Box.full((4, 4)))


def test_missing_chunk_coverage_is_reported(tmp_path):
    write_dcp(tmp_path / "ck", {"model.w": torch.randn(6, 2)}, world_size=2)
    md = (tmp_path / "ck" / ".metadata").read_bytes()
    meta = pickle.loads(md)
    meta.state_dict_metadata["model.w"].chunks.pop()
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointFormatError, match="do not cover shape"):
        DcpReader(tmp_path / "ck")


def test_rank_local_metadata_files_are_merged(tmp_path):
    value = torch.randn(7, 3)
    write_dcp(tmp_path / "ck", {"model.w": value}, world_size=2)
    meta = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    (tmp_path / "ck" / ".metadata").unlink()
    for rank in range(2):
        part = pickle.loads(pickle.dumps(meta))
        entry = part.state_dict_metadata["model.w"]
        entry.chunks = [entry.chunks[rank]]
        part.storage_data = {k: v for k, v in part.storage_data.items() if v.relative_path.startswith(f"__{rank}_")}
        (tmp_path / "ck" / f"__{rank}.metadata").write_bytes(pickle.dumps(part))
    with open_checkpoint(tmp_path / "ck") as reader:
        assert reader.info()["rank_local_metadata"]
        assert torch.equal(reader.read("model.w", Box.full((7, 3))), value)
    (tmp_path / "ck" / "__1.metadata").unlink()
    with pytest.raises(CheckpointFormatError, match="missing"):
        open_checkpoint(tmp_path / "ck")


def test_save_in_progress_is_not_a_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "__0_0.distcp").write_bytes(b"partial")
    assert detect_format(tmp_path / "ck") is None
    with pytest.raises(CheckpointNotFoundError, match=r"no \.metadata yet"):
        open_checkpoint(tmp_path / "ck")


def test_storage_paths_cannot_escape_the_directory(tmp_path):
    write_dcp(tmp_path / "ck", {"model.w": torch.randn(2, 2)})
    meta = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointFormatError, match="leaves the checkpoint directory"):
        open_checkpoint(tmp_path / "ck")


def test_steps_of_one_layout_share_one_parsed_structure(tmp_path):
    import gc

    from ema_ckpt.selection import check_compatible

    def model(seed, shape=(8, 4), world_size=1):
        g = torch.Generator().manual_seed(seed)
        return {"model.w": torch.randn(shape, generator=g), "model.b": torch.randn(4, generator=g)}, world_size

    paths = {}
    for name, (tensors, world_size) in {"a": model(1), "b": model(2), "ranks": model(3, world_size=2),
                                        "wider": model(4, shape=(8, 5))}.items():
        paths[name] = write_dcp(tmp_path / name, tensors, world_size=world_size)
    a, b, ranks, wider = (DcpReader(paths[n]) for n in ("a", "b", "ranks", "wider"))
    assert a._structure is b._structure and a.specs() is b.specs()  # built once
    assert ranks._structure is not a._structure  # the same keys and shapes, other chunks
    assert wider._structure is not a._structure
    for reader, name in ((a, "a"), (b, "b"), (ranks, "ranks")):
        expected = torch_load_flat(paths[name], {"model.w": torch.empty(8, 4), "model.b": torch.empty(4)})
        assert torch.equal(reader.read("model.w", Box((0, 0), (8, 4))), expected["model.w"])
    check_compatible([a, b, ranks], ["model.w", "model.b"], reference=1)
    with pytest.raises(IncompatibleCheckpointError, match=r"shape \[8, 5\]"):
        check_compatible([a, wider], ["model.w", "model.b"], reference=0)

    shared = pickle.loads(pickle.dumps(ranks.share()))  # as another worker receives it
    assert DcpReader(paths["ranks"], shared=shared)._structure is ranks._structure
    del a, b, ranks, wider
    gc.collect()  # no live structure left to match: rebuilt from the message
    rebuilt = DcpReader(paths["ranks"], shared=shared)
    expected = torch_load_flat(paths["ranks"], {"model.w": torch.empty(8, 4), "model.b": torch.empty(4)})
    assert torch.equal(rebuilt.read("model.w", Box((2, 0), (5, 4))), expected["model.w"][2:7])
    assert [c.box for c in rebuilt.chunks("model.w")] == [Box((0, 0), (4, 4)), Box((4, 0), (4, 4))]


def test_readers_of_the_same_keys_in_another_order_keep_their_own_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {"model.a": torch.randn(3, generator=g), "model.b": torch.randn(2, 2, generator=g)}
    forward = write_dcp(tmp_path / "forward", values)
    backward = write_dcp(tmp_path / "backward", dict(reversed(list(values.items()))))
    first, second = DcpReader(forward), DcpReader(backward)
    assert list(first.stored()) == ["model.a", "model.b"] and list(second.stored()) == ["model.b", "model.a"]
    assert first._structure is not second._structure  # the order decides a run's plan and its bytes
    shared = pickle.loads(pickle.dumps(second.share()))
    assert list(DcpReader(backward, shared=shared).stored()) == ["model.b", "model.a"]
