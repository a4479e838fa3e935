"""The DeepSpeed ZeRO reader: bit-exact against DeepSpeed's own ``zero_to_fp32``, no DeepSpeed needed.

Real checkpoints come from DeepSpeed training on CPU (torchrun + gloo), one launch per world size
for the whole session; DeepSpeed is the producer and the oracle only, so the tests that need it
skip without it. Synthetic checkpoints written here with plain ``torch.save`` (following the
partitioning rules in the DeepSpeed notes) cover the rest without DeepSpeed: random layouts,
refusals, unsafe pickles.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ema_ckpt.errors import CheckpointFormatError, CheckpointNotFoundError, UnsafePickleError
from ema_ckpt.formats import CheckpointReader, detect_format, open_checkpoint, registered_formats
from ema_ckpt.formats.deepspeed import DeepSpeedReader, deepspeed_tags, incomplete, is_deepspeed
from ema_ckpt.formats.deepspeed.unpickle import fragment_address, load_ds_file
from ema_ckpt.layout import Box, TensorSpec
from tests.ds_fixtures import CONFIGS, STEPS, ZERO_TO_FP32_CONFIGS, Config

REPO = Path(__file__).resolve().parents[1]


# --- real DeepSpeed fixtures -----------------------------------------------------------------




def _ids(configs):
    return [c.name for c in configs]


def _full(reader, key):
    return reader.read(key, Box.full(reader.specs()[key].shape))


@pytest.mark.parametrize("config", ZERO_TO_FP32_CONFIGS, ids=_ids(ZERO_TO_FP32_CONFIGS))
def test_every_key_of_zero_to_fp32_is_bit_exact(ds_run, zero_to_fp32, config):
    folder = ds_run(config)
    for step in STEPS:
        tag = f"global_step{step}"
        expected = zero_to_fp32(folder, tag)
        with open_checkpoint(folder / tag) as reader:
            specs = reader.specs()
            for key, value in expected.items():
                assert key in specs, key
                assert specs[key].shape == tuple(value.shape), key
                assert specs[key].dtype == value.dtype, key
                got = _full(reader, key)
                assert got.dtype == value.dtype and torch.equal(got, value), key
            extra = set(specs) - set(expected)
            # zero_to_fp32 drops frozen parameters at ZeRO-1; we keep them.
            assert extra == ({"frozen.weight", "frozen.bias"} if config.stage == 1 else set())


@pytest.mark.parametrize("config", CONFIGS, ids=_ids(CONFIGS))
def test_trainable_weights_equal_deepspeeds_live_fp32_masters(ds_run, config):
    folder = ds_run(config)
    for step in STEPS:
        masters = torch.load(folder / f"masters_step{step}.pt", weights_only=True)
        with open_checkpoint(folder / f"global_step{step}") as reader:
            assert reader.info()["optimizer"] == ("bf16_optimizer" if config.bf16_optimizer else "zero")
            for key, value in masters.items():
                got = _full(reader, key)
                assert got.dtype == torch.float32 and torch.equal(got, value), key


@pytest.mark.parametrize("config", CONFIGS, ids=_ids(CONFIGS))
def test_frozen_params_present_in_training_dtype(ds_run, config):
    folder = ds_run(config)
    reference = torch.load(folder / "frozen_reference.pt", weights_only=True)
    dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
    with open_checkpoint(folder) as reader:
        assert reader.info()["frozen"] == 2
        for key, value in reference.items():
            assert reader.specs()[key].dtype == dtype
            assert torch.equal(_full(reader, key), value.to(dtype)), key


@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c.stage == 1], ids=_ids([c for c in CONFIGS if c.stage == 1])
)
def test_zero1_frozen_params_equal_the_saved_module(ds_run, config):
    tag_dir = ds_run(config) / "global_step7"
    saved = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")[
        "module"
    ]
    with open_checkpoint(tag_dir) as reader:
        for key in ("frozen.weight", "frozen.bias"):
            assert torch.equal(_full(reader, key), saved[key])


@pytest.mark.parametrize("config", CONFIGS[:6], ids=_ids(CONFIGS[:6]))
def test_buffers_tied_params_and_info(ds_run, config):
    folder = ds_run(config)
    with open_checkpoint(folder) as reader:  # the save folder: ``latest`` names global_step7
        assert isinstance(reader, CheckpointReader)
        assert reader.format_name == "deepspeed" and reader.step == 7
        info = reader.info()
        assert info == info | {
            "stage": config.stage,
            "world_size": config.world_size,
            "dtype": config.dtype,
            "tag": "global_step7",
            "global_step": 7,
            "master_dtype": "float32",
            "params": 7,
            "frozen": 2,
            "tied": 1,
            "buffers": 2,
            "tensors": 12,
        }
        specs = reader.specs()
        # Integer buffers keep their dtype; each rank's step adds [1, batch, tokens].
        assert specs["seen"].dtype == torch.int64
        assert torch.equal(_full(reader, "seen"), torch.tensor([7, 14, 70]))
        assert specs["scale"].dtype == torch.float32
        # The tied alias reads its owner's data.
        assert specs["head.weight"] == TensorSpec("head.weight", (37, 11), torch.float32)
        assert torch.equal(_full(reader, "head.weight"), _full(reader, "embed.weight"))
        # Keys in the model's state_dict order.
        assert list(specs)[:4] == ["scale", "seen", "embed.weight", "frozen.weight"]
        for key, spec in specs.items():
            assert reader.layout(key) == [Box.full(spec.shape)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_box_read_equals_the_slice_of_the_full_tensor(ds_run, data):
    config = data.draw(st.sampled_from([Config(3, 3, "bf16"), Config(3, 1, "fp32"), Config(2, 2, "bf16")]))
    with open_checkpoint(ds_run(config) / "global_step2") as reader:
        key = data.draw(st.sampled_from(sorted(reader.specs())))
        shape = reader.specs()[key].shape
        offsets = tuple(data.draw(st.integers(0, d)) for d in shape)
        sizes = tuple(data.draw(st.integers(0, d - o)) for d, o in zip(shape, offsets, strict=True))
        box = Box(offsets, sizes)
        got = reader.read(key, box)
        assert got.dtype == reader.specs()[key].dtype
        assert torch.equal(got, _full(reader, key)[box.slices()])


def test_open_by_save_folder_tag_folder_and_hf_trainer_layout(ds_run, tmp_path):
    folder = ds_run(Config(2, 3, "bf16"))
    assert detect_format(folder).name == "deepspeed"
    assert detect_format(folder / "global_step2").name == "deepspeed"
    assert registered_formats()["deepspeed"].records_step
    assert [p.name for p in deepspeed_tags(folder)] == ["global_step2", "global_step3", "global_step7"]
    with open_checkpoint(folder / "global_step2") as reader:
        assert reader.step == 2 and reader.tag == "global_step2"
    # Hugging Face Trainer: output_dir/checkpoint-7/{latest, global_step7/, trainer files}
    hf = tmp_path / "checkpoint-7"
    shutil.copytree(folder / "global_step7", hf / "global_step7")
    (hf / "latest").write_text("global_step7")
    (hf / "trainer_state.json").write_text("{}")
    with open_checkpoint(hf) as reader, open_checkpoint(folder) as original:
        assert reader.tag_dir == hf / "global_step7" and reader.step == 7
        for key in original.specs():
            assert torch.equal(_full(reader, key), _full(original, key))


def test_rank_files_are_memory_mapped_not_read(ds_run):
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    tag_dir = ds_run(Config(3, 3, "bf16")) / "global_step7"
    with DeepSpeedReader(tag_dir) as reader:
        optim_files = {str(p) for p in reader._optim_files}
        for key in ("embed.weight", "fc2.bias"):
            entry = reader._entries[key]
            assert len(entry.pieces) == 3  # one slice per rank
            for piece in entry.pieces:
                ptr = piece.src.data_ptr()
                owners = [
                    line.split()[-1]
                    for line in maps.read_text().splitlines()
                    if (r := line.split()[0].split("-")) and int(r[0], 16) <= ptr < int(r[1], 16)
                ]
                assert owners and owners[0] in optim_files, (key, owners)


# --- refusals and damage on real files --------------------------------------------------------


@pytest.fixture
def tag_copy(ds_run, tmp_path):
    """A writable copy of a W=3 ZeRO-2 bf16 tag folder."""
    src = ds_run(Config(3, 2, "bf16")) / "global_step7"
    dst = tmp_path / "global_step7"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "name, words",
    [
        ("mp_rank_01_model_states.pt", "tensor-parallel"),
        ("layer_01-model_00-model_states.pt", "pipeline"),
        ("expp_rank_0_mp_rank_00_optim_states.pt", "MoE"),
    ],
)
def test_unsupported_layouts_are_refused_naming_the_file(tag_copy, name, words):
    shutil.copy(tag_copy / "mp_rank_00_model_states.pt", tag_copy / name)
    with pytest.raises(CheckpointFormatError, match=words) as err:
        open_checkpoint(tag_copy)
    assert err.value.path == str(tag_copy / name)


def test_missing_last_rank_is_incomplete_and_world_size_mismatch_is_refused(tag_copy):
    (tag_copy / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    assert "2 of the 3" in incomplete(tag_copy)
    assert not is_deepspeed(tag_copy)
    with pytest.raises(CheckpointNotFoundError, match="still being written"):
        open_checkpoint(tag_copy)
    with pytest.raises(CheckpointFormatError, match=r"expected 3 .* found 2"):
        DeepSpeedReader(tag_copy)


def test_gap_in_rank_files_is_incomplete(tag_copy):
    (tag_copy / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert "rank(s) [1] are missing" in incomplete(tag_copy)
    assert detect_format(tag_copy) is None


def test_truncated_rank_file_is_a_format_error_naming_it(tag_copy):
    victim = tag_copy / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError) as err:
        open_checkpoint(tag_copy)
    assert err.value.path == str(victim) and "\n" not in str(err.value)
    victim.write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="empty file"):
        DeepSpeedReader(tag_copy)


def test_reader_without_deepspeed_importable(ds_run, zero_to_fp32, tmp_path):
    """In a fresh interpreter where ``import deepspeed`` fails, the reader still reconstructs.

    Stage 2 files pickle ZeroStageEnum, LossScaler and fragment_address; stage 3 files the first two.
    """
    cases = []
    for i, config in enumerate([Config(3, 2, "bf16"), Config(3, 3, "bf16")]):
        folder = ds_run(config)
        reference = tmp_path / f"expected{i}.pt"
        expected = zero_to_fp32(folder, "global_step7")
        torch.save({k: v.clone() for k, v in expected.items()}, reference)
        cases.append((str(folder), str(reference)))
    stub = tmp_path / "stub" / "deepspeed"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('deepspeed is not installed here')\n")
    script = f"""
