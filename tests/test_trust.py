"""Damaged inputs are refused or skipped on record, never folded; a recorded skip stays skipped."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.errors import CheckpointFormatError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.manifest import Manifest

runner = CliRunner()


def _train_and_save(folder, steps, *, nan_at=()):
    """Real optimizer state beside the model, as a training loop saves it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.Adam(model.parameters())
    for step in steps:
        model(torch.randn(2, 8)).sum().backward()
        optim.step()
        state = model.state_dict()
        if step in nan_at:
            state = {k: v.clone().fill_(float("nan")) for k, v in state.items()}
        dcp.save({"model": state, "optim": optim.state_dict()}, checkpoint_id=str(folder / f"step_{step}"),
                 no_dist=True)


def _cut_the_optimizer_records(checkpoint, nbytes=200):
    data = next(checkpoint.glob("*.distcp"))
    os.truncate(data, data.stat().st_size - nbytes)
    return data


def test_a_data_file_shorter_than_its_metadata_is_refused_naming_both_sizes(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2])
    data = _cut_the_optimizer_records(tmp_path / "c" / "step_2")
    message = r"truncated: \d+ bytes, but the metadata has records up to byte \d+"
    with pytest.raises(CheckpointFormatError, match=message):
        open_checkpoint(tmp_path / "c" / "step_2")
    result = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9"])
    assert result.exit_code == 3 and str(data) in result.output and "--skip-damaged" in result.output
    assert not (tmp_path / "c" / "ema").exists()
    data.unlink()
    with pytest.raises(CheckpointFormatError, match="missing"):
        open_checkpoint(tmp_path / "c" / "step_2")


def test_skip_damaged_goes_on_and_the_manifest_remembers(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2, 3])
    _cut_the_optimizer_records(tmp_path / "c" / "step_2")
    result = accumulate(tmp_path / "c", decay=0.9, skip_damaged=True)
    assert [c.step for c in result.folded] == [1, 3]
    manifest = Manifest.read(tmp_path / "c" / "ema")
    assert [(s["step"], s["reason"].split(":")[0]) for s in manifest.skipped] == [(2, "damaged")]
    again = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9"])
    assert again.exit_code == 0 and "up to date" in again.output


def test_a_recorded_skip_stays_skipped_even_at_the_newest_step(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2], nan_at=(2,))
    first = accumulate(tmp_path / "c", decay=0.9, out=tmp_path / "ema", skip_nonfinite=True)
    assert [c.step for c in first.folded] == [1]
    skipped = Manifest.read(tmp_path / "ema").skipped
    assert [(s["step"], s["reason"]) for s in skipped] == [(2, "NaN/Inf")]
    # Later runs without the flag: the recorded skip holds, and cron goes on with new checkpoints.
    again = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9", "--out", str(tmp_path / "ema")])
    assert again.exit_code == 0 and "recorded as skipped" in again.output, again.output
    _train_and_save(tmp_path / "d", [1, 2, 3])
    os.rename(tmp_path / "d" / "step_3", tmp_path / "c" / "step_3")
    later = accumulate(tmp_path / "c", decay=0.9, out=tmp_path / "ema")
    assert [c.step for c in later.folded] == [3]
    assert [s["step"] for s in Manifest.read(tmp_path / "ema").skipped] == [2]


def test_a_skip_is_retried_once_the_checkpoint_is_rewritten(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2], nan_at=(2,))
    accumulate(tmp_path / "c", decay=0.9, out=tmp_path / "ema", skip_nonfinite=True)
    import shutil

    shutil.rmtree(tmp_path / "c" / "step_2")
    _train_and_save(tmp_path / "fixed", [1, 2])
    os.rename(tmp_path / "fixed" / "step_2", tmp_path / "c" / "step_2")
    result = accumulate(tmp_path / "c", decay=0.9, out=tmp_path / "ema")
    assert [c.step for c in result.folded] == [2]
    assert json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())["step"] == 2


