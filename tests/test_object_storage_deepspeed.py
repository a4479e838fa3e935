"""DeepSpeed ZeRO 1/2/3 checkpoints on object storage, read in place.

Real DeepSpeed save folders (``latest`` + ``global_stepN/``, trained under torchrun on CPU, and
the Hugging Face Trainer's checkpoint-N folders of ``tests/fixtures/trainers``) are uploaded
to moto's S3 server; each command's result on ``s3://`` paths is compared bit for bit with
the same command on the local copies, and every ranged request is recorded to check that an
optimizer file's Adam moments are never requested.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.deepspeed.unpickle import load_ds_file_releasable, storage_file_offsets
from ema_ckpt.layout import Box
from ema_ckpt.storage import object_paths, object_reads
from tests import test_object_storage
from tests.dcp_helpers import zero_page_inside
from tests.ds_fixtures import Config, members_read
from tests.test_deepspeed import _RunsCommand, _write_zero
from tests.test_object_storage import assert_same, cli, dcp_tensors, upload

s3 = test_object_storage.s3  # the moto server (module-scoped fixture)

STAGES = [Config(2, 1, "fp32"), Config(2, 2, "bf16"), Config(2, 3, "bf16")]


@pytest.fixture(scope="module")
def saved(s3, ds_run, tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """{stage: (local save folder, its URL)}: ``latest`` + ``global_step{2,3,7}`` of a 2-rank run."""
    out = {}
    for config in STAGES:
        local = tmp_path_factory.mktemp(f"ds-s3-{config.name}") / "run"
        shutil.copytree(ds_run(config), local)
        out[config.stage] = (local, upload(local, f"ds/{config.name}"))
    return out


@pytest.fixture
def requests(monkeypatch) -> Iterator[list[tuple[str, int, int]]]:
    """Every ranged GET made, as (object key, start, end)."""
    made: list[tuple[str, int, int]] = []
    real = object_paths.call

    def spy(where, func, *args, **kwargs):
        if "start" in kwargs:
            made.append((where.key, kwargs["start"], kwargs["end"]))
        return real(where, func, *args, **kwargs)

    monkeypatch.setattr(object_paths, "call", spy)
    monkeypatch.setattr(object_reads, "call", spy)
    yield made


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_inspect_consolidate_and_accumulate_from_s3_are_bit_identical(saved, stage, tmp_path):
    local, url = saved[stage]
    here = json.loads(cli("inspect", local / "global_step7", "--json"))
    there = json.loads(cli("inspect", f"{url}/global_step7", "--json"))
    assert there["format"] == "deepspeed" and there["step"] == 7 and there["details"]["stage"] == stage
    # the same document but for where the checkpoint is
    assert json.dumps(here, sort_keys=True).replace(str(local), "<run>") == json.dumps(
        there, sort_keys=True).replace(url, "<run>")
    cli("consolidate", url, "--out", tmp_path / "s3.safetensors")  # the save folder: `latest` names the tag
    cli("consolidate", local, "--out", tmp_path / "local.safetensors")
    assert (tmp_path / "s3.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    cli("accumulate", url, "--decay", "0.9", "--out", tmp_path / "ema-s3")
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    assert_same(dcp_tensors(tmp_path / "ema-s3"), dcp_tensors(tmp_path / "ema-local"))
    folded = json.loads((tmp_path / "ema-s3" / "ema-ckpt.json").read_text())["checkpoints"]
    assert [c["step"] for c in folded] == [2, 3, 7] and all(c["path"].startswith(f"{url}/") for c in folded)


def test_posthoc_average_reshard_workers_verify_and_diff_from_s3(saved, tmp_path):
    local, url = saved[3]
    for where, src in (("s3", url), ("local", local)):
        cli("posthoc", src, "--sigma-rel", "0.05,0.1", "--out", tmp_path / where / "posthoc")
        cli("average", src, "--last", "3", "--out", tmp_path / where / "average")
        cli("reshard", f"{src}/global_step7", "--world-size", "3", "--out", tmp_path / where / "reshard")
    for name in ("posthoc/sigma_rel_0.05", "posthoc/sigma_rel_0.1", "average", "reshard"):
        assert_same(dcp_tensors(tmp_path / "s3" / name), dcp_tensors(tmp_path / "local" / name))
    cli("accumulate", url, "--decay", "0.9", "--out", tmp_path / "s3" / "ema-w2", "--workers", "2")
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "local" / "ema")
    assert_same(dcp_tensors(tmp_path / "s3" / "ema-w2"), dcp_tensors(tmp_path / "local" / "ema"))
    checked = json.loads(cli("verify", f"{url}/global_step7", "--json"))
    assert checked["ok"] is True
    same = json.loads(cli("diff", f"{url}/global_step7", local / "global_step7", "--json"))
    assert same["equal"] is True and same["compared"] > 0


def _spans(state, path: Path, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """Byte spans in ``path`` of the storages of the tensors found under keys in ``names``."""
    offsets = storage_file_offsets(path, state)
    assert offsets is not None
    found: list[tuple[int, int]] = []

    def walk(obj, wanted: bool) -> None:
        if isinstance(obj, torch.Tensor):
            if wanted and obj.numel():
                start = offsets[obj.untyped_storage().data_ptr()]
                found.append((start, start + obj.untyped_storage().nbytes()))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, wanted or key in names)
        elif isinstance(obj, list | tuple):
            for value in obj:
                walk(value, wanted)

    walk(state, False)
    return found


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_only_fp32_partitions_and_structure_are_requested(saved, stage, requests):
    local, url = saved[stage]
    tag = local / "global_step7"
    with open_checkpoint(f"{url}/global_step7") as there, open_checkpoint(tag) as here:
        assert there.specs() == here.specs()
        for key, spec in here.specs().items():
            box = Box.full(tuple(spec.shape))
            a, b = there.read(key, box), here.read(key, box)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
    masters = ("single_partition_of_fp32_groups", "fp32_flat_groups")
    for file in sorted(tag.glob("*.pt")):
        asked = [(s, e) for k, s, e in requests if k.endswith(f"/global_step7/{file.name}")]
        size = file.stat().st_size
        assert asked and all(0 <= s < e <= size for s, e in asked)
        covered = _union(asked)
        assert covered < size, file.name  # never the whole file
        if "optim_states" not in file.name:
            continue
        state, _ = load_ds_file_releasable(file)
        fp32 = _spans(state, file, masters)
        moments = [m for m in _spans(state, file, ("base_optimizer_state", "optimizer_state_dict")) if m not in fp32]
        assert moments and not [(s, e) for s, e in asked for a, b in moments if s < b and a < e], file.name
        # each fp32 partition read from its start by requests inside it (again for a tied alias);
        # the rest is the zip directory, the pickle and member headers
        inside = [(s, e) for s, e in asked if any(a <= s and e <= b for a, b in fp32)]
        assert all(any(s == a for s, _ in inside) for a, _ in fp32), file.name
        structure = _union([r for r in asked if r not in inside])
        print(f"{file.name}: {covered} of {size} bytes requested ({_union(inside)} of fp32 partitions, "
              f"{structure} of structure); none of the {_union(moments)} bytes of Adam moments")


def _union(spans: list[tuple[int, int]]) -> int:
    """How many bytes the spans cover together."""
    total, end = 0, 0
    for s, e in sorted(spans):
        total += max(0, e - max(s, end))
        end = max(end, e)
    return total


def test_truncated_or_hostile_objects_are_one_line(s3, tmp_path):
    tag = tmp_path / "run" / "global_step1"
    _write_zero(tag, stage=2, world_size=2, groups=[{"w": torch.randn(64)}])
    (tmp_path / "run" / "latest").write_text("global_step1")
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    url = upload(tmp_path / "run", "ds-bad/truncated")
    for command in (["inspect", url], ["consolidate", url, "--out", tmp_path / "m.safetensors"],
                    ["accumulate", url, "--decay", "0.9", "--out", tmp_path / "ema"]):
        message = cli(*command, code=3)
        assert len(message.strip().splitlines()) == 1 and "Traceback" not in message, message
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in message and "truncated or corrupt" in message
    assert not (tmp_path / "ema").exists() and not (tmp_path / "m.safetensors").exists()

    marker = tmp_path / "pwned"
    evil = {"optimizer_state_dict": {"zero_stage": 2, "x": _RunsCommand(f"touch {marker}")}}
    torch.save(evil, victim)
    url = upload(tmp_path / "run", "ds-bad/hostile")
    message = cli("inspect", url, code=3)
    assert len(message.strip().splitlines()) == 1
    assert f"refers to {os.system.__module__}.system, which is not allowed; nothing from the file was run" in message
    assert not marker.exists()


TRAINERS = Path(__file__).resolve().parent / "fixtures" / "trainers"


@pytest.mark.parametrize("trainer", ["hf-trainer-zero2-bf16", "hf-trainer-zero3-final", "lightning-deepspeed3"])
def test_trainers_deepspeed_folders_on_s3_fold_as_their_local_copies(s3, trainer, tmp_path):
    """Folders the trainers' own saving code wrote (tests/fixtures/trainers), uploaded as they are."""
    local = TRAINERS / trainer / "ckpts"
    if not local.is_dir():
        local = tmp_path / "ckpts"
        shutil.copytree(TRAINERS / trainer, local, ignore=shutil.ignore_patterns("oracle", "producer.json"))
    url = upload(local, f"ds-trainers/{trainer}")
    cli("accumulate", url, "--decay", "0.9", "--out", tmp_path / "ema-s3")
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    assert_same(dcp_tensors(tmp_path / "ema-s3"), dcp_tensors(tmp_path / "ema-local"))
    a = json.loads((tmp_path / "ema-s3" / "ema-ckpt.json").read_text())["checkpoints"]
    b = json.loads((tmp_path / "ema-local" / "ema-ckpt.json").read_text())["checkpoints"]
    assert [c["step"] for c in a] == [c["step"] for c in b] and a


