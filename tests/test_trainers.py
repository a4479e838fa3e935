"""Checkpoints as real trainers save them, read with no flag and checked against each trainer's own tools.

The fixtures in ``tests/fixtures/trainers`` were written once by the trainers' own saving code
(``make fixtures``; versions and commands in their README): accelerate and the Hugging Face
Trainer (FSDP and DeepSpeed), Lightning (FSDP and DeepSpeed), torchtitan's
``CheckpointManager`` and megatron-core's ``dist_checkpointing``. Beside each set,
``oracle/`` holds what the trainer's own converter gives for each checkpoint
(``merge_fsdp_weights``, ``zero_to_fp32``, Lightning's consolidation, ``dcp_to_torch_save``).
Each test reads the fixtures in place through a copy, so nothing committed is ever written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.cli._flags import cli_text
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.commands.inspect import inspect_checkpoint
from ema_ckpt.discovery import discover
from ema_ckpt.errors import IncompatibleCheckpointError, UnplacedCheckpointError
from tests.ema_reference import assert_close_relative
from tests.torchrun import torchrun

FIXTURES = Path(__file__).parent / "fixtures" / "trainers"
runner = CliRunner()


def producer(name: str) -> dict:
    return json.loads((FIXTURES / name / "producer.json").read_text())


def checkpoints_of(name: str) -> list[tuple[str, dict]]:
    """(relative path, record with its ``oracle``) of each checkpoint, oldest first."""
    doc = producer(name)
    items = []
    for rel, info in doc["checkpoints"].items():
        path = info.get("oracle") or doc.get("oracle", {}).get(rel)
        if path is not None:
            items.append((rel, info | {"oracle": path}))
    return sorted(items, key=lambda item: item[1]["optimizer_step"])


def folder_of(name: str) -> Path:
    """The folder a set's trainer saved into (``ckpts/``, or the set folder itself)."""
    return FIXTURES / name / "ckpts" if (FIXTURES / name / "ckpts").is_dir() else FIXTURES / name


@pytest.fixture
def copy_of(tmp_path):
    """A private copy of a fixture set (commands write their outputs beside the inputs)."""

    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(FIXTURES / name, target)
        return target

    return make


def oracle(name: str, info: dict) -> dict[str, torch.Tensor]:
    state = load_file(FIXTURES / name / info["oracle"])
    for alias, owner in info.get("oracle_aliases", {}).items():
        state[alias] = state[owner]
    return state


def reference_ema(
    states: list[dict[str, torch.Tensor]], steps: list[int], decay: float
) -> dict[str, torch.Tensor]:
    """ema₁ = θ₁, emaₖ = β^Δ·emaₖ₋₁ + (1 − β^Δ)·θₖ in float64, Δ the steps between checkpoints."""
    ema = {k: v.double() for k, v in states[0].items()}
    for prev, step, state in zip(steps, steps[1:], states[1:], strict=False):
        keep = decay ** (step - prev)
        ema = {k: keep * ema[k] + (1 - keep) * state[k].double() for k in ema}
    return ema