@pytest.mark.parametrize("args", [
    ["posthoc", "{c}", "--gamma", "1e200", "--dry-run"],
    ["posthoc", "{c}", "--gamma", "1e150", "--dry-run"],
    ["posthoc", "{c}", "--sigma-rel", "1e-160", "--dry-run"],
    ["accumulate", "{c}", "--sigma-rel", "1e-160", "--dry-run"],
    ["accumulate", "{c}", "--gamma", "-1", "--dry-run"],
    ["accumulate", "{c}", "--decay", "0.9", "--step-regex", "step", "--dry-run"],
    ["accumulate", "{c}", "--decay", "0.9", "--step-regex", "(step)?_", "--dry-run"],
])
def test_options_out_of_range_are_usage_errors_stating_the_range(tmp_path, args):
    _train_and_save(tmp_path / "c", [1, 2])
    result = runner.invoke(app, [a.format(c=tmp_path / "c") for a in args])
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    assert any(word in result.output for word in ("between", "group", "digits")), result.output


def test_json_lists_the_terms_of_every_power_ema(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2, 3])
    result = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--sigma-rel", "0.05", "--sigma-rel", "0.1",
                                 "--out", str(tmp_path / "snap"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    by_output = doc["terms_by_output"]
    assert sorted(by_output) == sorted(str(tmp_path / "snap" / n) for n in ("sigma_rel_0.05", "sigma_rel_0.1"))
    assert all(len(terms) == 3 for terms in by_output.values())
    weights = [[t["coefficient"] for t in terms] for terms in by_output.values()]
    assert weights[0] != weights[1]


def test_posthoc_never_labels_a_step_it_did_not_compute(tmp_path):
    _train_and_save(tmp_path / "c", [100, 200, 400])
    beyond = runner.invoke(app, ["posthoc", str(tmp_path / "c"), "--sigma-rel", "0.1", "--at-step", "10000",
                                 "--dry-run"])
    assert beyond.exit_code == 2 and "after the newest checkpoint (step 400)" in beyond.output
    between = runner.invoke(app, ["posthoc", str(tmp_path / "c"), "--sigma-rel", "0.1", "--at-step", "300",
                                  "--dry-run", "--json"])
    assert between.exit_code == 0, between.output
    output = json.loads(between.output)["outputs"][0]
    assert output["step"] == 200  # labelled with the step it ends at


def test_plan_warnings_reach_stderr_json_and_the_manifest(tmp_path):
    _train_and_save(tmp_path / "c", [10, 20, 100])  # sparse for a short EMA: a spacing warning
    result = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--half-life", "5", "--out",
                                 str(tmp_path / "ema"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["warnings"] and "checkpoints are up to 80 steps apart" in doc["warnings"][0]
    recorded = Manifest.read(tmp_path / "ema").warnings  # the same warning, in the library's words
    assert [w.replace("half_life", "--half-life").replace("decay", "--decay") for w in recorded] == [
        w.split(": ", 1)[1] for w in doc["warnings"]]
    posthoc = runner.invoke(app, ["posthoc", str(tmp_path / "c"), "--sigma-rel", "0.01", "--out",
                                  str(tmp_path / "ph")])
    assert posthoc.exit_code == 0 and "warning: sigma_rel_0.01:" in posthoc.output, posthoc.output
    assert Manifest.read(tmp_path / "ph" / "sigma_rel_0.01").warnings


def test_a_poor_snapshot_fit_is_warned_about():
    from ema_ckpt.maths import Snapshot, posthoc_plan, sigma_rel_to_gamma

    plan = posthoc_plan([Snapshot(1000, sigma_rel_to_gamma(0.05))], sigma_rel_to_gamma(0.2))
    assert plan.rel_error > 1 and any("fit the target profile poorly" in w for w in plan.warnings)
    good = posthoc_plan([Snapshot(t, g) for t in range(100, 1001, 100) for g in (sigma_rel_to_gamma(0.05),
                         sigma_rel_to_gamma(0.1))], sigma_rel_to_gamma(0.07))
    assert not any("poorly" in w for w in good.warnings)


def _flip_a_bit(ema):
    data = sorted(ema.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    return data


def test_a_damaged_ema_is_never_folded_into(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2])
    accumulate(tmp_path / "c", decay=0.9, out=tmp_path / "ema")
    damaged = _flip_a_bit(tmp_path / "ema")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ema").iterdir()}
    _train_and_save(tmp_path / "more", [1, 2, 3])
    os.rename(tmp_path / "more" / "step_3", tmp_path / "c" / "step_3")
    result = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9", "--out", str(tmp_path / "ema")])
    assert result.exit_code == 3, result.output
    assert damaged.name in result.output and "CRC-32" in result.output and "--restart" in result.output
    assert {p.name: p.read_bytes() for p in (tmp_path / "ema").iterdir()} == before  # left as it is
    assert runner.invoke(app, ["verify", str(tmp_path / "ema")]).exit_code == 3  # and still reported
    rebuilt = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9", "--out",
                                  str(tmp_path / "ema"), "--restart"])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert runner.invoke(app, ["verify", str(tmp_path / "ema")]).exit_code == 0


