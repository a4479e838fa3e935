"""Merge weights from decay schedules: Megatron-LM ``weighted_merge``'s definitions, WSM's
theorem, a learning-rate CSV, and ``average --weights`` against a float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from ema_ckpt import average
from ema_ckpt.errors import OptionError
from ema_ckpt.maths import coefficients_from_decay, rate_schedule_weights, schedule_weights
from ema_ckpt.profile_specs import parse_weights


def _megatron_reference(style: str, n: int) -> list[float]:
    """Megatron-LM tools/checkpoint/weighted_merge.py (NVIDIA/Megatron-LM pull request 5114), as
    its docs define it: the schedule f sampled at j/N for j = 0…N−1; the last checkpoint takes
    f((N−1)/N), the middle ones the differences f(j/N) − f((j+1)/N), the first the rest."""
    f = {"linear": lambda x: 1 - x, "minus-sqrt": lambda x: 1 - math.sqrt(x)}[style]
    if n <= 1:
        return [1.0] * n
    decay = [f(j / n) for j in range(n)]
    coefficients = [0.0] * n
    coefficients[-1] = decay[-1]
    for j in range(1, n - 1):
        coefficients[j] = decay[j] - decay[j + 1]
    coefficients[0] = 1 - sum(coefficients)
    return coefficients


@given(st.sampled_from(["linear", "minus-sqrt"]), st.integers(1, 400))
def test_named_schedules_match_megatrons_weighted_merge(style, n):
    ours, theirs = schedule_weights(style, n), _megatron_reference(style, n)
    assert len(ours) == n and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-12
    assert math.fsum(ours) == pytest.approx(1.0, abs=1e-12)


def test_minus_sqrt_weighs_the_oldest_most_and_linear_is_the_mean():
    assert schedule_weights("linear", 5) == [0.2] * 5
    w = schedule_weights("minus-sqrt", 4)
    assert w == pytest.approx([0.5, math.sqrt(0.5) - 0.5, math.sqrt(0.75) - math.sqrt(0.5), 1 - math.sqrt(0.75)])
    assert w == sorted(w, reverse=True)
    cosine = schedule_weights("cosine", 6)
    assert math.fsum(cosine) == pytest.approx(1.0) and min(cosine) > 0


@given(st.lists(st.floats(0, 1), min_size=0, max_size=30))
def test_wsm_theorem_suffix_sums_are_the_decay(multipliers):
    w = sorted(multipliers, reverse=True)
    c = coefficients_from_decay(w)
    assert len(c) == len(w) + 1 and math.fsum(c) == pytest.approx(1.0, abs=1e-12)
    for i in range(1, len(c)):  # update i (between checkpoints i−1 and i) is scaled by Σ_{j≥i} cⱼ
        assert math.fsum(c[i:]) == pytest.approx(w[i - 1], abs=1e-12)


def test_a_learning_rate_schedule_becomes_step_aware_weights(tmp_path):
    # a linear decay from 1e-3 to 0 over steps 0..400 seen by checkpoints 0, 100, 200, 400
    steps = [0, 100, 200, 400]
    got = rate_schedule_weights(steps, [(0, 1e-3), (400, 0.0)])
    multipliers = [0.875, 0.625, 0.25]  # mean rate over each gap / peak
    assert got == pytest.approx(coefficients_from_decay(multipliers), abs=1e-15)
    csv = tmp_path / "lr.csv"
    csv.write_text("step,lr\n0,0.001\n400,0\n")
    assert parse_weights(str(csv)).coefficients(steps) == pytest.approx(got)
    # evenly spaced checkpoints and a decay to 0 at the newest: each gap takes its mean rate
    assert rate_schedule_weights([0, 1, 2, 3], [(0, 1.0), (3, 0.0)]) == pytest.approx(
        coefficients_from_decay([5 / 6, 3 / 6, 1 / 6]))


def test_bad_schedules_are_refused_in_one_line(tmp_path):
    for text in ("steep", "wsm:", str(tmp_path / "missing.csv")):
        with pytest.raises(OptionError) as err:
            parse_weights(text)
        assert err.value.option == "weights" and "\n" not in str(err.value)
    rising = tmp_path / "rising.csv"
    rising.write_text("0,0.1\n100,1.0\n")
    with pytest.raises(OptionError, match="must not increase"):
        parse_weights(str(rising)).coefficients([0, 50, 100])
    garbage = tmp_path / "garbage.csv"
    garbage.write_text("0,1\nten,0.5\n")
    with pytest.raises(OptionError, match="line 2"):
        parse_weights(str(garbage))


def test_average_with_weights_is_the_float64_weighted_sum(tmp_path):
    rng = np.random.default_rng(3)
    weights = {}
    for step in (10, 20, 30, 40, 50, 60):
        weights[step] = rng.standard_normal((5, 7)).astype(np.float32)
        (tmp_path / "ck" / f"step_{step}").mkdir(parents=True)
        save_file({"w": weights[step]}, str(tmp_path / "ck" / f"step_{step}" / "model.safetensors"))
    for spec, coefficients in (("minus-sqrt", schedule_weights("minus-sqrt", 4)),
                               ("cosine", schedule_weights("cosine", 4)), (None, [0.25] * 4)):
        plan = average(tmp_path / "ck", out=tmp_path / "x", last=4, weights=spec, dry_run=True)
        assert [t.coefficient for t in plan.outputs[0].terms] == coefficients
        result = average(tmp_path / "ck", out=tmp_path / f"avg-{spec}", last=4, weights=spec, dtype="float64")
        got = load_file(str(result.outputs[0] / "model.safetensors"))["w"]
        want = sum(c * weights[s].astype(np.float64) for c, s in zip(coefficients, (30, 40, 50, 60), strict=True))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    spaced = average(tmp_path / "ck", out=tmp_path / "x", last=3, every=2, dry_run=True)
    assert [t.step for t in spaced.outputs[0].terms] == [20, 40, 60]
