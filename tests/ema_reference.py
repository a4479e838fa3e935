"""The independent oracle: a float64 EMA from full loads by torch's own ``dcp_to_torch_save``."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def full_load(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, flattened to ``model.<fqn>`` keys, via torch's tools."""
    target = tmp / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(target))
    state = torch.load(target, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", state)
    return flat


def reference_ema(states: list[dict[str, torch.Tensor]], steps: list[int], keep) -> dict[str, torch.Tensor]:
    """ema₁ = θ₁, emaₖ = bₖ·emaₖ₋₁ + (1 − bₖ)·θₖ in float64, bₖ = keep(sₖ₋₁, sₖ); ints from the newest."""
    ema = {k: v.double() for k, v in states[0].items() if v.is_floating_point()}
    for (prev, step), state in zip(itertools.pairwise(steps), states[1:], strict=True):
        b = keep(prev, step)
        for k in ema:
            ema[k] = b * ema[k] + (1 - b) * state[k].double()
    for k, v in states[-1].items():
        if not v.is_floating_point():
            ema[k] = v
    return ema


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-6) -> None:
    """|got − want| ≤ rel·max|want| elementwise (relative to the tensor's scale)."""
    if not want.is_floating_point():
        assert torch.equal(got, want)
        return
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert err <= rel * max(scale, 1e-30), f"max error {err:.3g} vs scale {scale:.3g}"


def assert_ema_matches(out, want: dict[str, torch.Tensor], tmp: Path) -> dict[str, torch.Tensor]:
    """The EMA at ``out``, consolidated by ema-ckpt into ``tmp/ema.safetensors``, has exactly
    ``want``'s keys and matches each (:func:`assert_close_relative`); returns what it holds."""
    from safetensors.torch import load_file

    import ema_ckpt

    converted = tmp / "ema.safetensors"
    ema_ckpt.consolidate(out, converted, overwrite=True)
    got = load_file(converted)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key].double(), value)
    return got