def test_a_hole_in_a_pt_object_is_exit_3_naming_it(s3, tmp_path):
    local = tmp_path / "ckpts"
    shutil.copytree(TRAINERS / "hf-trainer-zero2-bf16" / "ckpts", local)
    with open_checkpoint(local / "checkpoint-4") as reader:
        touched, _ = members_read(local / "checkpoint-4" / "global_step4", reader)
    file, start, size = touched[0]
    zero_page_inside(file, start, size)
    url = upload(local, "ds-hole/ckpts")
    message = cli("accumulate", url, "--decay", "0.9", "--out", tmp_path / "ema", code=3)
    shown = f"{url}/{file.relative_to(local).as_posix()}: zip member "
    assert shown in message and "do not match their CRC-32" in message, message
    assert not (tmp_path / "ema").exists()


def test_an_optimizer_file_costs_its_fp32_partition_and_a_few_kib(s3, tmp_path, requests):
    """Rank files of 1.6M fp32 masters with their Adam moments (as DeepSpeed orders them: the
    moments first): about a third of each optimizer file is requested, never a moment."""
    torch.manual_seed(0)
    tag = tmp_path / "global_step5"
    groups = [{"a": torch.randn(1000, 1000), "b": torch.randn(600_000)}]
    expected = _write_zero(tag, stage=3, world_size=2, groups=groups, sub_group_numel=10**9)
    for file in sorted(tag.glob("*optim_states.pt")):
        state = torch.load(file, weights_only=True)
        osd = state["optimizer_state_dict"]
        flat = osd["fp32_flat_groups"][0]
        moments = {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn_like(flat),
                                 "exp_avg_sq": torch.rand_like(flat)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
        state["optimizer_state_dict"] = {"zero_stage": 3, "partition_count": 2, "optimizer_state_dict": moments,
                                         "fp32_flat_groups": osd["fp32_flat_groups"]}
        torch.save(state, file)
    url = upload(tmp_path, "ds-big")
    with open_checkpoint(f"{url}/global_step5") as reader:
        for key, value in expected.items():
            assert torch.equal(reader.read(key, Box.full(tuple(value.shape))), value), key
    for file in sorted(tag.glob("*optim_states.pt")):
        asked = [(s, e) for k, s, e in requests if k.endswith(f"/global_step5/{file.name}")]
        size = file.stat().st_size
        state, _ = load_ds_file_releasable(file)
        moments = _spans(state, file, ("state",))
        fp32 = _spans(state, file, ("fp32_flat_groups",))
        assert len(moments) == 3 and not [1 for s, e in asked for a, b in moments if s < b and a < e]
        covered = _union(asked)
        assert _union(fp32) <= covered < _union(fp32) + (64 << 10), file.name  # + the structure: under 64 KiB
        assert covered < 0.34 * size, file.name
        print(f"{file.name}: {covered} of {size} bytes requested ({covered / size:.1%}); "
              f"{len(asked)} requests")
