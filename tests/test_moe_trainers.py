"""Mixture-of-experts checkpoints saved with expert parallelism by the trainers' own code, on 2 gloo
ranks (``tests/producers/trainers/moe_trainers.py``; README of ``tests/fixtures/trainers``):

* ``megatron-moe-ep2``: megatron-core 0.16.1 ``GPTModel`` with MoE layers, EP=2 (allgather
  dispatcher, SequentialMLP experts), ``dist_checkpointing.save`` in the ``torch_dist`` format; the
  experts stacked as ``decoder.layers.mlp.experts.experts.*`` [layers, experts, ...] with the expert
  dim split over the ranks, the router's ``expert_bias`` beside them;
* ``torchtitan-moe-ep2``: torchtitan 0.3.0 Qwen3 MoE under FSDP2 + EP=2, ``CheckpointManager``; the
  grouped experts ``w1_EFD``/``w2_EDF``/``w3_EFD`` sharded on the expert dim over the ``ep`` mesh
  dimension, the router's ``expert_bias_E`` beside them.

Each is averaged against a float64 reference built from torch's own ``dcp_to_torch_save`` of every
step; the router's load-balancing bias is taken from the newest checkpoint (averaged with
``average_buffers``); the output is laid out like the newest checkpoint and ``dcp.load`` reads it
into the same keys and shapes. The frameworks' own loaders read such averages in the producer
(``dist_checkpointing.load`` with EP=2 and EP=1, torchtitan's ``CheckpointManager``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

from ema_ckpt import accumulate, average, consolidate
from ema_ckpt.cli import app
from ema_ckpt.discovery import discover
from ema_ckpt.maths import ExponentialProfile
from ema_ckpt.selection import is_non_weight_buffer
from tests.ema_reference import assert_close_relative, full_load, reference_ema
from tests.test_changing_layouts import _chunks
from tests.test_trainers import FIXTURES, checkpoints_of, oracle

runner = CliRunner()
MEGATRON, TITAN = "megatron-moe-ep2", "torchtitan-moe-ep2"
TRAINING_STATE = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
EXPERTS = {
    MEGATRON: {
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 8, 16),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 16, 8),
        "decoder.layers.mlp.router.weight": (2, 4, 16),
    },
    TITAN: {
        "layers.0.moe.routed_experts.inner_experts.w1_EFD": (4, 8, 16),
        "layers.0.moe.routed_experts.inner_experts.w2_EDF": (4, 16, 8),
        "layers.0.moe.routed_experts.inner_experts.w3_EFD": (4, 8, 16),
        "layers.0.moe.router.gate.weight": (4, 16),
    },
}
ROUTER_BIAS = {MEGATRON: ["decoder.layers.mlp.router.expert_bias"], TITAN: ["layers.0.moe.expert_bias_E"]}
BIAS_SHAPE = {MEGATRON: (2, 4), TITAN: (4,)}
# torchtitan 0.3.0 names its buffers with shape suffixes (expert_bias_E, tokens_per_expert_E): until
# NON_WEIGHT_BUFFERS knows them, an average averages expert_bias_E like a weight. Strict: the tests
# below become plain tests (and must pass) as soon as is_non_weight_buffer says yes.
TITAN_RULE = pytest.mark.xfail(
    not is_non_weight_buffer(ROUTER_BIAS[TITAN][0]), strict=True,
    reason="ema_ckpt.selection.NON_WEIGHT_BUFFERS lacks torchtitan 0.3.0's 'expert_bias_E'")


def _steps(name: str) -> list[int]:
    return [info["optimizer_step"] for _, info in checkpoints_of(name)]


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, tuple[Path, list[Path], list[dict[str, torch.Tensor]]]]:
    """Per set: a private copy (nothing committed is ever written), its checkpoints oldest first,
    and each one's model tensors by torch's own ``dcp_to_torch_save`` (training state left out)."""
    root = tmp_path_factory.mktemp("moe-trainers")
    out = {}
    for name in (MEGATRON, TITAN):
        work = root / name
        shutil.copytree(FIXTURES / name, work, ignore=shutil.ignore_patterns("oracle"))
        paths = [work / rel for rel, _ in checkpoints_of(name)]
        states = []
        for path in paths:
            full = full_load(path, root)
            states.append({k: v for k, v in full.items() if not k.startswith(TRAINING_STATE)})
        out[name] = (work, paths, states)
    return out


def _uniform(states: list[dict[str, torch.Tensor]], bias: list[str], average_buffers: bool = False):
    return {k: v if k in bias and not average_buffers else sum(s[k].double() for s in states) / len(states)
            for k, v in states[-1].items()}


def _expert_ranks(path: Path, key: str) -> dict[int, int]:
    """{first expert of each stored chunk: the rank whose file holds it} (``__<rank>_<n>.distcp``)."""
    expert_dim = 1 if key.startswith("decoder.layers.") else 0  # megatron stacks layers first
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return {index.offset[expert_dim]: int(info.relative_path.split("_")[2])
            for index, info in meta.storage_data.items() if index.fqn == key}


@pytest.mark.parametrize("name", [MEGATRON, TITAN])
def test_the_experts_are_read_whole_from_their_ep_ranks(name, sets, tmp_path):
    _work, paths, states = sets[name]
    assert [c.step for c in discover([paths[0].parent]).checkpoints] == _steps(name)
    for (rel, info), path, state in zip(checkpoints_of(name), paths, states, strict=True):
        for key, shape in EXPERTS[name].items():
            assert tuple(state[key].shape) == shape, (rel, key)
        for key in ROUTER_BIAS[name]:
            assert tuple(state[key].shape) == BIAS_SHAPE[name] and state[key].dtype == torch.float32
        # EP=2: experts 0-1 were written by rank 0, experts 2-3 by rank 1
        experts = next(k for k in EXPERTS[name] if ".experts." in k or "inner_experts" in k)
        assert _expert_ranks(path, experts) == (
            {0: 0, 1: 0, 2: 1, 3: 1} if name == MEGATRON else {0: 0, 2: 1})
        own = oracle(name, info)
        if name == MEGATRON:  # megatron's own dist_checkpointing.load into an EP=1 model
            for layer in range(2):
                for expert in range(4):
                    assert torch.equal(
                        state["decoder.layers.mlp.experts.experts.linear_fc2.weight"][layer, expert],
                        own[f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"])
                assert torch.equal(state["decoder.layers.mlp.router.expert_bias"][layer],
                                   own[f"decoder.layers.{layer}.mlp.router.expert_bias"])
        else:
            assert sorted(own) == sorted(state) and all(torch.equal(own[k], state[k]) for k in own)
        consolidate(path, tmp_path / f"{rel}.safetensors")
        got = load_file(tmp_path / f"{rel}.safetensors")
        assert sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state)
    # the bias moves by counting tokens between saves, so "the newest" and "the average" differ
    bias = ROUTER_BIAS[name][0]
    assert not torch.equal(states[0][bias], states[-1][bias])


def _check_average(name: str, sets, tmp_path: Path, *, average_buffers: bool = False) -> None:
    work, paths, states = sets[name]
    result = average(work, out=tmp_path / "avg", last=3, average_buffers=average_buffers)
    output = Path(result.outputs[0])
    got = full_load(output, tmp_path)
    want = _uniform(states, ROUTER_BIAS[name], average_buffers)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if key in ROUTER_BIAS[name] and not average_buffers:
            assert torch.equal(got[key], states[-1][key]), key  # copied from the newest
        else:
            assert_close_relative(got[key], value, rel=1e-6)
    # laid out like the newest checkpoint, each expert where its EP rank wrote it
    assert _chunks(output) == {k: v for k, v in _chunks(paths[-1]).items() if k in got}
    # dcp.load reads it into the model's keys and shapes (what both frameworks' loaders call)
    state = {k: torch.full(v.shape, float("nan")) for k, v in want.items()}
    dcp.load(state, checkpoint_id=str(output), no_dist=True)
    assert all(torch.equal(state[k], got[k].float()) for k in state)
    if name == MEGATRON:  # what dist_checkpointing.load needs beside the tensors
        assert (output / "common.pt").is_file() and (output / "metadata.json").is_file()


@pytest.mark.fast
def test_megatron_ep2_average_matches_float64_with_the_newest_expert_bias(sets, tmp_path):
    _check_average(MEGATRON, sets, tmp_path)


@pytest.mark.parametrize("name", [MEGATRON, TITAN])
def test_average_buffers_averages_the_router_bias_with_the_weights(name, sets, tmp_path):
    _check_average(name, sets, tmp_path, average_buffers=True)


@TITAN_RULE
def test_torchtitan_ep2_average_takes_expert_bias_E_from_the_newest(sets, tmp_path):
    _check_average(TITAN, sets, tmp_path)


@pytest.mark.parametrize("name", [MEGATRON, pytest.param(TITAN, marks=TITAN_RULE)])
def test_accumulate_by_the_cli_matches_a_float64_ema(name, sets, tmp_path):
    work, _paths, states = sets[name]
    result = runner.invoke(app, ["accumulate", str(work), "--decay", "0.8", "--out", str(tmp_path / "ema")])
    assert result.exit_code == 0, result.output
    keep = ExponentialProfile(0.8).keep_factor
    want = reference_ema(states, _steps(name), keep)
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = load_file(tmp_path / "ema.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if key in ROUTER_BIAS[name]:
            assert torch.equal(got[key], states[-1][key]), key
        else:
            assert_close_relative(got[key], value, rel=1e-6)
    again = accumulate(work, decay=0.8, out=tmp_path / "ema")
    assert not again.folded  # up to date
