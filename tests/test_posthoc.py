"""posthoc, average and the snapshot scheme end to end: one-hot checkpoints make outputs equal
their coefficient vectors, so every plan is checked against the closed forms to 1e-9."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt import maths
from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.averaging import average, find_snapshots, posthoc
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
from ema_ckpt.maths import ExponentialProfile
from tests.conftest import STEPS
from tests.dcp_helpers import write_dcp
from tests.ema_reference import assert_close_relative, full_load

ONE_HOT_STEPS = [100, 250, 300, 700, 1000, 1600, 2000]


def _one_hot_sequence(root: Path, steps=ONE_HOT_STEPS) -> Path:
    """Checkpoint i holds the unit vector eᵢ (and a counter), sharded over 2 ranks."""
    for i, step in enumerate(steps):
        e = torch.zeros(len(ONE_HOT_STEPS), 3, dtype=torch.float64)
        e[i] = 1.0
        write_dcp(root / f"step_{step}", {"model.e": e, "model.count": torch.tensor(step)}, world_size=2)
    return root


def _vector(path: Path) -> list[float]:
    with open_checkpoint(path) as reader:
        value = reader.read("model.e", Box.full(reader.specs()["model.e"].shape))
        assert torch.equal(value[:, 0], value[:, 2])
        return value[:, 0].tolist()


def test_power_ema_from_raw_checkpoints_equals_the_closed_form(tmp_path):
    ck = _one_hot_sequence(tmp_path / "ck")
    result = posthoc(ck, out=tmp_path / "out", sigma_rels=["0.05", "0.10,0.2"], dtype="float64")
    assert [p.name for p in result.outputs] == ["sigma_rel_0.05", "sigma_rel_0.10", "sigma_rel_0.2"]
    for path, sigma in zip(result.outputs, [0.05, 0.10, 0.2], strict=True):
        want = maths.power_coefficients(ONE_HOT_STEPS, maths.sigma_rel_to_gamma(sigma))
        assert _vector(path) == pytest.approx(want, abs=1e-12)
        with open_checkpoint(path) as reader:
            assert reader.read("model.count", Box((), ())).item() == ONE_HOT_STEPS[-1]


def test_at_step_uses_only_checkpoints_up_to_T(tmp_path):
    ck = _one_hot_sequence(tmp_path / "ck")
    result = posthoc(ck, out=tmp_path / "out", gammas=["6.94"], at_step=1000, dtype="float64")
    want = maths.power_coefficients(ONE_HOT_STEPS, 6.94, at_step=1000)
    assert _vector(result.outputs[0]) == pytest.approx(want, abs=1e-12)
    assert result.plan.outputs[0].step == 1000 and result.outputs[0].name == "gamma_6.94"


def test_a_sweep_reads_each_input_once(tmp_path):
    ck = _one_hot_sequence(tmp_path / "ck")
    one = posthoc(ck, out=tmp_path / "one", sigma_rels=["0.05"])
    four = posthoc(ck, out=tmp_path / "four", sigma_rels=["0.05:0.20:0.05"])
    assert len(four.outputs) == 4 and four.bytes_read == one.bytes_read


def test_average_last_and_step_range(tmp_path):
    ck = _one_hot_sequence(tmp_path / "ck")
    average(ck, out=tmp_path / "last3", last=3, dtype="float64")
    assert _vector(tmp_path / "last3") == pytest.approx([0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3], abs=1e-15)
    average(ck, out=tmp_path / "range", from_step=250, to_step=700, dtype="float64")
    assert _vector(tmp_path / "range") == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 0], abs=1e-15)


def test_accumulate_plan_equals_its_output(tmp_path):
    ck = _one_hot_sequence(tmp_path / "ck")
    dry = accumulate(ck, decay=0.998, out=tmp_path / "ema", dtype="float64", dry_run=True)
    assert not (tmp_path / "ema").exists()
    coefficients = [t.coefficient for t in dry.plan.outputs[0].terms]
    accumulate(ck, decay=0.998, out=tmp_path / "ema", dtype="float64")
    assert _vector(tmp_path / "ema") == pytest.approx(coefficients, abs=1e-12)
    steps = ONE_HOT_STEPS
    closed = [0.998 ** (steps[-1] - t) * (1 if i == 0 else 1 - 0.998 ** (t - steps[i - 1]))
              for i, t in enumerate(steps)]
    assert coefficients == pytest.approx(closed, abs=1e-12)


def test_snapshot_scheme_reconstructs_any_sigma_rel(tmp_path):
    live = tmp_path / "live"
    full = _one_hot_sequence(tmp_path / "all")
    live.mkdir()
    snap = tmp_path / "snap"
    options = dict(sigma_rels=["0.05", "0.10"], snapshot_every=500, out=snap, dtype="float64")
    for batch in (ONE_HOT_STEPS[:4], ONE_HOT_STEPS[4:]):  # two cron runs; retention deletes the first batch
        for step in batch:
            shutil.copytree(full / f"step_{step}", live / f"step_{step}")
        accumulate(live, **options)
        for step in batch:
            shutil.rmtree(live / f"step_{step}")
    # the running power EMAs equal the closed form (incremental == closed form)
    for sigma in ("0.05", "0.10"):
        want = maths.power_coefficients(ONE_HOT_STEPS, maths.sigma_rel_to_gamma(float(sigma)))
        assert _vector(snap / f"sigma_rel_{sigma}") == pytest.approx(want, abs=1e-12)
    snapshots = find_snapshots([snap])
    assert sorted({s.step for s in snapshots}) == [700, 1000, 1600, 2000]
    # dry run: the exact JSON shape, snapshot inputs carry their sigma_rel
    result = CliRunner().invoke(app, ["posthoc", str(snap), "--sigma-rel", "0.07", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert list(plan) == ["outputs", "notes"] and len(plan["outputs"]) == 1
    output = plan["outputs"][0]
    assert list(output) == ["name", "sigma_rel", "gamma", "step", "terms", "warnings"]
    assert output["name"] == "sigma_rel_0.07" and output["step"] == 2000
    assert all(list(t) == ["path", "step", "sigma_rel", "coefficient"] for t in output["terms"])
    assert sum(t["coefficient"] for t in output["terms"]) == pytest.approx(1.0, abs=1e-12)
    # executing it: Σ_j x_j · (snapshot j's coefficient vector over the raw checkpoints)
    run = posthoc(snap, out=tmp_path / "post", sigma_rels=["0.07"], dtype="float64")
    want = [0.0] * len(ONE_HOT_STEPS)
    for term in run.plan.outputs[0].terms:
        gamma = maths.sigma_rel_to_gamma(term.sigma_rel)
        steps = [s for s in ONE_HOT_STEPS if s <= term.step]
        for i, c in enumerate(maths.power_coefficients(steps, gamma)):
            want[i] += term.coefficient * c
    assert _vector(run.outputs[0]) == pytest.approx(want, abs=1e-9)


def test_dry_run_json_of_raw_inputs_and_cli_errors(tmp_path):
    ck = _one_hot_sequence(tmp_path / "ck")
    runner = CliRunner()
    result = runner.invoke(app, ["posthoc", str(ck), "--sigma-rel", "0.1", "--dry-run", "--json"])
    output = json.loads(result.stdout)["outputs"][0]
    assert all(list(t) == ["path", "step", "coefficient"] for t in output["terms"])
    assert output["gamma"] == pytest.approx(6.9372, abs=1e-4)
    bad = runner.invoke(app, ["posthoc", str(ck), "--sigma-rel", "0.5", "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "--sigma-rel" in bad.stderr
    bad = runner.invoke(app, ["average", str(ck), "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "--last" in bad.stderr
    ok = runner.invoke(app, ["average", str(ck), "--last", "2", "--out", str(tmp_path / "avg"), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["paths"] == [str(tmp_path / "avg")]
    shown = runner.invoke(app, ["accumulate", str(ck), "--decay", "0.99", "--dry-run"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "Σc = 1" in shown.stdout and "█" in shown.stdout


def test_posthoc_on_a_real_fsdp_sequence(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp2", 3)
    result = posthoc(ckpts[0].parent, out=tmp_path / "out", sigma_rels=["0.15"])
    states = [full_load(c, tmp_path) for c in ckpts]
    coeffs = maths.power_coefficients(STEPS, maths.sigma_rel_to_gamma(0.15))
    with open_checkpoint(result.outputs[0]) as reader:
        for key, spec in reader.specs().items():
            got = reader.read(key, Box.full(spec.shape))
            if spec.is_float:
                want = sum(c * s[key].double() for c, s in zip(coeffs, states, strict=True))
                assert_close_relative(got, want)
            else:
                assert torch.equal(got, states[-1][key])


def test_posthoc_on_a_real_deepspeed_sequence(ds_run, zero_to_fp32, tmp_path):
    from tests.ds_fixtures import STEPS as DS_STEPS
    from tests.ds_fixtures import Config

    folder = ds_run(Config(2, 3, "fp32"))
    result = posthoc(folder, out=tmp_path / "out", sigma_rels=["0.2"])
    coeffs = maths.power_coefficients(DS_STEPS, maths.sigma_rel_to_gamma(0.2))
    states = [zero_to_fp32(folder, f"global_step{s}") for s in DS_STEPS]
    with open_checkpoint(result.outputs[0]) as reader:
        for key, value in states[-1].items():
            got = reader.read(key, Box.full(tuple(value.shape)))
            if not reader.specs()[key].is_float:
                assert torch.equal(got, value.to(got.dtype))  # integer buffers: the newest
                continue
            want = sum(c * s[key].double() for c, s in zip(coeffs, states, strict=True))
            assert_close_relative(got, want)


def test_exponential_profile_half_life_is_reported():
    assert ExponentialProfile(0.999).half_life == pytest.approx(692.8, abs=0.1)
