"""Real FSDP1/FSDP2 checkpoint sequences (torchrun + gloo on CPU), checked with torch's own tools.

The float32/bfloat16 sequences come from conftest's session fixture ``fsdp_sequence``: the copies
``tests.producers.sequences`` committed (checked here against a fresh run), shared with other tests.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tests.producers.launch import make_fsdp_sequence
from tests.torchrun import free_port

# name -> (shape, sharded by FSDP?)
MODEL_KEYS: dict[str, tuple[tuple[int, ...], bool]] = {
    "emb.weight": ((11, 5), True),
    "proj.weight": ((13, 5), True),
    "proj.bias": ((13,), True),
    "norm.weight": ((13,), True),
    "norm.bias": ((13,), True),
    "fc1.weight": ((97, 13), True),
    "fc1.bias": ((97,), True),
    "fc2.weight": ((13, 97), True),
    "fc2.bias": ((13,), True),
    "out.weight": ((7, 13), True),
    "out.bias": ((7,), True),
    "feat.weight": ((4, 7), True),
    "head.weight": ((2, 4), True),  # dim 0 < world size 3: an empty shard
    "head.scale": ((1,), True),  # FSDP rejects 0-d params, so 1 element
    "running_stat": ((7,), False),  # float buffer, replicated
    "running_loss": ((), False),  # 0-d float buffer, replicated
    "num_batches_tracked": ((), False),  # int64 buffer, replicated
}
PARAM_NAMES = [k for k, (_, sharded) in MODEL_KEYS.items() if sharded]

# Configurations shared with the rest of the suite through conftest's session fixture
# ``fsdp_sequence(kind, world_size, dtype, with_optim)``, so a full run launches them once.
F32_WITH_OPTIM = {2: False, 3: True}  # with_optim used for the float32 pair at each world size
BF16_RUN = ("fsdp2", 2, "bfloat16", False)


def _step_of(ckpt: Path) -> int:
    m = re.fullmatch(r"step_(\d+)", ckpt.name)
    assert m, ckpt
    return int(m.group(1))


@pytest.fixture(scope="module")
def sequences(fsdp_sequence) -> dict[tuple[str, int, str, bool], list[Path]]:
    runs = {(kind, w, "float32", F32_WITH_OPTIM[w]) for kind in ("fsdp1", "fsdp2") for w in (2, 3)} | {BF16_RUN}
    return {run: fsdp_sequence(*run) for run in sorted(runs)}


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _torch_load_dcp(ckpt: Path, tmp: Path) -> dict:
    target = tmp / f"{ckpt.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, target)
    return _flatten(torch.load(target, map_location="cpu", weights_only=True))


def _expected_chunks(shape: tuple[int, ...], world: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Non-empty dim-0 ``torch.chunk`` pieces: ceil(n / world) rows per rank."""
    if len(shape) == 0:
        return [((), ())]
    rows = math.ceil(shape[0] / world)
    chunks = []
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        chunks.append(((start, *[0] * (len(shape) - 1)), (n, *shape[1:])))
    # cross-check against torch.chunk itself
    assert [c[1][0] for c in chunks] == [t.shape[0] for t in torch.chunk(torch.empty(shape[0]), world)]
    return chunks


def _chunks(md_entry: TensorStorageMetadata, *, drop_empty: bool = True) -> list:
    got = [(tuple(c.offsets), tuple(c.sizes)) for c in md_entry.chunks]
    if drop_empty:
        got = [c for c in got if math.prod(c[1]) > 0 or len(c[1]) == 0]
    return sorted(got)


def test_free_port() -> None:
    p = free_port()
    assert 0 < p < 65536


def test_sequence_dirs(sequences) -> None:
    for (kind, world, _, _), dirs in sequences.items():
        steps = [_step_of(d) for d in dirs]
        assert len(steps) >= 4 and steps == sorted(set(steps)), (kind, world, steps)
        assert len({d.parent for d in dirs}) == 1
        for d in dirs:
            assert (d / ".metadata").is_file()
            assert sorted(p.name for p in d.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]


