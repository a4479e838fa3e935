"""``verify`` and ``diff``: the library functions and their CLI adapters (on a local Typer app)."""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from ema_ckpt.cli.diff import EPILOG as DIFF_EPILOG
from ema_ckpt.cli.diff import diff_command
from ema_ckpt.cli.verify import EPILOG as VERIFY_EPILOG
from ema_ckpt.cli.verify import verify_command
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.commands.diff import diff, pair_keys
from ema_ckpt.commands.verify import verify
from ema_ckpt.errors import CheckpointNotFoundError
from ema_ckpt.manifest import MANIFEST_NAME, Manifest
from tests.dcp_helpers import write_dcp

app = typer.Typer(add_completion=False)
app.command("verify", epilog=VERIFY_EPILOG)(verify_command)
app.command("diff", epilog=DIFF_EPILOG)(diff_command)
runner = CliRunner()


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.w": torch.randn(7, 3, generator=g),
        "model.b": torch.randn(5, generator=g),
        "model.n": torch.tensor(step),
    }


@pytest.fixture
def ema(tmp_path) -> Path:
    """A fresh accumulate output (two ranks → two data files) over three DCP checkpoints."""
    for step in (10, 20, 30):
        write_dcp(tmp_path / "ckpts" / f"step_{step}", _tensors(step), world_size=2)
    result = accumulate(tmp_path / "ckpts", decay=0.9, out=tmp_path / "ema")
    assert result.step == 30
    return result.out


def _data_file(ema: Path) -> Path:
    return ema / "__0_0.distcp"


# --- verify -------------------------------------------------------------------------------


def test_verify_passes_on_a_fresh_output(ema):
    result = verify(ema)
    assert result.ok, result.problems
    manifest = Manifest.read(ema)
    assert sorted(result.files) == sorted(manifest.files) == ["__0_0.distcp", "__1_0.distcp"]
    assert result.manifest and result.checks == ["files", "readable"] and result.format_name == "dcp"
    assert result.keys == 3
    assert result.bytes_hashed == sum(f["size"] for f in manifest.files.values())
    assert result.bytes_read == (7 * 3 + 5) * 4 + 8
    cli = runner.invoke(app, ["verify", str(ema), "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["ok"] is True
    assert runner.invoke(app, ["verify", str(ema)]).exit_code == 0


def test_verify_crc_streams_in_blocks_like_zlib(ema):
    file = _data_file(ema)
    expected = zlib.crc32(file.read_bytes())
    assert Manifest.read(ema).files[file.name]["crc32"] == expected
    assert verify(ema, hash_block_bytes=7).ok  # odd block size: same CRC


def _flip_byte(ema: Path) -> Path:
    file = _data_file(ema)
    data = bytearray(file.read_bytes())
    data[len(data) - 3] ^= 0xFF  # inside the last record's tensor bytes: still parses
    file.write_bytes(bytes(data))
    return file


def _truncate(ema: Path) -> Path:
    file = _data_file(ema)
    file.write_bytes(file.read_bytes()[:-10])
    return file


def _delete(ema: Path) -> Path:
    file = _data_file(ema)
    file.unlink()
    return file


def _stray(ema: Path) -> Path:
    file = ema / "notes.txt"
    file.write_text("hello")
    return file


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_flip_byte, "CRC-32"),
        (_truncate, "truncated"),
        (_delete, "missing"),
        (_stray, "extra file"),
    ],
)
def test_damage_is_reported_with_exit_code_3(ema, damage, words):
    file = damage(ema)
    result = verify(ema)
    assert not result.ok
    assert any(p.startswith(str(file)) and words in p for p in result.problems), result.problems
    cli = runner.invoke(app, ["verify", str(ema)])
    assert cli.exit_code == 3, cli.output
    lines = cli.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {ema}: ") and "problem" in lines[0]
    assert any(line.startswith(str(file)) and words in line for line in lines[1:]), lines
    assert "Traceback" not in cli.output
    as_json = runner.invoke(app, ["verify", str(ema), "--json"])
    assert as_json.exit_code == 3
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["problems"] == result.problems


def test_a_flipped_byte_in_a_record_header_is_also_a_read_problem(ema):
    file = _data_file(ema)
    data = bytearray(file.read_bytes())
    data[0:4] = b"XXXX"  # the first record's zip local header
    file.write_bytes(bytes(data))
    result = verify(ema)
    assert any("CRC-32" in p for p in result.problems)
    assert any(str(file) in p and "CRC-32" not in p for p in result.problems), result.problems
    assert result.keys < 3


