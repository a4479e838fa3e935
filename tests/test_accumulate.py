"""accumulate over real FSDP1/FSDP2 sequences against a float64 reference, and its cron semantics."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ema_ckpt._lazy import torch as lazy_torch
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.errors import IncompatibleCheckpointError, ManifestMismatchError, UsageError
from ema_ckpt.formats.dcp import DcpReader
from ema_ckpt.layout import Box
from ema_ckpt.manifest import Manifest
from ema_ckpt.maths import ExponentialProfile
from tests.conftest import STEPS
from tests.dcp_helpers import write_dcp
from tests.ema_reference import assert_close_relative, full_load, reference_ema


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with DcpReader(path) as reader:
        return {k: reader.read(k, Box.full(s.shape)) for k, s in reader.specs().items()}


def _snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.iterdir())}


def _copy_sequence(ckpts: list[Path], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for c in ckpts:
        shutil.copytree(c, dest / c.name)
        out.append(dest / c.name)
    return out


@pytest.mark.parametrize(
    ("kind", "world", "dtype", "with_optim"),
    [
        ("fsdp1", 2, "float32", False),
        ("fsdp1", 3, "float32", True),
        ("fsdp2", 2, "bfloat16", False),
        ("fsdp2", 3, "float32", True),
    ],
)
def test_matches_the_float64_reference(fsdp_sequence, tmp_path, kind, world, dtype, with_optim):
    ckpts = fsdp_sequence(kind, world, dtype, with_optim)
    folder = ckpts[0].parent
    out = tmp_path / "ema"
    result = accumulate(folder, decay=0.9, out=out)
    assert result.step == STEPS[-1] and [c.step for c in result.folded] == STEPS
    states = [full_load(c, tmp_path) for c in ckpts]
    model_keys = {k for k in states[-1] if k.startswith("model.")}
    want = reference_ema([{k: s[k] for k in model_keys} for s in states], STEPS,
                         ExponentialProfile(0.9).keep_factor)
    got = _read_all(out)
    assert set(got) == model_keys  # the optimizer part is never averaged
    for key in model_keys:
        assert_close_relative(got[key], want[key])
        if want[key].is_floating_point():
            assert got[key].dtype == torch.float32  # the EMA state never lives in bf16
        else:
            assert got[key].dtype == want[key].dtype
    # torch's own tools read the output
    torch_view = full_load(out, tmp_path)
    for key in model_keys:
        assert torch.equal(torch_view[key], got[key])
    # laid out like the newest input: same chunks, same rank files
    with DcpReader(ckpts[-1]) as newest, DcpReader(out) as ema:
        for key in model_keys:
            assert [(c.box, c.rank) for c in ema.chunks(key)] == [(c.box, c.rank) for c in newest.chunks(key)]
    assert sum(abs(t.coefficient) for t in result.terms) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "options",
    [dict(half_life=4.0), dict(decay=0.8, per_checkpoint=True), dict(decay=0.95, warmup=True)],
    ids=["half-life", "per-checkpoint", "warmup"],
)
def test_profiles_match_the_reference(fsdp_sequence, tmp_path, options):
    ckpts = fsdp_sequence("fsdp2", 2)
    accumulate(ckpts[0].parent, out=tmp_path / "ema", **options)
    if "half_life" in options:
        profile = ExponentialProfile.from_half_life(options["half_life"])
    else:
        profile = ExponentialProfile(options["decay"], options.get("per_checkpoint", False),
                                     options.get("warmup", False))
    states = [full_load(c, tmp_path) for c in ckpts]
    want = reference_ema(states, STEPS, profile.keep_factor)
    got = _read_all(tmp_path / "ema")
    for key, value in got.items():
        assert_close_relative(value, want[key])


def test_float64_accumulation(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp2", 2)
    accumulate(ckpts[0].parent, decay=0.9, out=tmp_path / "ema", dtype="float64")
    states = [full_load(c, tmp_path) for c in ckpts]
    want = reference_ema(states, STEPS, ExponentialProfile(0.9).keep_factor)
    for key, value in _read_all(tmp_path / "ema").items():
        if value.is_floating_point():
            assert value.dtype == torch.float64
        assert_close_relative(value, want[key], rel=1e-12)


def test_incremental_equals_one_shot_and_survives_retention(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp1", 2)
    live = tmp_path / "ckpts"
    copies = _copy_sequence(ckpts[:2], live)
    first = accumulate(live, decay=0.9, out=tmp_path / "incremental")
    assert [c.step for c in first.folded] == STEPS[:2]
    copies += _copy_sequence(ckpts[2:4], live)
    second = accumulate(live, decay=0.9, out=tmp_path / "incremental")
    assert [c.step for c in second.folded] == STEPS[2:4]
    # retention deletes old checkpoints; the EMA goes on
    for old in copies[:3]:
        shutil.rmtree(old)
    _copy_sequence(ckpts[4:], live)
    third = accumulate(live, decay=0.9, out=tmp_path / "incremental")
    assert [c.step for c in third.folded] == [STEPS[4]]

    full = tmp_path / "all"
    _copy_sequence(ckpts, full)
    accumulate(full, decay=0.9, out=tmp_path / "one-shot")
    a, b = _snapshot(tmp_path / "incremental"), _snapshot(tmp_path / "one-shot")
    assert set(a) == set(b)
    for name in a:
        if name != "ema-ckpt.json":
            assert a[name][0] == b[name][0], f"{name} differs"
    manifest = Manifest.read(tmp_path / "incremental")
    assert [c.step for c in manifest.checkpoints] == STEPS and manifest.step == STEPS[-1]


def test_no_op_rerun_changes_no_byte(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp2", 2)
    out = tmp_path / "ema"
    accumulate(ckpts[0].parent, decay=0.99, out=out)
    before = _snapshot(out)
    again = accumulate(ckpts[0].parent, decay=0.99, out=out)
    assert again.up_to_date and again.folded == []
    assert _snapshot(out) == before


def test_other_settings_are_refused_unless_restart(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp2", 2)
    out = tmp_path / "ema"
    accumulate(ckpts[0].parent, decay=0.99, out=out)
    before = _snapshot(out)
    with pytest.raises(ManifestMismatchError, match="pass restart=True") as info:
        accumulate(ckpts[0].parent, decay=0.9, out=out)
    assert info.value.remedy == "restart"
    with pytest.raises(ManifestMismatchError, match="float32") as info:
        accumulate(ckpts[0].parent, decay=0.99, out=out, dtype="float64")
    assert info.value.remedy == "restart" and "keep dtype=float32" in str(info.value)
    assert _snapshot(out) == before
    result = accumulate(ckpts[0].parent, decay=0.9, out=out, restart=True)
    assert [c.step for c in result.folded] == STEPS
    assert Manifest.read(out).profile["decay"] == 0.9


def test_default_out_lies_inside_the_folder_and_is_never_an_input(fsdp_sequence, tmp_path):
    live = tmp_path / "ckpts"
    _copy_sequence(fsdp_sequence("fsdp2", 2)[:3], live)
    first = accumulate(live, decay=0.9)
    assert first.out == live / "ema"
    assert accumulate(live, decay=0.9).up_to_date


def test_include_exclude(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp2", 2)
    accumulate(ckpts[0].parent, decay=0.9, out=tmp_path / "ema", exclude=["*.bias"])
    keys = set(_read_all(tmp_path / "ema"))
    assert keys and not any(k.endswith(".bias") for k in keys)
    with pytest.raises(UsageError, match="no tensor keys left"):
        accumulate(ckpts[0].parent, decay=0.9, out=tmp_path / "none", include=["nothing.*"])


def test_changed_shape_is_refused_naming_file_and_key(tmp_path):
    write_dcp(tmp_path / "c" / "step_1", {"model.w": torch.zeros(4, 2)})
    write_dcp(tmp_path / "c" / "step_2", {"model.w": torch.zeros(5, 2)})
    with pytest.raises(IncompatibleCheckpointError, match=r"step_1: key 'model.w' has shape \[4, 2\]"):
        accumulate(tmp_path / "c", decay=0.9, out=tmp_path / "ema")
    assert not (tmp_path / "ema").exists()


def test_constant_sequence_is_a_fixed_point(tmp_path):
    value = torch.randn(9, 4)
    for step in (1, 5, 6, 50):
        write_dcp(tmp_path / "c" / f"step_{step}", {"model.w": value}, world_size=3)
    accumulate(tmp_path / "c", decay=0.7, out=tmp_path / "ema")
    assert torch.equal(_read_all(tmp_path / "ema")["model.w"], value)


def test_interrupted_publish_is_repaired(tmp_path):
    for step in (1, 2):
        write_dcp(tmp_path / "c" / f"step_{step}", {"model.w": torch.full((3,), float(step))})
    out = tmp_path / "c" / "ema"
    accumulate(tmp_path / "c", decay=0.5, out=out)
    before = _snapshot(out)
    # a run killed between the two renames of a non-atomic swap: old output moved aside
    out.rename(tmp_path / "c" / ".ema.old-deadbeef")
    (tmp_path / "c" / ".ema.tmp-1-cafe").mkdir()
    result = accumulate(tmp_path / "c", decay=0.5, out=out)
    assert result.up_to_date
    assert any("restored" in n for n in result.notes)
    assert _snapshot(out) == before
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["ema", "step_1", "step_2"]  # no lock file left


@pytest.mark.parametrize(("make", "loads_wanted"), [
    # a transposed tensor is stored with its strides: torch's weights-only loader reads that record
    (lambda g: torch.randn(1536, 1024, generator=g).t(), 2),
    # float8 records (torch's v3 record) are read raw, like any contiguous one
    (lambda g: (torch.randn(1024, 1536, generator=g) * 4).to(torch.float8_e4m3fn), 0),
])
def test_records_read_through_torch_load_are_loaded_once_per_chunk(tmp_path, monkeypatch, make, loads_wanted):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    values = []
    for step in (1, 2):
        value = make(g)
        dcp.save({"model": {"w": value}}, checkpoint_id=str(tmp_path / "ck" / f"step_{step}"), no_dist=True)
        values.append(value.float())
    loads = []
    real_load = torch.load
    counting = lambda *a, **k: loads.append(1) or real_load(*a, **k)  # noqa: E731
    monkeypatch.setattr(torch, "load", counting)
    # ema_ckpt's lazy torch keeps each attribute it has read: an earlier test may have read load
    monkeypatch.setattr(lazy_torch, "load", counting, raising=False)
    accumulate(tmp_path / "ck", decay=0.5, out=tmp_path / "ema")  # the region spans several 2 MiB blocks
    assert len(loads) == loads_wanted, f"{len(loads)} record loads for 2 chunks"
    monkeypatch.undo()
    with DcpReader(tmp_path / "ema") as reader:
        got = reader.read("model.w", Box.full((1024, 1536)))
    assert torch.equal(got, values[0].lerp(values[1], 0.5))
