"""Single files and ``.bin`` folders as trainers write them: found, averaged and loaded back with no flag.

The fixtures in ``tests/fixtures/trainers`` were written by each framework's own saving code
(``make fixtures``; ``single_files.py`` and ``bin_folders.py`` in ``tests/producers/trainers``):
Lightning's ``ModelCheckpoint`` (one device, and DDP on 2 ranks with ``save_last="link"``), a
MAE/DeiT-style ``torch.save`` loop with an ``argparse.Namespace``, a nanoGPT-style loop under
``torch.compile``, timm's ``CheckpointSaver`` with ``ModelEmaV3``, accelerate's FSDP
``FULL_STATE_DICT`` and plain ``save_state``, transformers 4 ``pytorch_model.bin`` folders
(whole and sharded) and a peft LoRA adapter. Beside each, ``oracle/`` holds the weights as the
framework's own loader reads them. Every EMA is checked against a float64 EMA of those, and
every output is loaded by the framework's own loader, strictly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.cli._flags import cli_text
from ema_ckpt.commands.inspect import inspect_folder
from ema_ckpt.discovery import discover
from ema_ckpt.errors import CheckpointNotFoundError
from tests.ema_reference import assert_close_relative
from tests.test_trainers import assert_loads_with_from_pretrained, reference_ema

FIXTURES = Path(__file__).parent / "fixtures" / "trainers"
runner = CliRunner()

# set -> (the folder the trainer saved into, the step each checkpoint is found at is the ...)
FOLDERS = {
    "lightning-single": "ckpts", "lightning-ddp": "ckpts", "research-mae": "output_dir", "nanogpt": "out",
    "timm-saver": "output/tiny", "accelerate-fsdp2-full": "ckpts", "accelerate-fsdp1-full": "ckpts",
    "accelerate-plain": "ckpts", "accelerate-plain-bin": "ckpts", "transformers4-bin": "ckpts",
    "transformers4-bin-sharded": "ckpts", "peft-lora": "ckpts",
}
EPOCH_SETS = {"research-mae", "timm-saver"}
"""Their files record epochs only: refused unless ``--step-from epoch`` (then the step is the epoch, and
the run says so)."""
HF_SETS = ["accelerate-fsdp2-full", "accelerate-fsdp1-full", "accelerate-plain", "accelerate-plain-bin",
           "transformers4-bin", "transformers4-bin-sharded"]
MODULE_SETS = ["lightning-single", "lightning-ddp", "research-mae", "nanogpt", "timm-saver"]


def producer(name: str) -> dict:
    return json.loads((FIXTURES / name / "producer.json").read_text())


def kept(name: str) -> list[tuple[str, dict]]:
    """The checkpoints an EMA folds (copies of another left out), oldest first."""
    items = [(rel, info) for rel, info in producer(name)["checkpoints"].items()
             if not info.get("copy_of") and not info.get("symlink_to")]
    return sorted(items, key=lambda item: item[1]["optimizer_step"])


def step_of(name: str, info: dict) -> int:
    return info["epoch"] if name in EPOCH_SETS else info["optimizer_step"]


def oracle(name: str, info: dict, key: str = "oracle") -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / info[key])


def module_of(name: str) -> torch.nn.Module:
    """The producer's own module, rebuilt from the source it recorded."""
    doc = producer(name)
    namespace: dict = {}
    exec(doc["module_class_source"], namespace)
    return eval(doc["module_factory"], namespace)


@pytest.fixture
def copy_of(tmp_path):
    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(FIXTURES / name, target, symlinks=True)
        return target / FOLDERS[name]

    return make


def ema_of(folder: Path, out: Path, *flags: str) -> None:
    if any(part in EPOCH_SETS for part in folder.parts):
        flags = ("--step-from", "epoch", *flags)
    result = runner.invoke(app, ["accumulate", str(folder), "--decay", "0.8", "--out", str(out), *flags])
    assert result.exit_code == 0, result.output


