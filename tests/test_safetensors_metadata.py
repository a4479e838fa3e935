"""A safetensors input's header ``__metadata__`` (kohya's ``ss_*``, ``modelspec.*``) is carried into
the safetensors files made from it, with the output's provenance under ``ema_ckpt.*``.

The oracle is safetensors' own reader, ``safe_open(path, "pt").metadata()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ema_ckpt._version import __version__
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.base import CARRIED_FILES, SAFETENSORS_METADATA_FILE
from ema_ckpt.formats.safetensors.metadata import MAX_METADATA_BYTES, carried_metadata, header_metadata

KOHYA = {"ss_network_module": "networks.lora", "ss_network_dim": "16", "ss_output_name": "tiny",
         "modelspec.title": "tiny lora", "modelspec.architecture": "stable-diffusion-v1/lora",
         "ss_tag_frequency": json.dumps({"img": {"cat": 3, "dög": 1}})}


def _save(path: Path, value: float, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"lora_unet_down.alpha": torch.tensor(8.0), "lora_unet_down.lora_down.weight": torch.full((4, 6), value)},
              str(path), metadata=metadata)


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as handle:
        return handle.metadata()


def test_consolidating_a_file_keeps_its_metadata_and_says_it_was_rewritten(tmp_path):
    _save(tmp_path / "tiny.safetensors", 1.0, {"format": "pt", **KOHYA})
    consolidate(tmp_path / "tiny.safetensors", tmp_path / "out.safetensors")
    assert _metadata(tmp_path / "out.safetensors") == {
        "format": "pt", **KOHYA, "ema_ckpt.version": __version__, "ema_ckpt.kind": "consolidated"}
    with open_checkpoint(tmp_path / "tiny.safetensors") as reader:
        [carried] = [f for f in reader.carried_files() if f.name == SAFETENSORS_METADATA_FILE]
        assert json.loads(carried.data) == KOHYA


def test_a_file_without_metadata_converts_as_save_file_writes_it(tmp_path):
    _save(tmp_path / "plain.safetensors", 1.0, {"format": "pt"})
    with open_checkpoint(tmp_path / "plain.safetensors") as reader:
        assert not any(f.name == SAFETENSORS_METADATA_FILE for f in reader.carried_files())
    consolidate(tmp_path / "plain.safetensors", tmp_path / "out.safetensors")
    assert _metadata(tmp_path / "out.safetensors") == {"format": "pt"}


def test_an_ema_of_files_carries_the_newest_files_metadata(tmp_path):
    for step in (1, 2):
        _save(tmp_path / "runs" / f"tiny-step{step:08d}.safetensors", float(step),
              {"format": "pt", **KOHYA, "ss_steps": str(step), "ss_output_name": f"tiny-{step}"})
    accumulate(tmp_path / "runs", out=tmp_path / "ema", decay=0.5)
    assert SAFETENSORS_METADATA_FILE in CARRIED_FILES and (tmp_path / "ema" / SAFETENSORS_METADATA_FILE).is_file()
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = _metadata(tmp_path / "ema.safetensors")
    profile = json.loads(got.pop("ema_ckpt.profile"))
    assert got == {"format": "pt", **KOHYA, "ss_steps": "2", "ss_output_name": "tiny-2",
                   "ema_ckpt.version": __version__, "ema_ckpt.kind": "ema", "ema_ckpt.step": "2",
                   "ema_ckpt.decay": "0.5"}
    assert profile["kind"] == "exponential" and profile["decay"] == 0.5
    # every shard of a directory output has it in its header; no file of it beside them
    consolidate(tmp_path / "ema", f"{tmp_path}/hf/", max_shard_size="50B")
    shards = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) == 2 and all(_metadata(s)["ss_steps"] == "2" for s in shards)
    assert not (tmp_path / "hf" / SAFETENSORS_METADATA_FILE).exists()


def test_an_inputs_metadata_never_overwrites_the_writers_keys(tmp_path):
    forged = {"format": "np", "ema_ckpt.step": "999", "ema_ckpt.kind": "forged", "ema_ckpt.extra": "x",
              "ss_steps": "7"}
    for step in (1, 2):
        _save(tmp_path / "runs" / f"step_{step}.safetensors", float(step), forged)
    consolidate(tmp_path / "runs" / "step_2.safetensors", tmp_path / "one.safetensors")
    assert _metadata(tmp_path / "one.safetensors") == {
        "format": "pt", "ss_steps": "7", "ema_ckpt.version": __version__, "ema_ckpt.kind": "consolidated"}
    accumulate(tmp_path / "runs", out=tmp_path / "ema", decay=0.5, step_regex=r"step_(\d+)")
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = _metadata(tmp_path / "ema.safetensors")
    assert got["format"] == "pt" and got["ema_ckpt.step"] == "2" and got["ema_ckpt.kind"] == "ema"
    assert "ema_ckpt.extra" not in got and got["ss_steps"] == "7"


def test_what_is_carried_is_bounded_and_strings_only():
    assert carried_metadata({"format": "pt"}) is None
    assert carried_metadata({"a": "x" * (MAX_METADATA_BYTES + 1)}) is None
    assert carried_metadata({"a": 1}) is None and carried_metadata(["a"]) is None
    assert carried_metadata({"a": "\ud800"}) is None  # no safetensors loader reads a lone surrogate back
    assert header_metadata({"format": "np", "b": "1"}, {"ema_ckpt.kind": "ema"}) == {
        "format": "pt", "b": "1", "ema_ckpt.kind": "ema"}
