"""Per-tensor cost: checkpoints of many small tensors (a mixture-of-experts export's shape).

Three checkpoints of N fp32 tensors of 16 bytes each (keys like
``model.layers.3.mlp.experts.117.w1``), as safetensors folders and as DCP checkpoints. For each
N, ema-ckpt's commands beside their floor: **one Python process that loads the same
checkpoints with the format's own loader, folds them, and saves one result with the format's
own saver** (``safetensors.torch.load_file``/``save_file``; ``dcp.load``/``dcp.save``). The data is
nothing (3 MiB at 200k tensors); what grows is the cost per tensor, in time and in memory.

Usage: python benchmarks/bench_many_tensors.py [--counts 1000,10000,50000,200000] [--formats safetensors,dcp]
       [--repeat 1]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import EMA, PY, machine_description, measure_in_turn, table, with_baseline

_MAKE = """
import os, sys, warnings
import numpy as np
warnings.filterwarnings("ignore")
fmt, count, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
for step in (100, 200, 300):
    names = [f"layers.{i // 4000}.mlp.experts.{(i // 4) % 1000}.w{i % 4}" for i in range(count)]
    values = {n: rng.standard_normal(4).astype(np.float32) for n in names}
    folder = os.path.join(root, f"step_{step}")
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        os.makedirs(folder, exist_ok=True)
        save_file({"model." + n: v for n, v in values.items()}, os.path.join(folder, "model.safetensors"))
    else:
        import torch, torch.distributed.checkpoint as dcp
        dcp.save({"model": {n: torch.from_numpy(v) for n, v in values.items()}}, checkpoint_id=folder, no_dist=True)
"""

_FLOOR = """
import glob, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
fmt, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
folders = sorted(glob.glob(os.path.join(root, "step_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
ema = None
for folder in folders:
    if fmt == "safetensors":
        from safetensors.torch import load_file
        state = load_file(os.path.join(folder, "model.safetensors"))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        meta = FileSystemReader(folder).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                 if hasattr(m, "size")}
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    if ema is None:
        ema = {k: v.clone() for k, v in state.items()}
    else:
        for k, v in state.items():
            ema[k].lerp_(v, 0.1)
os.makedirs(out, exist_ok=True)
if fmt == "safetensors":
    from safetensors.torch import save_file
    save_file(ema, os.path.join(out, "model.safetensors"))
else:
    import torch.distributed.checkpoint as dcp
    dcp.save(ema, checkpoint_id=out, no_dist=True)
"""


def _data(root: Path, fmt: str, count: int) -> Path:
    folder = root / f"many-{fmt}-{count}"
    if not (folder / "step_300").exists():
        shutil.rmtree(folder, ignore_errors=True)
        import subprocess

        subprocess.run([PY, "-c", _MAKE, fmt, str(count), str(folder)], check=True)
    return folder


def case(root: Path, fmt: str, count: int, repeat: int) -> list[tuple[str, ...]]:
    data = _data(root, fmt, count)
    out = root / "bench-many-out"
    ema = out / "ema"
    runs = {
        "floor: load 3, fold, save 1": dict(cmd=[PY, "-c", _FLOOR, fmt, str(data), str(ema)]),
        "accumulate": dict(cmd=[EMA, "accumulate", str(data), "--decay", "0.9", "--out", str(ema), "--quiet"]),
        "inspect (newest)": dict(cmd=[EMA, "inspect", str(data / "step_300"), "--json"]),
        "posthoc σ_rel 0.1": dict(cmd=[EMA, "posthoc", str(data), "--sigma-rel", "0.1", "--out", str(out / "ph"),
                                       "--quiet"]),
    }
    results = measure_in_turn(with_baseline(runs), out, repeat)
    # verify and consolidate need an EMA to read: one made once, outside the timed rows
    shutil.rmtree(out, ignore_errors=True)
    import subprocess

    subprocess.run([EMA, "accumulate", str(data), "--decay", "0.9", "--out", str(ema), "--quiet"], check=True)
    after = measure_in_turn(with_baseline({
        "verify (the EMA)": dict(cmd=[EMA, "verify", str(ema), "--quiet"]),
        "consolidate (the EMA)": dict(cmd=[EMA, "consolidate", str(ema), "--out", str(out / "c.safetensors"),
                                           "--overwrite", "--quiet"]),
    }), out / "c.safetensors", repeat)
    shutil.rmtree(out, ignore_errors=True)
    floor = results["floor: load 3, fold, save 1"]
    rows = []
    for name, m in {**results, **after}.items():
        rows.append((fmt, f"{count:,}", name, f"{m.wall_median:.2f}", f"{m.wall_median / floor.wall_median:.2f}",
                     f"{m.rss_median:.0f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("bench-data"))
    parser.add_argument("--counts", default="1000,10000,50000,200000")
    parser.add_argument("--formats", default="safetensors,dcp")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"Machine: {machine_description()}; medians of {args.repeat} runs")
    rows: list[tuple[str, ...]] = []
    for fmt in args.formats.split(","):
        for count in (int(c) for c in args.counts.split(",")):
            new = case(args.root, fmt, count, args.repeat)
            rows.extend(new)
            print(table(new, ("format", "tensors", "command", "wall s", "× floor", "peak RSS MiB")), flush=True)
    print("\n### All\n")
    print(table(rows, ("format", "tensors", "command", "wall s", "× floor", "peak RSS MiB")))


if __name__ == "__main__":
    main()
