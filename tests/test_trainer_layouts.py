"""Any trainer's checkpoints: found, stepped and read whole, or refused out loud.

Checkpoints laid out as trainers this project names nowhere else write them: a model one folder
down (``checkpoint-N/unet/``), several models in one checkpoint, steps kept only in a file's
nested records or a safetensors header, names with several counters. Each is found with no
flag at the optimizer step, or refused with one line naming the way through; never folded in
part with exit 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ema_ckpt
from ema_ckpt.cli import app
from ema_ckpt.discovery import discover
from ema_ckpt.errors import CheckpointNotFoundError, UnplacedCheckpointError
from ema_ckpt.steps import step_from_name
from tests.dcp_helpers import write_dcp
from tests.ema_reference import assert_close_relative
from tests.test_trainers import reference_ema

FIXTURES = Path(__file__).parent / "fixtures" / "trainers"
runner = CliRunner()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(3, 4, generator=g), "fc.bias": torch.randn(3, generator=g)}


def _ema_file(out: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    target = tmp_path / f"{out.name}.safetensors"
    result = runner.invoke(app, ["consolidate", str(out), "--out", str(target)])
    assert result.exit_code == 0, result.output
    return load_file(target)


def _accumulate(folder: Path, out: Path, *flags: str) -> dict:
    result = runner.invoke(app, ["accumulate", str(folder), "--decay", "0.8", "--out", str(out), "--json", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- steps from records -----------------------------------------------------------------------


def test_names_with_several_counters_take_the_labelled_step():
    assert step_from_name("ep0-ba4-rank0.pt") == 4
    assert step_from_name("epoch=3-step=1000.ckpt") == 1000
    assert step_from_name("iter-000008-ckpt.pth") == 8
    assert step_from_name("epoch_3.pth") is None  # epochs are never taken as steps silently
    assert step_from_name("resnet50-1000.pt") is None  # two numbers, none labelled: ambiguous


def test_a_composer_style_file_takes_the_batch_counter_and_keeps_module_names(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    states = {}
    for epoch, batch in ((0, 2), (0, 4), (1, 6)):
        model = {f"module.{k}": v for k, v in _weights(batch).items()}
        states[batch] = model
        timestamp = {"iteration": 0, "epoch": epoch, "batch": batch, "sample": 4 * batch, "token": 0,
                     "batch_in_epoch": batch % 4}
        torch.save({"state": {"model": model, "optimizers": {"AdamW": {"state": {}, "param_groups": []}},
                              "timestamp": timestamp, "run_name": "tiny"}, "rng": [{"torch": torch.get_rng_state()}]},
                   folder / f"ep{epoch}-ba{batch}-rank0.pt")
    found = discover([folder])
    assert [c.step for c in found.checkpoints] == [2, 4, 6]
    assert all("state.timestamp.batch" in str(c.step_source) for c in found.checkpoints)
    _accumulate(folder, tmp_path / "ema")
    got = _ema_file(tmp_path / "ema", tmp_path)
    want = reference_ema([states[s] for s in (2, 4, 6)], [2, 4, 6], 0.8)
    assert sorted(got) == sorted(want)  # Composer loads the names as saved: module. kept
    for key, value in want.items():
        assert_close_relative(got[key], value, rel=1e-6)


def test_optimizer_steps_win_over_micro_batches_and_epochs(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    for steps in (2, 4):
        # LitGPT-style: iter_num counts micro-batches beside step_count; the name counts micro-batches too
        torch.save({"model": _weights(steps), "iter_num": 2 * steps, "step_count": steps, "epoch": 0},
                   folder / f"iter-{2 * steps:06d}-ckpt.pth")
    found = discover([folder])
    assert [c.step for c in found.checkpoints] == [2, 4]
    assert [str(c.step_source) for c in found.checkpoints] == ["step_count in the file"] * 2
    inspected = runner.invoke(app, ["inspect", str(folder / "iter-000004-ckpt.pth"), "--json"])
    counters = {c["record"]: (c["value"], c["taken"]) for c in json.loads(inspected.stdout)["counters"]}
    assert counters["step_count"] == (2, True) and counters["iter_num"] == (4, False)


def test_nested_records_win_over_an_epoch_name(tmp_path):
    folder = tmp_path / "work_dir"
    folder.mkdir()
    for epoch in (1, 2):  # mmengine-style: meta.iter counts updates, the file is named by epoch
        torch.save({"meta": {"epoch": epoch, "iter": 5 * epoch}, "state_dict": _weights(epoch),
                    "message_hub": {"runtime_info": {"iter": 999}}}, folder / f"epoch_{epoch}.pth")
    (folder / "last_checkpoint").write_text(str(folder / "epoch_2.pth"))
    assert [c.step for c in discover([folder]).checkpoints] == [5, 10]


def test_a_step_only_in_safetensors_metadata(tmp_path):
    folder = tmp_path / "lora"
    folder.mkdir()
    for epoch, steps in ((1, 6), (2, 12)):  # kohya-style: the name counts epochs, ss_steps the updates
        save_file(_weights(epoch), str(folder / f"last-{epoch:06d}.safetensors"),
                  metadata={"ss_steps": str(steps), "ss_epoch": str(epoch), "ss_network_module": "networks.lora"})
    save_file(_weights(3), str(folder / "last.safetensors"), metadata={"ss_steps": "18", "ss_epoch": "3"})
    found = discover([folder])
    assert [c.step for c in found.checkpoints] == [6, 12, 18]
    assert {str(c.step_source) for c in found.checkpoints} == {"ss_steps in its safetensors metadata"}


def test_a_step_file_beside_a_dcp_folder(tmp_path):
    for step in (2, 4):  # OLMo-core-style: stepN/model_and_optim/ DCP, the step in train/rank0.pt
        write_dcp(tmp_path / f"step{step}" / "model_and_optim", {"model.w": torch.full((2,), float(step))})
        (tmp_path / f"step{step}" / "train").mkdir()
        torch.save({"global_step": step, "global_train_tokens": 64 * step}, tmp_path / f"step{step}" / "train"
                   / "rank0.pt")
    found = discover([tmp_path])
    assert [(c.step, str(c.step_source)) for c in found.checkpoints] == [
        (2, "global_step in train/rank0.pt"), (4, "global_step in train/rank0.pt")]


def test_epoch_only_records_are_refused_unless_asked(tmp_path):
    for epoch in (1, 2):
        torch.save({"model": _weights(epoch), "epoch": epoch}, tmp_path / f"checkpoint-{epoch}.pth")
    with pytest.raises(CheckpointNotFoundError, match="only epochs are recorded"):
        discover([tmp_path])
    result = runner.invoke(app, ["accumulate", str(tmp_path), "--decay", "0.8", "--out", str(tmp_path / "e")])
    assert result.exit_code == 3 and "--step-from" in result.output, result.output
    data = _accumulate(tmp_path, tmp_path / "ema", "--step-from", "epoch")
    assert any("count epochs" in n for n in data["notes"]), data["notes"]
    manifest = json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())
    assert manifest["options"]["step_from"] == "epoch"


def test_step_regex_matches_the_path_from_the_sequence_root(tmp_path):
    for n in (3, 7):
        save_file(_weights(n), str((tmp_path / f"run-{n}" / "unet").mkdir(parents=True) or
                                   tmp_path / f"run-{n}" / "unet" / "diffusion_pytorch_model.safetensors"))
    found = discover([tmp_path], step_regex=r"run-(\d+)/unet")
    assert [c.step for c in found.checkpoints] == [3, 7]


def test_step_from_names_a_record_and_says_what_it_records_when_missing(tmp_path):
    for n in (1, 2):
        torch.save({"model": _weights(n), "global_step": 100 * n, "tokens_seen": 7 * n}, tmp_path / f"c{n}.pt")
    assert [c.step for c in discover([tmp_path], step_from="tokens_seen").checkpoints] == [7, 14]
    with pytest.raises(CheckpointNotFoundError, match=r"no record 'nope'.*it records global_step, tokens_seen"):
        discover([tmp_path], step_from="nope")


# -- no silent partial result -----------------------------------------------------------------


def test_an_entry_like_the_others_without_a_step_fails_the_run(tmp_path):
    for n in (1, 2):
        save_file(_weights(n), str(tmp_path / f"step_{n}.safetensors"))
    save_file(_weights(3), str(tmp_path / "weights-copy.safetensors"))
    result = runner.invoke(app, ["accumulate", str(tmp_path), "--decay", "0.8", "--out", str(tmp_path / "e")])
    assert result.exit_code == 3, result.output
    assert "weights-copy.safetensors" in result.output and "--skip" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "e").exists()
    data = _accumulate(tmp_path, tmp_path / "ema", "--skip", str(tmp_path / "weights-copy.safetensors"))
    assert [c["step"] for c in data["folded"]] == [1, 2]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["step", "nameless", "other-keys", "alias", "export", "notes"]), min_size=1,
                max_size=6))
def test_every_model_bearing_entry_is_placed_or_the_run_fails(tmp_path_factory, kinds):
    folder = tmp_path_factory.mktemp("seq")
    save_file(_weights(0), str(folder / "step_1.safetensors"))
    save_file(_weights(1), str(folder / "step_2.safetensors"))
    for i, kind in enumerate(kinds):
        if kind == "step":
            save_file(_weights(i + 10), str(folder / f"step_{i + 10}.safetensors"))
        elif kind == "nameless":
            save_file(_weights(i), str(folder / f"weights-{chr(97 + i)}.safetensors"))
        elif kind == "other-keys":
            save_file({"other": torch.zeros(1)}, str(folder / f"other-{chr(97 + i)}.safetensors"))
        elif kind == "alias":
            shutil.copy(folder / "step_1.safetensors", folder / "last.safetensors")
        elif kind == "export":  # a final copy beside the checkpoints, with no step of its own
            (folder / "final").mkdir(exist_ok=True)
            save_file(_weights(5), str(folder / "final" / "model.safetensors"))
        else:
            (folder / f"notes-{i}.txt").write_text("x")
    try:
        found = discover([folder])
    except UnplacedCheckpointError as refused:
        assert "nameless" in kinds and "weights-" in str(refused)
        return
    assert "nameless" not in kinds
    model_files = {p.name for p in folder.glob("*.safetensors")} | ({"final"} if "export" in kinds else set())
    said = {e.path.name for e in found.entries}
    assert model_files <= said  # every model-bearing entry is taken or left with a reason
    taken = {c.path.name for c in found.checkpoints}
    for entry in found.entries:
        if entry.path.name in model_files and entry.path.name not in taken:
            assert entry.why and (entry.path.name in ("last.safetensors", "final") or entry.path.name.startswith(
                "other-"))


# -- components -------------------------------------------------------------------------------


def _producer(name: str) -> dict:
    return json.loads((FIXTURES / name / "producer.json").read_text())


@pytest.mark.skipif(not (FIXTURES / "accelerate-two-models").is_dir(), reason="fixture not made")
def test_accelerate_with_two_models_averages_each_into_its_own_folder(tmp_path):
    work = tmp_path / "set"
    shutil.copytree(FIXTURES / "accelerate-two-models", work)
    data = _accumulate(work / "ckpts", tmp_path / "ema")
    assert sorted(data["components"]) == ["model", "model_1"]
    items = sorted(_producer("accelerate-two-models")["checkpoints"].values(), key=lambda i: i["optimizer_step"])
    steps = [i["optimizer_step"] for i in items]
    for name in ("model", "model_1"):
        want = reference_ema([load_file(work / i["components"][name]["oracle"]) for i in items], steps, 0.8)
        got = load_file(tmp_path / "ema" / name / f"{name}.safetensors")  # named as accelerate names it
        assert sorted(got) == sorted(want)  # strict: the keys the model loads, no more, no fewer
        for key, value in want.items():
            assert_close_relative(got[key], value, rel=1e-6)
    # accelerate's own load_state takes the two EMAs, put side by side as save_state names them
    from accelerate import Accelerator

    side_by_side = tmp_path / "ema_state"
    side_by_side.mkdir()
    for name in ("model", "model_1"):
        shutil.copy(tmp_path / "ema" / name / f"{name}.safetensors", side_by_side / f"{name}.safetensors")

    class Generator(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))

    class Discriminator(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))

    accelerator = Accelerator(cpu=True)
    g, d = accelerator.prepare(Generator(), Discriminator())
    accelerator.load_state(str(side_by_side))
    for name, module in (("model", g), ("model_1", d)):
        for key, value in load_file(side_by_side / f"{name}.safetensors").items():
            assert torch.equal(module.state_dict()[key], value), (name, key)
    again = runner.invoke(app, ["accumulate", str(work / "ckpts"), "--decay", "0.8", "--out", str(tmp_path / "ema")])
    assert again.exit_code == 0 and "nothing new" in again.output, again.output
    second = work / "ckpts" / "checkpoints" / "checkpoint_0" / "model_1.safetensors"
    one = runner.invoke(app, ["consolidate", str(second), "--out", str(tmp_path / "m1.safetensors")])
    assert one.exit_code == 0, one.output


def test_a_checkpoint_folder_with_a_model_one_folder_down(tmp_path):
    states = {}
    for step in (2, 4, 6):
        ckpt = tmp_path / "out" / f"checkpoint-{step}"
        for part, seed in (("unet", step), ("unet_ema", 100 + step)):
            (ckpt / part).mkdir(parents=True)
            save_file(_weights(seed), str(ckpt / part / "diffusion_pytorch_model.safetensors"))
            (ckpt / part / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
        (ckpt / "random_states_0.pkl").write_bytes(b"x")
        states[step] = _weights(step)
    (tmp_path / "out" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", "unet": []}')
    (tmp_path / "out" / "unet").mkdir()
    save_file(_weights(999), str(tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors"))
    data = _accumulate(tmp_path / "out", tmp_path / "ema")
    assert list(data["components"]) == ["unet"] and [c["step"] for c in data["folded"]] == [2, 4, 6]
    assert any("unet_ema" in n and "an EMA the trainer kept" in n for n in data["notes"]), data["notes"]
    got = _ema_file(tmp_path / "ema" / "unet", tmp_path)
    want = reference_ema([states[s] for s in (2, 4, 6)], [2, 4, 6], 0.8)
    for key, value in want.items():
        assert_close_relative(got[key], value, rel=1e-6)
    chosen = _accumulate(tmp_path / "out", tmp_path / "ema2", "--component", "unet_ema")
    assert chosen["folded"] and (tmp_path / "ema2" / "unet_ema" / "ema-ckpt.json").is_file()
    listing = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "out"), "--json"]).stdout)
    rows = {Path(e["path"]).name: e for e in listing["entries"]}
    assert rows["unet"]["taken"] is False and "final export" in rows["unet"]["why"]
    assert {c["name"] for c in rows["checkpoint-4"]["components"]} == {"unet", "unet_ema"}


def _items(name: str) -> list[dict]:
    return sorted(_producer(name)["checkpoints"].values(), key=lambda i: i["optimizer_step"])


def _assert_ema_of(got: dict[str, torch.Tensor], name: str, key: str = "oracle") -> None:
    items = _items(name)
    want = reference_ema([load_file(FIXTURES / name / i[key]) for i in items], [i["optimizer_step"] for i in items],
                         0.8)
    assert sorted(got) == sorted(want)
    for k, value in want.items():
        assert_close_relative(got[k], value, rel=1e-6)


def test_diffusers_text_to_image_with_ema_needs_no_flag_and_loads_with_from_pretrained(tmp_path):
    from diffusers import UNet2DConditionModel

    work = tmp_path / "set"
    shutil.copytree(FIXTURES / "diffusers-t2i-ema", work)
    data = _accumulate(work / "ckpts", tmp_path / "ema")
    assert list(data["components"]) == ["unet"]
    assert [c["step"] for c in data["folded"]] == [i["optimizer_step"] for i in _items("diffusers-t2i-ema")]
    notes = " ".join(data["notes"])
    assert "an EMA the trainer kept (unet_ema)" in notes and "part of the final export" in notes
    out = tmp_path / "ema" / "unet"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                     "ema-ckpt.json"]
    _model, info = UNet2DConditionModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
    _assert_ema_of(load_file(out / "diffusion_pytorch_model.safetensors"), "diffusers-t2i-ema")
    # The trainer's own EMA, when chosen, is averaged like any component.
    _accumulate(work / "ckpts", tmp_path / "ema_of_ema", "--component", "unet_ema")
    _assert_ema_of(load_file(tmp_path / "ema_of_ema" / "unet_ema" / "diffusion_pytorch_model.safetensors"),
                   "diffusers-t2i-ema", "oracle_ema")


def test_a_components_ema_folded_in_two_runs_equals_one_run(tmp_path):
    work = tmp_path / "set"
    shutil.copytree(FIXTURES / "diffusers-t2i-ema", work)
    newest = work / "ckpts" / "checkpoint-8"
    newest.rename(tmp_path / "later")
    _accumulate(work / "ckpts", tmp_path / "ema")
    (tmp_path / "later").rename(newest)
    second = _accumulate(work / "ckpts", tmp_path / "ema")
    assert [c["step"] for c in second["folded"]] == [8]
    _accumulate(work / "ckpts", tmp_path / "once")
    assert (tmp_path / "ema" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        tmp_path / "once" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()


def test_diffusers_lora_checkpoints_with_the_final_adapter_beside_them(tmp_path):
    work = tmp_path / "set"
    shutil.copytree(FIXTURES / "diffusers-t2i-lora", work)
    data = _accumulate(work / "ckpts", tmp_path / "ema")
    assert [c["step"] for c in data["folded"]] == [2, 4, 6]
    assert any("pytorch_lora_weights.safetensors" in n and "final export" in n for n in data["notes"])
    _assert_ema_of(_ema_file(tmp_path / "ema", tmp_path), "diffusers-t2i-lora")
    # The EMA adapter loads where the script's adapters load: diffusers' own load_lora_weights.
    from diffusers import StableDiffusionPipeline

    adapter = tmp_path / "adapter" / "pytorch_lora_weights.safetensors"
    assert runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(adapter)]).exit_code == 0
    pipe = StableDiffusionPipeline.from_pretrained(work / "pretrained", safety_checker=None)
    pipe.load_lora_weights(adapter.parent)
    loaded = {k.replace(".default_0", ""): v for k, v in pipe.unet.state_dict().items() if ".lora_" in k}
    saved = {k.removeprefix("unet."): v for k, v in load_file(adapter).items()}
    assert sorted(loaded) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value)


RECORD_SETS = {
    # set: the folder given
    "kohya-metadata": "output",
    "litgpt-pretrain": "out",
    "litgpt-iter-names": "out",
    "composer-style": "checkpoints",
    "olmo-core-style": "ckpts",
    "lightning-gan": "ckpts",
}


def _distinct(name: str) -> list[dict]:
    """The set's checkpoints an EMA folds: one per optimizer step (copies and exports count once)."""
    by_step = {}
    for _rel, info in sorted(_producer(name)["checkpoints"].items()):
        if info.get("optimizer_step") is not None and info.get("oracle"):
            by_step.setdefault(info["optimizer_step"], info)
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("name", sorted(RECORD_SETS))
def test_a_trainers_own_records_place_its_checkpoints_with_no_flag(name, tmp_path):
    work = tmp_path / name
    shutil.copytree(FIXTURES / name, work, symlinks=True)
    data = _accumulate(work / RECORD_SETS[name], tmp_path / "ema")
    items = _distinct(name)
    assert [c["step"] for c in data["folded"]] == [i["optimizer_step"] for i in items]
    out = tmp_path / "ema" / "".join(data["components"])  # a model in each checkpoint folder: OUT/<its name>
    got = load_file(next(out.glob("*.safetensors"))) if list(out.glob("*.safetensors")) else _ema_file(out, tmp_path)
    want = reference_ema([load_file(work / i["oracle"]) for i in items], [i["optimizer_step"] for i in items], 0.8)
    assert sorted(got) == sorted(want)  # the names the trainer's own loader loads (Composer's module. kept)
    for key, value in want.items():
        if value.is_floating_point():
            assert_close_relative(got[key], value.to(torch.float64), rel=1e-3 if value.dtype == torch.float16
                                  else 1e-6)