def consolidated_ema(ema: Path, want: dict[str, torch.Tensor], tmp_path: Path) -> dict[str, torch.Tensor]:
    """The EMA at ``ema`` consolidated to safetensors, checked key by key against a float64 ``want``."""
    consolidate(ema, tmp_path / "ema.safetensors")
    got = load_file(tmp_path / "ema.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key], value, rel=1e-6)
    return got


def assert_loads_on_ranks(ckpt: Path, want: dict[str, torch.Tensor], tmp_path: Path, world: int = 2) -> None:
    """``dcp.load`` on ``world`` ranks, each into its rows of dim-0-sharded DTensors, gives ``want``."""
    expected = tmp_path / "expected.safetensors"
    save_file({k: v.float().contiguous() for k, v in want.items()}, expected)
    script = Path(__file__).parent / "producers" / "dcp_load_ranks.py"
    proc = torchrun([str(script), "--ckpt", str(ckpt), "--expected", str(expected)], nproc=world)
    assert proc.returncode == 0 and "OK:" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return config, LlamaForCausalLM


def assert_loads_with_from_pretrained(folder: Path, weights: Path, *, tie: bool) -> None:
    """``from_pretrained`` takes the file with no missing or unexpected key; tied weights stay tied."""
    config, model_class = _llama(tie)
    if not (folder / "config.json").exists():
        config.save_pretrained(folder)
    if weights != folder / "model.safetensors":
        shutil.copy(weights, folder / "model.safetensors")
    model, info = model_class.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = load_file(folder / "model.safetensors")
    for key, value in state.items():
        assert torch.equal(model.state_dict()[key], value), key
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


FSDP_SETS = ["accelerate-fsdp1", "accelerate-fsdp2", "hf-trainer-fsdp"]
DEEPSPEED_SETS = ["hf-trainer-zero2-bf16", "hf-trainer-zero3-final"]


@pytest.mark.parametrize("name", FSDP_SETS + DEEPSPEED_SETS)
def test_every_checkpoint_is_found_at_its_optimizer_step(name):
    folder = FIXTURES / name / "ckpts"
    found = discover([folder])
    want = [(rel, info["optimizer_step"]) for rel, info in checkpoints_of(name) if rel != "ckpts"]
    assert [(c.path.relative_to(FIXTURES / name).as_posix(), c.step) for c in found.checkpoints] == want
    for checkpoint in found.checkpoints:
        assert checkpoint.step_source in (
            "trainer_state.json global_step",
            "optimizer step counter in optimizer_0/",
        )


@pytest.mark.parametrize("name", FSDP_SETS + DEEPSPEED_SETS)
def test_consolidate_equals_the_trainers_own_converter(name, tmp_path):
    for rel, info in checkpoints_of(name):
        out = tmp_path / f"{Path(rel).name}.safetensors"
        consolidate(FIXTURES / name / rel, out)
        got, want = load_file(out), oracle(name, info)
        assert sorted(got) == sorted(want), rel
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (rel, key)


def test_accelerate_checkpoint_folders_are_one_checkpoint_each():
    folder = FIXTURES / "accelerate-fsdp2" / "ckpts" / "checkpoints" / "checkpoint_1"
    report = inspect_checkpoint(folder)
    assert report.format_name == "dcp" and report.trainer == "accelerate"
    assert report.model_path == folder / "pytorch_model_fsdp_0"
    assert (report.step, report.step_source) == (3, "optimizer step counter in optimizer_0/")
    assert report.container == "model."
    result = runner.invoke(app, ["inspect", str(folder)], terminal_width=200)
    assert result.exit_code == 0 and "3 (from optimizer step counter in optimizer_0/)" in result.output
    # accelerate's own record counts micro-batches and restarts every epoch: never the step.
    assert (
        producer("accelerate-fsdp2")["checkpoints"]["ckpts/checkpoints/checkpoint_2"][
            "accelerator.step_at_save"
        ]
        == 4
    )
    # The nested model folder given by itself takes its step from the trainer folder around it.
    nested = inspect_checkpoint(folder / "pytorch_model_fsdp_0")
    assert (nested.step, nested.step_source) == (3, "optimizer step counter in optimizer_0/")
    # The project folder (checkpoints/ inside) and the checkpoints folder are both understood.
    assert [c.step for c in discover([FIXTURES / "accelerate-fsdp2" / "ckpts"]).checkpoints] == [2, 3, 6]


@pytest.mark.parametrize("name", FSDP_SETS + DEEPSPEED_SETS)
def test_accumulate_with_no_flag_matches_a_float64_ema_and_loads_with_from_pretrained(
    name, copy_of, tmp_path
):
    work = copy_of(name)
    result = runner.invoke(
        app, ["accumulate", str(work / "ckpts"), "--decay", "0.8", "--out", str(tmp_path / "ema"), "--json"]
    )
    assert result.exit_code == 0, result.output
    items = [(rel, info) for rel, info in checkpoints_of(name) if rel != "ckpts"]
    want = reference_ema(
        [oracle(name, info) for _, info in items], [info["optimizer_step"] for _, info in items], 0.8
    )
    out = tmp_path / "ema.safetensors"
    assert runner.invoke(app, ["consolidate", str(tmp_path / "ema"), "--out", str(out)]).exit_code == 0
    got = load_file(out)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key], value, rel=1e-6)
    tie = name == "hf-trainer-zero3-final"
    target = tmp_path / "hf"
    target.mkdir()
    config = next((p for p in (work / "ckpts").rglob("config.json")), None)
    if config is not None:
        shutil.copy(config, target / "config.json")
    assert_loads_with_from_pretrained(target, out, tie=tie)


def test_the_trainers_final_save_beside_its_last_checkpoint_counts_once(copy_of):
    work = copy_of("hf-trainer-zero3-final")
    result = runner.invoke(app, ["accumulate", str(work / "ckpts"), "--decay", "0.9"])
    assert result.exit_code == 0, result.output
    assert "global_step5" in result.output and "same weights as" in result.output
    again = runner.invoke(app, ["accumulate", str(work / "ckpts"), "--decay", "0.9"])
    assert again.exit_code == 0 and "up to date at step 5" in again.output


