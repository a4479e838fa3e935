"""Reading single files as the class of inputs they are: any nesting, any harmless pickled object,
either of torch's serializations, hostile pickles, copies and files written over in place.

Files here are written by ``torch.save`` itself (the producer research code uses); the trainers'
own files are in ``test_single_files.py``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import enum
import json
import os
import pathlib
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.commands.inspect import inspect_checkpoint
from ema_ckpt.discovery import discover
from ema_ckpt.errors import CheckpointFormatError, IncompatibleCheckpointError, OptionError, UnsafePickleError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.options import ReadOptions
from ema_ckpt.formats.torch_file.model import NON_MODEL, candidates, wrapper_prefix
from ema_ckpt.layout import Box
from ema_ckpt.torch_records.emit import dumps_inert
from ema_ckpt.torch_records.tree import load_tree

runner = CliRunner()


class Config:  # a training script's own record, pickled beside the weights
    def __init__(self, lr: float) -> None:
        self.lr = lr


class Mode(enum.Enum):
    TRAIN = 1


def _net(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).state_dict()


def _read_all(path: Path, **options) -> dict[str, torch.Tensor]:
    with open_checkpoint(path, read=ReadOptions(**options)) as reader:
        return {k: reader.read(k, Box.full(s.shape)) for k, s in reader.specs().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- what is inert data, what is refused ----------------------------------------------------


def test_common_objects_beside_the_weights_are_read_as_data(tmp_path):
    state = {
        "model": _net(), "epoch": 3, "global_step": 120,
        "args": argparse.Namespace(lr=0.1, out=pathlib.Path("/runs/a"), tags=["x"]),
        "counts": collections.Counter(a=1), "history": collections.defaultdict(list, {"loss": [1.0]}),
        "started": datetime.datetime(2026, 1, 2, 3, 4, 5), "rng": np.random.get_state(),
        "gen": np.random.default_rng(0), "arr": np.arange(4.0), "scalar": np.float32(2.5),
        "version": torch.__version__, "device": torch.device("cpu"), "dtype": torch.bfloat16,
    }
    torch.save(state, tmp_path / "ckpt_000120.pt")
    assert _equal(_read_all(tmp_path / "ckpt_000120.pt"), state["model"])
    found = discover([tmp_path])
    assert [(c.step, c.step_source) for c in found.checkpoints] == [(120, "global_step in the file")]


def test_a_class_of_the_training_script_is_refused_naming_it_and_its_key(tmp_path):
    torch.save({"model": _net(), "extra": {"config": Config(0.1)}}, tmp_path / "step_5.pt")
    name = f"{__name__}.Config"
    with pytest.raises(UnsafePickleError) as caught:
        open_checkpoint(tmp_path / "step_5.pt")
    message = str(caught.value)
    assert f"refers to {name} under key 'extra.config', which is not allowed; nothing from the file was run" in message
    assert f"pass inert_globals={name}" in message and "skip" not in message
    result = runner.invoke(app, ["accumulate", str(tmp_path), "--decay", "0.9", "--out", str(tmp_path / "ema")])
    assert result.exit_code == 3 and f"pass --inert-global {name}" in result.output, result.output
    assert "--skip-damaged" not in result.output and "Traceback" not in result.output
    ok = runner.invoke(app, ["accumulate", str(tmp_path), "--decay", "0.9", "--out", str(tmp_path / "ema"),
                             "--inert-global", f"{__name__}.*"])
    assert ok.exit_code == 0, ok.output
    assert _equal(_read_all(tmp_path / "step_5.pt", inert_globals=(name,)), _net())


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_code_in_a_pickle_never_runs_and_no_flag_lets_it(tmp_path, monkeypatch, protocol):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": _net(), "x": _Exploit()}, tmp_path / "evil.pt", pickle_protocol=protocol)
    with pytest.raises(UnsafePickleError, match=r"refers to (posix|os)\.system under key 'x'.*a function, not data"):
        open_checkpoint(tmp_path / "evil.pt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "evil.pt")])
    assert result.exit_code == 3 and "--inert-global" not in result.output
    # the option refuses to list them (tests/test_reader_bounds.py); forced past it, still only read as data
    with pytest.raises(OptionError, match="posix"):
        ReadOptions(inert_globals=("posix.*", "os.*"))
    forced = ReadOptions()
    object.__setattr__(forced, "inert_globals", ("posix.*", "os.*"))
    with open_checkpoint(tmp_path / "evil.pt", read=forced) as reader:
        assert sorted(reader.specs()) == sorted(_net())
    assert not (tmp_path / "pwned.txt").exists()


class Detector(torch.nn.Module):  # a model class of the training code, pickled whole (ultralytics' best.pt)
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_a_whole_pickled_module_is_read_for_its_weights(tmp_path):
    torch.manual_seed(0)
    model, ema = Detector().half(), Detector().half()
    torch.save({"epoch": 3, "model": model, "ema": ema, "optimizer": None}, tmp_path / "best.pt")
    with pytest.raises(UnsafePickleError, match=rf"refers to {__name__}\.Detector under key 'model'.* a pickled "
                                                rf"module, whose weights can be read, pass inert_globals="):
        open_checkpoint(tmp_path / "best.pt")
    read = _read_all(tmp_path / "best.pt", inert_globals=(f"{__name__}.*",))
    assert _equal(read, model.state_dict())  # parameters and persistent buffers, by the module's own names
    assert _equal(_read_all(tmp_path / "best.pt", inert_globals=(f"{__name__}.*",), state_key="ema"),
                  ema.state_dict())
    torch.save(torch.nn.Linear(2, 3), tmp_path / "linear.pt")  # torch's own modules need no flag
    assert sorted(_read_all(tmp_path / "linear.pt")) == ["bias", "weight"]


def test_enums_and_configs_of_known_trainers_pass_but_others_are_named(tmp_path):
    torch.save({"model": _net(), "mode": Mode.TRAIN}, tmp_path / "m.pt")
    with pytest.raises(UnsafePickleError, match=rf"{__name__}\.Mode under key 'mode'"):
        open_checkpoint(tmp_path / "m.pt")


# --- torch's two serializations ---------------------------------------------------------------


def test_the_legacy_serialization_reads_as_the_zip_one(tmp_path):
    state = {"model": _net(), "epoch": 2, "args": argparse.Namespace(lr=1.0)}
    state["model"]["tied"] = state["model"]["0.weight"]
    torch.save(state, tmp_path / "zip.pth")
    torch.save(state, tmp_path / "old.pth.tar", _use_new_zipfile_serialization=False)
    assert _equal(_read_all(tmp_path / "zip.pth"), _read_all(tmp_path / "old.pth.tar"))
    report = inspect_checkpoint(tmp_path / "old.pth.tar")
    assert report.details["serialization"] == "legacy (torch < 1.6)" and report.details["container"] == "model"
    cut = tmp_path / "cut.pth"
    cut.write_bytes((tmp_path / "old.pth.tar").read_bytes()[:-8])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        open_checkpoint(cut)


# --- which state dict -------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "container", "prefix"), [
    ({"model": {"state_dict": {"w": 1.0}}, "epoch": 1}, "model.state_dict", None),
    ({"generator": {"w": 1.0}, "discriminator": {"w": 2.0}}, "", None),
    ({"student": {"a.w": 1.0, "a.b": 1.0}, "teacher": {"a.w": 1.0}, "epoch": 1}, "student", None),
    ({"w": 1.0, "b": 2.0, "epoch": 3}, "", None),
    ({"state_dict": {"module._orig_mod.w": 1.0, "module._orig_mod.b": 1.0}}, "state_dict", "module._orig_mod."),
    ({"model": {"model.w": 1.0, "model.b": 1.0}}, "model", None),  # a module named model: kept
    ({"optimizer": {"w": 1.0}, "net": {"w": 1.0}}, "net", None),
])
def test_the_obvious_state_dict_is_taken(state, container, prefix):
    found = candidates(state, is_tensor=lambda v: isinstance(v, float), nbytes=lambda v: 4)
    assert found and found[0].name == container
    assert wrapper_prefix(list(found[0].tensors)) == prefix


@st.composite
def trees(draw, depth=0):
    keys = st.sampled_from(["model", "state_dict", "optimizer", "ema", "w", "b", "layer", "lr_scheduler", "args",
                            "callbacks", "epoch", "net", "x.y"])
    leaves = st.one_of(st.floats(allow_nan=False), st.integers(0, 9), st.text(max_size=3))
    if depth >= 3:
        return draw(st.dictionaries(keys, leaves, max_size=4))
    return draw(st.dictionaries(keys, st.one_of(leaves, trees(depth + 1)), max_size=5))


@settings(max_examples=300, deadline=None)
@given(tree=trees())
def test_the_choice_never_reads_training_state_and_takes_only_tensors(tree):
    found = candidates(tree, is_tensor=lambda v: isinstance(v, float), nbytes=lambda v: 4)
    for candidate in found:
        assert candidate.tensors and all(isinstance(v, float) for v in candidate.tensors.values())
        assert not any(NON_MODEL.search(str(part)) for part in candidate.path), candidate.path
        assert not any(NON_MODEL.search(name.split(".")[0]) for name in candidate.tensors) or candidate.strict


def test_state_key_takes_any_state_dict_and_names_the_others_when_wrong(tmp_path):
    torch.save({"state_dict": _net(0), "state_dict_ema": _net(1), "epoch": 1}, tmp_path / "c.pth.tar")
    assert _equal(_read_all(tmp_path / "c.pth.tar"), _net(0))
    assert _equal(_read_all(tmp_path / "c.pth.tar", state_key="state_dict_ema"), _net(1))
    with pytest.raises(CheckpointFormatError, match=r"no state dict at state_key=nope .*'state_dict', "
                                                    r"'state_dict_ema'"):
        _read_all(tmp_path / "c.pth.tar", state_key="nope")
    assert inspect_checkpoint(tmp_path / "c.pth.tar").details["other_state_dicts"] == ["state_dict_ema"]


def test_a_tensor_subclass_in_the_model_is_named(tmp_path):
    torch.save({"model": {"w": torch.ones(2).to_sparse()}}, tmp_path / "s.pt")
    with pytest.raises(CheckpointFormatError, match=r"key 'model.w': torch._utils._rebuild_sparse_tensor tensors"):
        open_checkpoint(tmp_path / "s.pt")


# --- inert data written back -------------------------------------------------------------------


plain = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), st.binary()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4),
                            st.tuples(inner, inner)),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=plain, protocol=st.integers(2, 5))
def test_inert_data_is_written_back_as_it_was(value, protocol):
    assert pickle.loads(dumps_inert(load_tree(pickle.dumps(value, protocol), "x").root)) == value


def test_objects_are_written_back_as_the_trainer_saved_them():
    value = {"args": argparse.Namespace(lr=0.1, path=pathlib.Path("/a")), "d": collections.OrderedDict(x=1),
             "when": datetime.date(2026, 1, 2), "arr": np.arange(3), "s": {1, 2}, "big": 2**80}
    again = pickle.loads(dumps_inert(load_tree(pickle.dumps(value, 2), "x").root))
    assert again["args"] == value["args"] and type(again["d"]) is collections.OrderedDict
    assert again["when"] == value["when"] and (again["arr"] == value["arr"]).all() and again["s"] == {1, 2}


# --- copies, links and files written over -------------------------------------------------------


def test_links_and_copies_of_one_checkpoint_count_once(tmp_path):
    for step in (10, 20):
        torch.save({"model": _net(step), "global_step": step}, tmp_path / f"step={step}.ckpt")
    os.link(tmp_path / "step=20.ckpt", tmp_path / "model_best.ckpt")
    (tmp_path / "last.ckpt").symlink_to("step=20.ckpt")
    shutil.copy(tmp_path / "step=20.ckpt", tmp_path / "zz-copy.ckpt")
    found = discover([tmp_path])
    assert [c.path.name for c in found.checkpoints] == ["step=10.ckpt", "step=20.ckpt"]
    assert sum("the same step 20" in n for n in found.notes) == 3


def test_a_file_written_over_with_a_newer_step_is_folded_again(tmp_path):
    """nanoGPT's ckpt.pt: one path, a new checkpoint at every save."""
    states = {}
    for step in (2, 4, 6):
        states[step] = _net(step)
        torch.save({"model": states[step], "iter_num": step}, tmp_path / "ckpt.pt")
        os.utime(tmp_path / "ckpt.pt", ns=(step * 10**9, step * 10**9))
        result = accumulate(tmp_path, decay=0.5, out=tmp_path / "ema")
        assert result.step == step and [c.step for c in result.folded] == [step]
    manifest = json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == [2, 4, 6]
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = load_file(tmp_path / "ema.safetensors")
    want = {k: 0.0625 * states[2][k].double() + 0.1875 * states[4][k].double() + 0.75 * states[6][k].double()
            for k in states[2]}
    assert all(torch.allclose(got[k].double(), want[k], rtol=1e-6, atol=1e-7) for k in want)
    # the same file going back in steps is a rollback, not a new checkpoint
    torch.save({"model": _net(9), "iter_num": 4}, tmp_path / "ckpt.pt")
    with pytest.raises(IncompatibleCheckpointError, match=r"ckpt\.pt \(step 6\) was folded into .* written again"):
        accumulate(tmp_path, decay=0.5, out=tmp_path / "ema")