def test_an_output_that_is_a_symlink_is_published_at_its_target(tmp_path):
    from safetensors.torch import load_file

    _train_and_save(tmp_path / "c", [1, 2])
    (tmp_path / "store").mkdir()
    link = tmp_path / "c" / "ema"
    link.symlink_to(tmp_path / "store" / "ema")  # dangling at first: the EMA does not exist yet
    for _ in range(2):
        result = runner.invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9", "--out", str(link)])
        assert result.exit_code == 0, result.output
        assert link.is_symlink() and (tmp_path / "store" / "ema" / "ema-ckpt.json").is_file()
        _train_and_save(tmp_path / "more", [1, 2, 3])
        if not (tmp_path / "c" / "step_3").exists():
            os.rename(tmp_path / "more" / "step_3", tmp_path / "c" / "step_3")
    assert Manifest.read(tmp_path / "store" / "ema").step == 3
    leftovers = [p.name for p in (*tmp_path.joinpath("c").iterdir(), *tmp_path.joinpath("store").iterdir())
                 if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []
    file_link = tmp_path / "model.safetensors"
    file_link.symlink_to(tmp_path / "store" / "model.safetensors")
    for overwrite in ([], ["--overwrite"]):
        if overwrite:
            _train_and_save(tmp_path / "other", [9])
            source = tmp_path / "other" / "step_9"
        else:
            source = tmp_path / "c" / "step_2"
        result = runner.invoke(app, ["consolidate", str(source), "--out", str(file_link), *overwrite])
        assert result.exit_code == 0, result.output
        assert file_link.is_symlink() and load_file(tmp_path / "store" / "model.safetensors")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    result = runner.invoke(app, ["consolidate", str(source), "--out", str(loop)])
    assert result.exit_code == 7 and "symlink" in result.output


def test_leftovers_are_removed_when_the_note_says_so(tmp_path):
    from ema_ckpt.storage.local_publish import recover

    final = tmp_path / "ema"
    (tmp_path / ".ema.tmp-1-abcd").write_text("a file, not a folder")  # left by an older version
    (tmp_path / ".ema.tmp-2-beef").mkdir()
    notes = recover(final)
    assert sorted(n.split()[1] for n in notes if n.startswith("removed")) == [".ema.tmp-1-abcd", ".ema.tmp-2-beef"]
    assert [p.name for p in tmp_path.iterdir()] == []


def test_reshard_for_far_more_ranks_than_rows_costs_the_rows_not_the_ranks(tmp_path):
    import time

    from ema_ckpt.commands.reshard import reshard

    _train_and_save(tmp_path / "c", [1])
    started = time.perf_counter()
    result = reshard(tmp_path / "c" / "step_1", world_size=100_000, out=tmp_path / "r")
    assert time.perf_counter() - started < 30  # was minutes: every empty rank had chunks and work
    assert any("more than the largest tensor's 8 rows" in n for n in result.notes)
    assert len([name for name, _ in result.files if name.endswith(".distcp")]) <= 8  # and .metadata
    state = {"model.weight": torch.empty(8, 8), "model.bias": torch.empty(8)}
    dcp.load(state, checkpoint_id=str(tmp_path / "r"), no_dist=True)
    original = {"model.weight": torch.empty(8, 8), "model.bias": torch.empty(8)}
    dcp.load(original, checkpoint_id=str(tmp_path / "c" / "step_1"), no_dist=True)
    assert all(torch.equal(state[k], original[k]) for k in state)


def test_verify_finds_a_flipped_byte_in_a_training_checkpoints_optimizer_records(tmp_path):
    from ema_ckpt.commands.verify import verify
    from ema_ckpt.formats.dcp import DcpReader

    _train_and_save(tmp_path / "c", [1])
    ckpt = tmp_path / "c" / "step_1"
    assert verify(ckpt).ok and "record CRC-32s" in verify(ckpt).checks
    with DcpReader(ckpt) as reader:  # a byte inside an optimizer state record's tensor data
        file, offset, length = next(r for r in reader.stored_records() if r[2] > 200
                                    and r not in {(c.file, c.offset, c.length) for k in reader.specs()
                                                  if k.startswith("model.") for c in reader.chunks(k)})
    data = bytearray((ckpt / file).read_bytes())
    data[offset + length - 120] ^= 0x01  # in the last member's bytes, before the zip directory
    (ckpt / file).write_bytes(bytes(data))
    result = verify(ckpt)
    assert not result.ok and any("CRC-32" in p or "zip" in p for p in result.problems), result.problems
    cli = runner.invoke(app, ["verify", str(ckpt)])
    assert cli.exit_code == 3


def test_verify_checks_deepspeed_and_torch_files_crcs(tmp_path):
    from ema_ckpt.commands.verify import verify

    torch.save({"w": torch.randn(64, 64)}, tmp_path / "m.pt")
    assert "file CRC-32s" in verify(tmp_path / "m.pt").checks and verify(tmp_path / "m.pt").ok
    raw = bytearray((tmp_path / "m.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (tmp_path / "m.pt").write_bytes(bytes(raw))
    assert not verify(tmp_path / "m.pt").ok


def test_skip_damaged_with_workers_decides_alike_on_every_rank(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2, 3])
    _cut_the_optimizer_records(tmp_path / "c" / "step_2")
    refused = accumulate(tmp_path / "c", decay=0.9, workers=2, skip_damaged=True)
    assert [c.step for c in refused.folded] == [1, 3]
    assert [s["step"] for s in Manifest.read(tmp_path / "c" / "ema").skipped] == [2]


def test_two_damaged_checkpoints_with_workers_are_both_skipped(tmp_path):
    _train_and_save(tmp_path / "c", [1, 2, 3, 4])
    _cut_the_optimizer_records(tmp_path / "c" / "step_2")
    _cut_the_optimizer_records(tmp_path / "c" / "step_3")
    result = accumulate(tmp_path / "c", decay=0.9, workers=3, skip_damaged=True)
    assert [c.step for c in result.folded] == [1, 4]


def test_a_first_run_that_skips_everything_is_an_error(tmp_path):
    _train_and_save(tmp_path / "c", [1])
    _cut_the_optimizer_records(tmp_path / "c" / "step_1")
    with pytest.raises(CheckpointFormatError, match="every checkpoint was skipped"):
        accumulate(tmp_path / "c", decay=0.9, skip_damaged=True)
    assert not (tmp_path / "c" / "ema").exists()


def test_verify_notes_checkpoints_without_crcs_instead_of_failing(tmp_path):
    from ema_ckpt.commands.verify import verify

    torch.serialization.set_crc32_options(False)
    try:
        _train_and_save(tmp_path / "c", [1])
    finally:
        torch.serialization.set_crc32_options(True)
    result = verify(tmp_path / "c" / "step_1")
    assert result.ok, result.problems
    assert any("without CRC-32s" in n for n in result.notes)