def test_two_saves_of_one_step_with_other_weights_are_refused_naming_both(copy_of):
    work = copy_of("hf-trainer-fsdp")
    other = work / "ckpts" / "checkpoint-6-rerun"
    shutil.copytree(work / "ckpts" / "checkpoint-4", other)
    state = json.loads((other / "trainer_state.json").read_text())
    (other / "trainer_state.json").write_text(json.dumps(state | {"global_step": 6}))
    with pytest.raises(
        IncompatibleCheckpointError,
        match=r"checkpoint-6 and .*checkpoint-6-rerun both hold step 6 with different weights",
    ):
        discover([work / "ckpts"])
    result = runner.invoke(app, ["accumulate", str(work / "ckpts"), "--decay", "0.9"])
    assert result.exit_code == 4 and "--skip" in result.output
    result = runner.invoke(app, ["accumulate", str(work / "ckpts"), "--decay", "0.9", "--skip", str(other)])
    assert result.exit_code == 0, result.output


def test_zero2_folder_says_which_weights_are_read():
    folder = FIXTURES / "hf-trainer-zero2-bf16" / "ckpts" / "checkpoint-4"
    report = inspect_checkpoint(folder)
    assert report.format_name == "deepspeed" and (report.step, report.step_source) == (
        4,
        "trainer_state.json global_step",
    )
    assert report.dtypes == {"float32": len(report.tensors)}  # the fp32 master weights
    assert any(
        "model.safetensors" in n and "ignored" in n and str(folder / "model.safetensors") in n
        for n in report.notes
    ), report.notes
    bf16 = inspect_checkpoint(folder / "model.safetensors")
    assert bf16.format_name == "safetensors" and set(bf16.dtypes) == {"bfloat16"}


def test_a_half_written_deepspeed_tag_is_skipped_with_a_note(copy_of):
    work = copy_of("hf-trainer-zero2-bf16")
    half = work / "ckpts" / "checkpoint-8"
    shutil.copytree(work / "ckpts" / "checkpoint-6", half)
    (half / "latest").unlink()
    shutil.move(half / "global_step6", half / "global_step8")
    next((half / "global_step8").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    found = discover([work / "ckpts"])
    assert [c.step for c in found.checkpoints] == [2, 4, 6]
    assert any("checkpoint-8" in n and "no 'latest' yet" in n for n in found.notes), found.notes


# --- Lightning ------------------------------------------------------------------------------


def lightning_module():
    import pytorch_lightning as pl
    from torch import nn

    class TinyLitModule(pl.LightningModule):  # the producer's module (producer.json module_class_source)
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.GELU(), nn.Linear(10, 3))

    return TinyLitModule()


LIGHTNING_SETS = ["lightning-fsdp", "lightning-deepspeed3"]


@pytest.mark.parametrize("name", LIGHTNING_SETS)
def test_lightning_keeps_the_modules_own_model_attribute(name, tmp_path):
    for rel, info in checkpoints_of(name):
        out = tmp_path / f"{rel}.safetensors"
        result = consolidate(FIXTURES / name / rel, out)
        got, want = load_file(out), oracle(name, info)
        assert sorted(got) == sorted(want) and all(k.startswith("model.") for k in got), rel
        for key, value in want.items():
            assert torch.equal(got[key], value), (rel, key)
        lightning_module().load_state_dict(got, strict=True)
        # FSDP saves {"model": module.state_dict()}: that container level goes, self.model stays.
        assert result.renamed_prefix == ("model." if name == "lightning-fsdp" else None)


@pytest.mark.parametrize("name", LIGHTNING_SETS)
def test_lightning_accumulate_needs_no_flag(name, copy_of, tmp_path):
    work = copy_of(name)
    result = runner.invoke(app, ["accumulate", str(work), "--decay", "0.8", "--out", str(tmp_path / "ema")])
    assert result.exit_code == 0, result.output
    items = checkpoints_of(name)
    found = discover([work])
    assert [c.step for c in found.checkpoints] == [info["optimizer_step"] for _, info in items]
    want = reference_ema(
        [oracle(name, info) for _, info in items], [info["optimizer_step"] for _, info in items], 0.8
    )
    got = consolidated_ema(tmp_path / "ema", want, tmp_path)
    lightning_module().load_state_dict(got, strict=True)


# --- torchtitan -----------------------------------------------------------------------------


