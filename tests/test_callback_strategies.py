"""The training callbacks under sharded strategies: real 2-rank CPU training under torchrun (gloo).

``transformers.Trainer`` with DeepSpeed ZeRO-3 and with accelerate's FSDP
(``SHARDED_STATE_DICT``), and ``lightning.pytorch.Trainer`` with DeepSpeed stage 3 and
``FSDPStrategy(state_dict_type="sharded")``, each keeping one checkpoint (``save_total_limit=1`` /
``save_top_k=1``) and saving at steps 2, 4 and 6 (``tests/callback_train_strategies.py``): retention
removes the first save before its fold, and the last is written while the fold worker runs. The EMA
must fold every saved step, only on rank 0, and equal a float64 EMA of the fp32 states as saved:
each checkpoint copied aside right after its save and consolidated by the trainer's own tool
(DeepSpeed's ``zero_to_fp32``, accelerate's ``merge_fsdp_weights``, Lightning's converters).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ema_ckpt.watching import INCOMING
from tests.callback_train_strategies import SAVED_STEPS
from tests.ema_reference import assert_ema_matches, reference_ema
from tests.torchrun import launcher_env, torchrun

DECAY = 0.8
SCRIPT = Path(__file__).resolve().parent / "callback_train_strategies.py"

pytestmark = pytest.mark.slow


def _needs(*modules: str) -> None:
    """Skip unless the trainers are installed (found, not imported: the training runs elsewhere)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the test extra; DeepSpeed: make install-test)")


def _train(kind: str, tmp_path: Path) -> dict[int, dict]:
    env = launcher_env(PYTHONPATH=str(SCRIPT.parents[1]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu", PL_DISABLE_FORK="1",
                       ACCELERATE_DISABLE_RICH="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def clear_outputs() -> None:
        for name in ("run", "ema", "saved", "report"):
            shutil.rmtree(tmp_path / name, ignore_errors=True)

    proc = torchrun([str(SCRIPT), "--kind", kind, "--out-dir", str(tmp_path / "run"), "--ema", str(tmp_path / "ema"),
                     "--record", str(tmp_path / "saved"), "--report", str(tmp_path / "report"), "--decay", str(DECAY)],
                    env=env, cwd=SCRIPT.parents[1], before_retry=clear_outputs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "report").glob("rank*.json"))}


def _check(tmp_path: Path, reports: dict[int, dict], kept: str) -> None:
    """Every save folded on rank 0 only; retention kept ``kept`` alone; the EMA equals the float64 EMA."""
    assert sorted(reports) == [0, 1] and reports[0]["world"] == 2
    assert reports[1]["worker_starts"] == 0 and reports[1]["result"] is None
    assert reports[0]["worker_starts"] >= 1
    assert reports[0]["result"] == {"step": SAVED_STEPS[-1], "folded": SAVED_STEPS, "errors": []}
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".") and p.name != "ema") == [kept]
    assert not [p for p in (run / INCOMING).iterdir() if not p.name.startswith(".")]  # staged copies dropped
    states = {int(p.stem.split("-")[1]): load_file(p) for p in (tmp_path / "saved").glob("step-*.safetensors")}
    assert sorted(states) == SAVED_STEPS
    want = reference_ema([states[s] for s in SAVED_STEPS], SAVED_STEPS, lambda prev, step: DECAY ** (step - prev))
    got = assert_ema_matches(tmp_path / "ema", want, tmp_path)
    last = states[SAVED_STEPS[-1]]
    assert any(not torch.equal(got[k], last[k]) for k in last)  # an average, not the last state


def test_hf_trainer_deepspeed_zero3(tmp_path):
    """ZeRO-3 (ZeRO-2 writes the same ``global_stepN/`` folder, with a ``model.safetensors`` beside it:
    ``tests/callback_train_strategies.py --kind hf-zero2`` runs it)."""
    _needs("transformers", "accelerate", "deepspeed")
    reports = _train("hf-zero3", tmp_path)
    _check(tmp_path, reports, kept=f"checkpoint-{SAVED_STEPS[-1]}")


def test_hf_trainer_fsdp_sharded_state_dict(tmp_path):
    _needs("transformers", "accelerate")
    reports = _train("hf-fsdp", tmp_path)
    _check(tmp_path, reports, kept=f"checkpoint-{SAVED_STEPS[-1]}")
    assert (tmp_path / "run" / f"checkpoint-{SAVED_STEPS[-1]}" / "pytorch_model_fsdp_0" / ".metadata").is_file()


@pytest.mark.parametrize("kind", ["pl-deepspeed3", "pl-fsdp"])
def test_lightning_sharded_strategies(tmp_path, kind):
    _needs("lightning", *(["deepspeed"] if kind == "pl-deepspeed3" else []))
    reports = _train(kind, tmp_path)
    _check(tmp_path, reports, kept=f"epoch=0-step={SAVED_STEPS[-1]}.ckpt")
    assert (tmp_path / "run" / f"epoch=0-step={SAVED_STEPS[-1]}.ckpt").is_dir()  # a sharded folder