def test_missing_metadata_and_a_damaged_manifest_are_problems_not_crashes(ema):
    (ema / ".metadata").unlink()
    result = verify(ema)
    assert not result.ok and any(".metadata" in p or "not a checkpoint" in p for p in result.problems)
    (ema / MANIFEST_NAME).write_text('{"kind": "ema", "files": []')
    result = verify(ema)
    assert any(p.startswith(str(ema / MANIFEST_NAME)) for p in result.problems)


def test_manifest_entries_that_leave_the_directory_are_refused(ema, tmp_path):
    manifest = Manifest.read(ema)
    manifest.files["../outside"] = {"size": 1, "crc32": 0}
    (ema / MANIFEST_NAME).write_text(manifest.to_json())
    (tmp_path / "outside").write_text("x")
    result = verify(ema)
    assert any("../outside" in p and "not a file name" in p for p in result.problems)


def test_verify_without_manifest_checks_readability_and_the_records_own_crcs(tmp_path):
    ck = write_dcp(tmp_path / "ck", _tensors(1), world_size=3)
    result = verify(ck)
    assert result.ok and not result.manifest and result.checks == ["readable", "record CRC-32s"]
    assert result.notes and "zip CRC-32s are checked" in result.notes[0]
    st = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(3)}, str(st))
    assert verify(st).ok and verify(st).format_name == "safetensors"
    # damage the data of a plain checkpoint: a problem, not an exception
    data = st.read_bytes()
    st.write_bytes(data[:-4])
    result = verify(st)
    assert not result.ok and str(st) in result.problems[0]


