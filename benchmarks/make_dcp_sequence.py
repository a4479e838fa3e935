"""Generate a sequence of fp32 DCP checkpoints (~SIZE GiB each, 30+ tensors of mixed sizes).

Written with torch's own ``dcp.save`` (single process), as a model-only ``{"model": ...}``
state dict. Usage: python benchmarks/make_dcp_sequence.py OUT --size-gib 1 --count 4
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

# Mixed sizes, in MiB, summing to 1024 per GiB: a few large matrices, many medium, small ones.
LAYOUT_MIB = [128, 128, 96, 64, 64, 64, 48] + [32] * 8 + [16] * 8 + [4] * 8
SMALL = 16  # plus 16 tiny tensors (norms, biases) and one int64 counter


def shapes(size_gib: float) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for i, mib in enumerate(LAYOUT_MIB):
        numel = int(mib * size_gib * 2**20 / 4)
        cols = 1024
        out[f"layers.{i}.weight"] = (max(1, numel // cols), cols)
    for i in range(SMALL):
        out[f"norms.{i}.weight"] = (1024,)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--first-step", type=int, default=1000)
    parser.add_argument("--every", type=int, default=1000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    for n in range(args.count):
        step = args.first_step + n * args.every
        path = args.out / f"step_{step}"
        if (path / ".metadata").exists():
            continue
        model = {}
        for key, shape in shapes(args.size_gib).items():
            model[key] = torch.randn(shape, generator=g)
        model["steps_seen"] = torch.tensor(step, dtype=torch.int64)
        dcp.save({"model": model}, checkpoint_id=str(path), no_dist=True)
        del model
        print(path)


if __name__ == "__main__":
    main()
