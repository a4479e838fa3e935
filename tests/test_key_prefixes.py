"""A single file's key names are the ones the framework that wrote it loads it with.

A wrapper's prefix on every key (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``) is
dropped only where that framework's own loading code drops it: a plain training loop's state
dict (the file itself or one container of it), nanoGPT's ``sample.py``. A trainer's structured
checkpoint whose loader keeps the names keeps them: Composer's ``state.model`` (its
``ComposerClassifier`` holds the network as ``self.module``) and Lightning's ``state_dict`` (a
``LightningModule`` with an attribute ``module``). Each file here is written by ``torch.save``
(or Lightning's own ``Trainer.save_checkpoint``) in the shape that framework writes, and the
keys the reader gives load with ``strict=True`` into the module that framework loads them into.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.options import ReadOptions, read_options_from
from ema_ckpt.formats.torch_file.model import SAVERS, Candidate, candidates, key_prefix
from ema_ckpt.layout import Box


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))


class ComposerLike(torch.nn.Module):
    """As Composer's ``ComposerClassifier``: the user's network is the attribute ``module``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.module = net


def _read(path: Path, **options) -> tuple[dict[str, torch.Tensor], dict]:
    with open_checkpoint(path, read=ReadOptions(**options)) as reader:
        return {k: reader.read(k, Box.full(s.shape)) for k, s in reader.specs().items()}, reader.info()