def test_checkpoints_load_with_torch_tools(sequences, tmp_path: Path) -> None:
    for (kind, world, dtype, with_optim), dirs in sequences.items():
        float_dtype = getattr(torch, dtype)
        for ckpt in dirs:
            step = _step_of(ckpt)
            sd = _torch_load_dcp(ckpt, tmp_path)
            assert all(k.startswith(("model.", "optim.")) for k in sd), sorted(sd)
            model = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
            assert set(model) == set(MODEL_KEYS), (kind, world, sorted(model))
            for name, (shape, _) in MODEL_KEYS.items():
                t = model[name]
                assert tuple(t.shape) == shape, (kind, world, name, t.shape)
                if name == "num_batches_tracked":
                    assert t.dtype == torch.int64
                    assert int(t) == step
                else:
                    assert t.dtype == float_dtype, (kind, world, name, t.dtype)
                    assert torch.isfinite(t.float()).all()

            optim = {k: v for k, v in sd.items() if k.startswith("optim.")}
            if not with_optim:
                assert not optim
                continue
            for p in PARAM_NAMES:
                shape = MODEL_KEYS[p][0]
                assert optim[f"optim.state.{p}.exp_avg"].shape == shape
                assert optim[f"optim.state.{p}.exp_avg_sq"].shape == shape
                st = optim[f"optim.state.{p}.step"]  # AdamW's per-parameter 0-d float32 step
                assert st.dtype == torch.float32 and st.dim() == 0 and float(st) == step
            (group,) = optim["optim.param_groups"]
            assert sorted(group["params"]) == sorted(PARAM_NAMES)
            assert group["lr"] == pytest.approx(0.05)


def test_chunk_layout_fsdp1_vs_fsdp2(sequences) -> None:
    for world in (2, 3):
        run = ("float32", F32_WITH_OPTIM[world])
        md1 = FileSystemReader(sequences[("fsdp1", world, *run)][-1]).read_metadata().state_dict_metadata
        md2 = FileSystemReader(sequences[("fsdp2", world, *run)][-1]).read_metadata().state_dict_metadata
        assert set(md1) == set(md2)
        for fqn in md1:
            if isinstance(md1[fqn], BytesStorageMetadata):  # optimizer param_groups entries
                assert fqn.startswith("optim.param_groups.") and isinstance(md2[fqn], BytesStorageMetadata)
                continue
            e1, e2 = md1[fqn], md2[fqn]
            assert isinstance(e1, TensorStorageMetadata) and isinstance(e2, TensorStorageMetadata)
            assert tuple(e1.size) == tuple(e2.size) and e1.properties.dtype == e2.properties.dtype
            shape = tuple(e1.size)
            if fqn.startswith("model."):
                sharded = MODEL_KEYS[fqn[len("model."):]][1]  # params sharded, buffers replicated
            else:  # optim.state.<param>.{exp_avg,exp_avg_sq} sharded like the param; .step replicated
                assert fqn.startswith("optim.state."), fqn
                sharded = not fqn.endswith(".step")
            expected = _expected_chunks(shape, world) if sharded else [((0,) * len(shape), shape)]
            assert _chunks(e1) == expected, (world, fqn)
            assert _chunks(e2) == expected, (world, fqn)

    # Observed with torch 2.13: FSDP2 also records the empty shards (zero-size chunks) that
    # FSDP1 leaves out, e.g. head.weight (2, 4) on 3 ranks. Make sure the fixture has one.
    md2 = FileSystemReader(sequences[("fsdp2", 3, "float32", True)][-1]).read_metadata().state_dict_metadata
    assert ((2, 0), (0, 4)) in _chunks(md2["model.head.weight"], drop_empty=False)