import sys
sys.modules["deepspeed"] = None
import torch
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
try:
    import deepspeed
except ImportError:
    pass
else:
    raise SystemExit("deepspeed imported")
for folder, reference in {cases!r}:
    expected = torch.load(reference, weights_only=True)
    with open_checkpoint(folder) as reader:
        for key, value in expected.items():
            got = reader.read(key, Box.full(tuple(value.shape)))
            assert got.dtype == value.dtype and torch.equal(got, value), key
        assert reader.info()["frozen"] == 2
        print("reconstructed", reader.info()["stage"], len(expected))
assert sys.modules["deepspeed"] is None
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(REPO)])}
    env.pop("DS_ACCELERATOR", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reconstructed 2 12" in proc.stdout and "reconstructed 3 12" in proc.stdout


# --- synthetic checkpoints: no DeepSpeed needed -----------------------------------------------


def _write_zero(
    tag_dir: Path,
    *,
    stage: int,
    world_size: int,
    groups: list[dict[str, torch.Tensor]],
    frozen: dict[str, torch.Tensor] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
    shared: dict[str, str] | None = None,
    step: int = 7,
    sub_group_numel: int = 10,
) -> dict[str, torch.Tensor]:
    """Write a ZeRO checkpoint by DeepSpeed's partitioning rules; returns the expected tensors."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    ws = world_size
    frozen, buffers, shared = frozen or {}, buffers or {}, shared or {}
    params = {k: v for g in groups for k, v in g.items()}
    module = OrderedDict(list(buffers.items()) + list(params.items()) + list(frozen.items()))
    module.update({alias: params[owner] for alias, owner in shared.items()})
    common = {
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": None,
        "shared_params": shared,
        "frozen_param_shapes": None,
        "frozen_param_fragments": None,
        "global_steps": step,
        "dp_world_size": ws,
        "mp_world_size": 1,
        "ds_version": "synthetic",
    }
    optim: list[dict] = [{} for _ in range(ws)]
    if stage <= 2:
        common["param_shapes"] = [OrderedDict((k, v.shape) for k, v in g.items()) for g in groups]
        for g in groups:
            flat = torch.cat([v.reshape(-1) for v in g.values()]) if g else torch.zeros(0)
            padded = math.ceil(max(flat.numel(), 1) / (2 * ws)) * 2 * ws
            flat = torch.cat([flat, torch.zeros(padded - flat.numel())])
            part = padded // ws
            real = sum(v.numel() for v in g.values())
            for r in range(ws):
                lo, hi = r * part, min((r + 1) * part, max(real, r * part))  # padding removed
                optim[r].setdefault("single_partition_of_fp32_groups", []).append(flat[lo:hi].clone())
        for r in range(ws):
            optim[r].update(zero_stage=stage, partition_count=[ws] * len(groups))
        if stage == 2:
            common["frozen_param_shapes"] = OrderedDict((k, v.shape) for k, v in frozen.items())
            common["frozen_param_fragments"] = OrderedDict((k, v.clone()) for k, v in frozen.items())
        torch.save({"module": module, **common}, tag_dir / "mp_rank_00_model_states.pt")
    else:
        names = list(params)
        # sub-groups of about ``sub_group_numel`` elements, whole params each
        subgroups, current, size = [], [], 0
        for k in names:
            current.append(k)
            size += params[k].numel()
            if size >= sub_group_numel:
                subgroups.append(current)
                current, size = [], 0
        if current or not subgroups:
            subgroups.append(current)
        common["param_shapes"] = [OrderedDict((k, params[k].shape) for k in sg) for sg in subgroups]
        common["frozen_param_shapes"] = OrderedDict((k, v.shape) for k, v in frozen.items())

        def rank_slice(t: torch.Tensor, r: int) -> torch.Tensor:
            part = math.ceil(t.numel() / ws)
            padded = torch.cat([t.reshape(-1), torch.zeros(part * ws - t.numel(), dtype=t.dtype)])
            return padded[r * part : (r + 1) * part].clone()

        for r in range(ws):
            flat_groups = [
                torch.cat([rank_slice(params[k], r) for k in sg]) if sg else torch.zeros(0)
                for sg in subgroups
            ]
            optim[r].update(zero_stage=3, partition_count=ws, fp32_flat_groups=flat_groups)
            placeholders = OrderedDict((k, torch.empty(0)) if k in params or k in frozen else (k, v)
                                       for k, v in module.items())  # fmt: skip
            state = {
                "module": placeholders,
                **common,
                "shared_params": shared if r == 0 else {},
                "frozen_param_fragments": OrderedDict((k, rank_slice(v, r)) for k, v in frozen.items()),
            }
            torch.save(state, tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    for r in range(ws):
        torch.save({"optimizer_state_dict": optim[r], "ds_version": "synthetic"},
                   tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")  # fmt: skip
    expected = {
        **{k: v.float() if v.is_floating_point() else v for k, v in buffers.items()},
        **params,
        **frozen,
    }
    expected.update({alias: params[owner] for alias, owner in shared.items()})
    return expected


@st.composite
def zero_layouts(draw):
    stage = draw(st.sampled_from([1, 2, 3]))
    ws = draw(st.integers(1, 5))
    n_groups = draw(st.integers(1, 3))
    counter = iter(range(1000))
    groups = []
    for _ in range(n_groups):
        group = {}
        for _ in range(draw(st.integers(1 if stage < 3 else 0, 4))):
            ndim = draw(st.integers(0, 3))
            shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
            group[f"p{next(counter)}"] = torch.randn(
                shape, generator=torch.Generator().manual_seed(len(groups))
            )
        groups.append(group)
    if not any(groups):
        groups[0]["p_last"] = torch.randn(3)
    frozen = (
        {"f.w": torch.randn(draw(st.integers(1, 7)), 3).to(torch.bfloat16)} if draw(st.booleans()) else {}
    )
    return stage, ws, groups, frozen


@settings(max_examples=40, deadline=None)
@given(layout=zero_layouts(), data=st.data())
def test_synthetic_layouts_round_trip_with_any_box(layout, data):
    stage, ws, groups, frozen = layout
    buffers = {"buf.i": torch.arange(5), "buf.f": torch.ones(2, dtype=torch.bfloat16)}
    first = next(k for g in groups for k in g)
    with tempfile.TemporaryDirectory() as tmp:
        tag_dir = Path(tmp) / "global_step7"
        expected = _write_zero(
            tag_dir, stage=stage, world_size=ws, groups=groups, frozen=frozen, buffers=buffers,
            shared={"alias.w": first},
        )  # fmt: skip
        (tag_dir.parent / "latest").write_text("global_step7")
        with open_checkpoint(tag_dir.parent) as reader:
            assert reader.step == 7 and reader.info()["stage"] == stage
            assert set(reader.specs()) == set(expected)
            for key, value in expected.items():
                spec = reader.specs()[key]
                assert spec.shape == tuple(value.shape) and spec.dtype == value.dtype, key
                assert torch.equal(_full(reader, key), value), key
            key = data.draw(st.sampled_from(sorted(expected)))
            shape = tuple(expected[key].shape)
            offsets = tuple(data.draw(st.integers(0, d)) for d in shape)
            box = Box(
                offsets, tuple(data.draw(st.integers(0, d - o)) for d, o in zip(shape, offsets, strict=True))
            )
            assert torch.equal(reader.read(key, box), expected[key][box.slices()])


def test_alignment_paddings_and_zero_size_params(tmp_path):
    """[0.19.8] ``param_alignment_paddings`` put gaps between params of a stage-1/2 group."""
    a, b, c = torch.randn(3, 5), torch.randn(0), torch.randn(7)
    pads = [1, 0, 0]  # a: 15 elements padded to 16
    flat = torch.cat([a.reshape(-1), torch.zeros(1), c])  # 23, padded to 24 for ws=2 (align 4)
    flat = torch.cat([flat, torch.zeros(1)])
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save(
        {"module": {}, "buffer_names": [], "param_shapes": [OrderedDict(a=a.shape, b=b.shape, c=c.shape)],
         "shared_params": {}, "frozen_param_shapes": None, "global_steps": 1, "dp_world_size": 2},
        tag / "mp_rank_00_model_states.pt",
    )  # fmt: skip
    for r, part in enumerate((flat[:12], flat[12:23])):
        osd = {"zero_stage": 2, "partition_count": [2], "single_partition_of_fp32_groups": [part.clone()],
               "param_alignment_paddings": [pads]}  # fmt: skip
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    with open_checkpoint(tag) as reader:
        assert torch.equal(_full(reader, "a"), a) and torch.equal(_full(reader, "c"), c)
        assert reader.specs()["b"].shape == (0,) and reader.layout("b") == []
        assert _full(reader, "b").shape == (0,)


def test_read_errors_are_clear(tmp_path):
    tag = tmp_path / "global_step7"
    _write_zero(tag, stage=2, world_size=2, groups=[{"w": torch.randn(3, 4)}])
    reader = open_checkpoint(tag)
    with pytest.raises(KeyError, match="nope"):
        reader.read("nope", Box((0,), (1,)))
    with pytest.raises(ValueError, match="outside"):
        reader.read("w", Box((2, 0), (2, 4)))
    with pytest.raises(ValueError, match="dims"):
        reader.read("w", Box((0,), (3,)))
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.specs()


def test_layout_that_does_not_add_up_is_refused(tmp_path):
    tag = tmp_path / "global_step7"
    _write_zero(tag, stage=2, world_size=2, groups=[{"w": torch.randn(3, 4)}])
    state = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    state["param_shapes"] = [OrderedDict(w=torch.Size([3, 2]))]
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointFormatError, match="consumed 6 numels out of 12"):
        open_checkpoint(tag)


def test_incomplete_reasons_for_folders_being_written(tmp_path):
    save = tmp_path / "run"
    _write_zero(save / "global_step7", stage=3, world_size=3, groups=[{"w": torch.randn(5)}])
    (save / "latest").write_text("global_step9")
    assert "global_step9" in incomplete(save) and detect_format(save) is None
    (save / "latest").write_text("global_step7")
    assert incomplete(save) is None and is_deepspeed(save)
    (save / "global_step7" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    assert "3 ZeRO-3 model-states files but 2 optimizer files" in incomplete(save)
    for p in (save / "global_step7").glob("*optim_states.pt"):
        p.unlink()
    assert "no *_optim_states.pt" in incomplete(save)
    assert incomplete(tmp_path) is None  # not DeepSpeed at all
    with pytest.raises(CheckpointNotFoundError, match=r"no \*_optim_states\.pt"):
        open_checkpoint(save)


def test_bf16_optimizer_layout_without_zero_stage(tmp_path):
    """BF16_Optimizer keeps group padding in its partitions and records no ``zero_stage``."""
    tag = tmp_path / "global_step7"
    w = torch.randn(5, 3)
    _write_zero(tag, stage=1, world_size=2, groups=[{"w": w}])
    flat = torch.cat([w.reshape(-1), torch.zeros(1)])  # 15 → 16, not stripped
    for r in range(2):
        path = tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        osd = {"single_partition_of_fp32_groups": [flat[r * 8 : (r + 1) * 8].clone()], "partition_count": [2],
               "group_paddings": [0, 1][r : r + 1], "param_slice_mappings": [{}]}  # fmt: skip
        torch.save({"optimizer_state_dict": osd}, path)
    with open_checkpoint(tag) as reader:
        assert reader.info()["optimizer"] == "bf16_optimizer" and reader.info()["stage"] == 1
        assert torch.equal(_full(reader, "w"), w)


# --- unsafe and damaged pickles ---------------------------------------------------------------


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Evaluates:
    def __reduce__(self):
        return (eval, ("__import__('os').system('true')",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_pickle_that_would_run_a_command_is_refused_and_nothing_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    tag = tmp_path / "global_step1"
    _write_zero(tag, stage=2, world_size=2, groups=[{"w": torch.randn(4)}])
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    evil = {"optimizer_state_dict": {"zero_stage": 2, "x": _RunsCommand(f"touch {marker}")}}
    torch.save(evil, victim, pickle_protocol=protocol)
    with pytest.raises(UnsafePickleError) as err:
        open_checkpoint(tag)
    message = str(err.value)
    assert err.value.path == str(victim)
    assert (
        f"refers to {os.system.__module__}.system, which is not allowed; nothing from the file was run"
        in message
    )
    assert "\n" not in message
    assert not marker.exists()
    # the same file straight through the loader; and a builtins global
    with pytest.raises(UnsafePickleError):
        load_ds_file(victim)
    torch.save({"x": _Evaluates()}, victim, pickle_protocol=protocol)
    with pytest.raises(UnsafePickleError, match=r"refers to builtins\.eval"):
        load_ds_file(victim)
    assert not marker.exists()


def test_stand_ins_are_inert_and_only_the_deepspeed_names_are_allowed(tmp_path):
    address = fragment_address.__new__(fragment_address)
    address.__dict__.update(numel=3, start=5)
    assert tuple(address) == (3, 5)
    # A class that merely *claims* a stand-in's role under another name is refused.
    path = tmp_path / "x.pt"
    torch.save({"addr": _RunsCommand("true")}, path)
    with pytest.raises(UnsafePickleError, match="system"):
        load_ds_file(path)
    # Legacy (pre-zip) torch.save files cannot be memory-mapped: read whole, same allowlist.
    torch.save({"t": torch.arange(3)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_ds_file(path)["t"], torch.arange(3))
    torch.save({"x": _RunsCommand("true")}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafePickleError, match="system"):
        load_ds_file(path)
    # A damaged pickle (an opcode that does not exist) is corrupt, not unsafe.
    torch.save({"t": 1}, path)
    with zipfile.ZipFile(path) as zin:
        records = [(info, zin.read(info.filename)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zout:
        for info, data in records:
            zout.writestr(info, b"\x80\x02\xff." if info.filename.endswith("data.pkl") else data)
    with pytest.raises(CheckpointFormatError, match="Unsupported operand 255") as err:
        load_ds_file(path)
    assert not isinstance(err.value, UnsafePickleError)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointFormatError, match=r"not a torch\.save file"):
        load_ds_file(path)
    with pytest.raises(CheckpointNotFoundError):
        load_ds_file(tmp_path / "missing.pt")


def test_released_pages_refault_with_the_same_bytes(tmp_path):
    from ema_ckpt.formats.deepspeed.unpickle import load_ds_file_releasable, release_pages

    flat = torch.randn(3 << 20)  # 12 MiB: many pages
    torch.save({"fp32_flat_groups": [flat]}, tmp_path / "optim.pt")
    state, releasable = load_ds_file_releasable(tmp_path / "optim.pt")
    assert releasable
    mapped = state["fp32_flat_groups"][0]
    first = mapped[: 1 << 20].clone()
    release_pages(mapped[: 1 << 20])
    assert torch.equal(mapped[: 1 << 20], first)  # refaulted from the file
    assert torch.equal(mapped, flat)


def test_legacy_files_are_never_released(tmp_path):
    from ema_ckpt.formats.deepspeed.unpickle import load_ds_file_releasable

    torch.save({"x": torch.ones(4)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    state, releasable = load_ds_file_releasable(tmp_path / "legacy.pt")
    assert not releasable and torch.equal(state["x"], torch.ones(4))


def test_large_tensors_are_served_in_row_blocks(ds_run):
    folder = ds_run(Config(2, 3, "fp32"))
    with open_checkpoint(folder) as reader:
        for key, spec in reader.specs().items():
            boxes = reader.layout(key)
            assert sum(b.numel for b in boxes) == spec.numel
