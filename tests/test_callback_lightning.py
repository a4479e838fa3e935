"""The Lightning callbacks: real ``pl.Trainer`` runs on CPU with tiny models and ``save_top_k=1``.

The EMA must hold every saved step, and equal a float64 EMA of the states as they were saved
(captured in ``on_save_checkpoint``, so a retention that deletes a file early loses nothing here).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint  # noqa: E402

from ema_ckpt import consolidate  # noqa: E402
from ema_ckpt.errors import FoldError, OptionError, UsageError  # noqa: E402
from ema_ckpt.integrations.pytorch_lightning import EmaCkptCallback  # noqa: E402
from tests.ema_reference import assert_close_relative, reference_ema  # noqa: E402
from tests.torchrun import launcher_env, torchrun  # noqa: E402

DECAY = 0.9
ROOT = Path(__file__).resolve().parents[1]


def keep(prev: int, step: int) -> float:
    return DECAY ** (step - prev)


class Tiny(pl.LightningModule):
    """Two Linear layers; records the state dict of every save, by step, as it is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.log("countdown", -float(self.global_step), on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint) -> None:
        self.saved[checkpoint["global_step"]] = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}


def loader(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(max_steps: int, *callbacks, **kwargs) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks), **kwargs)


def ema_state(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    target = tmp / "ema.safetensors"
    consolidate(str(out), str(target), overwrite=True)
    return load_file(str(target))


def check_ema(out: Path, tmp: Path, saved: dict[int, dict[str, torch.Tensor]], steps: list[int]) -> None:
    assert sorted(saved) == steps
    want = reference_ema([saved[s] for s in steps], steps, keep)
    got = ema_state(out, tmp)
    assert sorted(got) == sorted(want)
    for key in want:
        assert_close_relative(got[key], want[key])


@pytest.mark.parametrize(("every", "monitor", "save_last"), [(2, None, False), (1, "countdown", True)])
def test_save_top_k_1_folds_every_saved_step(tmp_path: Path, caplog, every, monitor, save_last) -> None:
    """Retention keeps one file (every step with ``every_n_train_steps=1``), yet every step is folded."""
    caplog.set_level(logging.INFO, logger="ema_ckpt")
    ckpts, out = tmp_path / "ckpts", tmp_path / "ema"
    model = Tiny()
    ema = EmaCkptCallback(out, decay=DECAY)
    checkpoint = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=every, save_top_k=1, monitor=monitor,
                                 mode="min", save_last=save_last)
    trainer(8, ema, checkpoint).fit(model, loader())
    steps = list(range(every, 9, every))
    assert ema.result is not None and ema.result.errors == []
    assert ema.result.step == 8 and sorted(set(ema.result.folded)) == steps
    assert [p.name for p in ckpts.glob("*-step=*.ckpt")] == ["epoch=0-step=8.ckpt"]  # retention kept one
    check_ema(out, tmp_path, model.saved, steps)
    assert f"EMA at step 8: {out}" in caplog.text


def test_resumed_run_continues_the_ema(tmp_path: Path) -> None:
    ckpts, out = tmp_path / "ckpts", tmp_path / "ema"
    model = Tiny()
    first = EmaCkptCallback(out, decay=DECAY)
    trainer(4, first, ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_top_k=1)).fit(model, loader())
    assert first.result is not None and first.result.step == 4
    saved = dict(model.saved)

    resumed = Tiny()
    second = EmaCkptCallback(out, decay=DECAY)
    trainer(8, second, ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_top_k=1)).fit(
        resumed, loader(), ckpt_path=str(ckpts / "epoch=0-step=4.ckpt"))
    assert second.result is not None and second.result.step == 8
    assert sorted(second.result.folded) == [6, 8]  # 2 and 4 were folded by the first run
    check_ema(out, tmp_path, {**saved, **resumed.saved}, [2, 4, 6, 8])


class Truncate(Checkpoint):
    """Runs after ModelCheckpoint (Lightning keeps checkpoint callbacks last, in order): damages one save."""

    def __init__(self, dirpath: Path, step: int) -> None:
        self.dirpath, self.step, self.done = dirpath, step, False

    def on_train_batch_end(self, trainer, *args) -> None:
        path = self.dirpath / f"epoch=0-step={self.step}.ckpt"
        if not self.done and path.exists():
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
            self.done = True


