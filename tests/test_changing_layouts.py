"""Sequences whose parallel layout changes between checkpoints, as when a job resumes on other
nodes: FSDP2 on 1, 2 then 4 ranks; DeepSpeed ZeRO-3 on 2 then 3 ranks; Megatron TP 1 then 2.
Each is averaged against a float64 reference built from the checkpoints' own oracles, and
the output is laid out like the newest checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ema_ckpt import accumulate, consolidate, posthoc
from ema_ckpt.maths import ExponentialProfile
from tests.ds_fixtures import CONFIGS, ds_run, zero_to_fp32  # noqa: F401  (fixtures)
from tests.ema_reference import assert_close_relative, full_load, reference_ema
from tests.test_trainers import FIXTURES, assert_loads_on_ranks, checkpoints_of, megatron_oracle

DECAY = 0.9


def _keep(prev: int, step: int) -> float:
    return ExponentialProfile(DECAY).keep_factor(prev, step)


def _chunks(path: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Every tensor's stored chunks (offsets, sizes) holding data, read by torch's own reader
    (FSDP2 also lists an empty chunk for a rank past a tensor's rows)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, item in meta.state_dict_metadata.items():
        chunks = getattr(item, "chunks", None)
        if chunks is not None:
            out[key] = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks if all(c.sizes))
    return out


def test_fsdp2_on_one_two_then_four_ranks(fsdp_sequence, tmp_path):
    """Steps 3 and 7 saved by 1 rank, 20 by 2, 21 and 30 by 4 (each run from the same seed)."""
    runs = {1: fsdp_sequence("fsdp2", 1), 2: fsdp_sequence("fsdp2", 2), 4: fsdp_sequence("fsdp2", 4)}
    picks = [(1, 0), (1, 1), (2, 2), (4, 3), (4, 4)]
    ckpts = tmp_path / "ckpts"
    for world, index in picks:
        shutil.copytree(runs[world][index], ckpts / runs[world][index].name)
    sources = [ckpts / runs[w][i].name for w, i in picks]
    steps = [int(p.name.split("_")[1]) for p in sources]
    states = [full_load(p, tmp_path) for p in sources]
    result = accumulate(ckpts, decay=DECAY, out=tmp_path / "ema")
    assert [c.step for c in result.folded] == steps
    want = reference_ema(states, steps, _keep)
    got = full_load(tmp_path / "ema", tmp_path)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key], value)
    ema_chunks = _chunks(tmp_path / "ema")
    assert ema_chunks == {k: v for k, v in _chunks(sources[-1]).items() if k in ema_chunks}
    assert len(list((tmp_path / "ema").glob("*.distcp"))) == len(list(sources[-1].glob("*.distcp")))
    # a post-hoc EMA over the same mixed sequence loads as the newest layout too
    swept = posthoc(ckpts, out=tmp_path / "posthoc", sigma_rels=["0.2"])
    assert _chunks(swept.outputs[0]).keys() <= _chunks(sources[-1]).keys()


def test_deepspeed_zero3_on_two_then_three_ranks(ds_run, zero_to_fp32, tmp_path):  # noqa: F811
    two = next(c for c in CONFIGS if c.name == "z3-bf16-w2")
    three = next(c for c in CONFIGS if c.name == "z3-bf16-w3")
    ckpts = tmp_path / "save"
    sources = [(ds_run(two), "global_step2"), (ds_run(two), "global_step3"), (ds_run(three), "global_step7")]
    for folder, tag in sources:
        shutil.copytree(folder / tag, ckpts / tag)
    (ckpts / "latest").write_text("global_step7")
    result = accumulate(ckpts, decay=DECAY, out=tmp_path / "ema")
    assert [c.step for c in result.folded] == [2, 3, 7]
    states = [zero_to_fp32(folder, tag) for folder, tag in sources]
    want = reference_ema(states, [2, 3, 7], _keep)
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = load_file(tmp_path / "ema.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key], value)


def test_megatron_tensor_parallel_one_then_two(tmp_path):
    """iter 2 and 5 saved with TP 1, iter 7 with TP 2 (the same model and seed)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    picks = [("megatron-torch-dist", "iter_0000002"), ("megatron-torch-dist", "iter_0000005"),
             ("megatron-torch-dist-tp2", "iter_0000007")]
    for name, rel in picks:
        shutil.copytree(FIXTURES / name / rel, ckpts / rel)
    (ckpts / "latest_checkpointed_iteration.txt").write_text("7")
    steps = {rel: info["optimizer_step"] for name, _ in picks for rel, info in checkpoints_of(name)}
    result = accumulate(ckpts, decay=DECAY, out=tmp_path / "ema")
    assert [c.step for c in result.folded] == [steps[rel] for _, rel in picks]
    want = reference_ema([megatron_oracle(name, rel) for name, rel in picks], [steps[rel] for _, rel in picks], _keep)
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = load_file(tmp_path / "ema.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key], value)
    newest = FIXTURES / "megatron-torch-dist-tp2" / "iter_0000007"
    ema_chunks = _chunks(tmp_path / "ema")
    assert ema_chunks == {k: v for k, v in _chunks(newest).items() if k in ema_chunks}
    assert_loads_on_ranks(tmp_path / "ema", {k: v.to(torch.float32) for k, v in want.items()}, tmp_path)


def test_an_ema_of_two_rank_checkpoints_folds_three_rank_ones_later(fsdp_sequence, tmp_path):
    """A cron run after the job resumed on another number of ranks: the EMA takes the new layout."""
    first, later = fsdp_sequence("fsdp2", 2), fsdp_sequence("fsdp2", 3)
    ckpts = tmp_path / "ckpts"
    for path in first[:2]:
        shutil.copytree(path, ckpts / path.name)
    accumulate(ckpts, decay=DECAY, out=tmp_path / "ema")
    for path in later[2:]:
        shutil.copytree(path, ckpts / path.name)
    again = accumulate(ckpts, decay=DECAY, out=tmp_path / "ema")
    assert [c.step for c in again.folded] == [int(p.name.split("_")[1]) for p in later[2:]]
    assert len(list((tmp_path / "ema").glob("*.distcp"))) == len(list(later[-1].glob("*.distcp")))