def _loads_strictly(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    want = module.state_dict()
    module.load_state_dict(state, strict=True)
    assert all(torch.equal(module.state_dict()[k], state[k]) for k in want)


@pytest.fixture
def ddp(tmp_path):
    """A DDP-wrapped module on a one-rank gloo group, as a plain training loop wraps its network."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        net = _net(1)
        yield net, DistributedDataParallel(net)
    finally:
        dist.destroy_process_group()


# --- the files trainers write -----------------------------------------------------------------


@pytest.mark.parametrize("shape", ["top", "model", "model_state_dict"])
def test_ddp_prefix_of_a_plain_loop_is_dropped(tmp_path, ddp, shape):
    _, wrapped = ddp
    saved = wrapped.state_dict()
    assert all(k.startswith("module.") for k in saved)
    tree = saved if shape == "top" else {shape: saved, "optimizer": {"state": {}}, "epoch": 3}
    torch.save(tree, tmp_path / "checkpoint.pth")
    state, info = _read(tmp_path / "checkpoint.pth")
    _loads_strictly(_net(), state)  # what the loop's own `net.load_state_dict(strip(ckpt))` loads into
    assert info["wrapper_prefix"] == "module."
    assert info["key_prefix"].startswith("module. dropped: a plain training loop")


def test_a_state_dict_nested_deeper_keeps_its_names(tmp_path, ddp):
    _, wrapped = ddp
    torch.save({"run": {"weights": wrapped.state_dict()}, "epoch": 1}, tmp_path / "nested.pt")
    state, info = _read(tmp_path / "nested.pt")
    assert all(k.startswith("module.") for k in state)
    _loads_strictly(wrapped, state)
    assert info["wrapper_prefix"] is None and "2 containers deep" in info["key_prefix"]


def test_keep_prefix_keeps_every_prefix(tmp_path, ddp):
    _, wrapped = ddp
    torch.save({"model": wrapped.state_dict()}, tmp_path / "ddp.pt")
    torch.save({"model": torch.compile(_net()).state_dict()}, tmp_path / "compiled.pt")
    state, info = _read(tmp_path / "ddp.pt", keep_prefix=True)
    assert sorted(state) == sorted(wrapped.state_dict())
    _loads_strictly(wrapped, state)
    assert info["wrapper_prefix"] is None and info["key_prefix"] == "none dropped: module. kept (keep_prefix)"
    state, _ = _read(tmp_path / "compiled.pt", keep_prefix=True)
    assert all(k.startswith("_orig_mod.") for k in state)


def test_torch_compile_prefix_is_dropped(tmp_path):
    compiled = torch.compile(_net(2))  # no call: torch.compile wraps, and saves its `_orig_mod.` names
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    torch.save({"model": compiled.state_dict()}, tmp_path / "ckpt.pt")
    state, info = _read(tmp_path / "ckpt.pt")
    _loads_strictly(_net(), state)
    assert info["wrapper_prefix"] == "_orig_mod." and "a plain training loop" in info["key_prefix"]


def test_nanogpt_checkpoint_loses_orig_mod_as_its_sample_py_strips_it(tmp_path):
    compiled = torch.compile(_net(3))
    torch.save({"model": compiled.state_dict(), "optimizer": {"state": {}, "param_groups": []},
                "model_args": {"n_layer": 2}, "iter_num": 10, "best_val_loss": 1.5, "config": {}},
               tmp_path / "ckpt.pt")
    state, info = _read(tmp_path / "ckpt.pt")
    _loads_strictly(_net(), state)
    assert info["key_prefix"] == "_orig_mod. dropped: " + next(s.why for s in SAVERS if s.name == "nanoGPT")


def test_composer_checkpoint_keeps_module_of_its_model(tmp_path):
    model = ComposerLike(_net(4))
    saved = model.state_dict()
    assert all(k.startswith("module.") for k in saved)
    # as Composer's Checkpointer writes it: {"state": State.state_dict(), "rng": [...]}
    torch.save({
        "state": {
            "model": saved,
            "optimizers": {"DecoupledSGDW": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}},
            "schedulers": {},
            "timestamp": {"epoch": 1, "batch": 8, "sample": 64, "token": 0, "batch_in_epoch": 0},
            "rank_zero_seed": 17, "run_name": "run", "integrations": {"composer": {"version": "0.30.0"}},
        },
        "rng": [{"python": (3, (1, 2), None), "torch": torch.ByteTensor(8), "cuda": None}],
    }, tmp_path / "ep1-ba8-rank0.pt")
    state, info = _read(tmp_path / "ep1-ba8-rank0.pt")
    assert sorted(state) == sorted(saved)
    _loads_strictly(ComposerLike(_net()), state)  # Composer loads state.model into its ComposerModel
    assert info["container"] == "state.model" and info["wrapper_prefix"] is None
    assert info["key_prefix"].startswith("none dropped: module. kept, a Composer checkpoint")


COMPOSER = Path(__file__).parent / "fixtures" / "trainers" / "composer-style"


@pytest.mark.skipif(not (COMPOSER / "producer.json").is_file(), reason="needs the composer-style fixture")
def test_real_composer_checkpoints_read_as_composer_loads_them():
    """Written by Composer 0.32.1's own Trainer; the oracle is what its load_checkpoint put in a
    fresh ComposerClassifier (``tests/producers/trainers/step_records.py``)."""
    from safetensors.torch import load_file

    checkpoints = json.loads((COMPOSER / "producer.json").read_text())["checkpoints"]
    read = 0
    for name, info in checkpoints.items():
        if "oracle" not in info:
            continue
        want = load_file(COMPOSER / info["oracle"])
        state, details = _read(COMPOSER / name)
        assert sorted(state) == sorted(want) and all(k.startswith("module.") for k in state)
        assert all(torch.equal(state[k], want[k]) for k in want), name
        assert details["wrapper_prefix"] is None and "a Composer checkpoint" in details["key_prefix"]
        read += 1
    assert read >= 2


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch_lightning")
def test_lightning_checkpoint_keeps_an_attribute_named_module(tmp_path):
    import pytorch_lightning as pl

    class Lit(pl.LightningModule):
        def __init__(self, hidden: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.module = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.module(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)),
                                       batch_size=4)
    lit = Lit()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, data)
    trainer.save_checkpoint(tmp_path / "epoch=0-step=1.ckpt")
    state, info = _read(tmp_path / "epoch=0-step=1.ckpt")
    assert sorted(state) == sorted(lit.state_dict()) and all(k.startswith("module.") for k in state)
    loaded = Lit.load_from_checkpoint(tmp_path / "epoch=0-step=1.ckpt")  # Lightning's own loader
    _loads_strictly(loaded, state)
    assert info["container"] == "state_dict" and info["wrapper_prefix"] is None
    assert info["key_prefix"].startswith("none dropped: module. kept, a Lightning checkpoint")


# --- the table ----------------------------------------------------------------------------------


def _chosen(tree) -> Candidate:
    return candidates(tree, is_tensor=lambda v: isinstance(v, float), nbytes=lambda _v: 4)[0]


@pytest.mark.parametrize(("tree", "saver", "dropped"), [
    ({"module.a": 1.0, "module.b": 1.0}, "a plain training loop", "module."),
    ({"state_dict": {"module._orig_mod.a": 1.0, "module._orig_mod.b": 1.0}, "epoch": 1}, "a plain training loop",
     "module._orig_mod."),
    ({"model": {"state_dict": {"module.a": 1.0}}}, "a plain training loop", None),
    ({"state_dict": {"module.a": 1.0}, "loops": {}, "epoch": 1}, "Lightning", None),
    ({"state_dict": {"module.a": 1.0}, "pytorch-lightning_version": "2.6.6"}, "Lightning", None),
    ({"state": {"model": {"module.a": 1.0}, "timestamp": {}}, "rng": []}, "Composer", None),
    ({"model": {"module.a": 1.0}, "model_args": {}, "iter_num": 3}, "nanoGPT", None),
    ({"model": {"_orig_mod.a": 1.0}, "model_args": {}, "iter_num": 3}, "nanoGPT", "_orig_mod."),
    ({"model": {"a": 1.0, "b": 1.0}}, "a plain training loop", None),
])
def test_who_wrote_the_file_says_which_prefix_goes(tree, saver, dropped):
    decided = key_prefix(tree, _chosen(tree))
    assert (decided.saver, decided.dropped) == (saver, dropped)
    assert key_prefix(tree, _chosen(tree), keep=True).dropped is None


def test_the_table_ends_with_the_plain_loop_which_takes_any_file():
    assert SAVERS[-1].name == "a plain training loop" and SAVERS[-1].recognises({})
    assert set(SAVERS[-1].drops) == {"module.", "_orig_mod."}
    assert not any(s.recognises({"model": {}}) for s in SAVERS[:-1])


def test_keep_prefix_travels_with_the_commands_settings_and_is_recorded():
    options = read_options_from(SimpleNamespace(state_key=None, inert_globals=(), keep_prefix=True))
    assert options.keep_prefix and options.recorded() == {"keep_prefix": True}
    assert read_options_from(SimpleNamespace()).recorded() == {}