def test_torchtitan_steps_consolidate_to_dcp_to_torch_save(tmp_path):
    for rel, info in checkpoints_of("torchtitan"):
        out = tmp_path / f"{rel}.safetensors"
        consolidate(FIXTURES / "torchtitan" / rel, out)
        got, want = load_file(out), oracle("torchtitan", info)
        assert sorted(got) == sorted(want), rel  # model keys only, at the top level as torchtitan saves them
        for key, value in want.items():
            assert torch.equal(got[key], value), (rel, key)


def test_torchtitan_ema_loads_with_dcp_load_under_torchtitans_names(copy_of, tmp_path):
    import torch.distributed.checkpoint as dcp

    work = copy_of("torchtitan")
    result = runner.invoke(app, ["accumulate", str(work), "--decay", "0.8", "--out", str(tmp_path / "ema")])
    assert result.exit_code == 0, result.output
    items = checkpoints_of("torchtitan")
    want = reference_ema(
        [oracle("torchtitan", info) for _, info in items], [info["optimizer_step"] for _, info in items], 0.8
    )
    # What torchtitan's CheckpointManager does for a model-only load: dcp.load into the model's keys.
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in want.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ema"), no_dist=True)
    for key, value in want.items():
        assert_close_relative(state[key], value, rel=1e-6)
    # On 2 ranks, each reading its own rows, as torchtitan resumes under FSDP2; and resharded for 3.
    assert_loads_on_ranks(tmp_path / "ema", want, tmp_path)
    assert (
        runner.invoke(
            app, ["reshard", str(tmp_path / "ema"), "--world-size", "3", "--out", str(tmp_path / "ema-3")]
        ).exit_code
        == 0
    )
    again = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(again, checkpoint_id=str(tmp_path / "ema-3"), no_dist=True)
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_torchtitan_last_save_in_hf_is_refused_with_the_way_out(copy_of, tmp_path):
    work = copy_of("torchtitan-last-hf")
    for flags in ([], ["--allow-new-keys"], ["--dry-run"], ["--allow-new-keys", "--dry-run"]):
        result = runner.invoke(
            app,
            ["accumulate", str(work), "--decay", "0.8", "--out", str(tmp_path / "ema"), *flags],
            terminal_width=300,
        )
        assert result.exit_code == 4, (flags, result.output)
        assert "step-5" in result.output and "--skip" in result.output, result.output
        assert not (tmp_path / "ema").exists()
    result = runner.invoke(
        app,
        [
            "accumulate",
            str(work),
            "--decay",
            "0.8",
            "--out",
            str(tmp_path / "ema"),
            "--skip",
            str(work / "step-5"),
        ],
    )
    assert result.exit_code == 0, result.output
    items = [item for item in checkpoints_of("torchtitan-last-hf") if item[0] != "step-5"]
    want = reference_ema([oracle("torchtitan-last-hf", info) for _, info in items], [2, 4], 0.8)
    consolidated_ema(tmp_path / "ema", want, tmp_path)


# --- Megatron -------------------------------------------------------------------------------


MEGATRON_SETS = ["megatron-torch-dist", "megatron-torch-dist-dp2", "megatron-torch-dist-tp2"]


