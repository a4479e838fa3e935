import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ema_ckpt.errors import OptionError, UsageError
from ema_ckpt.maths import ExponentialProfile, fold_coefficients


def test_half_life_round_trip():
    p = ExponentialProfile.from_half_life(693.0)
    assert p.keep_factor(0, 693) == pytest.approx(0.5)
    assert p.half_life == pytest.approx(693.0)


def test_per_step_gap_and_per_checkpoint():
    p = ExponentialProfile(0.99)
    assert p.keep_factor(10, 30) == pytest.approx(0.99**20, rel=1e-14)
    q = ExponentialProfile(0.99, per_checkpoint=True)
    assert q.keep_factor(10, 30) == pytest.approx(0.99)


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.999, 0.9999])
@pytest.mark.parametrize(("a", "b"), [(0, 1), (0, 50), (3, 17), (100, 3000), (1, 20000)])
def test_warmup_closed_form_matches_the_per_step_product(beta, a, b):
    p = ExponentialProfile(beta, warmup=True)
    direct = sum(math.log(min(beta, (1 + n) / (10 + n))) for n in range(a + 1, b + 1))
    assert p.log_keep_factor(a, b) == pytest.approx(direct, rel=1e-10, abs=1e-12)


def test_update_weight_is_precise_near_one():
    p = ExponentialProfile(1 - 1e-9)
    assert p.update_weight(0, 1) == pytest.approx(1e-9, rel=1e-6)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30))
def test_fold_coefficients_sum_to_one(weights):
    weights = [1.0, *weights]
    assert math.fsum(fold_coefficients(weights)) == pytest.approx(1.0, abs=1e-12)


def test_fold_coefficients_equal_the_classic_formula():
    beta, steps = 0.97, [5, 9, 30, 31, 60]
    p = ExponentialProfile(beta)
    weights = [1.0] + [p.update_weight(a, b) for a, b in itertools.pairwise(steps)]
    coeffs = fold_coefficients(weights)
    T = steps[-1]
    for i, (c, t) in enumerate(zip(coeffs, steps, strict=False)):
        expected = beta ** (T - t) * (1 if i == 0 else 1 - beta ** (t - steps[i - 1]))
        assert c == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_bad_decay_is_refused(bad):
    with pytest.raises(OptionError, match=r"^decay must lie strictly between 0 and 1") as info:
        ExponentialProfile(bad)
    assert info.value.option == "decay"


def test_steps_must_increase():
    with pytest.raises(UsageError, match="steps must increase"):
        ExponentialProfile(0.9).keep_factor(5, 5)
