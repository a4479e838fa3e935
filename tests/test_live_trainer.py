"""A cron job beside a live trainer: rollbacks, saves in progress, nested outputs, edited manifests.

Every case here is a way a trainer (or an operator) can change the checkpoint folder between two
cron runs; none may end in a wrong EMA published with exit 0.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.errors import IncompatibleCheckpointError
from tests.dcp_helpers import write_dcp

runner = CliRunner()


def _save(folder: Path, step: int, seed: int) -> Path:
    torch.manual_seed(seed)
    return write_dcp(folder / f"step_{step}", {"model.w": torch.randn(8, 4), "model.b": torch.randn(4)})


def _run(ckpts: Path, out: Path, *flags: str):
    return runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.9", "--out", str(out), *flags],
                         terminal_width=300)


@pytest.mark.parametrize("rewritten", [[300, 400, 500], [300]], ids=["all-rewritten", "one-rewritten"])
def test_a_rollback_at_the_same_paths_is_refused_naming_the_first_rewritten_step(tmp_path, rewritten):
    ckpts = tmp_path / "ckpts"
    for step in (100, 200, 300, 400, 500):
        _save(ckpts, step, seed=step)
    assert _run(ckpts, tmp_path / "ema").exit_code == 0
    for step in (300, 400, 500):  # the trainer diverged: it goes back to 200 and saves again
        shutil.rmtree(ckpts / f"step_{step}")
    for step in rewritten:
        _save(ckpts, step, seed=step + 1)
    _save(ckpts, 600, seed=600)
    for flags in ([], ["--dry-run"]):
        result = _run(ckpts, tmp_path / "ema", *flags)
        assert result.exit_code == 4, result.output
        assert f"{ckpts / 'step_300'} (step 300) was folded into {tmp_path / 'ema'}" in result.output
        assert "has been written again since" in result.output and "Pass --restart to rebuild" in result.output
    gone = {400, 500} - set(rewritten)
    if gone:
        assert "steps 400, 500) cannot be folded again: their share of the EMA is lost" in result.output
    restarted = _run(ckpts, tmp_path / "ema", "--restart")
    assert restarted.exit_code == 0, restarted.output
    assert "EMA now at step 600" in restarted.output


def test_checkpoints_deleted_by_retention_are_no_rollback(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (100, 200, 300):
        _save(ckpts, step, seed=step)
    assert _run(ckpts, tmp_path / "ema").exit_code == 0
    shutil.rmtree(ckpts / "step_100")
    shutil.rmtree(ckpts / "step_200")
    _save(ckpts, 400, seed=400)
    result = _run(ckpts, tmp_path / "ema")
    assert result.exit_code == 0 and "folded step 400" in result.output, result.output


def test_the_library_says_the_same(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (1, 2):
        _save(ckpts, step, seed=step)
    accumulate(ckpts, decay=0.9, out=tmp_path / "ema")
    shutil.rmtree(ckpts / "step_2")
    _save(ckpts, 2, seed=99)
    with pytest.raises(IncompatibleCheckpointError) as caught:
        accumulate(ckpts, decay=0.9, out=tmp_path / "ema")
    assert caught.value.remedy == "restart" and "restart=True" in str(caught.value)


FIXTURES = Path(__file__).parent / "fixtures" / "trainers"


def _consolidated(ema: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    assert runner.invoke(app, ["consolidate", str(ema), "--out", str(out)]).exit_code == 0
    return load_file(out)


def test_a_trainer_folder_mid_save_is_skipped_and_folded_once_finished(tmp_path):
    """The Trainer under ZeRO writes config.json and its bf16 model.safetensors first, the fp32 tag and
    trainer_state.json last: a cron run in between must fold nothing of it."""
    ckpts = tmp_path / "ckpts"
    shutil.copytree(FIXTURES / "hf-trainer-zero2-bf16" / "ckpts", ckpts)
    finished = tmp_path / "checkpoint-6-finished"
    shutil.move(ckpts / "checkpoint-6", finished)
    (ckpts / "checkpoint-6").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(finished / name, ckpts / "checkpoint-6" / name)
    result = _run(ckpts, tmp_path / "ema")
    assert result.exit_code == 0 and "EMA now at step 4" in result.output, result.output
    assert "checkpoint-6: no trainer_state.json yet (the Trainer writes it last: a save in progress?)" in result.output
    shutil.rmtree(ckpts / "checkpoint-6")
    shutil.move(finished, ckpts / "checkpoint-6")
    again = _run(ckpts, tmp_path / "ema")
    assert again.exit_code == 0 and "folded step 6" in again.output, again.output
    assert _run(ckpts, tmp_path / "ema-once").exit_code == 0
    incremental, once = (_consolidated(tmp_path / n, tmp_path / f"{n}.safetensors") for n in ("ema", "ema-once"))
    assert sorted(incremental) == sorted(once) and all(torch.equal(incremental[k], once[k]) for k in once)


def test_a_lone_trainer_folder_holding_the_trainers_files_waits_for_its_state(tmp_path):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    shutil.copytree(FIXTURES / "hf-trainer-zero2-bf16" / "ckpts" / "checkpoint-2", ckpts / "checkpoint-2")
    (ckpts / "checkpoint-2" / "trainer_state.json").unlink()
    result = _run(ckpts, tmp_path / "ema")
    assert result.exit_code == 3 and "no trainer_state.json yet" in result.output, result.output


def test_an_accelerate_folder_without_its_random_states_is_mid_save(tmp_path):
    ckpts = tmp_path / "ckpts"
    shutil.copytree(FIXTURES / "accelerate-plain" / "ckpts" / "checkpoints", ckpts)
    for rng in (ckpts / "checkpoint_2").glob("random_states_*.pkl"):
        rng.unlink()
    result = _run(ckpts, tmp_path / "ema")
    assert result.exit_code == 0 and "EMA now at step 3" in result.output, result.output
    assert "checkpoint_2: no random_states_0.pkl yet (accelerate's save_state writes it last" in result.output


def test_outputs_never_nest_and_a_swap_never_deletes_what_it_did_not_write(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        _save(ckpts, step, seed=step)
    ema = tmp_path / "ema"
    assert _run(ckpts, ema).exit_code == 0
    before = sorted(p.name for p in ema.iterdir())
    power = runner.invoke(app, ["accumulate", str(ckpts), "--sigma-rel", "0.1", "--out", str(ema)], terminal_width=300)
    assert power.exit_code == 2 and f"{ema / 'sigma_rel_0.1'} is inside the ema-ckpt output {ema}" in power.output
    assert sorted(p.name for p in ema.iterdir()) == before
    inside = runner.invoke(app, ["consolidate", str(ckpts / "step_100"), "--out", str(ema / "x.safetensors")],
                           terminal_width=300)
    assert inside.exit_code == 2 and "is inside the ema-ckpt output" in inside.output
    (ema / "notes").mkdir()  # something of the user's inside the EMA's folder
    _save(ckpts, 300, seed=300)
    kept = _run(ckpts, ema)
    assert kept.exit_code == 2 and f"{ema} holds the directory notes, which ema-ckpt did not write there" in kept.output
    assert (ema / "notes").is_dir()
    around = _run(ckpts, ckpts / "step_100" / "ema")
    assert around.exit_code == 2 and "lies inside the checkpoint" in around.output, around.output


def test_a_hand_edited_manifest_is_refused_not_trusted(tmp_path):
    import json

    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        _save(ckpts, step, seed=step)
    ema = tmp_path / "ema"
    assert _run(ckpts, ema).exit_code == 0
    manifest = ema / "ema-ckpt.json"
    doc = json.loads(manifest.read_text())
    assert doc["integrity"].startswith("sha256:")
    doc["profile"]["decay"] = 0.5  # "the same EMA, with another decay from now on"
    manifest.write_text(json.dumps(doc, indent=2))
    _save(ckpts, 300, seed=300)
    result = runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.5", "--out", str(ema)], terminal_width=300)
    assert result.exit_code == 5, result.output
    assert f"{manifest}: edited since ema-ckpt wrote it" in result.output and "pass --restart" in result.output
    verify = runner.invoke(app, ["verify", str(ema)], terminal_width=300)
    assert verify.exit_code == 3 and "edited since ema-ckpt wrote it" in verify.output
    restarted = runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.5", "--out", str(ema), "--restart"])
    assert restarted.exit_code == 0, restarted.output
    assert runner.invoke(app, ["verify", str(ema)]).exit_code == 0


def test_a_manifest_written_before_the_checksum_is_still_read(tmp_path):
    import json

    ckpts = tmp_path / "ckpts"
    _save(ckpts, 100, seed=1)
    ema = tmp_path / "ema"
    assert _run(ckpts, ema).exit_code == 0
    doc = json.loads((ema / "ema-ckpt.json").read_text())
    del doc["integrity"]
    (ema / "ema-ckpt.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    _save(ckpts, 200, seed=2)
    assert _run(ckpts, ema).exit_code == 0
    assert "integrity" in json.loads((ema / "ema-ckpt.json").read_text())


def _without_dac_override(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command as root without CAP_DAC_OVERRIDE: file modes bind it, as they bind a cron user."""
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    drop = "-dac_override,-dac_read_search"
    return subprocess.run(["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", "--",
                           sys.executable, "-m", "ema_ckpt", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_an_unreadable_checkpoint_is_exit_3_naming_it(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        _save(ckpts, step, seed=step)
    (ckpts / "step_200").chmod(0)
    try:
        proc = _without_dac_override(["accumulate", str(ckpts), "--decay", "0.9", "--out", str(tmp_path / "ema")],
                                     tmp_path)
    finally:
        (ckpts / "step_200").chmod(0o755)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip() == f"error: {ckpts / 'step_200'}: cannot read (Permission denied)"
    assert not (tmp_path / "ema").exists()


def test_a_newline_in_a_path_is_shown_not_cut(tmp_path):
    folder = tmp_path / "a\nb"
    result = runner.invoke(app, ["accumulate", str(folder / "ckpts"), "--decay", "0.9", "--out", str(tmp_path / "e")])
    assert result.exit_code == 3
    assert f"{tmp_path}/a\\x0ab/ckpts: no such file or directory" in result.output, result.output


def test_a_working_directory_torch_cannot_load_from_is_refused_before_the_lock(tmp_path):
    ckpts = tmp_path / "ckpts"
    _save(ckpts, 100, seed=1)
    deep = tmp_path / "deep"
    deep.mkdir()
    part = "d" * 120
    climb = " && ".join(["cd " + str(deep)] + [f"mkdir {part} && cd {part}"] * 40)  # 4,800 bytes, past PATH_MAX
    command = f"{climb} && {sys.executable} -m ema_ckpt accumulate {ckpts} --decay 0.9 --out {tmp_path / 'ema'}"
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "more than PATH_MAX" in proc.stderr and "torch cannot load from there" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpts", "deep"]  # no lock, no staging