def test_verify_of_a_missing_path_or_a_non_checkpoint_raises(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        verify(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        verify(tmp_path / "empty")
    cli = runner.invoke(app, ["verify", str(tmp_path / "missing")])
    assert cli.exit_code == 3 and "no such file or directory" in cli.stderr


# --- diff ---------------------------------------------------------------------------------


def test_diff_of_a_checkpoint_with_itself_is_exact(ema):
    result = diff(ema, ema)
    assert result.equal() and result.pairing == "exact" and len(result.keys) == 3
    assert all(k.max_abs == 0 and k.max_rel == 0 and k.mismatched == 0 for k in result.keys)
    cli = runner.invoke(app, ["diff", str(ema), str(ema)])
    assert cli.exit_code == 0, cli.output
    assert "3 keys equal" in cli.stdout


def test_diff_dcp_against_consolidated_safetensors_strips_model_prefix(ema, tmp_path):
    out = tmp_path / "ema.safetensors"
    consolidate(ema, out)
    result = diff(ema, out)
    assert result.pairing == "strip-a"
    pairs = sorted((k.key_a, k.key_b) for k in result.keys)
    assert pairs == [("model.b", "b"), ("model.n", "n"), ("model.w", "w")]
    assert result.equal() and not result.only_in_a and not result.only_in_b
    reverse = diff(out, ema)
    assert reverse.pairing == "strip-b" and reverse.equal()
    cli = runner.invoke(app, ["diff", str(out), str(ema), "--json"])
    assert cli.exit_code == 0, cli.output
    data = json.loads(cli.stdout)
    assert data["equal"] and data["compared"] == 3 and data["format_a"] == "safetensors"


def test_a_perturbed_tensor_shows_the_right_max_abs_diff(tmp_path):
    base = _tensors(3)
    other = {k: v.clone() for k, v in base.items()}
    other["model.w"][4, 1] += 0.5
    other["model.w"][6, 2] -= 0.25
    other["model.n"] += 2
    a = write_dcp(tmp_path / "a", base, world_size=2)
    b = write_dcp(tmp_path / "b", other, world_size=3)  # other chunking: reads cross chunks
    result = diff(a, b, block_bytes=8 * 3 * 2)  # two rows a block: many blocks
    by_key = {k.key_a: k for k in result.keys}
    w = by_key["model.w"]
    expected = (base["model.w"].double() - other["model.w"].double()).abs().max().item()
    assert w.max_abs == pytest.approx(expected, abs=1e-6) and w.max_abs == pytest.approx(0.5, abs=1e-6)
    assert w.max_rel == pytest.approx(w.max_abs / other["model.w"].double().abs().max().item())
    assert w.mismatched == 2 and not w.matches(0.0) and w.matches(0.6) and not w.matches(0.4)
    assert by_key["model.b"].matches()
    assert by_key["model.n"].max_abs == 2 and by_key["model.n"].mismatched == 1
    assert not result.equal(atol=0.6)  # the int key is still off by 2
    assert set(result.to_dict()["differing"]) == {"model.w", "model.n"}
    cli = runner.invoke(app, ["diff", str(a), str(b)], env={"COLUMNS": "200"})
    assert cli.exit_code == 4
    assert "model.w" in cli.stdout and "0.5" in cli.stdout
    assert "2 of 3 keys differ" in cli.stderr
    within = runner.invoke(app, ["diff", str(a), str(b), "--atol", "3", "--json"])
    assert within.exit_code == 0, within.output
    assert json.loads(within.stdout)["equal"] is True
    only_w = runner.invoke(app, ["diff", str(a), str(b), "--include", "model.b"])
    assert only_w.exit_code == 0, only_w.output


def test_diff_reports_keys_on_one_side_shapes_and_nan(tmp_path):
    nan, inf = float("nan"), float("inf")
    a = write_dcp(tmp_path / "a", {"model.w": torch.tensor([1.0, nan, 3.0]), "model.x": torch.ones(2),
                                   "model.s": torch.ones(2, 2)})
    b = write_dcp(tmp_path / "b", {"model.w": torch.tensor([1.0, nan, inf]), "model.y": torch.ones(2),
                                   "model.s": torch.ones(4)})
    result = diff(a, b)
    assert result.only_in_a == ["model.x"] and result.only_in_b == ["model.y"]
    by_key = {k.key_a: k for k in result.keys}
    assert by_key["model.s"].max_abs is None and not by_key["model.s"].same_shape
    w = by_key["model.w"]
    assert w.mismatched == 1 and math.isinf(w.max_abs)  # NaN == NaN; 3 vs inf
    assert w.to_dict()["max_abs"] == "inf"
    cli = runner.invoke(app, ["diff", str(a), str(b), "--json"])
    assert cli.exit_code == 4
    data = json.loads(cli.stdout)  # strict JSON: no bare Infinity
    assert data["only_in_a"] == ["model.x"] and data["equal"] is False
    excluded = diff(a, b, exclude=["model.x", "model.y", "model.s"])
    assert excluded.only_in_a == [] and [k.key_a for k in excluded.keys] == ["model.w"]


def test_diff_across_dtypes_compares_values(tmp_path):
    a = tmp_path / "a.safetensors"
    b = tmp_path / "b.safetensors"
    save_file({"w": torch.tensor([0.5, 1.5]), "i": torch.tensor([1, 2], dtype=torch.int32)}, str(a))
    save_file({"w": torch.tensor([0.5, 1.5], dtype=torch.bfloat16), "i": torch.tensor([1, 2])}, str(b))
    result = diff(a, b)
    assert result.equal() and {k.dtype_a for k in result.keys} == {"float32", "int32"}
    assert not any(k.same_dtype for k in result.keys)


def test_pair_keys_prefers_the_largest_overlap():
    pairs, only_a, _only_b, how = pair_keys(["model.w", "model.b", "step"], ["w", "b"])
    assert how == "strip-a" and pairs == [("model.w", "w"), ("model.b", "b")] and only_a == ["step"]
    assert pair_keys(["w"], ["w"])[3] == "exact"
    # stripping that would make two keys collide is never used
    pairs, only_a, _only_b, how = pair_keys(["model.w", "w"], ["w"])
    assert how == "exact" and pairs == [("w", "w")] and only_a == ["model.w"]


def test_help_has_examples_and_exit_codes():
    for command in ("verify", "diff"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        assert f"ema-ckpt {command}" in result.stdout and "Exit codes" in result.stdout


def test_diff_of_a_missing_path_is_exit_3(ema, tmp_path):
    cli = runner.invoke(app, ["diff", str(ema), str(tmp_path / "nope")])
    assert cli.exit_code == 3 and "no such file or directory" in cli.stderr


def test_copy_of_an_output_verifies_and_diffs_equal(ema, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ema, copy)
    assert verify(copy).ok and diff(ema, copy).equal()