def test_an_omegaconf_config_is_read_and_carried_into_a_lightning_checkpoint(tmp_path):
    from omegaconf import DictConfig, OmegaConf

    config = OmegaConf.create({"model": {"hidden": 8, "layers": [1, 2]}, "optim": {"lr": 0.1}})
    for step in (2, 4):
        torch.save({"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.6",
                    "state_dict": _net(step), "hyper_parameters": config, "hparams_name": "cfg",
                    "optimizer_states": [{"state": {0: {"step": torch.tensor(float(step))}}}]},
                   tmp_path / f"epoch=0-step={step}.ckpt")
    accumulate(tmp_path, decay=0.5, out=tmp_path / "ema")
    consolidate(tmp_path / "ema", tmp_path / "ema.ckpt")
    saved = torch.load(tmp_path / "ema.ckpt", weights_only=False)
    assert isinstance(saved["hyper_parameters"], DictConfig) and saved["hyper_parameters"] == config
    assert saved["global_step"] == 4 and saved["hparams_name"] == "cfg" and "optimizer_states" not in saved
    assert sorted(saved["state_dict"]) == sorted(_net())


def test_shared_and_self_holding_data_is_written_back_as_it_was():
    inner: list = [1]
    inner.append(inner)
    value = {"a": inner, "b": inner, "t": (inner,)}
    again = pickle.loads(dumps_inert(load_tree(pickle.dumps(value, 2), "x").root))
    assert again["a"] is again["b"] is again["a"][1] is again["t"][0]