def megatron_oracle(name: str, rel: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under its own (layer-stacked) keys, from ``dcp_to_torch_save``."""
    return load_file(FIXTURES / name / "oracle" / "checkpoint-keys" / f"{rel}.safetensors")


@pytest.mark.parametrize("name", MEGATRON_SETS)
def test_megatron_torch_dist_reads_and_averages(name, copy_of, tmp_path):
    items = checkpoints_of(name)
    for rel, info in items:
        consolidate(FIXTURES / name / rel, tmp_path / f"{rel}.safetensors")
        got, want = load_file(tmp_path / f"{rel}.safetensors"), megatron_oracle(name, rel)
        assert sorted(got) == sorted(want), rel
        for key, value in want.items():
            assert torch.equal(got[key], value), (rel, key)
        # The layer-stacked keys hold each layer's module weights (megatron's own load of the same files).
        per_layer = oracle(name, info)
        assert torch.equal(
            got["decoder.layers.self_attention.linear_proj.weight"][1],
            per_layer["decoder.layers.1.self_attention.linear_proj.weight"],
        )
    work = copy_of(name)
    result = runner.invoke(
        app, ["accumulate", str(work), "--decay", "0.8", "--out", str(tmp_path / "ema"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert [c.step for c in discover([work]).checkpoints] == [info["optimizer_step"] for _, info in items]
    want = reference_ema(
        [megatron_oracle(name, rel) for rel, _ in items], [info["optimizer_step"] for _, info in items], 0.8
    )
    got = consolidated_ema(tmp_path / "ema", want, tmp_path)
    if name == "megatron-torch-dist-tp2":
        assert_loads_on_ranks(tmp_path / "ema", want, tmp_path)


def test_a_trainers_bf16_safetensors_keeps_its_names():
    folder = FIXTURES / "hf-trainer-zero2-bf16" / "ckpts" / "checkpoint-4"
    report = inspect_checkpoint(folder / "model.safetensors")
    assert report.container is None and "model.embed_tokens.weight" in {t.key for t in report.tensors}


# --- step records that are missing, late or overruled ----------------------------------------


def test_an_accelerate_folder_without_a_step_record_waits_instead_of_using_its_save_counter(copy_of):
    work = copy_of("accelerate-fsdp2")
    checkpoints = work / "ckpts" / "checkpoints"
    shutil.rmtree(checkpoints / "checkpoint_2" / "optimizer_0")  # e.g. saved without the optimizer
    (checkpoints / "checkpoint_1" / "optimizer_0" / ".metadata").unlink()  # still being written
    # A folder like the others with no step record fails the run (folding the rest would be a
    # partial result), naming it and the ways through.
    with pytest.raises(UnplacedCheckpointError, match=r"checkpoint_2: no step record .* counts saves, not steps"):
        discover([checkpoints])
    found = discover([checkpoints], skip=[checkpoints / "checkpoint_2"])
    assert [(c.path.name, c.step) for c in found.checkpoints] == [("checkpoint_0", 2)]
    assert any("checkpoint_1" in n and "optimizer_0/ is not complete yet" in n for n in found.notes), (
        found.notes
    )
    # Told so, the user can take the names as steps.
    forced = discover([checkpoints], step_regex=r"checkpoint_(\d+)")
    assert [c.step for c in forced.checkpoints] == [0, 1, 2]
    assert all(c.step_source.startswith("step_regex") and c.step_source.mentions == ("step_regex",)
               for c in forced.checkpoints)
    assert all(cli_text(c.step_source).startswith("--step-regex") for c in forced.checkpoints)


def test_a_step_regex_wins_over_a_trainers_record(copy_of):
    work = copy_of("hf-trainer-zero2-bf16")
    found = discover([work / "ckpts"], step_regex=r"checkpoint-(\d+)")
    assert [cli_text(c.step_source) for c in found.checkpoints] == [
        "--step-regex on the folder name checkpoint-2",
        "--step-regex on the folder name checkpoint-4",
        "--step-regex on the folder name checkpoint-6",
    ]
    assert found.checkpoints[0].step_source == "step_regex on the folder name checkpoint-2"


def test_skip_takes_the_nested_model_folder_an_error_names(copy_of, tmp_path):
    work = copy_of("accelerate-fsdp2")
    checkpoints = work / "ckpts" / "checkpoints"
    found = discover(
        [checkpoints], skip=[checkpoints / "checkpoint_1" / "pytorch_model_fsdp_0", tmp_path / "nope"]
    )
    assert [c.path.name for c in found.checkpoints] == ["checkpoint_0", "checkpoint_2"]
    assert any("nope" in n and "no such checkpoint was found" in n for n in found.notes)


def test_a_checkpoint_folded_then_written_again_is_a_rollback_never_folded_on(copy_of, tmp_path):
    work = copy_of("hf-trainer-fsdp")
    ckpts = work / "ckpts"
    first = runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.9", "--out", str(tmp_path / "ema")])
    assert first.exit_code == 0, first.output
    state = json.loads((ckpts / "checkpoint-2" / "trainer_state.json").read_text())
    (ckpts / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state | {"global_step": 8}))
    again = runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.9", "--out", str(tmp_path / "ema")])
    assert again.exit_code == 4, again.output
    assert f"{ckpts / 'checkpoint-2'} (step 2) was folded into" in again.output
    assert "has been written again since" in again.output and "Pass --restart" in again.output


def test_verify_checks_a_deepspeed_tags_own_crcs(copy_of):
    from ema_ckpt.commands.verify import verify

    work = copy_of("hf-trainer-zero3-final")
    folder = work / "ckpts" / "checkpoint-4"
    result = verify(folder)
    assert result.ok and "file CRC-32s" in result.checks, result.problems
    optim = next((folder / "global_step4").glob("*optim_states.pt"))
    raw = bytearray(optim.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    optim.write_bytes(bytes(raw))
    assert not verify(folder).ok
