"""Mixture-of-experts checkpoints: a DeepSeek-V3-style model saved by transformers' own
``save_pretrained`` (grouped expert weights, shared experts, the router's
``e_score_correction_bias``), averaged against float64 and loaded back by ``from_pretrained``.
The router's load-balancing bias is not a weight: it is taken from the newest checkpoint
unless ``average_buffers``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ema_ckpt import accumulate, average, consolidate
from ema_ckpt.maths import ExponentialProfile
from ema_ckpt.selection import is_non_weight_buffer

transformers = pytest.importorskip("transformers")
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
STEPS = [10, 20, 30]


def _config():
    return transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """Three checkpoints of one model: weights moved by a step each time, the router's bias set
    as aux-loss-free balancing sets it (by counting, not by gradients)."""
    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(_config())
    states = []
    for i, step in enumerate(STEPS):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
            model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.arange(8.0) * (i + 1))
        model.save_pretrained(root / f"checkpoint-{step}")
        states.append(load_file(root / f"checkpoint-{step}" / "model.safetensors"))
    return root, states


def _reference(states, weights):
    return {k: sum(w * s[k].double() for w, s in zip(weights, states, strict=True)) for k in states[0]}


def test_an_moe_checkpoints_router_bias_is_the_newest_and_the_rest_averaged(moe_run, tmp_path):
    root, states = moe_run
    assert BIAS in states[0] and "model.layers.1.mlp.experts.7.gate_proj.weight" in states[0]  # per-expert keys on disk
    assert [k for k in states[0] if is_non_weight_buffer(k)] == [BIAS]
    result = average(root, out=tmp_path / "avg", last=3, format="hf", dtype="float64")
    got = {k: v for f in sorted(result.outputs[0].glob("*.safetensors")) for k, v in load_file(f).items()}
    want = _reference(states, [1 / 3] * 3)
    for key, value in want.items():
        if key == BIAS:
            assert torch.equal(got[key], states[-1][key])  # taken, not averaged (its own float32)
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12)
    # transformers loads the average back, config carried from the newest checkpoint
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(result.outputs[0])
    assert torch.equal(loaded.model.layers[1].mlp.gate.e_score_correction_bias, states[-1][BIAS])
    averaged = average(root, out=tmp_path / "avg-all", last=3, format="safetensors", dtype="float64",
                       average_buffers=True)
    both = load_file(averaged.outputs[0] / "model.safetensors")
    torch.testing.assert_close(both[BIAS], want[BIAS], rtol=1e-12, atol=1e-12)


def test_accumulate_keeps_the_newest_router_bias_across_runs(moe_run, tmp_path):
    root, states = moe_run
    keep = ExponentialProfile(0.9)
    first = accumulate([root / f"checkpoint-{s}" for s in STEPS[:2]], decay=0.9, out=tmp_path / "ema")
    assert first.step == 20
    accumulate(root, decay=0.9, out=tmp_path / "ema")
    consolidate(tmp_path / "ema", tmp_path / "ema.safetensors")
    got = load_file(tmp_path / "ema.safetensors")
    b1, b2 = keep.keep_factor(10, 20), keep.keep_factor(20, 30)
    weights = [b1 * b2, (1 - b1) * b2, 1 - b2]
    want = _reference(states, weights)
    assert torch.equal(got[BIAS], states[-1][BIAS])
    for key, value in want.items():
        if key != BIAS:
            torch.testing.assert_close(got[key].double(), value, rtol=1e-6, atol=1e-7)


def test_changing_the_buffer_rule_of_an_ema_is_refused_with_the_remedy(moe_run, tmp_path):
    from ema_ckpt.errors import ManifestMismatchError

    root, _states = moe_run
    accumulate([root / "checkpoint-10", root / "checkpoint-20"], decay=0.9, out=tmp_path / "ema")
    with pytest.raises(ManifestMismatchError) as err:
        accumulate(root, decay=0.9, out=tmp_path / "ema", average_buffers=True)
    assert err.value.exit_code == 5 and "took from the newest checkpoint" in str(err.value)
    assert "drop average_buffers" in str(err.value)
    result = accumulate(root, decay=0.9, out=tmp_path / "ema", average_buffers=True, restart=True)
    assert result.step == 30
