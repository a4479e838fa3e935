"""``EmaCkptCallback`` inside real ``transformers.Trainer`` runs on CPU (tiny Llama, 8 steps, a save
every 2, ``save_total_limit=1``): the EMA folds every saved step and equals a float64 EMA of the
states as they were saved; a resumed run continues it; a damaged checkpoint is logged (or raised
with ``strict=True``) and never stops training; under torchrun only rank 0 folds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ema_ckpt
from ema_ckpt.errors import EmaCkptError, FoldError
from ema_ckpt.integrations.transformers import EmaCkptCallback
from ema_ckpt.watching import INCOMING
from tests.callback_train_hf import RecordSaves, trainer
from tests.ema_reference import assert_ema_matches, reference_ema
from tests.torchrun import launcher_env, torchrun

DECAY = 0.8
SCRIPT = Path(__file__).resolve().parent / "callback_train_hf.py"


def _expected(states: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    steps = sorted(states)
    return reference_ema([states[s] for s in steps], steps, lambda prev, step: DECAY ** (step - prev))


def _assert_ema(out: Path, states: dict[int, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    assert_ema_matches(out, _expected(states), tmp_path)


def test_every_saved_step_is_folded_with_save_total_limit_1(tmp_path):
    run = tmp_path / "run"
    out = run / "ema"  # inside the Trainer's output_dir, as users put it
    record = RecordSaves()
    callback = EmaCkptCallback(out=out, decay=DECAY)
    trainer(run, 8, [record, callback]).train()
    assert sorted(record.states) == [2, 4, 6, 8]
    assert callback.result is not None
    assert callback.result.folded == [2, 4, 6, 8] and callback.result.step == 8
    assert callback.result.errors == []
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-8"]  # retention deleted the rest
    assert not [p for p in (run / INCOMING).iterdir() if not p.name.startswith(".")]  # staged copies dropped
    _assert_ema(out, record.states, tmp_path)
    assert not torch.equal(load_file(tmp_path / "ema.safetensors")["lm_head.weight"],
                           record.states[8]["lm_head.weight"])


def test_a_resumed_run_continues_the_same_ema(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    record = RecordSaves()
    trainer(Path("run"), 4, [record, EmaCkptCallback("ema", decay=DECAY)]).train()  # "ema": from the cwd
    assert ema_ckpt.inspect(tmp_path / "ema").step == 4
    callback = EmaCkptCallback("ema", decay=DECAY)
    monkeypatch.chdir(tmp_path / "run")  # the relative out was resolved when each callback was made
    trainer(tmp_path / "run", 8, [record, callback]).train(resume_from_checkpoint=str(tmp_path / "run/checkpoint-4"))
    assert callback.result is not None and callback.result.folded == [6, 8] and callback.result.step == 8
    assert sorted(record.states) == [2, 4, 6, 8]
    _assert_ema(tmp_path / "ema", record.states, tmp_path)


@pytest.mark.parametrize("mode", ["logged", "strict"])
def test_a_damaged_checkpoint_never_stops_training(tmp_path, caplog, mode):
    run, out = tmp_path / "run", tmp_path / "ema"
    record = RecordSaves(damage=(4,))
    callback = EmaCkptCallback(out=out, decay=DECAY, strict=mode == "strict")
    job = trainer(run, 8, [record, callback])
    with caplog.at_level(logging.WARNING, logger="ema_ckpt"):
        if mode == "strict":
            with pytest.raises(FoldError, match="checkpoint-4"):
                job.train()
        else:
            job.train()
    assert job.state.global_step == 8  # training went to its end either way
    assert callback.result is not None
    assert callback.result.errors
    assert "checkpoint-4" in callback.result.errors[0] and "\n" not in callback.result.errors[0]
    assert any("a fold failed" in r.getMessage() and "checkpoint-4" in r.getMessage() for r in caplog.records)
    # the EMA stops before the damaged checkpoint: at 2 where a fold took 2 alone, else never made
    assert callback.result.folded in ([], [2]) and callback.result.step in (None, 2)
    if callback.result.step == 2:
        _assert_ema(out, {2: record.states[2]}, tmp_path)
    else:
        assert not out.exists()


def test_a_mistaken_profile_fails_before_training():
    with pytest.raises(EmaCkptError, match="exactly one profile"):
        EmaCkptCallback(out="ema", decay=0.9, half_life=100)
    with pytest.raises(TypeError, match="snapshot_evry"):
        EmaCkptCallback(out="ema", decay=0.9, snapshot_evry=10)
    callback = EmaCkptCallback(out="ema", sigma_rel=[0.05, 0.1], snapshot_every=4)
    assert callback.options["sigma_rels"] == ["0.05", "0.1"] and callback.out == os.path.abspath("ema")


def test_importing_ema_ckpt_imports_no_trainer():
    code = "import sys, ema_ckpt; assert 'transformers' not in sys.modules and 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_two_ranks_under_torchrun_only_rank_0_folds(tmp_path):
    env = launcher_env(PYTHONPATH=str(SCRIPT.parents[1]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false")

    def clear_outputs() -> None:
        for name in ("run", "ema", "saved", "report"):
            shutil.rmtree(tmp_path / name, ignore_errors=True)

    proc = torchrun([str(SCRIPT), "--out-dir", str(tmp_path / "run"), "--ema", str(tmp_path / "ema"),
                     "--record", str(tmp_path / "saved"), "--report", str(tmp_path / "report"), "--decay", str(DECAY)],
                    env=env, timeout=240, before_retry=clear_outputs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = {r["rank"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "report").glob("*.json"))}
    assert sorted(reports) == [0, 1] and reports[0]["world"] == 2
    assert reports[1]["worker_starts"] == 0 and reports[1]["result"] is None
    assert reports[0]["worker_starts"] >= 1
    assert reports[0]["result"] == {"step": 8, "folded": [2, 4, 6, 8], "errors": []}
    states = {int(p.stem.split("-")[1]): load_file(p) for p in (tmp_path / "saved").glob("step-*.safetensors")}
    assert sorted(states) == [2, 4, 6, 8]
    _assert_ema(tmp_path / "ema", states, tmp_path)