def test_trajectory_and_fsdp1_fsdp2_agree(sequences, tmp_path: Path) -> None:
    for world in (2, 3):
        run = ("float32", F32_WITH_OPTIM[world])
        seqs = {
            k: [_torch_load_dcp(c, tmp_path) for c in sequences[(k, world, *run)]] for k in ("fsdp1", "fsdp2")
        }
        for a, b in zip(seqs["fsdp1"], seqs["fsdp2"], strict=True):
            # Same seed, same data: FSDP1 and FSDP2 follow the same trajectory (observed: W=2
            # bit-identical, W=3 within ~1e-6 from a different reduction order).
            for k in a:
                if torch.is_tensor(a[k]) and a[k].is_floating_point():
                    torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)
        for kind, sds in seqs.items():
            w_first, w_last = sds[0]["model.fc1.weight"], sds[-1]["model.fc1.weight"]
            assert (w_last - w_first).abs().max() > 0.05, (kind, world)
            mean = torch.stack([sd["model.fc1.weight"] for sd in sds]).mean(0)  # a crude average
            assert (mean - w_last).abs().max() > 0.02, (kind, world)
            rs = torch.stack([sd["model.running_stat"] for sd in sds])
            assert (rs[1:] - rs[:-1]).abs().max() > 1e-3, (kind, world)


def test_rank_local_metadata_and_name_format(tmp_path: Path) -> None:
    dirs = make_fsdp_sequence(
        tmp_path / "rl", kind="fsdp2", world_size=2, steps=[2, 0], dtype="bfloat16",
        with_optim=True, name_format="global_step{step}", rank_local_metadata=True,
    )  # fmt: skip
    assert [d.name for d in dirs] == ["global_step0", "global_step2"]
    for d in dirs:
        assert not (d / ".metadata").exists()
        assert sorted(p.name for p in d.glob("__*.metadata")) == ["__0.metadata", "__1.metadata"]
        for rank in (0, 1):
            md = FileSystemReader(d).read_metadata(rank=rank)
            sdm = md.state_dict_metadata
            # each rank describes only its own shard; replicated tensors appear in every rank's file
            assert _chunks(sdm["model.emb.weight"]) == [_expected_chunks((11, 5), 2)[rank]]
            assert sdm["model.emb.weight"].properties.dtype == torch.bfloat16
            assert _chunks(sdm["model.num_batches_tracked"]) == [((), ())]
            assert sdm["model.num_batches_tracked"].properties.dtype == torch.int64
            assert {s.relative_path for s in md.storage_data.values()} == {f"__{rank}_0.distcp"}
            assert sdm["optim.state.fc1.weight.exp_avg"].properties.dtype == torch.bfloat16
            assert sdm["optim.state.fc1.weight.step"].properties.dtype == torch.float32
            assert _chunks(sdm["optim.state.fc1.weight.step"]) == [((), ())]

    # Saving optimizer state before the first step makes torch's get_state_dict() initialise
    # AdamW with a fake lr=0 step (state_dict._init_optim_state), so the saved AdamW ``step``
    # runs one ahead of the real optimizer-step count for the rest of that run.
    got = {
        "optim.state.fc1.weight.step": torch.zeros(()),
        "model.num_batches_tracked": torch.zeros((), dtype=torch.long),
    }
    dcp.load(got, checkpoint_id=dirs[-1], no_dist=True)  # falls back to __0.metadata
    assert int(got["model.num_batches_tracked"]) == 2
    assert float(got["optim.state.fc1.weight.step"]) == 3.0


def test_the_committed_sequences_are_what_the_producer_writes(tmp_path: Path) -> None:
    """The suite reads committed sequences (``tests/producers/sequences.py``): the producer, run
    again, writes the same tensor bytes and the same metadata (but its random save id)."""
    from tests.producers import sequences

    run = ("fsdp2", 2, "float32", True)
    committed = sequences.committed(sequences.fsdp_name(*run))
    assert committed is not None, "tests/fixtures/sequences lacks fsdp2-w2-float32-optim: run make fixtures"
    fresh = sequences.build_fsdp(tmp_path / "fresh", *run)
    assert [d.name for d in fresh] == [d.name for d in committed]
    for new, old in zip(fresh, committed, strict=True):
        assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
        for data in new.glob("*.distcp"):
            assert data.read_bytes() == (old / data.name).read_bytes(), data
        got, want = (FileSystemReader(d).read_metadata() for d in (new, old))
        assert got.state_dict_metadata == want.state_dict_metadata
        assert got.storage_data == want.storage_data