def assert_ema(got: dict[str, torch.Tensor], name: str, key: str = "oracle") -> None:
    """``got`` is the float64 EMA of the set's checkpoints (integer buffers: the newest's, as stored)."""
    items = kept(name)
    states = [oracle(name, info, key) for _, info in items]
    want = reference_ema(states, [step_of(name, i) for _, i in items], 0.8)
    assert sorted(got) == sorted(want)
    for k, value in want.items():
        if states[-1][k].is_floating_point():
            assert_close_relative(got[k], value, rel=1e-6)
        else:
            assert got[k].dtype == states[-1][k].dtype and torch.equal(got[k], states[-1][k]), k


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_every_checkpoint_is_found_with_no_flag(name):
    if name in EPOCH_SETS:  # no step record: refused, the way through named
        with pytest.raises(CheckpointNotFoundError, match="only epochs are recorded") as refused:
            discover([FIXTURES / name / FOLDERS[name]])
        assert "step_from" in refused.value.parameters
    found = discover([FIXTURES / name / FOLDERS[name]], step_from="epoch" if name in EPOCH_SETS else None)
    assert [c.step for c in found.checkpoints] == [step_of(name, info) for _, info in kept(name)]
    sources = {c.step_source for c in found.checkpoints}
    if name in EPOCH_SETS:
        assert {cli_text(s) for s in sources} == {"epoch in the file (--step-from)"}
        assert any("these steps count epochs" in n for n in found.notes), found.notes
    elif name.startswith("lightning"):
        assert sources == {"global_step in the file"}
        assert any("last.ckpt" in n and "same step 8" in n for n in found.notes), found.notes
    elif name == "nanogpt":
        assert sources == {"iter_num in the file"}
    elif name.startswith("accelerate"):
        assert sources == {"optimizer step counter in optimizer.bin"}
    elif name == "transformers4-bin-sharded":
        assert sources == {"folder name"}
    else:
        assert sources == {"trainer_state.json global_step"}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_accumulate_with_no_flag_matches_a_float64_ema(name, copy_of, tmp_path):
    ema_of(copy_of(name), tmp_path / "ema")
    assert runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(tmp_path / "ema.safetensors")]
                         ).exit_code == 0
    assert_ema(load_file(tmp_path / "ema.safetensors"), name)


@pytest.mark.parametrize("name", MODULE_SETS)
def test_the_ema_loads_into_the_trainers_module_strictly(name, copy_of, tmp_path):
    ema_of(copy_of(name), tmp_path / "ema")
    out = tmp_path / "ema.pt"
    assert runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(out)]).exit_code == 0
    state = torch.load(out, weights_only=True)
    module_of(name).load_state_dict(state, strict=True)  # the model's own names: no container, no _orig_mod.
    assert_ema(state, name)


@pytest.mark.parametrize("name", ["lightning-single", "lightning-ddp"])
def test_a_lightning_checkpoint_out_loads_with_load_from_checkpoint(name, copy_of, tmp_path):
    ema_of(copy_of(name), tmp_path / "ema")
    out = tmp_path / "ema.ckpt"
    result = runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(out)])
    assert result.exit_code == 0 and "lightning" in result.output, result.output
    module = type(module_of(name)).load_from_checkpoint(out)
    assert dict(module.hparams) == {"lr": 0.02, "hidden": 10, "tags": ["tiny", "single-file"]}
    saved = torch.load(out, weights_only=False)
    assert saved["global_step"] == 8 and saved["epoch"] == 2 and "optimizer_states" not in saved
    assert_ema({k: v for k, v in module.state_dict().items()}, name)
    # a single Lightning file straight to .ckpt keeps its own entries too
    direct = tmp_path / "direct.ckpt"
    source = FIXTURES / name / "ckpts" / "epoch=1-step=4.ckpt"
    assert runner.invoke(app, ["consolidate", str(source), "--out", str(direct)]).exit_code == 0
    again = type(module_of(name)).load_from_checkpoint(direct)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in load_file(
        FIXTURES / name / "oracle" / "epoch=1-step=4.ckpt.safetensors").items())


def _timm_helpers():
    """timm's own ``load_checkpoint``, loaded from its file (timm's package needs torchvision)."""
    spec = importlib.util.find_spec("timm")
    assert spec is not None and spec.submodule_search_locations, "timm is installed by make install-test"
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "_helpers.py"
    module_spec = importlib.util.spec_from_file_location("timm_helpers_under_test", path)
    helpers = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(helpers)
    return helpers


@pytest.mark.parametrize("state_key", [None, "state_dict_ema"])
def test_timm_loads_the_ema_with_its_own_load_checkpoint(state_key, copy_of, tmp_path):
    flags = ["--state-key", state_key] if state_key else []
    ema_of(copy_of("timm-saver"), tmp_path / "ema", *flags)
    out = tmp_path / "ema.pth.tar"
    assert runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(out)]).exit_code == 0
    model = module_of("timm-saver")
    _timm_helpers().load_checkpoint(model, str(out), strict=True)
    assert_ema(model.state_dict(), "timm-saver", "oracle_ema" if state_key else "oracle")