def test_mmengine_checkpoints_are_refused_out_loud(tmp_path):
    """mmengine pickles ``builtins.getattr`` in its message hub: a function is never read as data."""
    result = runner.invoke(app, ["accumulate", str(FIXTURES / "mmengine-runner" / "work_dir"), "--decay", "0.8",
                                 "--out", str(tmp_path / "ema")])
    assert result.exit_code == 3, result.output
    assert "builtins.getattr" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "ema").exists()


def test_watch_stages_whole_checkpoints_of_components_and_equals_accumulate(tmp_path):
    """watch stages each checkpoint folder whole (its unet/, its step records), never a component
    file alone, and writes the bytes accumulate writes."""
    live = tmp_path / "out"
    shutil.copytree(FIXTURES / "diffusers-t2i-ema" / "ckpts", live)
    done = ema_ckpt.watch(live, decay=0.8, out=tmp_path / "watched", stop_when_idle=0.5, interval=0.2)
    assert done.step == 8 and not done.errors, done
    _accumulate(live, tmp_path / "once")
    name = "diffusion_pytorch_model.safetensors"
    assert (tmp_path / "watched" / "unet" / name).read_bytes() == (tmp_path / "once" / "unet" / name).read_bytes()


def test_a_trainers_second_nested_model_is_averaged_not_dropped(tmp_path):
    """accelerate's save_state of two FSDP models: pytorch_model_fsdp_0/ and pytorch_model_fsdp_1/,
    each a DCP checkpoint; each gets its own EMA, the second never dropped with exit 0."""
    for step in (2, 4):
        ckpt = tmp_path / "out" / f"checkpoint-{step}"
        write_dcp(ckpt / "pytorch_model_fsdp_0", {"model.w": torch.full((3,), float(step))})
        write_dcp(ckpt / "pytorch_model_fsdp_1", {"model.v": torch.full((2,), float(10 * step))})
    data = _accumulate(tmp_path / "out", tmp_path / "ema", "--step-regex", r"checkpoint-(\d+)")
    assert sorted(data["components"]) == ["pytorch_model_fsdp_0", "pytorch_model_fsdp_1"]
    first = _ema_file(tmp_path / "ema" / "pytorch_model_fsdp_0", tmp_path)
    second = _ema_file(tmp_path / "ema" / "pytorch_model_fsdp_1", tmp_path)
    assert_close_relative(first["w"], torch.full((3,), 0.8 ** 2 * 2 + (1 - 0.8 ** 2) * 4, dtype=torch.float64),
                          rel=1e-6)
    assert_close_relative(second["v"], torch.full((2,), 0.8 ** 2 * 20 + (1 - 0.8 ** 2) * 40, dtype=torch.float64),
                          rel=1e-6)