@pytest.mark.parametrize("strict", [False, True])
def test_a_corrupt_checkpoint(tmp_path: Path, caplog, strict: bool) -> None:
    """strict=False: training completes and the failure is logged; strict=True: FoldError at the end."""
    caplog.set_level(logging.INFO, logger="ema_ckpt")
    ckpts, out = tmp_path / "ckpts", tmp_path / "ema"
    ema = EmaCkptCallback(out, decay=DECAY, strict=strict)
    run = trainer(6, ema, ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_top_k=1),
                  Truncate(ckpts, 4))
    if strict:
        with pytest.raises(FoldError, match="fold"):
            run.fit(Tiny(), loader())
    else:
        run.fit(Tiny(), loader())
        assert run.global_step == 6
    assert ema.result is not None and ema.result.errors
    assert ema.result.step == 6 and sorted(ema.result.folded) == [2, 6]  # training went on, so did the EMA
    assert "a fold failed" in caplog.text and "epoch=0-step=4.ckpt" in ema.result.errors[0]


def test_options_are_checked_at_construction(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="exactly one profile"):
        EmaCkptCallback(tmp_path)
    with pytest.raises(UsageError, match="exactly one profile"):
        EmaCkptCallback(tmp_path, decay=0.9, half_life=100)
    with pytest.raises(OptionError, match="decay"):
        EmaCkptCallback(tmp_path, decay=1.5)
    with pytest.raises(OptionError, match="snapshot_every"):
        EmaCkptCallback(tmp_path, decay=0.9, snapshot_every=10)
    with pytest.raises(TypeError, match="no_such"):
        EmaCkptCallback(tmp_path, decay=0.9, no_such=1)
    power = EmaCkptCallback(out=tmp_path, sigma_rel=[0.05, 0.1], snapshot_every=4)
    with pytest.raises(UsageError, match="cannot be combined"):  # accumulate's own rule: warmup is for decay
        EmaCkptCallback(out=tmp_path, sigma_rel=0.1, warmup=True)
    assert power.options["sigma_rels"] == ["0.05", "0.1"] and power.options["snapshot_every"] == 4
    assert EmaCkptCallback(tmp_path, half_life=50, skip_damaged=True).options["skip_damaged"] is True
    assert isinstance(power, pl.Callback)


def test_importing_ema_ckpt_imports_no_lightning() -> None:
    code = ("import sys, ema_ckpt, ema_ckpt.integrations; "
            "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_the_lightning_module() -> None:
    """``ema_ckpt.integrations.lightning`` subclasses ``lightning.pytorch.Callback``, or says what is missing."""
    if importlib.util.find_spec("lightning") is None:
        with pytest.raises(ImportError, match="needs the `lightning` package"):
            importlib.import_module("ema_ckpt.integrations.lightning")
        pytest.skip("the `lightning` package is not installed")
    from lightning.pytorch import Callback

    from ema_ckpt.integrations.lightning import EmaCkptCallback as LightningCallback

    assert isinstance(LightningCallback("ema", decay=0.9), Callback)


DDP_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    sys.path.insert(0, {root!r})
    from tests.test_callback_lightning import Tiny, loader, pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from ema_ckpt.integrations.pytorch_lightning import EmaCkptCallback

    tmp = {tmp!r}
    model = Tiny()
    ema = EmaCkptCallback(os.path.join(tmp, "ema"), decay={decay})
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True,
                         callbacks=[ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_train_steps=2,
                                                    save_top_k=1), ema])
    trainer.fit(model, loader(64))
    rank = trainer.global_rank
    report = {{"rank": rank, "result": None if ema.result is None else
               {{"step": ema.result.step, "folded": ema.result.folded, "errors": ema.result.errors}}}}
    with open(os.path.join(tmp, f"rank{{rank}}.json"), "w") as f:
        json.dump(report, f)
    if rank == 0:
        torch.save(model.saved, os.path.join(tmp, "saved.pt"))
    # Close the process group before the interpreter exits: gloo's threads left running at
    # exit can abort a rank ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
''')


def test_ddp_two_ranks_only_rank_0_folds(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(root=str(ROOT), tmp=str(tmp_path), decay=DECAY))
    proc = torchrun([str(script)], env=launcher_env(PL_DISABLE_FORK="1"), cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank1["result"] is None  # rank 1 started no fold
    assert rank0["result"]["step"] == 8 and rank0["result"]["errors"] == []
    assert sorted(set(rank0["result"]["folded"])) == [2, 4, 6, 8]
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    check_ema(tmp_path / "ema", tmp_path, saved, [2, 4, 6, 8])
