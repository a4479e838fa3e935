"""A record damaged after it was written (a zero-filled hole from a parallel copier or a torn
write: the size right, the bytes not) is caught by its CRC-32 as it is read, in every command
and every format that stores one, and never averaged in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.dist import Workers
from ema_ckpt.errors import CheckpointFormatError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
from ema_ckpt.storage import open_readable
from ema_ckpt.torch_records.checks import settle_reads
from ema_ckpt.torch_records.zipfmt import stored_members
from tests.dcp_helpers import dcp_sequence_with_hole, save_random_dcp, zero_page_inside
from tests.ds_fixtures import members_read

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures" / "trainers"


def _invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], terminal_width=300)


def test_a_hole_in_a_dcp_record_is_exit_3_in_every_command_and_never_folded(tmp_path):
    ckpts = tmp_path / "ckpts"
    damaged = dcp_sequence_with_hole(ckpts)
    expected = f"error: {damaged}: key 'model.w': the "
    runs = {
        "accumulate": ["accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "ema"],
        "average": ["average", ckpts, "--last", "3", "--out", tmp_path / "avg"],
        "posthoc": ["posthoc", ckpts, "--sigma-rel", "0.1", "--out", tmp_path / "ph"],
        "consolidate-copy": ["consolidate", ckpts / "step_2", "--out", tmp_path / "c.safetensors"],
        "consolidate-pt": ["consolidate", ckpts / "step_2", "--out", tmp_path / "c.pt"],
        "reshard-2-workers": ["reshard", ckpts / "step_2", "--world-size", "3", "--workers", "2",
                              "--out", tmp_path / "r"],
    }
    for name, args in runs.items():
        result = _invoke(*args)
        assert result.exit_code == 3, (name, result.output)
        assert expected in result.output and "do not match their CRC-32" in result.output, (name, result.output)
        assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpts"]  # nothing published, no staging left


def test_skip_damaged_records_the_hole_and_folds_the_rest(tmp_path):
    ckpts = tmp_path / "ckpts"
    dcp_sequence_with_hole(ckpts)
    result = _invoke("accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "ema", "--skip-damaged")
    assert result.exit_code == 0, result.output
    assert "skipped" in result.output and "do not match their CRC-32" in result.output
    manifest = json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == [1, 3]
    assert [s["step"] for s in manifest["skipped"]] == [2] and "CRC-32" in manifest["skipped"][0]["reason"]


def test_an_intact_sequence_folds_and_reshards_on_any_number_of_workers(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (1, 2):
        save_random_dcp(ckpts, step)
    for workers in ("1", "2"):
        assert _invoke("reshard", ckpts / "step_2", "--world-size", "3", "--workers", workers,
                       "--out", tmp_path / f"r{workers}").exit_code == 0
        assert _invoke("accumulate", ckpts, "--decay", "0.9", "--workers", workers,
                       "--out", tmp_path / f"e{workers}").exit_code == 0


def test_a_record_read_in_part_is_checked_when_the_run_settles(tmp_path):
    ckpts = tmp_path / "ckpts"
    save_random_dcp(ckpts, 1)
    with open_checkpoint(ckpts / "step_1") as reader:
        chunk = reader.chunks("model.w")[0]
        file, start, length = reader.byte_ranges("model.w")[0]
    with open_checkpoint(ckpts / "step_1") as reader:  # intact: reading ten rows and settling passes
        reader.read("model.w", Box((0, 0), (10, 8)))
        settle_reads([reader], Workers.single())
    zero_page_inside(ckpts / "step_1" / file, start + length // 2, length // 2)  # in rows not read
    with open_checkpoint(ckpts / "step_1") as reader:
        reader.read("model.w", Box((0, 0), (10, 8)))  # the rows read are intact, the record is not
        assert chunk.file == file
        with pytest.raises(CheckpointFormatError, match="do not match their CRC-32"):
            settle_reads([reader], Workers.single())


def test_a_hole_in_a_deepspeed_pt_is_exit_3_and_skip_damaged_skips_it(tmp_path):
    ckpts = tmp_path / "ckpts"
    shutil.copytree(FIXTURES / "hf-trainer-zero2-bf16" / "ckpts", ckpts)
    tag = ckpts / "checkpoint-4" / "global_step4"
    with open_checkpoint(ckpts / "checkpoint-4") as reader:
        touched, untouched = members_read(tag, reader)
    assert touched and untouched  # the fp32 partitions are read, the Adam moments never
    for file, start, size in untouched:  # damage nobody reads is nobody's business: no false alarm
        zero_page_inside(file, start, size)
    assert _invoke("accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "clean").exit_code == 0
    file, start, size = touched[0]
    zero_page_inside(file, start, size)
    result = _invoke("accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "ema")
    assert result.exit_code == 3, result.output
    assert f"error: {file}: zip member " in result.output and "do not match their CRC-32" in result.output
    assert not (tmp_path / "ema").exists()
    skipped = _invoke("accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "ema", "--skip-damaged")
    assert skipped.exit_code == 0 and "skipped" in skipped.output and "step 4" in skipped.output, skipped.output


def test_a_hole_in_a_single_file_checkpoint_is_exit_3(tmp_path):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for step in (100, 200):
        torch.manual_seed(step)
        torch.save({"model": {"w": torch.randn(1024, 8)}, "step": step}, ckpts / f"ckpt_{step:06d}.pt")
    with open_readable(ckpts / "ckpt_000200.pt") as source:
        members = stored_members(source, source.size) or {}
    start, (size, _, _) = max(members.items(), key=lambda m: m[1][0])
    zero_page_inside(ckpts / "ckpt_000200.pt", start, size)
    result = _invoke("accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "ema")
    assert result.exit_code == 3, result.output
    assert f"{ckpts / 'ckpt_000200.pt'}: key 'model.w': the " in result.output


def test_records_saved_without_checksums_are_read_as_before(tmp_path):
    ckpts = tmp_path / "ckpts"
    torch.serialization.set_crc32_options(False)
    try:
        for step in (1, 2):
            save_random_dcp(ckpts, step)
    finally:
        torch.serialization.set_crc32_options(True)
    for args in (["accumulate", ckpts, "--decay", "0.9", "--out", tmp_path / "ema"],
                 ["consolidate", ckpts / "step_2", "--out", tmp_path / "c.safetensors"]):
        result = _invoke(*args)
        assert result.exit_code == 0, result.output
