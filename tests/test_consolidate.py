"""consolidate and reshard against torch's own tools, safetensors' loader and FSDP2 itself."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate, parse_size
from ema_ckpt.commands.reshard import reshard
from ema_ckpt.errors import UsageError
from ema_ckpt.formats.dcp import DcpReader
from ema_ckpt.formats.safetensors.writer import plan_shards
from ema_ckpt.layout import Box
from tests.dcp_helpers import write_dcp
from tests.ema_reference import full_load
from tests.torchrun import torchrun

PRODUCERS = Path(__file__).parent / "producers"


def _model_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


@pytest.mark.parametrize(("kind", "world", "dtype", "optim"),
                         [("fsdp1", 3, "float32", True), ("fsdp2", 2, "bfloat16", False)])
def test_safetensors_equals_dcp_to_torch_save_bit_for_bit(fsdp_sequence, tmp_path, kind, world, dtype, optim):
    ckpt = fsdp_sequence(kind, world, dtype, optim)[-1]
    want = _model_part(full_load(ckpt, tmp_path))
    result = consolidate(ckpt, tmp_path / "model.safetensors")
    got = load_file(tmp_path / "model.safetensors")
    assert set(got) == set(want) and result.keys == len(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    kept = consolidate(ckpt, tmp_path / "kept.safetensors", keep_prefix=True)
    assert kept.keys == len(want) and all(k.startswith("model.") for k in load_file(tmp_path / "kept.safetensors"))


def test_sharded_layout_and_torch_file_equal_the_single_file(fsdp_sequence, tmp_path):
    ckpt = fsdp_sequence("fsdp1", 3, "float32", True)[-1]
    consolidate(ckpt, tmp_path / "one.safetensors")
    single = load_file(tmp_path / "one.safetensors")
    result = consolidate(ckpt, f"{tmp_path}/hf/", max_shard_size="2KB")  # a directory: ends in /
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(single) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in single.values())
    merged = {}
    for shard in shards:
        merged.update(load_file(tmp_path / "hf" / shard))
    assert set(merged) == set(single) and all(torch.equal(merged[k], single[k]) for k in single)
    assert result.layout == "hf-sharded"
    consolidate(ckpt, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(loaded) == set(single) and all(torch.equal(loaded[k], single[k]) for k in single)
    consolidate(ckpt, tmp_path / "whole", format="hf-sharded", max_shard_size="5GB")
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["model.safetensors"]


def test_strict_load_into_the_model_and_dtype_cast(fsdp_sequence, tmp_path):
    sys.path.insert(0, str(PRODUCERS))
    from fsdp_train import TinyModel

    ckpt = fsdp_sequence("fsdp2", 2)[-1]
    ema = tmp_path / "ema"
    accumulate(ckpt.parent, decay=0.9, out=ema)
    consolidate(ema, tmp_path / "ema.safetensors", dtype="bfloat16")
    state = load_file(tmp_path / "ema.safetensors")
    assert state["num_batches_tracked"].dtype == torch.int64
    assert state["fc1.weight"].dtype == torch.bfloat16
    model = TinyModel().to(torch.bfloat16)
    model.load_state_dict(state, strict=True)
    with DcpReader(ema) as reader:
        exact = reader.read("model.fc1.weight", Box.full(reader.specs()["model.fc1.weight"].shape))
    assert torch.equal(model.fc1.weight.detach(), exact.to(torch.bfloat16))


def test_outputs_are_never_clobbered_or_inside_the_source(tmp_path):
    src = write_dcp(tmp_path / "ck", {"model.w": torch.randn(4, 3)})
    consolidate(src, tmp_path / "a.safetensors")
    before = (tmp_path / "a.safetensors").read_bytes()
    with pytest.raises(UsageError, match="pass overwrite=True") as info:
        consolidate(src, tmp_path / "a.safetensors", dtype="float16")
    assert info.value.remedy == "overwrite"
    assert (tmp_path / "a.safetensors").read_bytes() == before
    consolidate(src, tmp_path / "a.safetensors", dtype="float16", overwrite=True)
    assert load_file(tmp_path / "a.safetensors")["w"].dtype == torch.float16
    with pytest.raises(UsageError, match="overlaps the source"):
        consolidate(src, src / "inside.safetensors")
    assert not list(tmp_path.glob(".a.safetensors.tmp-*"))


@pytest.mark.parametrize(("text", "value"), [("5GB", 5 * 10**9), ("20KB", 20_000), ("500MB", 5 * 10**8),
                                             ("1GiB", 2**30), ("123", 123)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_nonsense():
    with pytest.raises(UsageError, match="not understood"):
        parse_size("5 parsecs")


@given(st.lists(st.integers(0, 100), max_size=40), st.integers(1, 120))
def test_shard_plan_properties(sizes, limit):
    named = [(f"k{i}", n) for i, n in enumerate(sizes)]
    shards = plan_shards(named, limit)
    flat = [k for shard in shards for k in shard]
    assert flat == [k for k, _ in named]  # every key once, in order
    lookup = dict(named)
    for shard in shards:
        assert shard
        total = sum(lookup[k] for k in shard)
        assert total <= limit or len(shard) == 1 or all(lookup[k] == 0 for k in shard[1:])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=4),
       a=st.integers(1, 4), n=st.integers(1, 5), m=st.integers(1, 5), seed=st.integers(0, 1000))
def test_reshard_round_trips_are_identity(tmp_path_factory, shapes, a, n, m, seed):
    root = tmp_path_factory.mktemp("rt")
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.t{i}": torch.randn(tuple(s), generator=g) for i, s in enumerate(shapes)}
    tensors["model.count"] = torch.tensor(seed)
    write_dcp(root / "a", tensors, world_size=a)
    reshard(root / "a", world_size=n, out=root / "n")
    reshard(root / "n", world_size=m, out=root / "m")
    with DcpReader(root / "m") as reader:
        assert set(reader.specs()) == set(tensors)
        for key, value in tensors.items():
            assert torch.equal(reader.read(key, Box.full(tuple(value.shape))), value)
            ranks = {c.rank for c in reader.chunks(key)}
            assert ranks <= set(range(m))


def _run_fsdp_load(ckpt: Path, expected: Path, world: int, prefix: str = "model.") -> str:
    proc = torchrun([str(PRODUCERS / "fsdp_load_check.py"), "--ckpt", str(ckpt), "--expected", str(expected),
                     "--prefix", prefix], nproc=world)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_loads_exactly_into_fsdp2(fsdp_sequence, tmp_path, world):
    ckpt = fsdp_sequence("fsdp1", 3)[-1]
    expected = tmp_path / "expected.pt"
    torch.save(_model_part(full_load(ckpt, tmp_path)), expected)
    out = tmp_path / f"for{world}"
    result = reshard(ckpt, world_size=world, out=out)
    assert sorted(name for name, _ in result.files) == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
    with DcpReader(out) as reader:
        for key in reader.specs():
            for chunk in reader.chunks(key):
                if len(chunk.box.sizes) and chunk.box.sizes[0] and reader.specs()[key].shape[0] >= world:
                    assert chunk.file == f"__{chunk.rank}_0.distcp"
    assert "OK" in _run_fsdp_load(out, expected, world)


# -- the byte-copy path ---------------------------------------------------------------------


def test_byte_copy_runs_without_torch_and_equals_the_tensor_path(fsdp_sequence, tmp_path, monkeypatch):
    from ema_ckpt.formats.safetensors.output import SafetensorsOutput

    ckpt = fsdp_sequence("fsdp1", 3, "float32", True)[-1]
    code = ("import sys; from ema_ckpt.commands.consolidate import consolidate; "
            f"consolidate({str(ckpt)!r}, {str(tmp_path / 'fast.safetensors')!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setattr(SafetensorsOutput, "copies_stored", lambda *args: False)
    consolidate(ckpt, tmp_path / "tensors.safetensors")
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "tensors.safetensors").read_bytes()


def test_byte_copy_falls_back_when_the_kernel_cannot_copy(fsdp_sequence, tmp_path, monkeypatch):
    import errno

    ckpt = fsdp_sequence("fsdp2", 2, "bfloat16", False)[-1]
    consolidate(ckpt, tmp_path / "kernel.safetensors")

    def refuse(*_args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    consolidate(ckpt, tmp_path / "pread", format="hf-sharded", max_shard_size="3KB")
    merged = {}
    for shard in sorted((tmp_path / "pread").glob("*.safetensors")):
        merged.update(load_file(shard))
    single = load_file(tmp_path / "kernel.safetensors")
    assert set(merged) == set(single) and all(torch.equal(merged[k], single[k]) for k in single)


def test_layouts_that_are_not_byte_runs_take_the_tensor_path(tmp_path):
    import torch.distributed.checkpoint as dcp

    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    columns = write_dcp(tmp_path / "cols", {"model.w": w, "model.e": torch.empty(0, 3)},
                        boxes={"model.w": [Box((0, 0), (6, 5)), Box((0, 5), (6, 3))]})
    with DcpReader(columns) as reader:
        assert reader.byte_ranges("model.w") is None and reader.byte_ranges("model.e") == []
    consolidate(columns, tmp_path / "cols.safetensors")
    got = load_file(tmp_path / "cols.safetensors")
    assert torch.equal(got["w"], w) and got["e"].shape == (0, 3)
    dcp.save({"model": {"t": w.t()}}, checkpoint_id=str(tmp_path / "strided"), no_dist=True)
    consolidate(tmp_path / "strided", tmp_path / "strided.safetensors")
    assert torch.equal(load_file(tmp_path / "strided.safetensors")["t"], w.t())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 9), cols=st.integers(1, 4), cuts=st.lists(st.integers(0, 9), max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_byte_ranges_concatenate_to_the_tensor(tmp_path_factory, rows, cols, cuts, dtype):
    value = (torch.arange(rows * cols) * 3 - 7).reshape(rows, cols).to(dtype)
    bounds = sorted({0, rows, *(c for c in cuts if c <= rows)})
    boxes = [Box((a, 0), (b - a, cols)) for a, b in itertools.pairwise(bounds)] or [Box((0, 0), (0, cols))]
    ckpt = write_dcp(tmp_path_factory.mktemp("ck") / "c", {"model.v": value}, boxes={"model.v": boxes})
    with DcpReader(ckpt) as reader:
        ranges = reader.byte_ranges("model.v")
        assert ranges is not None
        data = b"".join(reader.open_data(f).pread(n, o) for f, o, n in ranges)
    assert data == value.contiguous().view(torch.uint8).numpy().tobytes()
