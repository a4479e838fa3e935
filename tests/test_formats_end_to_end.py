"""accumulate and consolidate on real DeepSpeed ZeRO sequences and Hugging Face safetensors sequences."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.discovery import discover
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
from ema_ckpt.maths import ExponentialProfile
from tests.ds_fixtures import STEPS as DS_STEPS
from tests.ds_fixtures import Config
from tests.ema_reference import assert_close_relative, reference_ema

DECAY = 0.6


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as reader:
        return {k: reader.read(k, Box.full(s.shape)) for k, s in reader.specs().items()}


@pytest.mark.parametrize(
    "config",
    [Config(2, 1, "fp32"), Config(2, 2, "bf16"), Config(2, 3, "fp32"), Config(3, 3, "bf16"), Config(3, 1, "fp32")],
    ids=lambda c: c.name,
)
def test_ema_over_a_zero_sequence_matches_the_reference(ds_run, zero_to_fp32, tmp_path, config):
    folder = ds_run(config)
    found = discover([folder])
    assert [c.step for c in found.checkpoints] == DS_STEPS  # every tag, not only `latest`
    result = accumulate(folder, decay=DECAY, out=tmp_path / "ema")
    assert result.step == DS_STEPS[-1]
    states = [zero_to_fp32(folder, f"global_step{s}") for s in DS_STEPS]
    want = reference_ema(states, DS_STEPS, ExponentialProfile(DECAY).keep_factor)
    got = _read_all(tmp_path / "ema")
    assert set(want) <= set(got)
    for key, value in want.items():
        assert_close_relative(got[key], value)
    if config.stage == 1:  # zero_to_fp32 drops ZeRO-1 frozen weights; ema-ckpt keeps them
        assert set(got) - set(want), "frozen weights missing"


@pytest.mark.parametrize("config", [Config(2, 1, "bf16"), Config(3, 2, "bf16"), Config(3, 3, "bf16")],
                         ids=lambda c: c.name)
def test_consolidating_a_raw_tag_equals_zero_to_fp32(ds_run, zero_to_fp32, tmp_path, config):
    folder = ds_run(config)
    tag = folder / f"global_step{DS_STEPS[-1]}"
    consolidate(tag, tmp_path / "model.safetensors")
    got = load_file(tmp_path / "model.safetensors")
    want = zero_to_fp32(folder, tag.name)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_accumulate_runs_where_deepspeed_cannot_be_imported(ds_run, tmp_path):
    folder = ds_run(Config(2, 3, "bf16"))
    stub = tmp_path / "stub" / "deepspeed"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('deepspeed is not installed here')\n")
    script = textwrap.dedent(f"""
        import sys
        from ema_ckpt.cli import main
        sys.argv = ["ema-ckpt", "accumulate", {str(folder)!r}, "--decay", "0.6", "--out", {str(tmp_path / "ema")!r}]
        main()
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'stub'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    check = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, env=env)
    assert check.returncode != 0
    assert (tmp_path / "ema" / ".metadata").exists()


# --- Hugging Face safetensors sequences (Trainer's checkpoint-N folders) ---------------------

HF_STEPS = [500, 1000, 2500, 2600]


def _hf_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(40, 8, generator=g),
        "layers.0.weight": torch.randn(8, 8, generator=g).bfloat16(),
        "layers.0.bias": torch.randn(8, generator=g),
        "norm.weight": torch.randn(8, generator=g).half(),
        "position_ids": torch.arange(40).unsqueeze(0),
    }


def _save_hf(folder: Path, state: dict[str, torch.Tensor], sharded: bool) -> None:
    folder.mkdir(parents=True)
    if not sharded:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return
    keys = list(state)
    parts = [keys[:2], keys[2:]]
    names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {}
    for part, name in zip(parts, names, strict=True):
        save_file({k: state[k] for k in part}, folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    import json

    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_ema_over_hf_trainer_checkpoints(tmp_path, sharded):
    states = []
    for step in HF_STEPS:
        states.append(_hf_state(step))
        _save_hf(tmp_path / "run" / f"checkpoint-{step}", states[-1], sharded)
    (tmp_path / "run" / "runs").mkdir()  # TensorBoard logs beside the checkpoints
    result = accumulate(tmp_path / "run", half_life=700, out=tmp_path / "ema")
    assert [c.step for c in result.folded] == HF_STEPS
    want = reference_ema(states, HF_STEPS, ExponentialProfile.from_half_life(700).keep_factor)
    got = _read_all(tmp_path / "ema")
    assert set(got) == set(want)
    for key, value in want.items():
        assert_close_relative(got[key], value)
    assert got["position_ids"].dtype == torch.int64
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors", dtype="bfloat16")
    out = load_file(tmp_path / "ema.safetensors")
    assert out["embed.weight"].dtype == torch.bfloat16 and torch.equal(out["position_ids"], states[-1]["position_ids"])