def test_a_changed_state_key_is_another_ema(copy_of, tmp_path):
    folder = copy_of("timm-saver")
    ema_of(folder, tmp_path / "ema")
    result = runner.invoke(app, ["accumulate", str(folder), "--decay", "0.8", "--out", str(tmp_path / "ema"),
                                 "--state-key", "state_dict_ema"])
    said = ("made from the state dict found in each file, not the state dict 'state_dict_ema' of each file; "
            "pass --restart to start over, or drop --state-key")
    assert result.exit_code == 5 and said in result.output, result.output
    manifest = json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())
    assert "state_key" not in manifest["selection"]
    ema_of(folder, tmp_path / "ema2", "--state-key", "state_dict_ema")
    assert json.loads((tmp_path / "ema2" / "ema-ckpt.json").read_text())["selection"]["state_key"] == "state_dict_ema"


@pytest.mark.parametrize("name", HF_SETS)
def test_hf_folders_load_with_from_pretrained(name, copy_of, tmp_path):
    ema_of(copy_of(name), tmp_path / "ema")
    out = tmp_path / "hf_ema"  # no suffix: the directory layout, as save_pretrained("hf_ema") makes
    result = runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    if name.startswith("transformers4"):  # their config.json came along with the EMA
        assert (out / "config.json").read_bytes() == (
            FIXTURES / name / "ckpts" / "checkpoint-6" / "config.json").read_bytes()
    else:
        from transformers import LlamaConfig

        LlamaConfig(**producer(name)["model_config"]).save_pretrained(out)
    assert_loads_with_from_pretrained(out, out / "model.safetensors", tie=False)
    assert_ema(load_file(out / "model.safetensors"), name)


def test_a_peft_adapter_ema_loads_with_peft_from_pretrained(copy_of, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    ema_of(copy_of("peft-lora"), tmp_path / "ema")
    out = tmp_path / "adapter_ema"
    assert runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(out)]).exit_code == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    base = LlamaForCausalLM(LlamaConfig(**producer("peft-lora")["model_config"]))
    base.load_state_dict(load_file(FIXTURES / "peft-lora" / "oracle" / "base_model.safetensors"), strict=True)
    model = PeftModel.from_pretrained(base, out)
    assert_ema({k: v for k, v in get_peft_model_state_dict(model).items()}, "peft-lora")


def test_inspect_a_folder_says_what_it_took_and_why(copy_of):
    folder = copy_of("lightning-ddp")
    (folder / "notes.txt").write_text("x")
    report = inspect_folder(folder)
    rows = {e.path.name: (e.taken, e.step, str(e.why)) for e in report.entries}
    assert rows["epoch=2-step=8.ckpt"] == (True, 8, "global_step in the file")
    assert rows["last.ckpt"][0] is False and "the same step 8" in rows["last.ckpt"][2]
    assert rows["notes.txt"] == (False, None, "not a checkpoint file")
    result = runner.invoke(app, ["inspect", str(folder)], terminal_width=200)
    assert result.exit_code == 0 and "4 checkpoints of 6 entries" in result.output, result.output
    data = json.loads(runner.invoke(app, ["inspect", str(folder), "--json"]).stdout)
    assert data["checkpoints"] == 4 and len(data["entries"]) == 6


