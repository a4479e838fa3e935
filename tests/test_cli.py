"""The command line, through Typer's CliRunner and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from tests.dcp_helpers import write_dcp

runner = CliRunner()
EMA_CKPT = Path(sys.executable).with_name("ema-ckpt")


@pytest.fixture
def folder(tmp_path) -> Path:
    for step in (10, 30, 31):
        write_dcp(tmp_path / "ckpts" / f"step_{step}",
                  {"model.w": torch.full((5, 2), float(step)), "model.n": torch.tensor(step)}, world_size=2)
    return tmp_path / "ckpts"


def test_accumulate_json_summary_and_up_to_date(folder):
    result = runner.invoke(app, ["accumulate", str(folder), "--decay", "0.9", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["step"] == 31 and [c["step"] for c in summary["folded"]] == [10, 30, 31]
    assert sum(t["coefficient"] for t in summary["terms"]) == pytest.approx(1.0)
    again = runner.invoke(app, ["accumulate", str(folder), "--decay", "0.9"])
    assert again.exit_code == 0 and "up to date at step 31" in again.stdout


def test_inspect_table_and_json(folder):
    result = runner.invoke(app, ["inspect", str(folder / "step_30")])
    assert result.exit_code == 0 and "model.w" in result.stdout and "dcp" in result.stdout
    data = json.loads(runner.invoke(app, ["inspect", str(folder / "step_30"), "--json"]).stdout)
    assert data["format"] == "dcp" and data["step"] == 30 and data["keys"] == 2
    assert data["total_bytes"] == 5 * 2 * 4 + 8 and data["details"]["ranks"] == 2


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["accumulate", "{folder}", "--decay", "1.5"], 2, "--decay must lie strictly between 0 and 1"),
        (["accumulate", "{folder}"], 2, "exactly one of --decay or --half-life"),
        (["accumulate", "{folder}", "--decay", "0.9", "--dtype", "int8"], 2, "--dtype must be one of"),
        (["accumulate", "{missing}", "--decay", "0.9"], 3, "no such file or directory"),
        (["inspect", "{missing}"], 3, "no such file or directory"),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(folder, tmp_path, args, code, message):
    args = [a.format(folder=folder, missing=tmp_path / "missing") for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == code
    assert message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_other_settings_exit_5_and_restart(folder):
    assert runner.invoke(app, ["accumulate", str(folder), "--decay", "0.9"]).exit_code == 0
    result = runner.invoke(app, ["accumulate", str(folder), "--decay", "0.5"])
    assert result.exit_code == 5 and "--restart" in result.stderr
    assert runner.invoke(app, ["accumulate", str(folder), "--decay", "0.5", "--restart"]).exit_code == 0


def test_help_has_examples():
    result = runner.invoke(app, ["accumulate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "ema-ckpt accumulate ckpts/ --decay 0.999" in result.stdout


def test_installed_entry_point_and_module(folder):
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([str(EMA_CKPT), "accumulate", str(folder), "--half-life", "5", "--quiet"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    proc = subprocess.run([sys.executable, "-m", "ema_ckpt", "inspect", str(folder / "ema"), "--json"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout)["manifest"]["step"] == 31
    proc = subprocess.run([str(EMA_CKPT), "accumulate", str(folder), "--decay", "0.9"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 5 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    proc = subprocess.run([str(EMA_CKPT), "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("ema-ckpt ")


def test_cli_starts_without_torch_and_completes_commands():
    probe = "import sys, ema_ckpt.cli; assert 'torch' not in sys.modules, 'the CLI imported torch at start'"
    subprocess.run([sys.executable, "-c", probe], check=True)
    exe = Path(sys.executable).parent / "ema-ckpt"
    env = {**os.environ, "_EMA_CKPT_COMPLETE": "complete_bash", "COMP_WORDS": "ema-ckpt consolidate --ma",
           "COMP_CWORD": "2"}
    proc = subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["--max-shard-size"]
    # the shell is detected from the parent process, as when a user types it in bash (a second
    # command keeps bash from exec-ing the first one in its own place)
    script = subprocess.run(["bash", "-c", f"'{exe}' --show-completion; exit $?"], capture_output=True, text=True,
                            check=True)
    assert "_EMA_CKPT_COMPLETE" in script.stdout
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("ema-ckpt ")
