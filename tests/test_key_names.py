"""Output key names, key conventions that change between checkpoints, and torch.save inputs.

Checkpoints here are written by torch's own ``dcp.save`` and ``torch.save`` and by the
safetensors library, never by hand.
"""

from __future__ import annotations

import pickle
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.commands.diff import diff
from ema_ckpt.commands.inspect import inspect_checkpoint
from ema_ckpt.errors import CheckpointFormatError, IncompatibleCheckpointError, UnsafePickleError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box

runner = CliRunner()


class Wrapper(nn.Module):
    """A module whose network is an attribute called ``model`` (Lightning's ``self.model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 4)


def _save(state: dict, path) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_a_module_attribute_named_model_is_kept(tmp_path):
    torch.manual_seed(0)
    module = Wrapper()
    _save(module.state_dict(), tmp_path / "step_1")
    result = consolidate(tmp_path / "step_1", tmp_path / "out.safetensors")
    got = load_file(tmp_path / "out.safetensors")
    assert sorted(got) == ["model.bias", "model.weight"]
    assert result.renamed_prefix is None and result.notes == []
    Wrapper().load_state_dict(got, strict=True)
    assert inspect_checkpoint(tmp_path / "step_1").container is None


def test_the_dcp_container_level_is_removed_and_reported(tmp_path):
    module = Wrapper()
    _save({"model": module.state_dict(), "optim": {"lr": torch.tensor(0.1)}}, tmp_path / "step_1")
    result = consolidate(tmp_path / "step_1", tmp_path / "out.safetensors")
    got = load_file(tmp_path / "out.safetensors")
    assert sorted(got) == ["model.bias", "model.weight"]  # the module's own names: container gone only
    assert result.renamed_prefix == "model." and "container level 'model.'" in result.notes[0]
    Wrapper().load_state_dict(got, strict=True)
    assert inspect_checkpoint(tmp_path / "step_1").container == "model."
    kept = consolidate(tmp_path / "step_1", tmp_path / "kept.safetensors", keep_prefix=True)
    assert kept.renamed_prefix is None
    assert sorted(load_file(tmp_path / "kept.safetensors")) == ["model.model.bias", "model.model.weight"]


def test_keys_that_merely_start_with_model_are_never_renamed(tmp_path):
    torch.manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    save_file(tensors, tmp_path / "model.safetensors")
    consolidate(tmp_path / "model.safetensors", tmp_path / "out.safetensors")
    assert sorted(load_file(tmp_path / "out.safetensors")) == sorted(tensors)
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    consolidate(tmp_path / "pytorch_model.bin", tmp_path / "out2.safetensors")
    assert sorted(load_file(tmp_path / "out2.safetensors")) == sorted(tensors)


def _titan_like(tmp_path):
    """DCP steps under one naming, then a last export of the same weights under other names."""
    torch.manual_seed(0)
    names = [f"layers.{i}.attention.wq.weight" for i in range(6)] + ["tok_embeddings.weight"]
    hf = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(6)] + ["model.embed_tokens.weight"]
    for step in (10, 20):
        _save({k: torch.randn(4, 4) for k in names}, tmp_path / "ckpts" / f"step-{step}")
    (tmp_path / "ckpts" / "step-30").mkdir()
    save_file(
        {k: torch.randn(4, 4) for k in hf[:-1]} | {"tok_embeddings.weight": torch.randn(4, 4)},
        tmp_path / "ckpts" / "step-30" / "model.safetensors",
    )
    return tmp_path / "ckpts"


def test_a_renamed_model_is_refused_even_with_allow_new_keys(tmp_path):
    ckpts = _titan_like(tmp_path)
    for dry_run in (True, False):
        with pytest.raises(
            IncompatibleCheckpointError, match=r"shares only 1 of its 7 keys.*with skip .*step-30"
        ) as info:
            accumulate(ckpts, decay=0.9, out=tmp_path / "ema", allow_new_keys=True, dry_run=dry_run)
        assert info.value.remedy == "skip"
    with pytest.raises(IncompatibleCheckpointError, match="shares only 1 of its 7 keys"):
        accumulate(ckpts, decay=0.9, out=tmp_path / "ema", dry_run=True)
    assert not (tmp_path / "ema").exists()


def test_a_renamed_model_after_an_incremental_run_is_refused(tmp_path):
    ckpts = _titan_like(tmp_path)
    accumulate(ckpts, decay=0.9, out=tmp_path / "ema", skip=[ckpts / "step-30"])
    with pytest.raises(IncompatibleCheckpointError, match="shares only 1 of its 7 keys"):
        accumulate(ckpts, decay=0.9, out=tmp_path / "ema", allow_new_keys=True)


def test_skip_leaves_one_checkpoint_out(tmp_path):
    ckpts = _titan_like(tmp_path)
    result = runner.invoke(
        app,
        [
            "accumulate",
            str(ckpts),
            "--decay",
            "0.9",
            "--out",
            str(tmp_path / "ema"),
            "--skip",
            str(ckpts / "step-30"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert '"step": 20' in result.output and "left out (--skip)" in result.output
    refused = runner.invoke(
        app,
        [
            "accumulate",
            str(ckpts),
            "--decay",
            "0.9",
            "--out",
            str(tmp_path / "ema2"),
            "--allow-new-keys",
            "--dry-run",
        ],
    )
    assert refused.exit_code == 4 and "--skip" in refused.output


def test_keys_added_during_training_still_need_only_allow_new_keys(tmp_path):
    torch.manual_seed(0)
    base = {f"model.w{i}": torch.randn(3) for i in range(6)}
    _save(base, tmp_path / "ckpts" / "step_1")
    _save(base | {"model.new": torch.randn(3)}, tmp_path / "ckpts" / "step_2")
    with pytest.raises(IncompatibleCheckpointError, match="pass allow_new_keys=True"):
        accumulate(tmp_path / "ckpts", decay=0.9, out=tmp_path / "ema", dry_run=True)
    accumulate(tmp_path / "ckpts", decay=0.9, out=tmp_path / "ema", allow_new_keys=True)


# --- torch.save files ---------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".bin"])
def test_torch_file_outputs_are_inputs_again(tmp_path, suffix):
    torch.manual_seed(0)
    _save({"model": {"w": torch.randn(6, 3), "n": torch.arange(4)}}, tmp_path / "step_1")
    consolidate(tmp_path / "step_1", tmp_path / f"model{suffix}")
    with open_checkpoint(tmp_path / f"model{suffix}") as reader:
        assert reader.format_name == "torch"
        assert torch.equal(
            reader.read("w", Box((2, 0), (3, 3))), torch.load(tmp_path / f"model{suffix}")["w"][2:5]
        )
    assert inspect_checkpoint(tmp_path / f"model{suffix}").key_count == 2
    assert diff(tmp_path / "step_1", tmp_path / f"model{suffix}").equal()
    consolidate(tmp_path / f"model{suffix}", tmp_path / "again.safetensors")
    assert torch.equal(
        load_file(tmp_path / "again.safetensors")["w"], torch.load(tmp_path / f"model{suffix}")["w"]
    )
    for command in (
        ["inspect", str(tmp_path / f"model{suffix}")],
        ["diff", str(tmp_path / "step_1"), str(tmp_path / f"model{suffix}")],
        ["verify", str(tmp_path / f"model{suffix}")],
    ):
        assert runner.invoke(app, command).exit_code == 0, command


def test_torch_files_of_views_nesting_and_tied_weights(tmp_path):
    torch.manual_seed(0)
    emb = torch.randn(5, 3)
    state = {
        "emb": emb,
        "head": emb,
        "t": torch.arange(6.0).reshape(2, 3).t(),
        "s": torch.tensor(2.5),
        "inner": {"x": torch.ones(2, dtype=torch.bfloat16)},
        "epoch": 3,
    }
    torch.save(state, tmp_path / "m.pt")
    with open_checkpoint(tmp_path / "m.pt") as reader:
        assert sorted(reader.specs()) == ["emb", "head", "inner.x", "s", "t"]
        assert torch.equal(reader.read("head", Box((1, 0), (3, 3))), emb[1:4])
        assert torch.equal(reader.read("t", Box((0, 1), (3, 1))), state["t"][:, 1:2])
        assert torch.equal(reader.read("s", Box((), ())), state["s"])
        assert reader.read("inner.x", Box((0,), (2,))).dtype == torch.bfloat16


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_torch_file_naming_code_is_refused(tmp_path, capsys):
    torch.save({"w": torch.ones(2), "evil": _Exploit()}, tmp_path / "evil.pt", pickle_module=pickle)
    with pytest.raises(UnsafePickleError, match=r"builtins\.print under key 'evil', which is not allowed"):
        open_checkpoint(tmp_path / "evil.pt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "evil.pt")])
    assert result.exit_code == 3 and "pwned" not in result.output and "Traceback" not in result.output


def test_a_truncated_torch_file_is_one_clear_error(tmp_path):
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match=r"cut\.pt"):
        open_checkpoint(tmp_path / "cut.pt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "cut.pt")])
    assert result.exit_code == 3 and "cut.pt" in result.output and "Traceback" not in result.output
    with zipfile.ZipFile(tmp_path / "m.pt") as archive:
        assert any(n.endswith("data.pkl") for n in archive.namelist())


def test_posthoc_and_average_leave_a_checkpoint_out_too(tmp_path):
    from ema_ckpt.commands.averaging import average, posthoc

    ckpts = _titan_like(tmp_path)
    with pytest.raises(IncompatibleCheckpointError, match="with skip ") as info:
        posthoc(ckpts, out=tmp_path / "ph", sigma_rels=["0.2"])
    result = posthoc(ckpts, out=tmp_path / "ph", sigma_rels=["0.2"], skip=[ckpts / "step-30"])
    assert [t.step for t in result.plan.outputs[0].terms] == [10, 20]
    assert info.value.remedy == "skip"
    assert any("left out (skip)" in n and n.mentions == ("skip",) for n in result.plan.notes)
    plan = average(ckpts, out=tmp_path / "avg", last=2, skip=[ckpts / "step-30"], dry_run=True)
    assert [t.step for t in plan.outputs[0].terms] == [10, 20]
    cli = runner.invoke(
        app,
        [
            "average",
            str(ckpts),
            "--last",
            "2",
            "--out",
            str(tmp_path / "avg2"),
            "--skip",
            str(ckpts / "step-30"),
        ],
    )
    assert cli.exit_code == 0, cli.output


def test_torch_file_bombs_are_refused_in_a_line(tmp_path):
    loop: dict = {"w": torch.ones(2)}
    loop["self"] = loop
    torch.save(loop, tmp_path / "loop.pt")
    shared = {"w": torch.ones(2)}
    torch.save({"a": shared, "b": shared}, tmp_path / "shared.pt")
    torch.save({"w": torch.ones(1).expand(1 << 20, 1 << 20)}, tmp_path / "expanded.pt")
    for name, message in (
        ("loop.pt", "appears twice"),
        ("shared.pt", "appears twice"),
        ("expanded.pt", "view of 1 stored elements"),
    ):
        with pytest.raises(CheckpointFormatError, match=message):
            open_checkpoint(tmp_path / name)
        result = runner.invoke(app, ["inspect", str(tmp_path / name)])
        assert result.exit_code == 3 and "Traceback" not in result.output, result.output


def test_torch_files_of_newer_dtypes_and_partial_strided_reads(tmp_path):
    torch.manual_seed(0)
    wide = torch.randn(64, 48).t()  # (48, 64), column-major in its storage
    state = {"t": wide, "f8": torch.randn(5).to(torch.float8_e4m3fn), "u16": torch.arange(4).to(torch.uint16)}
    torch.save(state, tmp_path / "m.pt")
    with open_checkpoint(tmp_path / "m.pt") as reader:
        assert reader.specs()["f8"].dtype == torch.float8_e4m3fn
        for box in (Box((3, 5), (7, 2)), Box((0, 0), (48, 64)), Box((47, 63), (1, 1))):
            assert torch.equal(reader.read("t", box), wide[box.slices()])
        got = reader.read("f8", Box((1,), (3,)))
        assert torch.equal(got.view(torch.uint8), state["f8"][1:4].view(torch.uint8))


def test_a_torch_file_container_level_is_a_container(tmp_path):
    module = Wrapper()
    torch.save({"model": module.state_dict(), "optimizer": {"step": torch.tensor(3.0)}}, tmp_path / "m.pt")
    result = consolidate(tmp_path / "m.pt", tmp_path / "out.safetensors")
    # the reader takes the state dict under "model" (keys as the module names them, its own "model." kept)
    assert sorted(load_file(tmp_path / "out.safetensors")) == ["model.bias", "model.weight"]
    assert result.renamed_prefix is None and inspect_checkpoint(tmp_path / "m.pt").details["container"] == "model"