def test_inspect_a_file_shows_its_entries_and_the_one_read(tmp_path):
    path = FIXTURES / "timm-saver" / "output" / "tiny" / "last.pth.tar"
    result = runner.invoke(app, ["inspect", str(path), "--state-key", "state_dict_ema"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "state_dict_ema │ dict of 8 (8 tensors) │ model" in result.output
    assert "args           │ argparse.Namespace" in result.output
    assert "only epochs are recorded (epoch = " in " ".join(result.output.split())
    counted = runner.invoke(app, ["inspect", str(path), "--step-from", "epoch"], terminal_width=200)
    assert "epoch = " in counted.output and "(epochs, taken)" in counted.output, counted.output


def test_a_cron_job_beside_a_trainer_with_retention_equals_one_run(tmp_path):
    """Files appear one at a time (each written whole: Lightning moves a finished file into place)
    while retention keeps the newest two; cron folds after each save."""
    names = [Path(rel).name for rel, _ in kept("lightning-single")]
    live = tmp_path / "live"
    live.mkdir()
    for i, name in enumerate(names):
        shutil.copy(FIXTURES / "lightning-single" / "ckpts" / name, live / name)
        shutil.copy(live / name, live / "last.ckpt")  # the trainer's own last.ckpt, rewritten every save
        for old in names[: max(0, i - 1)]:
            (live / old).unlink(missing_ok=True)
        ema_of(live, tmp_path / "ema")
    once = tmp_path / "once"
    shutil.copytree(FIXTURES / "lightning-single" / "ckpts", once)
    ema_of(once, tmp_path / "ema-once")
    for out in ("ema", "ema-once"):
        runner.invoke(app, ["consolidate", str(tmp_path / out), "--out", str(tmp_path / f"{out}.safetensors")])
    cron, one = load_file(tmp_path / "ema.safetensors"), load_file(tmp_path / "ema-once.safetensors")
    assert sorted(cron) == sorted(one) and all(torch.equal(cron[k], one[k]) for k in one)
    manifest = json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == [2, 4, 6, 8]
    assert all(not c["path"].endswith("last.ckpt") for c in manifest["checkpoints"])


def test_a_file_being_written_is_skipped_then_folded(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    files = [Path(rel).name for rel, _ in kept("lightning-single")]
    for name in files[:2]:
        shutil.copy(FIXTURES / "lightning-single" / "ckpts" / name, live / name)
    data = (FIXTURES / "lightning-single" / "ckpts" / files[2]).read_bytes()
    (live / files[2]).write_bytes(data[: len(data) // 2])  # torch.save in progress: no zip directory yet
    result = runner.invoke(app, ["accumulate", str(live), "--decay", "0.8", "--out", str(tmp_path / "ema")])
    assert result.exit_code == 0 and "EMA now at step 4" in result.output, result.output
    assert f"skipped {live / files[2]}: truncated: no zip directory at its end (still being written?)" in result.output
    (live / files[2]).write_bytes(data)
    again = runner.invoke(app, ["accumulate", str(live), "--decay", "0.8", "--out", str(tmp_path / "ema")])
    assert again.exit_code == 0 and "folded step 6" in again.output, again.output


def test_the_training_scripts_side_files_are_never_models(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    for name in ("checkpoint-0.pth", "checkpoint-1.pth"):
        shutil.copy(FIXTURES / "research-mae" / "output_dir" / name, folder / name)
    model = torch.nn.Linear(2, 2)
    torch.save(torch.optim.AdamW(model.parameters()).state_dict(), folder / "optimizer.pt")
    torch.save({"python": (3, (1,), None), "cpu": torch.get_rng_state()}, folder / "rng_state_0.pth")
    report = inspect_folder(folder, step_from="epoch")
    rows = {e.path.name: (e.taken, str(e.why)) for e in report.entries}
    assert rows["checkpoint-1.pth"][0] and not rows["optimizer.pt"][0] and not rows["rng_state_0.pth"][0]
    assert "training state beside the checkpoints" in rows["optimizer.pt"][1]
    result = runner.invoke(app, ["inspect", str(folder / "optimizer.pt")])
    assert result.exit_code == 3 and "training state beside the checkpoints" in result.output, result.output
    assert "Traceback" not in result.output


def test_megatron_ema_opens_with_dist_checkpointing_load(tmp_path):
    import subprocess
    import sys

    name = "megatron-torch-dist"
    work = tmp_path / name
    shutil.copytree(FIXTURES / name, work)
    ema_of(work, tmp_path / "ema")
    assert {"metadata.json", "common.pt"} <= {p.name for p in (tmp_path / "ema").iterdir()}
    loaded = tmp_path / "loaded.safetensors"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "producers" / "megatron_load.py"), "--fixture",
         str(FIXTURES / name), "--ckpt", str(tmp_path / "ema"), "--out", str(loaded)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "OK:" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    items = sorted(producer(name)["checkpoints"].items(), key=lambda item: item[1]["optimizer_step"])
    states = [load_file(FIXTURES / name / producer(name)["oracle"][rel]) for rel, _ in items]
    want = reference_ema(states, [info["optimizer_step"] for _, info in items], 0.8)
    got = load_file(loaded)
    for key, value in want.items():
        assert_close_relative(got[key], value, rel=1e-6)
    assert runner.invoke(app, ["verify", str(tmp_path / "ema")]).exit_code == 0
